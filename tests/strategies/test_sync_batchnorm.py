"""ddp's sync_bn on two real gloo ranks: each rank's outputs, input gradients and running statistics, and the
ranks' summed parameter gradients, are those of torch's BatchNorm over the whole batch in one process, eager
and compiled as one graph."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from src.strategies.sync_batchnorm import GlobalBatchNorm, global_batch_norm

SPLIT = 4  # rank 0 holds samples [:4] of each batch of 10, rank 1 the other 6


def make_model(momentum, dtype=torch.float64) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 8, 3), nn.BatchNorm2d(8, momentum=momentum), nn.ReLU(), nn.BatchNorm2d(8))
    with torch.no_grad():
        model[1].weight.uniform_(0.5, 1.5), model[1].bias.uniform_(-1, 1), model[3].running_var.fill_(2.0)
    return model.to(dtype)


def batches(offset: float, dtype=torch.float64, steps: int = 2) -> list[list[torch.Tensor]]:
    """Inputs and loss weights; the inputs' offset is large against their spread where `offset` is."""
    g = torch.Generator().manual_seed(1)
    shapes = ((10, 3, 7, 7), (10, 8, 5, 5))

    def draw(shape):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) + offset).to(dtype)

    return [[draw(shape) for shape in shapes] for _ in range(steps)]


def step(model, x, weights):
    x = x.clone().requires_grad_(True)
    y = model(x)
    (y * weights).sum().backward()
    return y.detach(), x.grad


def rank_main(rank: int, init: str, out: str, momentum, compiled: bool, dtype: torch.dtype, offset: float) -> None:
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=2)
    try:
        model = global_batch_norm(make_model(momentum, dtype))
        run = torch.compile(model, backend="aot_eager", fullgraph=True) if compiled else model
        part = slice(0, SPLIT) if rank == 0 else slice(SPLIT, None)
        results = [step(run, x[part], w[part]) for x, w in batches(offset, dtype)]
        grads = {k: p.grad for k, p in model.named_parameters()}
        torch.save({"results": results, "grads": grads, "state": model.state_dict()}, f"{out}/rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize(
    ("momentum", "compiled", "dtype", "offset", "tol"),
    [
        (0.4, False, torch.float64, 3.0, 1e-10),  # float64: any difference left is a wrong formula, not rounding
        (0.4, True, torch.float64, 3.0, 1e-10),
        (None, True, torch.float64, 3.0, 1e-10),  # momentum=None: torch's cumulative average
        # float32 inputs 1000 standard deviations from zero, where E[x^2] - E[x]^2 would lose the variance
        (0.4, False, torch.float32, 1000.0, 1e-3),
    ],
    ids=["float64", "float64-compiled", "cumulative-compiled", "float32-offset"],
)
def test_two_ranks_compute_batchnorm_of_the_whole_batch(tmp_path, momentum, compiled, dtype, offset, tol):
    mp.spawn(rank_main, args=(f"file://{tmp_path}/store", str(tmp_path), momentum, compiled, dtype, offset), nprocs=2)
    ranks = [torch.load(tmp_path / f"rank{r}.pt") for r in range(2)]

    reference = make_model(momentum)  # float64, one process, the whole batch
    for i, (x, w) in enumerate(batches(offset)):
        y, grad_x = step(reference, x.to(dtype).double(), w.to(dtype).double())
        for r, part in enumerate((slice(0, SPLIT), slice(SPLIT, None))):
            got_y, got_grad = ranks[r]["results"][i]
            torch.testing.assert_close(got_y.double(), y[part], rtol=tol, atol=tol)
            torch.testing.assert_close(got_grad.double(), grad_x[part], rtol=tol, atol=tol)
    for name, p in reference.named_parameters():
        if dtype == torch.float32 and name.startswith("0."):
            continue  # the convolution's weight gradient sums inputs of 1000 in float32: its own rounding
        summed = ranks[0]["grads"][name] + ranks[1]["grads"][name]  # what ddp's all-reduce adds up
        torch.testing.assert_close(summed.double(), p.grad, rtol=tol, atol=tol * max(1.0, p.grad.abs().max()))
    for key, value in reference.state_dict().items():
        for r in range(2):
            got = ranks[r]["state"][key]
            torch.testing.assert_close(got.to(value.dtype), value, rtol=tol, atol=tol * max(1.0, value.abs().max()))


def test_conversion_keeps_parameters_buffers_and_keys():
    model = make_model(0.1)
    model[1].weight.requires_grad_(False)
    before = dict(model.state_dict(keep_vars=True))
    converted = global_batch_norm(model)
    assert isinstance(converted[1], GlobalBatchNorm) and isinstance(converted[3], GlobalBatchNorm)
    after = converted.state_dict(keep_vars=True)
    assert after.keys() == before.keys() and all(after[k] is before[k] for k in before)
    assert converted[1].weight.requires_grad is False and converted[1].momentum == 0.1
