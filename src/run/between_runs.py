"""What one process carries from one run to the next (a local Hydra multirun, a notebook): torch.compile's graphs,
kept only for a config that differs in nothing but the seed, and none of a run's process-wide torch settings."""

from __future__ import annotations

import contextlib
import json
import logging

import torch
from omegaconf import DictConfig, OmegaConf

log = logging.getLogger("ddplab")

# the config (less its seed) of the last run whose compiled graphs this process keeps, or None
_kept_graphs: dict[str, str | None] = {"of": None}


def compile_key(cfg: DictConfig) -> str | None:
    """What decides a compiled run's graphs: its config as written, less the seed and the paths that name it."""
    if not cfg.trainer.compile:
        return None
    written = OmegaConf.to_container(cfg, resolve=False)
    for name in ("seed", "paths"):
        written.pop(name, None)
    return json.dumps(written, sort_keys=True, default=str)


def graphs_for(cfg: DictConfig) -> str | None:
    """At a run's start: forget graphs kept for another config (or a run without compile); say so where this run
    reuses the previous one's. Returns the run's compile_key."""
    key = compile_key(cfg)
    if _kept_graphs["of"] not in (None, key):
        forget_compiled()
    elif _kept_graphs["of"] is not None:
        log.info("torch.compile: this job reuses the previous job's compiled graphs (the configs differ only in seed)")
    return key


def after_run(key: str | None, keep: bool) -> None:
    """At a run's end: keep its compiled graphs for the next run (`keep`: it finished and another may follow) where
    device memory allows, or forget them."""
    if key is None:  # a run without compile has forgotten kept graphs at its start
        return
    if keep and room_for_another_graph_pool():
        _kept_graphs["of"] = key
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # what this run's tensors left in the allocator's cache
    else:
        forget_compiled()


def room_for_another_graph_pool() -> bool:
    """Kept graphs hold their CUDA-graph memory pool while the next run records its own, so the next run may
    reserve up to twice this run's device memory: keep them only where that fits."""
    if not torch.cuda.is_available():
        return True
    device = torch.cuda.current_device()
    return 2 * torch.cuda.max_memory_reserved(device) <= 0.9 * torch.cuda.get_device_properties(device).total_memory


def forget_compiled() -> None:
    """The next run compiles afresh, as its own process would. Graphs kept for other configs would count toward
    recompile_limit, after which functions run eagerly, and their CUDA-graph pools would stay held."""
    torch._dynamo.reset()
    _kept_graphs["of"] = None


@contextlib.contextmanager
def process_settings_restored():
    """A run sets process-wide torch settings (determinism, cuDNN benchmark, TF32, threads); the next run in
    the same process starts from the process's own, not this run's."""
    cudnn, matmul = torch.backends.cudnn, torch.backends.cuda.matmul
    deterministic = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    saved = cudnn.benchmark, cudnn.allow_tf32, matmul.allow_tf32, torch.get_num_threads()
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(deterministic[0], warn_only=deterministic[1])
        cudnn.benchmark, cudnn.allow_tf32, matmul.allow_tf32, threads = saved
        torch.set_num_threads(threads)
