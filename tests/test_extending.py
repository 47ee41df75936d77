"""docs/extending.md's strategy recipe, followed with a toy strategy defined here (the dataset and logger
recipes are followed in tests/data/test_data.py and tests/reporting/test_loggers.py)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, ClassVar

import pytest

from src.config.errors import ConfigError
from src.config.schema import Positive
from src.run.launch import main as launch
from src.strategies import Single


@dataclass
class CountingSingle(Single):
    """One device; counts optimizer-step boundaries and refuses odd `every` values through its type hint."""

    every: Annotated[int, Positive] = 1

    name: ClassVar[str] = "counting"
    boundaries: ClassVar[list[int]] = []

    def sync_gradients(self) -> None:
        CountingSingle.boundaries.append(self.every)

    def hparams(self, cfg) -> dict:
        return {**super().hparams(cfg), "every": self.every}


TARGET = "strategy._target_=tests.test_extending.CountingSingle"


def test_a_strategy_is_one_class_and_one_config(cfg_factory, tmp_path):
    from tests.conftest import read_metrics

    CountingSingle.boundaries.clear()
    final = launch(cfg_factory(TARGET, "+strategy.every=3", "trainer.max_epochs=2", "trainer.limit_train_batches=3"))
    assert CountingSingle.boundaries == [3] * 6  # 2 epochs x 3 steps, every one through the strategy
    m = read_metrics(tmp_path / "run")
    assert m["hparams"]["strategy"] == "counting" and m["hparams"]["every"] == 3
    assert final["test_count"] == 360


def test_a_new_strategys_options_are_checked_from_its_type_hints(cfg_factory):
    from src.run.plan import plan_layout

    with pytest.raises(ConfigError, match=r"strategy.every must be a positive integer, got 0"):
        plan_layout(cfg_factory(TARGET, "+strategy.every=0"))
    with pytest.raises(ConfigError, match=r"strategy.evry is not an option of strategy \(CountingSingle\)"):
        plan_layout(cfg_factory(TARGET, "+strategy.evry=2"))


def test_a_new_logger_receives_every_epoch_and_the_final_metrics_from_training(cfg_factory, tmp_path, monkeypatch):
    from tests.conftest import read_metrics
    from tests.reporting.test_loggers import ToyLogger

    monkeypatch.setattr(ToyLogger, "calls", [])
    launch(
        cfg_factory(
            "logger=none",
            "+logger.toy={_target_: tests.reporting.test_loggers.ToyLogger, prefix: 'toy_'}",
            "trainer.max_epochs=2",
        )
    )
    m = read_metrics(tmp_path / "run")
    epochs = [c for c in ToyLogger.calls if c[0] == "toy_metrics"]
    assert [c[1] for c in epochs] == [1, 2, 2]  # two epochs, then the test metrics at the last one
    for call, row in zip(epochs, m["epochs"]):
        assert call[2]["train/loss"] == row["train_loss"] and call[2]["val/top1"] == row["val_top1"]
    assert epochs[-1][2]["test/top1"] == m["final"]["test_top1"]
    (hp,) = [c for c in ToyLogger.calls if c[0] == "toy_hparams"]
    assert hp[1]["strategy"] == "single" and hp[2]["test_top1"] == m["final"]["test_top1"]
    assert ToyLogger.calls[-1] == ("close",)
