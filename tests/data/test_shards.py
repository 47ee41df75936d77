"""Packed shards (src/data/shards.py): the same labels, classes and bytes as the folder they were packed from, read in
few large reads, the same batches as the folder, one-line errors, and a training run on them."""

from __future__ import annotations

import io
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
import torchvision

from src.config.errors import ConfigError
from src.data import shards
from src.data.datasets import load_data
from src.data.epoch import plan_epoch
from src.data.loaders import build_loader
from src.run.trainer import train
from tests.conftest import ROOT, make_cfg, run_cli
from tests.data.test_decode import pil_rgb, write_tree


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
    proc = run_cli("pack", str(folder), str(root), command=[sys.executable, "-m", "src.data.shards"], timeout=60)
    assert (
        proc.returncode == 2
        and proc.stderr.strip() == f"error: {root} is not empty; pack into a new folder (or remove this one)"
    )
    with pytest.raises(ConfigError, match=rf"^data.root: {tmp_path} holds no packed shards \(no meta.json\)"):
        load_data(shard_cfg(tmp_path, tmp_path).data)
    (folder / "train/a/1.png").write_bytes(b"broken")
    with pytest.raises(ConfigError, match=rf"^{folder}/train/a/1.png: cannot read this image"):
        shards.pack(folder, tmp_path / "again", max_side=8, workers=1)
    files = load_data(shard_cfg(tmp_path, root).data).train.files
    last = sorted(root.glob("train-*.shard"))[-1]
    last.write_bytes(last.read_bytes()[:10])  # after loading: found by the read
    with pytest.raises(ConfigError, match="the shard ends early"):
        files[len(files) - 1]
    with pytest.raises(ConfigError, match=rf"^{last}: 10 bytes, but meta.json says \d+; pack the folder again"):
        load_data(shard_cfg(tmp_path, root).data)  # before: found by loading


@pytest.mark.parametrize(
    "option, value, kind",
    [
        ("--quality", "0", "jpeg_quality"),
        ("--quality", "101", "jpeg_quality"),
        ("--workers", "0", "positive"),
        ("--max-side", "-8", "positive"),
        ("--shard-size-mb", "nan", "positive_number"),
    ],
)
def test_a_pack_option_out_of_range_is_one_line_and_packs_nothing(tmp_path, packed, option, value, kind):
    folder, _ = packed
    command = [sys.executable, "-m", "src.data.shards"]
    proc = run_cli("pack", str(folder), str(tmp_path / "out"), option, value, command=command, timeout=60)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
    assert proc.stderr.strip().splitlines()[-1].endswith(f"error: argument {option}: invalid {kind} value: '{value}'")
    assert not (tmp_path / "out").exists()


def test_training_on_shards_with_device_decoding(tmp_path, packed):
    _, root = packed
    cfg = shard_cfg(tmp_path, root, "data.decode=gpu", "data.batch_size=6", "data.eval_batch_size=5")
    metrics = train(cfg)
    assert metrics["test_count"] == 8 and np.isfinite(metrics["test_loss"])


# --- integrity: a pack whose parts disagree is one line when it is loaded, before any training step ----------


def edit_index(root: Path, change) -> None:
    path = root / "train-index.npz"
    with np.load(path) as npz:
        columns = dict(npz)
    change(columns)
    np.savez(path, **columns)


def edit_meta(root: Path, change) -> None:
    meta = json.loads((root / "meta.json").read_text())
    change(meta)
    (root / "meta.json").write_text(json.dumps(meta))


def cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


DAMAGES = {  # what is done to the pack: (the file named, what the line says of it)
    "rows dropped": (
        lambda root: edit_index(root, lambda c: c.update({k: v[:-4] for k, v in c.items()})),
        ("train-index.npz", "14 rows, but meta.json counts 18 samples"),
    ),
    "label out of range": (
        lambda root: edit_index(root, lambda c: c["label"].__setitem__(0, 2)),
        ("train-index.npz", "labels outside [0, 2)"),
    ),
    "sample beyond its shard": (
        lambda root: edit_index(root, lambda c: c["offset"].__setitem__(-1, 10**6)),
        ("train-index.npz", "samples beyond the end of their shard"),
    ),
    "float column": (
        lambda root: edit_index(root, lambda c: c.update(length=c["length"] * 1.0)),
        ("train-index.npz", "its columns are not integer vectors"),
    ),
    "objects in the index": (
        lambda root: np.savez(root / "train-index.npz", shard=np.array([None] * 18), offset=0, length=0, label=0),
        ("train-index.npz", "cannot read this index (truncated or not written by pack)"),
    ),
    "truncated index": (lambda root: cut(root / "train-index.npz"), ("train-index.npz", "cannot read this index")),
    "missing index": (lambda root: (root / "test-index.npz").unlink(), ("test-index.npz", "cannot read this index")),
    "missing shard": (
        lambda root: (root / "train-00001.shard").unlink(),
        ("train-00001.shard", "cannot read this shard (No such file or directory)"),
    ),
    "grown shard": (
        lambda root: (root / "train-00001.shard").open("ab").write(b"x"),
        ("train-00001.shard", "bytes, but meta.json says"),
    ),
    "truncated meta.json": (lambda root: cut(root / "meta.json"), ("meta.json", "not readable JSON")),
    "meta.json a list": (lambda root: (root / "meta.json").write_text("[]"), ("meta.json", "not a JSON object")),
    "count a string": (
        lambda root: edit_meta(root, lambda m: m["splits"]["train"].update(count="18")),
        ("meta.json", "split 'train' lacks its count"),
    ),
    "shard outside the pack": (
        lambda root: edit_meta(root, lambda m: m["splits"]["train"]["shards"].__setitem__(0, "../train-00000.shard")),
        ("meta.json", "split 'train' lacks its count, its shard files"),
    ),
    "no classes": (lambda root: edit_meta(root, lambda m: m.pop("classes")), ("meta.json", "no list of classes")),
    "no eval split": (
        lambda root: edit_meta(root, lambda m: m["splits"].pop("test")),
        ("meta.json", "its splits are not train and val or test"),
    ),
}


@pytest.mark.parametrize("damage", DAMAGES)
def test_a_pack_whose_parts_disagree_is_one_line_at_loading(tmp_path, packed, damage):
    folder, root = packed
    meta = json.loads((root / "meta.json").read_text())
    assert [s["count"] for s in meta["splits"].values()] == [18, 8] and meta["classes"] == ["a", "b"]
    assert meta["splits"]["train"]["bytes"] == [(root / s).stat().st_size for s in meta["splits"]["train"]["shards"]]
    do, (name, what) = DAMAGES[damage]
    do(root)
    with pytest.raises(ConfigError) as info:
        load_data(shard_cfg(tmp_path, root).data)
    message = str(info.value)
    assert "\n" not in message and message.startswith(f"{root / name}: ") and what in message, message
    source = "<imagefolder root>" if damage in ("truncated meta.json", "meta.json a list") else folder
    assert message.endswith(
        f"pack the folder again into a new folder: python -m src.data.shards pack {source} <new folder>"
    )


def test_rows_dropped_from_an_index_stop_a_run_before_it_trains(tmp_path, packed):
    _, root = packed
    edit_index(root, lambda c: c.update({k: v[:-4] for k, v in c.items()}))
    proc = run_cli("debug=fast", "data=shards", f"data.root={root}", f"hydra.run.dir={tmp_path / 'run'}", timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert "14 rows, but meta.json counts 18 samples" in proc.stderr
    assert not (tmp_path / "run/checkpoints").exists()


# --- packing: never into its source, never half-made ------------------------------------------------------


def test_packing_into_the_image_folder_is_refused(packed):
    folder, _ = packed
    before = sorted(folder.rglob("*"))
    for out in (folder, folder / "packed", folder / "train/a/packed"):
        with pytest.raises(
            ConfigError, match=rf"^{out} is inside the image folder {folder}; pack into a folder outside"
        ):
            shards.pack(folder, out)
    assert sorted(folder.rglob("*")) == before


@pytest.mark.parametrize("workers", [1, 2])
def test_a_failed_pack_leaves_nothing(tmp_path, packed, workers):
    folder, _ = packed
    (folder / "test/b/3.jpg").write_bytes(b"broken")  # the last file packed: every shard before it is written
    (tmp_path / "empty").mkdir()
    for out in (tmp_path / "new", tmp_path / "empty"):
        with pytest.raises(ConfigError, match="cannot read this image"):
            shards.pack(folder, out, max_side=8, workers=workers)
    assert not (tmp_path / "new").exists() and not any((tmp_path / "empty").iterdir())
    assert not list(tmp_path.glob(".*"))  # no partial pack beside them
    (folder / "test/b/3.jpg").unlink()
    shards.pack(folder, tmp_path / "empty", max_side=8, workers=workers)  # an empty folder is a fine target
    assert load_data(shard_cfg(tmp_path, tmp_path / "empty").data).test.labels.tolist() == [0] * 4 + [1] * 3


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM], ids=["SIGINT", "SIGTERM"])
def test_a_stopped_pack_exits_128_plus_n_in_one_line_and_leaves_nothing(tmp_path, sig):
    """A real `python -m src.data.shards pack` of 2000 JPEGs stopped mid-way: SIGINT as Ctrl-C sends it (to the whole
    process group, its workers too), SIGTERM to the command alone."""
    from PIL import Image

    pixels = np.random.default_rng(0).integers(0, 256, (160, 160, 3), dtype=np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, "JPEG")
    for split, n in (("train", 900), ("test", 100)):
        for c in ("a", "b"):
            (tmp_path / "tree" / split / c).mkdir(parents=True)
            for i in range(n):
                (tmp_path / "tree" / split / c / f"{i}.jpg").write_bytes(out.getvalue())
    command = [sys.executable, "-m", "src.data.shards", "pack", "tree", "packed", "--max-side", "32", "--workers", "2"]
    proc = subprocess.Popen(
        command,
        cwd=tmp_path,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    deadline = time.time() + 60
    while not list(tmp_path.glob(".packed.partial-*/train-00000.shard")) and time.time() < deadline:
        time.sleep(0.01)
    assert proc.poll() is None, proc.communicate()  # still packing
    if sig == signal.SIGINT:
        os.killpg(proc.pid, sig)
    else:
        proc.send_signal(sig)
    _, stderr = proc.communicate(timeout=30)
    assert proc.returncode == 128 + sig
    assert stderr.splitlines() == [f"stopped by {sig.name}: nothing was written to packed"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["tree"]
