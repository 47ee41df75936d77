"""Sweep report (src/reporting/report.py) and TensorBoard summaries (src/reporting/loggers.py).

Sweeps are built in tmp_path with the real layout (job dirs named like Hydra's override_dirname,
`.hydra/overrides.yaml`, `metrics.json`); expected means/stds are computed here from the same
numbers with the statistics module. The TensorBoard tests read the event files back with
TensorBoard's own reader and through a real `tensorboard` server's HTTP API.
"""

import csv
import json
import socket
import statistics
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import matplotlib.image
import pytest
import yaml

from src.reporting import report
from src.reporting.loggers import open_writer, write_hparams

ROOT = Path(__file__).resolve().parents[2]
COMMON = "data.batch_size=128"


def final_metrics(strategy: str, seed: int) -> dict:
    """Distinct, deterministic numbers for every job."""
    k = {"ddp": 1, "single": 2, "fsdp": 3}[strategy]
    return {
        "val_top1": 89.0 + k + 0.5 * seed,
        "test_loss": 0.1 * k + 0.013 * seed,
        "test_top1": 90.0 + k + 0.7 * seed,
        "test_top5": 99.0 + 0.1 * seed,
        "best_val_top1": 89.0 + k,
        "best_epoch": 2,
        "sec_per_epoch": 1.0 + 0.5 * k - 0.05 * seed,
        "images_per_sec": 1000.0 * k + 37 * seed,
    }


def make_job(sweep: Path, overrides: list, final=None, status="completed") -> Path:
    """A job dir as Hydra + train.py leave it; no metrics.json when final is None."""
    job = sweep / ",".join(sorted(overrides))
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    if final is not None:
        (job / "metrics.json").write_text(
            json.dumps({"status": status, "final": final, "epochs": [], "hparams": {}, "overrides": overrides})
        )
    return job


@pytest.fixture
def sweep(tmp_path):
    """ddp and single with seeds 0-2, fsdp with one seed, plus two jobs that must not count."""
    d = tmp_path / "multirun" / "2025-01-01" / "12-00-00.000001"
    for strategy, seeds in (("ddp", [0, 1, 2]), ("single", [0, 1, 2]), ("fsdp", [0])):
        for seed in seeds:
            make_job(d, [COMMON, f"strategy={strategy}", f"seed={seed}"], final_metrics(strategy, seed))
    make_job(d, [COMMON, "strategy=ddp", "seed=3"])  # crashed: no metrics.json
    make_job(d, [COMMON, "strategy=single", "seed=3"], final_metrics("single", 3), status="running")
    (d / "multirun.yaml").write_text("{}\n")  # Hydra's sweep-level file, not a job
    return d


def expected(strategy: str, seeds: list, metric: str):
    values = [final_metrics(strategy, s)[metric] for s in seeds]
    return statistics.mean(values), (statistics.stdev(values) if len(values) > 1 else None)


def test_aggregate_means_stds_counts(sweep):
    rows = report.aggregate(report.find_jobs(sweep))
    by_config = {r["config"]: r for r in rows}
    assert list(by_config) == [f"{COMMON},strategy={s}" for s in ("ddp", "fsdp", "single")]
    for strategy, seeds, n_failed in (("ddp", [0, 1, 2], 1), ("single", [0, 1, 2], 1), ("fsdp", [0], 0)):
        row = by_config[f"{COMMON},strategy={strategy}"]
        assert (row["n"], row["n_failed"], row["seeds"]) == (len(seeds), n_failed, [str(s) for s in seeds])
        for m in report.METRICS:
            mean, std = expected(strategy, seeds, m)
            assert row[f"{m}_n"] == len(seeds)
            assert row[f"{m}_mean"] == pytest.approx(mean, rel=1e-12)
            assert row[f"{m}_std"] == (None if std is None else pytest.approx(std, rel=1e-12))

    failed = {d.name: reason for d, reason in report.failed_jobs(report.find_jobs(sweep))}
    assert failed == {
        f"{COMMON},seed=3,strategy=ddp": "no metrics.json (crashed, killed or still running)",
        f"{COMMON},seed=3,strategy=single": "status=running",
    }


def test_cli_writes_md_csv_png(sweep, tmp_path):
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "src.reporting.report", str(sweep), "--out", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 0, proc.stderr

    with open(out / "results.csv", newline="") as f:
        rows = {r["config"]: r for r in csv.DictReader(f)}
    assert set(rows) == {f"{COMMON},strategy={s}" for s in ("ddp", "fsdp", "single")}
    ddp = rows[f"{COMMON},strategy=ddp"]
    assert (ddp["n"], ddp["n_failed"], ddp["seeds"]) == ("3", "1", "0 1 2")
    mean, std = expected("ddp", [0, 1, 2], "test_top1")
    loss_mean, loss_std = expected("ddp", [0, 1, 2], "test_loss")
    assert float(ddp["test_top1_mean"]) == pytest.approx(mean)
    assert float(ddp["test_top1_std"]) == pytest.approx(std)
    assert ddp["test_top1_n"] == "3"
    assert rows[f"{COMMON},strategy=fsdp"]["test_top1_std"] == ""  # n=1: std undefined

    md = (out / "results.md").read_text()
    assert md == proc.stdout.split("wrote ")[0].rstrip("\n") + "\n"
    # the override common to all rows is left out of the labels
    val_mean, val_std = expected("ddp", [0, 1, 2], "val_top1")
    row = (
        f"| `strategy=ddp` | 3 | 1 | {val_mean:.2f} ± {val_std:.2f} | {loss_mean:.4f} ± {loss_std:.4f} | {mean:.2f} ± "
    )
    assert row + f"{std:.2f} |" in md
    fsdp = final_metrics("fsdp", 0)
    assert f"| `strategy=fsdp` | 1 | 0 | {fsdp['val_top1']:.2f} ± — | {fsdp['test_loss']:.4f} ± — |" in md
    assert "## Failed or unfinished jobs: 2" in md
    assert f"{COMMON},seed=3,strategy=ddp`: no metrics.json (crashed, killed or still running)" in md
    assert f"{COMMON},seed=3,strategy=single`: status=running" in md

    png = out / "results.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    image = matplotlib.image.imread(png)
    assert image.ndim == 3 and image.shape[0] > 100 and image.shape[1] > 100
    assert not (sweep / "results.md").exists()  # --out, not the sweep dir


def test_several_sweeps_pooled_or_by_sweep(tmp_path, capsys):
    a, b = tmp_path / "mr" / "day" / "a", tmp_path / "mr" / "day" / "b"
    for d, seeds in ((a, [0, 1]), (b, [2])):
        for seed in seeds:
            make_job(d, ["strategy=ddp", f"seed={seed}"], final_metrics("ddp", seed))

    pooled_dir = tmp_path / "pooled"
    assert report.main([str(tmp_path / "mr" / "day" / "*")]) == 2  # was: written into a's own results
    assert "pass --out DIR" in capsys.readouterr().err and not (a / "results.csv").exists()
    assert report.main([str(tmp_path / "mr" / "day" / "*"), "--out", str(pooled_dir)]) == 0  # quoted glob, pooled
    (pooled,) = report.aggregate(report.find_jobs(tmp_path / "mr"))
    assert pooled["n"] == 3 and pooled["sweep"] is None
    assert pooled["test_top1_mean"] == pytest.approx(expected("ddp", [0, 1, 2], "test_top1")[0])
    assert (pooled_dir / "results.csv").exists() and not (a / "results.csv").exists()

    assert report.main([str(a), str(b), "--by-sweep", "--out", str(pooled_dir)]) == 0
    with open(pooled_dir / "results.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    assert [(r["sweep"], r["n"]) for r in rows] == [(str(a), "2"), (str(b), "1")]
    assert report.main([str(a), str(tmp_path / "mr"), "--out", str(pooled_dir)]) == 0  # overlapping: counted once
    assert "| `strategy=ddp` | 3 | 0 |" in capsys.readouterr().out.split("# Sweep report")[-1]


@pytest.mark.parametrize("kind", ["missing", "empty", "glob"])
def test_bad_path_is_one_line_error(tmp_path, capsys, kind):
    (tmp_path / "empty").mkdir()
    arg = {"missing": tmp_path / "nope", "empty": tmp_path / "empty", "glob": tmp_path / "zz*"}[kind]
    assert report.main([str(arg)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("report: error: ") and err.count("\n") == 1


def test_jobs_whose_files_train_py_did_not_write_are_listed_not_a_traceback(tmp_path):
    """A damaged or hand-edited job is one of the failed or unfinished jobs, named with what is wrong; the
    others are still averaged. A metric that is not a number was a ValueError traceback."""
    good = [make_job(tmp_path, [COMMON, f"seed={s}"], final_metrics("ddp", s)) for s in (1, 2)]
    text = make_job(tmp_path, [COMMON, "seed=3"], {**final_metrics("ddp", 3), "test_top1": "abc"})
    listed = make_job(tmp_path, [COMMON, "seed=4"], [1, 2])
    flag = make_job(tmp_path, [COMMON, "seed=5"], {**final_metrics("ddp", 5), "test_loss": True})
    hydra = make_job(tmp_path, [COMMON, "seed=6"], final_metrics("ddp", 6))
    (hydra / ".hydra" / "overrides.yaml").write_text("- seed=6\n- [a\n")
    proc = subprocess.run(
        [sys.executable, "-m", "src.reporting.report", str(tmp_path)], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 0 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert f"`{text}`: metrics.json's final test_top1 is 'abc', not a number as train.py writes" in proc.stdout
    assert f"`{listed}`: metrics.json's final is list, not the metrics train.py writes" in proc.stdout
    assert f"`{flag}`: metrics.json's final test_loss is True, not a number as train.py writes" in proc.stdout
    assert f"`{hydra}`: unreadable .hydra/overrides.yaml" in proc.stdout
    [row] = report.aggregate(report.find_jobs(tmp_path))
    assert row["n"] == 2 and row["n_failed"] == 3
    expect = statistics.fmean(json.loads((g / "metrics.json").read_text())["final"]["test_top1"] for g in good)
    assert row["test_top1_mean"] == pytest.approx(expect)


@pytest.mark.parametrize("name", ["results.md", "results.csv", "results.png"])
def test_files_of_the_users_named_like_the_results_are_left_alone(tmp_path, capsys, name):
    """The report writes results.md/.csv/.png into the sweep: one of those names that it did not write there
    (the user's notes) is one line, and nothing in the folder changes; its own files it replaces."""
    for s in (1, 2):
        make_job(tmp_path, [COMMON, f"seed={s}"], final_metrics("ddp", s))
    assert report.main([str(tmp_path)]) == 0 and report.main([str(tmp_path)]) == 0  # its own files: replaced
    for own in ("results.md", "results.csv", "results.png"):
        (tmp_path / own).unlink()
    (tmp_path / name).write_bytes(b"\x89PNG mine" if name.endswith(".png") else b"my notes\n")
    before = sorted(p.name for p in tmp_path.iterdir())
    capsys.readouterr()
    assert report.main([str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err == f"report: error: {tmp_path / name} is not a report's {name[7:]} file; move it, or pass --out DIR\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == before
    assert (tmp_path / name).read_bytes() in (b"\x89PNG mine", b"my notes\n")


def test_an_untagged_png_beside_a_reports_markdown_is_an_earlier_reports(tmp_path):
    for s in (1, 2):
        make_job(tmp_path, [COMMON, f"seed={s}"], final_metrics("ddp", s))
    assert report.main([str(tmp_path)]) == 0
    report.make_figure([]).savefig(tmp_path / "results.png", dpi=50)  # matplotlib's own Software chunk only
    assert report.main([str(tmp_path)]) == 0
    assert b"ddplab report" in (tmp_path / "results.png").read_bytes()[:4096]


def write_job_events(run_dir: Path, hparams: dict, final: dict) -> None:
    writer = open_writer(run_dir)
    for step in range(1, 4):
        writer.add_scalar("train/loss", 1.0 / step, step)
        writer.add_scalar("val/top1", 80.0 + step, step)
    write_hparams(writer, hparams, final, step=3)
    writer.close()


HPARAMS = {
    "strategy": "ddp",
    "world_size": 2,
    "lr": 0.1,
    "amp": False,
    "model": "tiny_cnn",
    "milestones": [3, 6],
    "note": None,
}


def test_hparams_in_the_job_event_file(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer
    from tensorboard.plugins.hparams import metadata

    final = final_metrics("ddp", 1)
    write_job_events(tmp_path / "job", HPARAMS, final)

    # One run, named by the job's directory: its event file(s) and no sub-run directory.
    assert all(p.is_file() and p.name.startswith("events.out.tfevents.") for p in (tmp_path / "job").iterdir())
    mux = EventMultiplexer().AddRunsFromDirectory(str(tmp_path))
    assert list(mux.Runs()) == ["job"]

    acc = EventAccumulator(str(tmp_path / "job")).Reload()
    content = acc.PluginTagToContent(metadata.PLUGIN_NAME)
    assert set(content) == {metadata.EXPERIMENT_TAG, metadata.SESSION_START_INFO_TAG, metadata.SESSION_END_INFO_TAG}

    start = metadata.parse_session_start_info_plugin_data(content[metadata.SESSION_START_INFO_TAG])
    values = {k: getattr(v, v.WhichOneof("kind")) for k, v in start.hparams.items()}
    # numbers are numbers; bools and anything else (list, None) are strings
    assert values == {
        "strategy": "ddp",
        "world_size": "2",
        "lr": 0.1,
        "amp": "False",
        "model": "tiny_cnn",
        "milestones": "[3, 6]",
        "note": "None",
    }
    assert isinstance(values["lr"], float)  # integers are text: TensorBoard prints a number as 2.0000

    experiment = metadata.parse_experiment_plugin_data(content[metadata.EXPERIMENT_TAG])
    tags = {
        f"z_final/{m}"
        for m in ("test_loss", "test_top1", "test_top5", "best_val_top1", "sec_per_epoch", "images_per_sec")
    }
    assert {mi.name.tag for mi in experiment.metric_infos} == tags
    assert {hi.name for hi in experiment.hparam_infos} == set(HPARAMS)
    for tag in tags:
        (event,) = acc.Scalars(tag)
        assert (event.step, event.value) == (3, pytest.approx(final[tag.split("/", 1)[1]], rel=1e-6))
    assert [e.step for e in acc.Scalars("train/loss")] == [1, 2, 3]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(url: str, body: dict = None):
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=10) as response:
        return json.loads(response.read())


def test_tensorboard_server_shows_runs_scalars_and_hparams(tmp_path):
    finals = {"ddp": final_metrics("ddp", 0), "single": final_metrics("single", 0)}
    for strategy, final in finals.items():
        write_job_events(tmp_path / f"seed=0,strategy={strategy}", {**HPARAMS, "strategy": strategy}, final)
    runs = {f"seed=0,strategy={s}" for s in finals}

    port = _free_port()
    base = f"http://127.0.0.1:{port}"
    with open(tmp_path / "tensorboard.log", "w") as log:
        server = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "tensorboard.main",
                "--logdir",
                str(tmp_path),
                "--host",
                "127.0.0.1",
                "--port",
                str(port),
                "--load_fast",
                "false",
                "--reload_interval",
                "1",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            deadline, seen = time.monotonic() + 30, None
            while time.monotonic() < deadline and server.poll() is None:
                try:
                    seen = set(_http(f"{base}/data/runs"))
                except OSError:
                    seen = None  # not listening yet
                if seen == runs:
                    break
                time.sleep(0.3)
            assert seen == runs, f"runs {seen}; log:\n{(tmp_path / 'tensorboard.log').read_text()[-2000:]}"

            tags = _http(f"{base}/data/plugin/scalars/tags")
            for run in runs:
                assert {"train/loss", "val/top1", "z_final/test_top1", "z_final/images_per_sec"} <= set(tags[run])

            experiment = _http(f"{base}/data/plugin/hparams/experiment", {"experimentName": ""})
            assert {h["name"] for h in experiment["hparamInfos"]} == set(HPARAMS)
            assert "z_final/test_top1" in {m["name"]["tag"] for m in experiment["metricInfos"]}

            groups = _http(
                f"{base}/data/plugin/hparams/session_groups",
                {
                    "experimentName": "",
                    "allowedStatuses": ["STATUS_UNKNOWN", "STATUS_SUCCESS", "STATUS_FAILURE", "STATUS_RUNNING"],
                    "colParams": [],
                    "startIndex": 0,
                    "sliceSize": 100,
                },
            )
            assert groups["totalSize"] == 2
            for group in groups["sessionGroups"]:
                (session,) = group["sessions"]
                strategy = group["hparams"]["strategy"]
                assert session["name"] == f"seed=0,strategy={strategy}"
                assert session["status"] == "STATUS_SUCCESS"
                metric_values = {v["name"]["tag"]: v["value"] for v in session["metricValues"]}
                for name in ("test_loss", "test_top1", "images_per_sec"):
                    assert metric_values[f"z_final/{name}"] == pytest.approx(finals[strategy][name], rel=1e-6)
        finally:
            server.terminate()
            try:
                server.wait(timeout=10)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()
