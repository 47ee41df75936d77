"""What a finished run reports: epoch summary, hyper-parameters, the final log line and metrics.json."""

from __future__ import annotations

import functools
import json
import logging
import math
import subprocess
from pathlib import Path

import torch
from omegaconf import DictConfig, OmegaConf

from src.config.errors import ConfigError
from src.config.layout import Layout
from src.data.loader_plan import CROP_ON_DEVICE_GPU_WAIT, DALI_INSTALL, MIN_CPU_WORKERS, MIN_CPU_WORKERS_OVER_DALI
from src.reporting.efficiency import host

log = logging.getLogger("ddplab")


def summarize(history: list[dict]) -> dict:
    """Seconds per epoch, images/s and data-wait fractions (the host's; the GPU's on CUDA), leaving out epoch 1
    (warm-up, compilation) when there are later epochs; and train_sec, every epoch's training time, epoch 1 included
    (the time to the final weights, for time-to-accuracy)."""
    rows = history[1:] if len(history) > 1 else history
    if not rows:
        return {}
    seconds = sum(r["epoch_sec"] for r in rows)
    out = {
        "train_sec": sum(r["epoch_sec"] for r in history),
        "sec_per_epoch": seconds / len(rows),
        "images_per_sec": sum(r["images_per_sec"] * r["epoch_sec"] for r in rows) / seconds,
        "data_wait_fraction": sum(r["data_wait_fraction"] for r in rows) / len(rows),
    }
    if all("gpu_data_wait_fraction" in r for r in rows):
        out["gpu_data_wait_fraction"] = sum(r["gpu_data_wait_fraction"] for r in rows) / len(rows)
    for key in ("tflops_per_gpu", "mfu"):  # rates: time-weighted like images/s
        if all(key in r for r in rows):
            out[key] = sum(r[key] * r["epoch_sec"] for r in rows) / seconds
    for key in ("peak_mem_gb", "peak_mem_reserved_gb", "peak_host_mem_gb"):  # peaks: over every epoch
        if any(key in r for r in history):
            out[key] = max(r.get(key, 0.0) for r in history)
    return out


def _choices(run_dir: Path) -> dict:
    """The config group options the run was composed from (`model: tiny_cnn`), as Hydra recorded them."""
    try:
        return dict(OmegaConf.load(run_dir / ".hydra" / "hydra.yaml").hydra.runtime.choices)
    except Exception:  # no .hydra/ (a config composed in Python): the class names stand in
        return {}


def hparams(cfg: DictConfig, layout: Layout, strategy, loader, run_dir: Path) -> dict:
    """The settings a comparison is about (TensorBoard HParams, metrics.json, the report)."""
    t, choices = cfg.trainer, _choices(run_dir)

    def chosen(group: str) -> str:
        return str(choices.get(group) or cfg[group].get("name") or cfg[group]._target_.rsplit(".", 1)[-1])

    return {
        **strategy.hparams(cfg),
        "world_size": layout.world_size * layout.devices_per_process,
        "processes": layout.world_size,
        "devices_per_process": layout.devices_per_process,
        "global_batch": layout.global_batch,
        "per_device_batch": layout.per_device_batch,
        "amp": t.amp,
        "amp_dtype": t.amp_dtype,
        "accumulate_grad_batches": layout.accumulate,
        "model": chosen("model"),
        "data": cfg.data.name,
        "optim": chosen("optim"),
        "scheduler": chosen("scheduler"),
        "max_epochs": t.max_epochs,
        "seed": cfg.seed,
        "lr": cfg.optim.lr,
        "loader": loader.plan.name,  # src/data/loader_plan.py: resident, workers, decode-cpu, decode-gpu, ...
        "num_workers": loader.plan.workers,  # data.num_workers as resolved (auto: from the CPUs)
        "gpu_share": loader.plan.gpu_share,  # data.decode=split's share of each batch decoded on the GPU, else 0
        "compile": t.compile,
        "channels_last": t.channels_last,
        "threads": torch.get_num_threads(),
        "ema_decay": t.ema.decay,  # not null: the evaluated figures are of the weights' moving average
    }


def efficiency_line(m: dict) -> str:
    """Memory and compute efficiency, as far as this device reports them (a CPU: its host memory only; its
    FLOP rate stays in metrics.json, where it is exact, not printed as a GPU figure)."""
    gpu = "peak_mem_gb" in m
    parts = [f"{m['tflops_per_gpu']:.2f} TFLOP/s/device"] if gpu and m.get("tflops_per_gpu") is not None else []
    if m.get("mfu") is not None:
        parts.append(f"MFU {100 * m['mfu']:.1f}%")
    if "peak_mem_gb" in m:
        parts.append(f"peak mem {m['peak_mem_gb']:.2f} GiB (reserved {m.get('peak_mem_reserved_gb', 0):.2f})")
    elif "peak_host_mem_gb" in m:
        parts.append(f"peak host mem {m['peak_host_mem_gb']:.2f} GiB")
    return ", ".join(parts)


def data_wait(m: dict) -> str:
    """ "27% (GPU 2%)": the host's wait for batches, and on CUDA how long the GPU went without a step's work."""
    host = f"{100 * m.get('data_wait_fraction', 0.0):.0f}%"
    return f"{host} (GPU {100 * m['gpu_data_wait_fraction']:.0f}%)" if "gpu_data_wait_fraction" in m else host


# When the GPU waits for data this long, the final line names a remedy. The thresholds are measured (ResNet-50 from
# the 256-px shards, bench/results/decode-default_4xh200_2026-11-28.md and resnet50-split-loop_2xh200_2026-11-27.md):
# with 4 CPU workers per GPU, decoding on the GPU fed 1.5x CPU decoding; CPU decoding was the faster from 8 on.
DATA_BOUND_GPU_WAIT = 0.2
# the loaders whose DataLoader workers make the batches (LoaderPlan.name in src/data/loader_plan.py)
WORKER_LOADERS = ("workers", "decode-cpu", "decode-cpu-crop-device", "decode-gpu", "decode-split", "decode-dali")
RECIPE = "docs/data.md: 'Recipe: an ImageNet-style folder at GPU speed'"


def data_bound_advice(final: dict, loader: str, workers: int, from_disk: bool) -> str | None:
    """One line for a run whose GPU went without work, waiting for data, a fifth of the time or more (CPU-cropping
    workers: CROP_ON_DEVICE_GPU_WAIT; CUDA only: gpu_data_wait_fraction); None otherwise. What to change depends on
    the loader and its CPU workers per process."""
    wait = final.get("gpu_data_wait_fraction")
    if wait is None or loader not in WORKER_LOADERS:
        return None  # the resident loader's wait is its augmentation kernels; a loader not named here: no advice
    cropping = loader == "decode-cpu" and workers >= MIN_CPU_WORKERS
    if wait < (CROP_ON_DEVICE_GPU_WAIT if cropping else DATA_BOUND_GPU_WAIT):
        return None
    only_decode = "data.crop=device (the workers only decode and cut the crops: ~1.3x the images per CPU)"
    more_cpus = "give each GPU more CPUs (data.num_workers; srun --cpus-per-task)"
    smaller = "pack the images re-encoded smaller if they are not (python -m src.data.shards pack --max-side 256)"
    if not from_disk:
        fix = "data.loader=resident keeps the data on the GPU and augments it there"
    elif workers == 0:
        fix = "data.num_workers=0 decodes in the training process; data.num_workers=auto starts a worker per CPU"
    elif loader == "decode-split" and workers >= MIN_CPU_WORKERS:
        fix = f"with {workers} CPU workers per process, data.decode=cpu may be faster (it was from 8 workers on)"
    elif loader == "decode-split":
        fix = more_cpus
    elif loader == "decode-gpu":
        dali = "data.decode=dali (NVIDIA DALI: 1.25x at 4 CPUs per GPU)"
        on_cpu = f"from {MIN_CPU_WORKERS} CPU workers per GPU, data.decode=auto decodes on the CPU"
        fix = f"{more_cpus}: {on_cpu}; or {dali}; and {smaller}"
    elif loader == "decode-dali":
        fix = f"DALI's {workers} threads per process do not keep up: {more_cpus}, or {smaller}"
    elif workers < MIN_CPU_WORKERS:
        fix = (
            f"only {workers} CPU workers per process decode: try data.decode=dali (NVIDIA DALI: 1.25x GPU decoding "
            f"at 4 CPUs) or data.decode=gpu (1.5x CPU decoding at 4), or {more_cpus}"
        )
    elif loader == "decode-cpu" and wait < DATA_BOUND_GPU_WAIT:  # lighter work per image was enough on each host
        fix = f"its {workers} CPU workers per process nearly keep up: try {only_decode}"
    else:
        also = f", or {only_decode}" if loader == "decode-cpu" else ""
        if loader.startswith("decode-cpu") and workers < MIN_CPU_WORKERS_OVER_DALI:  # auto's choice, were DALI here
            also += f", or data.decode=dali (1.44x CPU decoding with 7 workers per GPU; {DALI_INSTALL})"
        fix = f"its {workers} CPU workers per process do not keep up: {more_cpus}, or {smaller}{also}"
    return f"the GPU waited for data {100 * wait:.0f}% of the time: {fix}; see the {RECIPE}"


def log_final(final: dict, replicated: bool) -> None:
    """The run's final line; `replicated`: several processes hold the model, so say whether they agree."""
    in_sync = (
        f" | params in sync: {final['params_in_sync']}, BN buffers in sync: {final['bn_buffers_in_sync']}"
        if replicated
        else ""
    )
    log.info(
        "test loss %.4f | top-1 %.2f%% | top-5 %.2f%% (%d images, best epoch %d) | %.1f s of training, %.2f "
        "s/epoch, %.0f img/s, data wait %s%s",
        final["test_loss"],
        final["test_top1"],
        final["test_top5"],
        final["test_count"],
        final["best_epoch"],
        final.get("train_sec", math.nan),
        final.get("sec_per_epoch", math.nan),
        final.get("images_per_sec", math.nan),
        data_wait(final),
        in_sync,
    )
    if "peak_mem_gb" in final:
        log.info("efficiency: %s", efficiency_line(final))


def git_state(repo: Path) -> dict:
    """The commit checked out in `repo`, and whether its tracked files differ from it (then the commit alone does
    not give back the code that ran). Nones outside a git checkout or without git."""

    def git(*args: str) -> str | None:
        try:
            done = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10, cwd=repo)
        except (OSError, subprocess.SubprocessError):
            return None
        return done.stdout.strip() if done.returncode == 0 else None

    commit = git("rev-parse", "HEAD") or None
    # without --no-optional-locks, git status rewrites the checkout's .git/index: a file the run did not create
    changes = git("--no-optional-locks", "status", "--porcelain", "--untracked-files=no") if commit else None
    return {"git_commit": commit, "git_dirty": None if changes is None else bool(changes)}


@functools.cache
def _code_state() -> dict:
    """ddplab's git_state, read once per process: the code a run imported at its start."""
    return git_state(Path(__file__).parent)


def _finite(obj):
    """NaN (e.g. no validation split) becomes null: metrics.json stays strict JSON."""
    if isinstance(obj, float) and math.isnan(obj):
        return None
    if isinstance(obj, dict):
        return {k: _finite(v) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_finite(v) for v in obj]
    return obj


def write_metrics(
    run_dir: Path,
    cfg: DictConfig,
    status: str,
    final: dict,
    history: list[dict],
    hparams: dict,
    device: torch.device,
    name: str = "metrics.json",
    stop_reason: str | None = None,
) -> None:
    """metrics.json (eval.json for an evaluation), replaced atomically so a reader never sees half of it."""
    overrides_file = run_dir / ".hydra" / "overrides.yaml"
    overrides = OmegaConf.to_container(OmegaConf.load(overrides_file)) if overrides_file.exists() else []
    metrics = {
        "status": status,
        "stop_reason": stop_reason,  # why a completed run trained fewer than trainer.max_epochs (early stopping)
        "final": final,
        "epochs": history,
        "hparams": hparams,
        "overrides": overrides,
        "config": OmegaConf.to_container(cfg, resolve=True),
        **host(device),
        **_code_state(),
    }
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / f".{name}.tmp"
    tmp.write_text(json.dumps(_finite(metrics), indent=2, default=str))
    tmp.replace(run_dir / name)


class Reporter:
    """Rank 0's reporting: the epoch log line, the configured loggers, the final line and metrics.json."""

    summarize = staticmethod(summarize)

    def __init__(self, cfg: DictConfig, run_dir: Path, layout: Layout, strategy, loader, device: torch.device):
        from src.reporting.loggers import Logger, build_loggers

        self.cfg, self.run_dir, self.device = cfg, run_dir, device
        self.hparams = hparams(cfg, layout, strategy, loader, run_dir)
        self.loader = loader  # its plan may change in the run (data.crop=auto): the final figures name the last
        result = run_dir / ("metrics.json" if cfg.train else "eval.json")
        if result.exists() and not result.is_file():  # found now, not after training, when the result would be lost
            raise ConfigError(f"{result} is in the way (not a file); remove it or use another run directory")
        predictions = run_dir / "predictions"
        if cfg.get("predict") and predictions.exists() and not predictions.is_dir():
            raise ConfigError(f"{predictions} is in the way (not a folder); remove it or use another run directory")
        try:  # an evaluation writes eval.json only: no logger files beside the training run's
            self.loggers = build_loggers(cfg, run_dir) if cfg.train else Logger()
        except OSError as exc:
            raise ConfigError(
                f"cannot open the loggers' files in {run_dir} ({exc.strerror}: {exc.filename}); remove what is in "
                f"the way or use another run directory"
            ) from None

    def epoch(self, row: dict) -> None:
        t = self.cfg.trainer
        evaluated = "".join(
            f" | {split} loss {row[f'{split}_loss']:.4f} top-1 {row[f'{split}_top1']:.2f}%"
            for split in ("val", "test")
            if f"{split}_loss" in row
        )  # the splits this epoch has
        precision = f"amp {t.amp_dtype}" if t.amp else "fp32"
        log.info(
            "epoch %d/%d  train loss %.4f acc %.2f%%%s | %.2f s, %.0f img/s, data wait %s, %s | %s",
            row["epoch"],
            t.max_epochs,
            row["train_loss"],
            row["train_top1"],
            evaluated,
            row["epoch_sec"],
            row["images_per_sec"],
            data_wait(row),
            precision,
            efficiency_line(row),
        )
        # tags by split; the epoch's time, rates and memory are the training loop's: `train/epoch_sec`, so that
        # TensorBoard's Scalars page (sections sorted by name, the first two open) starts with test, train, val
        scalars = {}
        for key, value in row.items():
            split, _, name = key.partition("_")
            if key == "epoch":
                continue
            scalars[f"{split}/{name}" if split in ("train", "val", "test") else f"train/{key}"] = value
        self.loggers.log_metrics(scalars, step=row["epoch"])

    def step(self, row: dict, global_step: int) -> None:
        """At step 1, then every trainer.log_every_n_steps optimizer steps: loss, lr, grad norm, images/s as
        `train_steps/<name>`."""
        self.loggers.log_steps({f"train_steps/{k}": v for k, v in row.items()}, global_step)

    def final(self, final: dict, status: str, history: list[dict], stop_reason: str | None = None) -> None:
        if status == "evaluated":  # the checkpoint's training figures are not this run's: evaluation only
            log.info(
                "evaluated %s: test loss %.4f | top-1 %.2f%% | top-5 %.2f%% (%d images) | val top-1 %.2f%%",
                self.cfg.ckpt_path,
                final["test_loss"],
                final["test_top1"],
                final["test_top5"],
                final["test_count"],
                final["val_top1"],
            )
            write_metrics(self.run_dir, self.cfg, status, final, [], self.hparams, self.device, name="eval.json")
            log.info("outputs: %s (eval.json)", self.run_dir)
            return
        log_final(final, self.hparams["processes"] > 1)
        plan = self.loader.plan
        self.hparams["loader"] = plan.name
        advice = data_bound_advice(final, plan.name, plan.workers, plan.from_disk)
        if advice:
            log.warning(advice)
        self.loggers.log_metrics(
            {f"test/{k[5:]}": final[k] for k in ("test_loss", "test_top1", "test_top5")}, step=len(history)
        )
        self.loggers.log_hparams({**self.hparams, "status": status}, final)
        write_metrics(
            self.run_dir, self.cfg, status, final, history, self.hparams, self.device, stop_reason=stop_reason
        )
        log.info("outputs: %s (metrics.json, checkpoints/, logs)", self.run_dir)

    def failed(self, status: str, history: list[dict]) -> None:
        """A run that stopped without final metrics (e.g. diverged): metrics.json says so."""
        write_metrics(self.run_dir, self.cfg, status, {}, history, self.hparams, self.device)
        self.loggers.log_hparams({**self.hparams, "status": status}, {})  # recognisable in the HParams tab

    def close(self) -> None:
        self.loggers.close()
