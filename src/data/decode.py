"""Images read from disk: their encoded bytes, and decoding them on the CPU or (batched) on the device.

An on-disk split (`EncodedImages`: an ImageFolder's files, or packed shards, src/data/shards.py) hands out each
sample's encoded bytes; the loader decodes them either in its DataLoader workers (`decode_cpu`) or, batched, on
the training device (`decode_batch`: nvjpeg on CUDA). `gpu_decodable` tells, from a JPEG's header alone, which
images the device decoder handles; the rest (PNG, CMYK, grayscale, progressive, ...) is decoded on the CPU.
`decode_cpu` is the one CPU decoding: every path that turns a file into pixels goes through it.
"""

from __future__ import annotations

import copy
import io
import os
from collections.abc import Callable, Sequence

import numpy as np
import torch

from src.config.errors import ConfigError

# JPEG frame markers: baseline and extended sequential Huffman (what nvjpeg's batched decoder takes)
_SEQUENTIAL = {0xC0, 0xC1}
_OTHER_FRAMES = {0xC2, 0xC3, 0xC5, 0xC6, 0xC7, 0xC9, 0xCA, 0xCB, 0xCD, 0xCE, 0xCF}
# luma sampling factors (h, v) of the chroma subsamplings nvjpeg knows (chroma sampled 1 x 1): 444 422 420 440 411 410
_SUBSAMPLINGS = {(1, 1), (2, 1), (2, 2), (1, 2), (4, 1), (4, 2)}


def unreadable(name: str, exc: Exception) -> ConfigError:
    """One line naming a file that cannot be read or decoded (PIL's own messages repeat the path or span lines)."""
    from PIL import UnidentifiedImageError

    if isinstance(exc, UnidentifiedImageError):
        why = "not an image format PIL can read"
    elif isinstance(exc, OSError) and exc.strerror:
        why = exc.strerror
    else:
        why = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
    return ConfigError(f"{name}: cannot read this image ({why}); remove or replace the file")


def _jpeg_segments(data: memoryview):
    """(marker, segment) of each segment of a JPEG's header, up to its start of scan: nothing more where the bytes
    are not a complete JPEG (no end marker) or the header is broken."""
    n = len(data)
    if n < 4 or data[0] != 0xFF or data[1] != 0xD8 or data[n - 2] != 0xFF or data[n - 1] != 0xD9:
        return
    pos = 2
    while pos + 4 <= n:
        if data[pos] != 0xFF:
            return
        marker = data[pos + 1]
        if marker == 0xFF:  # fill byte
            pos += 1
            continue
        if marker == 0x01 or 0xD0 <= marker <= 0xD7:  # markers without a length
            pos += 2
            continue
        length = (data[pos + 2] << 8) | data[pos + 3]
        yield marker, data[pos + 4 : pos + 2 + length]
        if marker == 0xDA:  # start of scan: the header is over
            return
        pos += 2 + length


def gpu_decodable(data) -> bool:
    """Whether the device decoder takes this image: a complete 8-bit sequential JPEG with 3 YCbCr components
    in a common subsampling, read from its header (a few hundred bytes) without decoding."""
    frame = False
    for marker, segment in _jpeg_segments(memoryview(data).cast("B")):
        if marker in _OTHER_FRAMES:
            return False
        if marker in _SEQUENTIAL:
            if len(segment) < 15 or segment[0] != 8 or segment[5] != 3:  # precision, component count
                return False
            sampling = [(segment[7 + 3 * k] >> 4, segment[7 + 3 * k] & 15) for k in range(3)]
            if sampling[0] not in _SUBSAMPLINGS or sampling[1] != (1, 1) or sampling[2] != (1, 1):
                return False
            frame = True
        if marker == 0xEE and bytes(segment[:5]) == b"Adobe" and len(segment) >= 12 and segment[11] == 0:
            return False  # Adobe's "no colour transform": RGB stored as is, not YCbCr
        if marker == 0xDA:
            return frame
    return False


def encoded_size(data, name: str) -> tuple[int, int]:
    """(height, width) of an encoded image, from its header without decoding: a JPEG's frame, else PIL's reading
    of the header (PNG, WEBP, ...). The stored orientation, as `decode_cpu` decodes it (EXIF is not applied). A
    file whose header neither reads is one ConfigError line naming it."""
    from PIL import Image

    view = memoryview(data).cast("B")
    for marker, segment in _jpeg_segments(view):
        if (marker in _SEQUENTIAL or marker in _OTHER_FRAMES) and len(segment) >= 5:
            height, width = (segment[1] << 8) | segment[2], (segment[3] << 8) | segment[4]
            if height and width:  # a height of 0 is given later in the file (a DNL marker): PIL's reading
                return height, width
            break
    try:
        with Image.open(io.BytesIO(view)) as img:
            width, height = img.size
    except Exception as exc:  # PIL raises OSError, ValueError, SyntaxError... depending on the codec
        raise unreadable(name, exc) from None
    return height, width


def to_rgb(img):
    """The one conversion of a PIL image to 8-bit RGB. 16-bit samples keep their high byte (v >> 8, as PIL
    itself reads 16-bit RGB PNGs), never clipped at 255; PIL's 32-bit mode I is read as 16-bit values (what a
    16-bit grayscale PNG or TIFF holds). Alpha (LA, RGBA, a palette's transparency) is dropped, not composited;
    grayscale is repeated in R, G and B; palettes and CMYK are PIL's conversions."""
    from PIL import Image

    if img.mode in ("I", "I;16", "I;16B", "I;16L", "I;16N"):
        return Image.fromarray((np.asarray(img).clip(0, 2**16 - 1) >> 8).astype(np.uint8)).convert("RGB")
    if img.mode == "P":  # through RGBA: PIL warns when a palette with transparency goes straight to RGB
        img = img.convert("RGBA")
    return img.convert("RGB")


def decode_cpu(data: torch.Tensor, name: str) -> torch.Tensor:
    """The one decoding of a file's bytes to uint8 RGB 3 x H x W, on every path (in-memory ImageFolder, DataLoader
    workers, the device decoder's fallback, `pack --max-side`): torchvision (JPEG incl. CMYK and grayscale, PNG,
    WEBP, GIF) or else PIL through `to_rgb` (BMP, TIFF, ...), by the same rules (16-bit: v >> 8; alpha dropped).
    A file neither reads is one ConfigError line naming it."""
    from PIL import Image
    from torchvision.io import ImageReadMode, decode_image
    from torchvision.transforms.v2.functional import to_dtype

    try:
        image = decode_image(data, mode=ImageReadMode.RGB)
        image = image[0] if image.dim() == 4 else image  # an animated GIF: its first frame, as PIL reads it
        return image if image.dtype == torch.uint8 else to_dtype(image, torch.uint8, scale=True)  # 16-bit: v >> 8
    except RuntimeError:
        pass  # a format torchvision does not read, or a damaged file: PIL reads more formats and says what is wrong
    try:
        with Image.open(io.BytesIO(data.numpy())) as img:
            rgb = np.asarray(to_rgb(img))
    except Exception as exc:  # PIL raises OSError, ValueError, SyntaxError... depending on the codec
        raise unreadable(name, exc) from None
    return torch.from_numpy(rgb.transpose(2, 0, 1).copy())  # numpy's copy: torch's uint8 permute copy is slower


def decode_file(path: str) -> torch.Tensor:
    """A file on disk through `decode_cpu`."""
    try:
        with open(path, "rb") as f:
            data = f.read()
    except OSError as exc:  # missing, a broken symlink, unreadable
        raise unreadable(path, exc) from None
    return decode_cpu(as_tensor(data), path)


def decode_batch(datas: list[torch.Tensor], device: torch.device, name: Callable[[int], str]) -> list:
    """Decode JPEGs (uint8 CPU tensors) to uint8 3 x H x W on `device`: one batched call (nvjpeg on CUDA). If it
    fails (a damaged file), each image alone on the CPU, so that the bad one is named: a ConfigError in its place
    (`name(k)` names image k)."""
    from torchvision.io import ImageReadMode, decode_jpeg

    if not datas:
        return []
    try:
        return decode_jpeg(datas, mode=ImageReadMode.RGB, device=device)
    except RuntimeError:
        out = []
        for k, data in enumerate(datas):
            try:
                out.append(decode_cpu(data, name(k)).to(device))
            except ConfigError as exc:
                out.append(exc)
        return out


def as_tensor(data) -> torch.Tensor:
    """Bytes (or a bytearray / memoryview) as a uint8 tensor, without a copy where the buffer is writable."""
    if isinstance(data, bytes):
        data = bytearray(data)
    return torch.frombuffer(data, dtype=torch.uint8) if len(data) else torch.empty(0, dtype=torch.uint8)


class EncodedImages(torch.utils.data.Dataset):
    """An on-disk split: each sample's encoded bytes, label and name; decoding is the loader's.
    Subclasses read rows of their storage (`_read`) and name them (`_name`); a subset is a view of the rows."""

    def __init__(self, labels: torch.Tensor):
        self.labels = labels
        self.rows = np.arange(len(labels))

    def __len__(self) -> int:
        return len(self.rows)

    def subset(self, idx) -> EncodedImages:
        view = copy.copy(self)
        view.rows, view.labels = self.rows[np.asarray(idx, dtype=np.int64)], self.labels[torch.as_tensor(idx)]
        return view

    def name(self, i: int) -> str:
        return self._name(int(self.rows[i]))

    def read(self, ids: Sequence[int]) -> list:
        """Encoded bytes of samples `ids`, in order; a sample that cannot be read is a ConfigError in its place."""
        return self._read(self.rows[np.asarray(ids, dtype=np.int64)])

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        """(uint8 3 x H x W decoded on the CPU, label): the plain Dataset protocol."""
        (data,) = self.read([i])
        if isinstance(data, ConfigError):
            raise data
        return decode_cpu(as_tensor(data), self.name(i)), int(self.labels[i])

    def _read(self, rows: np.ndarray) -> list:
        raise NotImplementedError

    def _name(self, row: int) -> str:
        raise NotImplementedError


class FileImages(EncodedImages):
    """One file per sample (an ImageFolder). Paths are one numpy bytes array, not a list of Python strings:
    forked DataLoader workers then share its pages instead of copying them as reference counts change."""

    def __init__(self, paths: list[str], labels: torch.Tensor):
        super().__init__(labels)
        self.paths = np.array([os.fsencode(p) for p in paths])

    def _name(self, row: int) -> str:
        return os.fsdecode(self.paths[row])

    def _read(self, rows: np.ndarray) -> list:
        out = []
        for row in rows.tolist():
            try:
                with open(self.paths[row], "rb", buffering=0) as f:
                    out.append(f.read())
            except OSError as exc:  # missing, a broken symlink, unreadable
                out.append(unreadable(self._name(row), exc))
        return out
