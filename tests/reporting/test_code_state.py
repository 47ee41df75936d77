"""metrics.json names the code that ran: its commit, and whether tracked files differed from that commit."""

import os
import subprocess

from src.reporting.results import git_state
from tests.conftest import ROOT, read_metrics, run_cli


def git(repo, *args) -> str:
    done = subprocess.run(
        ["git", "-c", "user.name=t", "-c", "user.email=t@example.com", *args],
        cwd=repo,
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


def test_a_commit_is_named_with_whether_the_tracked_files_differ_from_it(tmp_path):
    repo = tmp_path / "repo"
    repo.mkdir()
    git(repo, "init", "-q")
    (repo / "model.py").write_text("width = 64\n")
    git(repo, "add", "model.py")
    git(repo, "commit", "-qm", "one")
    head = git(repo, "rev-parse", "HEAD")
    assert git_state(repo) == {"git_commit": head, "git_dirty": False}
    (repo / "notes.txt").write_text("an untracked file is not the code")
    index = (repo / ".git" / "index").read_bytes()
    stat = (repo / "model.py").stat()
    os.utime(repo / "model.py", ns=(stat.st_atime_ns, stat.st_mtime_ns + 2_000_000_000))  # same content, newer
    assert git_state(repo) == {"git_commit": head, "git_dirty": False}
    assert (repo / ".git" / "index").read_bytes() == index  # looked at, not rewritten (plain git status would)
    (repo / "model.py").write_text("width = 128\n")  # what ran is no longer what the commit holds
    assert git_state(repo) == {"git_commit": head, "git_dirty": True}
    plain = tmp_path / "plain"
    plain.mkdir()
    assert git_state(plain) == {"git_commit": None, "git_dirty": None}


def test_a_runs_metrics_name_this_checkout_and_its_uncommitted_changes(tmp_path):
    run_dir = tmp_path / "run"
    proc = run_cli("debug=fast", "trainer.max_epochs=1", f"hydra.run.dir={run_dir}")
    assert proc.returncode == 0, proc.stderr[-2000:]
    m = read_metrics(run_dir)
    changed = git(ROOT, "--no-optional-locks", "status", "--porcelain", "--untracked-files=no") != ""
    assert (m["git_commit"], m["git_dirty"]) == (git(ROOT, "rev-parse", "HEAD"), changed)
