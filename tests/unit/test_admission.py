import pytest

from shmserve.admission import Backlog

NOW = 1000.0


def measured(rate: float = 1000.0, pass_s: float = 0.0) -> Backlog:
    """A backlog that has drained at `rate` tokens/s in passes of `pass_s` (0: instant)."""
    backlog = Backlog(share=1.0)
    if pass_s:
        backlog.passed(int(rate * pass_s), pass_s)
    else:
        backlog.passed(int(rate), 1.0)
        backlog.pass_s = 0.0
    return backlog


def test_no_estimate_before_a_backlog_was_measured():
    backlog = Backlog()
    backlog.add(0, 10_000_000)
    assert backlog.refusal(0, 100, NOW, NOW + 1) is None


def test_own_deadline_counts_work_at_its_priority_or_above():
    backlog = measured()
    backlog.add(0, 3000)
    backlog.add(-1, 5000)
    backlog.add(1, 1000)
    assert backlog.refusal(1, 500, NOW, NOW + 1.6) is None  # 1.5 s: the high work only
    assert "too close to its deadline" in backlog.refusal(1, 500, NOW, NOW + 1.4).why
    assert backlog.refusal(0, 500, NOW, NOW + 4.6) is None
    assert backlog.refusal(0, 500, NOW, NOW + 4.4) is not None
    backlog.done(0, 3000)
    assert backlog.refusal(0, 500, NOW, NOW + 1.6) is None
    assert backlog.queued() == 6000


def test_nothing_ahead_is_always_admitted_however_large():
    backlog = measured()
    backlog.add(-1, 5000)  # below: not ahead of a normal request
    assert backlog.refusal(0, 1_000_000, NOW, NOW + 1) is None
    assert backlog.refusal(-1, 1000, NOW, NOW + 5.9) is not None


def test_one_pass_is_added_to_the_wait():
    backlog = measured(rate=1000.0, pass_s=2.0)
    backlog.add(0, 1000)
    assert backlog.refusal(0, 500, NOW, NOW + 3.6) is None  # 1.5 s of work + a 2 s pass
    assert backlog.refusal(0, 500, NOW, NOW + 3.4) is not None


def test_speed_is_tokens_over_time_not_a_mean_of_pass_rates():
    backlog = Backlog(decay=1.0)
    backlog.passed(100, 1.0)  # a slow pass of short texts
    backlog.passed(2900, 1.0)
    assert backlog.rate == pytest.approx(1500.0)  # 3,000 tokens in 2 s
    assert backlog.pass_s == pytest.approx(1.0)
    backlog.passed(0, 1.0)  # an empty or unmeasured pass changes nothing
    backlog.passed(100, 0.0)
    assert backlog.rate == pytest.approx(1500.0)


def test_older_passes_weigh_less():
    backlog = Backlog(decay=0.5)
    backlog.passed(1000, 1.0)
    backlog.passed(3000, 1.0)
    assert backlog.rate == pytest.approx((1000 * 0.5 + 3000) / 1.5)


def test_the_warm_up_seed_is_taken_slower_than_it_ran():
    from shmserve.admission import SEED_SLOWDOWN, Backlog

    backlog = Backlog()
    backlog.seed(3_000, 1.0)
    assert SEED_SLOWDOWN > 1 and backlog.rate == 3_000 / SEED_SLOWDOWN
    assert backlog.pass_s == SEED_SLOWDOWN


def test_nothing_ahead_is_admitted_even_past_its_deadline():
    """... and then dropped as late (504), not refused as overloaded (429)."""
    backlog = measured()
    assert backlog.refusal(0, 500, NOW, NOW - 1) is None
    backlog.add(0, 10)
    assert backlog.refusal(0, 500, NOW, NOW - 1) is not None


def test_retry_after_is_when_the_same_request_would_be_admitted_spread_over_twice_that():
    """It was a fixed 1 s: clients that honour it came back while the backlog they were
    refused for still stood, and a refused burst came back at once."""
    from shmserve.admission import MAX_RETRY_AFTER_S, retry_after_s

    backlog = measured()  # share 1.0, 1,000 tokens/s, no pass time
    backlog.add(0, 9500)
    # done in 10 s, due in 4 s: the same request sent 6 s later is admitted
    waits = {backlog.refusal(0, 500, NOW, NOW + 4).retry_after_s for _ in range(400)}
    assert min(waits) in (6, 7) and max(waits) == 12 and len(waits) > 4
    assert retry_after_s(6.0, draw=0.0) == 6 and retry_after_s(6.0, draw=0.5) == 9
    assert retry_after_s(0.01, draw=0.0) == 1  # at least a second (a header's unit)
    assert retry_after_s(1e6, draw=0.0) == MAX_RETRY_AFTER_S  # at most a client's own limit
    assert retry_after_s(float("inf")) == MAX_RETRY_AFTER_S
    # a request too large for its deadline alone: admitted once nothing is ahead (it was told
    # 60 s, the most, where the queue ahead drained in 0.3 s: an outside check)
    small = measured()
    small.add(0, 300)  # 0.3 s ahead; the request alone needs 40 s, due in 4 s
    assert {small.refusal(0, 40_000, NOW, NOW + 4).retry_after_s for _ in range(50)} == {1}
    # a full queue: the time to drain the tokens over the bound
    assert backlog.retry_after_s(3000) in range(3, 7)
    assert Backlog().retry_after_s(3000) in (1, 2)  # no speed measured yet: 1 s, spread
