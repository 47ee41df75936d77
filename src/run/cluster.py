"""The `cluster/` group: check a SLURM/submitit job layout against the strategy before anything is submitted."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from hydra.experimental.callback import Callback
from omegaconf import DictConfig, OmegaConf

from src.config.errors import ConfigError
from src.config.schema import refuse_lookalikes

# the keys of conf/cluster/*.yaml; a YAML of your own may add keys for its launcher settings to interpolate
KEYS = (
    "name",
    "nodes",
    "tasks_per_node",
    "gpus_per_node",
    "cpus_per_task",
    "mem_gb",
    "timeout_min",
    "partition",
    "account",
    "qos",
    "max_requeues",
    "setup",
)


def check_keys(c: DictConfig) -> None:
    """+cluster.partion=gpu would submit to the default partition: refused."""
    refuse_lookalikes(c, "cluster", KEYS, hint="HINT: ")


def check_layout(cfg: DictConfig) -> None:
    from src.strategies import build_strategy

    check_keys(cfg.cluster)
    c, strategy = cfg.cluster, build_strategy(cfg.strategy)
    nodes, tasks, gpus = c.nodes, c.tasks_per_node, c.get("gpus_per_node")
    if not (isinstance(nodes, int) and nodes >= 1 and isinstance(tasks, int) and tasks >= 1):
        hint = (
            "cluster.tasks_per_node follows cluster.gpus_per_node=null: on a CPU-only partition set "
            "cluster.tasks_per_node=N (ranks per node)"
            if tasks is None and gpus is None
            else "set positive integers"
        )
        raise ConfigError(
            f"cluster.nodes and cluster.tasks_per_node must be positive integers, got {nodes}, {tasks}; HINT: {hint}"
        )
    world = nodes * tasks
    launcher = str(OmegaConf.select(cfg, "hydra.launcher._target_", default="") or "")
    if launcher.endswith(".LocalLauncher") and nodes != 1:
        raise ConfigError(
            f"cluster.nodes={nodes} with submitit's local executor, which runs every task on this "
            f"machine; HINT: set cluster.nodes=1 (or use cluster=slurm_2nodes on a SLURM cluster)"
        )
    if gpus is not None and tasks > gpus:
        raise ConfigError(
            f"cluster.tasks_per_node={tasks} > cluster.gpus_per_node={gpus}: one task drives one GPU; "
            f"HINT: set cluster.tasks_per_node={gpus}"
        )
    if strategy.multiprocess and world == 1:
        raise ConfigError(
            f"strategy={strategy.name} with 1 rank (nodes=1 x tasks_per_node=1); HINT: set "
            f"cluster.gpus_per_node=N (one task per GPU) or use strategy=single"
        )
    if not strategy.multiprocess and world > 1:
        raise ConfigError(
            f"strategy={strategy.name} runs one process but the job has {world} tasks "
            f"(nodes={nodes} x tasks_per_node={tasks}); HINT: use strategy=ddp or set "
            f"cluster.tasks_per_node=1 cluster.nodes=1"
        )
    devices = cfg.trainer.devices
    if devices != "auto" and strategy.multiprocess and devices != tasks:
        raise ConfigError(
            f"trainer.devices={devices} but each node runs cluster.tasks_per_node={tasks} ranks; "
            f"HINT: set trainer.devices=auto"
        )


SETUP = "set up SLURM's client on this machine (srun, sbatch and a slurm.conf), or submit from a login node"


def slurm_reachable() -> str | None:
    """Why jobs cannot be submitted to SLURM from here (one line), or None: what submitit would otherwise report
    as a traceback (no srun) or several (sbatch: fatal, CalledProcessError, FailedJobError)."""
    missing = [tool for tool in ("srun", "sbatch") if shutil.which(tool) is None]
    if missing:
        return f"{' and '.join(missing)} not found: this machine has no SLURM"
    try:
        ping = subprocess.run(["scontrol", "ping"], capture_output=True, text=True, timeout=15)
    except (OSError, subprocess.TimeoutExpired):
        return None  # no verdict: let sbatch say
    said = " ".join((ping.stdout + ping.stderr).split())
    if ping.returncode != 0 or "DOWN" in said:
        return f"SLURM's controller does not answer (scontrol ping: {said[:120] or ping.returncode})"
    return None


def refuse_unreachable_slurm(config: DictConfig) -> None:
    """Before a sweep is handed to submitit's SLURM launcher: one line that says what to do instead."""
    if not str(OmegaConf.select(config, "hydra.launcher._target_", default="") or "").endswith("SlurmLauncher"):
        return
    why = slurm_reachable()
    if why:
        print(
            f"error: {why}; run the same jobs on this machine with cluster=local_tasks (submitit's local "
            f"executor), or {SETUP}",
            file=sys.stderr,
        )
        sys.exit(2)


class ValidateCluster(Callback):
    """Runs in the submitting process: a bad layout is one line on stderr and nothing is submitted."""

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        try:
            check_layout(config)
        except ConfigError as exc:
            print(f"error: {exc}", file=sys.stderr)
            sys.exit(2)
        # The jobs unpickle our task function (`python -m submitit.core._submit` in the submit directory):
        # from any other directory they need the code on their path. sbatch and submitit_local pass our
        # environment on.
        code = str(Path(__file__).resolve().parents[2])
        path = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
        if code not in path:
            os.environ["PYTHONPATH"] = os.pathsep.join([code, *path])
