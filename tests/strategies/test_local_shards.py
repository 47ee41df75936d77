"""An FSDP optimizer stepped over the local shards computes what torch's optimizer over the DTensor parameters
computes, and torch's state-dict helpers save and load it as that optimizer."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

from src.models import TinyCNN
from src.strategies import FSDP, Context
from src.strategies.base import _dcp
from src.strategies.local_shards import step_on_local_shards

OPTIMIZERS = {
    "sgd": lambda params: torch.optim.SGD(params, lr=0.1, momentum=0.9, nesterov=True, weight_decay=5e-4),
    "adamw": lambda params: torch.optim.AdamW(params, lr=0.01, weight_decay=0.05),
}


@pytest.fixture
def one_rank_group():
    """fully_shard needs a process group (two ranks: tests/strategies/test_fsdp.py's runs)."""
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def fsdp_model(seed: int = 0):
    torch.manual_seed(seed)
    return FSDP(shard_modules="root").wrap(TinyCNN(10), Context(torch.device("cpu"), False, torch.bfloat16))


def train(model, optimizer, steps: range):
    scheduler = getattr(optimizer, "scheduler", None)
    for step in steps:
        x = torch.randn(8, 3, 16, 16, generator=torch.Generator().manual_seed(step))
        model(x).square().mean().backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if scheduler:
            scheduler.step()


def with_schedule(optimizer):
    optimizer.scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1 / (step + 1))
    return optimizer


def weights(model) -> dict[str, torch.Tensor]:
    return {k: v.full_tensor().clone() for k, v in model.state_dict().items() if hasattr(v, "full_tensor")}


@pytest.mark.parametrize("fused", [False, True])  # fused: torch's fused kernels (CUDA's, here CPU's)
@pytest.mark.parametrize("name", OPTIMIZERS)
def test_the_local_step_equals_torchs_step_over_dtensors_and_saves_the_same_state(one_rank_group, name, fused):
    plain, local = fsdp_model(), fsdp_model()
    plain_opt = with_schedule(OPTIMIZERS[name](plain.parameters()))
    local_opt = with_schedule(step_on_local_shards(OPTIMIZERS[name](local.parameters()), fused=fused))
    train(plain, plain_opt, range(3))
    train(local, local_opt, range(3))
    exact = {"rtol": None if fused else 0, "atol": None if fused else 0}  # fused kernels round differently
    assert_equal(weights(local), weights(plain), **exact)
    assert local_opt.param_groups[0]["lr"] == plain_opt.param_groups[0]["lr"] == plain_opt.defaults["lr"] / 4
    saved_plain = _dcp().get_state_dict(plain, plain_opt)[1]
    saved_local = _dcp().get_state_dict(local, local_opt)[1]
    assert_equal(flat(saved_local["state"]), flat(saved_plain["state"]), **exact)
    assert saved_local["param_groups"] == saved_plain["param_groups"]


@pytest.mark.parametrize("name", OPTIMIZERS)
def test_a_checkpoint_loaded_into_a_fresh_run_continues_as_the_saved_one(one_rank_group, name):
    saved, resumed = fsdp_model(), fsdp_model(seed=1)
    saved_opt = step_on_local_shards(OPTIMIZERS[name](saved.parameters()), fused=False)
    train(saved, saved_opt, range(3))
    full = _dcp().StateDictOptions(full_state_dict=True)
    model_state, optim_state = copy.deepcopy(_dcp().get_state_dict(saved, saved_opt, options=full))  # last.pt's
    resumed_opt = step_on_local_shards(OPTIMIZERS[name](resumed.parameters()), fused=False)
    _dcp().set_state_dict(
        resumed, resumed_opt, model_state_dict=model_state, optim_state_dict=optim_state, options=full
    )
    train(saved, saved_opt, range(3, 6))
    train(resumed, resumed_opt, range(3, 6))
    assert_equal(weights(resumed), weights(saved))


def flat(state: dict) -> dict[str, torch.Tensor]:
    return {
        f"{k}.{n}": (t.full_tensor() if hasattr(t, "full_tensor") else t)
        for k, s in state.items()
        for n, t in s.items()
    }


def assert_equal(a: dict, b: dict, rtol=0, atol=0) -> None:
    """Equal to the bit, or within torch's default tolerance where rtol and atol are None."""
    assert a.keys() == b.keys()
    for k in a:
        torch.testing.assert_close(a[k], b[k], msg=k, rtol=rtol, atol=atol)
