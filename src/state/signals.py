"""Stop signals: the ranks agree that one arrived, save a mid-epoch checkpoint, then exit.

Who catches what (Ctrl-C, SIGTERM and SIGUSR2 all mean "checkpoint and stop"):
- a single process and srun/submitit ranks: all three (StopRequest);
- ranks under torch's elastic agent (ours or torchrun): SIGUSR2 and SIGINT (Ctrl-C reaches the whole foreground
  process group), never SIGTERM: the agent sends it to stop the survivors of a failed group at once;
- the local launcher (src/run/launch.py `spawn`): all three, forwarded to its workers as their carriers (ForwardStops);
  its workers run in their own process groups, so one sent to the launcher's group reaches them only so;
- DataLoader workers: none; they leave all three to their training process (data_workers_started).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import multiprocessing.resource_tracker
import os
import signal
import threading
from collections.abc import Iterator

import torch

from src.distributed import reduce_max

STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGUSR2)


RTMIN = getattr(signal, "SIGRTMIN", None)  # no real-time signals (macOS): every stop is forwarded as SIGUSR2


def carrier(signum: int) -> int:
    """The real-time signal the local launcher forwards stop signal `signum` as: a plain SIGTERM to a worker
    must stay the agent's way to stop it at once."""
    return RTMIN + int(signum) if RTMIN else signal.SIGUSR2


def _origin(signum: int) -> int:
    return signum - RTMIN if RTMIN and signum >= RTMIN else signum


ELASTIC_SIGNALS = (signal.SIGINT, signal.SIGUSR2, *map(carrier, STOP_SIGNALS))


class Interrupted(BaseException):  # like KeyboardInterrupt: no `except Exception` on the way may swallow it
    """A stop signal outside the training steps (setup, final evaluation): nothing new to checkpoint, stop now."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _interrupt(signum, frame) -> None:
    raise Interrupted(_origin(signum))


@contextlib.contextmanager
def interrupt_outside_training(signals=STOP_SIGNALS, ignore_after: bool = False):
    """Stop signals raise Interrupted within this block, except where StopRequest catches them (the training
    steps). Blocked signals are unblocked: a worker of the local launcher starts with them blocked, so that one
    sent while it was starting waited for this handler instead of killing it. ignore_after: they are ignored
    once the block is left, also when it ends normally (a rank whose run is over, still handing back its result)."""
    try:
        previous = {sig: signal.signal(sig, _interrupt) for sig in signals}
    except ValueError:  # not the main thread: signals stay as they are
        yield
        return
    stopping = False
    try:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, signals)  # a pending one raises here
        yield
    except (Interrupted, SystemExit):
        stopping = True
        raise
    finally:
        _reset(previous, stopping or ignore_after)


def _reset(previous: dict, stopping: bool) -> None:
    """Put the handlers back; while stopping, ignore the signals instead: a late copy (a Ctrl-C reaches a rank
    directly and forwarded) must not act twice."""
    for sig, prev in previous.items():
        signal.signal(sig, signal.SIG_IGN if stopping else prev if prev is not None else signal.SIG_DFL)


class StopRequest:
    """SIGUSR2 (submitit/SLURM, before a time limit or preemption), SIGTERM and Ctrl-C: checkpoint, then exit.

    Under torch's elastic launcher SIGTERM is left alone (the agent stops workers with it before a restart;
    they resume from the last epoch's checkpoint); the local launcher forwards a SIGTERM as its carrier.
    """

    def __init__(self, elastic: bool):
        self.signum, self.frame, self.previous = None, None, {}
        for sig in ELASTIC_SIGNALS if elastic else STOP_SIGNALS:
            try:
                self.previous[sig] = signal.signal(sig, self._catch)
            except ValueError:  # not the main thread (e.g. a test runner thread): no handler
                pass

    def _catch(self, signum, frame):
        if self.signum is None:  # the first one counts: Ctrl-C reaches a rank both directly and forwarded
            self.signum, self.frame = _origin(signum), frame

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
        previous, self.previous = self.previous, {}  # exiting: nothing to restore
        for sig in previous:  # a late copy of the signal (srun delivers to each task in turn) must not act twice
            signal.signal(sig, signal.SIG_IGN)
        prev = previous.get(self.signum)
        if callable(prev) and prev not in (signal.default_int_handler, _interrupt):  # Ctrl-C: no KeyboardInterrupt
            prev(self.signum, self.frame)
        raise SystemExit(128 + int(self.signum))

    def restore(self) -> None:
        _reset(self.previous, stopping=False)


class ForwardStops:
    """In the local launcher, around the elastic agent: Ctrl-C, SIGTERM or SIGUSR2 to the process the user started
    is forwarded to every worker (also to those started later) as its carrier; `signum` is the one that came."""

    def __init__(self):
        self.signum: int | None = None
        self._previous, self._mask, self._thread, self._done = {}, None, None, threading.Event()

    def __enter__(self) -> ForwardStops:
        try:
            self._previous = {sig: signal.signal(sig, self._catch) for sig in STOP_SIGNALS}
        except ValueError:  # not the main thread: signals stay as they are
            return self
        # workers inherit the signal mask of the thread that starts them, this one: a stop that comes before their
        # handlers exist then waits (interrupt_outside_training) instead of killing them. The forwarding thread
        # receives ours meanwhile. (Started later, multiprocessing's resource tracker would unblock SIGINT.)
        multiprocessing.resource_tracker.ensure_running()
        self._mask = signal.pthread_sigmask(signal.SIG_BLOCK, ELASTIC_SIGNALS)
        self._thread = threading.Thread(target=self._forward, name="ddplab-stop-forwarder", daemon=True)
        self._thread.start()
        return self

    def _catch(self, signum, frame) -> None:
        if self.signum is None:  # a repeat changes nothing: the workers are already saving
            self.signum = signum

    def _forward(self) -> None:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, ELASTIC_SIGNALS)
        sent: set[int] = set()
        while not self._done.wait(0.1):
            if self.signum is None:
                continue
            for worker in multiprocessing.active_children():  # the agent's workers: our only children here
                if worker.pid not in sent:
                    sent.add(worker.pid)
                    try:
                        os.kill(worker.pid, carrier(self.signum))
                    except ProcessLookupError:
                        pass

    def __exit__(self, exc_type, *exc) -> None:
        if self._thread is not None:
            self._done.set()
            self._thread.join()
            signal.pthread_sigmask(signal.SIG_SETMASK, self._mask)
        _reset(self._previous, stopping=exc_type is not None or self.signum is not None)


# Stop signals (Ctrl-C, SIGTERM, SIGUSR2) are the training process's: it checkpoints, then stops its workers.
# Sent to a whole process group or SLURM step they would kill a DataLoader worker first (torch's workers die on a
# SIGTERM from anyone but their parent), and the run would end on "worker exited unexpectedly" without its
# checkpoint. So workers start with them blocked (data_workers_started) and one thread of theirs takes them
# (leave_stops_to_the_trainer, their worker_init_fn).
WAITS_FOR_SIGNALS = hasattr(signal, "sigwaitinfo")  # (not on macOS: signals act there as before)


def data_workers_started(loader: torch.utils.data.DataLoader) -> Iterator:
    """iter(loader), with stop signals blocked while it starts workers: they and all their threads inherit the
    mask (one that comes meanwhile waits, and reaches this process after). torch's SIGCHLD handler, set here
    once, is taken back: it raised a dead worker's error wherever this process happened to be (inside a logging
    call it is printed and swallowed). The next fetch finds a dead worker instead (within 5 s), and raises there."""
    main = threading.current_thread() is threading.main_thread() and hasattr(signal, "SIGCHLD")
    child = signal.getsignal(signal.SIGCHLD) if main else None
    before = signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS) if WAITS_FOR_SIGNALS else None
    try:
        return iter(loader)
    finally:
        if before is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, before)
        if child is not None:
            signal.signal(signal.SIGCHLD, child)


def leave_stops_to_the_trainer(_worker_id: int) -> None:
    """In each DataLoader worker (started by data_workers_started): its stop signals wait here. A SIGTERM from
    the training process (stopping a stuck worker) still ends it, as torch's own handler would."""
    if not WAITS_FOR_SIGNALS:
        return
    signal.pthread_sigmask(signal.SIG_BLOCK, STOP_SIGNALS)
    parent = os.getppid()

    def wait() -> None:
        while True:
            info = signal.sigwaitinfo(STOP_SIGNALS)
            if info.si_signo == signal.SIGTERM and info.si_pid == parent:
                os._exit(0)

    threading.Thread(target=wait, daemon=True, name="stop-signals").start()
