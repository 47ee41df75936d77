"""torch.compile keys its caches by hashes of torch's and Triton's source files. A process imports the code that
computes them and computes them once, at its first compile: inside the first training step, unless started earlier.
`prefetch_compile_keys` does both in a background thread, so they overlap loading the data instead."""

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


def _compute() -> None:
    try:
        for f in _key_functions():
            f()
    except Exception:  # noqa: BLE001 - the first compile computes them again and reports any error itself
        return


def prefetch_compile_keys() -> None:
    """Import and compute the cache keys in the background; the first compile then finds them ready (a compile that
    comes first waits for the import, and on torch < 2.13 computes the keys alongside, as it would have anyway)."""
    threading.Thread(target=_compute, name="compile-keys", daemon=True).start()
