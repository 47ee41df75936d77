"""The `logger` config group and src/reporting/loggers.py: every logger's output is read back and compared with what was
logged (TensorBoard's event reader, the CSV file, W&B's own reader of its offline transaction log).

The configs are composed from a copy of conf/ that has the logger default when conf/train.yaml does not yet.
"""

import csv
import json
import math
import shutil
import signal
import statistics
import subprocess
import sys
from pathlib import Path
from typing import ClassVar

import pytest
import yaml
from hydra import compose, initialize_config_dir
from omegaconf import DictConfig, OmegaConf, open_dict

from src.reporting.loggers import CSVLogger, Logger, build_loggers, job_identity
from tests.conftest import read_metrics, run_cli, run_cli_together, start_until_checkpoint

ROOT = Path(__file__).resolve().parents[2]
DEFAULT_LINE = "  - logger: tensorboard"

EPOCHS = [
    {"train/loss": 1.25, "train/top1": 40.5, "val/loss": 1.5, "val/top1": 38.25, "train/epoch_sec": 2.5},
    {"train/loss": 0.75, "train/top1": 70.125, "val/loss": 0.875, "val/top1": 68.0, "train/epoch_sec": 1.75},
    {"train/loss": 0.5, "train/top1": 81.0, "val/loss": 0.625, "val/top1": 79.5, "train/epoch_sec": 1.5},
]
TEST = {"test/loss": 0.6, "test/top1": 80.0, "test/top5": 99.0}
HPARAMS = {"strategy": "ddp", "world_size": 2, "lr": 0.1, "amp": False, "model": "tiny_cnn"}
FINAL = {
    "test_loss": 0.6,
    "test_top1": 80.0,
    "test_top5": 99.0,
    "best_val_top1": 79.5,
    "best_epoch": 3,
    "sec_per_epoch": 1.625,
    "images_per_sec": None,
    "val_loss": math.nan,
}


def conf_dir(tmp_path: Path) -> Path:
    """conf/ as it is, plus the logger default in train.yaml's defaults list where it is not there yet."""
    conf = tmp_path / "conf"
    if not conf.exists():
        shutil.copytree(ROOT / "conf", conf)
        train = conf / "train.yaml"
        text = train.read_text()
        if "- logger:" not in text:
            train.write_text(text.replace("  - experiment: null\n", f"{DEFAULT_LINE}\n  - experiment: null\n", 1))
    return conf


def compose_cfg(tmp_path: Path, *overrides: str) -> DictConfig:
    """The real config, shrunk as tests/conftest.py does, with its run dir in tmp_path/run."""
    with initialize_config_dir(str(conf_dir(tmp_path)), version_base="1.3"):
        cfg = compose(
            "train", overrides=["debug=fast", f"paths.root_dir={ROOT}", f"paths.data_dir={tmp_path}/data", *overrides]
        )
    with open_dict(cfg):
        cfg.paths.output_dir = str(tmp_path / "run")
    return cfg


def log_a_job(loggers: Logger) -> None:
    """What the trainer logs: one call per epoch, the test metrics at the last epoch, then hparams."""
    for epoch, metrics in enumerate(EPOCHS, 1):
        loggers.log_metrics(metrics, step=epoch)
    loggers.log_metrics(TEST, step=len(EPOCHS))
    loggers.log_hparams(HPARAMS, FINAL)
    loggers.close()


@pytest.mark.parametrize(
    "override, expected",
    [
        (None, {"tensorboard"}),
        ("logger=csv", {"csv"}),
        ("logger=[tensorboard,wandb]", {"tensorboard", "wandb"}),
        ("logger=[tensorboard,wandb,csv]", {"tensorboard", "wandb", "csv"}),
        ("logger=none", set()),
    ],
)
def test_logger_group_composes_one_or_several(tmp_path, override, expected):
    cfg = compose_cfg(tmp_path, *([override] if override else []))
    assert set(cfg.logger) == expected
    for name in expected:
        assert cfg.logger[name]._target_.startswith("src.reporting.loggers.")
    if "wandb" in expected:
        assert cfg.logger.wandb.mode == "offline"
        option = compose_cfg(tmp_path, override, "logger.wandb.mode=online", "logger.wandb.project=x")
        assert (option.logger.wandb.mode, option.logger.wandb.project) == ("online", "x")


def test_none_logs_nothing(tmp_path):
    loggers = build_loggers(compose_cfg(tmp_path, "logger=none"), tmp_path / "run")
    assert loggers.loggers == []
    log_a_job(loggers)
    assert not (tmp_path / "run").exists()


def test_tensorboard_scalars_and_hparams_in_one_run(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.backend.event_processing.event_multiplexer import EventMultiplexer
    from tensorboard.plugins.hparams import metadata

    cfg = compose_cfg(tmp_path)  # the default
    log_a_job(build_loggers(cfg, tmp_path / "run"))

    assert list(EventMultiplexer().AddRunsFromDirectory(str(tmp_path)).Runs()) == ["run"]  # named by its dir
    acc = EventAccumulator(str(tmp_path / "run")).Reload()
    for tag in EPOCHS[0]:
        assert [(e.step, e.value) for e in acc.Scalars(tag)] == [
            (step, pytest.approx(m[tag], rel=1e-6)) for step, m in enumerate(EPOCHS, 1)
        ]
    for tag, value in TEST.items():
        assert [(e.step, e.value) for e in acc.Scalars(tag)] == [(3, pytest.approx(value, rel=1e-6))]
    content = acc.PluginTagToContent(metadata.PLUGIN_NAME)
    start = metadata.parse_session_start_info_plugin_data(content[metadata.SESSION_START_INFO_TAG])
    # integers as text, as TensorBoard would print them otherwise as 2.0000; floats stay numbers
    values = {k: getattr(v, v.WhichOneof("kind")) for k, v in start.hparams.items()}
    assert values == {**HPARAMS, "amp": "False", "world_size": "2"} and start.group_name == "run"
    experiment = metadata.parse_experiment_plugin_data(content[metadata.EXPERIMENT_TAG])
    # the final metrics that are not None (NaN is a value), images_per_sec is None: left out
    finals = ("test_loss", "test_top1", "test_top5", "best_val_top1", "sec_per_epoch")
    assert [(mi.name.tag, mi.display_name) for mi in experiment.metric_infos] == [(f"z_final/{m}", m) for m in finals]
    assert acc.Scalars("z_final/test_top1")[0].value == pytest.approx(FINAL["test_top1"])
    assert not any(hi.differs for hi in experiment.hparam_infos)  # a single run varies nothing


def test_tensorboard_session_of_a_sweep_point_puts_what_the_sweep_varies_first(tmp_path):
    """A point of `-m seed=1,2 data.batch_size=32,64 model.width=8,16`, read from Hydra's files as a spawned rank
    does: the Trial ID is its swept overrides, and the swept hyper-parameters, then status, are marked `differs`
    (TensorBoard sorts those first and ticks the first five)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    from tensorboard.plugins.hparams import api_pb2, metadata

    sweep = tmp_path / "multirun" / "day" / "time"
    run_dir = sweep / "data.batch_size=64,debug=fast,model.width=8,seed=2"
    (run_dir / ".hydra").mkdir(parents=True)
    point = ["debug=fast", "seed=2", "data.batch_size=64", "model.width=8"]
    (run_dir / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(point))
    typed = ["debug=fast", "seed=1,2", "data.batch_size=32,64", "model.width=8,16"]
    (sweep / "multirun.yaml").write_text(yaml.safe_dump({"hydra": {"overrides": {"task": typed}}}))
    cfg = compose_cfg(tmp_path)
    loggers = build_loggers(cfg, run_dir)
    loggers.log_hparams({**HPARAMS, "global_batch": 64, "seed": 2, "status": "completed"}, FINAL)
    loggers.close()

    content = EventAccumulator(str(run_dir)).Reload().PluginTagToContent(metadata.PLUGIN_NAME)
    start = metadata.parse_session_start_info_plugin_data(content[metadata.SESSION_START_INFO_TAG])
    assert start.group_name == "seed=2,data.batch_size=64,model.width=8"  # debug=fast is every point's
    assert {k: start.hparams[k].string_value for k in ("seed", "global_batch", "model.width")} == {
        "seed": "2",
        "global_batch": "64",
        "model.width": "8",  # a swept key that is no hyper-parameter of the report: its own column
    }
    infos = metadata.parse_experiment_plugin_data(content[metadata.EXPERIMENT_TAG]).hparam_infos
    assert [hi.name for hi in infos if hi.differs] == ["seed", "global_batch", "model.width", "status"]
    assert [hi.name for hi in infos][:4] == ["seed", "global_batch", "model.width", "status"]
    by_name = {hi.name: hi for hi in infos}
    assert [v.string_value for v in by_name["global_batch"].domain_discrete.values] == ["32", "64"]
    assert by_name["lr"].type == api_pb2.DATA_TYPE_FLOAT64 and by_name["seed"].type == api_pb2.DATA_TYPE_STRING


def read_csv(path: Path) -> tuple[list, list]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        return reader.fieldnames, list(reader)


def test_csv_one_row_per_epoch_complete_after_each(tmp_path):
    cfg = compose_cfg(tmp_path, "logger=csv")
    path = tmp_path / "run" / "metrics.csv"
    loggers = build_loggers(cfg, tmp_path / "run")
    for epoch, metrics in enumerate(EPOCHS[:2], 1):
        loggers.log_metrics(metrics, step=epoch)
        columns, rows = read_csv(path)  # a reader in the middle of the run sees a whole file
        assert columns == ["step", *EPOCHS[0]] and [r["step"] for r in rows] == [str(s) for s in range(1, epoch + 1)]
    loggers.log_metrics(EPOCHS[2], step=3)
    loggers.log_metrics(TEST, step=3)  # same step: the same row, new columns
    loggers.log_hparams(HPARAMS, FINAL)
    loggers.close()

    columns, rows = read_csv(path)
    assert columns == ["step", *EPOCHS[0], *TEST]
    assert len(rows) == 3
    for row, metrics in zip(rows, EPOCHS, strict=True):
        assert {k: float(row[k]) for k in metrics} == metrics  # exact: floats are written as repr()
    assert {k: float(rows[2][k]) for k in TEST} == TEST and rows[0]["test/top1"] == ""

    resumed = build_loggers(cfg, tmp_path / "run")  # a restarted job continues the same file
    resumed.log_metrics({"train/loss": 0.25}, step=4)
    resumed.close()
    columns, rows = read_csv(path)
    assert [r["step"] for r in rows] == ["1", "2", "3", "4"] and float(rows[3]["train/loss"]) == 0.25
    assert float(rows[0]["val/top1"]) == EPOCHS[0]["val/top1"]


def read_wandb_run(run_dir: Path) -> list[dict]:
    """The records of the job's offline run, read by wandb's own reader of its transaction log."""
    (log,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")
    return read_wandb_log(log)


def read_wandb_log(log: Path) -> list[dict]:
    proc = subprocess.run(
        [sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(log)],
        check=False,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr
    return [json.loads(line) for line in proc.stdout.splitlines()]


def _wandb_row(record: dict) -> dict:
    """A history record's values by key (W&B's own `_step`, `_runtime`, ... left out)."""
    return {k: v for k, v in record["history"]["item"].items() if not k.startswith("_")}


def test_wandb_offline_run_named_grouped_and_read_back(tmp_path, monkeypatch):
    pytest.importorskip("wandb", reason="the W&B logger is optional: pip install wandb")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # a closed port: any network call would fail
    for key in ("WANDB_MODE", "WANDB_PROJECT", "WANDB_DIR", "WANDB_NAME", "WANDB_RUN_GROUP"):
        monkeypatch.delenv(key, raising=False)
    cfg = compose_cfg(tmp_path, "logger=[tensorboard,wandb]")
    sweep = tmp_path / "multirun" / "2026-11-26" / "11-08-53.123456"
    run_dir = sweep / "seed=1,strategy=ddp"  # a sweep job as Hydra leaves it, read without HydraConfig
    (run_dir / ".hydra").mkdir(parents=True)
    (run_dir / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(["strategy=ddp", "seed=1"]))
    (sweep / "multirun.yaml").write_text("{}\n")
    with open_dict(cfg):
        cfg.paths.output_dir = str(run_dir)
    loggers = build_loggers(cfg, run_dir)
    loggers.log_steps({"train_steps/loss": 2.0, "train_steps/lr": 0.1}, 5)  # on an axis of its own
    log_a_job(loggers)

    records = read_wandb_run(run_dir)
    (run,) = [r["run"] for r in records if r["type"] == "run"]
    assert (run["display_name"], run["run_group"], run["project"]) == (
        "seed=1,strategy=ddp",
        "2026-11-26/11-08-53.123456",
        "ddplab",
    )
    config = {k: v for k, v in run["config"]["update"].items() if k != "_wandb"}
    assert config == OmegaConf.to_container(cfg, resolve=True)
    history, steps = {}, []  # by epoch: W&B's own step counts the calls, the rows name their epoch
    for r in records:
        if r["type"] == "history":
            row = _wandb_row(r)
            if "global_step" in row:
                steps.append(row)
            else:
                history.setdefault(row.pop("epoch"), {}).update(row)
    assert steps == [{"global_step": 5, "train_steps/loss": 2.0, "train_steps/lr": 0.1}]
    assert sorted(history) == [1, 2, 3]
    for epoch, metrics in enumerate(EPOCHS, 1):
        assert history[epoch] == pytest.approx({**metrics, **(TEST if epoch == 3 else {})})
    updates = [r["config"]["update"] for r in records if r["type"] == "config"]
    assert {"hparams": HPARAMS} in updates
    summary = {}
    for r in records:
        if r["type"] == "summary":
            summary.update(r["summary"].get("update", {}))
    assert {k: summary[f"final/{k}"] for k in ("test_top1", "test_loss", "best_epoch", "sec_per_epoch")} == {
        k: FINAL[k] for k in ("test_top1", "test_loss", "best_epoch", "sec_per_epoch")
    }
    assert "final/images_per_sec" not in summary  # None: not logged
    assert records[-1]["type"] == "exit" and records[-1]["exit"].get("exit_code", 0) == 0
    assert any(run_dir.glob("events.out.tfevents.*"))  # and the other logger of the list wrote too


def test_a_stopped_and_resumed_run_continues_one_wandb_run(tmp_path, monkeypatch):
    """SIGTERM after the first checkpoint, then the printed resume command (a SLURM requeue starts the same run dir
    too): the second start continues the W&B run of the first. Offline each start is a segment of the run (what
    `wandb sync` appends); every segment has the id kept in the run dir, and together they hold each epoch once."""
    pytest.importorskip("wandb", reason="the W&B logger is optional: pip install wandb")
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # a closed port: any network call would fail
    for key in ("WANDB_MODE", "WANDB_PROJECT", "WANDB_DIR", "WANDB_NAME", "WANDB_RUN_GROUP", "WANDB_RUN_ID"):
        monkeypatch.delenv(key, raising=False)
    run_dir = tmp_path / "run"
    args = ("debug=fast", "trainer.limit_train_batches=null", "data.batch_size=32", "trainer.max_epochs=3")
    proc = start_until_checkpoint(*args, "logger=wandb", f"hydra.run.dir={run_dir}", run_dir=run_dir)
    proc.send_signal(signal.SIGTERM)
    out = proc.communicate(timeout=120)[0]
    assert proc.returncode == 128 + signal.SIGTERM and "resume with:" in out, out[-3000:]
    resumed = run_cli(f"hydra.run.dir={run_dir}")
    assert resumed.returncode == 0 and "resumed from" in resumed.stdout + resumed.stderr, resumed.stderr[-3000:]

    run_id = (run_dir / "wandb_id").read_text().strip()
    segments = sorted(run_dir.glob("wandb/offline-run-*"))  # named <time>-<id>: in the order they ran
    assert len(segments) == 2 and all(segment.name.endswith(f"-{run_id}") for segment in segments), segments
    epochs = []
    for segment in segments:
        (log,) = segment.glob("run-*.wandb")
        records = read_wandb_log(log)
        assert [r["run"]["run_id"] for r in records if r["type"] == "run"] == [run_id]
        rows = [_wandb_row(r) for r in records if r["type"] == "history"]
        epochs += [row["epoch"] for row in rows if "train/loss" in row]
    assert epochs == [1, 2, 3]
    assert read_metrics(run_dir)["status"] == "completed"


def test_job_identity_without_hydra(tmp_path):
    single = tmp_path / "runs" / "2026-11-26" / "11-08-53.123456"
    (single / ".hydra").mkdir(parents=True)
    (single / ".hydra" / "overrides.yaml").write_text("[]\n")
    assert job_identity(single) == ("11-08-53.123456", None)  # no overrides, no sweep: the run dir's name
    (single / ".hydra" / "overrides.yaml").write_text(yaml.safe_dump(["trainer.amp=true", "data=cifar10"]))
    assert job_identity(single) == ("data=cifar10,trainer.amp=true", None)


APP = """
import json, sys
from pathlib import Path
import hydra
sys.path.insert(0, {root!r})
import src  # the run-directory resolvers
from src.reporting.loggers import build_loggers, job_identity

@hydra.main(version_base="1.3", config_path={conf!r}, config_name="train")
def main(cfg):
    run_dir = Path(cfg.paths.output_dir)
    (run_dir / "identity.json").write_text(json.dumps(job_identity(run_dir)))
    loggers = build_loggers(cfg, run_dir)
    loggers.log_metrics({{"train/loss": 0.5}}, step=1)
    loggers.close()

main()
"""


def test_job_identity_in_a_hydra_app_matches_the_run_dir(tmp_path):
    """Under a real Hydra app (multirun and single run) the name is Hydra's override dirname and the group the
    sweep; read back later from the run dir alone (as a spawned rank does), the answer is the same."""
    app = tmp_path / "app.py"
    app.write_text(APP.format(root=str(ROOT), conf=str(conf_dir(tmp_path))))

    def run(*args):
        proc = subprocess.run(
            [sys.executable, str(app), *args], cwd=tmp_path, check=False, capture_output=True, text=True, timeout=300
        )
        assert proc.returncode == 0, proc.stderr[-3000:]

    sweep = tmp_path / "multirun" / "day" / "time"
    run("-m", "seed=2,1", "logger=csv", f"hydra.sweep.dir={sweep}")
    jobs = sorted(p for p in sweep.iterdir() if p.is_dir())
    assert [j.name for j in jobs] == ["logger=csv,seed=1", "logger=csv,seed=2"]
    for job in jobs:
        assert json.loads((job / "identity.json").read_text()) == [job.name, "day/time"]
        assert job_identity(job) == (job.name, "day/time")
        assert read_csv(job / "metrics.csv")[1] == [{"step": "1", "train/loss": "0.5"}]

    one = tmp_path / "runs" / "d" / "with_overrides"
    run(f"hydra.run.dir={one}", "hydra.output_subdir=null", "seed=3", "logger=[tensorboard,csv]")
    # no .hydra/ written: the name can only come from HydraConfig
    assert json.loads((one / "identity.json").read_text()) == ["logger=[tensorboard,csv],seed=3", None]
    assert job_identity(one) == ("with_overrides", None)  # later, without Hydra and its files: the dir's name
    assert any(one.glob("events.out.tfevents.*")) and (one / "metrics.csv").exists()

    bare = tmp_path / "runs" / "d" / "11-08-53.123456"
    run(f"hydra.run.dir={bare}")  # no overrides: the run dir's name; the default logger
    assert json.loads((bare / "identity.json").read_text()) == [bare.name, None]
    assert any(bare.glob("events.out.tfevents.*")) and not (bare / "metrics.csv").exists()


class ToyLogger(Logger):
    """A logger added by a user: one class and a `_target_` (here given on the command line)."""

    calls: ClassVar[list] = []

    def __init__(self, run_dir, cfg, prefix: str):
        self.prefix = prefix
        ToyLogger.calls.append(("init", run_dir, cfg.seed))

    def log_metrics(self, metrics, step):
        ToyLogger.calls.append((f"{self.prefix}metrics", step, dict(metrics)))

    def log_hparams(self, hparams, final):
        ToyLogger.calls.append((f"{self.prefix}hparams", dict(hparams), dict(final)))

    def close(self):
        ToyLogger.calls.append(("close",))


def test_a_new_logger_is_one_class_and_a_target(tmp_path, monkeypatch):
    monkeypatch.setattr(ToyLogger, "calls", [])
    cfg = compose_cfg(
        tmp_path, "logger=csv", "seed=7", f"+logger.toy={{_target_: {__name__}.ToyLogger, prefix: 'toy_'}}"
    )
    assert list(cfg.logger) == ["csv", "toy"]
    loggers = build_loggers(cfg, tmp_path / "run")
    log_a_job(loggers)
    loggers.close()  # again, as a `finally` would: closes nothing twice
    assert ToyLogger.calls == [
        ("init", tmp_path / "run", 7),
        *[("toy_metrics", step, m) for step, m in enumerate(EPOCHS, 1)],
        ("toy_metrics", 3, TEST),
        ("toy_hparams", HPARAMS, FINAL),
        ("close",),
    ]
    assert len(read_csv(tmp_path / "run" / "metrics.csv")[1]) == 3  # the configured csv logger ran alongside


def _steps_csv(run_dir: Path) -> list[dict]:
    with open(run_dir / "metrics_steps.csv", newline="") as f:
        return [{k: float(v) for k, v in row.items()} for row in csv.DictReader(f)]


@pytest.mark.slow
def test_every_n_steps_logs_the_same_figures_whatever_the_strategy(tmp_path):
    """loss, lr, grad norm and images/s every N optimizer steps, to every logger; one collective per log."""
    variants = {
        "single": ["trainer.log_every_n_steps=1"],
        "ddp": ["trainer.log_every_n_steps=1", "strategy=ddp", "trainer.devices=2"],
        "every2": ["trainer.log_every_n_steps=2"],
    }  # without BatchNorm, whose statistics depend on the per-device batch
    common = ("debug=fast", "model.batch_norm=false", "logger=[csv,tensorboard]")
    procs = run_cli_together(*([*common, *args, f"hydra.run.dir={tmp_path / name}"] for name, args in variants.items()))
    runs = {}
    for name, proc in zip(variants, procs):
        assert proc.returncode == 0, proc.stderr[-2000:]
        runs[name] = (_steps_csv(tmp_path / name), read_metrics(tmp_path / name))
    single, metrics = runs["single"]
    assert [r["step"] for r in single] == [1, 2, 3, 4, 5, 6]  # debug=fast: 2 epochs of 3 steps
    for a, b in zip(single, runs["ddp"][0]):  # the same global batches: the same numbers from 2 ranks
        assert (a["step"], a["lr"], a["epoch"]) == (b["step"], b["lr"], b["epoch"])
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5) and a["grad_norm"] == pytest.approx(
            b["grad_norm"], rel=1e-4
        )
    for epoch, row in enumerate(metrics["epochs"]):  # equal batches: the epoch's loss is the mean of its steps'
        steps = single[3 * epoch : 3 * epoch + 3]
        assert row["train_loss"] == pytest.approx(statistics.mean(r["loss"] for r in steps))
    every2 = runs["every2"][0]
    assert [r["step"] for r in every2] == [1, 2, 4, 6]  # the first step, then every 2nd
    for last, row in zip([0, *(r["step"] for r in every2)], every2):  # the loss of the steps since the last log
        assert row["loss"] == pytest.approx(statistics.mean(r["loss"] for r in single[int(last) : int(row["step"])]))
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(tmp_path / "single")).Reload()
    assert [e.step for e in events.Scalars("train_steps/loss")] == [1, 2, 3, 4, 5, 6]
    assert {"train_steps/lr", "train_steps/grad_norm", "train_steps/images_per_sec"} <= set(events.Tags()["scalars"])


def test_a_resumed_run_logs_its_steps_once(tmp_path):
    """A run resumed from a checkpoint at step 3 logs steps 4.. again: the rows logged after it are dropped."""
    first = CSVLogger(tmp_path)
    for step in range(1, 7):
        first.log_steps({"train_steps/loss": float(step)}, step)
    resumed = CSVLogger(tmp_path)
    for step in range(4, 6):
        resumed.log_steps({"train_steps/loss": 10.0 + step}, step)
    assert [(r["step"], r["loss"]) for r in _steps_csv(tmp_path)] == [(1, 1), (2, 2), (3, 3), (4, 14), (5, 15)]
