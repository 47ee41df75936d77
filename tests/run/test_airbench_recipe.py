"""experiment=cifar10_airbench's parts, each against a reference written here: the whitening network, BatchNorm's
learning-rate scale, the triangular one-cycle, the lookahead, alternating flips; and the preset trained on the CIFAR-10
JPEGs."""

from __future__ import annotations

import zipfile
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from omegaconf import OmegaConf
from torch import nn

from src.data.augment import draw_params
from src.data.datasets import load_data
from src.models import AirbenchNet, build_model
from src.run.optim import build_optimizer, one_cycle
from src.run.trainer import FIT_IMAGES, train
from src.strategies.ema import EMA
from tests.conftest import CIFAR_JPEG_ZIP, ROOT, read_metrics, run_cli
from tests.data.test_decode import write_tree


def whitened_covariance(net: AirbenchNet, images: torch.Tensor) -> torch.Tensor:
    """The covariance of the whitening layer's first half of outputs (before its bias) over `images`' patches."""
    out = F.conv2d(images.double(), net.whiten.double())[:, : net.whiten.shape[0] // 2]
    rows = out.permute(0, 2, 3, 1).reshape(-1, out.shape[1])
    return rows.T @ rows / len(rows)


def test_the_fitted_layer_whitens_the_patches_of_the_images_it_was_fitted_to():
    torch.manual_seed(0)
    images = F.avg_pool2d(torch.randn(64, 3, 34, 34), 3, stride=1)  # neighbouring pixels strongly correlated
    net = AirbenchNet(10, widths=[8, 16, 16], whiten_eps=1e-9)
    before = whitened_covariance(net, images)
    net.fit_to_images(images)
    torch.testing.assert_close(whitened_covariance(net, images), torch.eye(12, dtype=torch.float64), atol=1e-4, rtol=0)
    assert before.abs().max() == 0  # unfitted: zeros, not some other whitening
    torch.testing.assert_close(net.whiten[12:], -net.whiten[:12])  # each direction's mirror for the GELU


def test_only_the_convolutions_batchnorm_shifts_whitening_bias_and_head_are_trained():
    net = build_model(OmegaConf.load(ROOT / "conf/model/airbench96.yaml"), num_classes=10, in_channels=3)
    trained = {name for name, p in net.named_parameters() if p.requires_grad}
    assert not any(name.endswith("norm1.weight") for name in trained) and "stages.0.norm1.bias" in trained
    assert "whiten" in dict(net.named_buffers()) and "whiten_bias" in trained
    assert sum(p.numel() for p in net.parameters()) == 12_720_920  # airbench96's make_net96 has as many weights
    conv = net.stages[0].conv2.weight  # identity-initialised: the first filters pass their channel through
    assert torch.equal(conv[:128, :, 1, 1], torch.eye(128)) and conv[:, :, 0, 0].abs().max() == 0
    assert net(torch.randn(2, 3, 32, 32)).shape == (2, 10)


def test_batchnorm_parameters_step_norm_lr_scale_times_farther_and_decay_as_much_as_the_rest():
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.BatchNorm2d(4), nn.Flatten(), nn.LazyLinear(2))
    model(torch.randn(2, 3, 5, 5))
    options = {"lr": 0.5, "momentum": 0.0, "weight_decay": 0.1, "decay_norm_and_bias": True, "norm_lr_scale": 64}
    optim = OmegaConf.create({"_target_": "torch.optim.SGD", "_partial_": True, **options})
    optimizer = build_optimizer(optim, model)
    norm = set(model[1].parameters())
    for group in optimizer.param_groups:  # lr x 64 and decay / 64: the same decay per step for every parameter
        is_norm = {p in norm for p in group["params"]}
        assert len(is_norm) == 1 and group["lr"] * group["weight_decay"] == pytest.approx(0.5 * 0.1)
        assert group["lr"] == (0.5 * 64 if is_norm.pop() else 0.5)
    before = {p: p.detach().clone() for p in model.parameters()}
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    for p, old in before.items():  # p - lr' * (1 + wd' * p)
        lr = 0.5 * (64 if p in norm else 1)
        torch.testing.assert_close(p.detach(), old - lr * (1 + 0.1 / (64 if p in norm else 1) * old))


def test_the_one_cycle_with_start_and_end_ratios_is_airbenchs_triangle():
    total, pct = 490, 0.23
    peak = int(pct * total)
    reference = np.interp(np.arange(total + 1), [0, peak, total], [0.2, 1.0, 0.07])  # airbench's triangle(...)
    p = nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([p], lr=2.0)
    schedule = one_cycle(optimizer, total, 49, pct_start=pct, start_ratio=0.2, end_ratio=0.07)
    lrs = []
    for _ in range(total):
        lrs.append(optimizer.param_groups[0]["lr"] / 2.0)
        optimizer.step()
        schedule.step()
    # the warmup reaches each value one step earlier (its first step is not at lr x start), the decay is the same
    np.testing.assert_allclose(lrs[:peak], reference[1 : peak + 1], rtol=1e-12)
    np.testing.assert_allclose(lrs[peak:], reference[peak:total], rtol=1e-12)


def test_the_lookahead_follows_a_reference_loop():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    decay, every, total = 0.8, 3, 12
    ema = EMA(model, decay, every, ramp_power=3, total_steps=total, copy_back=True)
    reference = {k: v.double() for k, v in model.state_dict().items() if v.is_floating_point()}
    for step in range(1, total + 1):
        model(torch.randn(16, 4)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        live = {k: v.double() for k, v in model.state_dict().items() if v.is_floating_point()}
        ema.update(step)
        if step % every:
            continue
        d = decay * (step / total) ** 3
        for k in reference:  # averaged, then the model continues from the average
            reference[k] = d * reference[k] + (1 - d) * live[k]
            torch.testing.assert_close(model.state_dict()[k].double(), reference[k], rtol=1e-6, atol=1e-7, msg=k)
    assert not torch.equal(model[0].weight, live["0.weight"].float())  # it did move the model back


def test_alternating_flips_invert_every_other_epoch_and_keep_the_crops():
    flips = [draw_params(1000, 7, epoch, alternate_flips=True)[:, 2] for epoch in range(4)]
    assert torch.equal(flips[0], flips[2]) and torch.equal(flips[1], 1 - flips[0]) and torch.equal(flips[3], flips[1])
    assert 400 < int(flips[0].sum()) < 600  # half of the images start mirrored
    for epoch in range(2):  # the crops of an epoch are those of data.flip=random
        assert torch.equal(draw_params(1000, 7, epoch, alternate_flips=True)[:, :2], draw_params(1000, 7, epoch)[:, :2])
    assert not torch.equal(draw_params(1000, 7, 0)[:, 2], draw_params(1000, 7, 2)[:, 2])  # random: drawn anew


@pytest.mark.parametrize(
    "overrides,message",
    [
        (["data.augment=none", "data.flip=alternate"], "data.flip=alternate needs data.augment=crop_flip, got 'none'"),
        (
            ["model=airbench96", "data.augment=random_resized_crop", "data.batch_size=4"],
            "held in memory, but data=imagefolder is read from disk here; set data.augment=crop_flip or pick another",
        ),
        (  # known from the options: refused before the launcher starts the two processes
            [
                "model=airbench96",
                "data.augment=random_resized_crop",
                "data.batch_size=4",
                "strategy=ddp",
                "trainer.devices=2",
            ],
            "held in memory, but data=imagefolder is read from disk here; set data.augment=crop_flip or pick another",
        ),
        (  # known once the images are counted
            ["model=airbench96", "data.max_memory_gb=1e-9", "data.batch_size=4"],
            "held in memory, but data=imagefolder is read from disk here; raise data.max_memory_gb or pick another",
        ),
    ],
)
def test_what_the_recipe_cannot_do_is_one_line(tmp_path, overrides, message):
    write_tree(tmp_path / "tree")
    result = run_cli(
        "debug=fast", "data=imagefolder", f"data.root={tmp_path / 'tree'}", f"hydra.run.dir={tmp_path}/run", *overrides
    )
    assert result.returncode != 0 and message in result.stderr, result.stderr[-2000:]
    assert "Traceback" not in result.stderr and len(result.stderr.strip().splitlines()) == 1
    assert "starting 2 processes" not in result.stdout + result.stderr and not (tmp_path / "run").exists()


@pytest.mark.skipif(not CIFAR_JPEG_ZIP.exists(), reason="../shared/datasets/cifar10-jpeg.zip not present")
def test_the_preset_trains_on_the_cifar10_jpegs_from_a_whitening_fitted_to_them(tmp_path, cfg_factory):
    root = tmp_path / "cifar10-jpeg"
    with zipfile.ZipFile(CIFAR_JPEG_ZIP) as z:
        for n in z.namelist():
            if n.endswith(".jpg") and int(Path(n).stem) % 25 == 0:  # ~2,400 of 60,000, every class
                (tmp_path / n).parent.mkdir(parents=True, exist_ok=True)
                (tmp_path / n).write_bytes(z.read(n))
    cfg = cfg_factory(
        "experiment=cifar10_airbench",
        "model=airbench96",  # debug=fast (the test shrink) picks tiny_cnn after the experiment
        f"data.root={root}",
        "model.widths=[16,32,32]",
        "data.batch_size=128",
        "trainer.device=cpu",
        "trainer.devices=1",
        "trainer.compile=false",
        "trainer.amp=false",
        "trainer.max_epochs=3",
        "trainer.limit_train_batches=null",
        "trainer.save_top_k=null",
    )
    metrics = train(cfg)
    state = torch.load(tmp_path / "run/checkpoints/last.pt", weights_only=True)
    net = AirbenchNet(10, widths=[16, 32, 32])
    net.load_state_dict(state["model"])
    sample = load_data(cfg.data).train_sample(FIT_IMAGES)  # all ~2,000 here: fewer than FIT_IMAGES
    patches = sample.double().unfold(2, 2, 1).unfold(3, 2, 1).permute(0, 2, 3, 1, 4, 5).reshape(-1, 12).numpy()
    values = np.linalg.eigvalsh(patches.T @ patches / len(patches))
    covariance = whitened_covariance(net, sample)  # diagonal: each direction's variance / (variance + eps)
    torch.testing.assert_close(
        covariance - covariance.diag().diag(), torch.zeros(12, 12, dtype=torch.float64), atol=1e-4, rtol=0
    )
    np.testing.assert_allclose(np.sort(covariance.diag().numpy()), np.sort(values / (values + 5e-4)), rtol=1e-4)
    assert all(torch.equal(v, torch.ones_like(v)) for k, v in state["model"].items() if k.endswith("norm1.weight"))
    epochs = read_metrics(tmp_path / "run")["epochs"]
    assert [e["epoch"] for e in epochs] == [1, 2, 3] and all("test_top1" in e for e in epochs)
    assert metrics["test_top1"] > 0.25  # ten classes: chance is 0.10
