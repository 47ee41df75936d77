"""Hydra resolvers that name the run directory once for all ranks and keep a run's own records its own. They import
what they use when called: `import src` registers them, and a command line refused before Hydra needs no torch."""

from __future__ import annotations

import datetime
import os
from pathlib import Path


def _now_stamp() -> str:
    return datetime.datetime.now().strftime("%Y-%m-%d/%H-%M-%S.%f")


def run_stamp() -> str:
    """`<date>/<time with microseconds>`, the same on every rank of one job.

    Under torchrun every rank runs Hydra; the first rank to ask stores its stamp in the launcher's
    TCP store and all others read it back, also after an elastic restart (so resume finds the run).
    Under SLURM the job id names the run, stable across requeues.
    """
    env = os.environ
    if "SLURM_JOB_ID" in env and int(env.get("SLURM_NTASKS", "1")) > 1 and "SLURM_STEP_ID" in env:
        return f"slurm/{env.get('SLURM_ARRAY_JOB_ID', env['SLURM_JOB_ID'])}"
    if "TORCHELASTIC_RUN_ID" in env and "MASTER_ADDR" in env and int(env.get("WORLD_SIZE", "1")) > 1:
        import torch.distributed as dist

        store = dist.TCPStore(
            env["MASTER_ADDR"], int(env["MASTER_PORT"]), is_master=False, timeout=datetime.timedelta(seconds=120)
        )
        return store.compare_set("ddplab/run_stamp", "", _now_stamp()).decode()
    return _now_stamp()


NAME_BYTES = 200  # a folder name's budget: filesystems refuse names over 255 bytes


def job_subdir(name: str) -> str:
    """hydra.sweep.subdir: a sweep point's overrides as Hydra joins them, with each folder name over NAME_BYTES cut
    there and ended by a hash of the whole, so a point with many overrides still gets a folder of its own."""
    import hashlib

    parts = []
    for part in name.split("/"):
        raw = part.encode()
        if len(raw) > NAME_BYTES:
            part = raw[: NAME_BYTES - 13].decode(errors="ignore") + "-" + hashlib.sha256(raw).hexdigest()[:12]
        parts.append(part)
    return "/".join(parts)


def rank_log_suffix() -> str:
    from src.distributed import env_rank

    rank = env_rank()
    return "" if rank == 0 else f"_rank{rank}"


def _output_dir(root) -> Path | None:
    from omegaconf import OmegaConf

    try:
        out = OmegaConf.select(root, "hydra.runtime.output_dir", default=None)
    except Exception:  # not set yet (e.g. --cfg hydra): nothing to keep
        return None
    return Path(out) if out else None


_RECORDS: dict[tuple[Path | None, str], str | None] = {}  # (run dir, subdir) -> this process's answer


def record_subdir(value: str, *, _root_) -> str | None:
    """hydra.output_subdir: rank 0 writes `.hydra/` once; a resume, an evaluation or a re-run in the same run dir
    keeps the record of the run's own launch (its overrides name it in reports). Decided once per run dir in a
    process: Hydra reads the setting twice, and another sweep into the same folder may write the record between."""
    from src.distributed import env_rank

    out = _output_dir(_root_)
    if (out, value) not in _RECORDS:
        kept = env_rank() != 0 or (out is not None and (out / value / "config.yaml").exists())
        _RECORDS[out, value] = None if kept else value
    return _RECORDS[out, value]


def run_log(output_dir: str | None, name: str) -> str:
    """The job's log file; a completed run's dir is left as it is (its log stays the run's own). Where there is no
    job dir yet (a sweep's own config, resolved whole), there is no log file."""
    from src.state.resume import completed

    if output_dir is None or completed(Path(output_dir)):
        return os.devnull
    return f"{output_dir}/{name}{rank_log_suffix()}.log"


def register_resolvers() -> None:
    from omegaconf import OmegaConf

    for name, fn in (
        ("run_stamp", run_stamp),
        ("rank_log_suffix", rank_log_suffix),
        ("job_subdir", job_subdir),
    ):
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn, use_cache=True)
    for name, fn in (("record_subdir", record_subdir), ("run_log", run_log)):  # they look at the run dir each time
        if not OmegaConf.has_resolver(name):
            OmegaConf.register_new_resolver(name, fn, use_cache=False)
