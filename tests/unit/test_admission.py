import pytest

from gpu_workers.admission import Backlog


def test_no_estimate_before_the_first_pass():
    backlog = Backlog()
    backlog.add(0, 10_000_000)
    assert backlog.wait_s(0, 100) == 0.0


def test_wait_counts_work_at_its_priority_or_above():
    backlog = Backlog()
    backlog.passed(1000, 1.0)  # 1,000 tokens a second
    backlog.add(0, 3000)
    backlog.add(-1, 5000)
    backlog.add(1, 1000)
    assert backlog.wait_s(1, 500) == pytest.approx(1.5)  # only the high work ahead
    assert backlog.wait_s(0, 500) == pytest.approx(4.5)
    assert backlog.wait_s(-1, 500) == pytest.approx(9.5)
    backlog.done(0, 3000)
    assert backlog.wait_s(0, 0) == pytest.approx(1.0)
    assert backlog.queued() == 6000


def test_nothing_ahead_means_no_wait_however_large_the_request():
    backlog = Backlog()
    backlog.passed(1000, 1.0)
    backlog.add(-1, 5000)  # below: not ahead of a normal request
    assert backlog.wait_s(0, 1_000_000) == 0.0
    assert backlog.wait_s(-1, 1000) == pytest.approx(6.0)


def test_rate_follows_recent_passes():
    backlog = Backlog(smoothing=0.5)
    backlog.passed(2000, 1.0)
    assert backlog.rate == 2000
    backlog.passed(1000, 1.0)
    assert backlog.rate == 1500
    backlog.passed(0, 1.0)  # an empty or unmeasured pass changes nothing
    backlog.passed(100, 0.0)
    assert backlog.rate == 1500
