"""pytest fixtures for the single-host test SLURM cluster (tests/slurm_cluster.py).

tests/conftest.py:  from tests.slurm_fixture import slurm_cluster, slurm_env  # noqa: F401
"""

from __future__ import annotations

import os
import tempfile

import pytest

from tests.slurm_cluster import SlurmCluster, slurm_available


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    """A started 2-node SlurmCluster (node1, node2; 4 CPUs each), stopped at session end.

    Skips when the binaries/root are missing (see slurm_available()).
    """
    ok, reason = slurm_available()
    if not ok:
        pytest.skip(reason)
    workdir = tmp_path_factory.mktemp("slurm")
    if len(str(workdir)) > 60:  # unix socket paths (munge, mysql) must stay < 108 bytes
        workdir = tempfile.mkdtemp(prefix="ddplab-slurm-")
    cluster = SlurmCluster(workdir)
    cluster.start(timeout=60)
    try:
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture
def slurm_env(slurm_cluster, monkeypatch):
    """Point this test's process (and what it spawns: sbatch, sacct, submitit) at the test cluster."""
    for key in [k for k in os.environ if k.startswith(("SLURM_", "SBATCH_", "SRUN_"))]:
        monkeypatch.delenv(key)
    for key, value in slurm_cluster.env().items():
        monkeypatch.setenv(key, value)
    return slurm_cluster
