"""What `python train.py` does: validate, then train in this process or start the ranks.

- No launcher around us and one process needed: train here.
- No launcher and N processes needed (ddp/fsdp): start N workers with torch's elastic launcher
  (the machinery behind torchrun), restarting them up to trainer.max_restarts times.
- Already a rank (torchrun, srun, submitit): train here, never spawn again.
"""
from __future__ import annotations

import contextlib
import logging
import os
import sys
import uuid

from omegaconf import DictConfig, OmegaConf

from src.config import ConfigError, plan_layout
from src.distributed import rank_env
from src.resume import reconcile
from src.runlock import RunLock
from src.strategies import build_strategy
from src.trainer import train

log = logging.getLogger("ddplab")
LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"


def _hydra_mode() -> str | None:
    from hydra.core.hydra_config import HydraConfig

    return str(HydraConfig.get().mode.name) if HydraConfig.initialized() else None


def _command_line_overrides() -> list[str] | None:
    from hydra.core.hydra_config import HydraConfig

    return list(HydraConfig.get().overrides.task) if HydraConfig.initialized() else None


def main(cfg: DictConfig) -> dict:
    env = rank_env()
    if env.launcher in ("torchelastic", "env") and _hydra_mode() == "MULTIRUN":
        raise ConfigError("a Hydra multirun (-m) under torchrun would run the whole sweep in every rank; "
                          "run `python train.py -m ...` without torchrun (ranks are started per job)")
    cfg = reconcile(cfg, _command_line_overrides())  # a re-run in a run dir continues that run
    layout = plan_layout(cfg, env.world_size if env.external else None,
                         env.local_world_size if env.external else None)
    build_strategy(cfg.strategy).preflight(cfg)  # e.g. can FSDP shard this model?
    if cfg.train and cfg.trainer.resume not in (None, "none", "auto"):
        from src.checkpoint import load
        load(cfg.trainer.resume)  # unreadable or foreign file: fail before any process starts
    # one live run per run dir: held by the process the user started (or rank 0 of an external launcher),
    # so the local launcher keeps it across worker restarts
    lock = RunLock(cfg.paths.output_dir) if cfg.train and env.is_primary else contextlib.nullcontext()
    with lock:
        if env.external or layout.world_size == 1:
            return train(cfg)
        return spawn(cfg, layout.world_size)


def _setup_worker_logging(run_dir: str, rank: int) -> None:
    name = "train.log" if rank == 0 else f"train_rank{rank}.log"
    os.makedirs(run_dir, exist_ok=True)
    handlers = [logging.FileHandler(os.path.join(run_dir, name))]
    if rank == 0:
        handlers.append(logging.StreamHandler(sys.stdout))
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, handlers=handlers, force=True)


def _worker(config: dict) -> dict:
    """Entry point of each rank started by the elastic launcher."""
    rank = int(os.environ["RANK"])
    _setup_worker_logging(config["paths"]["output_dir"], rank)
    try:
        return train(OmegaConf.create(config))
    except ConfigError as exc:
        logging.getLogger("ddplab").error("%s", exc)
        raise


def spawn(cfg: DictConfig, nproc: int) -> dict:
    """Start `nproc` ranks on this machine; return rank 0's metrics."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = OmegaConf.to_container(cfg, resolve=True)  # every rank gets the same, fully resolved config
    launch = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=str(uuid.uuid4()),
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", rdzv_configs={"is_host": True},
                          max_restarts=cfg.trainer.max_restarts, monitor_interval=0.5, start_method="spawn")
    log.info("starting %d processes with torch's elastic launcher (max_restarts=%d)", nproc, cfg.trainer.max_restarts)
    try:
        results = elastic_launch(launch, _worker)(config)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        message = failure.message.get("message", "") if isinstance(failure.message, dict) else str(failure.message)
        last = message.strip().splitlines()[-1] if message.strip() else f"exit code {failure.exitcode}"
        if last.startswith("ConfigError: "):  # a bad input found inside the ranks: still one line
            raise ConfigError(last.removeprefix("ConfigError: ")) from None
        raise RuntimeError(f"rank {rank} failed: {last} (its log: {cfg.paths.output_dir})") from None
    return results[0]
