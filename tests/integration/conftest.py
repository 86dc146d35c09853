import pytest

from s3_server import S3Server
from swarm_helpers import Swarm, processes_mentioning


@pytest.fixture
def swarm(tmp_path):
    started = Swarm(tmp_path)
    yield started
    started.stop()
    assert not processes_mentioning(str(tmp_path)), "a peer process outlived the test"




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
