"""A step that runs out of GPU memory ends in one line that says what to change (rank, device, per-device
batch, the overrides that need less memory), not in a traceback from every rank. A CPU has no CUDA OOM: the
models here raise torch's own OutOfMemoryError, as a full GPU would, once a batch is larger than they fit."""

from __future__ import annotations

import torch

from src.models import TinyCNN
from tests.conftest import read_metrics, run_cli


def _oom(x: torch.Tensor) -> torch.OutOfMemoryError:
    return torch.OutOfMemoryError(
        f"CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 79.19 GiB "
        f"(batch of {len(x)} images)"
    )


class HungryCNN(TinyCNN):
    """TinyCNN on a device that holds at most FITS images (the flop count's 2 fit)."""

    FITS = 16

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if len(x) > self.FITS:
            raise _oom(x)
        return super().forward(x)


class HungryInEval(TinyCNN):
    """Trains (data.batch_size=128) but runs out of memory on evaluation batches of more than 256."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training and len(x) > 256:
            raise _oom(x)
        return super().forward(x)


def _error_line(proc) -> str:
    """The run failed with exactly one `error:` line, no traceback anywhere; that line."""
    out = proc.stdout + proc.stderr
    assert proc.returncode == 2, out[-3000:]
    assert "Traceback" not in out, out[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and proc.stderr.strip().splitlines()[-1] == errors[0], proc.stderr[-3000:]
    return errors[0]


def test_out_of_memory_in_a_training_step_is_one_line_naming_the_batch_and_the_overrides(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli("debug=fast", "model._target_=tests.run.test_oom.HungryCNN", f"hydra.run.dir={run_dir}")
    line = _error_line(proc)
    assert "out of memory in a training step on rank 0 (cpu), 2.00 GiB more requested" in line, line
    assert "128 images per device" in line, line
    assert "lower data.batch_size (now 128) or set trainer.accumulate_grad_batches=2" in line, line
    assert "trainer.activation_checkpointing=true" in line, line
    assert "strategy=fsdp trainer.devices=N" in line, line
    m = read_metrics(run_dir)
    assert m["status"] == "out_of_memory" and m["final"] == {} and m["epochs"] == []


def test_out_of_memory_under_ddp_is_still_one_line_not_a_traceback_per_rank(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli(
        "debug=fast",
        "model._target_=tests.run.test_oom.HungryCNN",
        "strategy=ddp",
        "trainer.devices=2",
        "trainer.activation_checkpointing=true",  # already on: not suggested again
        f"hydra.run.dir={run_dir}",
    )
    line = _error_line(proc)
    assert "out of memory in a training step on rank" in line, line
    assert "64 images per device" in line, line  # 128 over 2 ranks
    assert "lower data.batch_size (now 128) or set trainer.accumulate_grad_batches=2" in line, line
    assert "activation_checkpointing" not in line, line
    assert "strategy=fsdp trainer.devices=2" in line, line


def test_out_of_memory_in_evaluation_names_the_eval_batch(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli("debug=fast", "model._target_=tests.run.test_oom.HungryInEval", f"hydra.run.dir={run_dir}")
    line = _error_line(proc)
    assert "out of memory in an evaluation step on rank 0 (cpu)" in line, line
    assert "512 images per device: lower data.eval_batch_size (now 512)" in line, line
    assert "data.batch_size" not in line and "activation_checkpointing" not in line, line
    assert read_metrics(run_dir)["status"] == "out_of_memory"


def test_fsdp_suggests_its_own_memory_options_not_itself(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli(
        "debug=fast",
        "model._target_=tests.run.test_oom.HungryCNN",
        "strategy=fsdp",
        "trainer.devices=2",
        "strategy.reshard_after_forward=false",
        f"hydra.run.dir={run_dir}",
    )
    line = _error_line(proc)
    assert "out of memory in a training step on rank" in line, line
    # TinyCNN's two blocks are small: auto made the whole model one unit, so per-block units are a fix
    assert (
        "set strategy.shard_modules=blocks; set strategy.reshard_after_forward=true; set strategy.cpu_offload=true"
        in line
    )
    assert line.endswith("or shard over more GPUs (trainer.devices, more nodes)") and "strategy=fsdp" not in line, line
