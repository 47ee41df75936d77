"""TensorBoard's own pages, as a researcher sees them without a click: a real seed x batch sweep on CPU, a real
`tensorboard` server, and the pages rendered by headless chromium through playwright.

Skipped only where chromium (`apt-get install -y chromium`) or playwright (`pip install playwright`) is missing.
`TB_SCREENSHOTS=docs` saves the screenshots linked from docs/runs.md (else they go to the test's tmp dir).
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import run_cli

pytestmark = pytest.mark.browser

SEEDS, BATCHES = ("1", "2"), ("32", "64")
POINTS = {f"seed={s},data.batch_size={b}": (s, b) for s in SEEDS for b in BATCHES}  # Trial ID -> its values


@pytest.fixture(scope="module")
def chromium() -> str:
    path = shutil.which("chromium") or shutil.which("chromium-browser")
    if path is None:
        pytest.skip("chromium is not installed (apt-get install -y chromium)")
    pytest.importorskip("playwright.sync_api", reason="playwright is not installed (pip install playwright)")
    return path


@pytest.fixture(scope="module")
def server(chromium, tmp_path_factory):
    """A seed x batch sweep (the default logger), served by TensorBoard on a free port: its base URL."""
    tmp = tmp_path_factory.mktemp("tb_view")
    sweep = tmp / "sweep"
    points = (f"seed={','.join(SEEDS)}", f"data.batch_size={','.join(BATCHES)}")
    proc = run_cli("-m", "debug=fast", *points, f"hydra.sweep.dir={sweep}", cwd=tmp, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    base = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "tensorboard.main", "--logdir", str(sweep), "--host", "127.0.0.1"]
    with open(tmp / "tensorboard.log", "w") as log:
        tensorboard = subprocess.Popen([*command, "--port", str(port)], stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 60
            while time.monotonic() < deadline and tensorboard.poll() is None:
                try:
                    urllib.request.urlopen(f"{base}/data/runs", timeout=5)
                    break
                except OSError:
                    time.sleep(0.3)  # not listening yet
            assert tensorboard.poll() is None, (tmp / "tensorboard.log").read_text()[-2000:]
            yield base
        finally:
            tensorboard.terminate()
            try:
                tensorboard.wait(timeout=10)
            except subprocess.TimeoutExpired:
                tensorboard.kill()
                tensorboard.wait()


@pytest.fixture(scope="module")
def page(chromium):
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        # as root, chromium starts only without its sandbox; the pages are TensorBoard's, served here
        browser = playwright.chromium.launch(
            executable_path=chromium, args=["--no-sandbox"] if os.geteuid() == 0 else []
        )
        yield browser.new_page(viewport={"width": 1280, "height": 800})
        browser.close()


def screenshot(page, name: str, tmp_path: Path) -> None:
    folder = Path(os.environ.get("TB_SCREENSHOTS") or tmp_path)
    page.screenshot(path=str(folder / name))


def test_hparams_table_opens_on_the_swept_columns_with_the_points_as_trial_ids(server, page, tmp_path):
    page.goto(f"{server}/#hparams")
    cells = page.locator("vaadin-grid-cell-content")
    cells.filter(has_text="completed").first.wait_for(timeout=60_000)  # the table's rows are in
    page.wait_for_timeout(500)  # every row of the same answer
    texts = [t.strip() for t in cells.all_inner_texts()]

    ticked = page.locator("paper-checkbox.hparam-checkbox[checked]").all_inner_texts()
    assert [t.strip() for t in ticked[:3]] == ["global_batch", "seed", "status"] and len(ticked) == 5, ticked
    assert texts[:5] == ["Trial ID", "Show Metrics", "global_batch", "seed", "status"], texts[:12]

    trial_ids = [t for t in texts if "=" in t]
    assert sorted(trial_ids) == sorted(POINTS), trial_ids  # one row per point, named by its overrides
    for trial_id, (seed, batch) in POINTS.items():
        row = texts[texts.index(trial_id) :]
        assert row[2:5] == [batch, seed, "completed"], row[:8]  # integers as typed, not 32.000
    screenshot(page, "tensorboard-hparams.png", tmp_path)


def test_scalars_page_opens_on_the_splits(server, page, tmp_path):
    page.goto(f"{server}/#scalars")
    panes = page.locator("tf-category-paginated-view")
    panes.filter(has_text="val").first.wait_for(timeout=60_000)
    # [name, opened] of each section as the page shows them; the first is the (empty) tag filter's
    sections = [panes.nth(i).evaluate("e => [e.category.name, e.opened]") for i in range(panes.count())][1:]
    # the splits by epoch, the per-step curves beside train's, the final figures last
    assert [name for name, _ in sections] == ["test", "train", "train_steps", "val", "z_final"], sections
    assert [opened for _, opened in sections[:2]] == [True, True], sections  # TensorBoard opens the first two
    screenshot(page, "tensorboard-scalars.png", tmp_path)
