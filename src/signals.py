"""Stop signals: the ranks agree that one arrived, save a mid-epoch checkpoint, then exit."""
from __future__ import annotations

import signal

import torch

from src.distributed import reduce_max


class StopRequest:
    """SIGUSR2 (submitit/SLURM, before a time limit or preemption), SIGTERM and Ctrl-C: checkpoint, then exit.

    Under torch's elastic launcher SIGTERM and SIGINT are left alone: the agent uses them to stop the
    surviving workers of a failed group before it restarts them (they resume from the last epoch's checkpoint).
    """

    def __init__(self, elastic: bool):
        self.signum, self.frame, self.previous = None, None, {}
        catch = (signal.SIGUSR2,) if elastic else (signal.SIGUSR2, signal.SIGTERM, signal.SIGINT)
        for sig in catch:
            try:
                self.previous[sig] = signal.signal(sig, self._catch)
            except ValueError:  # not the main thread (e.g. a test runner thread): no handler
                pass

    def _catch(self, signum, frame):
        self.signum, self.frame = signum, frame

    def agreed(self, step_index: int, world_size: int, device: torch.device, every: int) -> bool:
        """Has any rank caught a stop signal? Ranks agree through an all-reduce every `every` steps only,
        because it waits for the device; a single process just reads its flag."""
        if world_size == 1:
            return self.signum is not None
        if step_index % every:
            return False
        # agree on the signal itself: a rank may act on one that only another rank has caught so far
        # (rank 0 must still hand it to submitit, which requeues from global rank 0 only)
        signum = int(reduce_max(float(self.signum or 0), device))
        if signum and self.signum is None:
            self.signum = signum
        return signum > 0

    def hand_over(self) -> None:
        """After our checkpoint: let the previous handler act (submitit requeues), else exit 128 + signal."""
        previous, self.previous = self.previous, {}   # exiting: nothing to restore
        for sig in previous:   # a late copy of the signal (srun delivers to each task in turn) must not act twice
            signal.signal(sig, signal.SIG_IGN)
        prev = previous.get(self.signum)
        if callable(prev) and prev is not signal.default_int_handler:  # Ctrl-C: exit 130, no KeyboardInterrupt
            prev(self.signum, self.frame)
        raise SystemExit(128 + int(self.signum))

    def restore(self) -> None:
        for sig, prev in self.previous.items():
            signal.signal(sig, prev if prev is not None else signal.SIG_DFL)
