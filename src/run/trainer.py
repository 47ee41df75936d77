"""`train(cfg) -> metrics`: the training loop every strategy and launcher shares."""

from __future__ import annotations

import contextlib
import logging
import math
import os
from functools import partial
from pathlib import Path

import torch
from hydra.utils import instantiate
from omegaconf import DictConfig
from tqdm import tqdm

from src.config.commands import train_command
from src.config.errors import ConfigError
from src.data.augment import AugmentOptions
from src.data.datasets import load_data, options_of
from src.data.decode import EncodedImages
from src.data.epoch import eval_shard, plan_epoch
from src.data.loader_plan import CROP_ON_DEVICE_GPU_WAIT
from src.data.loaders import build_loader
from src.distributed import RankEnv, destroy_process_group, init_process_group, rank_env, reduce_max
from src.models import build_model, head_names, new_head_line, refuse_fit_from_disk
from src.reporting.efficiency import memory_stats, out_of_memory_line, peak_flops, reset_peak, train_step_flops
from src.reporting.results import Reporter
from src.run.between_runs import after_run, graphs_for, process_settings_restored
from src.run.evaluate import evaluate
from src.run.loss import build_loss_terms
from src.run.meter import CropProbe, EpochMeter, StepLog
from src.run.optim import build_optimizer
from src.run.plan import RunPlan, plan_layout
from src.run.predict import gather_in_rank_order, predict, write
from src.state.run_state import Checkpoints, Monitor, Progress, progress_of
from src.state.signals import StopRequest
from src.strategies import Context, apply_activation_checkpointing
from src.strategies.ema import EMA

log = logging.getLogger("ddplab")


class Diverged(RuntimeError):
    """The training loss became NaN or infinite."""


class OutOfMemory(RuntimeError):
    """A training or evaluation step ran out of device memory; the message says what to change."""


class WorkerDied(RuntimeError):
    """A DataLoader worker process died (killed by a signal, often the host's out-of-memory killer)."""


FIT_IMAGES = 5000  # training images a model fits a layer to (model.fit_to_images)
STOPPED = {Diverged: "diverged", OutOfMemory: "out_of_memory", WorkerDied: "data_worker_died"}  # metrics' status


def prepare_run(cfg: DictConfig, plan: RunPlan | None = None) -> Trainer:
    """This rank's run: its plan (made here unless the launch hands it over), the process group joined (nothing
    built yet)."""
    env = rank_env()
    if plan is None:
        plan = plan_layout(cfg, env)
    # declared threads per process, so single vs ddp on a CPU compares the same cores
    threads = cfg.trainer.threads
    if threads == "auto":  # a cluster's per-task CPUs (OMP_NUM_THREADS, e.g. cluster.cpus_per_task) come first
        threads = int(os.environ.get("OMP_NUM_THREADS") or max(1, (os.cpu_count() or 1) // env.local_world_size))
    torch.set_num_threads(threads)
    return Trainer(cfg, env, plan, init_process_group(env, plan.layout.device_type))


def train(cfg: DictConfig, plan: RunPlan | None = None, keep_compiled: bool = False) -> dict:
    """Train (or evaluate, with train=false) as configured; return the final metrics on every rank. `plan`: the
    one src/run/launch.py made for this process, if any. `keep_compiled`: another run may follow in this process
    (a local multirun), which reuses this run's compiled graphs if its config differs only in the seed."""
    compiled_as = graphs_for(cfg)
    finished = False
    with process_settings_restored():
        run = prepare_run(cfg, plan)
        try:
            final = run.execute()
            if torch.distributed.is_initialized():
                torch.distributed.barrier()  # no rank frees the group while another still reduces over it
            finished = True
            return final
        finally:
            run.close()
            del run  # with the strategy's model gone, nothing holds the group: destroying it frees it now
            destroy_process_group()
            after_run(compiled_as, keep=finished and keep_compiled)


def cudnn_autotune(t, strategy) -> bool:
    """Whether cuDNN times each convolution's algorithms on first use (faster steps after a slower first epoch):
    trainer.cudnn_benchmark, unless deterministic (its pick may vary run to run) or the strategy cannot keep the
    tuned plans (dp)."""
    return t.cudnn_benchmark and not t.deterministic and strategy.cudnn_benchmark


class Trainer:
    def __init__(self, cfg: DictConfig, env: RankEnv, plan: RunPlan, device: torch.device):
        self.cfg, self.env, self.device = cfg, env, device
        self.layout, self.strategy = plan.layout, plan.strategy
        self.t = cfg.trainer
        self.primary = env.is_primary
        self.run_dir = Path(cfg.paths.output_dir)
        amp_dtype = torch.bfloat16 if self.t.amp_dtype == "bf16" else torch.float16
        if self.t.amp and amp_dtype == torch.bfloat16 and device.type == "cuda" and not torch.cuda.is_bf16_supported():
            amp_dtype = torch.float16
        self.amp_dtype = amp_dtype
        self.autocast = partial(torch.autocast, device.type, dtype=amp_dtype, enabled=self.t.amp)
        self.loader = self.reporter = self.stop_reason = None
        self.monitor = Monitor.of(cfg)

    def close(self) -> None:
        for part in (self.loader, self.reporter):
            if part is not None:
                part.close()
        self.strategy.release()

    def build(self) -> None:
        """Data, model, strategy, optimizer, schedule and checkpoints: everything the loop needs."""
        cfg, t = self.cfg, self.t
        torch.manual_seed(cfg.seed)
        if t.deterministic:  # the same bits run to run, and fp32 without TF32's 10-bit mantissa
            torch.use_deterministic_algorithms(True, warn_only=True)
            torch.backends.cudnn.allow_tf32 = torch.backends.cuda.matmul.allow_tf32 = False
        if self.device.type == "cuda":
            torch.backends.cudnn.benchmark = cudnn_autotune(t, self.strategy)
        self.data = load_data(cfg.data)
        if cfg.train and self.layout.global_batch > len(self.data.train):  # a step would use fewer images than said
            raise ConfigError(
                f"data.batch_size={self.layout.global_batch} is larger than the {len(self.data.train)} training "
                f"images; set at most {len(self.data.train)}"
            )
        if cfg.data.get("cutout", 0) >= min(self.data.image_size):  # it would blank every training image
            raise ConfigError(
                f"data.cutout={cfg.data.cutout} must be smaller than the images "
                f"({'x'.join(map(str, self.data.image_size))}); lower it or set 0"
            )
        if t.tta_shift >= min(self.data.image_size):
            raise ConfigError(
                f"trainer.tta_shift={t.tta_shift} must be smaller than the images "
                f"({'x'.join(map(str, self.data.image_size))}); lower it or set 0"
            )
        for key, value in (("early_stopping.patience", t.early_stopping.patience), ("save_top_k", t.save_top_k)):
            if value is not None and cfg.train and not len(self.data.val):  # it ranks epochs by a validation figure
                raise ConfigError(
                    f"trainer.{key}={value} ranks epochs by {self.monitor.metric}, but this data has no validation "
                    f"split; set data.val_fraction > 0 or trainer.{key}=null"
                )
        classes, channels = self.data.num_classes, self.data.channels
        model = build_model(cfg.model, classes, channels, start=cfg.train)  # an evaluation loads its checkpoint
        # the classifier head: re-initialized by init_from for another class count, outside pretrained_lr_scale
        started = t.init_from or cfg.optim.get("pretrained_lr_scale", 1.0) != 1
        self.head = head_names(cfg.model, model, classes, channels) if cfg.train and started else set()
        if cfg.train and hasattr(model, "fit_to_images") and not cfg.model.get("weights"):
            self.fit_to_data(model)
        model = model.to(self.device)
        self.flops_per_image = self._count_flops(model)
        if t.channels_last and self.strategy.channels_last_weights:  # else only the inputs are channels_last
            model = model.to(memory_format=torch.channels_last)
        if t.activation_checkpointing:  # before wrap: FSDP shards and compiles each checkpointed block whole
            apply_activation_checkpointing(model, self.strategy.blocks(model))
        self.model = self.strategy.wrap(
            model,
            Context(self.device, t.amp, self.amp_dtype, self.layout.devices_per_process, t.compile, t.compile_mode),
        )
        self.loss_terms = build_loss_terms(t.compile, t.compile_mode)
        # every strategy and accumulation gets the gradient of the mean loss over the global batch
        self.rank_factor = self.layout.world_size if self.strategy.averages_gradients else 1
        self.cudagraphs = t.compile and t.compile_mode == "reduce-overhead"
        self.loader = build_loader(
            self.data, cfg.data, self.device, t.channels_last, cfg.seed, t.compile, self.env.local_world_size
        )
        fused = self.device.type == "cuda"  # torch's fused optimizer kernels run on CUDA only
        optimizer = build_optimizer(
            cfg.optim, self.strategy.core, fused=fused and self.strategy.fused_optimizer, head=self.head
        )
        self.optimizer = self.strategy.prepare_optimizer(optimizer, fused)
        self._last_plan = None
        self.steps_per_epoch = len(self.plan(0))
        self.step_log = StepLog(t.log_every_n_steps, self.device)
        self.signal_check_every = 1 if self.device.type == "cpu" else 50  # steps between stop-signal agreements
        total_steps = self.steps_per_epoch * t.max_epochs
        self.scheduler = instantiate(cfg.scheduler)(
            self.optimizer, total_steps=total_steps, steps_per_epoch=self.steps_per_epoch
        )
        if cfg.train and t.ema.decay is not None:  # after wrap: under fsdp the average holds local shards
            e = t.ema
            self.strategy.ema = EMA(
                self.strategy.core, e.decay, e.every_n_steps, e.ramp_power, total_steps, e.copy_back
            )
        self.scaler = torch.amp.GradScaler(self.device.type, enabled=t.amp and self.amp_dtype == torch.float16)
        io = {"num_classes": self.data.num_classes, "input_shape": [self.data.channels, *self.data.image_size]}
        self.checkpoints = Checkpoints(
            self.run_dir,
            cfg,
            self.strategy,
            self.optimizer,
            self.scheduler,
            self.scaler,
            self.primary,
            io,
            background=self.device.type == "cuda",
        )
        self.progress = Progress()
        if self.primary:
            self.reporter = Reporter(cfg, self.run_dir, self.layout, self.strategy, self.loader, self.device)

    def fit_to_data(self, model: torch.nn.Module) -> None:
        """A layer fitted to the training images (airbench96's whitening), before any strategy copies the model:
        every rank fits it to the same images, so starts from the same weights. A resume or init_from loads over it."""
        if not self.data.in_memory:  # data.max_memory_gb: known once the images are counted
            refuse_fit_from_disk(self.cfg.model, self.cfg.data.name, self.data.augment == "random_resized_crop")
        model.fit_to_images(self.data.train_sample(FIT_IMAGES))

    def start_from(self, path: str) -> None:
        """trainer.init_from: a new run (epoch 0, this run's optimizer and schedule) from another run's weights,
        read by the strategy as any checkpoint of either format is."""
        state = self.strategy.load_checkpoint(path, head=self.head)
        if self.primary:
            new = state["new_head"]
            log.info(
                "trainer.init_from: the weights of %s (its epoch %s)%s",
                path,
                state["epoch"],
                f"; {new_head_line(', '.join(new), self.data.num_classes)}" if new else "",
            )

    def _count_flops(self, model: torch.nn.Module) -> float:
        """FLOPs of one training image (forward + backward), counted once on two images: linear in the batch."""
        x = torch.randn(2, self.data.channels, *self.data.image_size, device=self.device)
        try:  # the model's first forward: where a model built for other inputs fails
            return train_step_flops(model, x, torch.zeros(2, dtype=torch.long, device=self.device)) / 2
        except torch.OutOfMemoryError:
            raise
        except (RuntimeError, AssertionError, ValueError) as exc:
            m, shape = self.cfg.model, "x".join(map(str, x.shape[1:]))
            name = f"model={m.name}" if m.get("name") else f"model._target_={m._target_}"
            side = self.data.image_size[0]
            hint = "pick a model" if "img_size" not in m else f"set model.img_size={side} (ViTs)"
            if m.get("img_size") == side:  # the size fits, the patches do not
                hint = f"set a patch no larger than the image, e.g. +model.kwargs.patch_size={max(1, side // 2)}"
            raise ConfigError(
                f"{name} cannot take this data's {shape} images ({str(exc).strip().splitlines()[-1]}); {hint} "
                f"or choose a model for this input size"
            ) from None

    def efficiency(self, images_per_sec: float) -> dict:
        """Peak memory (max over ranks); on GPUs the achieved TFLOP/s and MFU per GPU (collective)."""
        out = {k: reduce_max(v, self.device) for k, v in memory_stats(self.device).items()}
        if self.device.type != "cuda":  # a CPU "device" is a share of the host's cores: no per-GPU rate to compare
            return out
        per_device = self.flops_per_image * images_per_sec / (self.layout.world_size * self.layout.devices_per_process)
        out["tflops_per_gpu"] = per_device / 1e12
        peak = peak_flops(torch.cuda.get_device_name(self.device), self.amp_dtype if self.t.amp else torch.float32)
        if peak:  # known GPUs only
            out["mfu"] = per_device / peak
        return out

    def plan(self, epoch: int):
        """The epoch's steps; the last plan is kept, as the next epoch's is made ahead for loader.prepare."""
        if self._last_plan and self._last_plan[0] == epoch:
            return self._last_plan[1]
        # with torch.compile a short last batch would trigger a recompile; mixing pairs need even micro-batches
        drop_last = self.t.compile or options_of(self.cfg.data, AugmentOptions).recipe.mixing is not None
        steps = plan_epoch(
            len(self.data.train),
            self.layout.global_batch,
            self.layout.world_size,
            self.env.rank,
            self.layout.accumulate,
            self.cfg.seed,
            epoch,
            drop_last=drop_last,
        )
        limit = self.t.limit_train_batches
        self._last_plan = (epoch, steps[:limit] if limit else steps)
        return self._last_plan[1]

    def eval_ids(self, split: str) -> torch.Tensor:
        """This rank's sample ids of an evaluation of `split`."""
        ids = eval_shard(len(getattr(self.data, split)), self.layout.world_size, self.env.rank)
        if self.t.limit_eval_batches:
            ids = ids[: self.t.limit_eval_batches * self.cfg.data.eval_batch_size]
        return ids

    def epoch_evals(self) -> list[str]:
        """The splits evaluated after each epoch: val, and test with trainer.test_every_epoch (a curve, never used
        to pick weights); a split with no samples is left out."""
        splits = ("val", "test") if self.t.test_every_epoch else ("val",)
        return [split for split in splits if len(getattr(self.data, split))]

    def evaluate(self, split: str) -> dict:
        """`split`'s figures, of the EMA weights while training keeps an average (trainer.ema)."""
        batches = self.loader.eval_batches(split, self.eval_ids(split), self.cfg.data.eval_batch_size)
        ema = self.strategy.ema
        try:
            with ema.swapped() if ema else contextlib.nullcontext():
                return evaluate(
                    self.strategy.eval_module(),
                    batches,
                    self.device,
                    self.autocast,
                    flip_tta=self.t.flip_tta,
                    tta_shift=self.t.tta_shift,
                )
        except torch.OutOfMemoryError as exc:
            raise OutOfMemory(self.out_of_memory(exc, training=False)) from None

    def out_of_memory(self, exc: torch.OutOfMemoryError, training: bool) -> str:
        lay, data = self.layout, self.cfg.data
        fixes = []
        if training:
            images = lay.per_device_batch
            if images > 1:  # more micro-steps of fewer images: the same global batch, so the same run
                per_step = lay.global_batch // (lay.world_size * lay.devices_per_process)
                more = [a for a in range(lay.accumulate + 1, per_step + 1) if per_step % a == 0]
                lower = f"lower data.batch_size (now {lay.global_batch})"
                fixes.append(f"{lower} or set trainer.accumulate_grad_batches={more[0]}" if more else lower)
            if not self.t.activation_checkpointing:
                fixes.append("set trainer.activation_checkpointing=true")
        else:
            images = max(1, data.eval_batch_size // lay.devices_per_process)
            if images > 1:
                fixes.append(f"lower data.eval_batch_size (now {data.eval_batch_size})")
        devices = lay.world_size * lay.devices_per_process
        if self.device.type == "cuda":
            devices = max(devices, torch.cuda.device_count())
        where = f"a{' training' if training else 'n evaluation'} step on rank {self.env.rank}"
        return out_of_memory_line(exc, where, self.device, images, fixes + self.strategy.memory_fixes(devices))

    # --- the loop ---------------------------------------------------------------------------------
    def train_epoch(self, epoch: int, stop: StopRequest) -> dict:
        steps = self.plan(epoch)
        p = self.progress
        first = p.step if epoch == p.epoch else 0
        probe = CropProbe(sum(len(s.micro) for s in steps[first:])) if self.loader.plan.crop_measured else None
        totals = p.partial_totals if first and self.primary else None
        meter = EpochMeter(self.device, self.layout.world_size, totals, probe)
        reset_peak(self.device)
        with tqdm(
            total=len(steps),
            initial=first,
            desc=f"epoch {epoch + 1}/{self.t.max_epochs}",
            leave=False,
            dynamic_ncols=True,
            disable=not (self.primary and self.t.progress_bar),
        ) as bar:  # closed on an error too: its line must not swallow the one-line error
            self.model.train()
            batches, step = self.loader.train_batches(steps[first:], epoch), first
            self.step_log.start(meter)
            while (micro := meter.next(batches)) is not None:
                if meter.probed:  # every rank at this micro-batch
                    self.settle_crops(probe.wait_fraction(self.device, self.layout.world_size))
                if self.cudagraphs:  # CUDA graphs reuse their output memory: mark where a step begins
                    torch.compiler.cudagraph_mark_step_begin()
                with self.strategy.sync_context(micro.boundary), self.autocast():
                    # sum / (samples of the whole step), x world where the strategy averages over ranks
                    loss, metrics = self.loss_terms(
                        self.model(micro.x),
                        micro.y,
                        self.rank_factor / micro.global_count,
                        self.t.label_smoothing,
                        *micro.mix,
                    )
                self.scaler.scale(loss).backward()
                meter.add(metrics, len(micro.y))
                if not micro.boundary:
                    continue
                self.strategy.sync_gradients()
                step += 1
                global_step, lr = epoch * self.steps_per_epoch + step, self.optimizer.param_groups[0]["lr"]
                logging = self.step_log.due(global_step)
                grad_norm = self.optimizer_step(norm=logging)
                if self.strategy.ema:
                    self.strategy.ema.update(global_step)
                if logging:  # every rank: the figures are reduced over them
                    row = {**self.step_log.read(grad_norm), "lr": lr, "epoch": epoch + step / len(steps)}
                    if self.primary:
                        self.reporter.step(row, global_step)
                bar.update(1)
                if step % 10 == 0 and bar.disable is False:  # the running loss, at a host sync every 10 steps
                    bar.set_postfix(loss=f"{meter.running_loss():.4f}")
                if stop.agreed(step, self.layout.world_size, self.device, self.signal_check_every):
                    self._save_mid_epoch(epoch, step, meter)
                    self._say_saved(stop, self.checkpoints.saved("last"), f"at epoch {epoch + 1} step {step}")
                    stop.hand_over()
                every = self.t.checkpoint_every_n_steps
                if every and (epoch * self.steps_per_epoch + step) % every == 0 and step < len(steps):
                    self._save_mid_epoch(epoch, step, meter)  # the epoch's end saves anyway
        if epoch + 1 < self.t.max_epochs:  # while the device still runs this epoch's last steps
            evals = [(split, self.eval_ids(split), self.cfg.data.eval_batch_size) for split in self.epoch_evals()]
            self.loader.prepare(self.plan(epoch + 1), epoch + 1, evals)
        row = meter.finish(sum(s.global_count for s in steps[first:]))
        return {**row, **self.efficiency(row["images_per_sec"]), "lr": self.scheduler.get_last_lr()[0]}

    def settle_crops(self, wait: float | None) -> None:
        """data.crop=auto: the CPU workers keep cropping, or hand the crops to this process where the GPU waited
        for them CROP_ON_DEVICE_GPU_WAIT of the time or more; `wait` None: the choice a resumed checkpoint made."""
        kept = wait is None
        on_device = self.progress.crop_on_device if kept else wait >= CROP_ON_DEVICE_GPU_WAIT
        self.loader.settle_crops(on_device)
        self.progress.crop_on_device = on_device
        if not self.primary:
            return
        where = "this process crops (the workers decode)" if on_device else "the CPU workers crop"
        if kept:
            log.info("data.crop=auto: %s, as measured before the resume", where)
        else:
            log.info(
                "data.crop=auto: the GPU waited %.1f%% of the time for batches the CPU workers cropped (%s %.0f%%): "
                "from here on %s; data.crop=workers or device fixes it",
                100 * wait,
                "at or over" if on_device else "under",
                100 * CROP_ON_DEVICE_GPU_WAIT,
                where,
            )

    def optimizer_step(self, norm: bool = False) -> torch.Tensor | None:
        """One optimizer step; with `norm` (or trainer.grad_clip), the gradients' global norm before clipping."""
        total = None
        if self.t.grad_clip or norm:  # a max norm of inf measures without changing a gradient
            self.scaler.unscale_(self.optimizer)
            total = self.strategy.clip_gradients(self.t.grad_clip or math.inf)
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.optimizer.zero_grad(set_to_none=True)
        self.scheduler.step()
        return total

    def _save_mid_epoch(self, epoch: int, step: int, meter: EpochMeter) -> None:
        """Collective: last.pt at this step of the epoch (a stop signal's, or every checkpoint_every_n_steps)."""
        self.progress.epoch, self.progress.step = epoch, step
        self.progress.partial_totals = meter.partial_totals()  # rank 0's checkpoint holds every rank's sums
        self.checkpoints.save(["last"], self.progress)

    def _say_saved(self, stop: StopRequest, saved: Path, where: str) -> None:
        if self.primary:
            log.warning(
                "signal %s: saved %s in %s %s; resume with: %s",
                stop.signum,
                saved.relative_to(self.run_dir),
                self.run_dir,
                where,
                train_command(("hydra.run.dir", self.run_dir)),
            )

    def fit(self) -> None:
        stop = StopRequest(elastic=self.env.launcher == "torchelastic")
        try:
            for epoch in range(self.progress.epoch, self.t.max_epochs):
                # here, not after the epoch: a run killed after its stopping epoch stops again when resumed
                self.stop_reason = self.monitor.stop_reason(self.progress.history)
                if self.stop_reason:
                    if self.primary:
                        log.info("%s", self.stop_reason)
                    break
                try:
                    row = {"epoch": epoch + 1, **self.train_epoch(epoch, stop)}
                except torch.OutOfMemoryError as exc:
                    raise OutOfMemory(self.out_of_memory(exc, training=True)) from None
                row["train_sec_total"] = self.progress.train_seconds + row["epoch_sec"]  # for time-to-accuracy
                for split in self.epoch_evals():
                    row.update({f"{split}_{k}": v for k, v in self.evaluate(split).items() if k != "count"})
                bad = [k for k in ("train_loss", "val_loss", "test_loss") if not math.isfinite(row.get(k, 0.0))]
                if bad:  # NaN/inf weights or logits: every later number would be meaningless
                    raise Diverged(
                        f"the {bad[0].replace('_', ' ')} is {row[bad[0]]} in epoch {epoch + 1}; lower "
                        f"optim.lr (or set trainer.grad_clip); checkpoints/ keeps the last finite epoch"
                    )
                names = ["best", "last"] if self.progress.record(row, self.monitor) else ["last"]
                if self.t.save_top_k:
                    top_k = [self.monitor.top_k_name(r) for r in self.monitor.ranked(self.progress.history)]
                    top_k = top_k[: self.t.save_top_k]
                    if self.monitor.top_k_name(row) in top_k:  # written with last (fsdp: hard links to its shards)
                        names.insert(0, self.monitor.top_k_name(row))
                self.checkpoints.save(names, self.progress)
                if self.t.save_top_k:
                    self.checkpoints.keep_only(top_k)
                stopping = stop.agreed(0, self.layout.world_size, self.device, 1)  # one came during the evaluation
                if self.primary:
                    self.reporter.epoch(row)
                if stopping:  # (one that comes from here on stops the next epoch's steps)
                    self._say_saved(stop, self.checkpoints.saved("last"), f"at the end of epoch {epoch + 1}")
                    stop.hand_over()
        except BaseException:
            self.checkpoints.wait(raising=False)  # the checkpoint in flight is complete; this error is the one to see
            raise
        else:
            self.checkpoints.wait()
        finally:
            stop.restore()

    @contextlib.contextmanager
    def stops_in_one_line(self):
        """A run that cannot go on (diverged, out of memory, a data worker died): metrics.json says why, the user
        gets the message as one line."""
        try:
            yield
        except RuntimeError as exc:
            if str(exc).startswith("DataLoader worker (pid"):  # torch's words, raised wherever this process was
                command = train_command(("hydra.run.dir", self.run_dir))
                resume = f", then resume with: {command}" if self.cfg.train else ""
                exc = WorkerDied(
                    f"{str(exc).splitlines()[0].rstrip('. ')}: a data loading worker died (often the host's "
                    f"out-of-memory killer); lower data.num_workers (now {self.loader.plan.workers}) "
                    f"or data.batch_size{resume}"
                )
            if type(exc) not in STOPPED:
                raise
            if self.primary and self.cfg.train:  # an evaluation (train=false) leaves the training run's file alone
                self.reporter.failed(STOPPED[type(exc)], self.progress.history)
            raise ConfigError(str(exc)) from None

    def execute(self) -> dict:
        self.build()
        lay = self.layout
        if self.primary and self.cfg.train:
            log.info(
                "strategy=%s world_size=%d device=%s | global batch %d = %d per device x %d devices x %d "
                "accumulation | %d steps/epoch",
                lay.strategy,
                lay.world_size,
                self.device.type,
                lay.global_batch,
                lay.per_device_batch,
                lay.world_size * lay.devices_per_process,
                lay.accumulate,
                self.steps_per_epoch,
            )
            if self.strategy.ema:
                e = self.t.ema
                log.info(
                    "trainer.ema: val/test figures, best.pt and the final figures are of the weights' moving "
                    "average (decay %g%s every %d steps%s)",
                    e.decay,
                    f" x (step / total)^{e.ramp_power:g}" if e.ramp_power else "",
                    e.every_n_steps,
                    "; a lookahead: the model continues from it" if e.copy_back else "",
                )
        if self.cfg.train:
            path = self.checkpoints.resume_path()
            if path is not None:
                self.progress = self.checkpoints.restore(path)
                if self.progress.crop_on_device is not None and self.loader.plan.crop_measured:
                    self.settle_crops(None)  # as measured before the resume
            elif self.t.init_from:
                self.start_from(self.t.init_from)
            with self.stops_in_one_line():
                self.fit()
            # before the best weights (rank 0's copy) are loaded everywhere: did the replicas stay identical?
            self.strategy.sync_buffers()
            in_sync = self.strategy.replicas_agree(self.device)
            if torch.distributed.is_initialized():
                torch.distributed.barrier()
            self.strategy.ema = None  # the final weights are the checkpoint's average itself, where it has one
            self.checkpoints.load_weights(self.checkpoints.final_weights(self.progress.best_epoch))
            status = "completed"
        else:
            if not self.cfg.ckpt_path:
                raise ConfigError("train=false needs ckpt_path=<checkpoint file> to evaluate")
            state = self.checkpoints.load_weights(self.cfg.ckpt_path)
            best_epoch = progress_of(state, Path(self.cfg.ckpt_path)).best_epoch
            self.progress = Progress(best_epoch=best_epoch)  # its training figures stay its own
            status = "evaluated"
            self.strategy.sync_buffers()
            in_sync = self.strategy.replicas_agree(self.device)
        with self.stops_in_one_line():
            val = self.evaluate("val") if len(self.data.val) else {"loss": math.nan, "top1": math.nan, "top5": math.nan}
            test = self.evaluate("test")
        final = {
            "test_loss": test["loss"],
            "test_top1": test["top1"],
            "test_top5": test["top5"],
            "test_count": test["count"],
            "val_loss": val["loss"],
            "val_top1": val["top1"],
            "val_top5": val["top5"],
            "best_val_top1": val["top1"],
            "best_epoch": self.progress.best_epoch,
            **Reporter.summarize(self.progress.history),
            **in_sync,
        }
        if self.cfg.get("predict"):
            with self.stops_in_one_line():
                final.update(self.predictions())
        if self.primary:
            self.reporter.final(final, status, self.progress.history, self.stop_reason)
        return final

    def predictions(self) -> dict:
        """predict=true: every evaluated sample's top-5 into <run dir>/predictions/ (rank 0), and each split's
        per-class top-1 for eval.json."""
        out = {}
        for split in ("val", "test"):
            data = getattr(self.data, split)
            if not len(data):
                continue
            ids = self.eval_ids(split)
            batches = self.loader.eval_batches(split, ids, self.cfg.data.eval_batch_size)
            module = self.strategy.eval_module()
            rows = gather_in_rank_order(predict(module, batches, ids, self.autocast, self.t.flip_tta, self.t.tta_shift))
            if self.primary:
                names = data.files.name if isinstance(data.files, EncodedImages) else None
                classes = list(self.data.classes)
                out[f"{split}_per_class_top1"] = write(self.run_dir / "predictions", split, rows, classes, names)
        if self.primary:
            log.info("predictions: %s", self.run_dir / "predictions")
        return out
