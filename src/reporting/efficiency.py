"""How well a run uses its hardware: FLOPs of a training step, the GPU's peak, MFU, and peak memory; and the
hardware itself (`host`), recorded beside every number measured on it."""

from __future__ import annotations

import os
import platform
import re
import resource
import sys

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.flop_counter import FlopCounterMode

from src.data.loader_plan import cpus_of_this_process

GIB = 2**30


HOST_FIELDS = ("device_name", "gpu_count", "cpu_model", "cpus", "cpus_usable", "hostname", "torch_version")


def host(device: torch.device | None = None) -> dict:
    """The machine a number is measured on (HOST_FIELDS): a loader's speed depends on its CPUs as much as on its
    GPUs."""
    cuda = device is not None and device.type == "cuda"
    return {
        "device_name": torch.cuda.get_device_name(device) if cuda else "cpu",
        "gpu_count": torch.cuda.device_count(),
        "cpu_model": cpu_model(),
        "cpus": os.cpu_count(),
        "cpus_usable": cpus_of_this_process(1),  # its affinity (a SLURM task's --cpus-per-task, taskset)
        "hostname": platform.node(),
        "torch_version": torch.__version__,
    }


def cpus_named(machine: dict) -> str:
    """'64 CPUs (Intel Xeon ...)' from a `host()` record; the model only where one is known."""
    model = f" ({machine['cpu_model']})" if machine.get("cpu_model") else ""
    return f"{machine['cpus']} CPUs{model}"


def cpu_model() -> str | None:
    """The CPU's marketing name: /proc/cpuinfo's on Linux x86, else what the platform says (on ARM Linux its
    architecture, e.g. aarch64; None if nothing)."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                if key.strip() == "model name":
                    return value.strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or None


def train_step_flops(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> int:
    """FLOPs of one training step on the batch (x, y): forward, cross-entropy and backward, as torch's
    FlopCounterMode counts them (matmuls, convolutions, attention; elementwise and norm layers count 0).
    Call it on the bare model (before DDP/FSDP/compile wrap it). Its gradients, buffers (BatchNorm
    statistics) and the random generators are left as they were, so the run is unchanged."""
    params = [p for p in model.parameters() if p.requires_grad]
    grads = [p.grad for p in params]
    buffers = [b.detach().clone() for b in model.buffers()]
    rng_devices = [x.device] if x.device.type == "cuda" else []  # dropout and the like draw from these
    with torch.random.fork_rng(devices=rng_devices), FlopCounterMode(display=False) as counter:
        for p in params:
            p.grad = None
        F.cross_entropy(model(x), y).backward()
    with torch.no_grad():
        for p, g in zip(params, grads):
            p.grad = g
        for b, saved in zip(model.buffers(), buffers):
            b.copy_(saved)
    return counter.get_total_flops()


# Dense (no 2:4 sparsity) tensor-core peaks in TFLOPS from the vendors' datasheets, per GPU. fp32 is the
# CUDA-core rate; a missing key means the GPU has no fast path for that type (V100/T4 have no bf16 or tf32).
PEAK_TFLOPS: dict[str, dict[str, float]] = {
    "H100 SXM": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "H100 PCIe": {"bf16": 756.5, "fp16": 756.5, "tf32": 378.0, "fp32": 51.2},
    "H100 NVL": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    "H200": {"bf16": 989.4, "fp16": 989.4, "tf32": 494.7, "fp32": 66.9},
    "H200 NVL": {"bf16": 835.5, "fp16": 835.5, "tf32": 417.5, "fp32": 60.0},
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "A10": {"bf16": 125.0, "fp16": 125.0, "tf32": 62.5, "fp32": 31.2},
    "L40S": {"bf16": 362.05, "fp16": 362.05, "tf32": 183.0, "fp32": 91.6},
    "L40": {"bf16": 181.05, "fp16": 181.05, "tf32": 90.5, "fp32": 90.5},
    "L4": {"bf16": 121.0, "fp16": 121.0, "tf32": 60.0, "fp32": 30.3},
    "RTX 4090": {"bf16": 165.2, "fp16": 165.2, "tf32": 82.6, "fp32": 82.6},  # fp32 accumulate, as torch uses
    "V100 SXM2": {"fp16": 125.0, "fp32": 15.7},
    "V100 PCIe": {"fp16": 112.0, "fp32": 14.0},
    "T4": {"fp16": 65.0, "fp32": 8.1},
}

# torch.cuda.get_device_name spellings (e.g. "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "Tesla T4")
# to a row above. The first match wins, so variants come before the plain name; \b keeps L4 from L40, A10
# from A100 and A10G (whose peak NVIDIA does not publish).
_NAME_PATTERNS = [
    (r"H100.*PCIe", "H100 PCIe"),
    (r"H100 NVL", "H100 NVL"),
    (r"H200 NVL", "H200 NVL"),
    (r"\bH100\b|\bGH200\b", "H100 SXM"),
    (r"\bH200\b", "H200"),
    (r"\bA100\b", "A100"),
    (r"\bA10\b", "A10"),
    (r"\bL40S\b", "L40S"),
    (r"\bL40\b", "L40"),
    (r"\bL4\b", "L4"),
    (r"RTX 4090\b", "RTX 4090"),
    (r"V100.*PCIE", "V100 PCIe"),
    (r"\bV100", "V100 SXM2"),
    (r"\bT4\b", "T4"),
]

_DTYPE_KEYS = {
    torch.bfloat16: "bf16",
    torch.float16: "fp16",
    "bf16": "bf16",
    "fp16": "fp16",
    "tf32": "tf32",
    "fp32": "fp32",
}


def _precision(dtype: torch.dtype | str) -> str:
    if dtype in (torch.float32, "float32"):
        # cuDNN runs fp32 convolutions in tf32 by default; rating them against the slower fp32 units
        # would give an MFU above 1
        tf32 = torch.backends.cudnn.allow_tf32 or torch.backends.cuda.matmul.allow_tf32
        return "tf32" if tf32 else "fp32"
    if dtype not in _DTYPE_KEYS:
        raise ValueError(f"no peak for dtype {dtype!r}; use bf16, fp16, tf32 or fp32")
    return _DTYPE_KEYS[dtype]


def peak_flops(device_name: str, dtype: torch.dtype | str) -> float | None:
    """Peak FLOP/s of one GPU named as torch.cuda.get_device_name reports it, for the compute dtype
    (torch.bfloat16 under bf16 autocast; torch.float32 means tf32 when torch allows it). None for a CPU or a
    GPU not in PEAK_TFLOPS: MFU is then not reported."""
    row = next((key for pattern, key in _NAME_PATTERNS if re.search(pattern, device_name, re.IGNORECASE)), None)
    if row is None:
        return None
    precision = _precision(dtype)
    if precision == "tf32" and "tf32" not in PEAK_TFLOPS[row]:
        precision = "fp32"  # before Ampere there is no tf32: torch's tf32 switches leave fp32 as it is
    tflops = PEAK_TFLOPS[row].get(precision)
    return tflops * 1e12 if tflops else None


def mfu(flops_per_step: float, steps_per_sec: float, peak: float) -> float:
    """Model FLOPs utilisation: achieved FLOP/s over the peak. flops_per_step and peak must cover the same
    devices (one device's share and one GPU's peak, or the whole step and world_size x the peak)."""
    return flops_per_step * steps_per_sec / peak


def reset_peak(device: torch.device | str) -> None:
    """Start a new peak-memory window on a CUDA device. A no-op on CPU: the kernel keeps one peak RSS per
    process, which cannot be reset."""
    if torch.device(device).type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def memory_stats(device: torch.device | str) -> dict[str, float]:
    """Peak memory in GiB. CUDA: tensors allocated and memory reserved by torch's caching allocator since the
    last reset_peak. CPU: the whole process's peak resident set (host memory, since the process started)."""
    device = torch.device(device)
    if device.type == "cuda":
        return {
            "peak_mem_gb": torch.cuda.max_memory_allocated(device) / GIB,
            "peak_mem_reserved_gb": torch.cuda.max_memory_reserved(device) / GIB,
        }
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"peak_host_mem_gb": rss * (1 if sys.platform == "darwin" else 1024) / GIB}  # macOS: bytes, Linux: KiB


def out_of_memory_line(exc: BaseException, where: str, device: torch.device, images: int, fixes: list[str]) -> str:
    """One line for a step that ran out of memory: where, how full the device was, how many images per device,
    and the overrides that need less memory."""
    line = f"{'CUDA' if device.type == 'cuda' else device.type.upper()} out of memory in {where} ({device})"
    if device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory / GIB
        line += f" at {torch.cuda.max_memory_allocated(device) / GIB:.1f} of {total:.1f} GiB allocated"
    tried = re.search(r"[Tt]ried to allocate ([\d.]+ [KMGT]?i?B)", str(exc))
    if tried:
        line += f", {tried.group(1)} more requested"
    return f"{line}, {images} images per device: {'; '.join(fixes[:-1])}{'; or ' if fixes[1:] else ''}{fixes[-1]}"
