"""predict=true: per-sample predictions, per-class accuracy and confusion matrices of an evaluation."""

from __future__ import annotations

import csv
import json
from collections import Counter
from pathlib import Path

import pytest

from tests.conftest import run_cli


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    run_dir = tmp_path_factory.mktemp("predict") / "run"
    proc = run_cli(
        "debug=fast", "trainer.limit_train_batches=null", "model.batch_norm=false", f"hydra.run.dir={run_dir}"
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    return run_dir


def _predict(trained: Path, out: Path, *args: str) -> tuple[list[dict], dict]:
    proc = run_cli(
        "train=false", "predict=true", f"ckpt_path={trained}/checkpoints/best.pt", f"hydra.run.dir={out}", *args
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    with open(out / "predictions/test.csv", newline="") as f:
        rows = list(csv.DictReader(f))
    return rows, json.loads((out / "eval.json").read_text())["final"]


@pytest.mark.slow
def test_predictions_agree_with_the_evaluation_and_across_strategies(trained, tmp_path):
    rows, final = _predict(trained, tmp_path / "single")
    assert [int(r["index"]) for r in rows] == list(range(final["test_count"]))  # every test sample once, in order
    hits = [r["top1"] == r["label"] for r in rows]
    assert 100 * sum(hits) / len(rows) == pytest.approx(final["test_top1"])  # the same top-1 as the evaluation
    assert 10 < final["test_top1"] < 100  # trained: the predictions mean something
    top5 = [r["label"] in [r[f"top{i}"] for i in range(1, 6)] for r in rows]
    assert 100 * sum(top5) / len(rows) == pytest.approx(final["test_top5"])
    for r in rows[:50]:
        probs = [float(r[f"p{i}"]) for i in range(1, 6)]
        assert probs == sorted(probs, reverse=True) and 0 < sum(probs) <= 1 + 1e-5
    per_label, right = Counter(r["label"] for r in rows), Counter(r["label"] for r in rows if r["top1"] == r["label"])
    assert final["test_per_class_top1"] == pytest.approx({c: 100 * right[c] / n for c, n in per_label.items()})
    assert (tmp_path / "single/predictions/test_confusion.png").read_bytes()[:4] == b"\x89PNG"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    images = EventAccumulator(str(tmp_path / "single/predictions")).Reload().Tags()["images"]
    assert {"confusion/test", "confusion/val"} <= set(images)
    ddp, _ = _predict(trained, tmp_path / "ddp", "strategy=ddp", "trainer.devices=2")  # 2 ranks, 2 shards
    assert [(r["index"], r["label"], r["top1"]) for r in ddp] == [(r["index"], r["label"], r["top1"]) for r in rows]
    assert [float(r["p1"]) for r in ddp] == pytest.approx([float(r["p1"]) for r in rows], abs=1e-5)


def test_predict_without_an_evaluation_is_one_line(tmp_path):
    proc = run_cli("debug=fast", "predict=true", f"hydra.run.dir={tmp_path}/run")
    assert proc.returncode == 2 and "predict=true writes an evaluation's predictions: add train=false" in proc.stderr


def test_a_file_in_the_way_of_the_predictions_is_one_line(trained, tmp_path):
    (tmp_path / ".hydra").mkdir()  # an earlier run's dir (a folder no run wrote is refused before: test_faults.py)
    (tmp_path / "predictions").write_text("mine")
    proc = run_cli(
        "train=false", "predict=true", f"ckpt_path={trained}/checkpoints/best.pt", f"hydra.run.dir={tmp_path}"
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]  # was: FileExistsError
    assert f"error: {tmp_path / 'predictions'} is in the way (not a folder)" in proc.stderr
    assert (tmp_path / "predictions").read_text() == "mine"
