"""The commands ddplab prints for pasting run as printed, from the folder they were printed in: the repository's or
a user's own (was: `python train.py` and `python -m src...`, which only the repository's folder finds)."""

from __future__ import annotations

import csv
import os
import subprocess
import sys
from pathlib import Path

from src.config import commands
from tests.conftest import ROOT, read_metrics, run_cli


def _paste(command: str, cwd: Path) -> subprocess.CompletedProcess:
    """`command` pasted into bash in `cwd`, where `python` is this interpreter (an activated venv)."""
    bin_dir = cwd / "bin"
    bin_dir.mkdir(exist_ok=True)
    (bin_dir / "python").write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
    (bin_dir / "python").chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:/usr/bin:/bin"}
    env.pop("PYTHONPATH", None)
    return subprocess.run(["bash", "-c", command], cwd=cwd, env=env, capture_output=True, text=True, timeout=300)


def test_commands_printed_in_the_repository_read_as_before(monkeypatch):
    monkeypatch.chdir(ROOT)
    assert commands.train_command(("seed", 2)) == "python train.py seed=2"
    table = commands.module_command("src.reporting.report", Path("multirun/x"))
    assert table == "python -m src.reporting.report multirun/x"


def test_a_resume_command_printed_in_another_folder_runs_there(tmp_path, monkeypatch):
    user = tmp_path / "my runs $(touch pwned)"
    user.mkdir()
    monkeypatch.chdir(user)
    run_dir = Path("outputs") / "a run"  # relative to the user's folder, as the command keeps it
    command = commands.train_command(("debug", "fast"), ("trainer.max_epochs", 1), ("hydra.run.dir", run_dir))
    assert command.startswith(f"python {ROOT / 'train.py'} ")
    done = _paste(command, user)
    assert done.returncode == 0, done.stderr[-2000:]
    assert read_metrics(user / run_dir)["status"] == "completed" and not (user / "pwned").exists()


def test_the_sweeps_table_command_printed_in_a_users_folder_runs_there(tmp_path):
    user = tmp_path / "project"
    (user / "src").mkdir(parents=True)  # a package of the user's own named src, as many projects have
    proc = run_cli("-m", "debug=fast", "trainer.max_epochs=1", "seed=1,2", cwd=user)
    assert proc.returncode == 0, proc.stderr[-2000:]
    said = next(line for line in proc.stdout.splitlines() if line.startswith("sweep: every point completed"))
    table = said.split("(table: ", 1)[1].removesuffix(")")
    [sweep] = list((user / "multirun").glob("*/*"))
    assert table == f"(cd {ROOT} && python -m src.reporting.report {sweep.resolve()})"
    done = _paste(table, user)
    assert done.returncode == 0, done.stderr[-2000:]
    with open(sweep / "results.csv", newline="") as f:
        [row] = list(csv.DictReader(f))  # one configuration
    assert row["n"] == "2" and row["n_failed"] == "0"
