import pytest

from frontend.pool import WorkerPool
from shmserve import config
from tests.stack import free_port


@pytest.fixture
def pool(tmp_path):
    """A frontend's WorkerPool of two CPU workers serving model "a", never started: its tests
    feed it heartbeats (`_on_heartbeat`) by hand."""
    cfg = config.from_tree({
        "models": [{"name": "a", "source": "/nonexistent/a"}],
        "server": {"run_dir": str(tmp_path / "run"), "port": free_port()},
        "workers": {"devices": "cpu", "cpu_workers": 2}})
    pool = WorkerPool(cfg)
    yield pool
    for link in pool.links:
        link.socket.close(linger=0)
    pool._ctx.term()
