"""Checkpoints: written atomically (temp file + rename), read with one-line errors.

Two formats, both under `<run dir>/checkpoints/`, both readable by every strategy on any number of ranks:
- full: `last.pt` / `best.pt`, one torch.save file written by rank 0 (model, optimizer and the rest);
- sharded: `last/` / `best/`, a torch.distributed.checkpoint (DCP) directory where each rank wrote its own
  shards (`.metadata`, `__<rank>_0.distcp`) and rank 0 the non-tensor state (`state.pt`: progress,
  scheduler, scaler, RNG, config). `python -m src.run.export <dir> <file.pt>` makes it a full one.
"""

from __future__ import annotations

import contextlib
import io
import os
import pickle
import random
import re
import shutil
import sys
import threading
import time
from pathlib import Path

import numpy as np
import torch

from src.config.errors import ConfigError


class _FileWriter:
    """Unbuffered writes that raise the OS error (ENOSPC, EFBIG, EIO) and remember it: torch.save turns a
    failed write into an opaque RuntimeError, so the real cause is kept here for the message."""

    def __init__(self, fd: int):
        self.fd, self.error = fd, None

    def write(self, data) -> int:
        view = memoryview(data).cast("B")
        try:
            while view:  # os.write may write part of the buffer; the next call reports why
                view = view[os.write(self.fd, view) :]
        except OSError as exc:
            self.error = self.error or exc
            raise
        return len(data)

    def flush(self) -> None:
        pass


FREE_SPACE = "free space or set hydra.run.dir elsewhere"


def save_atomic(state: dict, path: Path) -> None:
    """Write `state` to `path` so that readers see the old file or the new one, never half of one. On failure
    the temp file is removed; an OS error (full disk, read-only or missing directory) is a one-line ConfigError."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        with open(tmp, "wb") as f:  # written through the file descriptor only: nothing buffered in f
            writer = _FileWriter(f.fileno())
            try:
                torch.save(state, writer)
            except Exception as exc:  # torch's own message hides the OS error the writer kept
                raise (writer.error or exc) from None
            os.fsync(f.fileno())  # the data is on disk before the rename makes it the checkpoint
        os.replace(tmp, path)
    except BaseException as exc:
        with contextlib.suppress(OSError):  # e.g. ENOTDIR: there was no temp file to remove
            tmp.unlink()
        if isinstance(exc, OSError):
            raise ConfigError(f"cannot write checkpoint {path}: {exc.strerror or exc}; {FREE_SPACE}") from exc
        raise  # not the disk's fault (e.g. an unpicklable object): a bug to see in full


def remove_partial_writes(directory: Path) -> None:
    """What a save killed midway left in a run's checkpoint folder: `.<name>.pt.tmp<pid>` files, `.<name>.tmp/`."""
    for tmp in Path(directory).glob(".*.tmp*"):
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            tmp.unlink(missing_ok=True)


STATE = "state.pt"  # in a sharded checkpoint: everything but the model and optimizer tensors


# Files a user hands us are data: every checkpoint part is read without unpickling arbitrary objects (SECURITY.md)
def _refused(path: Path, what: str) -> ConfigError:
    return ConfigError(
        f"checkpoint {path} is refused: it asks to load {what}, which no ddplab checkpoint holds "
        f"(loading it could run code); pass a checkpoint train.py wrote"
    )


def _old_numpy_rng() -> list:
    """What checkpoints of earlier versions hold beside tensors: numpy's RNG state as a numpy array (plain data)."""
    return [np.zeros(1).__reduce__()[0], np.ndarray, np.dtype, type(np.dtype(np.uint32))]


def safe_torch_load(path: Path, what) -> object:
    """torch.load(weights_only=True): tensors, numbers, strings and containers only; anything else is refused.
    A file that torch.save did not write (neither its zip archive nor a legacy pickle) is said to be so, rather
    than in the words of whatever torch's reader tripped on."""
    if isinstance(what, (str, Path)):
        with open(what, "rb") as f:
            head = f.read(4)
        if not head:
            raise Unreadable(path, "the file is empty")
        if not head.startswith(b"PK") and head[0] != 0x80:
            raise Unreadable(path, "not a file torch.save wrote: neither a zip archive nor a pickle")
    try:
        with torch.serialization.safe_globals(_old_numpy_rng()):
            return torch.load(what, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as exc:
        name = re.search(r"(?:GLOBAL|global) ([\w.]+)", str(exc))
        if name:
            raise _refused(path, name.group(1)) from None
        cause = str(exc).split("WeightsUnpickler error:", 1)[-1].strip().splitlines()[0]  # not torch's advice
        raise _unreadable(path, pickle.UnpicklingError(cause)) from None
    except Exception as exc:
        raise _unreadable(path, exc) from None


class Unreadable(ConfigError):
    """A checkpoint that cannot be read (truncated, not a checkpoint); `cause` says what torch said, in one line."""

    def __init__(self, path: Path, cause: str, advice: str = "pass another checkpoint"):
        super().__init__(f"checkpoint {path} is unreadable ({cause}); {advice}")
        self.path, self.cause = path, cause


def _unreadable(path: Path, exc: BaseException) -> Unreadable:
    return Unreadable(path, f"{type(exc).__name__}: {' '.join(str(exc).split())[:80]}")


class _MetadataUnpickler(pickle.Unpickler):
    """A sharded checkpoint's `.metadata` is a pickle (torch's DCP reads it with pickle.load): here only the
    classes DCP writes there are found; any other global is refused before it is called."""

    def __init__(self, file, path: Path):
        super().__init__(file)
        self.path = path

    def find_class(self, module: str, name: str):
        import torch.distributed.checkpoint.metadata as metadata

        obj = getattr(sys.modules.get(module), name, None) if module in sys.modules else None
        allowed = (
            (module == metadata.__name__ and isinstance(obj, type) and obj.__module__ == module)
            or (module == "torch" and (name == "Size" or isinstance(obj, torch.dtype)))
            or (module, name) in _METADATA_GLOBALS
        )
        if not allowed:
            raise _refused(self.path, f"{module}.{name}")
        return obj


_METADATA_GLOBALS = {
    ("torch.serialization", "_get_layout"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("pathlib", "PosixPath"),
    ("pathlib", "PurePosixPath"),
    ("collections", "OrderedDict"),
}


def _dcp_parts():
    """A DCP reader and planners whose every read is plain data (see _MetadataUnpickler and safe_torch_load)."""
    import torch.distributed.checkpoint.filesystem  # noqa: F401  (the modules _MetadataUnpickler looks up)
    import torch.serialization  # noqa: F401
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, _EmptyStateDictLoadPlanner

    class Reader(FileSystemReader):
        def read_metadata(self, *args, **kwargs):
            path = Path(self.path)
            try:
                with open(path / ".metadata", "rb") as f:
                    metadata = _MetadataUnpickler(f, path).load()
            except ConfigError:
                raise
            except Exception as exc:
                raise _unreadable(path, exc) from None
            with contextlib.suppress(Exception):  # what FileSystemReader sets after reading it
                from torch.distributed.checkpoint.metadata import StorageMeta

                if getattr(metadata, "storage_meta", None) is None:
                    metadata.storage_meta = StorageMeta()
                metadata.storage_meta.load_id = self.load_id
            return metadata

    def safe_bytes(planner_class):
        class Planner(planner_class):
            path: Path

            def load_bytes(self, read_item, value: io.BytesIO) -> None:
                plain = io.BytesIO()  # checked as plain data, then handed to torch re-saved from what was read
                torch.save(safe_torch_load(self.path, value), plain)
                plain.seek(0)
                super().load_bytes(read_item, plain)

        return Planner

    return Reader, safe_bytes(DefaultLoadPlanner), safe_bytes(_EmptyStateDictLoadPlanner)


def dcp_load(tensors: dict, path: Path) -> dict:
    """DCP load of sharded checkpoint `path` into `tensors` ({}: all it holds), reading plain data only."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict

    reader, planner, empty = _dcp_parts()
    plan = (empty if not tensors else planner)()
    plan.path = Path(path)
    reader(path).read_metadata()  # refused or unreadable here in one line, before DCP wraps the error per rank
    try:
        if tensors:
            dcp.load(tensors, storage_reader=reader(path), planner=plan)
        else:  # everything it holds, on this process alone (what torch's dcp_to_torch_save does)
            _load_state_dict(tensors, storage_reader=reader(path), planner=plan, no_dist=True)
    except ConfigError:
        raise
    except (Exception, CheckpointException) as exc:  # DCP's exception is a BaseException holding each rank's
        causes = [f[0] if isinstance(f, tuple) else f for f in (getattr(exc, "failures", None) or {}).values()]
        mine = [c for c in causes if isinstance(c, ConfigError)]
        if mine:
            raise mine[0] from None
        raise _unreadable(Path(path), causes[0] if causes else exc) from None
    return tensors


def load(path: Path | str) -> dict:
    """A full checkpoint file's contents; of a sharded directory, its `state.pt` only (the tensors stay on
    disk until a strategy loads its shards of them: `Strategy.load_checkpoint`)."""
    path = Path(path)
    if path.is_dir():
        if not (path / ".metadata").is_file() or not (path / STATE).is_file():
            raise ConfigError(
                f"{path} is not a ddplab checkpoint (a sharded one holds .metadata and {STATE}); "
                f"pass a checkpoint written by train.py"
            )
        return safe_torch_load(path, path / STATE)
    if not path.is_file():
        raise ConfigError(
            f"checkpoint {path} does not exist; pass one train.py wrote (a run's checkpoints/last.pt or best.pt, "
            f"or checkpoints/last/ of a sharded fsdp run)"
        )
    state = safe_torch_load(path, path)
    if not isinstance(state, dict) or "model" not in state:
        raise ConfigError(f"{path} is not a ddplab checkpoint (no 'model' entry); pass a file written by train.py")
    return state


RESUME_ADVICE = "use the model= and data= it was trained with, or trainer.resume=none"


def check_compatible(saved: dict, model: dict, what: str, advice: str = RESUME_ADVICE) -> None:
    """Same parameter names and shapes (`{name: shape}` of the checkpoint and of the model), or a one-line
    error naming `what` (e.g. `checkpoint <path>`), the first difference and `advice`."""
    missing = [k for k in model if k not in saved]
    unexpected = [k for k in saved if k not in model]
    shapes = [k for k in model if k in saved and tuple(saved[k]) != tuple(model[k])]
    if missing or unexpected or shapes:
        difference = (
            f"missing {missing[:3]}"
            if missing
            else f"unexpected {unexpected[:3]}"
            if unexpected
            else f"shape of {shapes[0]} is {tuple(saved[shapes[0]])} vs {tuple(model[shapes[0]])}"
        )
        raise ConfigError(f"{what} does not match this model/data ({difference}); {advice}")


def saved_shapes(path: Path | str, state: dict) -> dict[str, tuple]:
    """`{parameter or buffer name: shape}` of the model in a checkpoint of either format (`state`: `load(path)`)."""
    path = Path(path)
    if not path.is_dir():
        return {k: tuple(v.shape) for k, v in state["model"].items()}
    entries = _dcp_parts()[0](path).read_metadata().state_dict_metadata
    return {k.removeprefix("model."): tuple(m.size) for k, m in entries.items() if k.startswith("model.")}


def find(directory: Path, name: str) -> Path | None:
    """Checkpoint `name` ("last", "best") of a run in either format: `<name>.pt` or `<name>/`, the newer if
    both are there; a sharded one caught between the two renames of its replacement is its previous version."""
    for _ in range(100):  # rank 0 may be publishing it meanwhile: look again where a rename came between two looks
        with contextlib.suppress(FileNotFoundError):
            found = [p for p in (directory / f"{name}.pt", directory / name) if p.exists()]
            if found:
                return max(found, key=lambda p: (p / STATE if p.is_dir() else p).stat().st_mtime_ns)
            if (directory / f".{name}.old" / STATE).is_file():
                return directory / f".{name}.old"
            if not (directory / name).exists():  # still none after the look at the previous version: there is none
                return None
        time.sleep(0.01)
    raise FileNotFoundError(f"checkpoint {name} in {directory} kept changing while it was looked up")


def save_full(state: dict, directory: Path, names: list[str]) -> None:
    """Rank 0: `state` as `directory/<name>.pt` for each of `names`, written once: the other names are hard links
    to it, each replaced atomically, so a later save of one name leaves the others as they were. A sharded
    checkpoint of the same name is now older."""
    first = directory / f"{names[0]}.pt"
    save_atomic(state, first)
    for name in names[1:]:
        final = directory / f"{name}.pt"
        tmp = final.with_name(f".{final.name}.tmp{os.getpid()}")
        try:
            tmp.unlink(missing_ok=True)
            _link(first, tmp)
            os.replace(tmp, final)
        except OSError as exc:  # the copy a filesystem without hard links needs can fill the disk
            tmp.unlink(missing_ok=True)
            raise ConfigError(f"cannot write checkpoint {final}: {exc.strerror or exc}; {FREE_SPACE}") from exc
    for name in names:
        shutil.rmtree(directory / name, ignore_errors=True)


class BackgroundWrites:
    """Rank 0's full checkpoints written by a thread while training goes on, one at a time: the write of an
    epoch's checkpoint (150 MB for airbench96 with its EMA) would otherwise hold up the next epoch. `start` copies
    the state first (the next steps change the tensors it holds); `wait` ends the write in flight and raises
    what failed in it, a disk problem as save_atomic's one-line ConfigError."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def start(self, state: dict, directory: Path, names: list[str]) -> None:
        self.wait()
        state, copied = _host_copy(state)
        self._thread = threading.Thread(
            target=self._write, args=(state, copied, directory, names), name="ddplab-checkpoint"
        )
        self._thread.start()

    def _write(self, state: dict, copied: list, directory: Path, names: list[str]) -> None:
        try:
            for event in copied:
                event.synchronize()
            save_full(state, directory, names)
        except BaseException as exc:  # raised in the training thread, by wait
            self._error = exc

    def wait(self, raising: bool = True) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None and raising:
            raise error


def _host_copy(state: dict) -> tuple[dict, list]:
    """A copy of `state` that nothing else holds (tensors in host memory, containers rebuilt), and the CUDA events
    after which it is complete. A GPU tensor is copied into pinned memory by the GPU, ordered after the steps that
    made it and before those that change it, without the host waiting for it here."""
    devices = set()

    def copy(obj):
        if isinstance(obj, torch.Tensor):
            if obj.is_cuda:
                devices.add(obj.device)
                return obj.detach().to("cpu", non_blocking=True)
            return obj.detach().clone()
        if isinstance(obj, dict):
            return {k: copy(v) for k, v in obj.items()}
        if type(obj) in (list, tuple):
            return type(obj)(copy(v) for v in obj)
        return obj

    copied = copy(state)
    events = [torch.cuda.Event() for _ in devices]
    for event, device in zip(events, devices):
        event.record(torch.cuda.current_stream(device))
    return copied, events


def save_sharded(tensors: dict, state: dict, directory: Path, names: list[str], primary: bool) -> None:
    """Collective: every rank writes its shards of `tensors` (DCP), rank 0 adds `state` (the non-tensor rest),
    then each of `names` becomes `directory/<name>/` by a rename. Nothing is gathered on one rank."""
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp

    tmp = directory / f".{names[-1]}.tmp"
    if primary:
        shutil.rmtree(tmp, ignore_errors=True)  # left by a save that was killed
    if dist.is_initialized():
        dist.barrier()  # no rank writes into the directory before it is emptied
    dcp.save(tensors, checkpoint_id=tmp)  # returns once every rank's shards and the .metadata are written
    if not primary:
        return
    save_atomic(state, tmp / STATE)  # written last: a directory with state.pt is complete
    for name in names[:-1]:  # the same checkpoint under another name: hard links, no second write
        copy = directory / f".{name}.tmp"
        shutil.rmtree(copy, ignore_errors=True)
        shutil.copytree(tmp, copy, copy_function=_link)
        _publish(copy, directory / name)
    _publish(tmp, directory / names[-1])


def _link(src: str, dst: str) -> None:
    try:
        os.link(src, dst)
    except OSError:  # a filesystem without hard links
        shutil.copy2(src, dst)


def _publish(tmp: Path, final: Path) -> None:
    """Make the complete directory `tmp` the checkpoint `final`. A directory cannot replace another in one
    rename, so the previous one is first renamed `.<name>.old` (where `find` still finds it) and removed last."""
    old = final.with_name(f".{final.name}.old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    shutil.rmtree(old, ignore_errors=True)
    final.with_name(f"{final.name}.pt").unlink(missing_ok=True)  # a full one of the same name is now older


def load_full(path: Path | str) -> dict:
    """A checkpoint of either format as one full state dict in memory (a sharded one is assembled from its shards)."""
    path = Path(path)
    state = load(path)
    if not path.is_dir():
        return state
    return {**state, **dcp_load({}, path)}


def export(path: Path | str, out: Path | str) -> None:
    """Write checkpoint `path` (e.g. a sharded directory) as one full checkpoint file `out`."""
    save_atomic(load_full(path), Path(out))


def rng_state() -> dict:
    kind, key, pos, has_gauss, cached = np.random.get_state()  # saved as plain data: a tensor and numbers
    numpy_state = (kind, torch.from_numpy(key.astype(np.int64)), pos, has_gauss, cached)
    state = {"python": random.getstate(), "numpy": numpy_state, "torch": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    kind, key, *rest = state["numpy"]
    np.random.set_state((kind, np.asarray(key, dtype=np.int64).astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available() and len(state["cuda"]) == torch.cuda.device_count():
        torch.cuda.set_rng_state_all(state["cuda"])
