"""The sweep report's figure, its choice of sweep and its optional columns (src/reporting/report.py, `make report`,
`make tensorboard`).

Jobs are written with train.py's layout: `.hydra/overrides.yaml`, `.hydra/hydra.yaml` (Hydra's config group
choices), and `metrics.json` with final metrics, hparams and the resolved config.
"""

import csv
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import yaml

from src.reporting import report
from tests.conftest import ROOT, make_env

CHOICES = {"model": "resnet18", "optim": "sgd", "scheduler": "cosine"}
CONFIG = {
    "model": {"_target_": "src.models.cifar_resnet18"},
    "trainer": {"max_epochs": 10},
    "optim": {"_target_": "torch.optim.SGD"},
    "scheduler": {"_target_": "src.run.optim.warmup_cosine"},
}


def final(top1: float, extra=None) -> dict:
    return {
        "val_top1": top1 - 1,
        "test_loss": 0.3,
        "test_top1": top1,
        "test_top5": 99.5,
        "sec_per_epoch": 2.0,
        "images_per_sec": 25000.0 + 100 * top1,
        **(extra or {}),
    }


def make_job(sweep, overrides, metrics=None, choices=CHOICES, config=CONFIG, hparams=None):
    """A job dir as train.py leaves it (no metrics.json when metrics is None)."""
    job = sweep / ",".join(sorted(overrides))
    (job / ".hydra").mkdir(parents=True)
    (job / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(overrides))
    if choices is not None:
        (job / ".hydra" / "hydra.yaml").write_text(yaml.safe_dump({"hydra": {"runtime": {"choices": choices}}}))
    if metrics is not None:
        (job / "metrics.json").write_text(
            json.dumps(
                {"status": "completed", "final": metrics, "config": config, "hparams": hparams or {"world_size": 1}}
            )
        )
    return job


def _make(*args: str) -> list[str]:
    """The project's Makefile run from another directory, with this venv (-o: it is there, do not reinstall)."""
    return [
        "make",
        "-s",
        "-f",
        str(ROOT / "Makefile"),
        "-o",
        str(ROOT / ".venv" / ".installed"),
        f"VENV={ROOT / '.venv'}",
        *args,
    ]


def test_png_values_beside_error_bars_and_accuracy_axis_zoomed(tmp_path):
    tops = {"a": [97.9, 98.3, 98.1], "b": [97.1, 97.6, 97.2], "c": [98.6, 98.5, 98.9]}
    for config, values in tops.items():
        for seed, top1 in enumerate(values):
            make_job(tmp_path, [f"+tag={config}", f"seed={seed}"], final(top1))
    rows = report.aggregate(report.find_jobs(tmp_path))
    fig = report.make_figure(rows)
    fig.savefig(tmp_path / "results.png", dpi=100)  # the final layout, as write_png saves it

    accuracy, throughput = fig.axes
    lows = [r["test_top1_mean"] - r["test_top1_std"] for r in rows]
    highs = [r["test_top1_mean"] + r["test_top1_std"] for r in rows]
    left, right = accuracy.get_xlim()
    assert 90 < left < min(lows) and right > max(highs)  # zoomed to 97-99, not 0-100
    assert throughput.get_xlim()[0] == 0

    for ax, m in ((accuracy, "test_top1"), (throughput, "images_per_sec")):
        texts = [t for t in ax.texts if "(n=" in t.get_text()]
        assert [t.get_text() for t in texts] == [f"{report._cell(r, m)}  (n=3)" for r in rows]
        for text, row in zip(texts, rows):
            box = text.get_window_extent()
            error_end = ax.transData.transform((row[f"{m}_mean"] + row[f"{m}_std"], 0))[0]
            assert box.x0 > error_end  # right of the error bar's end, not under it
            assert ax.bbox.x0 < box.x0 and box.x1 < ax.bbox.x1  # not cut off


def sweep_with_jobs(root, day, hour, with_metrics: bool):
    sweep = root / "multirun" / day / hour
    make_job(sweep, ["strategy=ddp", "seed=1"], final(98.0) if with_metrics else None)
    return sweep


def test_no_argument_reports_the_newest_sweep_that_has_results(tmp_path):
    oldest = sweep_with_jobs(tmp_path, "2025-01-01", "23-00-00.000001", True)
    newest_done = sweep_with_jobs(tmp_path, "2025-01-02", "09-00-00.000001", True)
    running = sweep_with_jobs(tmp_path, "2025-01-02", "10-00-00.000001", False)  # newest, no metrics.json yet
    (running.parent.parent / "2025-01-03").mkdir()  # an empty date directory
    assert report.newest_sweep(tmp_path / "multirun") == newest_done

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    proc = subprocess.run(
        [sys.executable, "-m", "src.reporting.report"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == "report: the newest sweep with results: multirun/2025-01-02/09-00-00.000001\n"
    assert (newest_done / "results.md").read_text() == proc.stdout.split("wrote ")[0].rstrip("\n") + "\n"
    assert not (running / "results.md").exists() and not (oldest / "results.md").exists()

    # make report without SWEEP= does the same
    (newest_done / "results.md").unlink()
    make = subprocess.run(
        _make("report"),
        cwd=tmp_path,
        env=make_env(env),
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert make.returncode == 0, make.stderr
    assert "the newest sweep with results: multirun/2025-01-02/09-00-00.000001" in make.stderr
    assert (newest_done / "results.md").is_file() and not (running / "results.md").exists()


def test_no_argument_and_no_results_is_one_line_error(tmp_path, monkeypatch, capsys):
    sweep_with_jobs(tmp_path, "2025-01-01", "10-00-00.000001", False)
    monkeypatch.chdir(tmp_path)
    assert report.main([]) == 2
    err = capsys.readouterr().err
    assert err.startswith("report: error: no sweep with results under multirun/") and err.count("\n") == 1


PERF = {"peak_mem_gb": 3.5, "tflops_per_gpu": 120.0, "mfu": 0.4}


def test_optional_metric_and_setting_columns(tmp_path):
    for seed in (1, 2):  # ddp reports the optional metrics, single does not (an older job)
        extra = {k: v + seed for k, v in PERF.items()}
        make_job(
            tmp_path,
            ["strategy=ddp", f"seed={seed}"],
            final(98.0 + seed, extra),
            hparams={"world_size": 2, "model": "cifar_resnet18", "peak_mem_gb": 9, "milestones": [1, 2]},
        )
        make_job(tmp_path, ["strategy=single", f"seed={seed}"], final(97.0 + seed))
    report.main([str(tmp_path)])

    md = (tmp_path / "results.md").read_text()
    assert "Settings common to all rows: `max_epochs=10`, `optimizer=sgd`, `scheduler=cosine`" in md
    head = (
        "| configuration | model | world_size | n | failed | val_top1 | test_loss | test_top1 | test_top5 "
        "| sec_per_epoch | images_per_sec | peak_mem_gb | tflops_per_gpu | mfu |"
    )
    assert head in md
    ddp_perf = " | ".join(f"{PERF[k] + 1.5:{report.FORMATS[k]}} ± {0.7071:{report.FORMATS[k]}}" for k in PERF)
    assert "| `strategy=ddp` | resnet18 | 2 | 2 | 0 |" in md and md.count(ddp_perf + " |") == 1
    assert "| `strategy=single` | resnet18 | 1 | 2 | 0 |" in md and md.count("| — | — | — |") == 1

    with open(tmp_path / "results.csv", newline="") as f:
        rows = {r["config"]: r for r in csv.DictReader(f)}
    ddp, single = rows["strategy=ddp"], rows["strategy=single"]
    assert (ddp["model"], ddp["world_size"], ddp["max_epochs"], ddp["optimizer"]) == ("resnet18", "2", "10", "sgd")
    assert float(ddp["mfu_mean"]) == pytest.approx(1.9) and ddp["mfu_n"] == "2"
    assert (single["mfu_mean"], single["mfu_n"]) == ("", "0")


def test_columns_absent_when_no_job_reports_them(tmp_path):
    """No optional metrics, no hydra.yaml: the setting names come from the resolved config's targets."""
    for epochs in (10, 20):
        config = {**CONFIG, "trainer": {"max_epochs": epochs}}
        make_job(
            tmp_path,
            [f"trainer.max_epochs={epochs}", "seed=1"],
            final(98.0),
            choices=None,
            config=config,
            hparams={"world_size": 1, "model": "cifar_resnet18"},
        )
    report.main([str(tmp_path)])
    md = (tmp_path / "results.md").read_text()
    assert "| configuration | model | max_epochs | n | failed | val_top1 | test_loss |" in md
    assert "Settings common to all rows: `world_size=1`, `optimizer=SGD`, `scheduler=warmup_cosine`" in md
    assert "| `trainer.max_epochs=10` | cifar_resnet18 | 10 | 1 | 0 |" in md
    assert not any(m in md for m in report.OPTIONAL_METRICS)
    header = (tmp_path / "results.csv").read_text().splitlines()[0]
    assert not any(m in header for m in report.OPTIONAL_METRICS)


def test_settings_from_hparams_then_hydra_choices(tmp_path):
    """Jobs that record the settings in hparams (no .hydra/hydra.yaml, no config); model=torchvision by name."""
    hparams = {
        "world_size": 4,
        "model": "resnet9",
        "optim": "adamw",
        "scheduler": "onecycle",
        "max_epochs": 40,
        "threads": 2,
        "processes": 1,
        "sync_bn": False,
    }  # extra keys are ignored
    make_job(tmp_path, ["+tag=a", "seed=1"], final(98.0), choices=None, config=None, hparams=hparams)
    config = {**CONFIG, "model": {"_target_": "src.models.torchvision_classifier", "name": "resnet50"}}
    make_job(tmp_path, ["+tag=b", "seed=1"], final(98.0), choices={**CHOICES, "model": "torchvision"}, config=config)
    a, b = report.aggregate(report.find_jobs(tmp_path))
    assert [a[k] for k in report.SETTINGS] == ["resnet9", "4", "40", "adamw", "onecycle"]
    assert [b[k] for k in report.SETTINGS] == ["torchvision:resnet50", "1", "10", "sgd", "cosine"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_make_tensorboard_serves_outputs_and_multirun_on_port(tmp_path):
    from torch.utils.tensorboard import SummaryWriter

    expected = {"outputs/runs/2025-01-01/10-00-00.000001", "multirun/2025-01-01/11-00-00.000001/seed=1"}
    for run in expected:
        with SummaryWriter(tmp_path / run) as writer:
            writer.add_scalar("train/loss", 1.0, 1)
    port = _free_port()
    server = subprocess.Popen(
        _make(f"PORT={port}", "tensorboard"),
        cwd=tmp_path,
        env=make_env(),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        deadline, runs = time.monotonic() + 60, set()
        while time.monotonic() < deadline and server.poll() is None and runs != expected:
            time.sleep(0.5)  # until it listens and has scanned both directories
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/data/runs", timeout=5) as response:
                    runs = set(json.loads(response.read()))
            except OSError:
                pass
        assert runs == expected
    finally:
        os.killpg(server.pid, signal.SIGTERM)  # make and the tensorboard it started (a session of their own)
        server.wait(timeout=30)
