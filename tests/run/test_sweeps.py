"""A CPU sweep through the CLI with failing points, then the report and TensorBoard's HParams on its outputs; sweeps
refused before anything ran leave no directory; submitit's local executor shows progress and keeps its logs in the
sweep."""

from __future__ import annotations

import csv
import json
import os
import shutil
import statistics
import subprocess
import sys

import pytest
import yaml

from tests.conftest import ROOT, run_cli

pytestmark = pytest.mark.slow


def job(seed: str, strategy: str) -> str:
    """Hydra's override_dirname: every override of the job, sorted, key=value joined by commas."""
    return f"debug=fast,seed={seed},strategy={strategy},trainer.max_epochs=1"


@pytest.fixture(scope="module")
def sweep(tmp_path_factory):
    sweep_dir = tmp_path_factory.mktemp("sweep") / "s"
    proc = run_cli(
        "-m",
        "debug=fast",
        "trainer.max_epochs=1",
        "seed=1,2,x",
        "strategy=single,ddp",
        f"hydra.sweep.dir={sweep_dir}",
        timeout=600,
    )
    assert proc.returncode != 0, "the seed=x points must fail the sweep"
    return sweep_dir, proc


def test_each_job_dir_is_named_from_its_overrides(sweep):
    sweep_dir, proc = sweep
    names = sorted(p.name for p in sweep_dir.iterdir() if p.is_dir())
    assert names == sorted(job(s, k) for s in ("1", "2", "x") for k in ("single", "ddp"))
    for s in ("1", "2"):
        for k in ("single", "ddp"):
            m = json.loads((sweep_dir / job(s, k) / "metrics.json").read_text())
            assert m["status"] == "completed" and m["hparams"]["world_size"] == (2 if k == "ddp" else 1)
    assert not (sweep_dir / job("x", "ddp") / "metrics.json").exists()


def test_failed_points_are_one_line_each_and_summed_up_at_the_end(sweep):
    _, proc = sweep
    assert proc.returncode == 2  # every failure is a bad input, as a single run's
    assert "Traceback" not in proc.stderr and "Error executing job" not in proc.stderr, proc.stderr[-3000:]
    failed = sorted(job("x", k) for k in ("ddp", "single"))
    said = sorted(line for line in proc.stderr.splitlines() if line.startswith("error:"))
    assert [line.split(": ", 2)[1] for line in said] == failed  # as each one failed
    assert all(line.endswith("seed must be an integer >= 0 and <= 4294967295, got 'x'") for line in said), said
    summary = proc.stderr[proc.stderr.index("sweep: 2 point(s) failed:") :].splitlines()[1:3]
    assert [line.split(": ", 1)[0].strip() for line in summary] == failed, summary  # again at the end
    assert all(line.endswith("seed must be an integer >= 0 and <= 4294967295, got 'x'") for line in summary), summary


def test_report_table_matches_the_jobs(sweep):
    sweep_dir, _ = sweep
    out = subprocess.run(
        [sys.executable, "-m", "src.reporting.report", str(sweep_dir)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode == 0, out.stderr
    rows = {r["config"]: r for r in csv.DictReader((sweep_dir / "results.csv").open())}
    assert set(rows) == {f"debug=fast,strategy={k},trainer.max_epochs=1" for k in ("single", "ddp")}
    for strategy in ("single", "ddp"):
        finals = [json.loads((sweep_dir / job(s, strategy) / "metrics.json").read_text())["final"] for s in (1, 2)]
        row = rows[f"debug=fast,strategy={strategy},trainer.max_epochs=1"]
        assert int(row["n"]) == 2
        runs = [json.loads((sweep_dir / job(s, strategy) / "metrics.json").read_text()) for s in (1, 2)]
        for m in runs:  # the time to the final weights: every epoch's, the first included
            assert m["final"]["train_sec"] == pytest.approx(sum(e["epoch_sec"] for e in m["epochs"]), rel=1e-12)
        for metric in ("test_loss", "test_top1", "test_top5", "sec_per_epoch", "images_per_sec", "train_sec"):
            values = [f[metric] for f in finals]
            assert float(row[f"{metric}_mean"]) == pytest.approx(statistics.mean(values), rel=1e-9)
            assert float(row[f"{metric}_std"]) == pytest.approx(statistics.stdev(values), rel=1e-9, abs=1e-12)
    md = (sweep_dir / "results.md").read_text()
    assert job("x", "single") in md and job("x", "ddp") in md  # failed jobs listed by name
    assert (sweep_dir / "results.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_hparams_summary_is_in_each_jobs_event_file(sweep):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import plugin_data_pb2

    sweep_dir, _ = sweep
    job_dir = sweep_dir / job("2", "ddp")
    acc = EventAccumulator(str(job_dir))
    acc.Reload()
    content = acc.PluginTagToContent("hparams")
    start = plugin_data_pb2.HParamsPluginData.FromString(content["_hparams_/session_start_info"]).session_start_info
    assert start.hparams["strategy"].string_value == "ddp" and start.hparams["world_size"].string_value == "2"
    assert start.group_name == "seed=2,strategy=ddp"  # the Trial ID: the point's swept overrides
    final = json.loads((job_dir / "metrics.json").read_text())["final"]
    assert acc.Scalars("z_final/test_top1")[-1].value == pytest.approx(final["test_top1"], rel=1e-6)
    assert len(list(job_dir.glob("events.out.tfevents.*"))) == 1  # one event file: no stray add_hparams sub-run


@pytest.mark.parametrize(
    "overrides, message",
    [
        (("optim.lr=-1,-2",), "optim.lr must be a number > 0"),  # every point fails in its job
        (("cluster=local_tasks", "strategy=single", "seed=1,2"), "strategy=single runs one process"),  # before any
    ],
)
def test_a_sweep_refused_before_anything_ran_leaves_no_directory(tmp_path, overrides, message):
    proc = run_cli("-m", "debug=fast", *overrides, cwd=tmp_path)
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    left = [p for p in tmp_path.rglob("*") if "multirun" in p.parts and p.name != "multirun"]
    assert left == [] and not (tmp_path / ".submitit").exists()


@pytest.mark.parametrize("launcher", [(), ("cluster=local_tasks", "strategy=ddp", "trainer.devices=2")])
def test_a_sweep_whose_every_point_is_refused_is_one_line_before_any_point_starts(tmp_path, launcher):
    """Each point used to start (a SLURM job each) and fail with its own line, then the summary repeated them."""
    proc = run_cli("-m", "debug=fast", *launcher, "seed=1,2", "trainer.max_epochs=abc", cwd=tmp_path, timeout=180)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1, proc.stderr[-3000:]
    first = ",".join(
        sorted(["debug=fast", *launcher, "seed=1", "trainer.max_epochs=abc"], key=lambda o: o.split("=")[0])
    )
    assert lines[0] == (
        f"error: all 2 points are refused; the first, {first}: trainer.max_epochs must be a positive integer, "
        "got 'abc'; no point was started"
    )
    assert "Launching" not in proc.stdout and not (tmp_path / "multirun").exists()
    assert not list(tmp_path.rglob(".submitit"))


def test_a_sweep_with_some_refused_points_runs_the_others(tmp_path):
    proc = run_cli("-m", "debug=fast", "trainer.max_epochs=1,abc", f"hydra.sweep.dir={tmp_path}/s", cwd=tmp_path)
    assert proc.returncode == 2 and "sweep: 1 point(s) failed:" in proc.stderr, proc.stderr[-3000:]
    assert (tmp_path / "s/debug=fast,trainer.max_epochs=1/metrics.json").exists()


def test_points_with_more_overrides_than_a_folder_name_holds_each_run_in_a_folder_of_their_own(tmp_path):
    many = [f"optim.{k}={v}" for k, v in (("momentum", 0.85), ("weight_decay", 0.0017), ("norm_lr_scale", 64))]
    many += [f"trainer.{k}=1" for k in ("max_epochs", "limit_eval_batches", "tta_shift")]
    many += ["trainer.label_smoothing=0.1", "trainer.flip_tta=true", "data.val_fraction=0.2", "model.width=8"]
    proc = run_cli("-m", "debug=fast", "seed=1,2", *many, f"hydra.sweep.dir={tmp_path}/s", cwd=tmp_path)
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]  # was: File name too long
    points = sorted(p.parent for p in (tmp_path / "s").glob("*/metrics.json"))
    assert len(points) == 2 and all(len(p.name.encode()) <= 200 for p in points)
    seeds = {json.loads((p / "metrics.json").read_text())["config"]["seed"] for p in points}
    assert seeds == {1, 2}
    report = subprocess.run([sys.executable, "-m", "src.reporting.report", str(tmp_path / "s")], cwd=ROOT)
    assert report.returncode == 0


def test_a_compiled_seed_sweep_compiles_once_and_each_seed_gets_its_own_runs_numbers(tmp_path):
    compiled = ("debug=fast", "trainer.compile=true", "trainer.max_epochs=2")
    proc = run_cli("-m", *compiled, "seed=1,2", f"hydra.sweep.dir={tmp_path}/s", cwd=tmp_path, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.count("this job reuses the previous job's compiled graphs") == 1, proc.stdout[-3000:]
    alone = run_cli(*compiled, "seed=2", f"hydra.run.dir={tmp_path}/alone", cwd=tmp_path, timeout=600)
    assert alone.returncode == 0 and "reuses" not in alone.stdout, alone.stderr[-3000:]
    [swept_dir] = (tmp_path / "s").glob("*seed=2*")
    swept = json.loads((swept_dir / "metrics.json").read_text())
    own = json.loads((tmp_path / "alone/metrics.json").read_text())
    for key in ("test_loss", "test_top1", "val_loss", "val_top1"):
        assert swept["final"][key] == own["final"][key], key
    assert [e["train_loss"] for e in swept["epochs"]] == [e["train_loss"] for e in own["epochs"]]


def test_a_failed_sweep_into_an_existing_folder_deletes_nothing_of_it(tmp_path):
    logs = tmp_path / "my logs"
    (logs / "old").mkdir(parents=True)
    (logs / "notes.txt").write_text("mine")
    (logs / "old/run.log").write_text("also mine")
    proc = run_cli("-m", "debug=fast", "data.batch_size=0,-1", f"hydra.sweep.dir={logs}", cwd=tmp_path)
    assert proc.returncode == 2 and "removed" not in proc.stderr, proc.stderr[-3000:]  # was: rmtree of the folder
    assert (logs / "notes.txt").read_text() == "mine" and (logs / "old/run.log").read_text() == "also mine"


def test_local_tasks_shows_progress_and_keeps_its_logs_in_the_sweep(tmp_path):
    proc = run_cli("cluster=local_tasks", "debug=fast", "optim.lr=0.1,-1", cwd=tmp_path, timeout=300)
    assert proc.returncode == 2, proc.stdout[-3000:] + proc.stderr[-3000:]
    [sweep] = [p for p in (tmp_path / "multirun").glob("*/*")]
    ok, bad = "cluster=local_tasks,debug=fast,optim.lr=0.1", "cluster=local_tasks,debug=fast,optim.lr=-1"
    assert (sweep / ok / "metrics.json").exists() and not (sweep / bad / "metrics.json").exists()
    assert f"[{ok}] " in proc.stdout and "epoch 2/2" in proc.stdout  # rank 0's log, while the jobs ran
    assert f"outputs in {sweep.relative_to(tmp_path)}" in proc.stderr
    assert f"  {bad}: optim.lr must be a number > 0, got -1" in proc.stderr  # from the job's own process
    assert "Traceback" not in proc.stderr
    # the task logs sit in the sweep, one folder per job id: no `%j` folder there or `.submitit` in the cwd
    assert sorted(p.name for p in tmp_path.iterdir()) == ["multirun"]
    jobs = list((sweep / ".submitit").iterdir())
    assert len(jobs) == 2 and all(p.name.replace("_", "").isdigit() for p in jobs), jobs
    assert all((p / f"{p.name}_0_log.out").exists() for p in jobs)


def test_two_identical_sweeps_into_one_folder_each_report_what_happened_to_their_points(tmp_path):
    args = [sys.executable, str(ROOT / "train.py"), "-m", "debug=fast", "seed=1,2", f"hydra.sweep.dir={tmp_path}/s"]
    procs = [subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)]
    procs.append(subprocess.Popen(args, cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    for proc in procs:
        out, err = proc.communicate(timeout=300)
        refused = "in use by another live run" in err or "still held by the ranks" in err
        if proc.returncode == 0:  # was: a point refused by the other sweep's lock, then "every point completed"
            assert not refused and "every point completed" in out, err[-2000:]
        else:
            assert refused and "point(s) failed" in err and "Traceback" not in err, err[-2000:]
    for seed in (1, 2):  # whatever the interleaving, every point completed in one of the two
        assert json.loads((tmp_path / f"s/debug=fast,seed={seed}/metrics.json").read_text())["status"] == "completed"


@pytest.mark.parametrize("launcher", ["cluster=slurm", "hydra/launcher=submitit_slurm"])
def test_slurm_sweeps_on_a_machine_without_slurm_are_one_line_naming_local_tasks(tmp_path, launcher):
    (tmp_path / "bin").mkdir()  # a PATH without srun and sbatch, whether or not this machine has them
    proc = run_cli("-m", launcher, "debug=fast", "seed=1,2", cwd=tmp_path, env={"PATH": str(tmp_path / "bin")})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]  # was: 25 lines
    [line] = [line for line in proc.stderr.splitlines() if line.strip()]
    assert line.startswith("error: srun and sbatch not found") and "cluster=local_tasks" in line
    assert sorted(p.name for p in tmp_path.iterdir()) == ["bin"]  # no sweep folder


def test_a_submitit_launcher_named_alone_is_read_with_its_cluster_preset(tmp_path):
    """`hydra/launcher=submitit_slurm` alone would submit with submitit's defaults: one task, no GPU, 60 minutes, no
    requeue. It is read as cluster=slurm, which selects the same launcher with the cluster's settings."""
    from src.config.cli import read_launcher

    argv = read_launcher(["-m", "seed=1,2", "hydra/launcher=submitit_slurm", "cluster.gpus_per_node=4"])
    assert argv == ["-m", "seed=1,2", "cluster=slurm", "hydra/launcher=submitit_slurm", "cluster.gpus_per_node=4"]
    assert read_launcher(["hydra/launcher=submitit_local"]) == ["cluster=local_tasks", "hydra/launcher=submitit_local"]
    for given in (["hydra/launcher=submitit_slurm", "cluster=slurm_2nodes"], ["seed=1"]):  # a cluster= choice rules
        assert read_launcher(given) == given
    proc = run_cli("hydra/launcher=submitit_slurm", "--cfg", "all", "--resolve", cwd=tmp_path)  # as a user's is
    assert proc.returncode == 0, proc.stderr[-2000:]
    launcher = yaml.safe_load(proc.stdout)["hydra"]["launcher"]
    assert launcher["_target_"].endswith("SlurmLauncher") and launcher["tasks_per_node"] == launcher["gpus_per_node"]
    assert launcher["gpus_per_node"] == 8 and launcher["timeout_min"] == 240 and launcher["max_num_timeout"] == 3


def test_the_local_submitit_launcher_named_alone_runs_the_local_tasks_sweep(tmp_path):
    """Alone, its jobs could not import ddplab ('No module named src' and 40 lines of traceback)."""
    proc = run_cli("-m", "hydra/launcher=submitit_local", "debug=fast", "seed=1,2", cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert "note: hydra/launcher=submitit_local is read as cluster=local_tasks" in proc.stderr
    [sweep] = list((tmp_path / "multirun").glob("*/*"))
    metrics = [json.loads(p.read_text()) for p in sorted(sweep.glob("*/metrics.json"))]
    assert [(m["status"], m["hparams"]["seed"], m["hparams"]["world_size"]) for m in metrics] == [
        ("completed", 1, 2),
        ("completed", 2, 2),
    ]


@pytest.mark.parametrize(
    ("launcher", "cluster"),
    [
        ("submitit_slurm", "cluster=local"),
        ("submitit_slurm", "cluster=local_tasks"),
        ("submitit_local", "cluster=local"),
    ],
)
def test_a_submitit_launcher_with_a_cluster_of_another_launcher_is_one_line(tmp_path, launcher, cluster):
    proc = run_cli("-m", "seed=1,2", f"hydra/launcher={launcher}", cluster, "debug=fast", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    [line] = [line for line in proc.stderr.splitlines() if line.strip()]
    preset = "cluster=slurm" if launcher == "submitit_slurm" else "cluster=local_tasks"
    assert line == (
        f"error: {cluster} and hydra/launcher={launcher} pick two launchers; drop {cluster} (then "
        f"hydra/launcher={launcher} is read as {preset}) or hydra/launcher={launcher}"
    )
    assert list(tmp_path.iterdir()) == []  # nothing made, nothing submitted


def test_two_launchers_on_one_command_line_are_one_line(tmp_path):
    """Hydra took the last one silently; here, alone and unread, its jobs could not import ddplab (a traceback)."""
    proc = run_cli("-m", "hydra/launcher=submitit_slurm", "hydra/launcher=submitit_local", "debug=fast", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    [line] = [line for line in proc.stderr.splitlines() if line.strip()]
    assert line == "error: hydra/launcher=submitit_slurm and hydra/launcher=submitit_local pick 2 launchers; keep one"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="needs SLURM's client (make slurm-install)")
def test_a_slurm_client_without_a_controller_is_one_line(tmp_path):
    conf = tmp_path / "slurm.conf"  # the real client, pointed at a controller that is not running
    conf.write_text(
        "ClusterName=nowhere\nSlurmctldHost=localhost\nSlurmctldPort=1\nNodeName=localhost CPUs=1 State=UNKNOWN\n"
        "PartitionName=p Nodes=localhost Default=YES\nMessageTimeout=2\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_"))}
    proc = run_cli("-m", "cluster=slurm", "debug=fast", cwd=tmp_path, env={**env, "SLURM_CONF": str(conf)})
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]  # was: 45 lines
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and "cluster=local_tasks" in lines[0], proc.stderr[-2000:]


def test_an_optuna_search_is_scored_on_validation_and_survives_a_diverged_trial(tmp_path):
    sweep = tmp_path / "search"
    proc = run_cli(
        "hparams_search=optuna",
        "debug=fast",
        "trainer.limit_train_batches=null",
        "optim.lr=choice(0.05,0.5,1e6)",  # 1e6 diverges
        "optim.weight_decay=0.0005",
        "trainer.label_smoothing=0.0",
        "hydra.sweeper.n_trials=4",
        f"hydra.sweep.dir={sweep}",
        timeout=600,
    )
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    trials = {}
    for job in sweep.glob("*/metrics.json"):
        m = json.loads(job.read_text())
        trials[job.parent] = (m["status"], m["final"].get("val_top1"), m["final"].get("test_top1"), m["config"])
    diverged = [job for job, t in trials.items() if t[0] == "diverged"]
    assert diverged and proc.returncode == 2, proc.stderr[-2000:]  # reported, and the study went on
    assert all(f"{job.name}: the train loss is nan" in proc.stderr for job in diverged)
    done = {job: t for job, t in trials.items() if t[0] == "completed"}
    assert len({t[1] for t in done.values()}) > 1  # the trials differ: the choice of the best means something
    best_job = max(done, key=lambda job: done[job][1])
    result = yaml.safe_load((sweep / "optimization_results.yaml").read_text())
    assert result["best_value"] == done[best_job][1] != done[best_job][2]  # validation, not test (was: test)
    assert result["best_params"]["optim.lr"] == done[best_job][3]["optim"]["lr"]


def test_a_jobs_record_subdir_is_decided_once_and_no_job_dir_means_no_log_file(tmp_path):
    """Hydra reads hydra.output_subdir twice per job; a second sweep into the same folder wrote `.hydra/` between
    the two reads, and the job ended on Path(None) with a traceback. A sweep's own config has no job dir."""
    import os

    from omegaconf import OmegaConf

    import src  # noqa: F401  (registers the resolvers)

    cfg = OmegaConf.create(
        {
            "hydra": {"runtime": {"output_dir": str(tmp_path)}, "job": {"name": "train"}},
            "subdir": "${record_subdir:.hydra}",
            "log": "${run_log:${hydra.runtime.output_dir},${hydra.job.name}}",
        }
    )
    assert cfg.subdir == ".hydra"
    (tmp_path / ".hydra").mkdir()
    (tmp_path / ".hydra/config.yaml").write_text("{}\n")  # the other sweep's job, between Hydra's two reads
    assert cfg.subdir == ".hydra"
    assert cfg.log == f"{tmp_path}/train.log"
    cfg.hydra.runtime.output_dir = None
    assert cfg.log == os.devnull


def test_no_validation_split_is_a_warning_only_where_a_search_scores_the_run(tmp_path):
    """main's return value is what a search (Optuna) scores: without a validation split the trial has no score and
    the warning says why. A plain run ignores the value, so a preset without one (cifar10_94) warns of nothing."""
    plain = run_cli("debug=fast", "data.val_fraction=0", f"paths.log_dir={tmp_path}")
    assert plain.returncode == 0 and "objective" not in plain.stdout + plain.stderr, plain.stderr[-2000:]
    search = run_cli(
        "hparams_search=optuna",
        "debug=fast",
        "data.val_fraction=0",
        "optim.lr=choice(0.05,0.1)",
        "hydra.sweeper.n_trials=1",
        f"hydra.sweep.dir={tmp_path / 'search'}",
        timeout=300,
    )
    assert "objective val_top1: this run has no validation split" in search.stdout + search.stderr
