"""A node without NVIDIA's driver never imports pynvml (about 2 MB for the agent's whole life).

GPU discovery (`laminar.runtime.gpus`) used to import pynvml first and let its nvmlInit fail;
now it tries to load NVML's library (libnvidia-ml.so.1) itself, and only where that loads does
it import pynvml. Run in a fresh interpreter, so no other test's import is counted. Where this
machine has the library (a GPU node), the test says so and checks only that it is used.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

AGENT = Path(__file__).resolve().parents[2] / "agent"

PROBE = f"""
import json, sys
sys.path.insert(0, {str(AGENT)!r})
from laminar.runtime import gpus
have = gpus.nvml_library()
found, note = gpus.nvml_gpus()
mem = gpus.nvml_process_memory()
gpus.discover(None)
print(json.dumps({{"have": have, "found": len(found), "note": note, "mem": mem,
                  "pynvml": "pynvml" in sys.modules}}))
"""


def test_without_nvmls_library_pynvml_is_never_imported() -> None:
    r = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout.strip().splitlines()[-1])
    if out["have"]:
        assert out["pynvml"], out  # a GPU node: NVML is used as before
        return
    assert out == {"have": False, "found": 0, "note": "NVML: NVML Shared Library Not Found", "mem": {},
                   "pynvml": False}, out
