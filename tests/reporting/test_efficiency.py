"""Memory and compute efficiency in every run: the epoch line, metrics.json and the loggers' scalars."""

from __future__ import annotations

import logging

import pytest
import torch

from src.models import build_model
from src.reporting.efficiency import HOST_FIELDS, cpus_named, host, train_step_flops
from src.run.launch import main as launch
from tests.conftest import read_metrics


def test_cpu_runs_report_host_memory_and_no_gpu_figures(cfg_factory, tmp_path, caplog):
    caplog.set_level(logging.INFO, logger="ddplab")
    final = launch(cfg_factory("logger=csv", "trainer.max_epochs=2"))
    m = read_metrics(tmp_path / "run")
    assert 0.05 < final["peak_host_mem_gb"] < 64
    gpu_only = {"tflops_per_gpu", "mfu", "peak_mem_gb"}
    assert not gpu_only & (set(final) | set(m["epochs"][1])), "a per-GPU figure in a CPU run"
    assert "peak host mem" in caplog.text and "TFLOP/s" not in caplog.text and "MFU" not in caplog.text
    header = (tmp_path / "run/metrics.csv").read_text().splitlines()[0].split(",")
    assert "train/peak_host_mem_gb" in header and "train/tflops_per_gpu" not in header


def test_the_machine_is_named_by_its_fields_and_its_cpus_by_model_only_where_known():
    machine = host()
    assert tuple(machine) == HOST_FIELDS and machine["cpus"] >= machine["cpus_usable"] >= 1
    assert cpus_named({"cpus": 64, "cpu_model": "Intel(R) Xeon(R) Processor"}) == "64 CPUs (Intel(R) Xeon(R) Processor)"
    assert cpus_named({"cpus": 8, "cpu_model": None}) == "8 CPUs"  # neither /proc/cpuinfo nor platform names it


def test_flops_per_training_image_match_an_independent_count(cfg_factory):
    """What the GPU rate is computed from: the trainer's count equals one made on the model outside it."""
    from src.distributed import destroy_process_group
    from src.run.trainer import prepare_run

    cfg = cfg_factory()
    run = prepare_run(cfg)
    try:
        run.build()
        model = build_model(cfg.model, 10, 1)
        x, y = torch.randn(4, 1, 8, 8), torch.zeros(4, dtype=torch.long)
        assert run.flops_per_image == pytest.approx(train_step_flops(model, x, y) / 4, rel=1e-9)
    finally:
        run.close()
        destroy_process_group()


def test_ddp_reports_peak_host_memory_and_no_gpu_figures(cfg_factory, tmp_path):
    final = launch(cfg_factory("strategy=ddp", "trainer.devices=2", "trainer.max_epochs=2"))
    assert final["peak_host_mem_gb"] > 0.05 and "tflops_per_gpu" not in final
