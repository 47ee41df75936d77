"""torch.compile's cache keys are hashed in the background from the start of a compiled run, not in its first step."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, sys, time
from src.run.compile_keys import _key_functions, prefetch_compile_keys
functions = _key_functions()
if sys.argv[1] == "thread":  # torch < 2.13: its key functions have no prefetch
    for f in functions:
        del f.prefetch
if sys.argv[1] in ("prefetch", "thread"):
    prefetch_compile_keys()
    time.sleep(float(sys.argv[2]))
start = time.perf_counter()
keys = [str(f()) for f in functions]
print(json.dumps({"seconds": time.perf_counter() - start, "keys": keys}))
"""


def _keys(*args: str) -> dict:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, *args], cwd=ROOT, capture_output=True, text=True, timeout=300, check=True
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


@pytest.mark.parametrize("how", ["prefetch", "thread"])
def test_prefetched_keys_are_ready_and_the_same(how):
    cold = _keys("cold")
    assert len(cold["keys"]) == 2  # torch's and Triton's source hashes
    # after a wait several times as long as the hashing, the first compile finds the keys computed
    warm = _keys(how, str(max(2.0, 5 * cold["seconds"])))
    assert warm["keys"] == cold["keys"]
    assert warm["seconds"] < cold["seconds"] / 5, (warm, cold)
