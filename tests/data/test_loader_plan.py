"""The loader plan (src/data/loader_plan.py): where images live, decode and get cropped, resolved once from the
data options, the device and the dataset, against a table written here; and the loader names of before issue 32
(data.loader=gpu, classic; model=small_cnn), which keep working."""

from __future__ import annotations

import logging

import pytest
import torch

from src.config.cli import problem
from src.config.errors import ConfigError
from src.data.datasets import check_data_config
from src.data.loader_plan import LoaderOptions, LoaderPlan, dali_installed, resolve_plan
from src.run.trainer import train
from src.state.resume import current_config
from tests.conftest import ROOT, make_cfg, read_metrics

CPU, CUDA = torch.device("cpu"), torch.device("cuda", 0)
IN_MEMORY, ENCODED, OWN = (True, False), (False, True), (False, False)  # (in_memory, encoded)
FEW_CPUS = "dali" if dali_installed() else "gpu"
EIGHT_CPUS = (
    LoaderPlan(False, True, "dali", True, 7)
    if dali_installed()
    else LoaderPlan(False, True, "cpu", False, 7, crop_measured=True)
)

PLANS = [  # (options, device, dataset, trivial, the plan)
    ({}, CUDA, IN_MEMORY, False, LoaderPlan(resident=True)),
    ({}, CPU, IN_MEMORY, False, LoaderPlan(workers=0)),
    ({"num_workers": 2}, CUDA, IN_MEMORY, True, LoaderPlan(workers=2)),  # trivial runs in CPU workers
    ({"loader": "workers", "num_workers": 2}, CUDA, IN_MEMORY, False, LoaderPlan(workers=2)),
    ({"num_workers": 2}, CPU, OWN, False, LoaderPlan(from_disk=True, workers=2)),  # a builder's own Dataset
    # decode=auto, few CPUs: DALI where it is installed (requirements.txt, on Linux x86-64), else GPU decoding
    ({"num_workers": 3}, CUDA, ENCODED, False, LoaderPlan(False, True, FEW_CPUS, True, 3)),
    # decode=auto, CPUs enough: the workers crop until the GPU is seen waiting for them (crop_measured)
    ({"num_workers": 15}, CUDA, ENCODED, False, LoaderPlan(False, True, "cpu", False, 15, crop_measured=True)),
    # 8 CPUs per GPU: DALI decodes faster where it is installed, else the CPU workers do
    ({"num_workers": 7}, CUDA, ENCODED, False, EIGHT_CPUS),
    ({"num_workers": 4, "crop": "workers"}, CUDA, ENCODED, False, LoaderPlan(False, True, "cpu", False, 4)),
    ({"num_workers": 4}, CUDA, ENCODED, True, LoaderPlan(False, True, "cpu", False, 4)),  # trivial: CPU workers
    ({"num_workers": 4}, CPU, ENCODED, False, LoaderPlan(False, True, "cpu", False, 4)),
    ({"num_workers": 4, "decode": "cpu"}, CUDA, ENCODED, False, LoaderPlan(False, True, "cpu", False, 4, 0, 0, True)),
    (
        {"num_workers": 4, "decode": "cpu", "crop": "device"},
        CUDA,
        ENCODED,
        False,
        LoaderPlan(False, True, "cpu", True, 4),
    ),
    ({"num_workers": 4, "decode": "gpu"}, CPU, ENCODED, False, LoaderPlan(False, True, "gpu", True, 4)),
    (
        {"num_workers": 4, "decode": "split", "gpu_share": 0.3},
        CUDA,
        ENCODED,
        False,
        LoaderPlan(False, True, "split", True, 4, gpu_share=0.3, gpu_workers=3),
    ),
    ({"num_workers": 4, "decode": "dali"}, CUDA, ENCODED, False, LoaderPlan(False, True, "dali", True, 4)),
    ({"num_workers": 0, "decode": "dali"}, CPU, ENCODED, False, LoaderPlan(False, True, "dali", True, 1)),  # a thread
]
NAMES = ["resident", "workers", "workers", "workers", "workers", f"decode-{FEW_CPUS}", "decode-cpu", EIGHT_CPUS.name]
NAMES += ["decode-cpu"]
NAMES += ["decode-cpu", "decode-cpu", "decode-cpu", "decode-cpu-crop-device", "decode-gpu", "decode-split"]
NAMES += ["decode-dali", "decode-dali"]


@pytest.mark.parametrize("case, name", list(zip(PLANS, NAMES, strict=True)))
def test_each_choice_resolves_to_its_plan_and_name(case, name):
    options, device, (in_memory, encoded), trivial, plan = case
    got = resolve_plan(
        LoaderOptions(**{"loader": "auto", "num_workers": 0, **options}), device, in_memory, encoded, trivial
    )
    assert got == plan and got.name == name


def test_plans_that_cannot_run_are_one_line():
    with pytest.raises(
        ConfigError, match=r"^data.loader=resident needs a dataset that fits in memory; use data.loader"
    ):
        resolve_plan(LoaderOptions("resident", 0), CUDA, False, True, False)
    with pytest.raises(ConfigError, match=r"^data.auto_augment=trivial runs in the workers of in-memory data"):
        resolve_plan(LoaderOptions("auto", 0), CPU, False, False, True)


@pytest.mark.parametrize("old, new", [("gpu", "resident"), ("classic", "workers")])
def test_an_old_loader_name_is_its_new_one_with_a_warning_and_silently_in_a_saved_run(tmp_path, caplog, old, new):
    cfg = make_cfg(tmp_path, f"data.loader={old}")
    with caplog.at_level(logging.WARNING, logger="src.data.datasets"):
        check_data_config(cfg.data)
    assert cfg.data.loader == new
    assert [r.getMessage() for r in caplog.records] == [f"data.loader={old} is now called data.loader={new}"]
    saved = {"data": {"loader": old, "_target_": "src.datasets.load_digits_data"}, "model": {"width": 16}}
    assert current_config(saved) == {
        "data": {"loader": new, "_target_": "src.data.datasets.load_digits_data"},
        "model": {"width": 16},
    }


def test_the_old_small_cnn_is_named_tiny_cnn():
    assert problem(["model=small_cnn"]) == "model=small_cnn is now called model=tiny_cnn"
    assert problem(["model=tiny_cnn", "model.width=16"]) is None


def test_a_digits_run_with_the_old_loader_name_trains(tmp_path):
    """data=digits on the CPU with data.loader=classic and two workers: the run of data.loader=workers, recorded
    under the new name."""
    old, new = (
        train(make_cfg(tmp_path / name, "data=digits", f"data.loader={name}", "data.num_workers=2"))
        for name in ("classic", "workers")
    )
    assert old["test_count"] == 360 and old["test_loss"] == new["test_loss"]
    saved = read_metrics(tmp_path / "classic" / "run")
    assert saved["hparams"]["loader"] == "workers" and saved["config"]["data"]["loader"] == "workers"


@pytest.mark.parametrize("preset", sorted(p.stem for p in (ROOT / "conf/experiment").glob("*.yaml")))
def test_no_shipped_preset_uses_an_old_name(tmp_path, caplog, preset):
    """The old names are for users' saved commands and runs: ddplab's own presets say the current ones, so that
    running one prints no renaming warning."""
    cfg = make_cfg(tmp_path, f"experiment={preset}", f"data.root={tmp_path}")  # presets of a folder need one
    with caplog.at_level(logging.WARNING, logger="src.data.datasets"):
        check_data_config(cfg.data)
    assert not [r.getMessage() for r in caplog.records if "is now called" in r.getMessage()]
