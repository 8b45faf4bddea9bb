"""laminar.agent.release_freed_memory gives the C allocator's freed heap back to the OS: memory
freed behind an allocation still in use (which glibc's free() never returns, only its top) leaves
the process's resident set. Run in a fresh child process so the heap is its own."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, re
from laminar.agent import release_freed_memory

def heap_kib():
    rss, cur = 0, False
    for line in open('/proc/self/smaps'):
        if re.match(r'^[0-9a-f]+-[0-9a-f]+ ', line):
            cur = line.rstrip().endswith('[heap]')
        elif cur and line.startswith('Rss:'):
            rss += int(line.split()[1])
    return rss

# 512 blocks of 64 KiB (below glibc's mmap threshold: in the main heap), each followed by a small
# allocation that stays: freeing the blocks leaves up to 32 MiB of holes that free() cannot give
# back (free() itself trims the run of them that ends at the heap's top: where the small ones
# land, in holes import left or after each block, depends on the hash seed's allocation order)
start = heap_kib()
blocks, keep = [], []
for i in range(512):
    blocks.append(b'x' * 65536)
    keep.append(b'k' * 1024)
del blocks
before = heap_kib()
released = release_freed_memory()
print(json.dumps({'start': start, 'before': before, 'after': heap_kib(), 'released': released,
                  'kept': len(keep)}))
"""


def test_freed_heap_behind_live_objects_leaves_the_resident_set() -> None:
    r = subprocess.run([sys.executable, "-c", CHILD], capture_output=True, text=True, timeout=60,
                       env={"PYTHONPATH": str(REPO / "agent"), "PATH": "/usr/bin:/bin"})
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    if out["released"] is None:
        pytest.skip("the C library has no malloc_trim (not glibc): the agent keeps freed memory there")
    # The holes free() kept (20 to 32 MiB in 20 runs) were resident before; after, the heap is
    # back to its size at the start plus what stays (512 KiB kept, some slack). What the function
    # answers is the process's resident drop, which includes them. (Asserting 16 MiB of holes
    # failed about one run in four: free() had trimmed more than half of them itself.)
    holes = out["before"] - out["start"]
    assert holes >= 8 * 1024, out  # the test's premise: free() left holes behind live objects
    assert out["after"] - out["start"] <= 2 * 1024, out
    assert out["released"] >= holes - 2 * 1024, out
