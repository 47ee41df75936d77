"""Data wait: the host's (time spent getting the next batch) and, on CUDA, the GPU's (time the GPU went without
a step's work between the steps), against sleeps of known length."""

from __future__ import annotations

import json
import time

import pytest
import torch

from src.run.meter import CropProbe, EpochMeter

CPU_DEVICE = torch.device("cpu")


def _epoch(meter: EpochMeter, items: int, fetch_sec: float, step) -> dict:
    """An epoch of `items` fetches that each sleep `fetch_sec` on the host, each followed by `step()`."""

    def batches():
        for _ in range(items):
            time.sleep(fetch_sec)
            yield 1

    it = batches()
    while meter.next(it) is not None:
        step()
        meter.add(torch.zeros(2, dtype=torch.float64, device=meter.device), 1)
    return meter.finish(items)


def test_host_data_wait_is_the_time_spent_fetching():
    row = _epoch(EpochMeter(torch.device("cpu"), 1), 5, 0.04, lambda: time.sleep(0.04))
    assert 0.4 <= row["data_wait_fraction"] <= 0.6
    assert "gpu_data_wait_fraction" not in row  # no GPU, no GPU figure


def test_a_cpu_run_reports_host_data_wait_in_the_epoch_line_and_metrics(cfg_factory, tmp_path, caplog):
    from src.run.trainer import train

    with caplog.at_level("INFO", logger="ddplab"):
        final = train(cfg_factory("debug=fast", "trainer.max_epochs=2"))
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("epoch 2/2"))
    second = json.loads((tmp_path / "run" / "metrics.json").read_text())["epochs"][1]
    assert f"data wait {100 * second['data_wait_fraction']:.0f}%," in line
    assert 0 < final["data_wait_fraction"] < 1 and "gpu_data_wait_fraction" not in final
    assert "(GPU" not in line


@pytest.mark.parametrize(
    "loader, workers, from_disk, wait, says",
    [  # rows of bench/results/{decode-default*,resnet50-split-loop_2xh200_2026-11-27,resnet50-ddp4-regions*}.md
        ("decode-cpu", 4, True, 0.55, "only 4 CPU workers per process decode: try data.decode=dali (NVIDIA DALI"),
        ("decode-cpu", 8, True, 0.29, "its 8 CPU workers per process do not keep up: give each GPU more CPUs"),
        ("decode-cpu", 15, True, 0.25, "or data.crop=device (the workers only decode and cut the crops"),
        # ddp x4 on the CPU-bound 4 x H200 host of decode-default-more-hosts: crop=device 1.24x; 4 x H100 host B 1.08x
        ("decode-cpu", 15, True, 0.14, "15 CPU workers per process nearly keep up: try data.crop=device (the"),
        ("decode-cpu", 15, True, 0.084, "nearly keep up: try data.crop=device"),
        ("decode-cpu", 15, True, 0.047, None),  # ddp x4 where crop=device was 0.95x (dali-anchor, the same call)
        ("decode-cpu", 4, True, 0.14, None),  # too few workers for the crop=device band: from a fifth on
        ("decode-cpu-crop-device", 15, True, 0.14, None),
        ("decode-cpu-crop-device", 15, True, 0.30, "--max-side 256"),
        # 8 CPUs, one H200, no DALI: the crops moved to the GPU and it still waited (decode-default-dali)
        ("decode-cpu-crop-device", 7, True, 0.32, "or data.decode=dali (1.44x CPU decoding with 7 workers per GPU"),
        ("decode-cpu", 11, True, 0.24, "or data.crop=device (the workers only decode and cut the crops: ~1.3x"),
        ("decode-split", 8, True, 0.37, "with 8 CPU workers per process, data.decode=cpu may be faster"),
        ("decode-split", 4, True, 0.31, "give each GPU more CPUs"),
        ("decode-gpu", 3, True, 0.14, None),  # the default with 3 workers: 0.69x the ceiling, GPU data wait 14 %
        ("decode-gpu", 3, True, 0.87, "from 6 CPU workers per GPU, data.decode=auto decodes on the CPU"),
        ("decode-gpu", 3, True, 0.30, "or data.decode=dali (NVIDIA DALI: 1.25x at 4 CPUs per GPU)"),
        ("decode-dali", 3, True, 0.18, None),  # 4 CPUs, one H200: 0.985x DALI's own pipeline (dali-engine)
        ("decode-dali", 3, True, 0.35, "DALI's 3 threads per process do not keep up: give each GPU more CPUs"),
        ("workers", 8, False, 0.40, "data.loader=resident"),
        ("decode-cpu", 0, True, 0.90, "data.num_workers=auto starts a worker per CPU"),
        ("decode-gpu", 0, True, 0.90, "data.num_workers=0 decodes in the training process"),
        ("decode-cpu", 15, True, 0.06, None),  # 0.95x the ceiling: nothing to change
        ("resident", 0, False, 0.50, None),  # the resident loader's wait is its augmentation kernels
        ("mine", 4, True, 0.50, None),  # a loader it does not know: no advice
        ("classic", 8, True, 0.40, None),  # a name from before LoaderPlan: no advice
    ],
)
def test_a_data_bound_gpu_run_ends_with_what_to_change(loader, workers, from_disk, wait, says):
    from src.reporting.results import data_bound_advice

    advice = data_bound_advice({"gpu_data_wait_fraction": wait}, loader, workers, from_disk)
    if says is None:
        assert advice is None
    else:
        assert advice.startswith(f"the GPU waited for data {100 * wait:.0f}% of the time: ") and says in advice
        assert "\n" not in advice and advice.endswith("'Recipe: an ImageNet-style folder at GPU speed'")
    assert data_bound_advice({"data_wait_fraction": 0.9}, loader, workers, from_disk) is None  # CPU: no GPU figure
    assert workers < 15 or "decode=dali" not in (advice or "")  # CPU decoding is as fast from 15 workers per GPU


def _gpu_sleep(seconds: float) -> None:
    """Queue about `seconds` of GPU work: a spin kernel, its cycles per second measured on this GPU once two
    measurements agree (an idle GPU's clock ramps up: its first cycles can run several times slower)."""
    global _CYCLES_PER_SEC
    if "_CYCLES_PER_SEC" not in globals():
        rates = []
        while len(rates) < 3 or abs(rates[-1] - rates[-2]) > 0.02 * rates[-1] and len(rates) < 50:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            torch.cuda._sleep(20_000_000)
            end.record()
            end.synchronize()
            rates.append(20_000_000 / (start.elapsed_time(end) / 1000))
        _CYCLES_PER_SEC = rates[-1]
    torch.cuda._sleep(int(seconds * _CYCLES_PER_SEC))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_data_wait_counts_only_the_time_the_gpu_has_no_step_to_run():
    device = torch.device("cuda", torch.cuda.current_device())
    _gpu_sleep(0)  # measure the spin kernel's clock before the clocks start
    # the host fetches (20 ms) while the GPU runs the previous step (100 ms): the host waits, the GPU does not
    busy = _epoch(EpochMeter(device, 1), 6, 0.02, lambda: _gpu_sleep(0.1))
    assert busy["data_wait_fraction"] > 0.1, busy
    assert busy["gpu_data_wait_fraction"] < 0.08, busy  # the first fetch only: 20 of ~620 ms
    # fetches (50 ms) longer than the steps (5 ms): the GPU idles through most of each fetch
    starved = _epoch(EpochMeter(device, 1), 10, 0.05, lambda: _gpu_sleep(0.005))
    assert starved["gpu_data_wait_fraction"] > 0.75, starved
    assert abs(starved["gpu_data_wait_fraction"] - starved["data_wait_fraction"]) < 0.1, starved


def test_the_running_loss_after_a_mid_epoch_resume_counts_the_resumed_samples():
    resumed = torch.tensor([10.0, 3.0, 10.0], dtype=torch.float64)  # loss sum 10 over 10 samples: mean 1
    meter = EpochMeter(torch.device("cpu"), 1, resumed)
    meter.add(torch.tensor([8.0, 1.0], dtype=torch.float64), 4)  # 4 more samples at mean 2
    assert meter.running_loss() == pytest.approx(18 / 14)  # was: 18 / 4, the resumed sum over this run's samples


class _At:
    """A moment on a GPU's timeline, read as a CUDA event is (elapsed_time in ms), for CropProbe's arithmetic."""

    def __init__(self, seconds: float):
        self.seconds = seconds

    def elapsed_time(self, later: _At) -> float:
        return 1000 * (later.seconds - self.seconds)

    def synchronize(self) -> None:
        pass


@pytest.mark.parametrize(
    "micro_batches, skip, end",
    [(300, 20, 80), (30, 10, 30), (11, 3, 11), (10, 3, None)],  # 10: 7 past the skip, under MIN_WINDOW: no verdict
)
def test_the_crop_probe_measures_past_the_first_micro_batches_and_agrees_once(micro_batches, skip, end):
    """Each fetch: `gap` s without GPU work, then 1 s of step; the skipped fetches (compilation) wait 100 s."""
    probe, now, done = CropProbe(micro_batches), 0.0, []
    for k in range(1, micro_batches + 1):
        gap = 100.0 if k <= skip else 0.25 if k % 2 else 0.05
        before, now = _At(now), now + gap
        done.append(probe.add(before, _At(now)))
        now += 1.0
    assert done == [k == end for k in range(1, micro_batches + 1)]
    if end:
        gaps = [0.25 if k % 2 else 0.05 for k in range(skip + 1, end + 1)]
        span = sum(gaps) + len(gaps) - 1  # from the window's first fetch to the end of its last
        assert probe.wait_fraction(CPU_DEVICE, 1) == pytest.approx(sum(gaps) / span)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_the_crop_probe_reads_the_gpus_wait_past_a_slow_start():
    """Real CUDA events: 20 starved fetches (compilation, say) then 40 the GPU does not wait for; and 20 quick
    fetches and steps, then 40 starved ones."""
    device = torch.device("cuda", torch.cuda.current_device())
    _gpu_sleep(0)
    for slow_first in (True, False):
        probe = CropProbe(60)  # skips 20, measures 40
        meter = EpochMeter(device, 1, probe=probe)

        def batches(slow_first=slow_first):
            for k in range(60):
                time.sleep(0.03 if (k < 20) == slow_first else 0.002)
                yield k

        it, verdicts = batches(), []
        while (k := meter.next(it)) is not None:
            verdicts.append(meter.probed)
            _gpu_sleep(0.03 if slow_first and k >= 20 else 0.002)
        assert verdicts == [k == 59 for k in range(60)]
        wait = probe.wait_fraction(device, 1)
        assert (wait < 0.08) if slow_first else (wait > 0.75), (slow_first, wait)
