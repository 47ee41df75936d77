"""trainer.ema: the weights' moving average follows its formula, is the same under single, ddp and fsdp, resumes bit
for bit from full and sharded checkpoints, and is what val/test, best.pt's evaluation and exports use."""

from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file
from torch import nn

from src.run.export import export
from src.run.launch import main as launch
from src.run.trainer import train
from src.state.checkpoint import find, load_full, save_atomic
from src.strategies.ema import EMA, lerp_update
from tests.conftest import read_metrics

EXACT = ("trainer.deterministic=true",)


def test_the_average_follows_a_reference_loop_and_swaps_in_and_out_bit_for_bit():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 3))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    decay, every = 0.75, 2
    ema = EMA(model, decay, every)
    reference = {k: v.double() if v.is_floating_point() else v.clone() for k, v in model.state_dict().items()}
    for step in range(1, 8):
        model(torch.randn(16, 4)).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        ema.update(step)
        if step % every == 0:  # float tensors (weights, BatchNorm stats) averaged, the counter copied
            for k, v in model.state_dict().items():
                reference[k] = decay * reference[k] + (1 - decay) * v.double() if v.is_floating_point() else v.clone()
    raw = {k: v.clone() for k, v in model.state_dict().items()}
    with ema.swapped():
        averaged = {k: v.clone() for k, v in model.state_dict().items()}
    for k, v in reference.items():
        torch.testing.assert_close(averaged[k].to(v.dtype), v, rtol=1e-6, atol=1e-7, msg=k)
    assert averaged["1.num_batches_tracked"] == 6 and raw["1.num_batches_tracked"] == 7  # copied at step 6
    assert not torch.allclose(averaged["0.weight"], raw["0.weight"])
    assert all(torch.equal(model.state_dict()[k], raw[k]) for k in raw)  # the model's own weights are back


def test_decay_zero_is_the_weights_themselves_bit_for_bit():
    average, weights = [torch.randn(5, 3), torch.randn(7)], [torch.randn(5, 3), torch.randn(7)]
    lerp_update(average, weights, 0.0)
    assert all(torch.equal(a, w) for a, w in zip(average, weights))


def test_a_run_with_decay_zero_saves_an_average_equal_to_its_weights_and_one_without_saves_none(cfg_factory, tmp_path):
    train(cfg_factory("trainer.ema.decay=0", sub="zero"))
    train(cfg_factory(sub="off"))
    zero, off = (torch.load(tmp_path / f"{s}/run/checkpoints/last.pt", weights_only=True) for s in ("zero", "off"))
    assert zero["ema_decay"] == 0 and all(torch.equal(v, zero["model"][k]) for k, v in zero["ema"].items())
    assert "ema" not in off and off["ema_decay"] is None
    assert read_metrics(tmp_path / "off/run")["hparams"]["ema_decay"] is None


# SAME_STEPS of tests/strategies/test_strategies.py over two epochs: 8 optimizer steps of a 64-sample global batch
SAME_STEPS = ("model.batch_norm=false", "scheduler=constant", "trainer.limit_train_batches=4", "data.batch_size=64")
AVERAGED = (*SAME_STEPS, "trainer.max_epochs=2", "trainer.ema.decay=0.5", "trainer.ema.every_n_steps=3", *EXACT)


@pytest.mark.slow
def test_single_ddp_and_fsdp_keep_the_same_average_and_fsdp_resumes_its_shards_exactly(cfg_factory, tmp_path):
    train(cfg_factory(*AVERAGED, sub="single"))
    single = load_full(tmp_path / "single/run/checkpoints/last.pt")
    assert not all(torch.equal(v, single["model"][k]) for k, v in single["ema"].items())  # updated at steps 3, 6
    for strategy in ("ddp", "fsdp"):
        top_k = ("trainer.save_top_k=2",) if strategy == "fsdp" else ()  # keeps epoch 1's checkpoint to resume from
        launch(cfg_factory(*AVERAGED, f"strategy={strategy}", "trainer.devices=2", *top_k, sub=strategy))
        other = load_full(find(tmp_path / strategy / "run/checkpoints", "last"))
        assert other["ema"].keys() == single["ema"].keys()
        for k, v in single["ema"].items():  # the tolerance of the strategies' weight comparisons
            torch.testing.assert_close(other["ema"][k], v, rtol=1e-4, atol=1e-6, msg=f"{strategy} {k}")
    straight = tmp_path / "fsdp/run/checkpoints"
    (epoch1,) = straight.glob("epoch1-*")
    assert epoch1.is_dir() and load_full(epoch1)["ema"].keys() == single["ema"].keys()  # in the DCP shards
    launch(cfg_factory(*AVERAGED, "strategy=fsdp", "trainer.devices=2", f"trainer.resume={epoch1}", sub="resumed"))
    resumed = load_full(tmp_path / "resumed/run/checkpoints/last")
    last = load_full(straight / "last")
    for key in ("model", "ema"):  # the raw weights and their average, each bit for bit
        assert all(torch.equal(resumed[key][k], v) for k, v in last[key].items()), key
    epochs = [[row["val_loss"] for row in read_metrics(tmp_path / d / "run")["epochs"]] for d in ("fsdp", "resumed")]
    assert epochs[0] == epochs[1]  # evaluated with the average


@pytest.mark.parametrize("lookahead", [(), ("trainer.ema.ramp_power=3", "trainer.ema.copy_back=true")])
def test_a_resumed_run_ends_with_the_uninterrupted_runs_average(cfg_factory, tmp_path, lookahead):
    common = ("trainer.max_epochs=3", "trainer.save_top_k=3", "trainer.ema.decay=0.9", *lookahead, *EXACT)
    train(cfg_factory(*common, sub="a"))
    (epoch1,) = (tmp_path / "a/run/checkpoints").glob("epoch1-val_top1-*.pt")
    train(cfg_factory(*common, f"trainer.resume={epoch1}", sub="b"))
    a, b = (torch.load(tmp_path / f"{s}/run/checkpoints/last.pt", weights_only=True) for s in "ab")
    assert a["ema_decay"] == 0.9 and a["ema"].keys() == a["model"].keys()
    assert all(torch.equal(a["ema"][k], b["ema"][k]) for k in a["ema"])
    ma, mb = read_metrics(tmp_path / "a/run"), read_metrics(tmp_path / "b/run")
    assert [row["val_loss"] for row in mb["epochs"]] == [row["val_loss"] for row in ma["epochs"]]  # of the average


def test_val_test_best_and_an_evaluated_checkpoint_use_the_average(cfg_factory, tmp_path):
    trained = train(cfg_factory("trainer.max_epochs=1", "trainer.ema.decay=0.9", sub="train"))
    m = read_metrics(tmp_path / "train/run")
    assert m["hparams"]["ema_decay"] == 0.9
    # one epoch: best.pt is its checkpoint, so its final evaluation repeats the epoch's (of the average)
    assert m["epochs"][0]["val_loss"] == trained["val_loss"]
    best = tmp_path / "train/run/checkpoints/best.pt"
    evaluated = train(cfg_factory("train=false", f"ckpt_path={best}", sub="eval"))
    assert evaluated["test_loss"] == trained["test_loss"] and evaluated["val_loss"] == trained["val_loss"]
    state = torch.load(best, weights_only=True)
    raw = tmp_path / "raw.pt"  # the same checkpoint without its average: its raw weights evaluate otherwise
    save_atomic({k: v for k, v in state.items() if k not in ("ema", "ema_decay")}, raw)
    assert train(cfg_factory("train=false", f"ckpt_path={raw}", sub="raw"))["test_loss"] != trained["test_loss"]
    export(best, tmp_path / "best.safetensors", "safetensors")  # the evaluated weights: the average
    exported = load_file(tmp_path / "best.safetensors")
    assert exported.keys() == state["ema"].keys() and all(torch.equal(v, state["ema"][k]) for k, v in exported.items())
