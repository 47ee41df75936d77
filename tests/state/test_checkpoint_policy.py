"""The checkpoint policy: objective.metric picks best.pt and the top-k checkpoints and stops a run early, last.pt
is also written every N optimizer steps, and a run resumed from any of these checkpoints ends as the
uninterrupted run does."""

from __future__ import annotations

import pytest
import torch

from src.config.errors import ConfigError
from src.run.trainer import train
from src.state import checkpoint as ckpt
from src.state.run_state import Monitor
from tests.conftest import (
    assert_background_checkpoints_equal_inline,
    read_metrics,
    run_cli,
    start_train,
    start_until_checkpoint,
    weights,
)

EXACT = ("trainer.deterministic=true",)


def _rows(metric: str, *values: float) -> list[dict]:
    return [{"epoch": epoch, metric: value} for epoch, value in enumerate(values, 1)]


def test_the_monitor_ranks_epochs_and_stops_after_patience_epochs_without_an_improvement_over_min_delta():
    loss = Monitor("val_loss", maximize=False, patience=2, min_delta=0.05)
    history = _rows("val_loss", 1.0, 0.9, 0.88, 0.87, 0.8)
    assert [row["epoch"] for row in loss.ranked(history)] == [5, 4, 3, 2, 1]
    assert loss.stop_reason(history[:3]) is None  # 0.88 is better, by less than min_delta: one epoch waited
    assert loss.stop_reason(history[:4]) == (
        "early stopping after epoch 4: val_loss did not improve by more than 0.05 for 2 epochs "
        "(patience 2; best 0.8700 at epoch 4)"
    )  # the best epoch is the best value, however small its improvement
    top1 = Monitor("val_top1")  # the default: no early stopping
    tied = _rows("val_top1", 90.0, 90.0, 80.0)
    assert top1.best(tied)["epoch"] == 1 and top1.stop_reason(tied) is None  # a tie does not replace the best
    assert top1.top_k_name(tied[1]) == "epoch2-val_top1-90.0000"
    assert Monitor().best([{"epoch": 1}, {"epoch": 2}])["epoch"] == 2  # no validation split: the latest


def test_early_stopping_top_k_and_best_follow_the_monitor(tmp_path, cfg_factory):
    """objective.metric=val_loss drives all three; nothing beats epoch 1 by min_delta=100, so patience=2 stops the
    run after epoch 3 of 6, completed, and the reason is in metrics.json."""
    cfg = cfg_factory(
        "trainer.max_epochs=6",
        "objective.metric=val_loss",
        "objective.direction=minimize",
        "trainer.early_stopping.patience=2",
        "trainer.early_stopping.min_delta=100",
        "trainer.save_top_k=2",
    )
    final = train(cfg)
    run = tmp_path / "run"
    metrics = read_metrics(run)
    history = metrics["epochs"]
    assert metrics["status"] == "completed" and [row["epoch"] for row in history] == [1, 2, 3]
    assert metrics["stop_reason"].startswith(
        "early stopping after epoch 3: val_loss did not improve by more than 100 for 2 epochs (patience 2; best "
    )
    ranked = sorted(history, key=lambda row: (row["val_loss"], row["epoch"]))
    assert final["best_epoch"] == ranked[0]["epoch"] and final["val_loss"] == pytest.approx(ranked[0]["val_loss"])
    top = [run / f"checkpoints/epoch{row['epoch']}-val_loss-{row['val_loss']:.4f}.pt" for row in ranked[:2]]
    assert sorted((run / "checkpoints").iterdir()) == sorted(
        [run / "checkpoints/best.pt", run / "checkpoints/last.pt", *top]
    )
    for path, row in zip(top, ranked):
        assert torch.load(path, weights_only=True)["epoch"] == row["epoch"]
    best = weights(run / "checkpoints/best.pt")
    assert all(torch.equal(best[k], v) for k, v in weights(top[0]).items())

    # stopped, then killed before its results were written: the re-run trains no further epoch
    (run / "metrics.json").unlink()
    train(cfg)
    again = read_metrics(run)
    assert [row["epoch"] for row in again["epochs"]] == [1, 2, 3] and again["stop_reason"] == metrics["stop_reason"]


def test_a_run_resumed_from_a_top_k_checkpoint_ends_as_the_uninterrupted_run(tmp_path, cfg_factory):
    common = ("trainer.max_epochs=4", "trainer.save_top_k=4", *EXACT)
    train(cfg_factory(*common, sub="a"))
    (epoch2,) = (tmp_path / "a/run/checkpoints").glob("epoch2-val_top1-*.pt")
    train(cfg_factory(*common, f"trainer.resume={epoch2}", sub="b"))
    a, b = read_metrics(tmp_path / "a/run"), read_metrics(tmp_path / "b/run")
    assert [row["train_loss"] for row in b["epochs"]] == [row["train_loss"] for row in a["epochs"]]
    assert b["final"]["test_loss"] == a["final"]["test_loss"]
    wa, wb = weights(tmp_path / "a/run/checkpoints/last.pt"), weights(tmp_path / "b/run/checkpoints/last.pt")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_top_k_and_early_stopping_without_a_validation_split_are_refused(cfg_factory):
    for override in ("trainer.save_top_k=2", "trainer.early_stopping.patience=3"):
        with pytest.raises(ConfigError) as info:
            train(cfg_factory("data.val_fraction=0", override))
        message = str(info.value)
        assert message.startswith(f"trainer.{override.split('.', 1)[1]} ranks epochs by val_top1, but this data has")
        assert "\n" not in message


def test_a_run_killed_after_a_step_checkpoint_resumes_to_the_uninterrupted_result(tmp_path):
    """SIGKILL (no signal handler runs: a lost node) after the first step checkpoint; the printed resume command
    (no overrides) continues mid-epoch with the run's own checkpoint policy and ends with the same weights."""
    args = ["debug=fast", "trainer.limit_train_batches=null", "trainer.max_epochs=2", "data.batch_size=32", *EXACT]
    args.append("trainer.checkpoint_every_n_steps=10")
    straight = start_train(*args, f"hydra.run.dir={tmp_path}/a")  # alongside
    run_dir = tmp_path / "b"
    proc = start_until_checkpoint(*args, f"hydra.run.dir={run_dir}", run_dir=run_dir)
    proc.kill()
    proc.communicate(timeout=60)
    state = torch.load(run_dir / "checkpoints/last.pt", weights_only=True)
    assert state["step"] > 0  # mid-epoch: only a step checkpoint is
    resumed = run_cli(f"hydra.run.dir={run_dir}")
    out = resumed.stdout + resumed.stderr
    assert resumed.returncode == 0 and f"at epoch {state['epoch'] + 1} step {state['step']}" in out, out[-3000:]
    out = straight.communicate(timeout=300)[0]
    assert straight.returncode == 0, out[-3000:]
    a, b = read_metrics(tmp_path / "a"), read_metrics(run_dir)
    assert b["config"]["trainer"]["checkpoint_every_n_steps"] == 10
    assert [row["train_loss"] for row in b["epochs"]] == pytest.approx([row["train_loss"] for row in a["epochs"]])
    assert b["final"]["test_loss"] == pytest.approx(a["final"]["test_loss"], rel=1e-6)
    wa, wb = weights(tmp_path / "a/checkpoints/last.pt"), weights(run_dir / "checkpoints/last.pt")
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def _files(run_dir) -> dict:
    return {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in sorted(run_dir.rglob("*")) if p.is_file()}


def test_an_early_stopped_run_is_completed_and_a_rerun_says_so(tmp_path):
    run_dir = tmp_path / "run"
    args = ("debug=fast", "trainer.max_epochs=5", "trainer.early_stopping.patience=1")
    first = run_cli(*args, "trainer.early_stopping.min_delta=100", f"hydra.run.dir={run_dir}")
    assert first.returncode == 0, first.stderr[-3000:]
    said = "early stopping after epoch 2: val_top1 did not improve by more than 100 for 1 epoch (patience 1; best"
    assert said in first.stdout, first.stdout[-3000:]
    metrics, before = read_metrics(run_dir), _files(run_dir)
    assert metrics["status"] == "completed" and len(metrics["epochs"]) == 2 and metrics["stop_reason"].startswith(said)
    again = run_cli(f"hydra.run.dir={run_dir}")
    assert again.returncode == 0, again.stderr[-3000:]
    assert "holds a completed run" in again.stdout and f"{metrics['stop_reason']}): nothing to do" in again.stdout
    assert _files(run_dir) == before


@pytest.mark.slow
def test_fsdp_keeps_its_top_k_as_sharded_folders_that_resume_exactly(tmp_path):
    """fsdp's top-k checkpoints are folders like last/ (hard links to the same shards), pruned as epochs rank
    lower; a run resumed from one ends as the uninterrupted run."""
    args = ("debug=fast", "model.batch_norm=false", "strategy=fsdp", "trainer.devices=2", "trainer.max_epochs=3")
    args += ("trainer.save_top_k=2", *EXACT)
    straight = run_cli(*args, f"hydra.run.dir={tmp_path}/a")
    assert straight.returncode == 0, straight.stderr[-3000:]
    directory = tmp_path / "a/checkpoints"
    ranked = sorted(read_metrics(tmp_path / "a")["epochs"], key=lambda row: (-row["val_top1"], row["epoch"]))
    top = [f"epoch{row['epoch']}-val_top1-{row['val_top1']:.4f}" for row in ranked[:2]]
    assert sorted(p.name for p in directory.iterdir()) == sorted(["best", "last", *top])  # nothing else left
    for name, row in zip(top, ranked):
        assert sorted(p.name for p in (directory / name).iterdir()) == [
            ".metadata",
            "__0_0.distcp",
            "__1_0.distcp",
            "state.pt",
        ]
        assert ckpt.load(directory / name)["epoch"] == row["epoch"]
    earliest = min(top, key=lambda name: int(name.split("-")[0].removeprefix("epoch")))  # epoch 1 or 2 of 3
    resumed = run_cli(*args, f"trainer.resume={directory / earliest}", f"hydra.run.dir={tmp_path}/b")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    wa = ckpt.load_full(directory / "last")["model"]
    wb = ckpt.load_full(tmp_path / "b/checkpoints/last")["model"]
    assert all(torch.equal(wa[k], wb[k]) for k in wa)


def test_checkpoints_written_in_the_background_equal_those_the_training_thread_writes(cfg_factory, monkeypatch):
    """A GPU run writes its full checkpoints from a thread while the next epoch trains (BackgroundWrites); forced
    on here, on the CPU, the run ends with the figures and every checkpoint of a run that writes them itself."""
    names = assert_background_checkpoints_equal_inline(cfg_factory, monkeypatch, "trainer.save_top_k=2", *EXACT)
    assert len(names) == 4  # best, last and the two best epochs
