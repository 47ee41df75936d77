"""bench/bench.py: the CPU smoke mode runs every configuration, and its ratios are the JSON's own numbers."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from src.data.loader_plan import dali_installed
from tests.conftest import ROOT, make_env, run_cli
from tests.data.test_decode import write_tree

BENCH = [sys.executable, str(ROOT / "bench" / "bench.py")]
SMOKE_RUNS = {"ceiling-fp32", "single1-gpu", "single1-classic0", "ddp2-gpu", "ddp2-classic0"}
SCALING = {"ddp2-gpu": "single1-gpu", "ddp2-classic0": "single1-classic0"}


def bench(*args: str, timeout: int = 300) -> subprocess.CompletedProcess:
    return subprocess.run([*BENCH, *args], cwd=ROOT, capture_output=True, text=True, timeout=timeout)


def test_list_and_only_select_configurations():
    proc = bench("--smoke", "--list")
    assert proc.returncode == 0 and set(proc.stdout.split()) == SMOKE_RUNS
    proc = bench("--list", "--only", "ceiling-*,ddp2-*", "--workers", "4,8", "--compile", "both")
    ceilings = [
        "ceiling-fp32",
        "ceiling-bf16",
        "ceiling-bf16-cl",
        "ceiling-bf16-cl-compile",
        "ceiling-bf16-cl-cudagraphs",
    ]
    assert proc.stdout.split() == [
        *ceilings,
        "ddp2-gpu",
        "ddp2-classic4",
        "ddp2-classic8",
        "ddp2-gpu-eager",
        "ddp2-classic4-eager",
        "ddp2-classic8-eager",
    ]
    assert bench("--list", "--gpus", "1").stdout.split() == [*ceilings, "single1-gpu", "single1-classic8"]
    assert bench("--list", "--gpus", "8", "--only", "ddp*-gpu").stdout.split() == ["ddp2-gpu", "ddp4-gpu", "ddp8-gpu"]
    assert bench("--only", "nothing*").returncode == 2


@pytest.mark.skipif(torch.cuda.device_count() >= 2, reason="checks a machine with fewer GPUs than the runs need")
def test_runs_that_need_more_gpus_than_the_machine_has_stop_with_one_line():
    proc = bench("--only", "ceiling-fp32,ddp2-gpu")
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"bench.py: error: the selected runs need 2 CUDA GPU(s), this machine has {torch.cuda.device_count()}: "
        "lower --gpus or --only, or run --smoke (the CPU mode)"
    )
    assert "ceiling-fp32" not in proc.stdout  # nothing ran


@pytest.fixture(scope="module")
def smoke(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench") / "b.json"
    # a smaller image than the smoke's own 32 px, and a user's override: both must reach every run
    proc = bench("--smoke", "--image-size", "16", "--override", "seed=3", "--out", str(out))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc, json.loads(out.read_text()), out


def check_ratios(report: dict) -> None:
    runs = report["runs"]
    ips = {name: r["images_per_sec"] for name, r in runs.items()}
    found = {(x["kind"], x["run"]): x for x in report["ratios"]}
    loops = [name for name, r in runs.items() if r["kind"] == "loop"]
    assert len(found) == len(loops) + len(SCALING)
    for name in loops:
        x = found["vs_ceiling", name]
        assert x["reference"] == "ceiling-fp32"  # the only (so the best) fp32 ceiling of the smoke mode
        assert x["value"] == pytest.approx(ips[name] / (ips["ceiling-fp32"] * runs[name]["gpus"]))
    for name, single in SCALING.items():
        x = found["vs_single", name]
        assert x["reference"] == single and x["value"] == pytest.approx(ips[name] / ips[single])


@pytest.mark.slow
def test_smoke_runs_everything_and_computes_ratios(smoke):
    proc, report, _ = smoke
    runs = report["runs"]
    assert set(runs) == SMOKE_RUNS
    for name, r in runs.items():
        assert r["ok"] and r["images_per_sec"] > 0, (name, r.get("error"))
    for name in SMOKE_RUNS - {"ceiling-fp32"}:
        r = runs[name]
        assert len(r["epoch_sec"]) == 2 and r["hparams"]["world_size"] == r["gpus"]
        assert r["hparams"]["loader"] == ("resident" if name.endswith("-gpu") else "workers")
        assert r["hparams"]["per_device_batch"] == 64
        assert not {"tflops_per_gpu", "peak_mem_gb", "mfu"} & set(r)  # CPU: no per-GPU figures
        assert "data.shape=[3,16,16]" in r["overrides"] and r["overrides"][-1] == "seed=3"
        assert r["hparams"]["seed"] == 3  # the override won over the bench's own choices
    assert report["data"] == "synthetic 1024x3x16x16"
    assert runs["ceiling-fp32"]["precision"] == "fp32" and len(runs["ceiling-fp32"]["window_sec"]) >= 2
    assert "--smoke" in report["command"] and report["torch_version"]
    head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    assert report["git_commit"] == head and isinstance(report["git_dirty"], bool)  # the code measured
    assert report["cpus"] == os.cpu_count() and "cpu_model" in report and report["cpus_usable"]  # the host, too
    assert all(r["cpus"] == os.cpu_count() for r in runs.values())
    check_ratios(report)
    tail = proc.stdout.splitlines()[-10:]  # the table is at the end of stdout
    assert any(line.startswith("ddp2-gpu ") for line in tail) and "written:" in tail[-1]
    header = next(line for line in proc.stdout.splitlines() if line.startswith("ddplab bench | "))
    model = f" ({report['cpu_model']})" if report["cpu_model"] else ""
    assert f"| no GPU (cpu) | {os.cpu_count()} CPUs{model} | torch " in header, header
    assert any(line.startswith("run ") and line.endswith("peak GB   MFU  pass start s") for line in tail)


def test_a_loop_run_trains_the_epochs_its_minimum_of_timed_steps_needs():
    """A GPU bench run times at least 100 steps after its warm-up epoch: where --epochs would time fewer, the
    run trains more epochs (here a minimum of 20 on the CPU)."""
    overrides = ["model=tiny_cnn", "model.width=16", "data=synthetic", "data.num_samples=512", "data.shape=[3,8,8]"]
    overrides += ["data.num_test=64", "trainer.device=cpu", "data.batch_size=64", "trainer.max_epochs=2"]
    proc = bench("--one", json.dumps({"kind": "loop", "overrides": overrides, "min_timed_steps": 20}), timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    steps, timed = result["steps_per_epoch"], result["timed_steps"]
    assert timed >= 20 > timed - steps and len(result["epoch_sec"]) == 1 + timed // steps


@pytest.mark.slow
def test_merge_recomputes_ratios_from_split_files(smoke, tmp_path):
    _, report, _ = smoke
    parts = []
    for i, keep in enumerate((lambda n: n.startswith("ddp2"), lambda n: not n.startswith("ddp2"))):
        part = tmp_path / f"part{i}.json"
        part.write_text(
            json.dumps({**report, "runs": {n: r for n, r in report["runs"].items() if keep(n)}, "ratios": []})
        )
        parts.append(str(part))
    proc = bench("--merge", *parts, "--out", str(tmp_path / "merged.json"), timeout=60)
    assert proc.returncode == 0, proc.stderr
    merged = json.loads((tmp_path / "merged.json").read_text())
    assert set(merged["runs"]) == SMOKE_RUNS and len(merged["merged_from"]) == 2
    check_ratios(merged)


def strategies_table(out, *variants: str) -> list[str]:
    """The command of bench/strategies_table.py with these variants, two short epochs each, the table at `out`."""
    variants = [f"--variant={v}" for v in variants]
    return [
        sys.executable,
        str(ROOT / "bench/strategies_table.py"),
        "--epochs=2",
        "--min-timed-steps=0",
        f"--out={out}",
        *variants,
        "debug=fast",
    ]


def test_strategies_table_marks_what_runs_out_of_memory_and_reports_what_fits(tmp_path):
    """bench/strategies_table.py --variant ...: a row per variant from its own metrics.json; a variant that runs
    out of memory (a model that does on this CPU, tests/run/test_oom.py) is a row saying so, with train.py's line."""
    out = tmp_path / "why.md"
    proc = subprocess.run(
        strategies_table(
            out, "fits:strategy=single", "hungry:strategy=single model._target_=tests.run.test_oom.HungryCNN"
        ),
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    results = {r["variant"]: r for r in json.loads(out.with_suffix(".json").read_text())}
    assert results["fits"]["status"] == "completed" and results["hungry"]["status"] == "out_of_memory"
    rows = {line.split(" | ")[0].lstrip("| "): line for line in out.read_text().splitlines() if line.startswith("| ")}
    final = results["fits"]["metrics"]["final"]
    assert f"| yes | {final['images_per_sec']:,.0f} | {final['peak_host_mem_gb']:.1f} (host) |" in rows["fits"]
    assert "| **out of memory** |" in rows["hungry"]
    assert f"- hungry: {results['hungry']['error']}" in out.read_text()
    assert results["hungry"]["error"].startswith("CPU out of memory in a training step on rank 0")


def test_strategies_table_keeps_the_rows_of_finished_variants_when_it_is_stopped(tmp_path):
    """The table is written after each variant: a call stopped during a long variant (a device call's time
    limit, Ctrl-C) keeps what finished, and says how much that is. The long variant's train.py stops with it."""
    out = tmp_path / "t.md"
    cmd = strategies_table(out, "short:strategy=single", "long:strategy=single trainer.max_epochs=1000")
    proc = _start(cmd)
    sid = None
    try:
        deadline = time.time() + 240
        while not out.with_suffix(".json").is_file() and time.time() < deadline and proc.poll() is None:
            time.sleep(0.5)
        time.sleep(2)  # well into the long variant
        assert proc.poll() is None, "the long variant should still be running"
        sid = os.getsid(_children(proc.pid)[0])  # the long variant's train.py
        _stop_and_check(proc, sid, "strategies_table.py")
    finally:
        _kill_groups(proc, sid)
    (short,) = json.loads(out.with_suffix(".json").read_text())
    assert short["variant"] == "short" and short["status"] == "completed"
    text = out.read_text()
    assert (
        text.startswith("# Strategies (so far: 1 of 2 variants)") and "| short | 1 |" in text and "| long |" not in text
    )


def test_each_decode_choice_runs_its_loader_alone(tmp_path):
    """--decode cpu,cpudecode,cpuauto,split,dali: the workers crop (classic), only decode with the training process
    cropping (cpudecode), crop where data.crop=auto puts them (cpuauto), share each batch with GPU-decoding workers
    (split; here those decode on the CPU device), or DALI decodes in the training process (where installed); each
    loader-* run reads, decodes and crops real JPEGs, and says which loader it measured."""
    write_tree(tmp_path / "tree", per_class=(32, 4))
    out = tmp_path / "b.json"
    decodes = "cpu,cpudecode,cpuauto,split" + (",dali" if dali_installed() else "")
    proc = bench(
        *("--smoke", "--decode", decodes, "--workers", "1", "--data-root", str(tmp_path / "tree")),
        *("--image-size", "16", "--batch", "4", "--loader-steps", "3", "--only", "loader-*", "--out", str(out)),
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    runs = json.loads(out.read_text())["runs"]
    assert {name: r["loader_name"] for name, r in runs.items()} == {
        "loader-classic1": "decode-cpu",
        "loader-cpudecode1": "decode-cpu-crop-device",
        "loader-cpuauto1": "decode-cpu",  # no GPU: the workers crop
        "loader-split1": "decode-split",
        **({"loader-dali1": "decode-dali"} if dali_installed() else {}),
    }
    assert all(r["ok"] and r["images_per_sec"] > 0 and 0 < r["pass_start_sec"] < 60 for r in runs.values())
    assert "data.crop=device" in runs["loader-cpudecode1"]["overrides"]
    assert "data.crop=workers" in runs["loader-classic1"]["overrides"]  # not auto's choice, which may move them
    assert not any(o.startswith("data.crop=") for o in runs["loader-cpuauto1"]["overrides"])
    assert "pass start s" in proc.stdout
    # --workers auto: the default's worker count for this host (the CPUs but one, at most 16)
    proc = bench(
        *("--smoke", "--decode", "auto", "--workers", "auto", "--data-root", str(tmp_path / "tree")),
        *("--image-size", "16", "--batch", "4", "--loader-steps", "3", "--only", "loader-*", "--out", str(out)),
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    (run,) = json.loads(out.read_text())["runs"].values()
    assert run["name"] == "loader-autoauto" and "data.num_workers=auto" in run["overrides"]
    assert run["loader_name"] == "decode-cpu" and run["workers"] == min(len(os.sched_getaffinity(0)) - 1, 16)


def test_loaders_at_once_sum_what_each_gpu_gets(tmp_path):
    """--gpus N adds loaderN-*: N loaders at once, one per device in a process of its own, timed from a common
    start; images/s is the sum of theirs. A loader that cannot start fails the run in one line, not a hang."""
    from tests.data.test_decode import write_tree

    write_tree(tmp_path / "tree", per_class=(32, 4))
    out = tmp_path / "b.json"
    common = ("--smoke", "--decode", "cpu", "--workers", "1", "--gpus", "2", "--image-size", "16", "--batch", "4")
    proc = bench(
        *common, "--data-root", str(tmp_path / "tree"), "--loader-steps", "4", "--only", "loader*", "--out", str(out)
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    runs = json.loads(out.read_text())["runs"]
    assert list(runs) == ["loader-classic1", "loader2-classic1"]
    both = runs["loader2-classic1"]
    assert both["ok"] and both["gpus"] == 2 and len(both["per_gpu_images_per_sec"]) == 2
    assert both["images_per_sec"] == pytest.approx(sum(both["per_gpu_images_per_sec"]))
    assert both["images"] == 2 * 4 * 4 and both["workers"] == 1
    for split in ("train", "test"):  # the layout passes bench.py's own check; the loaders find no images
        (tmp_path / "empty" / split / "a").mkdir(parents=True)
    proc = bench(
        *common, "--data-root", str(tmp_path / "empty"), "--only", "loader2-*", "--out", str(out), "--timeout", "120"
    )
    failed = json.loads(out.read_text())["runs"]["loader2-classic1"]
    assert proc.returncode == 1 and not failed["ok"], proc.stdout[-2000:]
    assert "loader 0 of 2: ConfigError" in failed["error"] or "loader 1 of 2: ConfigError" in failed["error"]


def _children(pid: int, spawned: bool = False) -> list[int]:
    """A process's children (Linux /proc); spawned: only those started by multiprocessing's "spawn"."""
    try:
        kids = [
            int(c)
            for t in os.listdir(f"/proc/{pid}/task")
            for c in Path(f"/proc/{pid}/task/{t}/children").read_text().split()
        ]
        return [k for k in kids if not spawned or b"spawn_main" in Path(f"/proc/{k}/cmdline").read_bytes()]
    except OSError:  # gone meanwhile
        return []


def test_a_loader_process_killed_outright_fails_the_run_at_once(tmp_path):
    """loaderN-*: a loader process SIGKILLed (as by the out-of-memory killer) sends no answer; the run says which
    one died, at once, instead of waiting for --timeout."""
    from tests.data.test_decode import write_tree

    write_tree(tmp_path / "tree", per_class=(32, 4))
    out = tmp_path / "b.json"
    args = ("--smoke", "--decode", "cpu", "--workers", "1", "--gpus", "2", "--image-size", "16", "--batch", "4")
    more = ("--data-root", str(tmp_path / "tree"), "--loader-steps", "100000", "--only", "loader2-*", "--out", str(out))
    proc = subprocess.Popen(
        [sys.executable, str(ROOT / "bench" / "bench.py"), *args, *more, "--timeout", "300"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,  # its process group: killed whole if the test fails
    )
    try:
        deadline, loader = time.monotonic() + 120, None
        while loader is None and time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.5)
            for child in _children(proc.pid):  # bench.py --one: the loaders are its spawned processes
                spawned = _children(child, spawned=True)
                loader = spawned[-1] if len(spawned) == 2 else None
        assert loader is not None, "no loader processes seen"
        time.sleep(2)  # past their start
        os.kill(loader, signal.SIGKILL)
        killed = time.monotonic()
        output, _ = proc.communicate(timeout=120)
        assert time.monotonic() - killed < 60  # not the 300 s --timeout
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    failed = json.loads(out.read_text())["runs"]["loader2-classic1"]
    assert proc.returncode == 1 and not failed["ok"], output[-2000:]
    assert "its process died (exit code -9) before answering" in failed["error"]


def _session(sid: int) -> list[int]:
    """The live (not zombie) processes of session `sid` (Linux /proc)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            stat = Path(f"/proc/{pid}/stat").read_text()
        except OSError:  # gone meanwhile
            continue
        state, _, _, session = stat[stat.rfind(")") + 2 :].split()[:4]  # after "pid (comm) "
        if int(session) == sid and state != "Z":
            found.append(int(pid))
    return found


def _start(cmd: list[str]) -> subprocess.Popen:
    """`cmd` in a session of its own (killed whole by _kill_groups if the test fails), its stderr kept."""
    return subprocess.Popen(
        cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True
    )


def _stop_and_check(proc: subprocess.Popen, sid: int, script: str) -> None:
    """SIGTERM to `proc` (running `script`): it ends session `sid` (its child's) with it, exits 128 + SIGTERM and
    says so in its last line, without a traceback."""
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=10)
    deadline = time.monotonic() + 10
    while _session(sid) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert _session(sid) == [], f"its child's processes outlived {script}"
    assert proc.returncode == 128 + signal.SIGTERM and "Traceback" not in err, err[-2000:]
    assert err.strip().splitlines()[-1] == f"{script}: stopped by SIGTERM; killed its child"


def _kill_groups(proc: subprocess.Popen, sid: int | None) -> None:
    """Whatever a failed test left: `proc`'s process group (its own session) and session `sid`'s leader's."""
    for group in (proc.pid, sid):
        if group is not None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(group, signal.SIGKILL)
    proc.wait()


def test_bench_stopped_from_outside_ends_its_runs_processes(tmp_path):
    """A SIGTERM to bench.py (an outer `timeout`, a device call's time limit) also ends the run it was waiting
    for: that run's session (its own, with the ranks train.py spawned) would otherwise keep training."""
    args = ("--smoke", "--only", "ddp2-gpu", "--epochs", "1000", "--timeout", "300", "--out", str(tmp_path / "b.json"))
    proc = _start([*BENCH, *args])
    sid = None
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and proc.poll() is None:
            time.sleep(0.5)
            children = _children(proc.pid)
            if children and len(_session(os.getsid(children[0]))) >= 3:  # bench.py --one and its two ranks
                sid = os.getsid(children[0])
                break
        assert sid is not None, "no run with its ranks seen"
        _stop_and_check(proc, sid, "bench.py")
    finally:
        _kill_groups(proc, sid)


@pytest.mark.parametrize("model", ["resnet50", "vit_b16", "resnet18"])
def test_strategies_table_scaling_preset_composes_each_run(model, tmp_path):
    """--scaling MODEL --dry-run: single, ddp and fsdp on 2 and 4 GPUs, with the global batch growing with the
    GPUs; each command is a valid config."""
    import shlex

    from src.data.datasets import check_data_config, load_data
    from tests.conftest import make_cfg

    cmd = [sys.executable, str(ROOT / "bench/strategies_table.py"), "--scaling", model, "--dry-run"]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    runs = dict(line.split(": ", 1) for line in proc.stdout.splitlines())
    assert list(runs) == ["single", "ddp2", "fsdp2", "ddp4", "fsdp4"]
    per_gpu = 512 if model == "resnet18" else 256
    for name, line in runs.items():
        overrides = shlex.split(line)[2:]  # after "python train.py"
        cfg = make_cfg(tmp_path, *overrides)
        check_data_config(cfg.data)
        devices = cfg.trainer.devices
        target = {"single": "Single", "ddp": "DDP", "fsdp": "FSDP"}[name.rstrip("0123456789")]
        assert cfg.strategy._target_ == f"src.strategies.{target}" and cfg.data.batch_size == per_gpu * devices
        assert cfg.trainer.compile and cfg.trainer.amp and cfg.data.name == "synthetic"
        assert cfg.trainer.compile_mode == ("default" if name.startswith("fsdp") else "reduce-overhead")
        # the epochs after the first (warm-up) time >= 100 steps: the fewest epochs that do, and at least --epochs
        cfg.data.shape = [1, 1, 1]
        steps = len(load_data(cfg.data).train) // cfg.data.batch_size
        timed = cfg.trainer.max_epochs - 1
        assert timed * steps >= 100 and (timed == 2 or (timed - 1) * steps < 100), (name, steps, timed)


def test_dali_anchor_reads_the_packs_training_images_byte_for_byte(tmp_path):
    """dali_anchor.py hands DALI's file reader the pack's training images as a folder: each file holds the bytes
    of one image of the ImageFolder the pack was made from, under its label's folder; a second call reuses it."""
    sys.path.insert(0, str(ROOT / "bench"))
    from dali_anchor import unpack

    from tests.data.test_decode import write_tree

    write_tree(tmp_path / "tree", per_class=(5, 2))
    pack = subprocess.run(
        [sys.executable, "-m", "src.data.shards", "pack", str(tmp_path / "tree"), str(tmp_path / "pack")],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert pack.returncode == 0, pack.stderr
    folder = unpack(tmp_path / "pack", tmp_path / "folder")
    got = sorted((p.parent.name, p.read_bytes()) for p in folder.glob("*/*.jpg"))
    want = sorted(
        (f"{label:04d}", p.read_bytes())
        for label, c in enumerate("ab")
        for p in (tmp_path / "tree/train" / c).iterdir()
    )
    assert len(got) == 10 and got == want
    (folder / "0000" / "0000000.jpg").unlink()  # a finished folder is not written again
    assert unpack(tmp_path / "pack", tmp_path / "folder") == folder and not (folder / "0000" / "0000000.jpg").exists()

    write_tree(tmp_path / "tree2", per_class=(4, 2), seed=1)  # another pack, the same folder: refused
    subprocess.run(
        [sys.executable, "-m", "src.data.shards", "pack", str(tmp_path / "tree2"), str(tmp_path / "pack2")],
        cwd=ROOT,
        check=True,
        capture_output=True,
    )
    with pytest.raises(SystemExit, match="holds another pack's images"):
        unpack(tmp_path / "pack2", folder)
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "notes.txt").write_text("a user's file")
    with pytest.raises(SystemExit, match="holds files this script did not write"):
        unpack(tmp_path / "pack", tmp_path / "mine")
    assert [p.name for p in (tmp_path / "mine").iterdir()] == ["notes.txt"]


# Python's own mark of a module that cannot be imported: find_spec then says it is not there
WITHOUT_DALI = (
    "import runpy, sys; sys.modules['nvidia.dali'] = None; sys.argv = sys.argv[1:]; "
    "runpy.run_path(sys.argv[0], run_name='__main__')"
)


def test_dali_anchor_without_dali_or_a_pack_says_what_to_do_in_one_line(tmp_path):
    """Where DALI is not installed (not Linux x86-64), the anchor says what to install; with DALI, a folder that is
    not a pack is named. One line each, no traceback."""
    args = ["bench/dali_anchor.py", "--shards", str(tmp_path), "--mode", "loop", "--out", "x.json"]
    said = {}
    for case, command in (("without", ["-c", WITHOUT_DALI, *args]), ("with", args)):
        proc = subprocess.run([sys.executable, *command], cwd=ROOT, capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0 and "Traceback" not in proc.stderr
        said[case] = proc.stderr.strip().splitlines()
    assert said["without"] == [
        "dali_anchor.py: needs NVIDIA DALI, which is not installed here: pip install nvidia-dali-cuda130"
    ]
    if dali_installed():
        assert len(said["with"]) == 1 and said["with"][0].startswith(f"dali_anchor.py: --shards: {tmp_path}")


def test_data_decode_dali_without_dali_is_one_line_before_anything_starts(tmp_path):
    write_tree(tmp_path / "tree", per_class=(4, 2))
    train = ["train.py", "data=imagefolder", f"data.root={tmp_path / 'tree'}", "data.decode=dali"]
    train += [f"hydra.run.dir={tmp_path / 'run'}", "trainer.max_epochs=1"]
    proc = subprocess.run(
        [sys.executable, "-c", WITHOUT_DALI, *train], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode != 0 and "Traceback" not in proc.stderr + proc.stdout
    line = "data.decode=dali needs NVIDIA DALI, which is not installed here: pip install nvidia-dali-cuda130"
    assert (proc.stdout + proc.stderr).count(line) == 1 and not (tmp_path / "run").exists()


def test_airbench_anchor_summarises_each_training_length_over_its_own_seeds():
    """--epochs 40,60: each length's mean, sample std and mean time come from its runs alone, in the order run."""
    sys.path.insert(0, str(ROOT / "bench"))
    from airbench_anchor import by_epochs

    runs = [
        {"epochs": 40.0, "seed": 2, "test_top1": 93.14, "seconds": 19.81},
        {"epochs": 40.0, "seed": 4, "test_top1": 93.32, "seconds": 19.84},
        {"epochs": 60.0, "seed": 2, "test_top1": 93.62, "seconds": 29.66},
    ]
    forty, sixty = by_epochs(runs)
    assert forty["epochs"] == 40.0 and sixty["epochs"] == 60.0
    assert forty["test_top1_mean"] == pytest.approx(93.23) and forty["test_top1_std"] == pytest.approx(0.18 / 2**0.5)
    assert forty["seconds_mean"] == pytest.approx(19.825)
    assert sixty == {"epochs": 60.0, "test_top1_mean": 93.62, "test_top1_std": 0.0, "seconds_mean": 29.66}


def test_airbench_anchor_hands_airbench_the_jpegs_as_its_tensors_and_reads_its_final_row(tmp_path):
    """airbench reads cifar10/{train,test}.pt: the anchor writes them from the JPEG folder ddplab trains on, pixel
    for pixel as PIL decodes each file, labelled in ImageFolder order; it takes accuracy and time from the last
    row airbench 0.1.8 prints (pasted below as airbench printed it)."""
    from PIL import Image

    sys.path.insert(0, str(ROOT / "bench"))
    from airbench_anchor import export_tensors, final_row

    rng = np.random.default_rng(0)
    for split, n in (("train", 3), ("test", 2)):
        for c in ("cat", "dog"):
            (tmp_path / "jpegs" / split / c).mkdir(parents=True)
            for i in range(n):
                Image.fromarray(rng.integers(0, 256, (32, 32, 3), dtype=np.uint8)).save(
                    tmp_path / "jpegs" / split / c / f"{i}.jpg", quality=75
                )
    target = export_tensors(tmp_path / "jpegs", tmp_path / "work")
    train = torch.load(target / "train.pt")
    assert train["classes"] == ["cat", "dog"] and train["labels"].tolist() == [0, 0, 0, 1, 1, 1]
    files = [tmp_path / "jpegs/train" / c / f"{i}.jpg" for c in ("cat", "dog") for i in range(3)]
    want = np.stack([np.asarray(Image.open(f)) for f in files])
    assert train["images"].dtype == torch.uint8 and np.array_equal(train["images"].numpy(), want)
    assert torch.load(target / "test.pt")["images"].shape == (4, 32, 32, 3)

    printed = """\
|  run     |  epoch  |  train_loss  |  train_acc  |  val_acc  |  tta_val_acc  |  total_time_seconds  |
|       1  |      0  |      0.5000  |     0.8000  |   0.9000  |               |                      |
|          |   eval  |      0.1000  |     0.9500  |   0.9300  |       0.9347  |             20.8123  |
"""
    assert final_row(printed) == (0.9347, 20.8123)

    Image.new("RGB", (40, 32)).save(tmp_path / "jpegs/train/cat/big.jpg")
    code = (
        "import sys; sys.path.insert(0, 'bench'); from pathlib import Path; "
        "from airbench_anchor import export_tensors; "
        "export_tensors(Path(sys.argv[1]), Path(sys.argv[2]))"
    )
    args = [sys.executable, "-c", code, str(tmp_path / "jpegs"), str(tmp_path / "w2")]
    proc = subprocess.run(args, cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode != 0 and "Traceback" not in proc.stderr and "is 40×32 px" in proc.stderr
    assert not list((tmp_path / "w2").rglob("*.pt"))
    (tmp_path / "jpegs/train/cat/big.jpg").unlink()
    Image.new("RGB", (32, 32)).save(tmp_path / "jpegs/train/cat/new.jpg")  # the folder changed: tensors of its own
    changed = export_tensors(tmp_path / "jpegs", tmp_path / "work")
    assert changed != target and len(torch.load(changed / "train.pt")["labels"]) == 7
    assert len(torch.load(target / "train.pt")["labels"]) == 6


CEILING_CPU = {"model": "tiny_cnn", "channels_last": False, "amp": False, "compile": False, "compile_mode": None}
CEILING_CPU["model_options"] = {"batch_norm": False}  # a gradient that does not depend on how the batch is split


def _ceiling_rank(rank: int, port: int, x, y, out) -> None:
    """One of two gloo ranks: the ceiling's step on its half of the batch, gradients summed by ddp's flat sync."""
    import torch.distributed as dist

    from src.strategies.ddp import FlatGradientSync

    sys.path.insert(0, str(ROOT / "bench"))
    from bench import ceiling_step

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        step, model = ceiling_step(CEILING_CPU, torch.device("cpu"), FlatGradientSync, ranks=2)
        half = len(y) // 2
        step(x[rank * half : (rank + 1) * half], y[rank * half : (rank + 1) * half])
    finally:
        dist.destroy_process_group()
    out.put((rank, [p.detach().numpy().copy() for p in model.parameters()]))  # by value: this process ends


def test_the_ceiling_step_over_two_ranks_takes_the_step_of_their_whole_batch():
    """dali_anchor.py's ranks: each steps on its half of a batch, the gradients summed by ddp's FlatGradientSync
    of a loss scaled to the ranks' mean; both end with the weights one process gets from the whole batch."""
    import socket

    import torch.multiprocessing as mp

    sys.path.insert(0, str(ROOT / "bench"))
    from bench import ceiling_step

    generator = torch.Generator().manual_seed(1)
    x, y = torch.randn(16, 3, 32, 32, generator=generator), torch.randint(0, 10, (16,), generator=generator)
    step, model = ceiling_step(CEILING_CPU, torch.device("cpu"))
    step(x, y)
    want = [p.detach().numpy() for p in model.parameters()]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_ceiling_rank, args=(rank, port, x, y, out)) for rank in range(2)]
    for proc in procs:
        proc.start()
    got = dict(out.get(timeout=120) for _ in procs)
    for proc in procs:
        proc.join(timeout=60)
    for rank in range(2):
        assert all(np.allclose(g, w, atol=1e-6) for g, w in zip(got[rank], want)), rank
    _, untrained = ceiling_step(CEILING_CPU, torch.device("cpu"))
    assert any(not np.array_equal(w, p.detach().numpy()) for w, p in zip(want, untrained.parameters()))  # it stepped


def test_fsdp_step_graph_ranks_take_the_step_of_their_whole_batch(tmp_path):
    """fsdp_step_graph.py's sharding (fsdp's in-graph route): two gloo ranks keep half of each parameter's rows,
    gather them in the forward and reduce-scatter the gradients in the backward; after 3 steps on their halves of a
    batch the whole weights are those one process gets from the whole batch with bench.py's ceiling step."""
    sys.path.insert(0, str(ROOT / "bench"))
    from bench import ceiling_step

    out = tmp_path / "whole.pt"
    args = ["--check", "--gpus", "2", "--steps", "3", "--batch", "8", "--model", "tiny_cnn", "--out", str(out)]
    proc = subprocess.run([sys.executable, "bench/fsdp_step_graph.py", *args], cwd=ROOT, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    got = torch.load(out)
    generator = torch.Generator().manual_seed(1)  # the script's batch: rank r takes rows [8r, 8r + 8)
    x, y = torch.randn(16, 3, 32, 32, generator=generator), torch.randint(0, 10, (16,), generator=generator)
    step, model = ceiling_step(CEILING_CPU, torch.device("cpu"))
    _, untrained = ceiling_step(CEILING_CPU, torch.device("cpu"))
    for _ in range(3):
        step(x, y)
    want, start = dict(model.named_parameters()), dict(untrained.named_parameters())
    assert sorted(got) == sorted(want)
    for name, w in want.items():
        assert torch.allclose(got[name], w.detach(), rtol=0, atol=1e-6), name
        assert (w - start[name]).abs().max() > 1e-4, name  # it stepped: a wrong gradient would show


def test_fsdp_step_graph_check_without_out_is_one_line():
    proc = subprocess.run(
        [sys.executable, "bench/fsdp_step_graph.py", "--check"], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert (
        proc.stderr.strip().splitlines()[-1]
        == "fsdp_step_graph.py: error: --check writes the whole weights to --out: give one"
    )


@pytest.mark.parametrize(
    "script, args, wrong",
    [
        ("dali_anchor.py", ["--shards", "x", "--mode", "loop", "--steps", "0"], "--steps"),
        ("dali_anchor.py", ["--shards", "x", "--mode", "loop", "--threads", "-3"], "--threads"),
        ("dali_anchor.py", ["--shards", "x", "--mode", "loop", "--hw-decoder-load", "1.5"], "--hw-decoder-load"),
        ("airbench_anchor.py", ["--data", "x", "--seeds", "2,a"], "--seeds"),
        ("airbench_anchor.py", ["--data", "x", "--epochs", "40,0"], "--epochs"),
        ("bench.py", ["--list", "--workers", "4,x"], "--workers"),
        ("bench.py", ["--list", "--workers", "-1"], "--workers"),
        ("bench.py", ["--list", "--gpus", "0"], "--gpus"),
        ("bench.py", ["--list", "--batch", "1.5"], "--batch"),
        ("bench.py", ["--list", "--timeout", "nan"], "--timeout"),
        ("fsdp_step_graph.py", ["--gpus", "0"], "--gpus"),
        ("fsdp_step_graph.py", ["--timeout", "0"], "--timeout"),
        ("recipe_search.py", ["a:", "--seeds", "2,-1"], "--seeds"),
        ("recipe_search.py", ["a:", "--base", "x='y"], "--base"),
        ("recipe_search.py", ["../a: x=1"], "recipes"),
        ("recipe_search.py", ["no colon"], "recipes"),
    ],
)
def test_a_bench_scripts_wrong_argument_is_one_line_naming_it(script, args, wrong):
    proc = subprocess.run(
        [sys.executable, f"bench/{script}", *args, "--out", "x.json"], cwd=ROOT, capture_output=True, text=True
    )
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith(f"{script}: error: argument {wrong}: invalid")


@pytest.mark.slow
def test_recipe_search_runs_each_recipes_seeds_side_by_side_as_each_would_run_alone(tmp_path):
    search = [sys.executable, "bench/recipe_search.py", "--gpus", "1", "--per-gpu", "3", "--seeds", "1,2"]
    out = tmp_path / "search 'q' $(x)"  # a folder name Hydra and the shell would both misread unquoted
    search += ["--base", "debug=fast trainer.max_epochs=1", "--out", str(out)]
    recipes = ["base:", "lr: optim.lr=0.05", "bad: trainer.max_epochs=0"]
    proc = subprocess.run([*search, *recipes], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0 and "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-2000:]
    summary = {s["name"]: s for s in json.loads((out / "summary.json").read_text())}
    for name in ("base", "lr"):
        written = [json.loads((out / name / f"seed{seed}" / "metrics.json").read_text()) for seed in (1, 2)]
        finals = [m["final"]["test_top1"] for m in written]
        assert [r["final_top1"] for r in summary[name]["runs"]] == finals and summary[name]["ok"]
        assert summary[name]["final_top1_mean"] == pytest.approx(sum(finals) / 2)
    alone = run_cli(
        "debug=fast", "trainer.max_epochs=1", "seed=2", "optim.lr=0.05", f"hydra.run.dir={tmp_path / 'alone'}"
    )
    assert alone.returncode == 0, alone.stderr[-2000:]
    alone_top1 = json.loads((tmp_path / "alone" / "metrics.json").read_text())["final"]["test_top1"]
    assert summary["lr"]["runs"][1]["final_top1"] == alone_top1  # sharing the machine changes no number
    said = [line for line in proc.stdout.splitlines() if line.startswith("bad ")]
    assert not summary["bad"]["ok"] and len(said) == 1 and "trainer.max_epochs must be a positive integer" in said[0]
    assert said[0].startswith("bad") and " failed: " in said[0]
    before = {p: p.stat().st_mtime_ns for p in out.rglob("*")}
    again = subprocess.run([*search, "other:"], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert again.returncode == 2 and again.stderr.strip().splitlines()[-1].endswith(
        "is not an empty folder: give a new one"
    )
    assert {p: p.stat().st_mtime_ns for p in out.rglob("*")} == before


@pytest.mark.slow
def test_recipe_search_time_limit_stops_the_runs_going_and_starts_no_more(tmp_path):
    search = [sys.executable, "bench/recipe_search.py", "--gpus", "1", "--per-gpu", "1", "--time-limit", "4"]
    search += ["--base", "debug=fast trainer.max_epochs=500", "--out", str(tmp_path / "s"), "long:", "next:"]
    proc = subprocess.run(search, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-2000:]
    long, later = proc.stdout.splitlines()
    assert long.startswith("long ") and "stopped by --time-limit: " in long, long  # at any point of its start-up
    assert later.startswith("next ") and "not started: --time-limit came first" in later
    assert not any(s["ok"] for s in json.loads((tmp_path / "s" / "summary.json").read_text()))


def test_profile_loop_counts_each_cuda_graph_recording_once():
    from types import SimpleNamespace as Event  # the key and count of torch.profiler's key_averages()

    sys.path.insert(0, str(ROOT / "bench"))
    from profile_loop import graphs_recorded

    record = "CUDAGraphNode.record"
    events = [Event(key=f"{record} (dynamo_timed)", count=10), Event(key=record, count=20), Event(key="mm", count=9)]
    assert graphs_recorded(events) == 10  # one dynamo_timed event per recording; the others repeat it
    assert graphs_recorded([Event(key=record, count=7), Event(key=f"{record}_x", count=7)]) == 7
    assert graphs_recorded([Event(key="mm", count=9)]) == 0


def test_profile_loop_counts_the_device_time_once():
    """The GPU's busy time is its own events' time: a CPU operator's device time and a GPU-side annotation (a
    compiled graph's call) cover the same kernels again, and counting them put an H200 epoch at 265 % busy."""
    from types import SimpleNamespace as Event

    from torch.autograd import DeviceType

    sys.path.insert(0, str(ROOT / "bench"))
    from profile_loop import device_seconds

    def event(device, us, annotation=False):
        return Event(device_type=device, self_device_time_total=us, is_user_annotation=annotation)

    kernels = [event(DeviceType.CUDA, 300_000), event(DeviceType.CUDA, 150_000)]
    covering = [event(DeviceType.CPU, 300_000), event(DeviceType.CUDA, 318_000, annotation=True)]
    assert device_seconds(kernels + covering) == pytest.approx(0.45)
    assert device_seconds(covering) == 0


def test_profile_loop_profiles_the_epoch_after_its_warmup_and_leaves_no_run_behind(tmp_path):
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    script = [sys.executable, "bench/profile_loop.py", "trainer.limit_train_batches=3", "--rows", "1"]
    script += ["trainer.progress_bar=false"]  # overrides on both sides of an option
    proc = subprocess.run([*script, "--warmup-epochs", "2"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = next(line for line in proc.stdout.splitlines() if "(profiled)" in line)
    assert summary.startswith("epoch 2: ") and "| epoch 3 (profiled): " in summary, summary
    assert " 3 steps," in summary and summary.endswith("CUDA graphs recorded 0")  # CPU: no graphs
    assert "aten::" in proc.stdout  # the operator tables
    assert not list(tmp_path.glob("ddplab-profile-*"))  # its run directory went with it
    proc = subprocess.run([*script, "--warmup-epochs", "0"], cwd=ROOT, env=env, capture_output=True, text=True)
    assert proc.returncode == 2 and proc.stderr.strip().splitlines()[-1].endswith(
        "must be at least 1 (compilation and tuning are not profiled), got 0"
    )


@pytest.mark.parametrize("option", ["--data-root", "--shards"])
def test_data_no_configuration_could_read_is_one_line_before_any_starts(tmp_path, option):
    proc = bench("--smoke", "--decode", "cpu", option, str(tmp_path / "none"), "--out", str(tmp_path / "b.json"))
    assert proc.returncode == 2 and "Traceback" not in proc.stderr and "FAILED" not in proc.stdout, proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith(f"bench.py: error: {option}: {tmp_path / 'none'} "), last
    assert not (tmp_path / "b.json").exists()  # nothing ran


def test_make_bench_dali_refuses_in_one_line_before_any_rank_starts(tmp_path):
    """`make bench-dali` runs the anchor, which checks the machine and the pack before it starts its ranks with
    torchrun: a refusal is the anchor's one line, not a rank's failure and torchrun's traceback."""
    proc = subprocess.run(
        ["make", "-s", "-o", ".venv/.installed", "bench-dali", f"SHARDS={tmp_path}", f"PY={sys.executable}"],
        cwd=ROOT,
        env=make_env(),
        capture_output=True,
        text=True,
        timeout=120,
    )
    said = [line for line in proc.stderr.splitlines() if not line.startswith("make")]
    assert proc.returncode != 0 and "Traceback" not in proc.stderr + proc.stdout
    assert len(said) == 1 and said[0].startswith("dali_anchor.py: "), proc.stderr
