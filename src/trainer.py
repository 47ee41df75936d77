"""`train(cfg) -> metrics`: the training loop every strategy and launcher shares."""
from __future__ import annotations

import logging
import math
import signal
import time
from functools import partial
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

from src import checkpoint as ckpt
from src import results
from src.config import ConfigError, Layout, plan_layout
from src.datasets import load_data
from src.distributed import (RankEnv, all_reduce, destroy_process_group, init_process_group,
                             rank_env, reduce_max)
from src.evaluate import evaluate
from src.loaders import build_loader, eval_shard, plan_epoch
from src.models import build_model
from src.objective import build_loss_terms
from src.optim import build_optimizer
from src.strategies import Wrapped, full_state, load_full_state, replicas_agree, wrap
from src.tb import open_writer, write_hparams

log = logging.getLogger("ddplab")


def prepare_run(cfg: DictConfig) -> Run:
    """This rank's run: its layout validated, the process group joined (nothing built yet)."""
    env = rank_env()
    layout = plan_layout(cfg, env.world_size if env.external else None,
                         env.local_world_size if env.external else None)
    return Run(cfg, env, layout, init_process_group(env, layout.device_type))


def train(cfg: DictConfig) -> dict:
    """Train (or evaluate, with train=false) as configured; return the final metrics on every rank."""
    run = prepare_run(cfg)
    try:
        return run.execute()
    finally:
        run.close()
        destroy_process_group()


class _StopRequest:
    """SIGUSR2 (submitit/SLURM, before a time limit or preemption) or SIGTERM: checkpoint, then exit.

    Under torch's elastic launcher SIGTERM is left alone: the agent uses it to stop the surviving
    workers of a failed group before it restarts them (they resume from the last epoch's checkpoint).
    """

    def __init__(self, elastic: bool):
        self.signum, self.frame, self.previous = None, None, {}
        for sig in (signal.SIGUSR2,) if elastic else (signal.SIGUSR2, signal.SIGTERM):
            try:
                self.previous[sig] = signal.signal(sig, self._catch)
            except ValueError:  # not the main thread (e.g. a test runner thread): no handler
                pass

    def _catch(self, signum, frame):
        self.signum, self.frame = signum, frame

    def hand_over(self) -> None:
        """After our checkpoint: let the previous handler act (submitit requeues), else exit."""
        previous, self.previous = self.previous, {}   # exiting: nothing to restore
        for sig in previous:   # a late copy of the signal (srun delivers to each task in turn) must not act twice
            signal.signal(sig, signal.SIG_IGN)
        prev = previous.get(self.signum)
        if callable(prev):
            prev(self.signum, self.frame)
        raise SystemExit(128 + int(self.signum))

    def restore(self) -> None:
        for sig, prev in self.previous.items():
            signal.signal(sig, prev if prev is not None else signal.SIG_DFL)


class Run:
    def __init__(self, cfg: DictConfig, env: RankEnv, layout: Layout, device: torch.device):
        self.cfg, self.env, self.layout, self.device = cfg, env, layout, device
        self.t = cfg.trainer
        self.primary = env.is_primary
        self.run_dir = Path(cfg.paths.output_dir)
        self.ckpt_dir = self.run_dir / "checkpoints"
        amp_dtype = torch.bfloat16 if self.t.amp_dtype == "bf16" else torch.float16
        if self.t.amp and amp_dtype == torch.bfloat16 and device.type == "cuda" and \
                not torch.cuda.is_bf16_supported():
            amp_dtype = torch.float16
        self.amp_dtype = amp_dtype
        self.autocast = partial(torch.autocast, device.type, dtype=amp_dtype, enabled=self.t.amp)

    def close(self) -> None:
        if getattr(self, "loader", None) is not None:
            self.loader.close()

    # --- set-up ---------------------------------------------------------------------------------
    def _build(self) -> None:
        cfg, t = self.cfg, self.t
        torch.manual_seed(cfg.seed)
        if t.deterministic:
            torch.use_deterministic_algorithms(True, warn_only=True)
            torch.backends.cudnn.benchmark = False
        elif self.device.type == "cuda":
            # not for dp: cuDNN keeps its tuned plans per thread and DataParallel runs every step in new
            # threads, so it would re-tune all convolutions at each step (measured: 50x slower)
            torch.backends.cudnn.benchmark = cfg.strategy.name != "dp"
        self.data = load_data(cfg.data)
        if t.get("tta_shift", 0) >= min(self.data.image_size):
            raise ConfigError(f"trainer.tta_shift={t.tta_shift} must be smaller than the images "
                              f"({'x'.join(map(str, self.data.image_size))}); lower it or set 0")
        model = build_model(cfg.model, self.data.num_classes, self.data.channels).to(self.device)
        if t.channels_last and cfg.strategy.name != "fsdp":  # FSDP2 cannot shard non-contiguous weights;
            model = model.to(memory_format=torch.channels_last)  # its inputs stay channels_last
        self.wrapped: Wrapped = wrap(model, cfg.strategy, self.device, t.amp, self.amp_dtype,
                                     self.layout.devices_per_process, compile=t.compile, compile_mode=t.compile_mode)
        self.model = self.wrapped.model
        self.loss_terms = build_loss_terms(t.compile, t.compile_mode)
        self.rank_factor = self.layout.world_size if self.wrapped.averages_gradients else 1
        # CUDA graphs (compile_mode reduce-overhead) reuse their output memory: mark where a step begins
        self.cudagraphs = t.compile and t.compile_mode == "reduce-overhead"
        self.loader = build_loader(self.data, cfg.data, self.device, t.channels_last, cfg.seed, t.compile)
        fused = self.device.type == "cuda" and cfg.strategy.name != "fsdp"
        self.optimizer = build_optimizer(cfg.optim, self.wrapped.core, fused=fused)
        self._last_plan = None
        self.steps_per_epoch = len(self._plan(0))
        self.signal_check_every = 1 if self.device.type == "cpu" else 50  # steps between stop-signal checks
        self.scheduler = instantiate(cfg.scheduler)(self.optimizer, total_steps=self.steps_per_epoch * t.max_epochs,
                                                    steps_per_epoch=self.steps_per_epoch)
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=t.amp and self.amp_dtype == torch.float16)
        self.writer = None
        if self.primary:
            self.writer = open_writer(self.run_dir)

    def _plan(self, epoch: int):
        """The epoch's steps; the last plan is kept, as the next epoch's is made ahead for loader.prepare."""
        if self._last_plan and self._last_plan[0] == epoch:
            return self._last_plan[1]
        # with torch.compile a short last batch would trigger a recompile: drop it
        steps = plan_epoch(len(self.data.train), self.layout.global_batch, self.layout.world_size, self.env.rank,
                           self.layout.accumulate, self.cfg.seed, epoch, drop_last=self.t.compile)
        limit = self.t.limit_train_batches
        self._last_plan = (epoch, steps[:limit] if limit else steps)
        return self._last_plan[1]

    def _eval(self, split: str) -> dict:
        n = len(getattr(self.data, split))
        ids = eval_shard(n, self.layout.world_size, self.env.rank)
        limit = self.t.limit_eval_batches
        if limit:
            ids = ids[: limit * self.cfg.data.eval_batch_size]
        return evaluate(self.wrapped.eval_module(), self.loader.eval_batches(split, ids, self.cfg.data.eval_batch_size),
                        self.device, self.autocast, flip_tta=self.t.flip_tta,
                        tta_shift=self.t.get("tta_shift", 0))

    # --- checkpoints ------------------------------------------------------------------------------
    def _resume_path(self) -> Path | None:
        resume = self.t.resume
        last = self.ckpt_dir / "last.pt"
        if resume in (None, "none"):
            if last.exists():
                raise ConfigError(f"{self.run_dir} already holds a run (checkpoints/last.pt) and trainer.resume=none "
                                  f"would overwrite it; use trainer.resume=auto or a new run directory")
            return None
        if resume == "auto":
            return last if last.exists() else None
        return Path(resume)

    def _state(self, position: tuple[int, int], partial_totals: torch.Tensor | None) -> dict:
        model_state, optim_state = full_state(self.wrapped, self.optimizer)
        return {"model": model_state, "optimizer": optim_state, "scheduler": self.scheduler.state_dict(),
                "scaler": self.scaler.state_dict(), "epoch": position[0], "step": position[1],
                "partial_totals": None if partial_totals is None else partial_totals.cpu(),
                "best_val_top1": self.best_val_top1, "best_epoch": self.best_epoch, "history": self.history,
                "rng": ckpt.rng_state(), "world_size": self.layout.world_size,
                "strategy": self.cfg.strategy.name, "config": OmegaConf.to_container(self.cfg, resolve=True)}

    def _save(self, name: str, state: dict) -> None:
        if self.primary:
            ckpt.save_atomic(state, self.ckpt_dir / name)

    def _load_weights(self, path, with_optimizer: bool) -> dict:
        state = ckpt.load(path)
        ckpt.check_compatible(state, self.wrapped.core.state_dict(), path)
        load_full_state(self.wrapped, self.optimizer if with_optimizer else None, state["model"],
                        state["optimizer"] if with_optimizer else None)
        return state

    def _restore(self, path: Path) -> None:
        state = self._load_weights(path, with_optimizer=True)
        self.scheduler.load_state_dict(state["scheduler"])
        self.scaler.load_state_dict(state["scaler"])
        self.start = (state["epoch"], state["step"])
        self.resumed_totals = state["partial_totals"]
        self.best_val_top1, self.best_epoch = state["best_val_top1"], state["best_epoch"]
        self.history = state["history"]
        ckpt.set_rng_state(state["rng"])
        if self.primary:
            log.info("resumed from %s at epoch %d step %d", path, state["epoch"] + 1, state["step"])

    # --- the loop ---------------------------------------------------------------------------------
    def _train_epoch(self, epoch: int, stop: _StopRequest) -> dict | None:
        steps = self._plan(epoch)
        first_step = self.start[1] if epoch == self.start[0] else 0
        # loss sum, top-1 hits, samples: kept on the device (no host sync per step), reduced once per epoch
        totals = torch.zeros(3, dtype=torch.float64, device=self.device)
        if first_step and self.resumed_totals is not None and self.primary:  # the sum over ranks, counted once
            totals += self.resumed_totals.to(self.device)
        samples = 0
        self.model.train()
        bar = tqdm(total=len(steps), initial=first_step, desc=f"epoch {epoch + 1}/{self.t.max_epochs}",
                   leave=False, dynamic_ncols=True, disable=not (self.primary and self.t.progress_bar))
        wait, step_index = 0.0, first_step
        if torch.distributed.is_initialized():  # start the clocks together (rank 0 may still be saving a checkpoint)
            torch.distributed.barrier()
        start = time.perf_counter()
        batches = self.loader.train_batches(steps[first_step:], epoch)
        while True:
            t0 = time.perf_counter()
            micro = next(batches, None)
            wait += time.perf_counter() - t0
            if micro is None:
                break
            if self.cudagraphs:
                torch.compiler.cudagraph_mark_step_begin()
            with self.wrapped.sync_context(micro.boundary), self.autocast():
                # sum / (samples of the whole step), x world where the strategy averages over ranks:
                # every strategy and accumulation gets the gradient of the mean loss over the global batch
                loss, metrics = self.loss_terms(self.model(micro.x), micro.y, self.rank_factor / micro.global_count,
                                                self.t.label_smoothing)
            self.scaler.scale(loss).backward()
            totals[:2] += metrics
            samples += len(micro.y)
            if not micro.boundary:
                continue
            self.wrapped.sync_gradients()
            self._optimizer_step()
            step_index += 1
            bar.update(1)
            if self._stop_requested(stop, step_index):
                totals[2] += samples
                all_reduce(totals)  # the checkpoint (rank 0's) holds every rank's partial sums
                self._save("last.pt", self._state((epoch, step_index), totals))
                if self.primary:
                    log.warning("signal %s: saved checkpoints/last.pt at epoch %d step %d; exiting",
                                stop.signum, epoch + 1, step_index)
                stop.hand_over()
        bar.close()
        if epoch + 1 < self.t.max_epochs:  # while the device still runs this epoch's last steps
            self.loader.prepare(self._plan(epoch + 1), epoch + 1)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        seconds = reduce_max(time.perf_counter() - start, self.device)
        wait_fraction = all_reduce(torch.tensor([wait], dtype=torch.float64, device=self.device)).item() / self.layout.world_size
        totals[2] += samples
        loss_sum, hits, count = all_reduce(totals).tolist()
        done = sum(s.global_count for s in steps[first_step:])
        return {"train_loss": loss_sum / max(count, 1), "train_top1": 100 * hits / max(count, 1),
                "epoch_sec": seconds, "images_per_sec": done / max(seconds, 1e-9),
                "data_wait_fraction": wait_fraction / max(seconds, 1e-9), "lr": self.scheduler.get_last_lr()[0]}

    def _stop_requested(self, stop: _StopRequest, step_index: int) -> bool:
        """Has any rank caught a stop signal? Ranks agree through an all-reduce every few steps only,
        because it waits for the device; a single process just reads its flag."""
        if self.layout.world_size == 1:
            return stop.signum is not None
        if step_index % self.signal_check_every:
            return False
        # agree on the signal itself: a rank may act on one that only another rank has caught so far
        # (rank 0 must still hand it to submitit, which requeues from global rank 0 only)
        signum = int(reduce_max(float(stop.signum or 0), self.device))
        if signum and stop.signum is None:
            stop.signum = signum
        return signum > 0

    def _optimizer_step(self) -> None:
        if self.t.grad_clip:
            self.scaler.unscale_(self.optimizer)
            torch.nn.utils.clip_grad_norm_(self.wrapped.core.parameters(), self.t.grad_clip)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()

    def _log_epoch(self, row: dict) -> None:
        evaluated = "".join(f" | {split} loss {row[f'{split}_loss']:.4f} top-1 {row[f'{split}_top1']:.2f}%"
                            for split in ("val", "test") if f"{split}_loss" in row)  # the splits this epoch has
        log.info("epoch %d/%d  train loss %.4f acc %.2f%%%s | %.2f s, %.0f img/s", row["epoch"], self.t.max_epochs,
                 row["train_loss"], row["train_top1"], evaluated, row["epoch_sec"], row["images_per_sec"])
        for key, value in row.items():
            if key != "epoch":
                split, _, name = key.partition("_")
                self.writer.add_scalar(f"{split}/{name}" if split in ("train", "val", "test") else f"time/{key}",
                                       value, row["epoch"])
        self.writer.flush()

    def _fit(self) -> None:
        stop = _StopRequest(elastic=self.env.launcher == "torchelastic")
        try:
            for epoch in range(self.start[0], self.t.max_epochs):
                row = {"epoch": epoch + 1, **self._train_epoch(epoch, stop)}
                previous = self.history[-1]["train_sec_total"] if self.history else 0.0
                row["train_sec_total"] = previous + row["epoch_sec"]  # training time only, for time-to-accuracy
                if len(self.data.val):
                    val = self._eval("val")
                    row.update(val_loss=val["loss"], val_top1=val["top1"], val_top5=val["top5"])
                if self.t.test_every_epoch:  # a curve for time-to-accuracy; never used to pick weights
                    test = self._eval("test")
                    row.update(test_loss=test["loss"], test_top1=test["top1"], test_top5=test["top5"])
                self.history.append(row)
                # without a validation split the latest weights count as the best
                is_best = not len(self.data.val) or row["val_top1"] > self.best_val_top1
                if is_best:
                    self.best_val_top1, self.best_epoch = row.get("val_top1", math.nan), epoch + 1
                state = self._state((epoch + 1, 0), None)
                if is_best:
                    self._save("best.pt", state)
                self._save("last.pt", state)
                if self.primary:
                    self._log_epoch(row)
        finally:
            stop.restore()

    def execute(self) -> dict:
        self._build()
        self.start, self.resumed_totals = (0, 0), None
        self.best_val_top1, self.best_epoch, self.history = -math.inf, 0, []
        l = self.layout
        if self.primary:
            log.info("strategy=%s world_size=%d device=%s | global batch %d = %d per device x %d devices x %d "
                     "accumulation | %d steps/epoch", l.strategy, l.world_size, self.device.type, l.global_batch,
                     l.per_device_batch, l.world_size * l.devices_per_process, l.accumulate, self.steps_per_epoch)
        if self.cfg.train:
            path = self._resume_path()
            if path is not None:
                self._restore(path)
            self._fit()
            # before the best weights (rank 0's copy) are loaded everywhere: did the replicas stay identical?
            self.wrapped.sync_buffers()
            in_sync = replicas_agree(self.wrapped.core, self.device)
            if torch.distributed.is_initialized():
                torch.distributed.barrier()
            best = self.ckpt_dir / "best.pt"
            weights = best if best.exists() else self.ckpt_dir / "last.pt"
            self._load_weights(weights, with_optimizer=False)
            status = "completed"
        else:
            if not self.cfg.ckpt_path:
                raise ConfigError("train=false needs ckpt_path=<checkpoint file> to evaluate")
            state = self._load_weights(self.cfg.ckpt_path, with_optimizer=False)
            self.history, self.best_epoch = state.get("history", []), state.get("best_epoch", 0)
            status = "evaluated"
            in_sync = replicas_agree(self.wrapped.core, self.device)
        val = self._eval("val") if len(self.data.val) else {"loss": math.nan, "top1": math.nan, "top5": math.nan}
        test = self._eval("test")
        final = {"test_loss": test["loss"], "test_top1": test["top1"], "test_top5": test["top5"],
                 "test_count": test["count"], "val_loss": val["loss"], "val_top1": val["top1"],
                 "val_top5": val["top5"], "best_val_top1": val["top1"], "best_epoch": self.best_epoch,
                 **results.summarize(self.history), **in_sync}
        if self.primary:
            self._report(final, status)
        return final

    def _report(self, final: dict, status: str) -> None:
        hparams = results.hparams(self.cfg, self.layout, self.loader.name)
        results.log_final(final)
        for key in ("test_loss", "test_top1", "test_top5"):
            self.writer.add_scalar(f"test/{key[5:]}", final[key], len(self.history))
        write_hparams(self.writer, hparams, final)
        self.writer.close()
        results.write_metrics(self.run_dir, self.cfg, status, final, self.history, hparams, self.device)
