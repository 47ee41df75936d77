"""Starting points (issue 33, item 5): model.pretrained from the local caches, model.weights, trainer.init_from
(a new run from another run's weights), a new head for another class count, model.freeze and
optim.pretrained_lr_scale. Every weight used here is made in the test: nothing downloads."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch

from src.config.errors import ConfigError
from src.data.datasets import DataBundle, Split, load_digits_data
from tests.conftest import read_metrics, run_cli, run_cli_together
from tests.models.test_models import needs_timm


def digits_classes(cfg) -> DataBundle:
    """Digits restricted to `data.classes`, relabelled 0..k-1: one task to pre-train on, another to fine-tune on."""
    data, keep = load_digits_data(cfg), torch.tensor(list(cfg.classes))
    relabel = torch.full((10,), -1, dtype=torch.long)
    relabel[keep] = torch.arange(len(keep))

    def only(split: Split) -> Split:
        mask = torch.isin(split.labels, keep)
        return Split(relabel[split.labels[mask]], images=split.images[mask])

    return replace(
        data,
        train=only(data.train),
        val=only(data.val),
        test=only(data.test),
        num_classes=len(keep),
        classes=[str(c) for c in keep.tolist()],
    )


DATA = "data._target_=tests.run.test_starting_points.digits_classes"
NARROW = "model.width=16"  # the 16-wide CNN learns little from scratch in 3 epochs: what a starting point gives shows
FIRST, SECOND = "+data.classes=[0,1,2,3]", "+data.classes=[5,6,7,8,9]"  # two tasks, and two class counts


def _one_line(proc, message: str) -> None:
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and message in lines[0], proc.stderr[-2000:]


@pytest.fixture(scope="module")
def pretrained(tmp_path_factory) -> Path:
    """A run trained on digits 0-3 (4 classes): its best checkpoint."""
    run_dir = tmp_path_factory.mktemp("pretrained") / "run"
    proc = run_cli(
        "debug=fast", DATA, FIRST, "trainer.max_epochs=8", "trainer.limit_train_batches=null",
        "data.batch_size=64", NARROW, f"hydra.run.dir={run_dir}",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    return run_dir / "checkpoints/best.pt"


def test_fine_tuning_from_another_task_beats_the_same_model_from_scratch(pretrained, tmp_path):
    """The point of a starting point: features learnt on digits 0-3 give digits 5-9 (a new head: 5 classes, not
    4) a clearly higher top-1 after the same few steps than random ones."""
    starts = {"scratch": [], "fine-tuned": [f"trainer.init_from={pretrained}"]}
    common = ("debug=fast", DATA, SECOND, "trainer.max_epochs=3", "data.batch_size=64", NARROW)
    procs = run_cli_together(*([*common, *start, f"hydra.run.dir={tmp_path / name}"] for name, start in starts.items()))
    top1 = {}
    for name, proc in zip(starts, procs):
        assert proc.returncode == 0, proc.stderr[-2000:]
        metrics = read_metrics(tmp_path / name)
        assert [row["epoch"] for row in metrics["epochs"]] == [1, 2, 3]  # a new run: from epoch 0
        top1[name] = metrics["final"]["test_top1"]
    assert "a new head (head.bias, head.weight) for the data's 5 classes, initialized afresh" in proc.stdout
    assert top1["fine-tuned"] >= top1["scratch"] + 15, top1  # measured: 66.1 vs 40.0


# --- trainer.init_from: any strategy's checkpoint, either format ----------------------------------------------


@pytest.fixture(scope="module")
def distributed_checkpoints(tmp_path_factory) -> dict[str, Path]:
    """A one-epoch ddp run (a full .pt) and fsdp run (a sharded folder) on 10 classes, from the command line."""
    dirs = {strategy: tmp_path_factory.mktemp(strategy) / "run" for strategy in ("ddp", "fsdp")}
    common = ("debug=fast", "trainer.devices=2", "trainer.max_epochs=1")
    procs = run_cli_together(*([*common, f"strategy={s}", f"hydra.run.dir={d}"] for s, d in dirs.items()))
    for proc in procs:
        assert proc.returncode == 0, proc.stderr[-2000:]
    out = {"ddp": dirs["ddp"] / "checkpoints/last.pt", "fsdp": dirs["fsdp"] / "checkpoints/last"}
    assert out["fsdp"].is_dir()
    return out


@pytest.mark.parametrize("strategy", ["ddp", "fsdp"])
@pytest.mark.parametrize("classes", [10, 5])
def test_init_from_a_ddp_or_fsdp_checkpoint_starts_a_single_run_from_its_weights(
    distributed_checkpoints, cfg_factory, strategy, classes
):
    """A single run started from another strategy's checkpoint holds its weights exactly, with a fresh optimizer
    and schedule at epoch 0; for 5 classes (the checkpoint has 10) all but the head, which is this run's own."""
    from src.distributed import destroy_process_group
    from src.run.trainer import prepare_run
    from src.state.checkpoint import load_full

    path = distributed_checkpoints[strategy]
    data = [DATA, f"+data.classes=[{','.join(map(str, range(classes)))}]"]
    run = prepare_run(cfg_factory(*data, f"trainer.init_from={path}"))
    try:
        run.build()
        fresh = {k: v.clone() for k, v in run.strategy.core.state_dict().items()}
        run.start_from(str(path))
        started = run.strategy.core.state_dict()
    finally:
        run.close()
        destroy_process_group()
    saved = load_full(path)["model"]
    head = {"head.weight", "head.bias"}
    for name, value in started.items():
        expected = fresh[name] if classes != 10 and name in head else saved[name]
        assert torch.equal(value, expected), name
    assert started["head.weight"].shape[0] == classes
    assert not run.optimizer.state and run.scheduler.last_epoch == 0 and run.progress.epoch == 0


# --- model.freeze under every strategy; optim.pretrained_lr_scale ----------------------------------------------


@pytest.mark.parametrize("strategy", ["single", "ddp", "fsdp"])
def test_frozen_parameters_are_not_trained_under_any_strategy(pretrained, tmp_path, strategy):
    from src.state.checkpoint import load_full

    run_dir = tmp_path / "run"
    devices = [] if strategy == "single" else ["trainer.devices=2"]
    proc = run_cli(
        "debug=fast", DATA, SECOND, NARROW, f"strategy={strategy}", *devices, f"trainer.init_from={pretrained}",
        "model.freeze=[features.0]", "optim.pretrained_lr_scale=0.5", f"hydra.run.dir={run_dir}",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "model.freeze=[features.0]: 3 of 8 parameter tensors are not trained" in proc.stdout
    start, end = load_full(pretrained)["model"], load_full(_last(run_dir))["model"]
    trained = {n for n in start if "running_" not in n and "num_batches" not in n and not n.startswith("head.")}
    for name in trained:
        assert torch.equal(start[name], end[name]) == name.startswith("features.0."), name


def _last(run_dir: Path) -> Path:
    from src.state.checkpoint import find

    return find(run_dir / "checkpoints", "last")


def test_pretrained_lr_scale_gives_all_but_the_head_a_smaller_learning_rate(cfg_factory):
    from src.models import TinyCNN, apply_freeze
    from src.run.optim import build_optimizer

    model = TinyCNN(num_classes=5, in_channels=1)
    apply_freeze(model, ["features.0"], set())
    cfg = cfg_factory("optim.pretrained_lr_scale=0.1", "optim.lr=0.2").optim
    optimizer = build_optimizer(cfg, model, head={"head.weight", "head.bias"})
    lr = {id(p): group["lr"] for group in optimizer.param_groups for p in group["params"]}
    for name, p in model.named_parameters():
        expected = None if name.startswith("features.0.") else 0.2 if name.startswith("head.") else 0.2 * 0.1
        assert lr.get(id(p)) == pytest.approx(expected) if expected else id(p) not in lr, name
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)  # a schedule keeps the ratio
    assert sorted(scheduler.get_last_lr()) == pytest.approx([0.01, 0.01, 0.1, 0.1])


# --- model.pretrained from the local caches, model.weights -------------------------------------------------------


def test_torchvision_pretrained_comes_from_the_torch_hub_cache_with_a_new_head(tmp_path, monkeypatch, caplog):
    import torchvision

    from src.models import build_model
    from tests.conftest import make_cfg

    monkeypatch.setenv("TORCH_HOME", str(tmp_path / "torch"))
    cfg = make_cfg(tmp_path, "model=torchvision", "model.name=resnet18", "model.pretrained=true").model
    url = torchvision.models.ResNet18_Weights.DEFAULT.url
    path = tmp_path / "torch/hub/checkpoints" / url.rsplit("/", 1)[-1]
    with pytest.raises(ConfigError) as info:  # nothing there: where to put it, and from where
        build_model(cfg, num_classes=7, in_channels=3)
    assert "\n" not in str(info.value) and str(path) in str(info.value) and url in str(info.value)
    path.parent.mkdir(parents=True)
    imagenet = torchvision.models.resnet18().state_dict()  # 1000 classes, saved as torch.hub keeps it, and
    imagenet = {k: v for k, v in imagenet.items() if "num_batches_tracked" not in k}  # as old as torchvision's
    torch.save(imagenet, path)
    with caplog.at_level("INFO", logger="ddplab"):
        model = build_model(cfg, num_classes=7, in_channels=3)
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in imagenet.items() if not k.startswith("fc."))
    assert state["fc.weight"].shape == (7, 512)
    assert (
        "a new head (fc.bias, fc.weight) for the data's 7 classes, initialized afresh (the weights have 1000)"
        in caplog.text
    )


@needs_timm
def test_timm_pretrained_comes_from_the_hugging_face_cache(tmp_path, monkeypatch, caplog):
    import huggingface_hub
    import timm
    from safetensors.torch import save_file

    from src.models import build_model
    from tests.conftest import make_cfg

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    cfg = make_cfg(tmp_path, "model=timm", "model.name=resnet18", "model.pretrained=true").model
    path = tmp_path / "hf/models--timm--resnet18.a1_in1k/snapshots/main/model.safetensors"
    with pytest.raises(ConfigError) as info:
        build_model(cfg, num_classes=7, in_channels=1)
    url = "https://huggingface.co/timm/resnet18.a1_in1k/resolve/main/model.safetensors"
    assert "\n" not in str(info.value) and str(path) in str(info.value) and url in str(info.value)
    path.parent.mkdir(parents=True)
    imagenet = timm.create_model("resnet18").state_dict()
    save_file(imagenet, path)
    with caplog.at_level("INFO", logger="ddplab"):
        model = build_model(cfg, num_classes=7, in_channels=1)  # the digits' one channel: timm adapts the stem
    state = model.state_dict()
    assert torch.equal(state["layer1.0.conv1.weight"], imagenet["layer1.0.conv1.weight"])
    assert torch.allclose(state["conv1.weight"], imagenet["conv1.weight"].sum(dim=1, keepdim=True))
    assert state["fc.weight"].shape == (7, 512)
    assert "a new head (fc) for the data's 7 classes, initialized afresh (the weights have 1000)" in caplog.text


@pytest.mark.parametrize("suffix", [".pt", ".safetensors"])
def test_model_weights_loads_a_state_dict_file(pretrained, tmp_path, cfg_factory, suffix, caplog):
    from src.models import build_model
    from src.state.checkpoint import load_full

    saved = load_full(pretrained)["model"]  # 4 classes
    path = tmp_path / f"weights{suffix}"
    if suffix == ".pt":
        torch.save(saved, path)
    else:
        from safetensors.torch import save_file

        save_file(saved, path)
    with caplog.at_level("INFO", logger="ddplab"):
        model = build_model(cfg_factory(NARROW, f"model.weights={path}").model, num_classes=10, in_channels=1)
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in saved.items() if not k.startswith("head."))
    assert state["head.weight"].shape[0] == 10 and "the weights have 4" in caplog.text


# --- mistakes: one line, before anything runs ---------------------------------------------------------------


def test_a_crafted_weights_file_is_refused_and_runs_nothing(tmp_path):
    from tests.test_faults import _crafted_full

    marker = tmp_path / "pwned"
    given = _crafted_full(tmp_path / "weights.pt", marker)
    proc = run_cli("debug=fast", f"model.weights={given}", f"hydra.run.dir={tmp_path}/run")
    _one_line(proc, "is refused: it asks to load posix.system")
    assert not marker.exists() and not (tmp_path / "run/checkpoints").exists()


def test_a_missing_pretrained_file_is_one_line_before_anything_runs(tmp_path):
    proc = run_cli(
        "model=torchvision", "model.name=resnet18", "model.pretrained=true", "strategy=ddp", "trainer.devices=2",
        f"hydra.run.dir={tmp_path}/run", env={"TORCH_HOME": str(tmp_path / "torch")},
    )  # fmt: skip
    _one_line(proc, f"are not at {tmp_path}/torch/hub/checkpoints/resnet18-")
    assert "https://download.pytorch.org/models/resnet18-" in proc.stderr
    assert "starting 2 processes" not in proc.stdout and not (tmp_path / "run").exists()


MISTAKES = [
    ("model.weights={tmp}/none.pt", "model.weights={tmp}/none.pt does not exist"),
    ("model.freeze=[nope]", "model.freeze: 'nope' names no parameter of this model; its modules: features, head"),
    ("model.freeze=[features,head]", "freezes every parameter: nothing would train"),
    ("model.freeze=3", "model.freeze must be a string or a list of a string or null, got 3"),
    ("optim.pretrained_lr_scale=0.1", "optim.pretrained_lr_scale=0.1 scales the learning rate of pretrained"),
    ("optim.pretrained_lr_scale=0", "optim.pretrained_lr_scale must be a number > 0 and <= 1, got 0"),
    ("trainer.init_from={tmp}/none.pt", "checkpoint {tmp}/none.pt does not exist"),
    ("trainer.init_from={ckpt} model.weights={ckpt}", "trainer.init_from takes every weight from its checkpoint"),
    ("trainer.init_from={ckpt} trainer.resume={ckpt}", "trainer.init_from starts a new run and trainer.resume="),
    ("model=torchvision model.pretrained=true model.weights={ckpt}", "both name the starting weights; choose one"),
    ("+model.pretrained=true", "model.pretrained is not an option of model (TinyCNN)"),
    ("trainer.init_from={ckpt} model.width=8", "does not match this model/data (shape of features.0.0.weight"),
]


@pytest.mark.parametrize("overrides, message", MISTAKES)
def test_starting_point_mistakes_are_one_line(pretrained, tmp_path, cfg_factory, overrides, message):
    from src.run.launch import main as launch

    fill = {"tmp": tmp_path, "ckpt": pretrained}
    with pytest.raises(ConfigError) as info:
        launch(cfg_factory(*overrides.format(**fill).split()))
    assert message.format(**fill) in str(info.value) and "\n" not in str(info.value), str(info.value)
    assert not (tmp_path / "run/checkpoints").exists()


def test_a_refused_resume_names_init_from_to_start_a_new_run_from_its_weights(pretrained, tmp_path, cfg_factory):
    """`trainer.max_epochs=20` on a 3-epoch run is refused (its schedule was planned for 3): the message says how
    to train longer."""
    from omegaconf import open_dict

    from src.state.resume import already_completed, reconcile

    unfinished = tmp_path / "unfinished"
    (unfinished / "checkpoints").mkdir(parents=True)
    (unfinished / "checkpoints/last.pt").write_bytes(pretrained.read_bytes())
    for run_dir, check in ((unfinished, reconcile), (pretrained.parents[1], already_completed)):
        cfg = cfg_factory(DATA, FIRST, "trainer.max_epochs=20")
        with open_dict(cfg):
            cfg.paths.output_dir = str(run_dir)
        with pytest.raises(ConfigError, match="trainer.init_from=") as info:
            check(cfg, ["trainer.max_epochs=20"])
        assert "\n" not in str(info.value)
