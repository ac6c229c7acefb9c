from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.slurm.localslurm import LocalSlurm, Unavailable


@pytest.fixture(scope="session")
def slurm() -> Iterator[LocalSlurm]:
    """A Slurm cluster of four nodes (Debian's packages, installed here if missing), stopped by PID at the end;
    one node in the host's network where namespaces cannot be made (``single_because`` says why). A node that
    has not answered for 20 s is down. KillWait is Slurm's default, 30 s: on a loaded 2-core machine two learner
    ranks finishing their step took longer than 10 s to stop, and Slurm SIGKILLed them."""
    cluster = LocalSlurm(nodes=4, kill_wait_s=30, slurmd_timeout_s=20)
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
