"""jobkit's verified copy of a torch checkpoint's state into a sealed memfd
(``jobkit._copy_sealed``: what ``Checkpointer.resume`` hashes and then loads).

Since 2026-11-24 each block is hashed in a second thread while the first writes it into the
memfd and reads the next, with three buffers in turn (a torch restore of 1 GiB: 0.88 -> 0.55 s).
What must hold, whatever the threads do: the hash is of exactly the bytes in the memfd (a
buffer read into again before its hash was done would hash other bytes than those written),
those are the file's, the memfd is sealed, and a file longer than the manifest says is cut at
one byte past it (the caller then refuses it). Real files, a real memfd.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
from pathlib import Path

import pytest

from laminar import jobkit


def copy(path: Path, size: int) -> tuple[int, str, bytes, int]:
    mfd = os.memfd_create("lm-t-sealed", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        n, digest = jobkit._copy_sealed(os.open(path, os.O_RDONLY | os.O_CLOEXEC), size, mfd)
        held = os.pread(mfd, n + 1, 0)
        return n, digest, held, fcntl.fcntl(mfd, fcntl.F_GET_SEALS)
    finally:
        os.close(mfd)


@pytest.mark.parametrize("size", [0, 1, jobkit._COPY_BLOCK - 1, jobkit._COPY_BLOCK, 7 * jobkit._COPY_BLOCK + 12345])
def test_the_hash_is_of_the_bytes_in_the_sealed_memfd_and_those_are_the_files(tmp_path: Path, size: int) -> None:
    f = tmp_path / "state.bin"
    data = os.urandom(size)
    f.write_bytes(data)
    n, digest, held, seals = copy(f, size)
    assert n == size and held == data
    assert digest == hashlib.sha256(data).hexdigest()
    assert seals & fcntl.F_SEAL_WRITE and seals & fcntl.F_SEAL_GROW and seals & fcntl.F_SEAL_SHRINK


def test_a_file_longer_than_its_manifest_says_is_cut_one_byte_past_it(tmp_path: Path) -> None:
    f = tmp_path / "state.bin"
    data = os.urandom(3 * jobkit._COPY_BLOCK)
    f.write_bytes(data)
    size = jobkit._COPY_BLOCK + 10
    n, digest, held, _ = copy(f, size)
    assert size < n <= size + jobkit._COPY_BLOCK  # past the size: the caller refuses it on the count
    assert held == data[:n] and digest == hashlib.sha256(data[:n]).hexdigest()
