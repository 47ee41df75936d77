"""Where this process sits in the job (rank environment), the process group, and reductions.

Ranks are started either by us (torch's elastic launcher, src/run/launch.py), by torchrun, by srun or by
submitit. All of them end with RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT set.
"""

from __future__ import annotations

import datetime
import gc
import os
import random
import subprocess
import sys
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class RankEnv:
    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    local_world_size: int = 1
    launcher: str = "none"  # none | torchelastic | env | slurm | submitit

    @property
    def is_primary(self) -> bool:
        return self.rank == 0

    @property
    def external(self) -> bool:
        """Ranks were started by something else than train.py itself."""
        return self.launcher != "none"


def _slurm_master_addr(nodelist: str) -> str:
    try:
        out = subprocess.run(
            ["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30, check=True
        ).stdout
        return out.split()[0]
    except (OSError, subprocess.SubprocessError, IndexError):
        return nodelist.split(",")[0].split("[")[0]


def _port_for_job(job_id: str) -> int:
    """A port that depends only on the job id, so requeued jobs and every rank agree; below Linux's ephemeral
    range (32768-60999), from which the kernel numbers outgoing connections (gloo opens many)."""
    return random.Random(job_id).randint(12000, 32767)


def _export_slurm_env() -> None:
    """Inside an srun step of several tasks (submitit or a user's sbatch), export torch's variables."""
    env = os.environ
    env.setdefault("RANK", env["SLURM_PROCID"])
    env.setdefault("LOCAL_RANK", env.get("SLURM_LOCALID", "0"))
    env.setdefault("WORLD_SIZE", env["SLURM_NTASKS"])
    env.setdefault("LOCAL_WORLD_SIZE", env.get("SLURM_NTASKS_PER_NODE", "1").split("(")[0])
    env.setdefault("MASTER_ADDR", _slurm_master_addr(env.get("SLURM_JOB_NODELIST", "localhost")))
    # SLURM_JOB_ID, not SLURM_ARRAY_JOB_ID: each task of an array (a sweep) has its own job id, kept across
    # requeues, while the array id is shared, so sweep points running at once on one node would collide
    env.setdefault("MASTER_PORT", str(_port_for_job(env.get("SLURM_JOB_ID", "0"))))


def _export_submitit_local_env() -> None:
    import submitit

    job = submitit.JobEnvironment()
    env = os.environ
    env.setdefault("RANK", str(job.global_rank))
    env.setdefault("LOCAL_RANK", str(job.local_rank))
    env.setdefault("WORLD_SIZE", str(job.num_tasks))
    env.setdefault("LOCAL_WORLD_SIZE", str(job.num_tasks // max(job.num_nodes, 1)))
    env.setdefault("MASTER_ADDR", "127.0.0.1")
    env.setdefault("MASTER_PORT", str(_port_for_job(str(job.job_id))))


def rank_env() -> RankEnv:
    """Detect (and complete) the rank environment of this process."""
    env = os.environ
    launcher = "none"
    if "RANK" in env and "WORLD_SIZE" in env:
        launcher = "torchelastic" if "TORCHELASTIC_RUN_ID" in env else "env"
    elif env.get("SUBMITIT_EXECUTOR") == "local" and int(env.get("SUBMITIT_LOCAL_NTASKS", "1")) > 1:
        _export_submitit_local_env()
        launcher = "submitit"
    elif "SLURM_STEP_ID" in env and int(env.get("SLURM_NTASKS", "1")) > 1:
        _export_slurm_env()
        launcher = "submitit" if "SUBMITIT_EXECUTOR" in env else "slurm"
    if launcher == "none":
        return RankEnv()
    return RankEnv(
        int(env["RANK"]),
        int(env.get("LOCAL_RANK", 0)),
        int(env["WORLD_SIZE"]),
        int(env.get("LOCAL_WORLD_SIZE", env["WORLD_SIZE"])),
        launcher,
    )


def env_rank() -> int:
    """This process's global rank as its launcher announces it, before any process group exists."""
    env = os.environ
    for key in ("RANK", "SUBMITIT_LOCAL_GLOBALID"):
        if key in env:
            return int(env[key])
    return int(env.get("SLURM_PROCID", 0)) if "SLURM_STEP_ID" in env else 0


# --- process group -------------------------------------------------------------------------------


def init_process_group(env: RankEnv, device_type: str) -> torch.device:
    """Join the job's process group (if distributed) and return this rank's device."""
    if device_type == "cuda":
        torch.cuda.set_device(env.local_rank)
        device = torch.device("cuda", env.local_rank)
    else:
        device = torch.device("cpu")
    if env.world_size > 1 and not dist.is_initialized():
        # imported once the group exists, torch._dynamo (DDP imports it) keeps references to the group, which then
        # outlives destroy_process_group with its threads (see destroy_process_group)
        import torch._dynamo as _dynamo  # noqa: F401

        backend = "nccl" if device_type == "cuda" else "gloo"
        options = {"timeout": datetime.timedelta(minutes=10), "device_id": device if device_type == "cuda" else None}
        if env.launcher == "torchelastic":
            options.update(store=_attempt_store(env), rank=env.rank, world_size=env.world_size)
        dist.init_process_group(backend, **options)
    return device


def _attempt_store(env: RankEnv) -> dist.Store:
    """The elastic agent's store, under a prefix per restart: after a worker failure the restarted group
    must not read the dead group's addresses (seen: gloo 'connectFullMesh ... Connection refused')."""
    e = os.environ
    agent_hosts = e.get("TORCHELASTIC_USE_AGENT_STORE") == "True"
    store = dist.TCPStore(
        e["MASTER_ADDR"],
        int(e["MASTER_PORT"]),
        env.world_size,
        is_master=not agent_hosts and env.rank == 0,
        timeout=datetime.timedelta(minutes=10),
    )
    return dist.PrefixStore(f"ddplab/attempt_{e.get('TORCHELASTIC_RESTART_COUNT', '0')}", store)


def destroy_process_group() -> None:
    """Leave the process group and free it, joining its backend's threads: call it once the model wrapped over
    the group is released. A gloo thread that frees a finished collective after Python began to shut down
    aborts the process ("terminate called without an active exception"): the collective holds Python objects."""
    if dist.is_initialized():
        if "torch._inductor.cudagraph_trees" in sys.modules and torch.cuda.is_initialized():
            # CUDA graphs that hold collectives (fsdp's in-graph route) hang the group's destruction (torch#115388)
            sys.modules["torch._inductor.cudagraph_trees"].reset_cudagraph_trees()
        dist.destroy_process_group()
        _meshes_drop_groups()


def _meshes_drop_groups() -> None:
    """A DeviceMesh (fsdp's) holds its process groups, and DTensor's caches hold the mesh past the run, so the
    group and its gloo threads would live on into Python's shutdown: drop the meshes' references to them."""
    mesh_module = sys.modules.get("torch.distributed.device_mesh")
    if mesh_module is None:
        return
    for obj in gc.get_objects():  # type(), not isinstance(): a dead weakref proxy raises on isinstance
        if issubclass(type(obj), mesh_module.DeviceMesh) and isinstance(getattr(obj, "_pg_registry", None), dict):
            obj._pg_registry.clear()
    gc.collect()  # a group left only in a reference cycle


def is_distributed() -> bool:
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1


def all_reduce(values: torch.Tensor, op=None) -> torch.Tensor:
    """Sum (or `op`) a tensor over ranks; identity when not distributed."""
    if is_distributed():
        dist.all_reduce(values, op=op or dist.ReduceOp.SUM)
    return values


def reduce_max(value: float, device: torch.device) -> float:
    t = torch.tensor([value], dtype=torch.float64, device=device)
    return all_reduce(t, dist.ReduceOp.MAX).item()
