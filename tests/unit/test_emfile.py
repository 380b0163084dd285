"""Out of descriptors (EMFILE), psutil raises a plain OSError, not psutil.Error: the helpers a
frontend's heartbeat and receive tasks call must not let it through (an outside check: a
frontend at its open-files limit lost a restarted worker for good, and its pings stopped, so
the workers SIGKILLed both frontends 30 s later)."""

import errno

import psutil
import pytest

from shmserve import hung, processes


@pytest.fixture
def emfile(monkeypatch):
    def process(pid):
        raise OSError(errno.EMFILE, "Too many open files", f"/proc/{pid}/stat")
    monkeypatch.setattr(psutil, "Process", process)


def test_start_time_out_of_descriptors(emfile):
    assert hung.start_time(1) is None


def test_heard_reads_the_start_again_later(emfile, monkeypatch):
    killer = hung.HungKiller("gpu_workers", "/x", 30, 3, 0.0)
    killer.heard(0, 1234)
    assert 0 not in killer._starts  # not recorded as unknown for good
    monkeypatch.setattr(hung, "start_time", lambda pid: 42.0)
    killer.heard(0, 1234)
    assert killer._starts[0] == (1234, 42.0)


def test_check_judges_again_next_round(emfile):
    killer = hung.HungKiller("gpu_workers", "/x", 30, 3, 0.0)
    assert killer.check(0, 1234, 0.0, 100.0) is None
    assert 0 not in killer._tried


def test_alive_out_of_descriptors_is_the_safe_side(emfile):
    assert processes.alive(1234) is True


def test_a_worker_out_of_descriptors_keeps_a_frontend_running(monkeypatch):
    """(gpu_workers.intake.running): False would let a live frontend's queued requests go."""
    from gpu_workers import intake

    class NoDescriptors:
        def __init__(self, path):
            self.path = path

        def read_text(self):
            raise OSError(errno.EMFILE, "Too many open files", self.path)

    monkeypatch.setattr(intake, "Path", NoDescriptors)
    assert intake.running(1234) is True
