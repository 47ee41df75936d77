"""What a finished run reports: epoch summary, hyper-parameters, the final log line and metrics.json."""
from __future__ import annotations

import json
import logging
import math
import subprocess
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from src.config import Layout
from src.strategies import ddp_gradient_sync

log = logging.getLogger("ddplab")


def summarize(history: list[dict]) -> dict:
    """Seconds per epoch, images/s and data-wait fraction, leaving out epoch 1 (warm-up, compilation)
    when there are later epochs."""
    rows = history[1:] if len(history) > 1 else history
    if not rows:
        return {}
    seconds = sum(r["epoch_sec"] for r in rows)
    return {"sec_per_epoch": seconds / len(rows),
            "images_per_sec": sum(r["images_per_sec"] * r["epoch_sec"] for r in rows) / seconds,
            "data_wait_fraction": sum(r["data_wait_fraction"] for r in rows) / len(rows)}


def hparams(cfg: DictConfig, layout: Layout, loader: str) -> dict:
    """The settings a comparison is about (TensorBoard HParams, metrics.json, the report)."""
    target = cfg.model.get("_target_", "")
    t = cfg.trainer
    return {"strategy": layout.strategy, "world_size": layout.world_size * layout.devices_per_process,
            "global_batch": layout.global_batch, "per_device_batch": layout.per_device_batch, "amp": t.amp,
            "amp_dtype": t.amp_dtype, "sync_bn": bool(cfg.strategy.sync_bn),
            "gradient_sync": (ddp_gradient_sync(cfg.strategy, t.compile, t.compile_mode)
                              if layout.strategy == "ddp" else "none"),
            "accumulate_grad_batches": layout.accumulate, "model": cfg.model.get("name", target.rsplit(".", 1)[-1]),
            "data": cfg.data.name, "seed": cfg.seed, "lr": cfg.optim.lr, "loader": loader,
            "compile": t.compile, "channels_last": t.channels_last}


def log_final(final: dict) -> None:
    log.info("test loss %.4f | top-1 %.2f%% | top-5 %.2f%% (%d images, best epoch %d) | %.2f s/epoch, "
             "%.0f img/s, data wait %.0f%% | params in sync: %s, BN buffers in sync: %s",
             final["test_loss"], final["test_top1"], final["test_top5"], final["test_count"],
             final["best_epoch"], final.get("sec_per_epoch", math.nan), final.get("images_per_sec", math.nan),
             100 * final.get("data_wait_fraction", 0.0), final["params_in_sync"], final["bn_buffers_in_sync"])


def _git_commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, timeout=10,
                              cwd=Path(__file__).parent).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _finite(obj):
    """NaN (e.g. no validation split) becomes null: metrics.json stays strict JSON."""
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def write_metrics(run_dir: Path, cfg: DictConfig, status: str, final: dict, history: list[dict],
                  hparams: dict, device: torch.device) -> None:
    """metrics.json, replaced atomically so a reader never sees half of it."""
    overrides_file = run_dir / ".hydra" / "overrides.yaml"
    overrides = OmegaConf.to_container(OmegaConf.load(overrides_file)) if overrides_file.exists() else []
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    metrics = {"status": status, "final": final, "epochs": history, "hparams": hparams, "overrides": overrides,
               "config": OmegaConf.to_container(cfg, resolve=True), "torch_version": torch.__version__,
               "device_name": device_name, "git_commit": _git_commit()}
    tmp = run_dir / ".metrics.json.tmp"
    tmp.write_text(json.dumps(_finite(metrics), indent=2, default=str))
    tmp.replace(run_dir / "metrics.json")
    log.info("outputs: %s (metrics.json, checkpoints/, tb/)", run_dir)
