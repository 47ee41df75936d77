"""`python -m src.run.export <checkpoint> <out>`: a checkpoint (full or sharded, any strategy's) as one file that
other tools read: `.pt` (a full ddplab checkpoint), `.safetensors` (the weights, the config as metadata) or `.onnx`
(the model's forward). The exported file is read back and must give the checkpoint's logits."""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import sys
from pathlib import Path

import torch
from omegaconf import OmegaConf

from src.config.arguments import positive
from src.config.errors import ConfigError
from src.models import build_model
from src.state.checkpoint import export as export_pt
from src.state.checkpoint import load_full

FORMATS = ("pt", "safetensors", "onnx")
KNOWN_SIDES = {"digits": 8, "cifar10": 32, "cifar100": 32}  # datasets whose images have one size


def model_io(state: dict) -> dict:
    """The model's class count and input shape: recorded in the checkpoint, or guessed for older ones."""
    return state.get("model_io") or _guessed_io(state)


def rebuilt(state: dict, io: dict) -> torch.nn.Module:
    """The checkpoint's model with its evaluated weights (the average, if any), on the CPU, built from its saved
    config and `io`."""
    try:
        arch = OmegaConf.create(state["config"]["model"])  # the architecture alone: the checkpoint has the weights
        model = build_model(arch, num_classes=io["num_classes"], in_channels=io["input_shape"][0], start=False)
        model.load_state_dict(state.get("ema") or state["model"])  # the evaluated weights: the average if any
    except (KeyError, RuntimeError) as exc:
        raise ConfigError(
            f"cannot rebuild the checkpoint's model from its config ({str(exc).splitlines()[0]})"
        ) from None
    return model.eval()


def _guessed_io(state: dict) -> dict:
    """For checkpoints that predate `model_io`: the class count from the last matrix, the channels from the first
    convolution (a full checkpoint keeps the model's order), the size from the data config."""
    matrices = [w for w in state.get("model", {}).values() if w.ndim >= 2]
    if not matrices or "config" not in state:
        raise ConfigError("the checkpoint holds no model config or weights to rebuild the model from")
    data = state["config"].get("data", {})
    channels = next((w.shape[1] for w in matrices if w.ndim == 4), matrices[0].shape[1])
    side = data.get("image_size") or KNOWN_SIDES.get(data.get("name"))
    return {"num_classes": matrices[-1].shape[0], "input_shape": data.get("shape") or [channels, side, side]}


def input_shape(state: dict, io: dict, side: int | None) -> tuple[int, ...]:
    channels, *size = io["input_shape"]
    if side:
        size = [side, side]
    if not all(size):
        name = state["config"].get("data", {}).get("name")
        raise ConfigError(f"the input size of data={name} is not in the checkpoint: pass --input-size H")
    return (1, channels, *size)


def export(path: Path, out: Path, fmt: str, side: int | None = None) -> float:
    """Write `out`, read it back and compare its logits with the checkpoint's on one input; returns the largest
    difference. A file whose logits differ is not left behind."""
    if fmt == "pt":
        export_pt(path, out)
        return 0.0
    state = load_full(path)
    io = model_io(state)
    model = rebuilt(state, io)
    x = torch.rand(input_shape(state, io, side), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        expected = model(x)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.partial")
    try:
        if fmt == "safetensors":
            from safetensors.torch import load_file, save_file

            weights = {k: v.contiguous() for k, v in model.state_dict().items()}
            save_file(weights, str(tmp), {"config": json.dumps(state["config"])})
            with torch.no_grad():
                got = rebuilt({**state, "model": load_file(str(tmp)), "ema": None}, io)(x)
        else:
            got = _onnx(model, x, tmp)
        diff = (got - expected).abs().max().item()
        if not diff <= 1e-4 * expected.abs().max().item() + 1e-5:
            raise ConfigError(f"{out} read back gives other logits than the checkpoint (max difference {diff:.2e})")
        tmp.replace(out)
    finally:
        tmp.unlink(missing_ok=True)
    return diff


def _onnx(model: torch.nn.Module, x: torch.Tensor, out: Path) -> torch.Tensor:
    try:
        import onnxruntime
    except ImportError:
        raise ConfigError(
            "--format onnx needs onnx, onnxscript and onnxruntime: pip install onnx onnxscript onnxruntime"
        ) from None
    batch = torch.export.Dim("batch")
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):  # progress lines
        torch.onnx.export(
            model,
            (x,),
            str(out),
            input_names=["images"],
            output_names=["logits"],
            dynamic_shapes=({0: batch},),
            dynamo=True,
        )
    session = onnxruntime.InferenceSession(str(out), providers=["CPUExecutionProvider"])
    return torch.from_numpy(session.run(None, {"images": x.numpy()})[0])


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="python -m src.run.export", description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", help="a checkpoint file, or a sharded checkpoint folder (fsdp)")
    parser.add_argument("out", help="the file to write (.pt, .safetensors or .onnx)")
    parser.add_argument("--format", choices=FORMATS, help="default: from the out file's suffix")
    parser.add_argument(
        "--input-size", type=positive, help="the input's side in pixels, where the checkpoint does not tell"
    )
    args = parser.parse_args(argv)
    out = Path(args.out)
    fmt = args.format or out.suffix.lstrip(".")
    try:
        if fmt not in FORMATS:
            raise ConfigError(f"cannot tell the format of {out}: name it .pt, .safetensors or .onnx, or pass --format")
        if out.is_dir():
            raise ConfigError(f"{out} is a folder: name the file to write")
        diff = export(Path(args.checkpoint), out, fmt, args.input_size)
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:  # a folder that cannot be made or written
        print(f"error: cannot write {out} ({exc.strerror}); pick a writable place", file=sys.stderr)
        return 2
    checked = "" if fmt == "pt" else f" (read back: logits within {diff:.1e} of the checkpoint's)"
    print(f"wrote {out}{checked}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
