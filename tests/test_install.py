"""What `make install` (.ci/install.sh) leaves in the venv the tests run in."""

from __future__ import annotations

import importlib.util
import os

import pytest


@pytest.mark.parametrize("name", ["torch", "hydra", "omegaconf", "sklearn", "scipy.stats"])
def test_the_installed_packages_come_with_their_bytecode(name):
    """uv writes no .pyc unless asked (--compile-bytecode), and where PYTHONDONTWRITEBYTECODE is set Python never
    writes them either: every process then compiled torch & co. again, ~1.2 s more per start on 2 cores."""
    source = importlib.util.find_spec(name).origin
    assert os.path.exists(importlib.util.cache_from_source(source)), source
