import pytest

from swarm_helpers import Swarm, processes_mentioning


@pytest.fixture
def swarm(tmp_path):
    started = Swarm(tmp_path)
    yield started
    started.stop()
    assert not processes_mentioning(str(tmp_path)), "a peer process outlived the test"


