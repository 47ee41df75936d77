"""data.decode=auto: the choice for each kind of host, against the table the benchmark supports."""

from __future__ import annotations

import pytest

from src.data.loader_plan import MIN_CPU_WORKERS, auto_decode


@pytest.mark.parametrize(
    ("device", "workers", "cpu_only", "expected"),
    [
        ("cpu", 0, None, "cpu"),  # no GPU to decode on
        ("cuda", 15, None, "cpu"),  # a 64-CPU host with 4 GPUs
        ("cuda", MIN_CPU_WORKERS, None, "cpu"),
        ("cuda", MIN_CPU_WORKERS - 1, None, "gpu"),  # too few CPUs per GPU
        ("cuda", 0, None, "gpu"),  # data.num_workers=0: nothing else decodes off the training process
        ("cuda", 2, "data.auto_augment=trivial", "cpu"),  # runs in the workers after their crops
        ("cuda", 0, "data.crop=workers", "cpu"),
    ],
)
def test_auto_decode_by_host(device, workers, cpu_only, expected):
    decode, why = auto_decode(device, workers, cpu_only)
    assert decode == expected and why and "\n" not in why
