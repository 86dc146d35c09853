import pytest

from s3_server import S3Server
from swarm_helpers import Swarm, processes_mentioning


@pytest.fixture
def swarm(tmp_path):
    started = Swarm(tmp_path)
    yield started
    started.stop()
    assert not processes_mentioning(str(tmp_path)), "a peer process outlived the test"


@pytest.fixture(scope="session")
def bootstrap_coordinator(tmp_path_factory):
    """One bootstrap coordinator (no state) for the short two-trainer runs of several modules: each run is a
    swarm of its own (``--run-id``) that only needs an address to join, as on a coordinator that outlives runs."""
    directory = tmp_path_factory.mktemp("bootstrap-coordinator")
    swarm = Swarm(directory)
    try:
        swarm.start_coordinator()
        yield swarm
    finally:
        swarm.stop()
    assert not processes_mentioning(str(directory)), "a peer process outlived the tests"


@pytest.fixture(scope="module")
def s3_server(tmp_path_factory):
    """A real S3-compatible server (moto) on a free loopback port, for the checkpoint mirror's tests."""
    server = S3Server(tmp_path_factory.mktemp("moto") / "moto.log")
    try:
        server.start()
    except RuntimeError as error:
        pytest.fail(f"cannot start the S3 test server: {error}", pytrace=False)
    yield server
    server.stop()
