"""data.decode=auto: where the training images read from disk are decoded, chosen from this host's CPUs per GPU.

On a GPU the model and nvjpeg share one device: GPU decoding held ResNet-50 near 0.7x its compute ceiling, while
15 CPU workers per GPU fed it at 0.97x and 4 at 0.45x (bench/results/decode-default_4xh200_2026-11-28.md).
"""

from __future__ import annotations

MIN_CPU_WORKERS = 6  # CPU workers per GPU from which CPU decoding outruns decoding on the GPU


def auto_decode(device_type: str, cpu_workers: int, cpu_only: str | None = None) -> tuple[str, str]:
    """(data.decode, the reason in a few words). cpu_workers: the DataLoader workers this process gets when they
    decode; cpu_only: an option that needs the CPU workers to decode (its name), if any."""
    if device_type != "cuda":
        return "cpu", "no GPU"
    if cpu_only:
        return "cpu", f"{cpu_only} runs in the CPU workers"
    if cpu_workers >= MIN_CPU_WORKERS:
        return "cpu", f"{cpu_workers} CPU workers per GPU decode faster than the GPU beside the model"
    return "gpu", f"{cpu_workers} CPU workers per GPU (fewer than {MIN_CPU_WORKERS}) decode slower than the GPU"
