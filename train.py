"""ddplab entry point: `python train.py [group=option ...] [key=value ...]` (see README.md)."""

import logging
import math
import signal
import sys

import hydra
from omegaconf import DictConfig

from src.config.errors import ConfigError


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    # imported here, not above: a command line refused before Hydra answers without importing torch
    from src.run.launch import RankFailed
    from src.run.launch import main as run
    from src.run.sweep import remove_refused_run_dir
    from src.state.signals import Interrupted

    try:
        metrics = run(cfg)
    except (ConfigError, RankFailed) as exc:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.get().mode.name == "MULTIRUN":
            raise  # this sweep point fails; src/run/sweep.py says so in one line and the sweep carries on
        _to_the_log_file(str(exc))
        print(f"error: {exc}", file=sys.stderr)
        if isinstance(exc, ConfigError):
            remove_refused_run_dir()
        sys.exit(2 if isinstance(exc, ConfigError) else 1)
    except (Interrupted, KeyboardInterrupt) as exc:  # during the training steps a stop checkpoints instead
        signum = getattr(exc, "signum", signal.SIGINT)
        print(
            f"stopped by {signal.Signals(signum).name} before or after the training steps: nothing new saved in "
            f"{cfg.paths.output_dir}",
            file=sys.stderr,
        )
        sys.exit(128 + signum)
    value = float(metrics.get(cfg.objective.metric, math.nan))  # what a sweeper optimizes: never a test figure
    if not math.isnan(value):
        return value
    if _sweeper_reads_objective():  # it records the point as failed, not as a number to compare: say why
        logging.getLogger("ddplab").warning("objective %s: this run has no validation split", cfg.objective.metric)
    return None


def _to_the_log_file(line: str) -> None:
    """The run's log file keeps the error too, where the run dir stays; the terminal shows it once, on stderr."""
    logger = logging.getLogger("ddplab")
    record = logger.makeRecord(logger.name, logging.ERROR, __file__, 0, "%s", (line,), None)
    for handler in logging.getLogger().handlers:
        if isinstance(handler, logging.FileHandler):
            handler.handle(record)


def _sweeper_reads_objective() -> bool:
    """A search (hparams_search=optuna) scores each point by main's return value; a run or a `-m` grid ignores it."""
    from hydra.core.hydra_config import HydraConfig

    hydra_cfg = HydraConfig.get()
    return hydra_cfg.mode.name == "MULTIRUN" and "BasicSweeper" not in str(hydra_cfg.sweeper.get("_target_", ""))


if __name__ == "__main__":
    from src.config.cli import problem, read_launcher

    sys.argv[1:] = read_launcher(sys.argv[1:])  # Hydra reads sys.argv
    if said := problem(sys.argv[1:]):  # before Hydra, whose own messages take several lines
        print(f"error: {said}", file=sys.stderr)
        sys.exit(2)
    main()
