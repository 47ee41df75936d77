"""Run by test_signals: a rank's whole run through the local launcher's entry point (`_worker`), then the stop
the launcher forwards (SIGTERM's carrier) sent to this process once the run has returned, as it can arrive
while the rank hands its result back. Prints `returned` after the run and `survived` after the signal."""

import os
import signal
import sys
from pathlib import Path

from omegaconf import OmegaConf

from src.run.launch import _worker
from src.state.signals import carrier
from tests.conftest import make_cfg

result = _worker(OmegaConf.to_container(make_cfg(Path(sys.argv[1])), resolve=True))
print("returned", sorted(result)[:3], flush=True)
os.kill(os.getpid(), carrier(signal.SIGTERM))
print("survived", flush=True)
