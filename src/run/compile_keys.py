"""torch.compile keys its caches by hashes of torch's and Triton's source files. A process computes them once, on its
first compile: inside the first training step, unless started earlier. `prefetch_compile_keys` starts them in the
background, so the hashing overlaps loading the data instead."""

from __future__ import annotations

import threading


def _key_functions() -> list:
    """torch's cached key functions (private API: none where it has moved)."""
    try:
        from torch._inductor import codecache
        from torch._inductor.runtime import triton_compat
    except ImportError:
        return []
    triton_key = getattr(codecache, "triton_key", None)  # torch >= 2.13; before, Triton's own cached function
    if triton_key is None and getattr(triton_compat, "HAS_TRITON", False):
        triton_key = triton_compat.triton_key
    return [f for f in (getattr(codecache, "torch_key", None), triton_key) if callable(f)]


def _compute(functions: list) -> None:
    for f in functions:
        try:
            f()
        except Exception:  # noqa: BLE001 - the first compile computes it again and reports any error itself
            return


def prefetch_compile_keys() -> None:
    """Start the cache keys' hashing; the first compile then finds them computed (torch >= 2.13 waits for its own
    prefetch; before, a compile that comes first computes them alongside, as it would have anyway)."""
    functions = _key_functions()
    if functions and all(hasattr(f, "prefetch") for f in functions):
        for f in functions:
            f.prefetch()
    elif functions:
        threading.Thread(target=_compute, args=(functions,), name="compile-keys", daemon=True).start()
