"""A real FUSE file system whose storage fails with EIO where a test says: failing storage
under a checkpoint, on a machine without device-mapper (dm-flakey) or fault injection.

:func:`eio_mount` mounts, with raw mount(2) on ``/dev/fuse``, a read-only mirror of a real
backing directory, served by a small FUSE server in a forked child process (so the test's
own file system calls never wait on its own GIL). Every read is answered from the backing
file, except reads of the file :meth:`EioMount.fail` names that reach at or past its offset:
those are answered EIO (a bad sector at that offset), until :meth:`EioMount.heal`. Files are
opened ``FOPEN_DIRECT_IO`` and names and attributes are not cached, so every read and stat
reaches the server: the page cache never hides a fault, and what the test writes into the
backing directory shows in the mount at once.

Storage that stops answering altogether (a dead NFS or FUSE server: every stat, readdir and
open on the mount then waits) is :meth:`EioMount.hang`: the server is stopped (SIGSTOP), so the
kernel queues each new request and nobody takes it; :meth:`EioMount.heal` lets it answer again
(SIGCONT), the queued requests first. A process waiting on a queued request is still killable.

Storage that answers with other bytes than before (a file replaced between two opens, flaky
network storage) is :meth:`EioMount.swap`: from a chosen open of a file on, its reads are
answered from another backing file (of the same size: the mount still reports the first one's
attributes), so a reader that opens the file twice reads two different contents.

Only what a reader needs is implemented (the protocol is include/uapi/linux/fuse.h, 7.38):
INIT, LOOKUP, FORGET, GETATTR, OPEN, READ, FLUSH, RELEASE, OPENDIR, READDIR, RELEASEDIR,
STATFS, DESTROY; anything else is answered ENOSYS (the kernel then treats FLUSH, ACCESS,
xattrs as unsupported), and the mount is read-only (MS_RDONLY: writes get EROFS). With
``writable=True`` it is a read-write mirror instead (shared storage an agent writes to, as the
archive): MKDIR, CREATE, WRITE, SETATTR, RENAME, UNLINK, RMDIR, FSYNC and FSYNCDIR are done on
the backing directory as asked (the server is root), and :meth:`EioMount.hang_at` stops the
server at a chosen point of a writer's work: the first MKDIR or CREATE of a name that starts
with a given prefix waits, with everything after it, until :meth:`EioMount.heal` (a writer
caught mid-copy, not before it began).

Usage::

    with eio_mount(backing) as fs:           # fs.path: /tmp/lm-t-eio-<hex>
        fs.fail("src/ckpt-40/state.bin", 300_000)
        ...                                  # reads at or past byte 300000 of it: EIO
        fs.heal()
        fs.swap("src/ckpt-40/state.bin", "other.bin", after_opens=1)
        ...                                  # its 2nd and later opens read other.bin's bytes
        fs.hang()
        ...                                  # every call on the mount waits
        fs.heal()                            # ... and is answered now

    with eio_mount(backing, writable=True) as fs:
        fs.hang_at(".tmp-")                  # the first mkdir/create of .tmp-* waits, and all after
        ...
        fs.heal()                            # ... answered now, that mkdir first

The mount is detached (umount2 MNT_DETACH) and the server killed on exit, also when the
test fails; whatever still waits on it then gets ENOTCONN.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import secrets
import shutil
import signal
import stat
import struct
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

MS_RDONLY, MS_NOSUID, MS_NODEV = 1, 2, 4
MNT_DETACH = 2

# opcodes (enum fuse_opcode)
LOOKUP, FORGET, GETATTR, OPEN, READ, STATFS, RELEASE, FLUSH = 1, 2, 3, 14, 15, 17, 18, 25
INIT, OPENDIR, READDIR, RELEASEDIR, INTERRUPT, DESTROY, BATCH_FORGET = 26, 27, 28, 29, 36, 38, 42
# a writable mirror's
SETATTR, MKDIR, UNLINK, RMDIR, RENAME, WRITE, FSYNC, FSYNCDIR, CREATE = 4, 9, 10, 11, 12, 16, 20, 30, 35
FUSE_BIG_WRITES = 1 << 5  # fuse_init_out flags: writes up to max_write, not one page each
NO_REPLY = {FORGET, BATCH_FORGET, INTERRUPT}
FOPEN_DIRECT_IO = 1 << 0
KERNEL_MAJOR, KERNEL_MINOR = 7, 38

# struct fuse_in_header: len, opcode, unique, nodeid, uid, gid, pid, total_extlen, padding
IN_HEADER = struct.Struct("<IIQQIIIHH")
# struct fuse_out_header: len, error (-errno), unique
OUT_HEADER = struct.Struct("<IiQ")
# struct fuse_init_in: major, minor, max_readahead, flags (flags2 and unused follow)
INIT_IN = struct.Struct("<IIII")
# struct fuse_init_out: major, minor, max_readahead, flags, max_background, congestion_threshold,
# max_write, time_gran, max_pages, map_alignment, flags2, unused[7]
INIT_OUT = struct.Struct("<IIIIHHIIHHI28x")
# struct fuse_attr: ino, size, blocks, atime, mtime, ctime, atimensec, mtimensec, ctimensec,
# mode, nlink, uid, gid, rdev, blksize, flags
ATTR = struct.Struct("<QQQQQQIIIIIIIIII")
# struct fuse_attr_out: attr_valid, attr_valid_nsec, dummy, attr
ATTR_OUT = struct.Struct("<QII")
# struct fuse_entry_out: nodeid, generation, entry_valid, attr_valid, entry_valid_nsec,
# attr_valid_nsec, attr
ENTRY_OUT = struct.Struct("<QQQQII")
# struct fuse_open_out: fh, open_flags, padding
OPEN_OUT = struct.Struct("<QII")
# struct fuse_read_in: fh, offset, size, read_flags, lock_owner, flags, padding
READ_IN = struct.Struct("<QQIIQII")
# struct fuse_release_in: fh, flags, release_flags, lock_owner
RELEASE_IN = struct.Struct("<QIIQ")
# struct fuse_dirent: ino, off (of the next entry), namelen, type; then the name, padded to 8
DIRENT = struct.Struct("<QQII")
# struct fuse_open_in: flags, open_flags
OPEN_IN = struct.Struct("<II")
# struct fuse_mkdir_in: mode, umask; struct fuse_create_in: flags, mode, umask, open_flags
MKDIR_IN = struct.Struct("<II")
CREATE_IN = struct.Struct("<IIII")
# struct fuse_write_in: fh, offset, size, write_flags, lock_owner, flags, padding; fuse_write_out: size, padding
WRITE_IN = struct.Struct("<QQIIQII")
WRITE_OUT = struct.Struct("<II")
# struct fuse_setattr_in: valid, padding, fh, size, lock_owner, atime, mtime, ctime, atimensec,
# mtimensec, ctimensec, mode, unused4, uid, gid, unused5
SETATTR_IN = struct.Struct("<IIQQQQQQIIIIIIII")
FATTR_MODE, FATTR_UID, FATTR_GID, FATTR_SIZE, FATTR_ATIME, FATTR_MTIME = 1, 2, 4, 8, 16, 32
FATTR_ATIME_NOW, FATTR_MTIME_NOW = 128, 256
# struct fuse_rename_in: newdir (the old and the new name follow, NUL-terminated)
RENAME_IN = struct.Struct("<Q")
# struct fuse_fsync_in: fh, fsync_flags, padding
FSYNC_IN = struct.Struct("<QII")
# struct fuse_kstatfs: blocks, bfree, bavail, files, ffree, bsize, namelen, frsize, padding, spare[6]
KSTATFS = struct.Struct("<QQQQQIIII24x")

# The shared page between the test and the server: fail offset (-1: healthy), EIO answers,
# READs served, the failing file's path relative to the mount (NUL-padded).
CTL = struct.Struct("<qQQ")
NAME_AT, NAME_MAX = CTL.size, 1024
# Then the swap: opens of the swapped file that still read its own bytes (-1: no swap), opens of
# it so far; its path and the replacement's (both relative, NUL-padded).
SWAP = struct.Struct("<qQ")
SWAP_AT = NAME_AT + NAME_MAX
SWAP_NAME_AT = SWAP_AT + SWAP.size
SWAP_WITH_AT = SWAP_NAME_AT + NAME_MAX
# Then the hang at a writer's step (hang_at): 0 off, 1 armed, 2 the server stopped itself there;
# the name prefix (NUL-padded).
HANG_AT = SWAP_WITH_AT + NAME_MAX
HANG = struct.Struct("<q")
HANG_NAME_AT = HANG_AT + HANG.size
CTL_SIZE = HANG_NAME_AT + NAME_MAX


class EioMount:
    """A mounted mirror (``path``) of ``backing`` whose reads fail where :meth:`fail` says."""

    def __init__(self, path: Path, backing: Path, ctl: mmap.mmap, server: int) -> None:
        self.path = path
        self.backing = backing
        self._ctl = ctl
        self._server = server  # the serving child's pid
        self.hung = False

    def fail(self, rel: str, offset: int) -> None:
        """From now on, a read of ``rel`` (relative to the mount) that reaches byte ``offset``
        or past it is answered EIO."""
        raw = rel.encode()
        if len(raw) >= NAME_MAX or offset < 0:
            raise ValueError(f"fail({rel!r}, {offset}): a path under {NAME_MAX} bytes and an offset >= 0")
        self._ctl[NAME_AT:NAME_AT + NAME_MAX] = raw.ljust(NAME_MAX, b"\0")
        self._ctl[:8] = struct.pack("<q", offset)

    def heal(self) -> None:
        """Every read is answered from the backing file again, and a hung server (:meth:`hang`,
        :meth:`hang_at`) answers again, what waited first."""
        self._ctl[:8] = struct.pack("<q", -1)
        armed = HANG.unpack_from(self._ctl, HANG_AT)[0]
        HANG.pack_into(self._ctl, HANG_AT, 0)
        if self.hung or armed:
            os.kill(self._server, signal.SIGCONT)  # (a server that never stopped ignores it)
            self.hung = False

    def hang_at(self, prefix: str) -> None:
        """From the first MKDIR or CREATE of a name (its last component) starting with
        ``prefix`` on, nothing on the mount is answered, that request included (the server
        stops itself before it does it), until :meth:`heal`: storage that hangs in the middle of
        a writer's work. A writable mount's (``eio_mount(writable=True)``)."""
        raw = prefix.encode()
        if not raw or len(raw) >= NAME_MAX:
            raise ValueError(f"hang_at({prefix!r}): a name prefix of 1 to {NAME_MAX - 1} bytes")
        self._ctl[HANG_NAME_AT:HANG_NAME_AT + NAME_MAX] = raw.ljust(NAME_MAX, b"\0")
        HANG.pack_into(self._ctl, HANG_AT, 1)

    @property
    def hung_at(self) -> bool:
        """Whether the server stopped itself where :meth:`hang_at` said (and waits for :meth:`heal`)."""
        return bool(HANG.unpack_from(self._ctl, HANG_AT)[0] == 2)

    def hang(self) -> None:
        """From now on nothing on the mount is answered (the server is stopped: requests queue
        in the kernel and wait, as on a dead NFS or FUSE server), until :meth:`heal`."""
        os.kill(self._server, signal.SIGSTOP)
        self.hung = True

    def swap(self, rel: str, replacement: str, after_opens: int) -> None:
        """From now on, the first ``after_opens`` opens of ``rel`` read its own bytes and every later
        open reads ``replacement``'s (both relative to the mount; the replacement should have
        the same size, as the mount reports ``rel``'s attributes)."""
        raw, with_ = rel.encode(), replacement.encode()
        if len(raw) >= NAME_MAX or len(with_) >= NAME_MAX or after_opens < 0:
            raise ValueError(f"swap({rel!r}, {replacement!r}, {after_opens}): paths under {NAME_MAX} bytes "
                             "and after_opens >= 0")
        self._ctl[SWAP_NAME_AT:SWAP_NAME_AT + NAME_MAX] = raw.ljust(NAME_MAX, b"\0")
        self._ctl[SWAP_WITH_AT:SWAP_WITH_AT + NAME_MAX] = with_.ljust(NAME_MAX, b"\0")
        SWAP.pack_into(self._ctl, SWAP_AT, after_opens, 0)

    @property
    def opens_of_swapped(self) -> int:
        """How many times the file :meth:`swap` names was opened since."""
        return int(SWAP.unpack_from(self._ctl, SWAP_AT)[1])

    @property
    def eio_count(self) -> int:
        """How many reads were answered EIO so far."""
        return int(CTL.unpack_from(self._ctl)[1])

    @property
    def reads(self) -> int:
        """How many READ requests the server answered (EIO included)."""
        return int(CTL.unpack_from(self._ctl)[2])


def fuse_waiters(pid: int) -> list[int]:
    """The threads of process ``pid`` that wait for a FUSE server's answer now (their wait
    channel is the kernel's ``request_wait_answer``): on a hung mount (:meth:`EioMount.hang`),
    how many of its threads it holds."""
    out = []
    for t in Path(f"/proc/{pid}/task").iterdir():
        with contextlib.suppress(OSError):
            if (t / "wchan").read_text() == "request_wait_answer":
                out.append(int(t.name))
    return out


def _attr(st: os.stat_result) -> bytes:
    return ATTR.pack(st.st_ino, st.st_size, st.st_blocks, int(st.st_atime), int(st.st_mtime), int(st.st_ctime),
                     st.st_atime_ns % 10**9, st.st_mtime_ns % 10**9, st.st_ctime_ns % 10**9, st.st_mode, st.st_nlink,
                     st.st_uid, st.st_gid, st.st_rdev, 4096, 0)


class _Server:
    """The FUSE server (runs in the child): node ids are paths relative to the backing root."""

    def __init__(self, fd: int, backing: Path, ctl: mmap.mmap, writable: bool = False) -> None:
        self.fd, self.backing, self.ctl, self.writable = fd, backing, ctl, writable
        self.paths: dict[int, str] = {1: ""}
        self.ids: dict[str, int] = {"": 1}
        self.files: dict[int, tuple[int, str]] = {}  # fh -> (backing fd, relative path)
        self.next_fh = 1

    def node(self, rel: str) -> int:
        if rel not in self.ids:
            # a new id for a new name: one removed or renamed away may still be in the kernel's hands
            self.ids[rel] = max(self.paths) + 1
            self.paths[self.ids[rel]] = rel
        return self.ids[rel]

    def entry(self, rel: str) -> bytes:
        """A fuse_entry_out for ``rel`` (nothing cached: every lookup reaches the server)."""
        return ENTRY_OUT.pack(self.node(rel), 0, 0, 0, 0, 0) + _attr(os.lstat(self.backing / rel))

    def child(self, nodeid: int, arg: bytes) -> tuple[str, bytes]:
        """(the relative path of the name at the start of ``arg`` in directory ``nodeid``, the rest
        after its NUL)."""
        name, rest = arg.split(b"\0", 1)
        return f"{self.paths[nodeid]}/{name.decode()}".lstrip("/"), rest

    def forget_tree(self, rel: str) -> None:
        """Names at or under ``rel`` are gone (removed, or replaced by a rename): new ids next time."""
        for r in [r for r in self.ids if r == rel or r.startswith(rel + "/")]:
            del self.ids[r]

    def maybe_hang(self, name: str) -> None:
        """hang_at: the first MKDIR/CREATE of a name with the armed prefix stops the server here."""
        if HANG.unpack_from(self.ctl, HANG_AT)[0] != 1:
            return
        prefix = bytes(self.ctl[HANG_NAME_AT:HANG_NAME_AT + NAME_MAX]).rstrip(b"\0").decode()
        if name.startswith(prefix):
            HANG.pack_into(self.ctl, HANG_AT, 2)
            os.kill(os.getpid(), signal.SIGSTOP)  # until heal(): then this request is done, and the rest

    def real(self, nodeid: int) -> Path:
        return self.backing / self.paths[nodeid]

    def reply(self, unique: int, body: bytes = b"", err: int = 0) -> None:
        try:
            os.write(self.fd, OUT_HEADER.pack(OUT_HEADER.size + (0 if err else len(body)), -err, unique)
                     + (b"" if err else body))
        except OSError as e:  # ENOENT: the request was interrupted meanwhile
            if e.errno != errno.ENOENT:
                raise

    def serve(self) -> None:
        while True:
            try:
                req = os.read(self.fd, (1 << 20) + 4096)
            except OSError as e:
                if e.errno == errno.EINTR:
                    continue
                return  # ENODEV: unmounted or aborted
            _len, op, unique, nodeid, *_ = IN_HEADER.unpack_from(req)
            arg = req[IN_HEADER.size:]
            try:
                body = self.handle(op, nodeid, arg)
            except OSError as e:
                if op not in NO_REPLY:
                    self.reply(unique, err=e.errno or errno.EIO)
                continue
            if op == DESTROY:
                self.reply(unique)
                return
            if op not in NO_REPLY:
                self.reply(unique, body)

    def handle(self, op: int, nodeid: int, arg: bytes) -> bytes:
        if op == INIT:
            major, minor, readahead, _flags = INIT_IN.unpack_from(arg)
            return INIT_OUT.pack(KERNEL_MAJOR, min(minor, KERNEL_MINOR), readahead,
                                 FUSE_BIG_WRITES if self.writable else 0, 16, 12, 128 << 10, 1, 0, 0, 0)
        if op in NO_REPLY:
            return b""
        if op == LOOKUP:
            name = arg.split(b"\0", 1)[0].decode()
            rel = f"{self.paths[nodeid]}/{name}".lstrip("/")
            st = os.lstat(self.backing / rel)
            return ENTRY_OUT.pack(self.node(rel), 0, 0, 0, 0, 0) + _attr(st)
        if op == GETATTR:
            return ATTR_OUT.pack(0, 0, 0) + _attr(os.lstat(self.real(nodeid)))
        if op in (OPEN, OPENDIR):
            if op == OPEN:
                real = self.real(nodeid)
                after, opens = SWAP.unpack_from(self.ctl, SWAP_AT)
                swapped = bytes(self.ctl[SWAP_NAME_AT:SWAP_NAME_AT + NAME_MAX]).rstrip(b"\0").decode()
                if after >= 0 and self.paths[nodeid] == swapped:
                    SWAP.pack_into(self.ctl, SWAP_AT, after, opens + 1)
                    if opens + 1 > after:
                        real = self.backing / bytes(self.ctl[SWAP_WITH_AT:SWAP_WITH_AT + NAME_MAX]).rstrip(b"\0").decode()
                access = OPEN_IN.unpack_from(arg)[0] & (os.O_ACCMODE | os.O_APPEND) if self.writable else os.O_RDONLY
                fd = os.open(real, access | os.O_NOFOLLOW | os.O_CLOEXEC)
                self.files[self.next_fh] = (fd, self.paths[nodeid])
            self.next_fh += 1
            return OPEN_OUT.pack(self.next_fh - 1, FOPEN_DIRECT_IO if op == OPEN else 0, 0)
        if op == READ:
            fh, off, size, *_ = READ_IN.unpack_from(arg)
            fd, rel = self.files[fh]
            fail_at, eios, reads = CTL.unpack_from(self.ctl)
            name = bytes(self.ctl[NAME_AT:NAME_AT + NAME_MAX]).rstrip(b"\0").decode()
            CTL.pack_into(self.ctl, 0, fail_at, eios, reads + 1)
            if fail_at >= 0 and rel == name and off + size > fail_at:
                CTL.pack_into(self.ctl, 0, fail_at, eios + 1, reads + 1)
                raise OSError(errno.EIO, "injected")
            return os.pread(fd, size, off)
        if op == READDIR:
            _fh, off, size, *_ = READ_IN.unpack_from(arg)
            d = self.real(nodeid)
            names = [".", ".."] + sorted(os.listdir(d))
            out = b""
            for k, name in enumerate(names[off:], start=off + 1):
                raw = name.encode()
                ino = os.lstat(d / name).st_ino if name not in (".", "..") else 1
                mode = os.lstat(d / name).st_mode if name not in (".", "..") else stat.S_IFDIR
                ent = DIRENT.pack(ino, k, len(raw), stat.S_IFMT(mode) >> 12) + raw
                ent += b"\0" * (-len(ent) % 8)
                if len(out) + len(ent) > size:
                    break
                out += ent
            return out
        if op == RELEASE:
            fh = RELEASE_IN.unpack_from(arg)[0]
            fd, _rel = self.files.pop(fh, (-1, ""))
            if fd >= 0:
                os.close(fd)
            return b""
        if op in (FLUSH, RELEASEDIR, DESTROY):
            return b""
        if op == STATFS:
            sv = os.statvfs(self.backing)
            return KSTATFS.pack(sv.f_blocks, sv.f_bfree, sv.f_bavail, sv.f_files, sv.f_ffree, sv.f_bsize,
                                sv.f_namemax, sv.f_frsize, 0)
        if self.writable and op in (SETATTR, MKDIR, UNLINK, RMDIR, RENAME, WRITE, FSYNC, FSYNCDIR, CREATE):
            return self.write_op(op, nodeid, arg)
        raise OSError(errno.ENOSYS, "not implemented")

    def write_op(self, op: int, nodeid: int, arg: bytes) -> bytes:
        """A writable mirror's change, done on the backing directory as asked."""
        if op == MKDIR:
            mode, umask = MKDIR_IN.unpack_from(arg)
            rel, _ = self.child(nodeid, arg[MKDIR_IN.size:])
            self.maybe_hang(rel.rsplit("/", 1)[-1])
            os.mkdir(self.backing / rel, mode & ~umask & 0o7777)
            return self.entry(rel)
        if op == CREATE:
            flags, mode, umask, _ = CREATE_IN.unpack_from(arg)
            rel, _ = self.child(nodeid, arg[CREATE_IN.size:])
            self.maybe_hang(rel.rsplit("/", 1)[-1])
            fd = os.open(self.backing / rel, (flags & ~os.O_CLOEXEC) | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC,
                         mode & ~umask & 0o7777)
            self.files[self.next_fh] = (fd, rel)
            self.next_fh += 1
            return self.entry(rel) + OPEN_OUT.pack(self.next_fh - 1, FOPEN_DIRECT_IO, 0)
        if op == WRITE:
            fh, off, size, *_ = WRITE_IN.unpack_from(arg)
            return WRITE_OUT.pack(os.pwrite(self.files[fh][0], arg[WRITE_IN.size:WRITE_IN.size + size], off), 0)
        if op == SETATTR:
            (valid, _, _fh, size, _, atime, mtime, _, atimens, mtimens, _, mode, _, uid, gid,
             _) = SETATTR_IN.unpack_from(arg)
            real = self.real(nodeid)
            if valid & FATTR_MODE:
                os.chmod(real, mode & 0o7777)
            if valid & (FATTR_UID | FATTR_GID):
                os.lchown(real, uid if valid & FATTR_UID else -1, gid if valid & FATTR_GID else -1)
            if valid & FATTR_SIZE:
                os.truncate(real, size)
            if valid & (FATTR_ATIME | FATTR_MTIME):
                st = os.lstat(real)
                now = time.time_ns()
                a = (now if valid & FATTR_ATIME_NOW else atime * 10**9 + atimens) if valid & FATTR_ATIME else st.st_atime_ns
                m = (now if valid & FATTR_MTIME_NOW else mtime * 10**9 + mtimens) if valid & FATTR_MTIME else st.st_mtime_ns
                os.utime(real, ns=(a, m), follow_symlinks=False)
            return ATTR_OUT.pack(0, 0, 0) + _attr(os.lstat(real))
        if op in (UNLINK, RMDIR):
            rel, _ = self.child(nodeid, arg)
            (os.unlink if op == UNLINK else os.rmdir)(self.backing / rel)
            self.forget_tree(rel)
            return b""
        if op == RENAME:
            newdir = RENAME_IN.unpack_from(arg)[0]
            old, rest = self.child(nodeid, arg[RENAME_IN.size:])
            new, _ = self.child(newdir, rest)
            os.rename(self.backing / old, self.backing / new)
            self.forget_tree(new)  # what the rename replaced
            for r in [r for r in self.ids if r == old or r.startswith(old + "/")]:
                i = self.ids.pop(r)
                self.ids[new + r[len(old):]] = i
                self.paths[i] = new + r[len(old):]
            return b""
        if op == FSYNC:
            fh = FSYNC_IN.unpack_from(arg)[0]
            if fh in self.files:
                os.fsync(self.files[fh][0])
            return b""
        return b""  # FSYNCDIR: the backing directory's entries are written as they are made


@contextlib.contextmanager
def eio_mount(backing: Path, writable: bool = False) -> Iterator[EioMount]:
    """Mounts a read-only mirror of ``backing`` (``writable``: a read-write one) at
    /tmp/lm-t-eio-<hex>, served by a forked child; yields its :class:`EioMount`. Skips when the
    kernel has no /dev/fuse."""
    if not Path("/dev/fuse").exists():
        pytest.skip("no /dev/fuse on this kernel")
    mnt = Path(f"/tmp/lm-t-eio-{secrets.token_hex(4)}")
    mnt.mkdir(mode=0o755)
    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    ctl = mmap.mmap(-1, CTL_SIZE)  # MAP_SHARED | MAP_ANONYMOUS: shared with the child
    CTL.pack_into(ctl, 0, -1, 0, 0)
    SWAP.pack_into(ctl, SWAP_AT, -1, 0)
    HANG.pack_into(ctl, HANG_AT, 0)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the server: mounts, says so, serves until unmounted or killed
        code = 1
        try:
            os.close(r)
            fd = os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
            opts = f"fd={fd},rootmode=40000,user_id=0,group_id=0,allow_other".encode()
            flags = (0 if writable else MS_RDONLY) | MS_NOSUID | MS_NODEV
            if libc.mount(b"lm-t-eio", str(mnt).encode(), b"fuse.lm-t-eio", flags, opts) != 0:
                err = ctypes.get_errno()
                os.write(w, f"mount fuse on {mnt}: {os.strerror(err)}".encode())
                os._exit(1)
            os.write(w, b"ok")
            os.close(w)
            _Server(fd, backing, ctl, writable).serve()
            code = 0
        except BaseException as e:  # noqa: BLE001 - the child must never return into pytest
            print(f"fuserig server: {e!r}", file=sys.stderr)
        finally:
            os._exit(code)
    os.close(w)
    try:
        said = os.read(r, 4096)
    finally:
        os.close(r)
    try:
        if said != b"ok":
            raise OSError(f"fuserig: {said.decode() or 'the server died before mounting'}")
        yield EioMount(mnt, backing, ctl, pid)
    finally:
        libc.umount2(str(mnt).encode(), MNT_DETACH)
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)  # its /dev/fuse fd closes: the connection is aborted (stopped or not)
        os.waitpid(pid, 0)
        if not os.path.ismount(mnt):  # what a writer that outlived the mount put in the bare directory goes too
            shutil.rmtree(mnt, ignore_errors=True)
        ctl.close()
