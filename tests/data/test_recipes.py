"""Batch recipes (issue 33 item 7): random erasing, mixup and cutmix against references written here, the soft-target
loss, the same draws whatever the layout or loader, and one line for every bad setting."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from src.config.errors import ConfigError
from src.data.augment import AugmentOptions
from src.data.datasets import load_data, options_of
from src.data.draws import sample_uniforms
from src.data.epoch import plan_epoch
from src.data.recipes import Recipe, erase_and_mix, mix_draws, recipe_draws, trivial_augment
from src.run.loss import build_loss_terms, loss_terms
from src.run.plan import plan_layout
from tests.conftest import resident_loader, workers_loader

RECIPE = Recipe(erasing=0.5, mixup_alpha=0.2, cutmix_alpha=1.0, mix_prob=0.8, switch_prob=0.5)


def reference_erase_and_mix(x, y, draws):
    """Pixel by pixel, pair by pair: what erase_and_mix should give."""
    x, draws = x.clone(), draws.tolist()
    b, _, h, w = x.shape
    for k, (t, bo, le, ri, *_) in enumerate(draws):
        for r in range(h):
            for c in range(w):
                if t <= r < bo and le <= c < ri:
                    x[k, :, r, c] = 0.0
    out, targets = x.clone(), []
    for k in range(b):
        j = min(k ^ 1, b - 1)
        a, t, bo, le, ri = draws[k][4:]
        for r in range(h):
            for c in range(w):
                inside = t <= r < bo and le <= c < ri
                out[k, :, r, c] = x[j, :, r, c] if inside else a * x[k, :, r, c] + (1 - a) * x[j, :, r, c]
        own = a * (1 - (bo - t) * (ri - le) / (h * w))
        targets.append((int(y[k]), int(y[j]), own) if own >= 0.5 else (int(y[j]), int(y[k]), 1 - own))
    return out, targets


def test_erasing_and_mixing_match_a_per_pixel_reference():
    x, y = torch.randn(7, 3, 9, 10), torch.tensor([3, 1, 4, 1, 5, 9, 2])  # odd: the last is paired with itself
    draws = recipe_draws(0, 2, np.array([10, 11, 12, 13, 14, 15, 16]), 9, 10, 0.7, (0.2, 1.0, 1.0, 0.5))
    assert (draws[:, 4] < 1).any() and (draws[:, 6] > draws[:, 5]).any() and (draws[:, 1] > draws[:, 0]).any()
    out, dominant, (other, weight) = erase_and_mix(x, y, draws)
    ref, targets = reference_erase_and_mix(x, y, draws)
    torch.testing.assert_close(out, ref, rtol=0, atol=1e-6)
    assert dominant.tolist() == [t[0] for t in targets] and other.tolist() == [t[1] for t in targets]
    torch.testing.assert_close(weight, torch.tensor([t[2] for t in targets]))
    assert (weight >= 0.5).all()
    erased_only, same_y, nothing = erase_and_mix(x, y, draws, mix=False)
    unmixed = draws.clone()
    unmixed[:, 4], unmixed[:, 5:] = 1.0, 0.0
    assert nothing == () and torch.equal(same_y, y)
    assert torch.equal(erased_only, reference_erase_and_mix(x, y, unmixed)[0])


def test_mix_draws_follow_timm():
    u = sample_uniforms(0, 0, np.arange(20_000), 5, stream=5)
    m = mix_draws(u, 32, 32, mixup_alpha=0.2, cutmix_alpha=1.0, prob=0.8, switch=0.5)
    cut, mixed = m[:, 2] > m[:, 1], m[:, 0] < 1
    assert abs(cut.mean() - 0.4) < 0.02 and abs(mixed.mean() - 0.4) < 0.02  # 0.8 mixed, half each way
    # Beta(0.2, 0.2) piles up near 0 and 1: P(lam < 0.1) = 0.3 or so, against 0.1 for a uniform
    assert 0.25 < (m[mixed, 0] < 0.1).mean() < 0.4
    # cutmix alone: timm's rand_bbox with lam ~ Beta(1, 1) = U(0, 1): the box side is int(32 * sqrt(1 - lam))
    only_cut = mix_draws(u[:5], 32, 32, 0.0, 1.0, 1.0, 0.5)
    for (t, b, le, r), row in zip(only_cut[:, 1:].astype(int).tolist(), u[:5]):
        side, cy, cx = int(32 * np.sqrt(1 - row[2])), int(row[3] * 32), int(row[4] * 32)
        assert (t, b, le, r) == (
            max(cy - side // 2, 0),
            min(cy + side // 2, 32),
            max(cx - side // 2, 0),
            min(cx + side // 2, 32),
        )


def test_a_pair_draws_the_same_whatever_micro_batch_holds_it():
    """The draws of a micro-batch are those of its pairs: every even cut of the global batch agrees."""
    ids = np.array([7, 3, 11, 0, 5, 2, 9, 8])
    whole = recipe_draws(1, 3, ids, 12, 12, 0.5, (0.2, 1.0, 1.0, 0.5))
    halves = torch.cat([recipe_draws(1, 3, part, 12, 12, 0.5, (0.2, 1.0, 1.0, 0.5)) for part in np.split(ids, 4)])
    assert torch.equal(whole, halves)


@pytest.mark.parametrize("smoothing", [0.0, 0.1])
def test_mixed_loss_is_the_soft_target_cross_entropy(smoothing):
    """timm's way: smooth each one-hot target, mix them, then the soft-target cross-entropy."""
    logits, classes = torch.randn(6, 5, generator=torch.Generator().manual_seed(0)), 5
    y, other = torch.tensor([0, 1, 2, 3, 4, 0]), torch.tensor([1, 1, 3, 0, 2, 4])
    weight = torch.tensor([1.0, 0.5, 0.7, 0.9, 0.6, 0.55])
    off, on = smoothing / classes, 1 - smoothing + smoothing / classes
    smooth = [F.one_hot(t, classes).float() * (on - off) + off for t in (y, other)]
    soft = weight[:, None] * smooth[0] + (1 - weight[:, None]) * smooth[1]
    reference = -(soft * logits.log_softmax(1)).sum()
    for terms in (loss_terms, build_loss_terms(compile=True)):
        loss, metrics = terms(logits, y, 0.5, smoothing, other, weight)
        torch.testing.assert_close(loss, 0.5 * reference)
        assert metrics[1] == (logits.argmax(1) == y).sum()  # hits against the dominant label


@pytest.mark.parametrize("cut", [0, 3])
def test_loaders_and_layouts_give_each_sample_the_same_recipe(cfg_factory, cut):
    """resident and workers loaders agree bit for bit; two ranks' micro-batches are the single device's, halved."""
    data = load_data(cfg_factory("data=synthetic", "data.augment=crop_flip", "data.num_samples=100").data)
    cpu = torch.device("cpu")
    one = plan_epoch(len(data.train), 16, 1, 0, 1, seed=3, epoch=1, drop_last=True)
    options = dict(seed=3, cutout=cut, recipe=RECIPE)
    device = list(resident_loader(data, cpu, False, **options).train_batches(one, 1))
    classic = list(workers_loader(data, cpu, False, num_workers=0, **options).train_batches(one, 1))
    for a, b in zip(device, classic):
        assert torch.equal(a.x, b.x) and torch.equal(a.y, b.y) and all(map(torch.equal, a.mix, b.mix))
    assert any((b.mix[1] < 1).any() for b in device)  # some samples were mixed
    ranks = [
        list(
            resident_loader(data, cpu, True, **options).train_batches(plan_epoch(len(data.train), 16, 2, r, 1, 3, 1), 1)
        )
        for r in (0, 1)
    ]
    for whole, *halves in zip(device, *ranks):
        assert torch.equal(whole.x, torch.cat([h.x for h in halves]))
        assert torch.equal(whole.y, torch.cat([h.y for h in halves]))
        assert all(torch.equal(w, torch.cat(p)) for w, *p in zip(whole.mix, *(h.mix for h in halves)))


def test_compiled_gpu_loader_mixes_like_eager(cfg_factory):
    data = load_data(cfg_factory("data=synthetic", "data.augment=crop_flip", "data.num_samples=100").data)
    steps = plan_epoch(len(data.train), 16, 1, 0, 1, seed=3, epoch=1, drop_last=True)
    cpu = torch.device("cpu")
    eager = list(resident_loader(data, cpu, True, seed=3, recipe=RECIPE).train_batches(steps, 1))
    compiled = list(resident_loader(data, cpu, True, seed=3, compile=True, recipe=RECIPE).train_batches(steps, 1))
    for e, c in zip(eager, compiled):
        torch.testing.assert_close(c.x, e.x, rtol=0, atol=1e-6)
        assert torch.equal(c.y, e.y) and torch.equal(c.mix[0], e.mix[0]) and torch.equal(c.mix[1], e.mix[1])
        assert c.x.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize(
    "overrides,message",
    [
        (("data.mixup_alpha=-1",), "data.mixup_alpha must be a number >= 0, got -1"),
        (("data.cutmix_alpha=x",), "data.cutmix_alpha must be a number >= 0"),
        (("data.mix_prob=1.5",), "data.mix_prob must be a number >= 0 and <= 1, got 1.5"),
        (("data.mix_switch_prob=-0.1",), "data.mix_switch_prob must be a number >= 0 and <= 1"),
        (("data.random_erasing=2",), "data.random_erasing must be a number >= 0 and <= 1, got 2"),
        (
            ("data.mixup_alpha=0.2", "data.batch_size=30", "trainer.accumulate_grad_batches=2"),
            "= 15; pick a multiple of 4",
        ),
        (
            ("data=imagefolder", "data.root=/nowhere", "data.cutmix_alpha=1", "data.skip_bad_images=true"),
            "which data.skip_bad_images=true would shift",
        ),
    ],
)
def test_bad_recipe_settings_are_one_line(cfg_factory, overrides, message):
    with pytest.raises(ConfigError) as err:
        plan_layout(cfg_factory(*overrides))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_recipes_are_off_by_default(cfg_factory):
    def recipe(*overrides):
        return options_of(cfg_factory(*overrides).data, AugmentOptions).recipe

    assert not recipe().on and recipe("data.cutmix_alpha=1").mixing


def test_trivial_augment_is_torchvisions_seeded_per_sample():
    from torchvision.transforms import v2

    images = torch.randint(0, 256, (6, 3, 12, 12), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))
    ids = np.array([40, 7, 13, 2, 99, 5])
    state = torch.random.get_rng_state()
    out = trivial_augment(images, 3, 2, ids)
    assert torch.equal(torch.random.get_rng_state(), state)  # the caller's random state is left alone
    seeds = (sample_uniforms(3, 2, ids, 1, stream=6)[:, 0] * 2**53).astype(np.int64)
    for image, s, got in zip(images, seeds.tolist(), out):
        torch.manual_seed(s)
        assert torch.equal(got, v2.TrivialAugmentWide()(image))
    assert not torch.equal(out, images)
    swapped = trivial_augment(images[[3, 4, 5, 0, 1, 2]], 3, 2, ids[[3, 4, 5, 0, 1, 2]])
    assert torch.equal(swapped, out[[3, 4, 5, 0, 1, 2]])  # a function of the sample, not of its place
    assert not torch.equal(trivial_augment(images, 3, 3, ids), out)  # a new epoch, new choices


def test_trivial_augment_is_the_same_in_workers_and_for_two_ranks(cfg_factory):
    data = load_data(cfg_factory("data=synthetic", "data.augment=crop_flip", "data.num_samples=100").data)
    cpu, recipe = torch.device("cpu"), Recipe(trivial=True, erasing=0.5, cutmix_alpha=1.0)
    one = plan_epoch(len(data.train), 16, 1, 0, 1, seed=3, epoch=1, drop_last=True)
    here = list(workers_loader(data, cpu, False, 0, seed=3, recipe=recipe).train_batches(one, 1))
    workers = list(workers_loader(data, cpu, False, 2, seed=3, recipe=recipe).train_batches(one, 1))
    plain = list(workers_loader(data, cpu, False, 0, seed=3).train_batches(one, 1))
    assert all(torch.equal(a.x, b.x) for a, b in zip(here, workers))
    assert not all(torch.equal(a.x, b.x) for a, b in zip(here, plain))
    ranks = [
        list(
            workers_loader(data, cpu, False, 0, seed=3, recipe=recipe).train_batches(
                plan_epoch(len(data.train), 16, 2, r, 1, 3, 1), 1
            )
        )
        for r in (0, 1)
    ]
    for whole, *halves in zip(here, *ranks):
        assert torch.equal(whole.x, torch.cat([h.x for h in halves]))


@pytest.mark.parametrize(
    "overrides,message",
    [
        (("data.auto_augment=rand",), "data.auto_augment must be one of none, trivial"),
        (("data.auto_augment=trivial", "data.loader=resident"), "not in data.loader=resident; use data.loader=workers"),
        (
            ("data=shards", "data.root=/nowhere", "data.auto_augment=trivial", "data.decode=gpu"),
            "set data.decode=cpu (or auto) and data.crop=workers (or auto)",
        ),
    ],
)
def test_trivial_augment_where_it_cannot_run_is_one_line(cfg_factory, overrides, message):
    with pytest.raises(ConfigError) as err:
        plan_layout(cfg_factory(*overrides))
    assert message in str(err.value) and "\n" not in str(err.value)


def test_trivial_augment_on_images_read_from_disk(tmp_path):
    """Decoded and cropped on the CPU, then augmented in the workers: 0 or 2 workers, one rank or two, agree."""
    from src.data.loaders import build_loader
    from tests.data.test_decode import CPU, disk_data, write_tree

    write_tree(tmp_path / "tree", per_class=(24, 2))
    got = {}
    for workers, trivial in ((0, "trivial"), (2, "trivial"), (0, "none")):
        data, cfg = disk_data(
            tmp_path, tmp_path / "tree", f"data.num_workers={workers}", f"data.auto_augment={trivial}"
        )
        loader = build_loader(data, cfg.data, CPU, False, seed=7)
        try:
            layouts = [plan_epoch(len(data.train), 8, w, r, 1, seed=7, epoch=1) for w, r in ((1, 0), (2, 0), (2, 1))]
            got[workers, trivial] = [[b.x for b in loader.train_batches(steps, 1)] for steps in layouts]
        finally:
            loader.close()
    (one, r0, r1), again, plain = got[0, "trivial"], got[2, "trivial"], got[0, "none"]
    assert all(torch.equal(a, b) for a, b in zip(one, again[0]))
    assert all(torch.equal(a, torch.cat([b, c])) for a, b, c in zip(one, r0, r1))
    assert not all(torch.equal(a, b) for a, b in zip(one, plain[0]))
