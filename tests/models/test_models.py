"""The model group's builders (timm, one-line errors) and src/reporting/efficiency.py (FLOPs, peaks, MFU, memory)."""

from __future__ import annotations

import importlib.util

import pytest
import torch
from torch import nn

from src.config.errors import ConfigError
from src.models import build_model
from src.reporting.efficiency import memory_stats, mfu, peak_flops, reset_peak, train_step_flops
from tests.conftest import run_cli

needs_timm = pytest.mark.skipif(importlib.util.find_spec("timm") is None, reason="timm is not installed")

TIMM_MODELS = {  # overrides -> input side
    "resnet18": (["model.name=resnet18"], 8),
    "vit": (["model.name=vit_tiny_patch16_224", "model.img_size=16", "+model.kwargs.patch_size=4"], 16),
    "test_vit": (["model.name=test_vit", "model.img_size=32"], 32),
}


@needs_timm
@pytest.mark.parametrize("channels", [1, 3])
@pytest.mark.parametrize("which", TIMM_MODELS)
def test_timm_model_builds_for_the_datas_channels_and_classes(cfg_factory, monkeypatch, which, channels):
    import timm

    calls = []
    create = timm.create_model
    monkeypatch.setattr(timm, "create_model", lambda *a, **kw: calls.append(kw) or create(*a, **kw))
    overrides, side = TIMM_MODELS[which]
    model = build_model(cfg_factory("model=timm", *overrides).model, num_classes=7, in_channels=channels)
    logits = model(torch.randn(2, channels, side, side))
    assert logits.shape == (2, 7)
    assert calls and calls[0]["pretrained"] is False  # random init: nothing to download


@needs_timm
@pytest.mark.parametrize("name, suggested", [("resnt18", "resnet18"), ("vit_tiny", "vit_tiny_patch16_224")])
def test_unknown_timm_name_is_one_line_with_close_names(cfg_factory, name, suggested):
    with pytest.raises(ConfigError) as err:
        build_model(cfg_factory("model=timm", f"model.name={name}").model, num_classes=7, in_channels=3)
    assert "\n" not in str(err.value) and name in str(err.value) and suggested in str(err.value)


@needs_timm
def test_timm_refuses_settings_ddplab_owns(cfg_factory):
    cfg = cfg_factory("model=timm", "+model.kwargs.pretrained=true").model
    with pytest.raises(ConfigError, match="pretrained"):
        build_model(cfg, num_classes=7, in_channels=3)


def test_bad_torchvision_name_is_ddplabs_one_line_error_not_hydras(cfg_factory):
    with pytest.raises(ConfigError) as err:  # not Hydra's InstantiationException around it
        build_model(cfg_factory("model=torchvision", "model.name=nope").model, num_classes=7, in_channels=3)
    assert "\n" not in str(err.value) and "'nope'" in str(err.value)


@pytest.mark.parametrize("model", ["torchvision", pytest.param("timm", marks=needs_timm)])
def test_cli_bad_model_name_is_one_stderr_line(tmp_path, model):
    proc = run_cli(
        f"model={model}", "model.name=nope", "trainer.device=cpu", f"hydra.run.dir={tmp_path}/r", timeout=120
    )
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and "'nope'" in lines[0], proc.stderr


@needs_timm
@pytest.mark.parametrize(
    "size, hint",
    [
        ([], "set model.img_size=8 (ViTs)"),  # built for 224 px
        (["model.img_size=8"], "+model.kwargs.patch_size=4"),  # 8 px, but 16 px patches
    ],
)
def test_a_model_built_for_other_inputs_is_one_line_saying_what_to_set(tmp_path, size, hint):
    """A ViT built for 224 px on the 8 x 8 digits failed in its first forward with a traceback."""
    proc = run_cli("model=timm", "model.name=vit_tiny_patch16_224", *size, f"hydra.run.dir={tmp_path}/r", timeout=120)
    lines = proc.stderr.strip().splitlines()
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-2000:]
    assert lines[0].startswith("error: model=vit_tiny_patch16_224 cannot take this data's 1x8x8 images (")
    assert hint in lines[0], lines[0]
    assert "Traceback" not in proc.stdout + proc.stderr


# --- efficiency ---------------------------------------------------------------------------------------------


def _conv_net() -> nn.Module:
    # BatchNorm, ReLU and Dropout are elementwise: FlopCounterMode counts them as 0
    return nn.Sequential(
        nn.Conv2d(3, 8, 3, padding=1, bias=False),
        nn.BatchNorm2d(8),
        nn.ReLU(),
        nn.Conv2d(8, 8, 3, padding=1),
        nn.ReLU(),
        nn.Dropout(0.5),
        nn.Flatten(),
        nn.Linear(8 * 8 * 8, 7),
    )


def test_train_step_flops_matches_a_hand_count():
    n, side = 4, 8
    conv1 = 2 * n * 8 * side * side * 3 * 3 * 3  # 2 (multiply+add) x N x Cout x H x W x Cin x k x k
    conv2 = 2 * n * 8 * side * side * 8 * 3 * 3
    linear = 2 * n * (8 * side * side) * 7  # the bias add is not counted
    # backward: a weight gradient costs one forward, an input gradient one more; the first conv's input (the
    # images) needs no gradient, so it costs one forward there and two forwards everywhere else
    hand = (conv1 + conv1) + (conv2 + 2 * conv2) + (linear + 2 * linear)
    assert train_step_flops(_conv_net(), torch.randn(n, 3, side, side), torch.randint(0, 7, (n,))) == hand


def test_train_step_flops_leaves_the_model_and_rng_as_they_were():
    torch.manual_seed(0)
    net, x, y = _conv_net(), torch.randn(4, 3, 8, 8), torch.randint(0, 7, (4,))
    nn.functional.cross_entropy(net(x), y).backward()  # a half-accumulated step: gradients and BN stats set
    state = {k: v.clone() for k, v in net.state_dict().items()}
    grads = [p.grad.clone() for p in net.parameters()]
    rng = torch.get_rng_state()
    assert train_step_flops(net, x * 3 + 1, y) > 0  # other statistics: BN would move its running mean
    assert all(torch.equal(v, net.state_dict()[k]) for k, v in state.items())
    assert all(torch.equal(g, p.grad) for g, p in zip(grads, net.parameters()))
    assert torch.equal(rng, torch.get_rng_state())  # dropout drew from a forked generator


def test_peak_flops_of_gpus_as_torch_names_them():
    assert peak_flops("NVIDIA H100 80GB HBM3", torch.bfloat16) == pytest.approx(989.4e12)
    assert peak_flops("NVIDIA H200", torch.bfloat16) == pytest.approx(989.4e12)
    assert peak_flops("NVIDIA H100 PCIe", torch.float16) == pytest.approx(756.5e12)  # not matched as SXM
    assert peak_flops("NVIDIA A100-SXM4-80GB", "bf16") == pytest.approx(312e12)
    assert peak_flops("NVIDIA L4", "bf16") == pytest.approx(121e12)  # not L40/L40S
    assert peak_flops("NVIDIA L40S", "bf16") == pytest.approx(362.05e12)
    for unknown in ("cpu", "NVIDIA A10G", "Intel(R) Xeon(R) CPU"):
        assert peak_flops(unknown, torch.bfloat16) is None
    assert peak_flops("Tesla V100-SXM2-16GB", torch.bfloat16) is None  # no bf16 tensor cores
    assert peak_flops("Tesla V100-SXM2-16GB", "tf32") == pytest.approx(15.7e12)  # no tf32 before Ampere: fp32
    # fp32 training is rated at tf32 while cuDNN or matmuls may use it, else at the fp32 units
    saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32  # (monkeypatch can't undo these)
    try:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = False, True
        assert peak_flops("NVIDIA H100 80GB HBM3", torch.float32) == pytest.approx(494.7e12)
        torch.backends.cudnn.allow_tf32 = False
        assert peak_flops("NVIDIA H100 80GB HBM3", torch.float32) == pytest.approx(66.9e12)
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved


def test_mfu_is_achieved_over_peak():
    assert mfu(flops_per_step=2e12, steps_per_sec=50.0, peak=400e12) == pytest.approx(0.25)


def test_cpu_memory_stats_report_a_growing_host_peak():
    reset_peak("cpu")  # a no-op on CPU, but callable the same way as on CUDA
    before = memory_stats("cpu")
    assert list(before) == ["peak_host_mem_gb"] and before["peak_host_mem_gb"] > 0
    # more bytes than the whole peak so far, written so the pages are resident: the peak must move past it
    big = torch.ones(int(before["peak_host_mem_gb"] * 2**30) // 4 + 2**25, dtype=torch.float32)
    after = memory_stats("cpu")["peak_host_mem_gb"]
    del big
    assert after > before["peak_host_mem_gb"] + 0.1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_cuda_memory_stats_and_flops():
    device = torch.device("cuda")
    reset_peak(device)
    big = torch.empty(2**28, dtype=torch.uint8, device=device)  # 0.25 GiB
    stats = memory_stats(device)
    assert stats["peak_mem_gb"] >= 0.25 and stats["peak_mem_reserved_gb"] >= 0.25
    del big
    reset_peak(device)
    assert memory_stats(device)["peak_mem_gb"] < 0.25
    net, x, y = _conv_net(), torch.randn(4, 3, 8, 8), torch.randint(0, 7, (4,))
    assert train_step_flops(net.to(device), x.to(device), y.to(device)) == train_step_flops(net.cpu(), x, y)
    assert peak_flops(torch.cuda.get_device_name(device), torch.bfloat16) is not None
