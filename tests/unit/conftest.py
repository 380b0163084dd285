import pytest

from frontend.pool import WorkerPool
from shmserve import config
from tests.stack import free_port
from tests.unit.test_render import make_config


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


@pytest.fixture
def deployment(tmp_path, monkeypatch):
    """Select a deployment the way a user does: environment overrides over configs/test.yaml."""
    run_dir = tmp_path / "run"
    monkeypatch.setenv("SHMSERVE_ENV", "test")
    monkeypatch.delenv("SHMSERVE_CONFIG", raising=False)
    monkeypatch.setenv("SHMSERVE__SERVER__RUN_DIR", str(run_dir))
    monkeypatch.setenv("SHMSERVE__SERVER__PORT", str(free_port()))
    monkeypatch.setenv("SHMSERVE__WORKERS__DEVICES", "cpu")
    monkeypatch.setenv("SHMSERVE__WORKERS__CPU_WORKERS", "2")
    return make_config(run_dir)


@pytest.fixture
def base(tmp_path):
    """A rendered deployment's config of two frontends and two CPU workers (tests of apply)."""
    return make_config(tmp_path / "run", frontends={"count": 2},
                       workers={"devices": "cpu", "cpu_workers": 2, "torch_threads": 1})
