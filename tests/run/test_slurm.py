"""The SLURM path (issue 4) end to end, through `python train.py cluster=...` as a user types it.

- submitit's local executor with 2 tasks (the multi-task code path without SLURM) equals a local 2-process run;
- a real 2-node x 1-task DDP job on the test cluster (tests/slurm_cluster.py) equals the same local run;
- a seed sweep becomes one job per seed, each with its metrics.json;
- SIGUSR2 (submitit's preemption/time-out signal) checkpoints mid-epoch, requeues, and the job resumes to
  the result of an uninterrupted run, also when only rank 1 got the signal;
- bad layouts are refused before anything is submitted.

docs/slurm.md has the user commands and the measured timings. Every wait here is bounded.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.conftest import ROOT, read_metrics, run_cli

pytestmark = pytest.mark.slurm  # fixtures slurm_cluster / slurm_env come from tests/conftest.py

# cluster=slurm* presets are written for GPU partitions; the test cluster has 2 CPU-only nodes of 4 CPUs
CPU_CLUSTER = (
    "cluster.gpus_per_node=null",
    "cluster.tasks_per_node=1",
    "cluster.cpus_per_task=1",
    "cluster.timeout_min=5",
    "cluster.partition=debug",
    "trainer.device=cpu",
)
FAST = ("debug=fast",)
# long enough (12 epochs x 39 steps, ~0.35 s per epoch on 2 cores) to be signalled mid-training
LONG_EPOCHS = 12
LONG = (
    "debug=fast",
    "trainer.limit_train_batches=null",
    f"trainer.max_epochs={LONG_EPOCHS}",
    "data.batch_size=32",
    "trainer.deterministic=true",
)
FINAL_KEYS = ("test_loss", "test_top1", "test_top5", "best_val_top1")


def _wait_until(predicate, timeout: float, what: str, every: float = 0.1):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = predicate()
        if value:
            return value
        time.sleep(every)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}")


def _job_dirs(sweep: Path) -> list[Path]:
    return sorted(p for p in sweep.iterdir() if p.is_dir() and not p.name.startswith("."))


def _job_ids(sweep: Path) -> list[str]:
    """SLURM job ids from the .submitit folder: `<id>` for one job, `<array>_<i>` for a sweep's array tasks."""
    names = [p.name for p in (sweep / ".submitit").iterdir() if p.is_dir() and re.fullmatch(r"\d+(_\d+)?", p.name)]
    tasks = [n for n in names if "_" in n]
    return sorted(tasks or names)


def _assert_same_final(got: dict, want: dict) -> None:
    for key in FINAL_KEYS:
        assert got["final"][key] == pytest.approx(want["final"][key], rel=1e-6), key


def _assert_one_writer(job_dir: Path, ranks: int, attempts: int = 1) -> None:
    """Only rank 0 wrote artifacts; rank k>0 wrote its train_rank<k>.log and nothing else."""
    logs = [f"train_rank{k}.log" for k in range(1, ranks)]
    events = [p.name for p in job_dir.glob("events.out.tfevents.*")]
    assert sorted(p.name for p in job_dir.iterdir()) == sorted(
        [".hydra", ".lock", "checkpoints", "metrics.json", "train.log", *logs, *events]
    )  # .lock: rank 0's run-dir lock
    assert sorted(p.name for p in (job_dir / ".hydra").iterdir()) == ["config.yaml", "hydra.yaml", "overrides.yaml"]
    assert len(events) == attempts  # rank 0's writer, one event file per start
    # each rank's Hydra logging went to its own file (the resolvers ran per rank, not from the submitter's cache)
    for name in ("train.log", *logs):
        assert (job_dir / name).read_text().count("Exiting after successful completion") == 1, name


class _LocalDDP:
    """The reference: the same job run locally with 2 processes (torch's elastic launcher), once per args.

    `start(*args)` runs it in the background (while a SLURM job waits for scheduling, say); calling the
    object waits for the result.
    """

    def __init__(self, tmp_path_factory):
        self.tmp, self.pool, self.futures = tmp_path_factory, ThreadPoolExecutor(max_workers=2), {}

    def _run(self, run_dir: Path, args: tuple) -> dict:
        proc = run_cli("strategy=ddp", "trainer.devices=2", *args, f"hydra.run.dir={run_dir}", timeout=240)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return read_metrics(run_dir)

    def start(self, *args: str) -> Future:
        if args not in self.futures:
            self.futures[args] = self.pool.submit(self._run, self.tmp.mktemp("local_ddp") / "run", args)
        return self.futures[args]

    def __call__(self, *args: str) -> dict:
        return self.start(*args).result(timeout=300)


@pytest.fixture(scope="module")
def local_ddp(tmp_path_factory):
    reference = _LocalDDP(tmp_path_factory)
    yield reference
    reference.pool.shutdown(wait=True, cancel_futures=True)


# --- 5. refused before submission -----------------------------------------------------------------

BAD_LAYOUTS = {  # overrides -> the start of the one-line error
    ("cluster=slurm", "strategy=single"): "strategy=single runs one process but the job has 8 tasks",
    (
        "cluster=slurm",
        "cluster.gpus_per_node=2",
        "cluster.tasks_per_node=4",
    ): "cluster.tasks_per_node=4 > cluster.gpus_per_node=2",
    ("cluster=local_tasks", "cluster.nodes=2"): "cluster.nodes=2 with submitit's local executor",
    ("cluster=slurm", "+cluster.partion=gpu"): "cluster.partion is not a cluster option; HINT: did you mean "
    "cluster.partition?",
}


def test_bad_layouts_are_refused_before_submission(tmp_path):
    procs = {}
    for i, overrides in enumerate(BAD_LAYOUTS):  # all at once: each is mostly Python start-up
        sweep = tmp_path / f"sweep{i}"
        procs[overrides] = (
            sweep,
            subprocess.Popen(
                [sys.executable, str(ROOT / "train.py"), *overrides, f"hydra.sweep.dir={sweep}"],
                cwd=ROOT,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            ),
        )
    for overrides, (sweep, proc) in procs.items():
        try:
            _, err = proc.communicate(timeout=120)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
        lines = err.strip().splitlines()
        assert proc.returncode == 2 and len(lines) == 1, (overrides, err[-2000:])
        assert BAD_LAYOUTS[overrides] in lines[0] and "HINT" in lines[0], lines
        assert not (sweep / ".submitit").exists() and not sweep.exists()  # nothing submitted


def _assert_job_equals_local_ddp(sweep, local_ddp):
    """The sweep's one job completed on 2 ranks, matches the local 2-process run, and rank 0 alone wrote."""
    [job_dir] = _job_dirs(sweep)
    metrics = read_metrics(job_dir)
    assert metrics["status"] == "completed" and metrics["hparams"]["world_size"] == 2
    _assert_same_final(metrics, local_ddp(*FAST))
    _assert_one_writer(job_dir, ranks=2)


# --- 1. the multi-task code path without SLURM ------------------------------------------------------


@pytest.mark.slow
def test_submitit_local_two_tasks_equal_local_ddp(tmp_path, local_ddp):
    local_ddp.start(*FAST)
    sweep = tmp_path / "sweep"
    proc = run_cli("cluster=local_tasks", *FAST, f"hydra.sweep.dir={sweep}", timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    _assert_job_equals_local_ddp(sweep, local_ddp)


# --- 2. a real 2-node job -------------------------------------------------------------------------


@pytest.mark.slow
def test_two_node_job_equals_local_ddp(slurm_env, tmp_path, local_ddp):
    sweep = tmp_path / "sweep"
    proc = run_cli("cluster=slurm_2nodes", *CPU_CLUSTER, *FAST, f"hydra.sweep.dir={sweep}", timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    [job] = _job_ids(sweep)
    assert slurm_env.wait_job(job, timeout=30) == "COMPLETED"
    nodes = slurm_env.run("sacct", "-j", job, "-X", "-n", "-P", "-o", "NodeList").stdout.split()
    assert nodes == ["node[1-2]"], nodes
    logs = sweep / ".submitit" / job
    for rank in (0, 1):  # each task's submitit log: <sweep>/.submitit/<job>/<job>_<task>_log.out
        assert f"node={rank}(2), global_rank={rank}(2)" in (logs / f"{job}_{rank}_log.out").read_text()
    _assert_job_equals_local_ddp(sweep, local_ddp)


# --- 3. a seed sweep ------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.parametrize(
    "launch",
    [
        ("cluster=slurm_2nodes", *CPU_CLUSTER),
        # the launcher named alone is read as cluster=slurm (was: one task, no GPU, cluster=local's options refused)
        (
            "-m",
            "hydra/launcher=submitit_slurm",
            *(o for o in CPU_CLUSTER if "tasks_per_node" not in o),
            "cluster.tasks_per_node=2",
        ),
    ],
    ids=["cluster", "launcher"],
)
def test_seed_sweep_runs_one_job_per_seed(slurm_env, tmp_path, launch):
    # as a user would: from a directory of theirs (not the repo), default sweep dir <cwd>/multirun/<date>/<time>
    proc = run_cli(*launch, *FAST, "seed=1,2", cwd=tmp_path, timeout=240)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert ("note: hydra/launcher=submitit_slurm is read as cluster=slurm" in proc.stderr) == ("-m" in launch)
    [sweep] = list((tmp_path / "multirun").glob("*/*"))
    jobs = _job_ids(sweep)
    assert len(jobs) == 2 and all("_" in j for j in jobs), jobs  # one array, one task per sweep point
    for job in jobs:
        assert slurm_env.wait_job(job, timeout=30) == "COMPLETED"
    dirs = _job_dirs(sweep)
    assert [d.name.split("seed=")[1].split(",")[0] for d in dirs] == ["1", "2"], dirs
    seeds = []
    for job_dir in dirs:
        metrics = read_metrics(job_dir)
        assert metrics["status"] == "completed" and metrics["hparams"]["world_size"] == 2
        seeds.append(metrics["hparams"]["seed"])
        _assert_one_writer(job_dir, ranks=2)
    assert seeds == [1, 2]


# --- 4. preemption / time-out: SIGUSR2 -> checkpoint -> requeue -> resume ---------------------------


def _task_pids(job: str, rank: int) -> list[int]:
    """PIDs of SLURM task `rank` of `job` running submitit's worker (all nodes are on this host)."""
    pids = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes().split(b"\0")
            cmdline = Path(f"/proc/{entry}/cmdline").read_bytes()
        except OSError:
            continue
        if (
            f"SLURM_JOB_ID={job}".encode() in env
            and f"SLURM_PROCID={rank}".encode() in env
            and b"submitit.core._submit" in cmdline
        ):
            pids.append(int(entry))
    return pids


def _interrupt_and_resume(slurm_env, tmp_path: Path, local_ddp, send_signal) -> str:
    """Submit the LONG job, `send_signal(job)` once epoch 1 is saved, let the requeued job run; check that it
    resumed to the uninterrupted result. Returns rank 0's train.log."""
    sweep = tmp_path / "sweep"
    submit_log = tmp_path / "submit.log"
    cmd = [
        sys.executable,
        str(ROOT / "train.py"),
        "cluster=slurm_2nodes",
        *CPU_CLUSTER,
        *LONG,
        f"hydra.sweep.dir={sweep}",
    ]
    job = None
    local_ddp.start(*LONG)  # the uninterrupted reference, meanwhile
    with submit_log.open("w") as out:
        proc = subprocess.Popen(
            cmd, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONUNBUFFERED": "1"}
        )
    try:
        # the end of epoch 1 writes last.pt: the job is training, our handler is in place
        _wait_until(
            lambda: proc.poll() is not None or next(sweep.glob("*/checkpoints/last.pt"), None),
            150,
            "checkpoints/last.pt of epoch 1",
            every=0.05,
        )
        assert proc.poll() is None, submit_log.read_text()[-3000:]
        [job] = _job_ids(sweep)
        send_signal(job)
        # submitit requeued it (`scontrol requeue`); SLURM holds a requeued job for AuthInfo's cred_expire
        # (120 s by default) before it may start again: the test lets it start at once
        _wait_until(lambda: slurm_env.squeue(job).get(job) == "PENDING", 60, f"job {job} requeued (PENDING)")
        slurm_env.run("scontrol", "update", f"JobId={job}", "StartTime=now")
        rc = proc.wait(timeout=180)
        assert rc == 0, submit_log.read_text()[-3000:]
        assert slurm_env.wait_job(job, timeout=30) == "COMPLETED"
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
        if job and slurm_env.squeue(job):
            slurm_env.run("scancel", job, check=False)
    history = slurm_env.run("sacct", "-D", "-X", "-n", "-P", "-j", job, "-o", "State").stdout.split()
    assert history == ["REQUEUED", "COMPLETED"], history
    [job_dir] = _job_dirs(sweep)
    log = (job_dir / "train.log").read_text()
    where = r"at (?:epoch (\d+) step \d+|the end of epoch (\d+))"
    saved = re.search(rf"signal {int(signal.SIGUSR2)}: saved checkpoints/last.pt in \S+ {where}", log)
    # mid-training: mid-epoch as a rule, at an epoch's end where the signal comes as one ends (a fast or loaded host)
    assert saved and 1 <= int(saved[1] or saved[2]) < LONG_EPOCHS, log[-3000:]
    assert "Requeued job" in log and "resumed from" in log, log[-3000:]
    got, want = read_metrics(job_dir), local_ddp(*LONG)
    _assert_same_final(got, want)
    # the interrupted epoch too: its partial train sums (all ranks') came back from the checkpoint
    assert [r["train_loss"] for r in got["epochs"]] == pytest.approx(
        [r["train_loss"] for r in want["epochs"]], rel=1e-6
    )
    _assert_one_writer(job_dir, ranks=2, attempts=2)  # the requeued start opened a second event file
    return log


@pytest.mark.slow
def test_usr2_requeues_and_resumes_to_the_uninterrupted_result(slurm_env, tmp_path, local_ddp):
    # what SLURM sends every task signal_delay_s before the time limit (sbatch --signal=USR2@120)
    _interrupt_and_resume(slurm_env, tmp_path, local_ddp, lambda job: slurm_env.run("scancel", "--signal=USR2", job))


@pytest.mark.slow
def test_usr2_on_rank_1_only_still_requeues_from_rank_0(slurm_env, tmp_path, local_ddp):
    """srun delivers the signal task by task: rank 0 (the one submitit requeues from) may not have it yet
    when the ranks agree to stop. Here it never gets it."""

    def signal_rank_1(job: str) -> None:
        pids = _task_pids(job, rank=1)
        assert pids, f"no process of task 1 of job {job}"
        for pid in pids:
            os.kill(pid, signal.SIGUSR2)

    log = _interrupt_and_resume(slurm_env, tmp_path, local_ddp, signal_rank_1)
    assert "Caught signal SIGUSR2 on" in log  # rank 0 handed the agreed signal to submitit's handler
