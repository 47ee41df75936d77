"""Experiment loggers of one job (global rank 0 only): TensorBoard, Weights & Biases, CSV.

`conf/logger/<name>.yaml` holds `<name>: {_target_: <class>, <options>}`, so several can be selected at once
(`logger=[tensorboard,wandb]`); `build_loggers` builds each as `<class>(run_dir=..., cfg=..., **options)`
and returns one `Logger` that calls them all. A new logger is one `Logger` subclass plus one YAML file.
"""

from __future__ import annotations

import csv
import re
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from hydra.utils import instantiate
from omegaconf import DictConfig, OmegaConf

from src.config.errors import ConfigError

# Final metrics shown in TensorBoard's HParams tab, logged as one-point scalars `z_final/<name>`: TensorBoard sorts
# the Scalars page's sections by name and opens the first two, so train/val/test come first.
FINAL_SECTION = "z_final"
METRICS = (
    "test_loss",
    "test_top1",
    "test_top5",
    "best_val_top1",
    "sec_per_epoch",
    "images_per_sec",
    "peak_mem_gb",
    "peak_host_mem_gb",
    "tflops_per_gpu",
    "mfu",
)


class Logger:
    """What the trainer calls. Every method does nothing here, which is what `logger=none` gets."""

    def log_metrics(self, metrics: dict, step: int) -> None:
        """Scalars under flat tags (`train/loss`, `val/top1`, `train/epoch_sec`, ...) at `step` (the epoch)."""

    def log_steps(self, metrics: dict, step: int) -> None:
        """At step 1, then every trainer.log_every_n_steps optimizer steps: `train_steps/loss`, `train_steps/lr`,
        ... at `step` (the global optimizer step, an axis of its own)."""

    def log_hparams(self, hparams: dict, final: dict) -> None:
        """Once, at the end: hyper-parameters (str/number/bool values) and final metrics (may hold None/NaN)."""

    def close(self) -> None:
        """Flush and release what the logger holds; nothing is logged after this."""


class Loggers(Logger):
    """Every selected logger, called in the order of `cfg.logger`."""

    def __init__(self, loggers):
        self.loggers = list(loggers)

    def log_metrics(self, metrics: dict, step: int) -> None:
        for logger in self.loggers:
            logger.log_metrics(metrics, step)

    def log_steps(self, metrics: dict, step: int) -> None:
        for logger in self.loggers:
            if hasattr(logger, "log_steps"):  # a logger of your own may keep to the epochs
                logger.log_steps(metrics, step)

    def log_hparams(self, hparams: dict, final: dict) -> None:
        for logger in self.loggers:
            logger.log_hparams(hparams, final)

    def close(self) -> None:
        loggers, self.loggers = self.loggers, []  # a second close (e.g. in a finally after the normal end) is a no-op
        for logger in loggers:
            logger.close()


def build_loggers(cfg: DictConfig, run_dir) -> Loggers:
    """The loggers selected in `cfg.logger` (a dict name -> options with `_target_`), writing into `run_dir`."""
    selected = cfg.get("logger") or {}
    # _partial_: run_dir and cfg reach the class as they are; instantiate(..., cfg=cfg) would merge a copy of the
    # whole config into the logger's node, where its interpolations (${paths.root_dir}, ...) no longer resolve
    return Loggers(
        instantiate(options, _partial_=True)(run_dir=Path(run_dir), cfg=cfg) for options in selected.values()
    )


def _hydra_job(run_dir: Path):
    """Hydra's config of the job that writes `run_dir` when this process runs its Hydra app, else None (ranks
    the elastic launcher started read Hydra's files instead)."""
    from hydra.core.hydra_config import HydraConfig

    hydra = HydraConfig.get() if HydraConfig.initialized() else None
    return hydra if hydra is not None and Path(hydra.runtime.output_dir).resolve() == run_dir.resolve() else None


def job_identity(run_dir: Path) -> tuple[str, str | None]:
    """(name, group) of the job: its Hydra override dirname, or the run dir's name when it has no overrides;
    in a multirun, the sweep directory's last two parts (`<date>/<time>`: the time alone repeats across days)."""
    hydra = _hydra_job(run_dir)
    if hydra is not None:
        name, multirun = hydra.job.override_dirname, hydra.mode.name == "MULTIRUN"
    else:
        overrides = run_dir / ".hydra" / "overrides.yaml"
        name = ",".join(sorted(OmegaConf.load(overrides))) if overrides.exists() else ""  # as Hydra joins them
        multirun = (run_dir.parent / "multirun.yaml").exists()
    return name or run_dir.name, ("/".join(run_dir.resolve().parts[-3:-1]) if multirun else None)


# Config keys that src/reporting/results.py's hparams() reports under another name; any other swept key is its
# own HParams column (`seed`, `model`, `strategy` are both)
HPARAM_OF_KEY = {
    "data.batch_size": "global_batch",
    "optim.lr": "lr",
    "trainer.amp": "amp",
    "trainer.amp_dtype": "amp_dtype",
    "trainer.accumulate_grad_batches": "accumulate_grad_batches",
    "trainer.max_epochs": "max_epochs",
    "trainer.compile": "compile",
    "trainer.channels_last": "channels_last",
    "data.num_workers": "num_workers",
    "strategy.sync_bn": "sync_bn",
    "strategy.gradient_sync": "gradient_sync",
}


@dataclass
class SweepPoint:
    """What sets a job apart from the other points of its sweep: `name` (`seed=2,data.batch_size=64`: the swept
    overrides in the command line's order), `values` (the HParams column of each swept key and this job's value)
    and `domains` (each column's values over the sweep, where the sweep lists them)."""

    name: str
    values: dict = field(default_factory=dict)
    domains: dict = field(default_factory=dict)


def sweep_point(run_dir: Path) -> SweepPoint:
    """The job's point in its sweep, from Hydra's overrides: the job's own and the sweep's (`multirun.yaml` holds
    them as typed: `seed=1,2`). A job outside a sweep, or of a sweep of one point, is named like job_identity."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    run_dir, parser = Path(run_dir), OverridesParser.create()
    sweep_file, swept = run_dir.parent / "multirun.yaml", {}
    sweep = OmegaConf.load(sweep_file) if sweep_file.exists() else OmegaConf.create()
    typed = list(OmegaConf.select(sweep, "hydra.overrides.task", default=None) or [])  # as the command line had them
    for override in parser.parse_overrides(typed):
        if override.is_sweep_override():
            try:  # choices and ranges list their values; an interval or a glob does not
                swept[override.key_or_group] = list(override.sweep_string_iterator())
            except HydraException:
                swept[override.key_or_group] = []
    hydra, own_file = _hydra_job(run_dir), run_dir / ".hydra" / "overrides.yaml"
    if hydra is not None:
        own = list(hydra.overrides.task)
    else:
        own = list(OmegaConf.load(own_file)) if own_file.exists() else []
    point = sorted(  # in the sweep's order, the command line's
        (o for o in parser.parse_overrides(own) if o.key_or_group in swept),
        key=lambda o: list(swept).index(o.key_or_group),
    )
    if not point:
        return SweepPoint(name=job_identity(run_dir)[0])
    return SweepPoint(
        name=",".join(o.input_line for o in point),
        values={HPARAM_OF_KEY.get(o.key_or_group, o.key_or_group): o.value() for o in point},
        domains={HPARAM_OF_KEY.get(key, key): values for key, values in swept.items()},
    )


# --- TensorBoard ----------------------------------------------------------------------------------


def open_writer(run_dir):
    """TensorBoard writer whose event files go into the run dir itself: TensorBoard names the run after the
    job's directory (its overrides in a sweep), not `<dir>/tb`."""
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=str(Path(run_dir)))


def _hparam_value(value):
    # TensorBoard prints every number with 5 significant digits (2 as 2.0000): integers go as text, like booleans
    # and everything else but floats
    return value if isinstance(value, float) else str(value)


def _summary(tag: str, data):
    """One hparams plugin summary (experiment, session start or session end) as an event file holds it."""
    from tensorboard.compat.proto.summary_pb2 import Summary
    from tensorboard.plugins.hparams import metadata

    return Summary(value=[Summary.Value(tag=tag, metadata=metadata.create_summary_metadata(data))])


def write_hparams(writer, hparams: dict, final_metrics: dict, step: int = 0, point: SweepPoint | None = None) -> None:
    """Write the HParams experiment, session start and session end into `writer`'s own event file, next to the
    training scalars, so each job is one TensorBoard run and one HParams session (`SummaryWriter.add_hparams`
    would open a sub-run `<logdir>/<timestamp>/`: every job twice, pytorch issues 32651, 37738). Each final
    metric of METRICS that is not None is also written as scalar `z_final/<name>` at `step`: the value the
    HParams tab shows for the session.

    The session is named after `point` (its Trial ID), and the hyper-parameters the sweep varies come first,
    with `status`: they are marked `differs`, which TensorBoard sorts first, and the tab ticks the first five."""
    from google.protobuf import struct_pb2
    from tensorboard.plugins.hparams import api_pb2, metadata, plugin_data_pb2

    point = point or SweepPoint(name="")
    values = {name: _hparam_value(v) for name, v in {**point.values, **hparams}.items()}
    first = [*point.values, *(["status"] if "status" in values else [])]
    start = plugin_data_pb2.SessionStartInfo(group_name=point.name)
    infos = []
    for name in dict.fromkeys([*first, *values]):
        value, domain = values[name], point.domains.get(name, [])
        info = api_pb2.HParamInfo(name=name, differs=name in first)
        if isinstance(value, float):
            start.hparams[name].number_value = value
            info.type = api_pb2.DATA_TYPE_FLOAT64
        else:
            start.hparams[name].string_value = value
            info.type = api_pb2.DATA_TYPE_STRING
            if value in domain:  # the tab's filter lists the sweep's values
                info.domain_discrete.values.extend(struct_pb2.Value(string_value=v) for v in domain)
        infos.append(info)
    metrics = {name: float(final_metrics[name]) for name in METRICS if final_metrics.get(name) is not None}
    experiment = api_pb2.Experiment(
        hparam_infos=infos,
        metric_infos=[
            api_pb2.MetricInfo(name=api_pb2.MetricName(tag=f"{FINAL_SECTION}/{name}"), display_name=name)
            for name in metrics
        ],
    )
    end = plugin_data_pb2.SessionEndInfo(status=api_pb2.STATUS_SUCCESS)
    # file_writer: the public FileWriter of the writer's event file (add_hparams writes its sub-run through it)
    for tag, data in (
        (metadata.EXPERIMENT_TAG, plugin_data_pb2.HParamsPluginData(experiment=experiment)),
        (metadata.SESSION_START_INFO_TAG, plugin_data_pb2.HParamsPluginData(session_start_info=start)),
        (metadata.SESSION_END_INFO_TAG, plugin_data_pb2.HParamsPluginData(session_end_info=end)),
    ):
        writer.file_writer.add_summary(_summary(tag, data), step)
    for name, value in metrics.items():
        writer.add_scalar(f"{FINAL_SECTION}/{name}", value, step)
    writer.flush()


class TensorBoardLogger(Logger):
    """Scalars and the HParams summary in the run dir (`make tensorboard`)."""

    def __init__(self, run_dir: Path, cfg: DictConfig | None = None):
        self.writer = open_writer(run_dir)
        self.point = sweep_point(run_dir)  # now: HydraConfig is this job's while it runs

    def log_metrics(self, metrics: dict, step: int) -> None:
        for tag, value in metrics.items():
            self.writer.add_scalar(tag, value, step)
        self.writer.flush()  # a running job's curves show up in TensorBoard epoch by epoch

    def log_steps(self, metrics: dict, step: int) -> None:
        for tag, value in metrics.items():
            self.writer.add_scalar(tag, value, step)

    def log_hparams(self, hparams: dict, final: dict) -> None:
        write_hparams(self.writer, hparams, final, point=self.point)

    def close(self) -> None:
        self.writer.close()


# --- CSV ------------------------------------------------------------------------------------------


class CSVLogger(Logger):
    """`<run_dir>/<filename>`: one row per step (the trainer's is the epoch), a `step` column, then one per tag.

    The file is rewritten and atomically replaced at each call, so it is a complete CSV after every epoch even
    when a late tag (test/ at the end) adds a column; calls with the same step fill the same row. Rows already
    in the file (a resumed run) are kept. Hyper-parameters and final metrics are in metrics.json, not here.
    """

    def __init__(self, run_dir: Path, cfg: DictConfig | None = None, filename: str = "metrics.csv"):
        if Path(filename).name != filename or filename in (".", ".."):  # the run's files stay in its dir
            raise ConfigError(f"logger.csv.filename must be a file name in the run dir, got {filename!r}")
        self.path = Path(run_dir) / filename
        self.steps = self.path.with_name(f"{self.path.stem}_steps.csv")
        self.resumed_steps = self.steps.exists()
        self.rows: dict[int, dict] = {}
        if self.path.exists():
            with open(self.path, newline="") as f:
                self.rows = {int(row["step"]): row for row in csv.DictReader(f)}

    def log_metrics(self, metrics: dict, step: int) -> None:
        self.rows.setdefault(step, {"step": step}).update(metrics)
        columns = list(dict.fromkeys(key for row in self.rows.values() for key in row))  # first seen, first
        self.path.parent.mkdir(parents=True, exist_ok=True)
        tmp = self.path.with_name(f".{self.path.name}.tmp")
        try:
            with open(tmp, "w", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=columns)
                writer.writeheader()
                writer.writerows(self.rows[s] for s in sorted(self.rows))
            tmp.replace(self.path)
        except OSError as exc:
            raise ConfigError(f"cannot write {self.path} ({exc.strerror}); make it writable or pick logger=") from None

    def log_steps(self, metrics: dict, step: int) -> None:
        """`<name>_steps.csv`, appended to (the per-epoch file is rewritten, which would not scale to every step).
        A resumed run first drops the rows logged after its checkpoint: the steps are logged again."""
        row = {"step": step, **{k.removeprefix("train_steps/"): v for k, v in metrics.items()}}
        try:
            if self.resumed_steps:
                self.resumed_steps = False
                with open(self.steps, newline="") as f:
                    kept = [r for r in csv.DictReader(f) if int(r["step"]) < step]
                with open(self.steps, "w", newline="") as f:
                    writer = csv.DictWriter(f, fieldnames=list(row))
                    writer.writeheader()
                    writer.writerows(kept)
            new = not self.steps.exists()
            with open(self.steps, "a", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=list(row))
                if new:
                    writer.writeheader()
                writer.writerow(row)
        except OSError as exc:
            raise ConfigError(f"cannot write {self.steps} ({exc.strerror}); make it writable or pick logger=") from None


# --- Weights & Biases -----------------------------------------------------------------------------


def run_id(run_dir: Path) -> str:
    """The W&B run id of this run dir: the one saved there, else a new one, saved first (a job killed while W&B
    starts continues the same run)."""
    path = run_dir / "wandb_id"
    if path.is_file():
        return path.read_text().strip()
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(uuid.uuid4().hex[:12] + "\n")
    tmp.replace(path)  # atomic: a reader sees no id or the whole one
    return path.read_text().strip()


class WandbLogger(Logger):
    """A W&B run in `<run_dir>/wandb/`, named by the job's overrides, grouped by sweep, its config the resolved
    config. mode=offline (default) needs no account and no network; `wandb sync <run_dir>/wandb/offline-run-*`
    uploads it later. Final metrics go to the run's summary as `final/<name>`, hyper-parameters to config.hparams.
    Its id is kept in `<run_dir>/wandb_id`: a resumed or requeued job continues the same W&B run (offline, each
    start is one more `offline-run-*` folder of that id; `wandb sync` appends them to it).
    """

    def __init__(
        self,
        run_dir: Path,
        cfg: DictConfig,
        project: str = "ddplab",
        entity: str | None = None,
        mode: Literal["offline", "online", "disabled"] = "offline",
        tags=(),
    ):
        import wandb  # here: only a job that selects it needs wandb installed

        if not re.fullmatch(r"[^/\\#?%:]{1,128}", project):  # W&B's own rule, as one line here
            raise ConfigError(
                f"logger.wandb.project={project!r} is not a W&B project name: at most 128 characters, "
                f"none of / \\ # ? % :"
            )

        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)  # wandb falls back to a temp dir when `dir` is missing
        name, group = job_identity(run_dir)
        self.run = wandb.init(
            id=run_id(run_dir),
            resume="allow",
            allow_val_change=True,  # a resume may change where it runs (devices, workers): the config follows
            dir=str(run_dir),
            project=project,
            entity=entity,
            mode=mode,
            name=name,
            group=group,
            tags=list(tags),
            config=OmegaConf.to_container(cfg, resolve=True),
            settings=wandb.Settings(silent=mode == "offline"),
        )  # nothing to link to offline
        # two x axes: epoch rows and every-N-steps rows; W&B's own step just counts the calls
        for prefix in ("train", "val", "test"):
            self.run.define_metric(f"{prefix}/*", step_metric="epoch")
        self.run.define_metric("train_steps/*", step_metric="global_step")

    def log_metrics(self, metrics: dict, step: int) -> None:
        self.run.log({**metrics, "epoch": step})

    def log_steps(self, metrics: dict, step: int) -> None:
        self.run.log({**metrics, "global_step": step})

    def log_hparams(self, hparams: dict, final: dict) -> None:
        # under config.hparams: names like `strategy` or `model` are already top-level groups of the config
        self.run.config.update({"hparams": dict(hparams)}, allow_val_change=True)
        self.run.summary.update({f"final/{k}": v for k, v in final.items() if v is not None})

    def close(self) -> None:
        self.run.finish()
