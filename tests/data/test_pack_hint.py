"""An ImageFolder of large JPEGs read from disk gets one line with the command that packs it smaller; the command
runs as printed, also from a folder whose name holds spaces, quotes and `$()`."""

from __future__ import annotations

import logging
import shlex
import subprocess
import sys
from pathlib import Path

import numpy as np

from src.config.commands import hydra_value
from src.data.datasets import load_data
from tests.conftest import make_cfg


def _folder(root: Path, side: int) -> None:
    from PIL import Image

    rng = np.random.default_rng(0)
    for split, n in (("train", 4), ("test", 2)):
        for c in ("a", "b"):
            (root / split / c).mkdir(parents=True)
            for i in range(n):
                pixels = rng.integers(0, 256, (side, side + 40, 3), dtype=np.uint8)
                Image.fromarray(pixels).save(root / split / c / f"{i}.jpg", quality=90)


def _said(tmp_path: Path, root: Path, caplog) -> list[str]:
    caplog.clear()
    caplog.set_level(logging.INFO, logger="src.data.image_folder")
    overrides = ["data=imagefolder", f"data.root={hydra_value(root)}", "data.image_size=32", "data.val_fraction=0.5"]
    overrides.append("data.augment=random_resized_crop")
    load_data(make_cfg(tmp_path / "cfg", *overrides).data)
    return [r.getMessage() for r in caplog.records if "shards pack" in r.getMessage()]


def test_large_images_get_the_pack_command_that_runs_as_printed(tmp_path, caplog):
    from hydra.core.override_parser.overrides_parser import OverridesParser

    root = tmp_path / "my data $(touch pwned) 'x'"
    _folder(root, 400)
    (line,) = _said(tmp_path, root, caplog)
    assert "~400 px" in line
    pack, train = line.split("faster: ", 1)[1].split(", then ", 1)
    assert pack.startswith("python -m src.data.shards pack ")
    done = subprocess.run(
        ["bash", "-c", sys.executable + pack.removeprefix("python")],
        cwd=tmp_path,
        env={"PYTHONPATH": str(Path(__file__).resolve().parents[2]), "PATH": "/usr/bin:/bin"},
        capture_output=True,
        text=True,
    )
    assert done.returncode == 0, done.stderr[-1000:]
    packed = Path(f"{root}-shards256")
    assert (packed / "meta.json").exists() and not (tmp_path / "pwned").exists()
    words = shlex.split(train)
    assert words[:3] == ["python", "train.py", "data=shards"]
    assert OverridesParser.create().parse_override(words[3]).value() == str(packed)


def test_images_near_the_crop_size_get_no_line(tmp_path, caplog):
    root = tmp_path / "small"
    _folder(root, 240)
    assert _said(tmp_path, root, caplog) == []
