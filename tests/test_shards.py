"""Packed shards (src/shards.py): the same labels, classes and bytes as the folder they were packed from, read in
few large reads, the same batches as the folder, one-line errors, and a training run on them."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision

from src import shards
from src.config import ConfigError
from src.datasets import load_data
from src.loaders import build_loader, plan_epoch
from src.trainer import train
from tests.conftest import make_cfg, run_cli
from tests.test_decode import pil_rgb, write_tree


@pytest.fixture
def packed(tmp_path):
    """A folder of JPEGs and PNGs (train/, test/) and its pack, in shards of ~8 KiB (several per split)."""
    write_tree(tmp_path / "tree", kinds=("jpeg", "png", "gray"), per_class=(9, 4))
    shards.pack(tmp_path / "tree", tmp_path / "packed", shard_size_mb=8 / 1024)
    return tmp_path / "tree", tmp_path / "packed"


def shard_cfg(tmp_path, root, *overrides):
    return make_cfg(
        tmp_path,
        "data=shards",
        f"data.root={root}",
        "data.image_size=16",
        "data.val_fraction=0",
        "data.augment=random_resized_crop",
        "data.num_workers=0",
        *overrides,
    )


def test_round_trip_same_labels_classes_and_bytes(tmp_path, packed):
    folder, root = packed
    data = load_data(shard_cfg(tmp_path, root).data)
    assert data.classes == ["a", "b"] and not data.in_memory
    for split in ("train", "test"):
        reference = torchvision.datasets.ImageFolder(str(folder / split))
        files = getattr(data, split).files
        assert len(list(root.glob(f"{split}-*.shard"))) > 1
        assert torch.equal(getattr(data, split).labels, torch.tensor(reference.targets))
        order = np.random.default_rng(0).permutation(len(files))  # any order, several shards per read
        for i, blob in zip(order, files.read(order)):
            assert bytes(blob) == Path(reference.samples[i][0]).read_bytes()
            assert files.name(i).endswith(f"({os.path.relpath(reference.samples[i][0], folder)})")
        image, label = files[0]
        assert torch.equal(image, pil_rgb(Path(reference.samples[0][0]).read_bytes())) and label == 0


def test_contiguous_samples_are_one_read(tmp_path, packed, monkeypatch):
    _, root = packed
    files = load_data(shard_cfg(tmp_path, root).data).train.files
    reads = []
    real = os.preadv
    monkeypatch.setattr(os, "preadv", lambda fd, buffers, offset: reads.append(offset) or real(fd, buffers, offset))
    files.read(range(len(files)))
    assert len(reads) == len(set(files.shard.tolist()))  # one read per shard file
    reads.clear()
    files.read([0, 5])  # far apart only in the sample order, both in the first shard
    assert len(reads) == 1 + (files.shard[5] != files.shard[0])


def test_shards_give_the_folders_batches(tmp_path, packed):
    folder, root = packed
    on_folder = make_cfg(
        tmp_path,
        "data=imagefolder",
        f"data.root={folder}",
        "data.image_size=16",
        "data.val_fraction=0",
        "data.augment=random_resized_crop",
        "data.num_workers=0",
    )
    for decode in ("gpu", "cpu"):
        got = []
        for cfg in (shard_cfg(tmp_path, root, f"data.decode={decode}"), on_folder):
            data = load_data(cfg.data)
            cfg.data.decode = decode
            loader = build_loader(data, cfg.data, torch.device("cpu"), False, seed=3)
            steps = plan_epoch(len(data.train), 6, 1, 0, 1, seed=3, epoch=1)
            got.append([b.x for b in loader.train_batches(steps, 1)])
        assert len(got[0]) == 3 and all(torch.equal(a, b) for a, b in zip(*got))


def test_max_side_reencodes_only_larger_images(tmp_path, packed):
    folder, _ = packed
    shards.pack(folder, tmp_path / "small", max_side=30, workers=2)
    files = load_data(shard_cfg(tmp_path, tmp_path / "small").data).train.files
    reference = torchvision.datasets.ImageFolder(str(folder / "train"))
    for i, blob in enumerate(files.read(range(len(files)))):
        image, original = pil_rgb(bytes(blob)), pil_rgb(Path(reference.samples[i][0]).read_bytes())
        assert min(image.shape[1:]) == min(30, min(original.shape[1:]))
        if min(original.shape[1:]) <= 30:
            assert bytes(blob) == Path(reference.samples[i][0]).read_bytes()


def test_bad_packs_and_commands_are_one_line(tmp_path, packed):
    folder, root = packed
    proc = run_cli("pack", str(folder), str(root), command=[sys.executable, "-m", "src.shards"], timeout=60)
    assert (
        proc.returncode == 2
        and proc.stderr.strip() == f"error: {root} is not empty; pack into a new folder (or remove this one)"
    )
    with pytest.raises(ConfigError, match=rf"^data.root: {tmp_path} holds no packed shards \(no meta.json\)"):
        load_data(shard_cfg(tmp_path, tmp_path).data)
    (folder / "train/a/1.png").write_bytes(b"broken")
    with pytest.raises(ConfigError, match=rf"^{folder}/train/a/1.png: cannot read this image"):
        shards.pack(folder, tmp_path / "again", max_side=8, workers=1)
    last = sorted(root.glob("train-*.shard"))[-1]
    last.write_bytes(last.read_bytes()[:10])
    files = load_data(shard_cfg(tmp_path, root).data).train.files
    with pytest.raises(ConfigError, match="the shard ends early"):
        files[len(files) - 1]


def test_training_on_shards_with_device_decoding(tmp_path, packed):
    _, root = packed
    cfg = shard_cfg(tmp_path, root, "data.decode=gpu", "data.batch_size=6", "data.eval_batch_size=5")
    metrics = train(cfg)
    assert metrics["test_count"] == 8 and np.isfinite(metrics["test_loss"])
