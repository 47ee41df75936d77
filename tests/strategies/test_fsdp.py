"""FSDP2 on CPU over gloo: torchtitan's layout (per-block compile before sharding, explicit prefetch), its
options, activation checkpointing, and sharded (DCP) checkpoints that resume on another number of ranks,
evaluate with any strategy and export to one file."""

from __future__ import annotations

import copy
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Annotated

import pytest
import torch
import torch.distributed as dist
from torch import nn

from src.config.errors import ConfigError
from src.config.schema import Positive
from src.models import TinyCNN
from src.run.launch import main as launch
from src.run.plan import plan_layout
from src.run.trainer import train
from src.state import checkpoint as ckpt
from src.strategies import FSDP, Context, Single, apply_activation_checkpointing, shard_targets
from tests.conftest import ROOT, make_cfg, read_metrics, run_cli, start_train
from tests.reporting.test_loggers import _steps_csv

pytestmark = pytest.mark.slow

# 4 optimizer steps of a 64-sample global batch at a constant LR (BatchNorm kept: fsdp is compared with fsdp)
STEPS = ("scheduler=constant", "trainer.max_epochs=1", "trainer.limit_train_batches=4", "data.batch_size=64")
FSDP2 = ("strategy=fsdp", "trainer.devices=2", "strategy.shard_modules=blocks")  # several units, as big models
AC_MODEL = "model._target_=tests.strategies.test_fsdp.checkpointed_tiny_cnn"


def checkpointed_tiny_cnn(
    num_classes: int, in_channels: int = 3, width: Annotated[int, Positive] = 16, batch_norm: bool = True
) -> nn.Module:
    """TinyCNN as the trainer builds it with activation checkpointing on (before the strategy wraps it)."""
    model = TinyCNN(num_classes, in_channels, width, batch_norm)
    apply_activation_checkpointing(model)
    return model


def scalar_tiny_cnn(
    num_classes: int, in_channels: int = 3, width: Annotated[int, Positive] = 16, batch_norm: bool = True
) -> nn.Module:
    """TinyCNN with a scalar parameter (no rows to shard)."""
    model = TinyCNN(num_classes, in_channels, width, batch_norm)
    model.temperature = nn.Parameter(torch.ones(()))
    return model


def last_weights(run: Path) -> dict[str, torch.Tensor]:
    return ckpt.load_full(ckpt.find(run / "checkpoints", "last"))["model"]


def assert_same(a: dict, b: dict, **tolerance) -> None:
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], msg=lambda m, k=k: f"{k}: {m}", **tolerance)


def assert_near(a: dict, b: dict, rel: float) -> None:
    """Each tensor within `rel` of the other in norm: runs that sum in another order drift apart by rounding over
    many steps, elementwise most where a weight is near zero (a few of 73,728 by 1e-3 relative on one CPU model,
    under 1e-4 on another), while each tensor as a whole stays ~1e-6 apart."""
    assert a.keys() == b.keys()
    for k in a:
        drift = float((a[k].double() - b[k].double()).norm() / b[k].double().norm().clamp_min(1e-12))
        assert drift <= rel, f"{k}: {drift:.2e} apart in norm (up to {rel:.0e} allowed)"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """fsdp on 2 ranks with every option at its default: what the variants must compute."""
    base = tmp_path_factory.mktemp("fsdp_reference")
    launch(make_cfg(base, *STEPS, *FSDP2))
    return base / "run"


# --- options --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "override, message",
    [
        ("strategy.prefetch=0", "strategy.prefetch must be true or false or a positive integer, got 0"),
        ("strategy.param_dtype=fp16", "strategy.param_dtype must be one of bf16, fp32 or null, got 'fp16'"),
        ("strategy.reduce_dtype=fp16", "strategy.reduce_dtype must be one of fp32, bf16, got 'fp16'"),
        ("strategy.cpu_offload=1", "strategy.cpu_offload must be true or false, got 1"),
        ("strategy.checkpoint_format=zip", "strategy.checkpoint_format must be one of sharded, full, got 'zip'"),
        ("strategy.collectives=nccl", "strategy.collectives must be one of auto, hooks, graph, got 'nccl'"),
        (
            "strategy.reshard_after_forward=0",
            "strategy.reshard_after_forward must be true or false or a positive integer, got 0",
        ),
        (
            "strategy.reshard_after_forward=3",
            "strategy.reshard_after_forward=3 must divide the 2 ranks (the group each "
            "parameter is regathered from in the backward); use true, false",
        ),
    ],
)
def test_each_bad_option_is_one_line(cfg_factory, override, message):
    with pytest.raises(ConfigError) as err:
        plan_layout(cfg_factory(*FSDP2, override))
    assert str(err.value) == message


@pytest.mark.parametrize(
    "option, message",
    [
        (
            "strategy.shard_modules=blocks",
            "but 2 units of their own (strategy.shard_modules=blocks) are gathered again",
        ),
        ("strategy.cpu_offload=true", "does not work with strategy.cpu_offload=true (the parameters live on the CPU)"),
    ],
)
def test_cuda_graphs_are_refused_before_any_process_where_fsdp_gathers_more_than_once(cfg_factory, option, message):
    graphs = ("trainer.compile=true", "trainer.compile_mode=reduce-overhead")
    with pytest.raises(ConfigError) as err:
        launch(cfg_factory("strategy=fsdp", "trainer.devices=2", *graphs, option))
    assert message in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize(
    "units",
    [
        ("strategy.shard_modules=root", "strategy.collectives=hooks"),
        ("strategy.shard_modules=[features.1]", "strategy.reshard_after_forward=false"),
    ],
    ids=["root", "two-units"],
)
def test_graph_mode_keeps_batchnorm_statistics_of_the_compiled_fsdp_model(reference, cfg_factory, tmp_path, units):
    """trainer.compile_mode=reduce-overhead marks the FSDP-managed buffers static (on CUDA the graphs then replay):
    the compiled graphs still update BatchNorm's running statistics as eager fsdp does, with the root as the one
    unit or with a second unit (features.1) compiled apart from the root's block."""
    graphs = ("trainer.compile=true", "trainer.compile_mode=reduce-overhead", *units)
    launch(cfg_factory(*STEPS, *FSDP2, *graphs, sub="graphs"))
    assert_same(last_weights(tmp_path / "graphs/run"), last_weights(reference), rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    "options",
    [
        ("strategy.prefetch=false", "strategy.cpu_offload=true"),
        ("strategy.shard_modules=root",),
        ("strategy.prefetch=2", "strategy.reshard_after_forward=false", "strategy.checkpoint_format=full"),
    ],
)
def test_options_that_move_memory_or_communication_compute_the_same(reference, cfg_factory, tmp_path, options):
    launch(cfg_factory(*STEPS, *FSDP2, *options))
    assert_same(last_weights(tmp_path / "run"), last_weights(reference))
    if "strategy.checkpoint_format=full" in options:
        assert (tmp_path / "run/checkpoints/last.pt").is_file() and not (tmp_path / "run/checkpoints/last").exists()


@pytest.fixture(scope="module")
def single_nobn(tmp_path_factory):
    """One device, no BatchNorm (whose statistics depend on the per-device batch): what any number of ranks
    computes."""
    base = tmp_path_factory.mktemp("single_nobn")
    train(make_cfg(base, "model.batch_norm=false", *STEPS))
    return base / "run"


def test_bf16_parameters_and_reduction_train_close_and_keep_fp32_weights(single_nobn, cfg_factory, tmp_path):
    # no BatchNorm: torch's CPU kernel takes no bf16 weights with fp32 running stats
    launch(
        cfg_factory("model.batch_norm=false", *STEPS, *FSDP2, "strategy.param_dtype=bf16", "strategy.reduce_dtype=bf16")
    )
    weights = last_weights(tmp_path / "run")
    assert all(w.dtype == torch.float32 for w in weights.values())  # the sharded master weights
    assert_same(weights, last_weights(single_nobn), rtol=0.05, atol=0.02)  # 4 steps of bf16 rounding


@pytest.mark.parametrize(
    "option",
    ["strategy.reshard_after_forward=2", "strategy.collectives=graph"],
    ids=["reshard-to-groups-of-2", "in-graph-uneven-rows"],
)
def test_four_ranks_match_single(single_nobn, tmp_path, option):
    """torchrun: 4 processes on this 2-core machine. reshard_after_forward=2 regathers from groups of 2 ranks; the
    in-graph route keeps torch.chunk's rows of 4 ranks, the head's 10 rows as 3, 3, 3 and 1."""
    proc = run_cli(
        str(ROOT / "train.py"),
        "debug=fast",
        "model.batch_norm=false",
        *STEPS,
        "strategy=fsdp",
        option,
        f"hydra.run.dir={tmp_path}/fsdp4",
        command=[sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=4"],
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert read_metrics(tmp_path / "fsdp4")["hparams"]["world_size"] == 4
    assert_same(last_weights(tmp_path / "fsdp4"), last_weights(single_nobn), rtol=1e-4, atol=1e-6)


# --- the in-graph route: collectives inside the compiled graph ------------------------------------------

GRAPH = ("strategy=fsdp", "trainer.devices=2", "strategy.collectives=graph")
CUDA_GRAPHS = ("trainer.compile=true", "trainer.compile_mode=reduce-overhead")


@pytest.mark.parametrize(
    "options",
    [GRAPH, ("strategy=fsdp", "trainer.devices=2", *CUDA_GRAPHS), (*GRAPH, "strategy.checkpoint_format=full")],
    ids=["eager", "auto-under-cuda-graphs", "full-checkpoints"],
)
def test_the_in_graph_route_trains_evaluates_and_saves_as_fsdp2(reference, cfg_factory, tmp_path, options):
    """Each rank's rows gathered by an op of the model (compiled: inside its graph, which `auto` picks under CUDA
    graphs): the same weights, BatchNorm statistics, evaluation and checkpoint names as FSDP2's hooks."""
    final = launch(cfg_factory(*STEPS, *options))
    assert_same(last_weights(tmp_path / "run"), last_weights(reference), rtol=1e-4, atol=1e-6)
    assert final["test_loss"] == pytest.approx(read_metrics(reference)["final"]["test_loss"], rel=1e-5)
    assert read_metrics(tmp_path / "run")["hparams"]["gradient_sync"] == "graph"
    assert read_metrics(reference)["hparams"]["gradient_sync"] == "hooks"
    full = "strategy.checkpoint_format=full" in options
    assert (tmp_path / "run/checkpoints/last.pt").is_file() == full
    assert (tmp_path / "run/checkpoints/last").is_dir() != full


def test_the_in_graph_route_clips_by_the_global_norm_averages_and_resumes_from_fsdp2(cfg_factory, tmp_path):
    """grad_clip below the gradients' norm (each rank's rows alone have a smaller one), an EMA, and a resume from
    FSDP2's sharded checkpoint of epoch 1 that ends where FSDP2 ends, momentum and average included."""
    common = (*STEPS[:-2], "trainer.max_epochs=2", "trainer.save_top_k=2", "trainer.grad_clip=0.05")
    common += ("trainer.ema.decay=0.5", "model.batch_norm=false", "data.batch_size=64")
    common += ("logger=[csv]", "trainer.log_every_n_steps=1")
    launch(cfg_factory(*common, *FSDP2, sub="hooks"))
    launch(cfg_factory(*common, *GRAPH, sub="graph"))
    hooks, graph = (ckpt.load_full(tmp_path / f"{d}/run/checkpoints/last") for d in ("hooks", "graph"))
    for key in ("model", "ema"):
        assert_same(graph[key], hooks[key], rtol=1e-4, atol=1e-6)
    norms = [[row["grad_norm"] for row in _steps_csv(tmp_path / f"{d}/run")] for d in ("hooks", "graph")]
    assert len(norms[1]) == 6 and min(norms[1]) > 0.05, norms  # the clip was active at every step
    assert norms[1] == pytest.approx(norms[0], rel=1e-4)
    (epoch1,) = (tmp_path / "hooks/run/checkpoints").glob("epoch1-*")
    launch(cfg_factory(*common, *GRAPH, f"trainer.resume={epoch1}", sub="resumed"))
    resumed = ckpt.load_full(tmp_path / "resumed/run/checkpoints/last")
    for key in ("model", "ema"):
        assert_same(resumed[key], hooks[key], rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize(
    "option, message",
    [
        (
            "strategy.shard_modules=blocks",
            "but strategy.shard_modules=blocks makes 2 units; set strategy.shard_modules=root",
        ),
        ("strategy.cpu_offload=true", "but the parameters then live on the CPU; drop strategy.cpu_offload"),
        ("strategy.reshard_after_forward=2", "but strategy.reshard_after_forward=2 regathers from groups of ranks"),
        (f"model._target_={__name__}.scalar_tiny_cnn", "but temperature has no rows (a scalar); keep each parameter"),
    ],
)
def test_the_in_graph_route_refuses_what_it_cannot_do_before_any_process(cfg_factory, option, message):
    with pytest.raises(ConfigError) as err:
        launch(cfg_factory(*GRAPH, option))
    assert message in str(err.value) and str(err.value).endswith("or set strategy.collectives=hooks")
    assert "\n" not in str(err.value)


def test_auto_takes_the_in_graph_route_only_under_cuda_graphs_for_a_model_it_can_shard_by_rows():
    fsdp = FSDP()
    assert fsdp.gathers_in_graph(TinyCNN(10), per_block=False, cuda_graphs=True)
    assert not fsdp.gathers_in_graph(TinyCNN(10), per_block=False, cuda_graphs=False)
    assert not fsdp.gathers_in_graph(TinyCNN(10), per_block=True, cuda_graphs=True)
    assert not fsdp.gathers_in_graph(scalar_tiny_cnn(10), per_block=False, cuda_graphs=True)
    assert not FSDP(cpu_offload=True).gathers_in_graph(TinyCNN(10), per_block=False, cuda_graphs=True)


@pytest.mark.parametrize("bucket", [True, False])
def test_the_in_graph_route_merges_its_collectives(one_rank_group, bucket):
    """strategy.bucket_collectives: inductor's compiled step holds one all-gather and one reduce-scatter for all of
    TinyCNN's parameters, not one of each per parameter (the NCCL launches each CUDA graph replays)."""
    import re

    from torch._inductor.utils import run_and_get_code

    torch._dynamo.reset()
    model = TinyCNN(10)
    params = len(list(model.parameters()))
    compiled = FSDP(collectives="graph", bucket_collectives=bucket).wrap(
        model, Context(torch.device("cpu"), False, torch.bfloat16, compile=True)
    )
    _, code = run_and_get_code(lambda: compiled(torch.randn(4, 3, 32, 32)).sum().backward())
    code = "\n".join(code)
    gathers = len(re.findall(r"_c10d_functional\.all_gather_into_tensor(?:_out)?\.default\(", code))
    scatters = len(re.findall(r"_c10d_functional\.reduce_scatter_tensor\.default\(", code))
    assert (gathers, scatters) == ((1, 1) if bucket else (params, params)), (gathers, scatters, params)
    torch._dynamo.reset()


# --- layout: compile per block before sharding, prefetch ---------------------------------------------


@pytest.fixture
def one_rank_group():
    """A process group of this process alone (fully_shard needs one); dynamo's recompile limit, which FSDP.wrap
    raises for the ranks' lifetime, is put back for the tests that follow."""
    limit = torch._dynamo.config.recompile_limit
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()
    torch._dynamo.config.recompile_limit = limit


@pytest.mark.parametrize("checkpointing", [False, True])
def test_each_block_is_compiled_then_sharded_and_prefetches_the_next(one_rank_group, checkpointing):
    from torch._dynamo.eval_frame import OptimizedModule
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import CheckpointWrapper
    from torch.distributed.fsdp import FSDPModule

    from src.models import cifar_resnet18

    model = cifar_resnet18(10)
    blocks = shard_targets(model, "auto")
    if checkpointing:
        apply_activation_checkpointing(model)
    core = FSDP(prefetch=True, shard_modules="blocks").wrap(
        model, Context(torch.device("cpu"), False, torch.bfloat16, compile=True)
    )
    units = [core.get_submodule(f"layer{i}.{j}") for i in range(1, 5) for j in range(2)]
    for unit, block in zip(units, blocks):
        # fully_shard took the compiled module: its FSDP class derives from OptimizedModule
        assert type(unit).__mro__[1:3] == (FSDPModule, OptimizedModule)
        inner = unit._orig_mod
        assert (inner._checkpoint_wrapped_module if checkpointing else inner) is block
        assert isinstance(inner, CheckpointWrapper) == checkpointing  # compile(AC(block)), as torchtitan
    assert isinstance(core, FSDPModule) and not isinstance(core, OptimizedModule)  # the root is not compiled
    assert not any(isinstance(m, FSDPModule) for m in (core.conv1, core.bn1, core.fc))  # the root's own layers
    assert torch._dynamo.config.recompile_limit >= len(units)

    def prefetched(module, direction):  # torch keeps the explicit prefetch lists on the module's FSDP state
        return [s._modules[0] for s in getattr(module._get_fsdp_state(), f"_states_to_{direction}_prefetch")]

    assert prefetched(core, "forward") == units[:1]
    assert [prefetched(u, "forward") for u in units] == [[u] for u in units[1:]] + [[]]
    assert [prefetched(u, "backward") for u in units] == [[]] + [[u] for u in units[:-1]]


def test_auto_shards_the_root_alone_when_the_blocks_are_small_and_compiles_its_forward_whole(one_rank_group):
    from torch._dynamo.eval_frame import OptimizedModule
    from torch.distributed.fsdp import FSDPModule

    from src.models import cifar_resnet18

    core = FSDP().wrap(cifar_resnet18(10), Context(torch.device("cpu"), False, torch.bfloat16, compile=True))
    blocks = [core.get_submodule(f"layer{i}.{j}") for i in range(1, 5) for j in range(2)]
    assert not any(isinstance(b, (OptimizedModule, FSDPModule)) for b in blocks)  # inside the root's one graph
    assert isinstance(core, FSDPModule)  # one unit: every parameter sharded, gathered once per step
    assert all(type(p).__name__ == "DTensor" for p in core.parameters())
    assert not any(k.startswith("_orig_mod") or "._orig_mod" in k for k in core.state_dict())


def test_the_root_unit_trains_as_one_compiled_graph_like_eager(one_rank_group):
    """Blocks of different shapes compiled one by one were a graph (and a guard check) each; as one unit the
    forward is a single graph, compiled once, computing what eager FSDP computes."""
    from torch._dynamo.utils import counters

    def steps(compile):
        torch.manual_seed(0)
        model = FSDP(shard_modules="root").wrap(
            TinyCNN(10), Context(torch.device("cpu"), False, torch.bfloat16, compile=compile)
        )
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        losses = []
        for step in range(3):
            x = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(step))
            loss = model(x).square().mean()
            loss.backward()
            opt.step()
            opt.zero_grad()
            losses.append(loss.item())
        return losses

    torch._dynamo.reset()
    counters.clear()
    compiled = steps(compile=True)
    assert counters["stats"]["unique_graphs"] == 1
    assert compiled == pytest.approx(steps(compile=False), rel=1e-5)


@pytest.mark.parametrize("width, per_block", [(2800, False), (3000, True)])
def test_auto_shards_each_block_from_32_mib_of_parameters_per_block(width, per_block):
    def block():
        return nn.Sequential(nn.Linear(width, width), nn.ReLU())

    with torch.device("meta"):  # width^2 + width fp32 parameters per block: 29.9 MiB at 2800, 34.3 MiB at 3000
        model = nn.Sequential(nn.Linear(8, width), nn.Sequential(block(), block()), nn.Linear(width, 10))
    strategy = FSDP()
    assert strategy.per_block(strategy.blocks(model)) is per_block
    assert FSDP(shard_modules="blocks").per_block(strategy.blocks(model)) is True
    assert FSDP(shard_modules="root").per_block(strategy.blocks(model)) is False


@pytest.mark.parametrize("compile, units", [(False, "blocks"), (True, "blocks"), (True, "root")])
def test_activation_checkpointing_and_compile_train_like_eager_fsdp(reference, cfg_factory, tmp_path, compile, units):
    """Compiled per block (blocks) or as one graph around the checkpointed blocks (root)."""
    options = (f"trainer.compile={str(compile).lower()}", f"strategy.shard_modules={units}")
    launch(cfg_factory(*STEPS, *FSDP2, AC_MODEL, *options, sub="ac"))
    # BatchNorm's running stats included: the recomputation in the backward does not count a batch twice
    assert_same(last_weights(tmp_path / "ac/run"), last_weights(reference), rtol=1e-4, atol=1e-6)
    # its checkpoint (written through CheckpointWrapper and compiled blocks) evaluates in a plain model
    best = ckpt.find(tmp_path / "ac/run/checkpoints", "best")
    plain = train(cfg_factory("train=false", f"ckpt_path={best}", "model=tiny_cnn", *STEPS, sub="plain"))
    assert plain["test_loss"] == pytest.approx(read_metrics(tmp_path / "ac/run")["final"]["test_loss"], rel=1e-5)


@pytest.mark.parametrize("strategy", ["single", "ddp"])
def test_activation_checkpointing_works_with_every_strategy(single_nobn, cfg_factory, tmp_path, strategy):
    devices = "trainer.devices=2" if strategy == "ddp" else "trainer.devices=1"
    launch(cfg_factory(AC_MODEL, "model.batch_norm=false", *STEPS, f"strategy={strategy}", devices))
    assert_same(last_weights(tmp_path / "run"), last_weights(single_nobn), rtol=1e-4, atol=1e-6)


def test_activation_checkpointing_gives_the_same_loss_gradients_and_state_names():
    torch.manual_seed(0)
    plain = TinyCNN(10, 3, width=8)
    checkpointed = copy.deepcopy(plain)
    apply_activation_checkpointing(checkpointed)
    assert sum(isinstance(m, nn.Sequential) for m in checkpointed.features.children()) == 0  # both blocks wrapped
    x, y = torch.randn(16, 3, 8, 8), torch.randint(0, 10, (16,))
    losses = []
    for model in (plain, checkpointed):
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        losses.append(loss)
    assert losses[0].item() == losses[1].item()
    grads = {n.replace("_checkpoint_wrapped_module.", ""): p.grad for n, p in checkpointed.named_parameters()}
    assert_same(grads, {n: p.grad for n, p in plain.named_parameters()})
    assert_same(checkpointed.state_dict(), plain.state_dict())  # same names; running stats counted once
    TinyCNN(10, 3, width=8).load_state_dict(checkpointed.state_dict())  # strict, both ways
    apply_activation_checkpointing(fresh := TinyCNN(10, 3, width=8))
    fresh.load_state_dict(plain.state_dict())


# --- sharded checkpoints ----------------------------------------------------------------------------

ARGS = (
    "debug=fast",
    "model.batch_norm=false",
    "trainer.limit_train_batches=null",
    "trainer.max_epochs=4",
    "data.batch_size=32",
    "trainer.deterministic=true",
    *FSDP2,
)


@pytest.fixture(scope="module")
def straight(tmp_path_factory):
    """fsdp on 2 ranks, uninterrupted: what an interrupted and resumed run must end with."""
    run = tmp_path_factory.mktemp("straight") / "run"
    proc = run_cli(*ARGS, f"hydra.run.dir={run}")
    assert proc.returncode == 0, proc.stderr[-3000:]
    return run


def test_each_rank_writes_its_own_shards_and_nothing_else_is_left(straight):
    from torch.distributed.checkpoint import FileSystemReader

    directory = straight / "checkpoints"
    assert sorted(p.name for p in directory.iterdir()) == ["best", "last"]  # no .pt, no .tmp or .old leftovers
    for name in ("best", "last"):
        assert sorted(p.name for p in (directory / name).iterdir()) == [
            ".metadata",
            "__0_0.distcp",
            "__1_0.distcp",
            "state.pt",
        ]
        # every tensor of the model and of the optimizer state is in two halves, each in its rank's file:
        # nothing was gathered on rank 0
        files = {}
        for index, where in FileSystemReader(directory / name).read_metadata().storage_data.items():
            files.setdefault(index.fqn, set()).add(where.relative_path)
        assert {k for k in files if k.startswith("model.")} == {f"model.{k}" for k in last_weights(straight)}
        tensors = {k: v for k, v in files.items() if k.startswith(("model.", "optimizer.state."))}
        assert len(tensors) == 12 and all(v == {"__0_0.distcp", "__1_0.distcp"} for v in tensors.values()), files
    assert ckpt.load(directory / "last")["strategy"] == "fsdp"


def _workers(launcher: subprocess.Popen) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(launcher.pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split() if "spawn_main" in Path(f"/proc/{p}/cmdline").read_text()]


def _kill_a_rank_after_the_first_checkpoint(run: Path, *extra: str) -> subprocess.Popen:
    proc = start_train(*ARGS, *extra, f"hydra.run.dir={run}")
    deadline = time.time() + 120
    while time.time() < deadline and ckpt.find(run / "checkpoints", "last") is None:
        time.sleep(0.02)
    workers = _workers(proc)
    assert workers, "no worker processes found"
    os.kill(workers[-1], signal.SIGKILL)
    return proc


def assert_same_result(run: Path, reference: Path, rel: float) -> None:
    a, b = read_metrics(reference)["final"], read_metrics(run)["final"]
    for key in ("test_loss", "test_top1", "best_val_top1"):
        assert b[key] == pytest.approx(a[key], rel=rel), key


def test_killed_rank_restarts_and_resumes_from_the_sharded_checkpoint(straight, tmp_path):
    proc = _kill_a_rank_after_the_first_checkpoint(tmp_path / "run", "trainer.max_restarts=1")
    out = proc.communicate(timeout=240)[0]
    assert proc.returncode == 0, out[-3000:]
    assert f"resumed from {tmp_path / 'run/checkpoints/last'}" in out
    assert_same_result(tmp_path / "run", straight, rel=1e-6)
    assert_same(last_weights(tmp_path / "run"), last_weights(straight))


def test_sharded_checkpoint_resumes_on_one_process(straight, tmp_path):
    """2 ranks write it, strategy=single reads both halves of every tensor (and of the optimizer state)."""
    proc = _kill_a_rank_after_the_first_checkpoint(tmp_path / "run")
    out = proc.communicate(timeout=240)[0]
    assert proc.returncode != 0 and not (tmp_path / "run/metrics.json").exists(), out[-3000:]
    resumed = run_cli(f"hydra.run.dir={tmp_path}/run", "strategy=single", "trainer.devices=1")
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert "resumed from" in resumed.stdout + resumed.stderr
    assert read_metrics(tmp_path / "run")["hparams"]["world_size"] == 1
    assert_same_result(tmp_path / "run", straight, rel=1e-4)  # other reduction order than 2 ranks
    # ~2e-6 seen; momentum lost on resume: 3e-2
    assert_near(last_weights(tmp_path / "run"), last_weights(straight), rel=1e-4)


def test_sharded_checkpoint_evaluates_with_single_and_exports_to_one_file(straight, cfg_factory, tmp_path):
    best = straight / "checkpoints/best"
    same = ("model.batch_norm=false", "data.batch_size=32")
    evaluated = launch(cfg_factory("train=false", f"ckpt_path={best}", *same, sub="dir"))
    final = read_metrics(straight)["final"]
    for key in ("test_loss", "test_top1", "test_top5", "val_loss"):
        assert evaluated[key] == pytest.approx(final[key], rel=1e-6), key
    out = tmp_path / "best.pt"
    proc = run_cli(str(best), str(out), command=[sys.executable, "-m", "src.run.export"], timeout=120)
    assert proc.returncode == 0 and proc.stdout == f"wrote {out}\n", proc.stderr
    exported = torch.load(out, weights_only=True)
    # the same tensors as single reads from the shards through DCP
    single = Single()
    single.wrap(TinyCNN(10, 1, width=64, batch_norm=False), Context(torch.device("cpu"), False, torch.bfloat16))
    state = single.load_checkpoint(best)
    assert_same(exported["model"], single.core.state_dict(), rtol=0, atol=0)
    assert exported["epoch"] == state["epoch"] and exported["optimizer"]["state"]
    from_file = launch(cfg_factory("train=false", f"ckpt_path={out}", *same, sub="file"))
    assert from_file["test_loss"] == evaluated["test_loss"]


def test_sharded_save_replaces_the_previous_checkpoint_only_once_the_new_one_is_complete(tmp_path):
    """In one process (DCP without a process group): a failed save keeps the previous checkpoint; a save caught
    between its two renames leaves the previous one where `find` looks."""
    directory = tmp_path / "checkpoints"

    def save(value: float, state: dict) -> None:
        ckpt.save_sharded({"model": {"w": torch.full((4,), value)}}, state, directory, ["best", "last"], True)

    def saved(name: str) -> float:
        return ckpt.load_full(ckpt.find(directory, name))["model"]["w"][0].item()

    save(1.0, {"epoch": 1})
    save(2.0, {"epoch": 2})
    assert saved("best") == saved("last") == 2.0 and ckpt.load(directory / "best")["epoch"] == 2
    with pytest.raises(Exception, match="pickle"):
        save(3.0, {"epoch": 3, "hook": lambda: None})  # the state fails after every shard is written
    assert saved("last") == 2.0 and sorted(p.name for p in directory.iterdir()) == [".last.tmp", "best", "last"]
    save(4.0, {"epoch": 4})  # clears what the failed save left
    assert sorted(p.name for p in directory.iterdir()) == ["best", "last"]
    (directory / "last").rename(directory / ".last.old")  # killed between the renames of the next save
    assert ckpt.find(directory, "last") == directory / ".last.old" and saved("last") == 4.0
    ckpt.save_full({"model": {"w": torch.full((4,), 5.0)}}, directory, ["best"])  # the other format replaces it
    assert ckpt.find(directory, "best") == directory / "best.pt" and saved("best") == 5.0


def test_a_rerun_in_the_run_directory_takes_the_sharded_checkpoints_config(straight, cfg_factory):
    from omegaconf import open_dict

    from src.state.resume import reconcile

    def in_straight(*overrides):
        cfg = cfg_factory("debug=fast", *overrides)
        with open_dict(cfg):
            cfg.paths.output_dir = str(straight)
        return cfg

    continued = reconcile(in_straight(), [])
    assert continued.trainer.max_epochs == 4 and continued.model.batch_norm is False
    with pytest.raises(ConfigError) as err:
        reconcile(in_straight("trainer.max_epochs=5"), ["trainer.max_epochs=5"])
    assert str(err.value).startswith(
        f"{straight / 'checkpoints/last'} was trained with other settings that "
        f"change the result: trainer.max_epochs=5 (checkpoint: 4)"
    )


def test_units_named_by_path_are_sharded_and_the_blocks_around_them_compiled():
    """shard_modules=[layer4]: resnet's last stage is FSDP's second unit (its gather overlaps the early stages),
    and each of the eight blocks is compiled on its own, those of the root included, FSDP's hooks between them."""
    import torchvision

    from src.strategies.fsdp import _compiled_parts

    with torch.device("meta"):
        model = torchvision.models.resnet18(num_classes=10)
    units = FSDP(shard_modules=["layer4"]).blocks(model)
    assert units == [model.layer4]
    names = {id(m): name for name, m in model.named_modules()}
    parts = [names[id(p)] for p in _compiled_parts(model, units)]
    assert parts == [f"layer{stage}.{i}" for stage in range(1, 5) for i in range(2)]
    # a class and a path together; the outermost match wins (layer4's blocks are inside it)
    both = FSDP(shard_modules=["layer4", "BasicBlock"]).blocks(model)
    assert both == [
        model.layer1[0],
        model.layer1[1],
        model.layer2[0],
        model.layer2[1],
        model.layer3[0],
        model.layer3[1],
        model.layer4,
    ]
    with pytest.raises(
        ConfigError, match=r"matches no module of the model; choose among the classes .* paths \['conv1'"
    ):
        FSDP(shard_modules=["layer9"]).blocks(model)


@pytest.mark.parametrize("collectives", ["hooks", "graph"])
def test_amp_on_the_cpu_trains_with_batchnorm_on_fp32_weights(reference, cfg_factory, tmp_path, collectives):
    """trainer.amp=true on the CPU: autocast computes in bf16 from the fp32 weights (BatchNorm's CPU kernel takes no
    bf16 weights, which FSDP2 gathered there before)."""
    launch(cfg_factory(*STEPS, *FSDP2[:2], "trainer.amp=true", f"strategy.collectives={collectives}"))
    assert_near(last_weights(tmp_path / "run"), last_weights(reference), rel=0.05)  # 4 steps of bf16 rounding
