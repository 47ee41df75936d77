"""Memory and compute efficiency in every run: the epoch line, metrics.json and the loggers' scalars."""

from __future__ import annotations

import logging

import pytest
import torch

from src.models import build_model
from src.reporting.efficiency import train_step_flops
from src.run.launch import main as launch
from tests.conftest import read_metrics


def test_every_run_reports_tflops_and_peak_host_memory_on_cpu(cfg_factory, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="ddplab")
    cfg = cfg_factory("logger=csv", "trainer.max_epochs=2")
    final = launch(cfg)
    m = read_metrics(tmp_path / "run")
    # the reference: FLOPs of one training image counted on the same model, independently of the trainer
    model = build_model(cfg.model, 10, 1)
    per_image = train_step_flops(model, torch.randn(4, 1, 8, 8), torch.zeros(4, dtype=torch.long)) / 4
    epoch2 = m["epochs"][1]
    assert epoch2["tflops_per_gpu"] == pytest.approx(per_image * epoch2["images_per_sec"] / 1e12, rel=1e-9)
    assert final["tflops_per_gpu"] == pytest.approx(epoch2["tflops_per_gpu"], rel=1e-9)  # epoch 1 left out
    assert 0.05 < final["peak_host_mem_gb"] < 64 and "mfu" not in final  # no honest CPU peak: no MFU
    assert "peak host mem" in caplog.text and "TFLOP/s" not in caplog.text and "MFU" not in caplog.text  # GPU figures
    header = (tmp_path / "run/metrics.csv").read_text().splitlines()[0].split(",")
    assert {"train/tflops_per_gpu", "train/peak_host_mem_gb"} <= set(header)


def test_ddp_reports_the_max_over_ranks_and_per_device_rates(cfg_factory, tmp_path):
    final = launch(cfg_factory("strategy=ddp", "trainer.devices=2", "trainer.max_epochs=2"))
    m = read_metrics(tmp_path / "run")
    model = build_model(cfg_factory().model, 10, 1)
    per_image = train_step_flops(model, torch.randn(2, 1, 8, 8), torch.zeros(2, dtype=torch.long)) / 2
    epoch2 = m["epochs"][1]
    # two devices share the images: each does half of the FLOPs per second the whole run does
    assert epoch2["tflops_per_gpu"] == pytest.approx(per_image * epoch2["images_per_sec"] / 2 / 1e12, rel=1e-9)
    assert final["peak_host_mem_gb"] > 0.05
