"""The single-host test SLURM cluster really schedules 2-node jobs, keeps accounting, and runs submitit."""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

import pytest

from tests.slurm_cluster import SlurmCluster, slurm_available

pytestmark = pytest.mark.slurm  # fixtures slurm_cluster / slurm_env come from tests/conftest.py


def _wait_until(predicate, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def test_two_node_batch_job(slurm_cluster, tmp_path):
    # each slurmd runs in its own UTS namespace named after the node (unless unshare is not permitted)
    step = "srun hostname" if slurm_cluster.uts_namespaces else "srun printenv SLURMD_NODENAME"
    job = slurm_cluster.sbatch(
        "--nodes=2", "--ntasks-per-node=1", f"--output={tmp_path}/%j.out", "--wrap", step, cwd=tmp_path
    )
    assert slurm_cluster.wait_job(job, timeout=30) == "COMPLETED", slurm_cluster.sacct(job)
    assert sorted((tmp_path / f"{job}.out").read_text().split()) == ["node1", "node2"]
    states = slurm_cluster.sacct(job)
    assert states[job] == "COMPLETED" and states[f"{job}.0"] == "COMPLETED", states


def test_scancel_shows_cancelled(slurm_cluster, tmp_path):
    job = slurm_cluster.sbatch(f"--output={tmp_path}/%j.out", "--wrap", "sleep 300", cwd=tmp_path)
    _wait_until(lambda: slurm_cluster.squeue(job).get(job) == "RUNNING", 20, f"job {job} RUNNING")
    slurm_cluster.run("scancel", job)
    assert slurm_cluster.wait_job(job, timeout=30) == "CANCELLED"


def _rank_info():
    """Runs in each SLURM task: rank layout + a 2-process gloo all_reduce across the two nodes."""
    from datetime import timedelta

    import submitit
    import torch
    import torch.distributed as dist

    env = submitit.JobEnvironment()
    dist_env = submitit.helpers.TorchDistributedEnvironment().export()
    dist.init_process_group("gloo", rank=dist_env.rank, world_size=dist_env.world_size, timeout=timedelta(seconds=60))
    value = torch.tensor([float(env.global_rank + 1)])
    dist.all_reduce(value)
    dist.destroy_process_group()
    return {
        "rank": env.global_rank,
        "num_tasks": env.num_tasks,
        "node": env.node,
        "hostname": socket.gethostname(),
        "slurmd_nodename": os.environ["SLURMD_NODENAME"],
        "master": f"{os.environ['MASTER_ADDR']}:{os.environ['MASTER_PORT']}",
        "sum": value.item(),
    }


def test_submitit_two_nodes_gloo_all_reduce(slurm_env, tmp_path):
    submitit = pytest.importorskip("submitit")
    pytest.importorskip("torch.distributed")
    import cloudpickle

    cloudpickle.register_pickle_by_value(sys.modules[__name__])  # jobs can't import this test module
    executor = submitit.AutoExecutor(folder=tmp_path / "submitit", cluster="slurm")
    executor.update_parameters(nodes=2, tasks_per_node=1, cpus_per_task=1, timeout_min=5)
    job = executor.submit(_rank_info)
    try:
        _wait_until(lambda: job.done(force_check=True), 75, f"submitit job {job.job_id}")
    finally:
        if not job.done():
            job.cancel(check=False)
    results = sorted(job.results(), key=lambda r: r["rank"])
    assert [r["rank"] for r in results] == [0, 1] and {r["num_tasks"] for r in results} == {2}
    if slurm_env.uts_namespaces:
        assert [r["hostname"] for r in results] == ["node1", "node2"]
    assert [r["slurmd_nodename"] for r in results] == ["node1", "node2"]
    assert {r["master"].split(":")[0] for r in results} == {"node1"}
    assert [r["sum"] for r in results] == [3.0, 3.0]
    assert slurm_env.wait_job(job.job_id, timeout=20) == "COMPLETED"


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"  # zombies are dead
    except OSError:
        return False


def test_stop_leaves_no_processes(tmp_path_factory):
    ok, reason = slurm_available()
    if not ok:
        pytest.skip(reason)
    workdir = tmp_path_factory.mktemp("slurm_stop")
    with SlurmCluster(workdir) as cluster:
        daemons = cluster.pids()
        job = cluster.sbatch(f"--output={workdir}/%j.out", "--wrap", "sleep 300")
        _wait_until(lambda: cluster.squeue(job).get(job) == "RUNNING", 20, f"job {job} RUNNING")
        marker = f"SLURM_CONF={cluster.conf}".encode()
        job_pids = _wait_until(
            lambda: [
                p
                for p in map(int, filter(str.isdigit, os.listdir("/proc")))
                if p != os.getpid() and _environ_has(p, marker)
            ],
            10,
            "job processes",
        )
    assert len(daemons) == 6, daemons  # munged mariadbd slurmdbd slurmctld slurmd x2
    left = [p for p in list(daemons.values()) + job_pids if _alive(p)]
    assert not left, f"still running after stop(): {left}"


def _environ_has(pid: int, marker: bytes) -> bool:
    try:
        return marker in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    except OSError:
        return False
