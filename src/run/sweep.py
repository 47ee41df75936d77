"""Sweeps (`-m`): a failing point is one line and the sweep goes on; the sweep ends with a summary of its failed
points and a non-zero exit; a sweep in which nothing ran leaves no directory behind. A sweep whose every point
has a bad option is one line before anything starts (nothing submitted to SLURM).

The failed point's line is also kept in `<its dir>/error.txt` (with the traceback of an unexpected error), which is
how the summary finds the points that ran in other processes (submitit). Submitit sweeps also echo rank 0's log
of every point while the submitting process waits. A run or sweep directory that cannot be made is one line.
"""

from __future__ import annotations

import contextlib
import shutil
import sys
import threading
import time
import traceback
from pathlib import Path

from hydra.core.hydra_config import HydraConfig
from hydra.core.utils import JobStatus
from hydra.experimental.callback import Callback
from hydra.types import RunMode
from omegaconf import DictConfig

from src.config.cli import LAUNCHER_PRESETS, preset_note
from src.config.commands import module_command
from src.config.errors import ConfigError

ERROR_FILE = "error.txt"
BOOKKEEPING = (".hydra", ".lock", ".lock.ranks", ERROR_FILE)  # with *.log: what is written before a run trains


def _one_line(exc: BaseException) -> str:
    from src.run.launch import RankFailed

    text = str(exc) if isinstance(exc, (ConfigError, RankFailed)) else f"{type(exc).__name__}: {exc}"
    return " ".join(text.split())


def _primary() -> bool:
    from src.distributed import env_rank

    return env_rank() == 0


def _make(path: Path, key: str, undo: bool = False) -> None:
    """Make the run or sweep directory, or say in one line why it cannot be (Hydra would, with a traceback).
    `undo`: remove what was made, so that a sweep refused later (src/run/cluster.py) leaves nothing behind."""
    missing = [p for p in (path, *path.parents) if not p.exists()]
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        print(f"error: cannot create {key}={path} ({exc.strerror}); set {key} to a writable folder", file=sys.stderr)
        sys.exit(2)
    for made in missing if undo else ():  # deepest first; another sweep may have made one its own meanwhile
        with contextlib.suppress(OSError):
            made.rmdir()


# what rank 0 of a run writes at the top of its run dir: a file of these names there that no run wrote is the
# user's (the other ranks' train_rank<N>.log are not among them: under torchrun they may be there already)
RUN_FILES = ("metrics.json", "train.log", "eval.json", "checkpoints", "predictions", ERROR_FILE)
RUN_FILE_PATTERNS = ("events.out.tfevents.*",)


def _refuse_foreign_files(run_dir: Path) -> None:
    """A run into a folder holding files of the names a run writes, that no run wrote (no Hydra record, run lock
    or metrics.json), or a metrics.json that is not a run's: one line before anything there is touched (Hydra
    appends to train.log; a run replaces metrics.json)."""
    from src.state.resume import run_metrics

    if not run_dir.is_dir():
        return
    metrics = run_dir / "metrics.json"
    foreign = None
    if metrics.exists() and run_metrics(run_dir) is None:
        foreign = metrics
    elif not any((run_dir / mark).exists() for mark in (".hydra", ".lock", "metrics.json")):  # a run's record
        found = [run_dir / name for name in RUN_FILES if (run_dir / name).exists()]
        found += [path for pattern in RUN_FILE_PATTERNS for path in sorted(run_dir.glob(pattern))]
        foreign = found[0] if found else None
    if foreign is not None:
        print(
            f"error: hydra.run.dir={run_dir} holds {foreign.name}, which no ddplab run wrote there; "
            f"use a new or empty folder",
            file=sys.stderr,
        )
        sys.exit(2)


MADE_HERE: list[Path] = []  # the folders this single run's invocation made (its run dir and missing parents)


def remove_refused_run_dir() -> None:
    """A single run refused before it trained leaves no directory: only if this invocation made it and it holds
    nothing but what Hydra and the run lock write first."""
    if not MADE_HERE or not _primary() or not _nothing_ran(MADE_HERE[0]):  # (ranks of torchrun run Hydra too)
        return
    shutil.rmtree(MADE_HERE[0], ignore_errors=True)
    for parent in MADE_HERE[1:]:  # e.g. outputs/runs/<date>, when this run was its first
        with contextlib.suppress(OSError):
            parent.rmdir()


class SweepReport(Callback):
    """Registered in conf/train.yaml; also checks that a single run's directory can be made."""

    def on_run_start(self, config: DictConfig, **kwargs) -> None:
        # the default dir lies under ${hydra:runtime.cwd}, which resolves once HydraConfig is set; Hydra sets it
        # again for the job. run_stamp is cached on this config, so the job gets the folder made here
        HydraConfig.instance().set_config(config)
        run_dir = Path(config.hydra.run.dir)
        MADE_HERE[:] = [p for p in (run_dir, *run_dir.parents) if not p.exists()]  # deepest first
        if _primary():  # before Hydra opens train.log there (other ranks: rank 0 may have written it meanwhile)
            _refuse_foreign_files(run_dir)
        _make(run_dir, "hydra.run.dir")

    def on_multirun_start(self, config: DictConfig, **kwargs) -> None:
        from src.run.cluster import refuse_unreachable_slurm

        refuse_unreachable_slurm(config)  # before any folder is made
        refuse_bad_points(config)
        for launcher, preset in LAUNCHER_PRESETS.items():  # the command line named the launcher (src/config/cli.py)
            if launcher in config.hydra.overrides.hydra and preset in config.hydra.overrides.task:
                print(preset_note(launcher), file=sys.stderr)
        self.made = not Path(config.hydra.sweep.dir).exists()  # only a folder this sweep made may be removed
        _make(Path(config.hydra.sweep.dir), "hydra.sweep.dir", undo=True)
        self.started = time.time() - 1  # error files written since then are this sweep's
        self.failed_here: dict[str, tuple[str, str]] = {}  # points run in this process that failed
        launcher = str(config.hydra.launcher.get("_target_", ""))
        self.echo = None if launcher.endswith("BasicLauncher") else _Echo(Path(config.hydra.sweep.dir))

    def __getstate__(self) -> dict:  # submitit pickles the callbacks into each job: the echo thread stays here
        return {k: v for k, v in self.__dict__.items() if k != "echo"}

    def on_job_end(self, config: DictConfig, job_return, **kwargs) -> None:
        if config.hydra.mode != RunMode.MULTIRUN:
            return
        job_dir = Path(config.hydra.runtime.output_dir)
        if job_return.status != JobStatus.FAILED:
            if _primary():
                (job_dir / ERROR_FILE).unlink(missing_ok=True)  # an earlier attempt's
            return
        exc = job_return._return_value
        line = _one_line(exc)
        print(f"error: {config.hydra.job.override_dirname}: {line}", file=sys.stderr, flush=True)
        details = "" if isinstance(exc, ConfigError) else "".join(traceback.format_exception(exc))
        # kept here too: another sweep into the same folder may replace or remove the file meanwhile
        self.failed_here[str(job_dir.resolve())] = (line, details)
        if _primary():
            (job_dir / ERROR_FILE).write_text(f"{line}\n{details}")
        # said; Hydra would otherwise re-raise it with a traceback once the batch is done, ending the sweep
        job_return.status, job_return.return_value = JobStatus.COMPLETED, None

    def on_multirun_end(self, config: DictConfig, **kwargs) -> None:
        if self.echo is not None:
            self.echo.stop()
        sweep_dir = Path(config.hydra.sweep.dir)
        with contextlib.suppress(OSError):
            (sweep_dir / ".submitit" / "%j").rmdir()  # submitit's empty staging folder
        found = {**_error_files(sweep_dir, self.started), **self.failed_here}
        failed = sorted((Path(job).relative_to(sweep_dir.resolve()), *said) for job, said in found.items())
        if not failed:
            table = module_command("src.reporting.report", sweep_dir)
            print(f"sweep: every point completed; outputs in {sweep_dir} (table: {table})")
            return
        print(f"sweep: {len(failed)} point(s) failed:", file=sys.stderr)
        for point, line, _ in failed:
            print(f"  {point}: {line}", file=sys.stderr)
        if self.made and _nothing_ran(sweep_dir):
            shutil.rmtree(sweep_dir)
            if sweep_dir.parent.parent.name == "multirun":  # the default multirun/<date>/<time>
                with contextlib.suppress(OSError):
                    sweep_dir.parent.rmdir()
            print(f"sweep: no point ran; removed {sweep_dir}", file=sys.stderr)
        else:
            print(f"sweep: outputs in {sweep_dir}", file=sys.stderr)
        sys.exit(2 if not any(details for *_, details in failed) else 1)  # 2: only bad inputs, as a single run


def refuse_bad_points(config: DictConfig) -> None:
    """A sweep whose every point is refused by the checks a run makes of its options (src/run/plan.py check_types)
    is one line before any point runs or any job is submitted, not a failure per point (a SLURM job each) later.
    Points are composed one by one until one passes: a sweep with some bad points runs the others, each bad one
    failing in its job with its line. Other sweepers (optuna) draw their points as they go: their fixed overrides
    are checked. Best effort: a point that cannot be composed here is left to check itself when it runs."""
    from hydra import compose
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    from src.run.plan import check_types

    task = list(config.hydra.overrides.task)
    try:
        if "BasicSweeper" in str(config.hydra.sweeper.get("_target_", "")):
            parsed = OverridesParser.create().parse_overrides(task)
            points = [point for batch in BasicSweeper.split_arguments(parsed, None) for point in batch]
        else:
            points = [task]
    except Exception:  # noqa: BLE001 - Hydra itself says what is wrong with the overrides
        return
    first = None
    for point in points:
        try:
            check_types(compose(config.hydra.job.config_name, overrides=point))
        except ConfigError as exc:
            first = first or (",".join(sorted(point, key=lambda o: o.split("=", 1)[0])), _one_line(exc))
            continue
        except Exception:  # noqa: BLE001 - composing outside the job is a convenience; the run checks itself
            pass
        return
    if first:
        where, line = first
        said = f"all {len(points)} points are refused; the first, {where}" if len(points) > 1 else where
        print(f"error: {said}: {line}; no point was started", file=sys.stderr)
        sys.exit(2)


def _error_files(sweep_dir: Path, since: float) -> dict[str, tuple[str, str]]:
    """The points that ran in other processes (submitit) and failed say so in their error file."""
    found = {}
    for path in sweep_dir.rglob(ERROR_FILE):
        with contextlib.suppress(OSError):  # another sweep into this folder may remove it meanwhile
            if ".submitit" not in path.parts and path.stat().st_mtime >= since:
                line, _, details = path.read_text().partition("\n")
                found[str(path.parent.resolve())] = (line, details)
    return found


def _nothing_ran(sweep_dir: Path) -> bool:
    """Does the sweep dir hold only what is written before any point trains?"""
    for path in sweep_dir.rglob("*"):
        parts = path.relative_to(sweep_dir).parts
        if path.is_dir() or parts[0] == ".submitit" or parts == ("multirun.yaml",):
            continue
        if not (path.suffix == ".log" or any(part in BOOKKEEPING for part in parts)):
            return False
    return True


class _Echo:
    """Prints the new lines of each point's rank-0 log (`<point>/train.log`) while submitit runs the points."""

    def __init__(self, sweep_dir: Path, every: float = 1.0):
        self.sweep_dir, self.every, self.seen = sweep_dir, every, {}
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, name="ddplab-sweep-echo", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.wait(self.every):
            self.poll()

    def poll(self) -> None:
        if not self.sweep_dir.is_dir():
            return
        for log in sorted(self.sweep_dir.rglob("train.log")):
            with contextlib.suppress(OSError), log.open("rb") as f:
                f.seek(self.seen.get(log, 0))
                chunk = f.read()
                complete = chunk[: chunk.rfind(b"\n") + 1]  # a line being written waits for the next poll
                self.seen[log] = self.seen.get(log, 0) + len(complete)
                point = log.parent.relative_to(self.sweep_dir)
                for line in complete.decode(errors="replace").splitlines():
                    print(f"[{point}] {line}", flush=True)

    def stop(self) -> None:
        self.done.set()
        self.thread.join()
        self.poll()
