"""libbpf from Python through cffi (ABI mode on the distro's ``libbpf.so.1``).

No C compiler and no kernel headers are needed at run time: the CO-RE objects under
``agent/laminar/bpf/objects/`` are built once by clang (``make bpf``) and relocated by libbpf
against the running kernel's BTF when loaded.

Load an object, pinning its ``LIBBPF_PIN_BY_NAME`` maps under a directory of your choice (an
existing compatible pin is reattached, which is how a restarted agent keeps its state)::

    from laminar.bpf.libbpf import BpfObject, BpfMap, RingBuffer, object_path

    obj = BpfObject.open(object_path("netguard"), pin_root="/sys/fs/bpf/laminar")
    obj.load()
    jobs = obj.map("lm_jobs")
    jobs.update(cgroup_id, bytes(lm_job))        # key: int, bytes or a ctypes object
    raw = jobs.lookup(cgroup_id)                  # bytes, or None when absent
    for key, value in jobs.items(): ...
    prog_fd = obj.program("lm_egress").fd         # attach with laminar.net.tc

    stats = BpfMap.from_pin("/sys/fs/bpf/laminar/lm_stats")   # no object needed
    passed = stats.lookup_percpu_sum(0)

    pobj = BpfObject.open(object_path("pressure"), pin_root="/sys/fs/bpf/laminar")
    pobj.load()
    links = [p.attach() for p in pobj.programs().values()]
    rb = RingBuffer(pobj.map("lm_events"), lambda data: print(len(data)))
    rb.poll(100)                                  # or loop.add_reader(rb.epoll_fd(), rb.consume)

Every failure raises :class:`BpfError` (an ``OSError``) with the errno, what was attempted and
the last lines libbpf logged (the verifier log when a program is refused). libbpf's own log is
forwarded to the ``laminar.bpf.libbpf`` logger at debug level.
"""

from __future__ import annotations

import collections
import ctypes
import errno as errno_mod
import logging
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

from cffi import FFI

log = logging.getLogger(__name__)

_CDEF = """
typedef int (*libbpf_print_fn_t)(int level, const char *fmt, void *ap);
libbpf_print_fn_t libbpf_set_print(libbpf_print_fn_t fn);
int vsnprintf(char *str, size_t size, const char *format, void *ap);

struct bpf_object_open_opts {
    size_t sz;
    const char *object_name;
    bool relaxed_maps;
    const char *pin_root_path;
    uint32_t _unused_attach_prog_fd;
    const char *kconfig;
    const char *btf_custom_path;
    char *kernel_log_buf;
    size_t kernel_log_size;
    uint32_t kernel_log_level;
};

struct bpf_object;
struct bpf_map;
struct bpf_program;
struct bpf_link;
struct ring_buffer;

struct bpf_object *bpf_object__open_file(const char *path, const struct bpf_object_open_opts *opts);
int bpf_object__load(struct bpf_object *obj);
void bpf_object__close(struct bpf_object *obj);
struct bpf_map *bpf_object__next_map(const struct bpf_object *obj, const struct bpf_map *map);
struct bpf_program *bpf_object__next_program(const struct bpf_object *obj, struct bpf_program *prog);

const char *bpf_map__name(const struct bpf_map *map);
int bpf_map__fd(const struct bpf_map *map);
int bpf_map__type(const struct bpf_map *map);
uint32_t bpf_map__key_size(const struct bpf_map *map);
uint32_t bpf_map__value_size(const struct bpf_map *map);
uint32_t bpf_map__max_entries(const struct bpf_map *map);
const char *bpf_map__pin_path(const struct bpf_map *map);

const char *bpf_program__name(const struct bpf_program *prog);
int bpf_program__fd(const struct bpf_program *prog);
int bpf_program__pin(struct bpf_program *prog, const char *path);
struct bpf_link *bpf_program__attach(const struct bpf_program *prog);

int bpf_link__fd(const struct bpf_link *link);
int bpf_link__pin(struct bpf_link *link, const char *path);
int bpf_link__destroy(struct bpf_link *link);

int bpf_map_lookup_elem(int fd, const void *key, void *value);
int bpf_map_update_elem(int fd, const void *key, const void *value, uint64_t flags);
int bpf_map_delete_elem(int fd, const void *key);
int bpf_map_get_next_key(int fd, const void *key, void *next_key);
int bpf_obj_pin(int fd, const char *pathname);
int bpf_obj_get(const char *pathname);
int bpf_obj_get_info_by_fd(int bpf_fd, void *info, uint32_t *info_len);
int bpf_prog_get_fd_by_id(uint32_t id);
int libbpf_num_possible_cpus(void);

typedef int (*ring_buffer_sample_fn)(void *ctx, void *data, size_t size);
struct ring_buffer *ring_buffer__new(int map_fd, ring_buffer_sample_fn sample_cb, void *ctx, void *opts);
void ring_buffer__free(struct ring_buffer *rb);
int ring_buffer__poll(struct ring_buffer *rb, int timeout_ms);
int ring_buffer__consume(struct ring_buffer *rb);
int ring_buffer__epoll_fd(const struct ring_buffer *rb);
"""

# enum bpf_map_type (uapi/linux/bpf.h), the ones Laminar meets.
MAP_TYPES: dict[int, str] = {
    1: "hash",
    2: "array",
    3: "prog_array",
    4: "perf_event_array",
    5: "percpu_hash",
    6: "percpu_array",
    9: "lru_hash",
    10: "lru_percpu_hash",
    27: "ringbuf",
}
BPF_MAP_TYPE_PERCPU_HASH = 5
BPF_MAP_TYPE_PERCPU_ARRAY = 6
BPF_MAP_TYPE_LRU_PERCPU_HASH = 10
BPF_MAP_TYPE_PERCPU_CGROUP_STORAGE = 21
_PERCPU_TYPES = {
    BPF_MAP_TYPE_PERCPU_HASH,
    BPF_MAP_TYPE_PERCPU_ARRAY,
    BPF_MAP_TYPE_LRU_PERCPU_HASH,
    BPF_MAP_TYPE_PERCPU_CGROUP_STORAGE,
}

# bpf_map_update_elem flags
BPF_ANY = 0
BPF_NOEXIST = 1
BPF_EXIST = 2

LIBBPF_WARN, LIBBPF_INFO, LIBBPF_DEBUG = 0, 1, 2
_LOG_RING_LINES = 400  # a verifier log of a refused program runs to hundreds of lines
_ERROR_TAIL_LINES = 25

DEFAULT_OBJECT_DIR = Path(__file__).resolve().parent / "objects"


class _MapInfo(ctypes.Structure):
    """struct bpf_map_info (uapi/linux/bpf.h), as filled by BPF_OBJ_GET_INFO_BY_FD."""

    _fields_ = [
        ("type", ctypes.c_uint32),
        ("id", ctypes.c_uint32),
        ("key_size", ctypes.c_uint32),
        ("value_size", ctypes.c_uint32),
        ("max_entries", ctypes.c_uint32),
        ("map_flags", ctypes.c_uint32),
        ("name", ctypes.c_char * 16),
        ("ifindex", ctypes.c_uint32),
        ("btf_vmlinux_value_type_id", ctypes.c_uint32),
        ("netns_dev", ctypes.c_uint64),
        ("netns_ino", ctypes.c_uint64),
        ("btf_id", ctypes.c_uint32),
        ("btf_key_type_id", ctypes.c_uint32),
        ("btf_value_type_id", ctypes.c_uint32),
        ("_pad", ctypes.c_uint32),
        ("map_extra", ctypes.c_uint64),
    ]


class _ProgInfoHead(ctypes.Structure):
    """The leading fields of struct bpf_prog_info (uapi/linux/bpf.h) up to name; the kernel
    fills as many bytes as we ask for."""

    _fields_ = [
        ("type", ctypes.c_uint32),
        ("id", ctypes.c_uint32),
        ("tag", ctypes.c_uint8 * 8),
        ("jited_prog_len", ctypes.c_uint32),
        ("xlated_prog_len", ctypes.c_uint32),
        ("jited_prog_insns", ctypes.c_uint64),
        ("xlated_prog_insns", ctypes.c_uint64),
        ("load_time", ctypes.c_uint64),
        ("created_by_uid", ctypes.c_uint32),
        ("nr_map_ids", ctypes.c_uint32),
        ("map_ids", ctypes.c_uint64),
        ("name", ctypes.c_char * 16),
    ]


class BpfError(OSError):
    """A libbpf or bpf(2) failure: ``errno`` is set, ``libbpf_log`` holds libbpf's last lines."""

    def __init__(self, err: int, what: str, libbpf_log: list[str] | None = None) -> None:
        err = abs(err) or errno_mod.EINVAL
        self.libbpf_log: list[str] = list(libbpf_log or [])
        msg = f"{what}: {os.strerror(err)}"
        if self.libbpf_log:
            msg += "\nlibbpf said:\n  " + "\n  ".join(self.libbpf_log)
        super().__init__(err, msg)

    def __str__(self) -> str:
        return str(self.strerror)


class _Lib:
    """The loaded library, the print callback and its log ring (one per process)."""

    def __init__(self) -> None:
        self.ffi = FFI()
        self.ffi.cdef(_CDEF)
        try:
            self.lib: Any = self.ffi.dlopen("libbpf.so.1")
        except OSError as e:
            raise BpfError(
                errno_mod.ENOENT, "cannot load libbpf.so.1 (install Debian's libbpf1 / libbpf-dev)"
            ) from e
        self.libc: Any = self.ffi.dlopen(None)
        self.ring: collections.deque[str] = collections.deque(maxlen=_LOG_RING_LINES)
        self.lock = threading.Lock()
        self._buf = self.ffi.new("char[]", 4096)

        # libbpf passes a va_list. On x86-64 (and arm64) a va_list argument is passed as a
        # pointer, so declaring it `void *` and handing it to libc's vsnprintf formats it.
        @self.ffi.callback("int(int, const char *, void *)")
        def _print(level: int, fmt: Any, ap: Any) -> int:
            try:
                n = self.libc.vsnprintf(self._buf, 4096, fmt, ap)
                text = self.ffi.string(self._buf, min(max(n, 0), 4095)).decode("utf-8", "replace")
                for line in text.rstrip("\n").splitlines():
                    if level <= LIBBPF_INFO:
                        self.ring.append(line)
                    log.debug("libbpf: %s", line)
            except Exception:  # never let an exception cross into C
                pass
            return 0

        self._print = _print  # keep the callback alive as long as libbpf may call it
        self.lib.libbpf_set_print(_print)

    def tail(self) -> list[str]:
        return list(self.ring)[-_ERROR_TAIL_LINES:]

    def call(self, what: str, fn: Callable[..., int], *args: Any) -> int:
        """Call an int-returning libbpf function; raise BpfError on a negative result."""
        mark = len(self.ring)
        rc = fn(*args)
        if rc < 0:
            # libbpf 1.x returns -errno from every int-returning call (and sets errno).
            raise BpfError(-rc, what, list(self.ring)[mark:][-_ERROR_TAIL_LINES:])
        return int(rc)

    def call_ptr(self, what: str, fn: Callable[..., Any], *args: Any) -> Any:
        """Call a pointer-returning libbpf function; raise BpfError (errno) on NULL."""
        mark = len(self.ring)
        self.ffi.errno = 0
        p = fn(*args)
        if p == self.ffi.NULL:
            raise BpfError(self.ffi.errno or errno_mod.EINVAL, what, list(self.ring)[mark:][-_ERROR_TAIL_LINES:])
        return p


_lib_singleton: _Lib | None = None
_lib_lock = threading.Lock()


def _L() -> _Lib:
    global _lib_singleton
    with _lib_lock:
        if _lib_singleton is None:
            _lib_singleton = _Lib()
        return _lib_singleton


def libbpf_log_tail() -> list[str]:
    """The last warning/info lines libbpf logged in this process (for diagnostics)."""
    return _L().tail()


def possible_cpus() -> int:
    """Number of possible CPUs: the number of slots a per-CPU map value has."""
    L = _L()
    return L.call("libbpf_num_possible_cpus", L.lib.libbpf_num_possible_cpus)


def object_path(name: str) -> Path:
    """Path of the compiled CO-RE object ``<name>.bpf.o``.

    Looked up in ``$LAMINAR_BPF_DIR`` when set, else in the package's ``bpf/objects``
    directory (filled by ``make bpf``). The file is not required to exist yet.
    """
    if not name or "/" in name:
        raise ValueError(f"bpf object name {name!r} must be a bare name such as 'netguard'")
    base = os.environ.get("LAMINAR_BPF_DIR")
    return (Path(base) if base else DEFAULT_OBJECT_DIR) / f"{name}.bpf.o"


KeyLike = bytes | bytearray | memoryview | int | ctypes.Structure | ctypes._SimpleCData


def _as_bytes(what: str, obj: KeyLike, size: int) -> bytes:
    """`obj` as exactly `size` bytes; ints are packed little-endian (host order on x86/arm)."""
    if isinstance(obj, int):
        if obj < 0 or obj >= 1 << (8 * size):
            raise ValueError(f"{what} {obj} does not fit in {size} bytes")
        return obj.to_bytes(size, "little")
    data = bytes(obj)  # type: ignore[arg-type]
    if len(data) != size:
        raise ValueError(f"{what} is {len(data)} bytes, the map needs {size}")
    return data


class BpfMap:
    """One BPF map, from a loaded :class:`BpfObject` or from a pin (:meth:`from_pin`).

    Keys may be ``bytes``, a ctypes object or an ``int`` (packed to the key size). Values are
    returned as ``bytes``; per-CPU maps return one value per possible CPU
    (:meth:`lookup_percpu`, :meth:`lookup_percpu_sum`).
    """

    def __init__(
        self, fd: int, name: str, map_type: int, key_size: int, value_size: int, max_entries: int, owned: bool
    ) -> None:
        self.fd = fd
        self.name = name
        self.map_type = map_type
        self.key_size = key_size
        self.value_size = value_size
        self.max_entries = max_entries
        self._owned = owned  # True: fd is ours to close (from_pin); False: the object's

    def __repr__(self) -> str:
        return f"BpfMap({self.name!r}, type={self.type_name}, key={self.key_size}, value={self.value_size}, fd={self.fd})"

    @property
    def type_name(self) -> str:
        return MAP_TYPES.get(self.map_type, str(self.map_type))

    @property
    def percpu(self) -> bool:
        return self.map_type in _PERCPU_TYPES

    @classmethod
    def from_pin(cls, path: str | os.PathLike[str]) -> BpfMap:
        """Open a pinned map; its name, type and sizes come from the kernel.

        Raises BpfError (ENOENT when nothing is pinned there, EINVAL when it is not a map).
        """
        L = _L()
        fd = L.call(f"bpf_obj_get({path})", L.lib.bpf_obj_get, os.fsencode(str(path)))
        try:
            info = map_info(fd)
        except BpfError:
            os.close(fd)
            raise BpfError(errno_mod.EINVAL, f"{path} is not a BPF map") from None
        return cls(
            fd,
            info["name"],
            info["type"],
            info["key_size"],
            info["value_size"],
            info["max_entries"],
            owned=True,
        )

    def close(self) -> None:
        """Close the fd when this map was opened from a pin (an object's maps close with it)."""
        if self._owned and self.fd >= 0:
            os.close(self.fd)
        self.fd = -1

    def __enter__(self) -> BpfMap:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _value_buf_size(self) -> int:
        if self.percpu:
            return ((self.value_size + 7) // 8) * 8 * possible_cpus()
        return self.value_size

    def _lookup_raw(self, key: KeyLike) -> bytes | None:
        L = _L()
        k = _as_bytes(f"key for {self.name}", key, self.key_size)
        n = self._value_buf_size()
        buf = L.ffi.new("char[]", max(n, 1))
        rc = L.lib.bpf_map_lookup_elem(self.fd, k, buf)
        if rc < 0:
            if -rc == errno_mod.ENOENT:
                return None
            raise BpfError(-rc, f"lookup in {self.name}")
        return bytes(L.ffi.buffer(buf, n))

    def lookup(self, key: KeyLike) -> bytes | None:
        """The value under `key`, or None when absent. Raises BpfError for a per-CPU map
        (use lookup_percpu) or a kernel failure."""
        if self.percpu:
            raise BpfError(errno_mod.EINVAL, f"{self.name} is per-CPU: use lookup_percpu()/lookup_percpu_sum()")
        return self._lookup_raw(key)

    def lookup_percpu(self, key: KeyLike) -> list[bytes] | None:
        """One value per possible CPU for a per-CPU map, or None when absent."""
        if not self.percpu:
            raise BpfError(errno_mod.EINVAL, f"{self.name} is not per-CPU: use lookup()")
        raw = self._lookup_raw(key)
        if raw is None:
            return None
        stride = ((self.value_size + 7) // 8) * 8
        return [raw[i : i + self.value_size] for i in range(0, len(raw), stride)]

    def lookup_percpu_sum(self, key: KeyLike) -> int:
        """Sum over CPUs of an unsigned 8-byte per-CPU counter (0 when absent)."""
        if self.value_size != 8:
            raise BpfError(errno_mod.EINVAL, f"{self.name} values are {self.value_size} bytes, not a u64 counter")
        vals = self.lookup_percpu(key)
        return sum(int.from_bytes(v, "little") for v in vals or [])

    def update(self, key: KeyLike, value: KeyLike, flags: int = BPF_ANY) -> None:
        """Set `key` to `value` (BPF_ANY, BPF_NOEXIST or BPF_EXIST). For a per-CPU map the
        value is written to every CPU. Raises BpfError (EEXIST/ENOENT per flags, E2BIG when full)."""
        L = _L()
        k = _as_bytes(f"key for {self.name}", key, self.key_size)
        v = _as_bytes(f"value for {self.name}", value, self.value_size)
        if self.percpu:
            stride = ((self.value_size + 7) // 8) * 8
            v = (v + bytes(stride - self.value_size)) * possible_cpus()
        L.call(f"update of {self.name}", L.lib.bpf_map_update_elem, self.fd, k, v, flags)

    def delete(self, key: KeyLike) -> bool:
        """Remove `key`; True when it was there, False when it was not."""
        L = _L()
        k = _as_bytes(f"key for {self.name}", key, self.key_size)
        rc = L.lib.bpf_map_delete_elem(self.fd, k)
        if rc < 0:
            if -rc == errno_mod.ENOENT:
                return False
            raise BpfError(-rc, f"delete from {self.name}")
        return True

    def keys(self) -> Iterator[bytes]:
        """Every key, in the kernel's order (a snapshot as it iterates; concurrent deletes may
        restart a hash walk from its start, so a key may show twice but none is lost)."""
        L = _L()
        cur = L.ffi.new("char[]", max(self.key_size, 1))
        nxt = L.ffi.new("char[]", max(self.key_size, 1))
        prev: Any = L.ffi.NULL
        while True:
            rc = L.lib.bpf_map_get_next_key(self.fd, prev, nxt)
            if rc < 0:
                if -rc == errno_mod.ENOENT:
                    return
                raise BpfError(-rc, f"iteration of {self.name}")
            key = bytes(L.ffi.buffer(nxt, self.key_size))
            yield key
            L.ffi.memmove(cur, nxt, self.key_size)
            prev = cur

    def items(self) -> Iterator[tuple[bytes, bytes]]:
        """(key, value) pairs; for a per-CPU map the value is the CPUs' values concatenated
        with 8-byte alignment (see items_percpu). Keys deleted meanwhile are skipped."""
        for k in self.keys():
            v = self._lookup_raw(k)
            if v is not None:
                yield k, v

    def items_percpu(self) -> Iterator[tuple[bytes, list[bytes]]]:
        """(key, [value per CPU]) pairs of a per-CPU map."""
        for k in self.keys():
            v = self.lookup_percpu(k)
            if v is not None:
                yield k, v

    def pin(self, path: str | os.PathLike[str]) -> None:
        """Pin the map at `path` on a bpffs (EEXIST when something is pinned there)."""
        L = _L()
        L.call(f"pin of {self.name} at {path}", L.lib.bpf_obj_pin, self.fd, os.fsencode(str(path)))

    @staticmethod
    def unpin(path: str | os.PathLike[str]) -> bool:
        """Remove the pin at `path`; True when there was one. The map lives on while fds,
        programs or other pins hold it."""
        try:
            os.unlink(path)
            return True
        except FileNotFoundError:
            return False


def map_info(fd: int) -> dict[str, Any]:
    """Kernel info of the map behind `fd`: name, type, id, key_size, value_size, max_entries,
    map_flags, btf_id. Raises BpfError."""
    L = _L()
    info = _MapInfo()
    ln = L.ffi.new("uint32_t *", ctypes.sizeof(info))
    L.call("bpf_obj_get_info_by_fd(map)", L.lib.bpf_obj_get_info_by_fd, fd, L.ffi.cast("void *", ctypes.addressof(info)), ln)
    return {
        "name": info.name.decode(),
        "type": info.type,
        "id": info.id,
        "key_size": info.key_size,
        "value_size": info.value_size,
        "max_entries": info.max_entries,
        "map_flags": info.map_flags,
        "btf_id": info.btf_id,
    }


def prog_info(fd: int) -> dict[str, Any]:
    """Kernel info of the program behind `fd`: id, type, name, tag (hex). Raises BpfError."""
    L = _L()
    info = _ProgInfoHead()
    ln = L.ffi.new("uint32_t *", ctypes.sizeof(info))
    L.call("bpf_obj_get_info_by_fd(prog)", L.lib.bpf_obj_get_info_by_fd, fd, L.ffi.cast("void *", ctypes.addressof(info)), ln)
    return {"id": info.id, "type": info.type, "name": info.name.decode(), "tag": bytes(info.tag).hex()}


def prog_info_by_id(prog_id: int) -> dict[str, Any]:
    """Kernel info (id, type, name, tag) of the loaded program with id `prog_id`.
    Raises BpfError (ENOENT when no such program is loaded)."""
    L = _L()
    fd = L.call(f"bpf_prog_get_fd_by_id({prog_id})", L.lib.bpf_prog_get_fd_by_id, prog_id)
    try:
        return prog_info(fd)
    finally:
        os.close(fd)


class BpfLink:
    """An attachment (tracepoint, tp_btf, ...). It lasts until :meth:`destroy` unless pinned."""

    def __init__(self, ptr: Any, name: str) -> None:
        self._ptr = ptr
        self.name = name

    @property
    def fd(self) -> int:
        L = _L()
        return L.call(f"fd of link {self.name}", L.lib.bpf_link__fd, self._ptr)

    def pin(self, path: str | os.PathLike[str]) -> None:
        """Pin the link: the attachment then outlives this process."""
        L = _L()
        L.call(f"pin of link {self.name} at {path}", L.lib.bpf_link__pin, self._ptr, os.fsencode(str(path)))

    def destroy(self) -> None:
        """Detach (unless pinned) and free. Idempotent."""
        if self._ptr is not None:
            _L().lib.bpf_link__destroy(self._ptr)
            self._ptr = None


class BpfProgram:
    """A program of a loaded :class:`BpfObject`."""

    def __init__(self, obj: BpfObject, ptr: Any) -> None:
        self._obj = obj
        self._ptr = ptr
        self.name: str = _L().ffi.string(_L().lib.bpf_program__name(ptr)).decode()

    def __repr__(self) -> str:
        return f"BpfProgram({self.name!r})"

    @property
    def fd(self) -> int:
        """The program fd (valid after load, while the object is open)."""
        L = _L()
        return L.call(f"fd of program {self.name} (is the object loaded?)", L.lib.bpf_program__fd, self._ptr)

    @property
    def id(self) -> int:
        """The kernel's program id (what `bpftool prog` and tc filters show)."""
        return int(prog_info(self.fd)["id"])

    def attach(self) -> BpfLink:
        """Attach by section name (tracepoint/..., tp_btf/..., ...). tc programs are attached
        with laminar.net.tc instead. Raises BpfError."""
        L = _L()
        p = L.call_ptr(f"attach of {self.name}", L.lib.bpf_program__attach, self._ptr)
        return BpfLink(p, self.name)

    def pin(self, path: str | os.PathLike[str]) -> None:
        L = _L()
        L.call(f"pin of program {self.name} at {path}", L.lib.bpf_program__pin, self._ptr, os.fsencode(str(path)))


class BpfObject:
    """A CO-RE object file: open, load, then find its maps and programs by name."""

    def __init__(self, ptr: Any, path: Path, pin_root: str | None) -> None:
        self._ptr = ptr
        self.path = path
        self.pin_root = pin_root
        self.loaded = False
        self._maps: dict[str, BpfMap] | None = None

    @classmethod
    def open(cls, path: str | os.PathLike[str], pin_root: str | None = None) -> BpfObject:
        """Open (parse, not yet load) an object file. Maps declared with
        ``LIBBPF_PIN_BY_NAME`` are pinned as ``<pin_root>/<map name>`` at load time, reusing
        an existing compatible pin. `pin_root` must be a directory on a bpffs; it is created
        when missing. None: libbpf's default, /sys/fs/bpf. Raises BpfError."""
        p = Path(path)
        if not p.is_file():
            raise BpfError(errno_mod.ENOENT, f"BPF object {p} not found (build it with `make bpf`)")
        L = _L()
        opts = L.ffi.new("struct bpf_object_open_opts *")
        opts.sz = L.ffi.sizeof("struct bpf_object_open_opts")
        keep = []
        if pin_root is not None:
            os.makedirs(pin_root, exist_ok=True)
            c_root = L.ffi.new("char[]", os.fsencode(pin_root))
            keep.append(c_root)
            opts.pin_root_path = c_root
        ptr = L.call_ptr(f"open of {p}", L.lib.bpf_object__open_file, os.fsencode(str(p)), opts)
        return cls(ptr, p, pin_root)

    def load(self) -> None:
        """Relocate against the kernel BTF, create or reattach maps, load programs into the
        kernel. Raises BpfError with the verifier's log on refusal."""
        L = _L()
        self._check_open()
        L.call(f"load of {self.path.name}", L.lib.bpf_object__load, self._ptr)
        self.loaded = True
        self._maps = None

    def _check_open(self) -> None:
        if self._ptr is None:
            raise BpfError(errno_mod.EBADF, f"BPF object {self.path.name} is closed")

    def maps(self) -> dict[str, BpfMap]:
        """Every map of the object by name (fds valid after load)."""
        self._check_open()
        if self._maps is not None:
            return self._maps
        L = _L()
        out: dict[str, BpfMap] = {}
        m: Any = L.ffi.NULL
        while True:
            m = L.lib.bpf_object__next_map(self._ptr, m)
            if m == L.ffi.NULL:
                break
            name = L.ffi.string(L.lib.bpf_map__name(m)).decode()
            out[name] = BpfMap(
                L.lib.bpf_map__fd(m),
                name,
                L.lib.bpf_map__type(m),
                L.lib.bpf_map__key_size(m),
                L.lib.bpf_map__value_size(m),
                L.lib.bpf_map__max_entries(m),
                owned=False,
            )
        if self.loaded:
            self._maps = out
        return out

    def map(self, name: str) -> BpfMap:
        """The map called `name`; KeyError naming the maps there are when absent."""
        maps = self.maps()
        if name not in maps:
            raise KeyError(f"no map {name!r} in {self.path.name} (maps: {', '.join(sorted(maps))})")
        return maps[name]

    def programs(self) -> dict[str, BpfProgram]:
        """Every program of the object by name."""
        self._check_open()
        L = _L()
        out: dict[str, BpfProgram] = {}
        p: Any = L.ffi.NULL
        while True:
            p = L.lib.bpf_object__next_program(self._ptr, p)
            if p == L.ffi.NULL:
                break
            prog = BpfProgram(self, p)
            out[prog.name] = prog
        return out

    def program(self, name: str) -> BpfProgram:
        """The program called `name`; KeyError naming the programs there are when absent."""
        progs = self.programs()
        if name not in progs:
            raise KeyError(f"no program {name!r} in {self.path.name} (programs: {', '.join(sorted(progs))})")
        return progs[name]

    def close(self) -> None:
        """Free the object: its map and program fds close (pins, tc filters and pinned links
        keep what they reference alive). Idempotent."""
        if self._ptr is not None:
            _L().lib.bpf_object__close(self._ptr)
            self._ptr = None
            self._maps = None

    def __enter__(self) -> BpfObject:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class RingBuffer:
    """Reads a BPF_MAP_TYPE_RINGBUF map: `callback(data: bytes)` runs once per record, in the
    thread that calls :meth:`poll` or :meth:`consume`.

    An exception raised by the callback stops that poll and is re-raised from it (the record
    counts as consumed). With asyncio: ``loop.add_reader(rb.epoll_fd(), rb.consume)``.
    """

    def __init__(self, map: BpfMap, callback: Callable[[bytes], None]) -> None:
        if map.map_type != 27:
            raise BpfError(errno_mod.EINVAL, f"{map.name} is a {map.type_name} map, not a ringbuf")
        L = _L()
        self._map = map  # the map must outlive the ring buffer
        self._callback = callback
        self._pending: BaseException | None = None

        @L.ffi.callback("int(void *, void *, size_t)")
        def _sample(ctx: Any, data: Any, size: int) -> int:
            try:
                self._callback(bytes(L.ffi.buffer(data, size)))
                return 0
            except BaseException as e:  # re-raised in poll(); C must not see it
                self._pending = e
                return -1

        self._sample = _sample  # keep alive while libbpf holds the pointer
        self._rb: Any = L.call_ptr(
            f"ring_buffer__new({map.name})", L.lib.ring_buffer__new, map.fd, _sample, L.ffi.NULL, L.ffi.NULL
        )

    def _check(self, rc: int, what: str) -> int:
        if self._pending is not None:
            e, self._pending = self._pending, None
            raise e
        if rc < 0 and -rc != errno_mod.EINTR:
            raise BpfError(-rc, f"{what} of {self._map.name}")
        return max(rc, 0)

    def epoll_fd(self) -> int:
        """An fd that is readable when records are waiting."""
        self._check_alive()
        return int(_L().lib.ring_buffer__epoll_fd(self._rb))

    def consume(self) -> int:
        """Handle every waiting record without blocking; returns how many."""
        self._check_alive()
        return self._check(_L().lib.ring_buffer__consume(self._rb), "consume")

    def poll(self, timeout_ms: int) -> int:
        """Wait up to `timeout_ms` (-1: forever) for records and handle them; returns how many."""
        self._check_alive()
        return self._check(_L().lib.ring_buffer__poll(self._rb, timeout_ms), "poll")

    def _check_alive(self) -> None:
        if self._rb is None:
            raise BpfError(errno_mod.EBADF, f"ring buffer of {self._map.name} is closed")

    def close(self) -> None:
        """Free the ring buffer. Idempotent."""
        if self._rb is not None:
            _L().lib.ring_buffer__free(self._rb)
            self._rb = None

    def __enter__(self) -> RingBuffer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
