"""One image, one decoding: every path that turns a file into pixels (the in-memory ImageFolder, the DataLoader
workers' decode, the device decoder's CPU fallback, packed shards with and without --max-side) gives the same RGB
uint8 image, for each format below. Each expected image is built here from the pixel values written, by hand."""

from __future__ import annotations

import io
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from src.data import shards
from src.data.datasets import load_data
from src.data.decode import as_tensor, decode_batch
from tests.conftest import make_cfg

H, W = 16, 32
rng = np.random.default_rng(0)
RGB = rng.integers(0, 256, (H, W, 3), dtype=np.uint8)
GRAY = rng.integers(0, 256, (H, W), dtype=np.uint8)
ALPHA = rng.integers(0, 256, (H, W), dtype=np.uint8)
WIDE = rng.integers(0, 2**16, (H, W, 3), dtype=np.uint16)  # 16-bit samples
INDEX = rng.integers(0, 4, (H, W), dtype=np.uint8)
PALETTE = np.array([[255, 0, 0], [0, 255, 0], [0, 0, 255], [10, 20, 30]], dtype=np.uint8)
# JPEG is lossy: two 16 x 16 blocks of one colour each, colours whose JPEG round trip is exact at quality 100
# without chroma subsampling (whose upsampling blends the blocks' colours at their border)
EXACT = {"quality": 100, "subsampling": 0}
BLOCKS = np.concatenate([np.full((H, 16, 3), (200, 100, 50)), np.full((H, 16, 3), 60)], axis=1).astype(np.uint8)


def saved(img: Image.Image, fmt: str = "PNG", **options) -> bytes:
    out = io.BytesIO()
    img.save(out, fmt, **options)
    return out.getvalue()


def png16(pixels: np.ndarray) -> bytes:
    """A 16-bit RGB PNG (PIL cannot write one), chunk by chunk."""

    def chunk(kind: bytes, body: bytes) -> bytes:
        return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))

    rows = b"".join(b"\0" + row.astype(">u2").tobytes() for row in pixels)  # filter 0, big-endian samples
    header = struct.pack(">IIBBBBB", W, H, 16, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b"")


def palette_image() -> Image.Image:
    img = Image.frombytes("P", (W, H), INDEX.tobytes())
    img.putpalette(PALETTE.tobytes())
    return img


def gray3(gray: np.ndarray) -> np.ndarray:
    return np.repeat(gray[..., None], 3, axis=2)


def high_byte(wide: np.ndarray) -> np.ndarray:
    return (wide >> 8).astype(np.uint8)


# file name: (its bytes, the RGB uint8 image every path must give). Alpha is dropped, not composited.
FORMATS = {
    "rgb.png": (lambda: saved(Image.fromarray(RGB)), RGB),
    "l.png": (lambda: saved(Image.fromarray(GRAY)), gray3(GRAY)),
    "la.png": (lambda: saved(Image.merge("LA", [Image.fromarray(GRAY), Image.fromarray(ALPHA)])), gray3(GRAY)),
    "rgba.png": (lambda: saved(Image.fromarray(np.dstack([RGB, ALPHA]))), RGB),
    "p.png": (lambda: saved(palette_image()), PALETTE[INDEX]),
    "p-alpha.png": (lambda: saved(palette_image(), transparency=bytes([255, 0, 128, 255])), PALETTE[INDEX]),
    "p-key.png": (lambda: saved(palette_image(), transparency=3), PALETTE[INDEX]),
    "gray16.png": (lambda: saved(Image.fromarray(WIDE[..., 0])), gray3(high_byte(WIDE[..., 0]))),
    "rgb16.png": (lambda: png16(WIDE), high_byte(WIDE)),
    "gray16.tif": (lambda: saved(Image.fromarray(WIDE[..., 0]), "TIFF"), gray3(high_byte(WIDE[..., 0]))),
    "p.bmp": (lambda: saved(palette_image(), "BMP"), PALETTE[INDEX]),
    "rgb.jpg": (lambda: saved(Image.fromarray(BLOCKS), "JPEG", **EXACT), BLOCKS),
    "progressive.jpg": (lambda: saved(Image.fromarray(BLOCKS), "JPEG", progressive=True, **EXACT), BLOCKS),
    "cmyk.jpg": (lambda: saved(Image.fromarray(BLOCKS).convert("CMYK"), "JPEG", **EXACT), BLOCKS),
    "gray.jpg": (lambda: saved(Image.fromarray(BLOCKS[..., 1]), "JPEG", **EXACT), gray3(BLOCKS[..., 1])),
}
NAMES = sorted(FORMATS)  # ImageFolder's order


@pytest.fixture(scope="module")
def tree(tmp_path_factory) -> Path:
    """train/ and test/ with one class holding one file of each format."""
    root = tmp_path_factory.mktemp("formats")
    for split in ("train", "test"):
        (root / split / "a").mkdir(parents=True)
        for name, (write, _) in FORMATS.items():
            (root / split / "a" / name).write_bytes(write())
    return root


def train_images(tmp_path: Path, *overrides: str) -> dict[str, np.ndarray]:
    """Each training file as the dataset gives it (decoded in memory, or one by one as a DataLoader worker)."""
    cfg = make_cfg(tmp_path, *overrides, "data.val_fraction=0", "data.augment=none", "data.num_workers=0")
    split = load_data(cfg.data).train
    images = split.images if split.images is not None else [split.files[i][0] for i in range(len(split))]
    assert len(images) == len(NAMES)
    return {name: image.permute(1, 2, 0).numpy() for name, image in zip(NAMES, images)}


def wrong(got: dict[str, np.ndarray], expected: dict[str, np.ndarray]) -> list[str]:
    return [name for name in NAMES if not np.array_equal(got[name], expected[name])]


EXPECTED = {name: image for name, (_, image) in FORMATS.items()}


def test_the_in_memory_folder(tmp_path, tree):
    assert not wrong(train_images(tmp_path, "data=imagefolder", f"data.root={tree}"), EXPECTED)


def test_the_workers_decode(tmp_path, tree):
    got = train_images(tmp_path, "data=imagefolder", f"data.root={tree}", "data.max_memory_gb=1e-9")
    assert not wrong(got, EXPECTED)


def test_the_device_decoders_cpu_fallback(tree):
    """decode_batch on the CPU: libjpeg for plain JPEGs, the CPU decoder for the files it refuses."""
    got = {}
    for name in NAMES:
        (image,) = decode_batch([as_tensor((tree / "train/a" / name).read_bytes())], torch.device("cpu"), str)
        got[name] = image.permute(1, 2, 0).numpy()
    assert not wrong(got, EXPECTED)


@pytest.mark.parametrize("max_side", [None, H])
def test_packed_shards(tmp_path, tree, max_side):
    shards.pack(tree, tmp_path / "packed", max_side=max_side, workers=1)
    assert not wrong(train_images(tmp_path, "data=shards", f"data.root={tmp_path / 'packed'}"), EXPECTED)


def test_packed_shards_resized(tmp_path, tree):
    """--max-side below the images' size: each stored image is the expected one resized and encoded by the same
    PIL calls (shorter side to max_side, bicubic, JPEG quality 90)."""
    shards.pack(tree, tmp_path / "packed", max_side=H // 2, workers=1)
    resized = {}
    for name, image in EXPECTED.items():
        small = Image.fromarray(image).resize((W // 2, H // 2), Image.Resampling.BICUBIC)
        with Image.open(io.BytesIO(saved(small, "JPEG", quality=90))) as img:
            resized[name] = np.asarray(img.convert("RGB"))
    assert not wrong(train_images(tmp_path, "data=shards", f"data.root={tmp_path / 'packed'}"), resized)
