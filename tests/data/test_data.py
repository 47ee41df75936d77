"""The data group: builders named by `_target_`, shared keys composed from `conf/data_common.yaml`, the
content-keyed decode cache, and one-line errors for bad data and bad data settings."""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from hydra import compose, initialize_config_dir
from hydra.utils import get_method
from omegaconf import OmegaConf, open_dict

from src.config.errors import ConfigError
from src.data import datasets, image_folder, shards
from src.data.datasets import DataBundle, Split, carve_val, check_data_config, load_data, stratified_split
from src.state.resume import current_config
from tests.conftest import ROOT, make_cfg, read_metrics, run_cli

DATA_OPTIONS = ("digits", "cifar10", "cifar100", "imagefolder", "shards", "synthetic")

# The data config of every option and experiment, recorded from the YAMLs before the shared keys moved to
# conf/data_common.yaml (unresolved, so interpolations are compared as written). `_target_` is new, and so are
# the keys of images read from disk (issue 16: GPU decoding, the GPU's share with decode=split, where crops run,
# random resized crop ranges, skipping bad images).
ON_DISK = {
    "decode": "auto",
    "gpu_share": 0.5,
    "crop": "auto",
    "rrc_scale": [0.08, 1.0],
    "rrc_ratio": [0.75, 1.3333333333333333],
    "skip_bad_images": False,
}
BEFORE = {
    "digits": {
        "name": "digits",
        "batch_size": 128,
        "eval_batch_size": 512,
        "val_fraction": 0.15,
        "test_fraction": 0.2,
        "augment": "none",
        "cutout": 0,
        "pad_mode": "zeros",
        "num_workers": 0,
        "loader": "auto",
    },
    "cifar10": {
        "name": "cifar10",
        "root": "${paths.data_dir}/cifar10",
        "download": True,
        "batch_size": 256,
        "eval_batch_size": 1024,
        "val_fraction": 0.1,
        "augment": "crop_flip",
        "cutout": 0,
        "pad_mode": "zeros",
        "num_workers": 4,
        "loader": "auto",
    },
    "cifar100": {
        "name": "cifar100",
        "root": "${paths.data_dir}/cifar100",
        "download": True,
        "batch_size": 256,
        "eval_batch_size": 1024,
        "val_fraction": 0.1,
        "augment": "crop_flip",
        "cutout": 0,
        "pad_mode": "zeros",
        "num_workers": 4,
        "loader": "auto",
    },
    "imagefolder": {
        "name": "imagefolder",
        "root": "???",
        "image_size": None,
        "batch_size": 256,
        "eval_batch_size": 1024,
        "val_fraction": 0.1,
        "augment": "auto",
        "cutout": 0,
        "pad_mode": "zeros",
        "num_workers": "auto",
        "loader": "auto",
        "max_memory_gb": 8,
        **ON_DISK,
    },
    "synthetic": {
        "name": "synthetic",
        "num_samples": 2048,
        "num_test": 512,
        "shape": [3, 32, 32],
        "num_classes": 10,
        "batch_size": 256,
        "eval_batch_size": 1024,
        "val_fraction": 0.1,
        "augment": "none",
        "cutout": 0,
        "pad_mode": "zeros",
        "num_workers": 0,
        "loader": "auto",
    },
}
SHARDS = {
    "name": "shards",
    "root": "???",
    "image_size": None,
    "batch_size": 256,
    "eval_batch_size": 1024,
    "val_fraction": 0.1,
    "augment": "auto",
    "cutout": 0,
    "pad_mode": "zeros",
    "num_workers": "auto",
    "loader": "auto",
    **ON_DISK,
}  # added with the on-disk keys (issue 16)
BEFORE["shards"] = SHARDS
# added with the batch recipes (issue 33 item 7), all off
RECIPES = {
    "auto_augment": "none",
    "random_erasing": 0.0,
    "mixup_alpha": 0.0,
    "cutmix_alpha": 0.0,
    "mix_prob": 1.0,
    "mix_switch_prob": 0.5,
}
for option in BEFORE.values():
    option.update(RECIPES)
    option["flip"] = "random"  # added with airbench96's rules (issue 34 item 4): a fresh flip per epoch, as before
JPEG = {"root": "${paths.data_dir}/cifar10-jpeg", "batch_size": 512}
BEFORE_EXPERIMENTS = {
    "cifar10_94": {**BEFORE["imagefolder"], **JPEG, "val_fraction": 0.0, "cutout": 8, "loader": "resident"},
    "cifar10_jpeg": {**BEFORE["imagefolder"], **JPEG, "num_workers": 8},
    "cifar10_long": {**BEFORE["imagefolder"], **JPEG, "val_fraction": 0.0, "cutout": 16, "loader": "resident"},
    "seeds_cifar100": BEFORE["cifar100"],
}
BUILDERS = {
    "digits": datasets.load_digits_data,
    "cifar10": datasets.load_cifar10,
    "cifar100": datasets.load_cifar100,
    "imagefolder": image_folder.load_imagefolder,
    "shards": shards.load_shards,
    "synthetic": datasets.load_synthetic,
}


def composed_data(*overrides: str) -> dict:
    with initialize_config_dir(str(ROOT / "conf"), version_base="1.3"):
        return OmegaConf.to_container(compose("train", overrides=list(overrides)).data, resolve=False)


# --- 1. a dataset is one function and one YAML ------------------------------------------------------------

TOY_TRAIN, TOY_TEST = 300, 90


def toy_bars(cfg) -> DataBundle:
    """A user's dataset: 1x8x8 noise with a bright vertical bar at a class-dependent place (3 classes)."""
    g = torch.Generator().manual_seed(1)

    def make(n: int) -> Split:
        labels = torch.arange(n) % 3
        images = torch.randint(0, 60, (n, 1, 8, 8), generator=g, dtype=torch.uint8)
        for k in range(3):
            images[labels == k, :, :, 2 * k + 1 : 2 * k + 3] = 230
        return Split(labels, images=images)

    train, val = carve_val(make(TOY_TRAIN), cfg.val_fraction)  # the helper docs/extending.md shows
    return DataBundle(cfg.name, train, val, make(TOY_TEST), 3, 1, (8, 8), (0.3,), (0.3,), cfg.augment, ["a", "b", "c"])


def empty_train(cfg) -> DataBundle:
    """A builder whose training split came out empty."""
    none = Split(torch.empty(0, dtype=torch.long), images=torch.empty(0, 1, 8, 8, dtype=torch.uint8))
    some = Split(torch.zeros(4, dtype=torch.long), images=torch.zeros(4, 1, 8, 8, dtype=torch.uint8))
    return DataBundle(cfg.name, none, none, some, 2, 1, (8, 8), (0.5,), (0.3,), "none")


def test_a_builder_defined_in_a_test_trains_end_to_end(tmp_path):
    from src.run.launch import main as launch

    cfg = make_cfg(
        tmp_path,
        "data._target_=tests.data.test_data.toy_bars",
        "data.name=toy",
        "+data.bar_width=2",  # a key of its own: not one of src/'s, not refused
        "data.batch_size=32",
        "trainer.limit_train_batches=null",
        "trainer.max_epochs=3",
    )
    metrics = launch(cfg)
    saved = read_metrics(tmp_path / "run")
    assert metrics["test_count"] == saved["final"]["test_count"] == TOY_TEST  # digits would give 360
    assert saved["status"] == "completed" and saved["hparams"]["data"] == "toy"
    assert metrics["test_top1"] >= 90.0  # 3 classes: chance is 33 %


@pytest.mark.parametrize("option", DATA_OPTIONS)
def test_every_data_yaml_names_its_builder(option):
    target = composed_data(f"data={option}")["_target_"]
    assert get_method(target) is BUILDERS[option]


# --- 2. the shared keys live in conf/data_common.yaml ------------------------------------------------------


@pytest.mark.parametrize("option", DATA_OPTIONS)
def test_data_options_compose_to_the_values_before(option):
    data = composed_data(f"data={option}")
    assert data.pop("_target_") == f"{BUILDERS[option].__module__}.{BUILDERS[option].__name__}"
    assert data == BEFORE[option]


@pytest.mark.parametrize("experiment", sorted(BEFORE_EXPERIMENTS))
def test_experiments_compose_to_the_data_values_before(experiment):
    data = composed_data(f"experiment={experiment}")
    data.pop("_target_")
    assert data == BEFORE_EXPERIMENTS[experiment]


@pytest.mark.parametrize("option", DATA_OPTIONS)
def test_data_yamls_hold_only_their_own_keys(option):
    common = yaml.safe_load((ROOT / "conf/data_common.yaml").read_text())
    own = yaml.safe_load((ROOT / f"conf/data/{option}.yaml").read_text())
    assert own.pop("defaults") == ["/data_common@_here_", "_self_"]
    assert {"_target_", "name"} <= set(own)
    repeated = {k: v for k, v in own.items() if k in common and common[k] == v}
    assert not repeated, f"{option}.yaml repeats data_common.yaml: {repeated}"


# --- 3. the decode cache is keyed by the files' content -------------------------------------------------


def _write_tree(root: Path, classes=("a", "b", "c"), counts=(6, 3, 3), ext="bmp", mtime_ns=None) -> None:
    """train/ val/ test/ with the same file names in every class; each class lights its own channel.
    BMPs of one size have one byte size, so only the path, label, mtime and inode tell files apart."""
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, n in zip(("train", "val", "test"), counts):
        for c, name in enumerate(classes):
            (root / split / name).mkdir(parents=True)
            for i in range(n):
                pixels = rng.integers(0, 100, (8, 8, 3), dtype=np.uint8)
                pixels[..., c % 3] = 200 + 10 * i
                path = root / split / name / f"{i}.{ext}"
                Image.fromarray(pixels).save(path)
                if mtime_ns is not None:
                    os.utime(path, ns=(mtime_ns, mtime_ns))


def _reference(folder: Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Images and labels read straight from the files: sorted class folders, sorted file names."""
    from PIL import Image

    images, labels = [], []
    for label, cls in enumerate(sorted(p.name for p in folder.iterdir())):
        for path in sorted((folder / cls).iterdir()):
            with Image.open(path) as img:
                images.append(torch.from_numpy(np.array(img.convert("RGB"))).permute(2, 0, 1))
            labels.append(label)
    return torch.stack(images), torch.tensor(labels)


@pytest.fixture
def decodes(monkeypatch):
    """Counts the folders actually decoded (cache misses)."""
    calls = []
    real = image_folder._decode_folder

    def counting(ds, size):
        calls.append(ds.root)
        return real(ds, size)

    monkeypatch.setattr(image_folder, "_decode_folder", counting)
    return calls


def _load(tmp_path: Path, root: Path, *overrides: str):
    return load_data(make_cfg(tmp_path, "data=imagefolder", f"data.root={root}", *overrides).data)


def _assert_matches_files(data, root: Path) -> None:
    for split in ("train", "val", "test"):
        images, labels = _reference(root / split)
        got = getattr(data, split)
        assert torch.equal(got.labels, labels) and torch.equal(got.images, images), split


def test_swapping_two_class_folders_decodes_again(tmp_path, decodes):
    root = tmp_path / "tree"
    _write_tree(root, mtime_ns=1_700_000_000_000_000_000)  # one mtime for all: the swap changes no size or time
    _assert_matches_files(_load(tmp_path, root), root)
    assert len(decodes) == 3
    before = _reference(root / "train")[0]
    os.rename(root / "train/a", root / "train/tmp")
    os.rename(root / "train/b", root / "train/a")
    os.rename(root / "train/tmp", root / "train/b")
    assert not torch.equal(_reference(root / "train")[0], before)  # same labels, other images under them
    data = _load(tmp_path, root)
    _assert_matches_files(data, root)
    assert decodes[3:] == [str(root / "train")]  # only the changed split is decoded again
    assert len(list((root / ".ddplab-cache").glob("train-*.pt"))) == 1  # the stale entry is gone


def test_touching_or_rewriting_one_image_decodes_again(tmp_path, decodes):
    from PIL import Image

    root = tmp_path / "tree"
    _write_tree(root)
    _load(tmp_path, root)
    target = root / "val/b/1.bmp"
    stat = target.stat()
    os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    _assert_matches_files(_load(tmp_path, root), root)
    assert decodes[3:] == [str(root / "val")]
    Image.fromarray(np.full((8, 8, 3), 7, dtype=np.uint8)).save(target)  # same byte size, new pixels
    os.utime(target, ns=(stat.st_atime_ns, stat.st_mtime_ns + 2 * 10**9))
    data = _load(tmp_path, root)
    _assert_matches_files(data, root)
    assert (data.val.images == 7).all(dim=(1, 2, 3)).sum() == 1 and decodes[4:] == [str(root / "val")]
    _load(tmp_path, root)
    assert len(decodes) == 5  # unchanged files: served from the cache


@pytest.mark.parametrize("old", ["src.data.datasets.load_imagefolder", "src.datasets.load_imagefolder"])
def test_a_data_yaml_naming_the_imagefolder_builders_old_place_loads_with_a_warning(tmp_path, caplog, old):
    root = tmp_path / "tree"
    _write_tree(root)
    with caplog.at_level("WARNING", logger="src.data.datasets"):
        data = _load(tmp_path, root, f"data._target_={old}")
    _assert_matches_files(data, root)
    new = "src.data.image_folder.load_imagefolder"
    assert [r.getMessage() for r in caplog.records] == [f"data._target_={old} has moved to {new}"]
    saved = {"data": {"_target_": old, "root": str(root)}, "model": {"_target_": "src.models.TinyCNN"}}
    assert current_config(saved) == {"data": {"_target_": new, "root": str(root)}, "model": saved["model"]}


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_damaged_cache_file_is_decoded_again_with_a_warning(tmp_path, decodes, caplog, damage):
    root = tmp_path / "tree"
    _write_tree(root)
    _load(tmp_path, root)
    (cache,) = (root / ".ddplab-cache").glob("test-*.pt")
    blob = cache.read_bytes()
    cache.write_bytes(blob[: len(blob) // 2] if damage == "truncated" else b"not a cache file")
    with caplog.at_level("WARNING", logger="src.data.image_folder"):
        data = _load(tmp_path, root)
    _assert_matches_files(data, root)
    assert decodes[3:] == [str(root / "test")]
    assert any(str(cache) in r.getMessage() and "decoding the images again" in r.getMessage() for r in caplog.records)
    _load(tmp_path, root)
    assert len(decodes) == 4  # the rewritten cache is read back


# --- 4. bad data and bad settings: one line each ---------------------------------------------------------


def _one_line(excinfo) -> str:
    message = str(excinfo.value)
    assert "\n" not in message
    return message


def test_imagefolder_without_root_is_one_line(tmp_path):
    from src.run.launch import main as launch

    with pytest.raises(ConfigError, match=r"data.root must be set for data=imagefolder") as excinfo:
        launch(make_cfg(tmp_path, "data=imagefolder"))
    _one_line(excinfo)
    proc = run_cli("debug=fast", "data=imagefolder", f"hydra.run.dir={tmp_path}/cli", cwd=tmp_path)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert proc.stderr.strip().splitlines()[-1].startswith("error: data.root must be set")


def test_class_folders_without_images(tmp_path):
    root = tmp_path / "tree"
    _write_tree(root)
    for path in (root / "train/b").iterdir():
        path.unlink()
    (root / "train/b/notes.txt").write_text("no images here")
    with pytest.raises(ConfigError, match=r"train: class folder\(s\) b hold no images") as excinfo:
        _load(tmp_path, root)
    _one_line(excinfo)


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_a_corrupt_jpeg_is_named_in_memory_and_on_disk(tmp_path, damage):
    root = tmp_path / "tree"
    _write_tree(root, ext="jpg")
    bad = root / "train/c/4.jpg"
    blob = bad.read_bytes()
    bad.write_bytes(b"\xff\xd8 not a jpeg" if damage == "garbage" else blob[: len(blob) // 2])
    with pytest.raises(ConfigError, match=rf"{bad}: cannot read this image") as excinfo:
        _load(tmp_path, root)
    _one_line(excinfo)
    on_disk = _load(tmp_path, root, "data.max_memory_gb=1e-9")  # too big for memory: read by the loader
    assert not on_disk.in_memory and len(on_disk.train) == 18
    with pytest.raises(ConfigError, match=rf"{bad}: cannot read this image") as excinfo:
        [on_disk.train.files[i] for i in range(len(on_disk.train))]
    _one_line(excinfo)


def test_a_broken_symlink_is_named(tmp_path):
    root = tmp_path / "tree"
    _write_tree(root)
    link = root / "val/a/9.bmp"
    link.symlink_to(tmp_path / "elsewhere.bmp")
    with pytest.raises(ConfigError, match=rf"{link}: cannot read this image \(No such file or directory\)") as exc:
        _load(tmp_path, root)
    _one_line(exc)


def test_a_folder_named_like_an_image_is_no_sample(tmp_path):
    root = tmp_path / "tree"
    _write_tree(root)
    (root / "test/a/x.bmp").mkdir()
    assert len(_load(tmp_path, root).test) == 9


def test_a_split_too_small_for_every_class_names_the_fractions_that_work():
    labels = torch.arange(64) % 10  # 64 samples of 10 classes: 0.1 holds out 7, fewer than the classes
    with pytest.raises(ConfigError) as info:
        stratified_split(labels, 0.1)
    message = str(info.value)
    assert message.startswith("data.val_fraction=0.1 cannot split 64 samples of 10 classes") and "\n" not in message
    low, high = (float(v) for v in re.search(r"between ([\d.]+) and ([\d.]+)", message).groups())
    for fraction in (low, high):  # the range's ends split, every class on both sides
        keep, held = stratified_split(labels, fraction)
        assert len(labels[keep].unique()) == len(labels[held].unique()) == 10
    for fraction in (round(low - 0.01, 2), round(high + 0.01, 2)):  # just outside: refused
        with pytest.raises(ConfigError, match="cannot split"):
            stratified_split(labels, fraction)
    with pytest.raises(ConfigError, match=r"class 1 has only 1 sample"):
        stratified_split(torch.tensor([0, 0, 1, 2, 2]), 0.4)


@pytest.mark.parametrize(
    "override,message",
    [
        ("data.val_fraction=0.999", r"data.val_fraction=0.999 cannot split 1437 samples of 10 classes"),
        ("data.test_fraction=0.001", r"data.test_fraction=0.001 cannot split 1797 samples of 10 classes"),
        ("+data.num_worker=4", r"^data.num_worker is not a data option; did you mean data.num_workers\?$"),
        ("+data.foo=1", r"^data.foo is not an option of data=digits; the data options are batch_size, "),
        ("data.val_fraction=1.0", r"data.val_fraction must be a number >= 0 and < 1, got 1.0"),
        ("data.val_fraction=-0.1", r"data.val_fraction must be a number >= 0 and < 1, got -0.1"),
        ("data.val_fraction=some", r"data.val_fraction must be a number >= 0 and < 1, got 'some'"),
        ("data.test_fraction=0", r"data.test_fraction must be a number > 0 and < 1, got 0"),
        ("data.augment=bogus", r"data.augment must be one of none, crop_flip, random_resized_crop, auto, got 'bogus'"),
        ("data.augment=random_resized_crop", r"data.augment=random_resized_crop needs images read from disk"),
        ("data.num_workers=-1", r"data.num_workers must be one of auto or an integer >= 0, got -1"),
        ("data.num_workers=1.5", r"data.num_workers must be one of auto or an integer >= 0, got 1.5"),
        ("data.num_workers=two", r"data.num_workers must be one of auto or an integer >= 0, got 'two'"),
        (
            "data._target_=src.data.datasets.no_such_loader",
            r"data._target_=src.data.datasets.no_such_loader cannot be imported as a function \(Are you sure",
        ),
        ("data._target_=tests.data.test_data.empty_train", r"the train split of data=digits is empty"),
        ("+data.decode=nvjpeg", r"data.decode must be one of auto, gpu, cpu, split, dali, got 'nvjpeg'"),
        (
            "+data.rrc_scale=[0.5,0.1]",
            r"data.rrc_scale must be .* pair \[low, high\] with 0 < low <= high <= 1 .*got \[0.5, 0.1\]",
        ),
        (
            "+data.rrc_scale=[0.5,2]",
            r"data.rrc_scale must be a list of a number pair \[low, high\] with 0 < low <= high <= 1",
        ),
        (
            "+data.rrc_ratio=0.75",
            r"data.rrc_ratio must be .* pair \[low, high\] with 0 < low <= high \(width / height\), got 0.75",
        ),
        ("+data.skip_bad_images=sometimes", r"data.skip_bad_images must be true or false, got 'sometimes'"),
    ],
)
def test_bad_data_settings_are_one_line(tmp_path, override, message):
    with pytest.raises(ConfigError, match=message) as excinfo:
        load_data(make_cfg(tmp_path, override).data)
    _one_line(excinfo)


def test_the_checks_run_before_any_data_is_read(tmp_path):
    """check_data_config alone refuses what it can tell from the config (the lead calls it before any rank)."""
    with pytest.raises(ConfigError, match="data.num_workers must be"):
        check_data_config(make_cfg(tmp_path, "data=cifar10", "data.download=false", "data.num_workers=-2").data)
    cfg = make_cfg(tmp_path)
    with open_dict(cfg):
        del cfg.data.batch_size
    with pytest.raises(ConfigError, match=r"data.batch_size is missing; start the data YAML with `defaults"):
        check_data_config(cfg.data)
    cfg = make_cfg(tmp_path)
    with open_dict(cfg):
        del cfg.data._target_
    with pytest.raises(ConfigError, match="data._target_ is not set"):
        check_data_config(cfg.data)


@pytest.mark.parametrize("option", DATA_OPTIONS)
def test_every_shipped_data_option_passes_the_checks(tmp_path, option):
    root = ["data.root=/x"] if option in ("imagefolder", "shards") else []
    check_data_config(make_cfg(tmp_path, f"data={option}", *root).data)


# --- what scikit-learn computes is cached: importing it costs each process ~0.9 s ------------------------

DIGITS_BUNDLE = """
import sys, torch
from omegaconf import OmegaConf
from src.data.datasets import load_digits_data
cfg = OmegaConf.create({"name": "digits", "val_fraction": 0.15, "test_fraction": 0.2})
b = load_digits_data(cfg)
torch.save({s: (getattr(b, s).images, getattr(b, s).labels) for s in ("train", "val", "test")}, sys.argv[1])
print("sklearn imported:", "sklearn" in sys.modules)
"""


def test_digits_and_their_splits_are_sklearns_and_a_second_process_reads_them_without_importing_it(tmp_path):
    import subprocess
    import sys

    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    env = {**os.environ, "XDG_CACHE_HOME": str(tmp_path / "cache"), "PYTHONPATH": str(ROOT)}
    runs = []
    for i in range(2):
        out = tmp_path / f"bundle{i}.pt"
        proc = subprocess.run(
            [sys.executable, "-c", DIGITS_BUNDLE, str(out)], env=env, capture_output=True, text=True, cwd=ROOT
        )
        assert proc.returncode == 0, proc.stderr[-2000:]
        runs.append((proc.stdout.strip(), torch.load(out, weights_only=True)))
    assert [said for said, _ in runs] == ["sklearn imported: True", "sklearn imported: False"]
    for split in ("train", "val", "test"):
        for a, b in zip(runs[0][1][split], runs[1][1][split]):
            assert torch.equal(a, b)
    # the independent reference: scikit-learn's own split of its digits
    raw = load_digits()
    idx = np.arange(len(raw.target))
    train_idx, test_idx = train_test_split(idx, test_size=0.2, random_state=0, stratify=raw.target)
    assert torch.equal(runs[1][1]["test"][1], torch.from_numpy(raw.target[np.sort(test_idx)]))
    images = np.round(raw.images * (255 / 16)).astype(np.uint8)[np.sort(test_idx)]
    assert torch.equal(runs[1][1]["test"][0][:, 0], torch.from_numpy(images))
    assert len(runs[1][1]["train"][1]) + len(runs[1][1]["val"][1]) == len(train_idx)


def test_an_unreadable_cache_entry_is_computed_again_and_replaced(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    labels = torch.arange(40) % 4
    fresh = stratified_split(labels, 0.25)
    (entry,) = (tmp_path / "ddplab").glob("split-*.pt")
    entry.write_bytes(b"not a torch file")
    again = stratified_split(labels, 0.25)
    assert all(torch.equal(a, b) for a, b in zip(fresh, again))
    assert torch.equal(torch.load(entry, weights_only=True)["held"], fresh[1])
    assert [p.name for p in (tmp_path / "ddplab").iterdir()] == [entry.name]  # no temporary file left
