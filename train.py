"""ddplab entry point: `python train.py [group=option ...] [key=value ...]` (see README.md)."""
import logging
import sys

import hydra
from omegaconf import DictConfig

from src.config import ConfigError
from src.launch import main as run


@hydra.main(version_base="1.3", config_path="conf", config_name="train")
def main(cfg: DictConfig) -> float | None:
    try:
        metrics = run(cfg)
    except ConfigError as exc:
        from hydra.core.hydra_config import HydraConfig

        if HydraConfig.get().mode.name == "MULTIRUN":
            raise  # this sweep point fails; Hydra carries on with the others and reports it
        logging.getLogger("ddplab").error("%s", exc)
        print(f"error: {exc}", file=sys.stderr)
        sys.exit(2)
    return metrics.get("test_top1")  # what a Hydra sweeper optimizes


if __name__ == "__main__":
    main()
