"""Run by test_strategies under torchrun: one rank's run (the overrides after <dir>, e.g. strategy=ddp) through train()
with a plan its caller keeps (as src/run/launch.py does), then the names of the threads left in its process, written
to <dir>/threads_rank<N>.json."""

import json
import sys
from pathlib import Path

from src.distributed import env_rank, rank_env
from src.run.plan import plan_layout
from src.run.trainer import train
from tests.conftest import make_cfg

out = Path(sys.argv[1])
cfg = make_cfg(out, *sys.argv[2:])
plan = plan_layout(cfg, rank_env())
train(cfg, plan)
threads = sorted(task.read_text().strip() for task in Path("/proc/self/task").glob("*/comm"))
(out / f"threads_rank{env_rank()}.json").write_text(json.dumps(threads))
