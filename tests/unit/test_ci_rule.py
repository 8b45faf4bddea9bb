"""The suite's CI rule: with CI=true a skipped kernel test fails the run; elsewhere it only skips."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]


def _run(tmp_path: Path, ci: bool) -> subprocess.CompletedProcess[str]:
    shutil.copy(HERE / "conftest.py", tmp_path / "conftest.py")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    kernel: k\n    cluster: c\n    gpu: g\n")
    (tmp_path / "test_k.py").write_text(
        "import pytest\n\n@pytest.mark.kernel\ndef test_needs_kernel():\n    pytest.skip('no BPF here')\n\n"
        "@pytest.mark.gpu\ndef test_needs_gpu():\n    pytest.skip('no GPU here')\n")
    env = {k: v for k, v in os.environ.items() if k != "CI"}
    if ci:
        env["CI"] = "true"
    return subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", str(tmp_path)],
                          capture_output=True, text=True, env=env, cwd=tmp_path)


def test_skipped_kernel_test_fails_in_ci(tmp_path: Path) -> None:
    r = _run(tmp_path, ci=True)
    assert r.returncode == 1, r.stdout
    assert "skipped in CI" in r.stdout
    # Failed in the call or (when the machine lacks what kernel tests need) at setup: either fails the run.
    assert "1 failed" in r.stdout or "1 error" in r.stdout
    assert "1 skipped" in r.stdout  # the GPU test may skip: no CI machine has a GPU


def test_skipped_kernel_test_only_skips_outside_ci(tmp_path: Path) -> None:
    r = _run(tmp_path, ci=False)
    assert r.returncode == 0, r.stdout
    assert "2 skipped" in r.stdout
