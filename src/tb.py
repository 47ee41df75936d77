"""TensorBoard writer of one job, and its HParams summary.

`SummaryWriter.add_hparams` writes the HParams summary into a new sub-run
(`<logdir>/<timestamp>/`), so every job shows up twice in TensorBoard
(pytorch issues 32651, 37738). `write_hparams` writes the three HParams
summaries into the writer's own event file instead, next to the training
scalars, so each job is exactly one run and one HParams session.
"""
from pathlib import Path

from torch.utils.tensorboard import SummaryWriter
from torch.utils.tensorboard.summary import hparams as hparams_summaries

# Final metrics shown in the HParams tab, logged as scalars `hparams/<name>`.
METRICS = ("test_loss", "test_top1", "test_top5", "best_val_top1", "sec_per_epoch", "images_per_sec")


def open_writer(run_dir) -> SummaryWriter:
    """Writer whose event files go to `<run_dir>/tb`."""
    return SummaryWriter(log_dir=str(Path(run_dir) / "tb"))


def _hparam_value(value):
    # Numbers stay numbers; everything else, booleans included, becomes its str(): torch's hparams()
    # tests for int before bool, so a bool would show as 0.0/1.0 rather than False/True.
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else str(value)


def write_hparams(writer: SummaryWriter, hparams: dict, final_metrics: dict, step: int = 0) -> None:
    """Write the HParams experiment, session start and session end into `writer`'s event file,
    plus each final metric (of METRICS, when present and not None) as scalar `hparams/<name>`
    at `step`, which is what the HParams tab reads as the session's metric value."""
    hp = {str(k): _hparam_value(v) for k, v in hparams.items()}
    metrics = {f"hparams/{name}": float(final_metrics[name])
               for name in METRICS if final_metrics.get(name) is not None}
    file_writer = writer._get_file_writer()  # the writer's own event file, as add_hparams does for its sub-run
    for summary in hparams_summaries(hp, metrics):  # experiment, session start, session end
        file_writer.add_summary(summary, step)
    for tag, value in metrics.items():
        writer.add_scalar(tag, value, step)
    writer.flush()
