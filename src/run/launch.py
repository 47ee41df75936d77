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
import signal
import sys
import threading
import time
import uuid

from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from src.config.cli import UNDER_TORCHRUN
from src.config.errors import ConfigError
from src.distributed import rank_env
from src.models import preflight as model_preflight
from src.run.plan import check_starting_point, plan_layout
from src.run.trainer import train
from src.state.resume import already_completed, reconcile
from src.state.runlock import RunLock, hold_as_rank
from src.state.signals import (
    ELASTIC_SIGNALS,
    STOP_SIGNALS,
    ForwardStops,
    Interrupted,
    carrier,
    interrupt_outside_training,
)

log = logging.getLogger("ddplab")
LOG_FORMAT = "[%(asctime)s][%(name)s][%(levelname)s] - %(message)s"


def _hydra_mode() -> str | None:
    from hydra.core.hydra_config import HydraConfig

    return str(HydraConfig.get().mode.name) if HydraConfig.initialized() else None


def _command_line_overrides() -> list[str] | None:
    from hydra.core.hydra_config import HydraConfig

    if not HydraConfig.initialized():
        return None
    return OmegaConf.to_container(HydraConfig.get().overrides.task, resolve=False)  # as typed: `${...}` unresolved


def _resolvable(cfg: DictConfig) -> None:
    """An interpolation that cannot be resolved (`${oc.env:UNSET}`, `${no.such.key}`) is one line."""
    from omegaconf.errors import OmegaConfBaseException

    try:
        OmegaConf.to_container(cfg, resolve=True)
    except OmegaConfBaseException as exc:
        cause = " ".join(str(exc).splitlines()[0].split())
        raise ConfigError(f"{exc.full_key or 'the config'}: {cause}; set it or pass a value instead") from None


def main(cfg: DictConfig) -> dict:
    _resolvable(cfg)
    env = rank_env()
    if env.launcher in ("torchelastic", "env") and _hydra_mode() == "MULTIRUN":
        raise ConfigError(UNDER_TORCHRUN)  # a multirun the config chose (cluster=...); train.py refuses -m before
    check_starting_point(cfg)  # before a checkpoint in the run dir is compared with it
    done = already_completed(cfg, _command_line_overrides())
    if done is not None:  # a finished run is immutable: nothing runs, nothing in its dir changes
        final = done.get("final") or {}
        log.info(
            "%s holds a completed run (test top-1 %.2f %%, best epoch %s%s): nothing to do",
            cfg.paths.output_dir,
            final.get("test_top1", float("nan")),
            final.get("best_epoch"),
            f"; {done['stop_reason']}" if done.get("stop_reason") else "",
        )
        return final
    cfg = reconcile(cfg, _command_line_overrides())  # a re-run in a run dir continues that run
    plan = plan_layout(cfg, env)
    plan.strategy.preflight(cfg)  # e.g. can FSDP shard this model?
    if cfg.train:
        from src.state.checkpoint import load

        model_preflight(cfg.model)  # the starting point's files are here, model.freeze names modules of the model
        for given in (cfg.trainer.resume, cfg.trainer.get("init_from")):
            if given not in (None, "none", "auto"):
                load(given)  # unreadable or foreign file: fail before any process starts
    # one live run per run dir: held by the process the user started (or rank 0 of an external launcher),
    # so the local launcher keeps it across worker restarts
    lock = RunLock(cfg.paths.output_dir) if cfg.train and env.is_primary else contextlib.nullcontext()
    # started by the user: a stop signal before or after the training steps stops at once (Interrupted)
    signals = contextlib.nullcontext() if env.external else interrupt_outside_training()
    with signals, lock:
        if env.external or plan.layout.world_size == 1:
            # a local multirun's next job in this process may reuse this one's compiled graphs (a seed sweep)
            return train(cfg, plan, keep_compiled=_hydra_mode() == "MULTIRUN")
        return spawn(cfg, plan.layout.world_size)  # each rank is a process of its own and plans there


def _setup_worker_logging(run_dir: str, rank: int) -> None:
    name = "train.log" if rank == 0 else f"train_rank{rank}.log"
    os.makedirs(run_dir, exist_ok=True)
    handlers = [logging.FileHandler(os.path.join(run_dir, name))]
    if rank == 0:
        handlers.append(logging.StreamHandler(sys.stdout))
    logging.basicConfig(level=logging.INFO, format=LOG_FORMAT, handlers=handlers, force=True)


def _worker(config: dict) -> dict:
    """Entry point of each rank started by the elastic launcher. Stopped by a signal, it returns how (a clean
    exit: the agent must not restart the group) and the launcher exits 128 + the signal."""
    rank = int(os.environ["RANK"])
    # our own process group: a stop signal sent to the launcher's whole group (`timeout` at its limit,
    # `kill -TERM -<pgid>`, Ctrl-C) reaches the launcher alone, which forwards it as the carrier (ForwardStops);
    # a plain SIGTERM, fatal here, stays the agent's (it stops the survivors of a failed group)
    os.setpgid(0, 0)
    hold_as_rank(config["paths"]["output_dir"])  # a new launch into this dir waits until every rank has gone
    orphan_watch = _OrphanWatch()
    # tqdm would take a multiprocessing lock (a named semaphore in a spawned process), leaked with a warning at
    # exit whenever the agent stops a rank; ranks never share a bar, a thread lock does
    tqdm.set_lock(threading.RLock())
    try:
        # first: one that came while this rank started acts now; one that comes after the run has nothing to stop
        # (the launcher says so), where the default action would kill the rank before its result reaches the launcher
        with interrupt_outside_training(ELASTIC_SIGNALS, ignore_after=True):
            _setup_worker_logging(config["paths"]["output_dir"], rank)
            return train(OmegaConf.create(config))
    except ConfigError as exc:
        logging.getLogger("ddplab").error("%s", exc)
        raise
    except Interrupted as exc:
        return {"stopped": exc.signum, "saved": False}
    except SystemExit as exc:
        if exc.code not in {128 + s for s in STOP_SIGNALS}:
            raise
        return {"stopped": exc.code - 128, "saved": True}  # rank 0 has said where and how to resume
    finally:
        orphan_watch.finished()


class _OrphanWatch:
    """A rank whose launcher died (SIGKILL, OOM) stops as if told to: it checkpoints at the next agreed step and
    exits, `grace` seconds at most after the launcher's death. torch's spawn wrapper also turns that death into
    a SIGINT, which can stop the rank before it is re-parented: a rank done before it sees itself orphaned exits
    as soon as it does, instead of waiting for the launcher to take its result."""

    def __init__(self, every: float = 0.5, grace: float = 60.0):
        self.parent, self.done = os.getppid(), threading.Event()
        threading.Thread(target=self._watch, args=(every, grace), name="ddplab-orphan-watch", daemon=True).start()

    def orphaned(self) -> bool:
        return os.getppid() != self.parent

    def finished(self) -> None:
        """This rank's work is over: with no launcher to hand its result to, exit (torch's wrapper would wait)."""
        self.done.set()
        if self.orphaned():
            self._exit()

    def _watch(self, every: float, grace: float) -> None:
        while not self.orphaned():
            time.sleep(every)
        if not self.done.is_set():
            os.kill(os.getpid(), carrier(signal.SIGTERM))  # as the launcher forwards a SIGTERM
            self.done.wait(grace)
        self._exit()

    @staticmethod
    def _exit() -> None:
        logging.shutdown()
        os._exit(128 + signal.SIGTERM)


# they log a failed rank with the agent's own traceback: RankFailed says which rank failed and where its log is
TORCH_FAILURE_LOGGERS = ("torch.distributed.elastic.multiprocessing.api", "torch.multiprocessing.spawn")


@contextlib.contextmanager
def _quiet(*names: str):
    loggers = [logging.getLogger(name) for name in names]
    levels = [logger.level for logger in loggers]
    for logger in loggers:
        logger.setLevel(logging.CRITICAL)
    try:
        yield
    finally:
        for logger, level in zip(loggers, levels):
            logger.setLevel(level)


class RankFailed(RuntimeError):
    """A rank started by the local launcher failed; the message is one line naming it and its log."""


def spawn(cfg: DictConfig, nproc: int) -> dict:
    """Start `nproc` ranks on this machine; return rank 0's metrics. Ctrl-C, SIGTERM or SIGUSR2 make every rank
    checkpoint (rank 0 says where and how to resume), then this process exits 128 + the signal."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    config = OmegaConf.to_container(cfg, resolve=True)  # every rank gets the same, fully resolved config
    # the agent would turn SIGINT/SIGTERM into an exception here and SIGTERM the workers (no checkpoint):
    # those are ForwardStops' now
    launch = LaunchConfig(
        min_nodes=1,
        max_nodes=1,
        nproc_per_node=nproc,
        run_id=str(uuid.uuid4()),
        rdzv_backend="c10d",
        rdzv_endpoint="127.0.0.1:0",
        rdzv_configs={"is_host": True},
        max_restarts=cfg.trainer.max_restarts,
        start_method="spawn",
        signals_to_handle="SIGHUP,SIGQUIT",
    )
    log.info("starting %d processes with torch's elastic launcher (max_restarts=%d)", nproc, cfg.trainer.max_restarts)
    with ForwardStops() as stop, _quiet(*TORCH_FAILURE_LOGGERS):
        try:
            results = elastic_launch(launch, _worker)(config)
        except ChildFailedError as exc:
            rank, failure = exc.get_first_failure()
            message = failure.message.get("message", "") if isinstance(failure.message, dict) else str(failure.message)
            last = message.strip().splitlines()[-1] if message.strip() else f"exit code {failure.exitcode}"
            if last.startswith("ConfigError: "):  # a bad input found inside the ranks: still one line
                raise ConfigError(last.removeprefix("ConfigError: ")) from None
            raise RankFailed(f"rank {rank} failed: {last} (its log: {cfg.paths.output_dir})") from None
    stopped = results[0].get("stopped")
    if stopped and results[0]["saved"]:  # rank 0 has said where it saved and how to resume
        raise SystemExit(128 + (stop.signum or stopped))
    if stopped:
        raise Interrupted(stop.signum or stopped)
    if stop.signum:
        log.warning("signal %d came after the last training step: the run completed", stop.signum)
    return results[0]
