"""ddp's sync_bn on two real gloo ranks: each rank's outputs, input gradients and running statistics, and the
ranks' summed parameter gradients, are those of torch's BatchNorm over the whole batch in one process, eager
and compiled as one graph."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from src.strategies import sync_batchnorm
from src.strategies.sync_batchnorm import GlobalBatchNorm, global_batch_norm


def make_model(momentum) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8, momentum=momentum), nn.ReLU(), nn.BatchNorm2d(8))
    with torch.no_grad():
        model[1].weight.uniform_(0.5, 1.5), model[1].bias.uniform_(-1, 1), model[3].running_var.fill_(2.0)
    return model.double()  # float64: any difference left is a wrong formula, not rounding


def batch(steps: int = 2):
    g = torch.Generator().manual_seed(1)
    # an offset and scale unlike the initial running statistics; rank 1's part is larger than rank 0's
    shapes = ((10, 3, 7, 7), (10, 8, 5, 5))
    return [[torch.randn(*s, generator=g, dtype=torch.float64) * 2 + 3 for s in shapes] for _ in range(steps)]


SPLIT = 4  # rank 0 holds samples [:4], rank 1 [4:]


def step(model, x, target):
    x = x.clone().requires_grad_(True)
    y = model(x)
    (y * target).sum().backward()
    return y.detach(), x.grad


def rank_main(rank: int, init: str, out: str, momentum, compiled: bool, own_gradient: bool) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    if own_gradient:  # the route of torch releases that register no gradient for the functional all-reduce
        sync_batchnorm._ALL_REDUCE_HAS_GRADIENT = False
    try:
        model = global_batch_norm(make_model(momentum))
        run = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
        part = slice(0, SPLIT) if rank == 0 else slice(SPLIT, None)
        results = [step(run, x[part], t[part]) for x, t in batch()]
        grads = {k: p.grad for k, p in model.named_parameters()}
        torch.save({"results": results, "grads": grads, "state": model.state_dict()}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("momentum", "compiled", "own_gradient"),
    [(0.4, False, False), (0.4, True, False), (None, False, False), (0.4, False, True), (None, True, True)],
)
def test_two_ranks_compute_batchnorm_of_the_whole_batch(tmp_path, momentum, compiled, own_gradient):
    init = f"file://{tmp_path}/store"
    mp.spawn(rank_main, args=(init, str(tmp_path), momentum, compiled, own_gradient), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]

    reference = make_model(momentum)
    for i, (x, t) in enumerate(batch()):
        y, grad_x = step(reference, x, t)
        for r, part in enumerate((slice(0, SPLIT), slice(SPLIT, None))):
            got_y, got_grad = ranks[r]["results"][i]
            torch.testing.assert_close(got_y, y[part], rtol=1e-10, atol=1e-10)
            torch.testing.assert_close(got_grad, grad_x[part], rtol=1e-10, atol=1e-10)
    for name, p in reference.named_parameters():
        summed = ranks[0]["grads"][name] + ranks[1]["grads"][name]  # what ddp's all-reduce adds up
        torch.testing.assert_close(summed, p.grad, rtol=1e-10, atol=1e-10)
    for key, value in reference.state_dict().items():
        for r in range(2):
            torch.testing.assert_close(ranks[r]["state"][key], value, rtol=1e-10, atol=1e-10)


def test_conversion_keeps_parameters_buffers_and_keys():
    model = make_model(0.1)
    model[1].weight.requires_grad_(False)
    before = dict(model.state_dict(keep_vars=True))
    converted = global_batch_norm(model)
    assert isinstance(converted[1], GlobalBatchNorm) and isinstance(converted[3], GlobalBatchNorm)
    after = converted.state_dict(keep_vars=True)
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    assert converted[1].weight.requires_grad is False and converted[1].momentum == 0.1
