"""jobkit: the checkpoint contract on the job's side (signal, atomic commit, verified resume)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from laminar import jobkit
from laminar.jobkit import MANIFEST, Checkpointer, CheckpointError, latest_checkpoint, verify_checkpoint

REPO = Path(__file__).resolve().parents[2]


def test_save_commits_atomically_with_a_manifest(tmp_path: Path) -> None:
    ck = Checkpointer(job_id="j1", ckpt_dir=tmp_path, install_signal=False)
    p = ck.save(b"hello", step=3)
    assert p == tmp_path / "ckpt-3"
    m = verify_checkpoint(p)
    assert m["job_id"] == "j1" and m["step"] == 3 and m["format"] == "bytes"
    assert sorted(x.name for x in p.iterdir()) == [MANIFEST, "state.bin"]
    assert not [x for x in tmp_path.iterdir() if x.name.startswith(".")]  # no temp left behind


def test_keep_prunes_old_checkpoints_and_same_step_replaces(tmp_path: Path) -> None:
    ck = Checkpointer(ckpt_dir=tmp_path, keep=2, install_signal=False)
    for s in (1, 2, 3):
        ck.save(bytes([s]), step=s)
    assert [p.name for p in jobkit.list_checkpoints(tmp_path)] == ["ckpt-2", "ckpt-3"]
    ck.save(b"again", step=3)
    assert (tmp_path / "ckpt-3" / "state.bin").read_bytes() == b"again"


def test_resume_returns_the_state_and_refuses_corruption(tmp_path: Path) -> None:
    src = Checkpointer(ckpt_dir=tmp_path / "a", install_signal=False)
    p = src.save(b"x" * 1000, step=5)
    dst = Checkpointer(ckpt_dir=tmp_path / "b", resume_from=p, install_signal=False)
    assert dst.resume() == b"x" * 1000 and dst.resumed_step == 5
    # a directory of checkpoints resumes from the newest one that verifies
    src.save(b"y" * 1000, step=6)
    (tmp_path / "a" / "ckpt-6" / "state.bin").write_bytes(b"z" * 1000)  # same size, wrong bytes
    assert latest_checkpoint(tmp_path / "a") == p
    assert Checkpointer(ckpt_dir=tmp_path / "c", resume_from=tmp_path / "a", install_signal=False).resume() == b"x" * 1000
    # naming a corrupt checkpoint is an error, never a silent load
    with pytest.raises(CheckpointError, match="SHA-256"):
        Checkpointer(ckpt_dir=tmp_path / "c", resume_from=tmp_path / "a/ckpt-6", install_signal=False).resume()
    (p / "state.bin").unlink()
    with pytest.raises(CheckpointError, match="missing"):
        verify_checkpoint(p)
    with pytest.raises(CheckpointError, match="no MANIFEST.json"):
        verify_checkpoint(tmp_path)


def test_no_resume_from_means_fresh_start(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LAMINAR_RESUME_FROM", raising=False)
    monkeypatch.setenv("LAMINAR_CKPT_DIR", str(tmp_path))
    monkeypatch.setenv("LAMINAR_JOB_ID", "envjob")
    ck = Checkpointer(install_signal=False)
    assert ck.resume() is None and ck.job_id == "envjob" and ck.ckpt_dir == tmp_path


def test_bad_environment_is_named(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("LAMINAR_CKPT_DIR", raising=False)
    with pytest.raises(CheckpointError, match="LAMINAR_CKPT_DIR is unset"):
        Checkpointer(install_signal=False)
    monkeypatch.setenv("LAMINAR_CKPT_SIGNAL", "SIGNOPE")
    with pytest.raises(CheckpointError, match="SIGNOPE"):
        Checkpointer(ckpt_dir=tmp_path, install_signal=False)


JOB = """
import sys, time
sys.path.insert(0, {agent!r})
from laminar import jobkit
ck = jobkit.Checkpointer()
print("ready", flush=True)
step = 0
while step < 100000:
    step += 1
    time.sleep(0.001)
    if ck.requested():
        ck.save(step.to_bytes(8, "little"), step=step)
        print("saved", step, flush=True)
        break
"""


@pytest.mark.parametrize("signame", ["SIGUSR1", "SIGUSR2"])
def test_the_checkpoint_signal_of_the_contract_asks_a_real_process(tmp_path: Path, signame: str) -> None:
    env = dict(os.environ, LAMINAR_CKPT_DIR=str(tmp_path), LAMINAR_JOB_ID="sig", LAMINAR_CKPT_SIGNAL=signame)
    p = subprocess.Popen([sys.executable, "-c", JOB.format(agent=str(REPO / "agent"))], env=env,
                         stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        assert p.stdout.readline().strip() == "ready"
        p.send_signal(signal.Signals[signame])
        line = p.stdout.readline().split()
        assert line[0] == "saved"
        assert p.wait(timeout=30) == 0
    finally:
        p.kill()
    ck = latest_checkpoint(tmp_path)
    assert ck is not None and int.from_bytes((ck / "state.bin").read_bytes(), "little") == int(line[1])


def _torch_python() -> str | None:
    """A Python with torch: this one, or $LAMINAR_TORCH_PYTHON."""
    for py in (sys.executable, os.environ.get("LAMINAR_TORCH_PYTHON", "")):
        if py and subprocess.run([py, "-c", "import torch"], capture_output=True).returncode == 0:
            return py
    return None


def test_pytorch_job_resumed_from_a_requested_checkpoint_ends_with_identical_weights(tmp_path: Path) -> None:
    py = _torch_python()
    if py is None:
        pytest.skip("torch not installed here (pip install torch==2.13.0, or set LAMINAR_TORCH_PYTHON)")
    ex = str(REPO / "examples/train_mnistlike.py")
    steps = "120"
    ref = subprocess.run([py, ex, "--steps", steps], capture_output=True, text=True, check=True)
    want = json.loads(ref.stdout.strip().splitlines()[-1])["weights_sha256"]

    env = dict(os.environ, LAMINAR_CKPT_DIR=str(tmp_path / "a"), LAMINAR_JOB_ID="mnist")
    p = subprocess.Popen([py, ex, "--steps", steps, "--step-sleep", "0.02", "--exit-after-checkpoint"],
                         env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None
        assert json.loads(p.stdout.readline())["event"] == "start"
        p.send_signal(signal.SIGUSR1)
        events = [json.loads(x) for x in p.stdout]
        assert p.wait(timeout=60) == 0
    finally:
        p.kill()
    ck = next(e for e in events if e["event"] == "checkpoint")
    assert ck["requested"] and 0 < ck["step"] < int(steps)

    env = dict(os.environ, LAMINAR_CKPT_DIR=str(tmp_path / "b"), LAMINAR_JOB_ID="mnist", LAMINAR_RESUME_FROM=ck["path"])
    out = subprocess.run([py, ex, "--steps", steps], env=env, capture_output=True, text=True, check=True)
    lines = [json.loads(x) for x in out.stdout.splitlines()]
    assert lines[0] == {"event": "start", "step": ck["step"], "resumed": True, "pid": lines[0]["pid"]}
    assert lines[-1]["weights_sha256"] == want


_SAVE_PEAK = r"""
import resource, sys
import torch
from laminar import jobkit

kind = sys.argv[2]
mib = 192
if kind == "torch":
    state = {"w": torch.ones(mib << 18, dtype=torch.float32)}  # 192 MiB of weights
else:
    state = bytearray(b"\x07") * (mib << 20)
ck = jobkit.Checkpointer(job_id="peak", ckpt_dir=sys.argv[1], install_signal=False)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
ck.save(state, step=1)
after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
jobkit.verify_checkpoint(ck.saved[-1])
print((after - before) // 1024)
"""


@pytest.mark.parametrize("kind", ["torch", "bytes"])
def test_save_streams_the_state_to_disk_without_a_second_copy_in_memory(tmp_path: Path, kind: str) -> None:
    """A checkpoint is often taken when memory is short (a reclaim, Airlock): saving 192 MiB of
    state must not hold another copy of it in the job's memory (it used to serialize the whole
    state into memory first, and then copy it: the job's peak grew by 1-2x the state)."""
    pytest.importorskip("torch")
    env = {**os.environ, "PYTHONPATH": str(Path(jobkit.__file__).resolve().parents[1])}
    out = subprocess.run([sys.executable, "-c", _SAVE_PEAK, str(tmp_path / "ck"), kind], env=env,
                         capture_output=True, text=True, timeout=300, check=True)
    grew_mib = int(out.stdout.strip().splitlines()[-1])
    assert grew_mib < 64, f"saving 192 MiB of {kind} state grew the job's peak RSS by {grew_mib} MiB"
    ck = tmp_path / "ck" / "ckpt-1"
    m = verify_checkpoint(ck)
    assert m["files"][0]["size"] == (ck / m["files"][0]["name"]).stat().st_size


def test_a_manifest_listing_no_state_is_not_a_checkpoint(tmp_path: Path) -> None:
    """A ``ckpt-<n>`` whose manifest lists no file holds no state: it does not verify, so the
    newest checkpoint with state is resumed (it verified, was chosen as the newest, shipped,
    and the job's resume failed with an IndexError, on every restart)."""
    ck = Checkpointer(job_id="j1", ckpt_dir=tmp_path, keep=5, install_signal=False)
    good = ck.save(b"state", step=1)
    empty = tmp_path / "ckpt-2"
    empty.mkdir()
    m = json.loads((good / MANIFEST).read_text()) | {"step": 2, "files": []}
    (empty / MANIFEST).write_text(json.dumps(m))
    with pytest.raises(CheckpointError, match="no file"):
        verify_checkpoint(empty)
    assert latest_checkpoint(tmp_path) == good
    assert Checkpointer(ckpt_dir=tmp_path / "new", resume_from=tmp_path, install_signal=False).resume() == b"state"
    with pytest.raises(CheckpointError):
        Checkpointer(ckpt_dir=tmp_path / "new", resume_from=empty, install_signal=False).resume()


def test_a_manifest_with_a_step_that_is_no_integer_is_refused(tmp_path: Path) -> None:
    ck = Checkpointer(job_id="j1", ckpt_dir=tmp_path, install_signal=False)
    p = ck.save(b"state", step=1)
    for bad in ("one", None, -1, 1.5, True):
        m = json.loads((p / MANIFEST).read_text()) | {"step": bad}
        (p / MANIFEST).write_text(json.dumps(m))
        with pytest.raises(CheckpointError, match="step"):
            Checkpointer(ckpt_dir=tmp_path / "new", resume_from=p, install_signal=False).resume()


_SLOW_WRITER = """
import sys, time
sys.path.insert(0, sys.argv[2])
from laminar import jobkit
def slow(state, fmt, out):
    out.write(b"x" * 100000)
    out.flush()
    print("writing", flush=True)
    time.sleep(60)
jobkit._serialize_into = slow
jobkit.Checkpointer("j", sys.argv[1], install_signal=False).save(b"s", step=int(sys.argv[3]))
"""


def test_a_save_killed_half_way_leaves_no_temporary_behind_the_next_save(tmp_path: Path) -> None:
    """A process killed while saving (the kill-switch at a window's end, the OOM killer: a
    checkpoint is often asked for when memory is short) leaves ``.tmp-ckpt-<step>-<pid>``; the
    next process saving there removed only its own pid's, so every killed save kept up to a
    whole checkpoint's size on the disk for as long as the directory lived. A save still being
    written by a live process is left alone."""
    agent_dir = str(REPO / "agent")
    dead = subprocess.Popen([sys.executable, "-c", _SLOW_WRITER, str(tmp_path), agent_dir, "3"],
                            stdout=subprocess.PIPE, text=True)
    live = subprocess.Popen([sys.executable, "-c", _SLOW_WRITER, str(tmp_path), agent_dir, "5"],
                            stdout=subprocess.PIPE, text=True)
    try:
        assert dead.stdout is not None and live.stdout is not None
        assert dead.stdout.readline().strip() == "writing"
        assert live.stdout.readline().strip() == "writing"
        dead.kill()
        dead.wait(10)
        left = tmp_path / f".tmp-ckpt-3-{dead.pid}"
        assert left.is_dir()
        Checkpointer("j", tmp_path, install_signal=False).save(b"next", step=4)
        assert not left.exists()
        assert (tmp_path / f".tmp-ckpt-5-{live.pid}").is_dir()  # still being written
        assert [p.name for p in jobkit.list_checkpoints(tmp_path)] == ["ckpt-4"]
    finally:
        for p in (dead, live):
            p.kill()
            p.wait(10)


def test_a_replace_killed_between_its_renames_puts_the_old_checkpoint_back(tmp_path: Path) -> None:
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    pid = int(gone.stdout)
    ck = Checkpointer("j", tmp_path, install_signal=False, keep=5)
    ck.save(b"seven", step=7)
    os.rename(tmp_path / "ckpt-7", tmp_path / f".old-ckpt-7-{pid}")  # where the killed replace left it
    ck.save(b"eight", step=8)
    assert [p.name for p in jobkit.list_checkpoints(tmp_path)] == ["ckpt-7", "ckpt-8"]
    verify_checkpoint(tmp_path / "ckpt-7")
