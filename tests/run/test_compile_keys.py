"""torch.compile's cache keys are imported and hashed in the background from the start of a compiled run, not in its
first step, and not in the main thread's setup either."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, sys, time
import torch
from src.run.compile_keys import prefetch_compile_keys
assert "torch._inductor.codecache" not in sys.modules
start = time.perf_counter()
if sys.argv[1] == "prefetch":
    prefetch_compile_keys()
returned = time.perf_counter() - start
time.sleep(float(sys.argv[2]))
start = time.perf_counter()  # what the first compile then does: import, and compute the keys
from src.run.compile_keys import _key_functions
keys = [str(f()) for f in _key_functions()]
print(json.dumps({"returned": returned, "seconds": time.perf_counter() - start, "keys": keys}))
"""


def _keys(*args: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, *args], cwd=ROOT, capture_output=True, text=True, timeout=300, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_prefetched_keys_are_ready_and_the_same():
    cold = _keys("cold", "0")
    assert len(cold["keys"]) == 2  # torch's and Triton's source hashes
    # the main thread goes on at once; after a wait several times as long, the first compile finds the keys ready
    warm = _keys("prefetch", str(max(2.0, 5 * cold["seconds"])))
    assert warm["keys"] == cold["keys"]
    assert warm["returned"] < cold["seconds"] / 5, (warm, cold)
    assert warm["seconds"] < cold["seconds"] / 5, (warm, cold)
