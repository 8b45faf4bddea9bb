"""jobkit's resume loads exactly the bytes it verified, even from storage that answers a second
read of a checkpoint with other bytes than the first (a state file replaced between two opens,
a racing writer, flaky network storage): ``LAMINAR_RESUME_FROM`` is never restored from bytes
that were not checked against the manifest.

The changing storage is real: a FUSE mount (tests/fuserig.py, :meth:`EioMount.swap`) mirroring a
real checkpoint saved by jobkit, whose server answers the state file's first open with its own
bytes and every later open with another checkpoint's state file of the same size (a valid torch
file too: what a replaced file looks like). The job's side is the real ``Checkpointer.resume()``
with the real torch.
"""

from __future__ import annotations

import secrets
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest
from fuserig import eio_mount

from laminar import jobkit

pytestmark = pytest.mark.kernel
torch = pytest.importorskip("torch")


def saved(root: Path, name: str, fill: float) -> Path:
    """A torch checkpoint ``root/<name>/ckpt-3`` of a 64x64 tensor filled with ``fill``."""
    ck = jobkit.Checkpointer(job_id="j", ckpt_dir=root / name, install_signal=False)
    return ck.save({"w": torch.full((64, 64), fill), "step": 3}, step=3)


def test_resume_loads_the_bytes_it_verified_when_a_second_read_returns_other_bytes(tmp_path: Path) -> None:
    good = saved(tmp_path / "backing", "src", 1.0)
    other = saved(tmp_path / "other", "src", 666.0)
    assert (good / "state.pt").stat().st_size == (other / "state.pt").stat().st_size
    shutil.copy(other / "state.pt", tmp_path / "backing" / "other.pt")
    with eio_mount(tmp_path / "backing") as fs:
        fs.swap("src/ckpt-3/state.pt", "other.pt", after_opens=1)
        ck = jobkit.Checkpointer(job_id="j", ckpt_dir=tmp_path / "mine", resume_from=fs.path / "src/ckpt-3",
                                 install_signal=False)
        state = ck.resume()
        opens = fs.opens_of_swapped
    assert opens >= 1, "resume never opened the state file through the mount"
    # the state the manifest vouches for, never the other file's (before the fix: all 666)
    got = (float(state["w"].min()), float(state["w"].max()))
    assert got == (1.0, 1.0), f"loaded unverified bytes: values {got} ({opens} opens of the state file)"
    assert ck.resumed_step == 3


def test_resume_refuses_a_state_file_whose_every_read_returns_other_bytes(tmp_path: Path) -> None:
    saved(tmp_path / "backing", "src", 1.0)
    other = saved(tmp_path / "other", "src", 666.0)
    shutil.copy(other / "state.pt", tmp_path / "backing" / "other.pt")
    with eio_mount(tmp_path / "backing") as fs:
        fs.swap("src/ckpt-3/state.pt", "other.pt", after_opens=0)
        ck = jobkit.Checkpointer(job_id="j", ckpt_dir=tmp_path / "mine", resume_from=fs.path / "src/ckpt-3",
                                 install_signal=False)
        with pytest.raises(jobkit.CheckpointError, match="state.pt does not match its SHA-256"):
            ck.resume()


_RESUME = r"""
import sys
sys.path.insert(0, sys.argv[1])
import torch
from laminar import jobkit
if sys.argv[2] == "resume":
    ck = jobkit.Checkpointer(job_id="p", ckpt_dir=sys.argv[3] + "-mine", resume_from=sys.argv[3], install_signal=False)
    w = ck.resume()["w"]
    assert float(w.sum()) == w.numel()  # every page of the state touched
"""


def peak_mib(tag: str, *argv: str) -> int:
    """The peak memory (MiB, memory cgroup v1: anonymous, shmem and page cache charged to it) of
    ``python -c _RESUME argv`` run alone in a new cgroup ``laminar-t-<tag>-<hex>``."""
    cg = Path("/sys/fs/cgroup/memory") / f"laminar-t-{tag}-{secrets.token_hex(3)}"
    cg.mkdir()
    try:
        subprocess.run(["/bin/sh", "-c", f'echo $$ > {cg}/cgroup.procs && exec "$0" "$@"', sys.executable, "-c",
                        _RESUME, *argv], check=True, timeout=300)
        return int((cg / "memory.max_usage_in_bytes").read_text()) >> 20
    finally:
        cg.rmdir()


def test_resuming_torch_state_holds_one_copy_of_it_not_two() -> None:
    """Reading the state file once and loading from what was read must not cost a second copy
    of the state (a 40 GiB state on an 80 GiB host): the verified bytes are a sealed memfd whose
    pages the tensors map. 128 MiB of weights on tmpfs (whose pages are this test's, not the
    child's): the resume's peak grows by about the state, not twice it."""
    if not Path("/sys/fs/cgroup/memory/cgroup.procs").exists():
        pytest.skip("no memory cgroup v1 here to measure a peak with")
    lib = str(Path(jobkit.__file__).resolve().parents[1])
    d = Path(tempfile.mkdtemp(prefix="lm-t-resume-peak-", dir="/dev/shm"))
    try:
        ck = jobkit.Checkpointer(job_id="p", ckpt_dir=d / "src", install_signal=False)
        src = ck.save({"w": torch.ones(32 << 20)}, step=1)  # 128 MiB
        base = peak_mib("rpk", lib, "import", str(src))
        resumed = peak_mib("rpk", lib, "resume", str(src))
        assert resumed - base < 192, f"resuming 128 MiB of torch state grew the peak by {resumed - base} MiB"
    finally:
        shutil.rmtree(d, ignore_errors=True)


def test_a_directory_resume_reads_each_checkpoint_once_and_falls_back_past_one_that_fails(
        tmp_path: Path, capfd: pytest.CaptureFixture[str]) -> None:
    """``LAMINAR_RESUME_FROM`` naming a directory of checkpoints: the newest was verified by one
    read and loaded by a second; storage whose second read of it answered other bytes failed the
    resume ("does not match its SHA-256") although that checkpoint had verified. Now each is read
    once, verified as read: the newest loads. Where the newest fails on every read, the resume
    falls back to the next one that verifies and names the one it skipped; where none verifies,
    it refuses, naming each."""
    ck = jobkit.Checkpointer(job_id="j", ckpt_dir=tmp_path / "backing" / "src", keep=2, install_signal=False)
    ck.save({"w": torch.full((64, 64), 3.0), "step": 3}, step=3)
    ck.save({"w": torch.full((64, 64), 5.0), "step": 5}, step=5)
    other = saved(tmp_path / "other", "x", 666.0)
    shutil.copy(other / "state.pt", tmp_path / "backing" / "other.pt")

    def resume(fs_path: Path) -> tuple[float, int]:
        ck = jobkit.Checkpointer(job_id="j", ckpt_dir=tmp_path / "mine", resume_from=fs_path / "src",
                                 install_signal=False)
        state = ck.resume()
        assert float(state["w"].min()) == float(state["w"].max())
        return float(state["w"].max()), int(ck.resumed_step or 0)

    with eio_mount(tmp_path / "backing") as fs:  # the newest answers its 2nd and later opens with other bytes
        fs.swap("src/ckpt-5/state.pt", "other.pt", after_opens=1)
        assert resume(fs.path) == (5.0, 5)
    assert "newer ones did not" not in capfd.readouterr().err

    with eio_mount(tmp_path / "backing") as fs:  # the newest corrupt on every read: the one before it
        fs.swap("src/ckpt-5/state.pt", "other.pt", after_opens=0)
        assert resume(fs.path) == (3.0, 3)
    err = capfd.readouterr().err
    assert "resuming from ckpt-3" in err and "ckpt-5" in err and "SHA-256" in err, err

    with eio_mount(tmp_path / "backing") as fs:  # none verifies: refused, naming both
        fs.swap("src/ckpt-5/state.pt", "other.pt", after_opens=0)
        (tmp_path / "backing" / "src" / "ckpt-3" / "state.pt").write_bytes(b"\0" * 16)
        with pytest.raises(jobkit.CheckpointError, match="holds no verified checkpoint") as e:
            resume(fs.path)
    assert "ckpt-5" in str(e.value) and "ckpt-3" in str(e.value)
