"""A checkpoint on storage that fails with EIO: it is never restored or committed, and a
transfer that met the failure resumes once the storage heals (issue 6).

The failing storage is real: a FUSE mount (tests/fuserig.py) mirroring a real checkpoint,
whose server answers EIO to reads of one file at or past a chosen offset (a bad sector
there), until the test heals it. The sender, the Receiver (loopback) and jobkit are the
project's own code on real files.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path

import pytest
from fuserig import eio_mount
from xferrig import KEY, make_ckpt, with_receiver

from laminar import jobkit
from laminar.migrate.transfer import (
    Receiver,
    SendResult,
    TransferError,
    build_manifest,
    latest_verified,
    send_checkpoint,
    verified_checkpoint,
)
from laminar.migrate.transfer.committed import TRUST_UNCHANGED_S

pytestmark = pytest.mark.kernel

KB = 1 << 10
SHARD = "src/ckpt-40/state.bin"  # make_ckpt's checkpoint, relative to the mount


def nothing_committed(root: Path) -> None:
    """The receiver at ``root`` holds no checkpoint of j1 that it would hand to LAMINAR_RESUME_FROM."""
    assert latest_verified(root, "j1") is None
    assert not list((root / "checkpoints" / "j1").glob("ckpt-*")), "a checkpoint directory under the committed place"


def test_eio_mid_transfer_fails_naming_the_file_and_a_retry_after_healing_resumes(tmp_path: Path) -> None:
    """The storage fails after the manifest was built (the sender reads each chunk again to
    send it): the transfer fails naming the file and the error, the receiver commits nothing,
    and once the storage heals a new send resumes from the chunks the receiver kept."""
    ck = make_ckpt(tmp_path / "backing", 640 * KB)
    want = (ck / "state.bin").read_bytes()
    with eio_mount(tmp_path / "backing") as fs:
        src = fs.path / "src/ckpt-40"
        m = build_manifest(src, "j1", 32 * KB)  # healthy storage: the manifest is built
        fs.fail(SHARD, 300 * KB)

        async def body(rcv: Receiver, port: int) -> tuple[str, SendResult]:
            with pytest.raises(TransferError) as failed:
                await send_checkpoint("127.0.0.1", port, src, "j1", KEY, chunk_size=32 * KB, retries=1,
                                      retry_delay_s=0.05, manifest=m)
            assert fs.eio_count > 0, "the sender never read past the bad offset"
            nothing_committed(tmp_path / "rcv")
            assert not rcv.committed
            fs.heal()
            return str(failed.value), await send_checkpoint("127.0.0.1", port, src, "j1", KEY, chunk_size=32 * KB,
                                                            retries=0)

        why, res = asyncio.run(with_receiver(tmp_path / "rcv", body))
    assert "state.bin" in why and "Input/output error" in why, why
    assert res.skipped_bytes >= 256 * KB, "the retry did not resume from what the receiver kept"
    dst = verified_checkpoint(res.remote_path)
    assert latest_verified(tmp_path / "rcv", "j1") == dst
    assert (dst / "state.bin").read_bytes() == want
    assert (dst / jobkit.MANIFEST).read_bytes() == (ck / jobkit.MANIFEST).read_bytes()
    assert jobkit.Checkpointer(ckpt_dir=tmp_path / "j", resume_from=dst, install_signal=False).resume() == want


def test_eio_while_the_manifest_is_built_refuses_the_checkpoint_naming_the_file(tmp_path: Path) -> None:
    """A shard that cannot be read when the sender first hashes it: refused at once (no
    connection's worth of retries), naming the file; after healing it is sent whole."""
    ck = make_ckpt(tmp_path / "backing", 200 * KB)
    with eio_mount(tmp_path / "backing") as fs:
        src = fs.path / "src/ckpt-40"
        fs.fail(SHARD, 100 * KB)

        async def body(rcv: Receiver, port: int) -> SendResult:
            with pytest.raises(TransferError) as failed:
                await send_checkpoint("127.0.0.1", port, src, "j1", KEY, chunk_size=32 * KB, retries=3,
                                      retry_delay_s=0.05)
            assert failed.value.fatal and "state.bin" in str(failed.value), failed.value
            assert fs.eio_count > 0
            nothing_committed(tmp_path / "rcv")
            fs.heal()
            return await send_checkpoint("127.0.0.1", port, src, "j1", KEY, chunk_size=32 * KB, retries=0)

        res = asyncio.run(with_receiver(tmp_path / "rcv", body))
    assert (verified_checkpoint(res.remote_path) / "state.bin").read_bytes() == (ck / "state.bin").read_bytes()


def test_jobkit_never_resumes_a_checkpoint_it_cannot_read_and_falls_back_to_the_previous(tmp_path: Path) -> None:
    """jobkit's verify refuses a checkpoint whose shard fails with EIO, naming it; resuming from
    a directory of checkpoints takes the newest that verifies (the previous one); resuming from
    the failing checkpoint itself raises CheckpointError and loads nothing. The agent's own
    check before LAMINAR_RESUME_FROM (verified_checkpoint, latest_verified) refuses it too."""
    ck = jobkit.Checkpointer(job_id="j1", ckpt_dir=tmp_path / "backing/ck", install_signal=False)
    old, new = b"step-40 " * 20_000, b"step-80 " * 40_000
    ck.save(old, step=40)
    ck.save(new, step=80)
    with eio_mount(tmp_path / "backing") as fs:
        d = fs.path / "ck"
        assert jobkit.latest_checkpoint(d) == d / "ckpt-80"  # healthy: the newest
        fs.fail("ck/ckpt-80/state.bin", 200 * KB)
        with pytest.raises(jobkit.CheckpointError, match=r"state\.bin.*Input/output error"):
            jobkit.verify_checkpoint(d / "ckpt-80")
        assert jobkit.latest_checkpoint(d) == d / "ckpt-40"
        fell_back = jobkit.Checkpointer(job_id="j1", ckpt_dir=tmp_path / "j", resume_from=d, install_signal=False)
        assert fell_back.resume() == old and fell_back.resumed_step == 40
        named = jobkit.Checkpointer(job_id="j1", ckpt_dir=tmp_path / "j", resume_from=d / "ckpt-80",
                                    install_signal=False)
        with pytest.raises(jobkit.CheckpointError, match=r"ckpt-80.*state\.bin"):
            named.resume()
        assert named.resumed_step is None
        assert fs.eio_count > 0
        fs.heal()
        assert jobkit.Checkpointer(job_id="j1", ckpt_dir=tmp_path / "j", resume_from=d,
                                   install_signal=False).resume() == new


def test_a_committed_transfer_on_failing_storage_is_not_handed_to_resume(tmp_path: Path) -> None:
    """The receiver's committed copy later sits on storage that fails: the agent's check
    (past the window in which an unchanged copy is trusted without hashing) refuses it."""
    ck = make_ckpt(tmp_path, 200 * KB)

    async def body(rcv: Receiver, port: int) -> SendResult:
        return await send_checkpoint("127.0.0.1", port, ck, "j1", KEY, chunk_size=32 * KB, retries=0)

    res = asyncio.run(with_receiver(tmp_path / "backing", body))
    rel = Path(res.remote_path).relative_to(tmp_path / "backing")
    with eio_mount(tmp_path / "backing") as fs:
        later = time.time() + TRUST_UNCHANGED_S + 1
        assert verified_checkpoint(fs.path / rel, now=later) == fs.path / rel  # healthy
        fs.fail(f"{rel}/state.bin", 50 * KB)
        with pytest.raises(TransferError, match=r"state\.bin"):
            verified_checkpoint(fs.path / rel, now=later)
        assert fs.eio_count > 0
        with pytest.raises(jobkit.CheckpointError, match=r"state\.bin"):
            jobkit.Checkpointer(ckpt_dir=tmp_path / "j", resume_from=fs.path / rel, install_signal=False).resume()


def test_an_unreadable_manifest_is_refused_by_the_sender_and_skipped_by_jobkit(tmp_path: Path) -> None:
    """EIO on the checkpoint's MANIFEST.json: the sender refuses the checkpoint naming the file
    (before connecting), jobkit skips it for the previous one."""
    ck = jobkit.Checkpointer(job_id="j1", ckpt_dir=tmp_path / "backing/ck", install_signal=False)
    ck.save(b"old" * 1000, step=40)
    ck.save(b"new" * 1000, step=80)
    with eio_mount(tmp_path / "backing") as fs:
        fs.fail(f"ck/ckpt-80/{jobkit.MANIFEST}", 0)
        with pytest.raises(TransferError, match=r"refusing to send .*ckpt-80.*MANIFEST\.json.*Input/output error") as e:
            asyncio.run(send_checkpoint("127.0.0.1", 9, fs.path / "ck/ckpt-80", "j1", KEY, retries=0))
        assert e.value.fatal
        assert jobkit.latest_checkpoint(fs.path / "ck") == fs.path / "ck/ckpt-40"
        assert fs.eio_count > 0
