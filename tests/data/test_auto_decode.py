"""data.decode=auto: the choice for each kind of host, against the table the benchmark supports."""

from __future__ import annotations

import pytest
import torch

from src.data.loader_plan import MIN_CPU_WORKERS, MIN_CPU_WORKERS_OVER_DALI, LoaderOptions, auto_decode, resolve_plan


@pytest.mark.parametrize(
    ("device", "workers", "cpu_only", "dali", "expected"),
    [
        ("cpu", 0, None, True, "cpu"),  # no GPU to decode on
        ("cuda", 15, None, True, "cpu"),  # a 64-CPU host with 4 GPUs
        ("cuda", 7, None, True, "dali"),  # 8 CPUs per GPU: DALI, 1.44x CPU decoding
        ("cuda", 13, None, True, "dali"),  # 14: 1.14x
        ("cuda", 7, None, False, "cpu"),  # without DALI, CPU decoding is as fast as the GPU-decoding workers there
        ("cuda", MIN_CPU_WORKERS_OVER_DALI, None, True, "cpu"),
        ("cuda", MIN_CPU_WORKERS_OVER_DALI - 1, None, True, "dali"),
        ("cuda", MIN_CPU_WORKERS, None, False, "cpu"),
        ("cuda", MIN_CPU_WORKERS - 1, None, False, "gpu"),  # too few CPUs per GPU and no DALI: GPU-decoding workers
        ("cuda", 3, None, True, "dali"),
        ("cuda", 0, None, False, "gpu"),  # data.num_workers=0: nothing else decodes off the training process
        ("cuda", 2, "data.auto_augment=trivial", True, "cpu"),  # runs in the workers after their crops
        ("cuda", 0, "data.crop=workers", True, "cpu"),
    ],
)
def test_auto_decode_by_host(device, workers, cpu_only, dali, expected):
    decode, why = auto_decode(device, workers, cpu_only, dali)
    assert decode == expected and why and "\n" not in why


@pytest.mark.parametrize(("skip", "expected"), [(False, "decode-dali"), (True, "decode-gpu")])
def test_few_cpus_decode_with_dali_unless_bad_images_are_to_be_skipped(skip, expected):
    """DALI stops at an unreadable image: data.skip_bad_images=true keeps ddplab's own GPU decoding."""
    pytest.importorskip("nvidia.dali", reason="needs DALI (requirements.txt installs it on Linux x86-64 only)")
    options = LoaderOptions(loader="auto", num_workers=3, skip_bad_images=skip)
    plan = resolve_plan(options, torch.device("cuda", 0), in_memory=False, encoded=True, trivial=False)
    assert plan.name == expected and plan.workers == 3
