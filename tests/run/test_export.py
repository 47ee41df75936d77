"""`python -m src.run.export`: a checkpoint as .pt, .safetensors or .onnx, each giving the checkpoint's logits."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch
from omegaconf import OmegaConf

from src.models import build_model
from tests.conftest import ROOT, run_cli_together


def _export(*args) -> subprocess.CompletedProcess:
    command = [sys.executable, "-m", "src.run.export", *map(str, args)]
    return subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict[str, Path]:
    """A single run's full checkpoint and an fsdp run's sharded one."""
    root = tmp_path_factory.mktemp("export")
    small = ("data.num_samples=512", "data.num_test=64", "data.shape=[3,16,16]", "trainer.max_epochs=1")  # no more
    common = ("debug=fast", "model=resnet9", "data=synthetic", *small)
    variants = {"single": [], "fsdp": ["strategy=fsdp", "trainer.devices=2"]}
    procs = run_cli_together(*([*common, *args, f"hydra.run.dir={root / name}"] for name, args in variants.items()))
    for proc in procs:
        assert proc.returncode == 0, proc.stderr[-2000:]
    return {"single": root / "single/checkpoints/best.pt", "fsdp": root / "fsdp/checkpoints/best"}


def _logits(checkpoint_weights: dict, config: dict, x: torch.Tensor) -> torch.Tensor:
    """The reference: the model built from the checkpoint's config, its weights loaded as torch saved them."""
    model = build_model(OmegaConf.create(config["model"]), num_classes=10, in_channels=3)
    model.load_state_dict(checkpoint_weights)
    with torch.no_grad():
        return model.eval()(x)


@pytest.mark.slow
def test_safetensors_and_onnx_give_the_checkpoints_logits(runs, tmp_path):
    pytest.importorskip("onnxruntime", reason="ONNX export is optional: pip install onnx onnxscript onnxruntime")
    import onnxruntime
    from safetensors.torch import load_file

    state = torch.load(runs["single"], weights_only=True)
    x = torch.rand(4, *state["config"]["data"]["shape"])
    expected = _logits(state["model"], state["config"], x)
    proc = _export(runs["single"], tmp_path / "m.safetensors")
    assert proc.returncode == 0 and "read back: logits within" in proc.stdout, proc.stderr[-2000:]
    saved = load_file(tmp_path / "m.safetensors")
    assert saved.keys() == state["model"].keys() and all(torch.equal(saved[k], state["model"][k]) for k in saved)
    proc = _export(runs["single"], tmp_path / "m.onnx")
    assert proc.returncode == 0, proc.stderr[-2000:]
    session = onnxruntime.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"])
    got = torch.from_numpy(session.run(None, {"images": x.numpy()})[0])  # a batch of 4: the batch axis is dynamic
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.slow
def test_a_sharded_fsdp_checkpoint_exports_as_its_full_weights(runs, tmp_path):
    from safetensors.torch import load_file

    assert _export(runs["fsdp"], tmp_path / "full.pt").returncode == 0
    full = torch.load(tmp_path / "full.pt", weights_only=True)["model"]
    proc = _export(runs["fsdp"], tmp_path / "m.safetensors")
    assert proc.returncode == 0, proc.stderr[-2000:]
    saved = load_file(tmp_path / "m.safetensors")
    assert saved.keys() == full.keys() and all(torch.equal(saved[k], full[k]) for k in full)


def test_an_unknown_format_or_input_size_is_one_line(runs, tmp_path):
    proc = _export(runs["single"], tmp_path / "m.bin")
    assert (
        proc.returncode == 2
        and proc.stderr.startswith("error: cannot tell the format of")
        and not list(tmp_path.iterdir())
    )
    folder = tmp_path / "a folder.onnx"
    folder.mkdir()
    proc = _export(runs["single"], folder)  # was: IsADirectoryError's traceback
    assert proc.returncode == 2 and proc.stderr == f"error: {folder} is a folder: name the file to write\n"
    folder.rmdir()
    state = torch.load(runs["single"], weights_only=True)
    del state["config"]["data"]["shape"], state["model_io"]  # as a checkpoint of an older version
    state["config"]["data"]["name"] = "mine"
    torch.save(state, tmp_path / "nosize.pt")
    proc = _export(tmp_path / "nosize.pt", tmp_path / "m.onnx")
    assert proc.returncode == 2 and "pass --input-size H" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "m.onnx").exists()
    proc = _export(tmp_path / "nosize.pt", tmp_path / "m.onnx", "--input-size", "0")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith("error: argument --input-size: invalid positive value: '0'")
    assert not (tmp_path / "m.onnx").exists()
