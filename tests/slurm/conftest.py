from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.slurm.localslurm import LocalSlurm, Unavailable


@pytest.fixture(scope="session")
def slurm() -> Iterator[LocalSlurm]:
    """A one-node Slurm cluster (Debian's packages, installed here if missing), stopped by PID at the end."""
    cluster = LocalSlurm(kill_wait_s=10)
    try:
        cluster.start()
    except Unavailable as e:
        cluster.stop()
        pytest.skip(str(e))
    except BaseException:
        cluster.stop()
        raise
    try:
        yield cluster
    finally:
        cluster.stop()
