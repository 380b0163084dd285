from dataclasses import dataclass, replace

import pytest

from gpu_workers.batcher import (Arrivals, FairTurns, Limits, anchor_index, form_batch,
                                 form_pass, wait_time)


@dataclass(eq=False)
class T:
    length: int
    arrived: float = 0.0
    model: str = "m"
    priority: int = 0


LIMITS = Limits(max_batch_size=8, max_batch_tokens=1024, max_wait_s=0.005, max_pad_ratio=1.5)


def drain(queue, limits=LIMITS):
    batches = []
    while queue:
        batch, queue = form_batch(queue, limits)
        batches.append(batch)
    return batches


def test_every_text_lands_in_exactly_one_batch():
    queue = [T(n, arrived=i) for i, n in enumerate([5, 300, 7, 6, 120, 8, 9, 130, 5, 5, 5, 250])]
    batches = drain(list(queue))
    seen = [id(t) for b in batches for t in b.texts]
    assert sorted(seen) == sorted(id(t) for t in queue)


def test_limits_hold_for_every_batch():
    queue = [T(n, arrived=i) for i, n in enumerate([3, 40, 41, 39, 200, 5, 6, 7, 8, 9, 10, 11,
                                                    12, 13, 500, 60, 61, 62, 63, 64])]
    for batch in drain(queue):
        assert len(batch.texts) <= LIMITS.max_batch_size
        assert batch.padded_len == max(t.length for t in batch.texts)
        if len(batch.texts) > 1:  # a single over-budget text still runs alone
            assert batch.padded_tokens <= LIMITS.max_batch_tokens
            assert batch.padded_tokens <= LIMITS.max_pad_ratio * batch.real_tokens


def test_lengths_are_grouped_to_cut_padding():
    queue = [T(n, arrived=i) for i, n in enumerate([10, 200, 11, 190, 12, 195, 9, 205])]
    groups = sorted(sorted(t.length for t in b.texts) for b in drain(queue))
    assert groups == [[9, 10, 11, 12], [190, 195, 200, 205]]


def test_oldest_text_is_always_in_the_next_batch():
    old = T(400, arrived=0.0)
    queue = [old] + [T(10, arrived=1.0 + i) for i in range(20)]
    batch, rest = form_batch(queue, LIMITS)
    assert old in batch.texts
    assert len(rest) == 20  # the short ones were not padded up to 400


def test_higher_priority_goes_first_and_rest_keeps_arrival_order():
    queue = [T(10, arrived=0, priority=0), T(50, arrived=1, priority=1),
             T(11, arrived=2, priority=0)]
    assert anchor_index(queue) == 1
    batch, rest = form_batch(queue, LIMITS)
    assert queue[1] in batch.texts
    assert [t.arrived for t in rest] == sorted(t.arrived for t in rest)


def test_models_never_share_a_batch():
    queue = [T(10, model="a", arrived=0), T(10, model="b", arrived=1), T(10, model="a", arrived=2)]
    batch, rest = form_batch(queue, LIMITS)
    assert {t.model for t in batch.texts} == {"a"} and len(batch.texts) == 2
    assert [t.model for t in rest] == ["b"]


def test_equal_lengths_fill_up_to_batch_size():
    queue = [T(16, arrived=i) for i in range(20)]
    sizes = [len(b.texts) for b in drain(queue)]
    assert sizes == [8, 8, 4]


@pytest.mark.parametrize("queue,now,expected", [
    ([T(10, arrived=1.0)], 1.0, 0.005),  # alone: wait for company
    ([T(10, arrived=1.0)], 1.003, 0.002),
    ([T(10, arrived=1.0)], 2.0, 0.0),  # waited long enough
    ([T(10, arrived=1.0) for _ in range(8)], 1.0, 0.0),  # a full batch is queued
    ([T(600, arrived=1.0), T(600, arrived=1.0)], 1.0, 0.0),  # the token budget is reached
])
def test_wait_time(queue, now, expected):
    assert wait_time(queue, now, LIMITS) == pytest.approx(expected)


def test_no_wait_where_requests_arrive_further_apart_than_the_wait():
    alone = [T(10, arrived=1.0)]
    arrivals = Arrivals(LIMITS.max_wait_s)
    assert arrivals.gap_s == 4 * LIMITS.max_wait_s  # none seen: no company expected
    assert wait_time(alone, 1.0, LIMITS, arrivals.gap_s) == 0.0
    for i in range(8):  # a burst: 1 ms apart, under the 5 ms wait
        arrivals.arrived(10.0 + i / 1000)
    assert arrivals.gap_s < LIMITS.max_wait_s
    assert wait_time(alone, 1.0, LIMITS, arrivals.gap_s) == pytest.approx(0.005)
    for i in range(8):  # a serial client: 12 ms apart, a gap of hours counted as 20 ms
        arrivals.arrived(3600.0 + i * 0.012)
    assert LIMITS.max_wait_s <= arrivals.gap_s <= 4 * LIMITS.max_wait_s
    assert wait_time(alone, 1.0, LIMITS, arrivals.gap_s) == 0.0


def test_no_wait_for_a_serial_client_faster_than_the_wait():
    """Each request arrives after the last was answered (nothing else queued): 1 ms apart,
    under the 5 ms wait, yet no company can come, since the client waits for its answer."""
    alone = [T(10, arrived=1.0)]
    arrivals = Arrivals(LIMITS.max_wait_s)
    for i in range(50):
        arrivals.arrived(10.0 + i / 1000, alone=True)
    assert wait_time(alone, 1.0, LIMITS, arrivals.gap_s) == 0.0
    for i in range(8):  # concurrent clients: each finds others' work queued
        arrivals.arrived(20.0 + i / 1000, alone=i == 0)
    assert wait_time(alone, 1.0, LIMITS, arrivals.gap_s) == pytest.approx(0.005)


def test_a_fair_turn_starts_from_the_oldest_text_of_any_priority():
    low = T(10, arrived=0.0, priority=0)
    highs = [T(10, arrived=0.1 + i / 100, priority=5) for i in range(20)]
    queue = [low] + highs
    assert queue[anchor_index(queue)].priority == 5
    assert anchor_index(queue, fair_turn=True) == 0
    batch, _ = form_batch(queue, LIMITS, fair_turn=True)
    assert low in batch.texts


def test_lower_priority_never_starves_under_a_steady_stream():
    """High-priority texts (of another length, so they never share a batch with it) keep
    arriving faster than batches drain; with a fair turn after 3 batches in a row that went
    before it, the low one runs in the 4th batch."""
    low = T(200, arrived=0.0, priority=0)
    queue, turns = [low], FairTurns(4)
    for count in range(40):
        queue += [T(10, arrived=1.0 + count, priority=1) for _ in range(9)]
        oldest = queue[0]
        batch, queue = form_batch(queue, LIMITS, fair_turn=turns.next())
        turns.ran(oldest, queue)
        if low in batch.texts:
            break
    assert low in batch.texts and count == 3


def test_a_fair_turn_comes_only_after_passes_that_went_before_an_older_text():
    """Passes of one priority alone are not counted: a query that comes after any number of
    them runs in the next pass (a fair turn every 4th pass whatever went before made a query
    that came at one wait a second pass behind a bulk flood)."""
    turns = FairTurns(4)
    bulk = [T(200, arrived=i, priority=-1) for i in range(200)]

    def run(queue):  # one pass, as the worker runs it: whether it was fair, and the rest
        fair, oldest = turns.next(), queue[0]
        _, rest = form_batch(queue, LIMITS, fair_turn=fair)
        turns.ran(oldest, rest)
        return fair, rest

    def query(k):  # of another length than the bulk's: never in its batches
        return T(5, arrived=300.0 + k, priority=0)

    for _ in range(7):  # the bulk alone: never a fair turn
        fair, bulk = run(bulk)
        assert not fair
    fair, rest = run(bulk + [query(0)])
    assert not fair  # the query's pass
    # A stream of queries: the 4th pass in a row that goes before the bulk is a fair turn
    fairs = []
    for k in range(1, 5):
        fair, rest = run(rest + [query(k)])
        fairs.append(fair)
    assert fairs == [False, False, True, False]
    assert FairTurns(1).next()  # 1: every pass fair


def test_a_pass_merges_length_groups_only_for_a_model_that_packs_them():
    queue = [T(n, arrived=i) for i, n in enumerate([5, 300, 7, 6, 120, 8, 130, 5])]
    single, rest = form_pass(queue, LIMITS)
    assert len(single) == 1 and single[0].texts == form_batch(queue, LIMITS)[0].texts
    batches, rest = form_pass(queue, LIMITS, merges=lambda text: True)
    assert len(batches) > 1
    texts = [t for b in batches for t in b.texts]
    assert len(texts) <= LIMITS.max_batch_size
    assert sum(b.padded_tokens for b in batches) <= LIMITS.max_batch_tokens
    assert sorted(map(id, texts + rest)) == sorted(map(id, queue))  # nothing lost or doubled
    assert [t.arrived for t in rest] == sorted(t.arrived for t in rest)
    for b in batches:  # each group still holds similar lengths
        assert b.padded_tokens <= LIMITS.max_pad_ratio * b.real_tokens


def test_a_pass_never_merges_another_models_texts():
    queue = [T(10, model="a", arrived=0), T(300, model="a", arrived=1),
             T(10, model="b", arrived=2)]
    batches, rest = form_pass(queue, LIMITS, merges=lambda text: True)
    assert [[t.length for t in b.texts] for b in batches] == [[10], [300]]  # both of "a"
    assert [t.model for t in rest] == ["b"]


def _one_after_another(queue, limits, fair, model=None, strict=False):
    """form_batch on `queue`, then on its rest, ... while the batches are of one model and fit
    the limits (the first batch always, unless `strict`)."""
    want, rest, texts, padded = [], list(queue), 0, 0
    while rest:
        nxt, after = form_batch(rest, limits, fair and not want)
        model = model or nxt.texts[0].model
        if nxt.texts[0].model != model or (want or strict) and (
                texts + len(nxt.texts) > limits.max_batch_size
                or padded + nxt.padded_tokens > limits.max_batch_tokens):
            break
        want.append(nxt)
        rest = after
        texts, padded = texts + len(nxt.texts), padded + nxt.padded_tokens
    return want, rest, texts, padded


def test_a_pass_is_the_batches_form_batch_would_form_one_after_another():
    # form_pass sorts the queue once for all its batches; form_batch sorts on every call. On
    # random queues (lengths, models, priorities, limits) both must give the same batches:
    # on a fair turn from the whole queue; otherwise from the texts of the top priority, then
    # from the rest.
    import random

    rng = random.Random(7)
    for _ in range(3000):
        queue = [T(rng.choice([rng.randint(0, 10), rng.randint(1, 200)]), arrived=i,
                   model=rng.choice("aab"), priority=rng.choice([0, 0, 0, 1, -1]))
                 for i in range(rng.randint(1, 60))]
        limits = Limits(rng.randint(1, 64), rng.randint(1, 4000), 0.005,
                        rng.choice([1.0, 1.2, 1.5, 3.0]), top_up=rng.choice([0, 0.5, 1, 1e6]))
        fair = rng.random() < 0.3
        batches, rest = form_pass(queue, limits, fair, merges=lambda text: True)
        top = max(t.priority for t in queue)
        if fair:
            want, want_rest, _, _ = _one_after_another(queue, limits, True)
        else:
            want, _, texts, padded = _one_after_another(
                [t for t in queue if t.priority == top], limits, False)
            taken = {id(t) for b in want for t in b.texts}
            want_rest = [t for t in queue if id(t) not in taken]
            # then the rest, grown within the room the top priority left
            room = Limits(limits.max_batch_size - texts,
                          min(limits.max_batch_tokens - padded, int(limits.top_up * padded)),
                          limits.max_wait_s, limits.max_pad_ratio)
            if want_rest and room.max_batch_size > 0 and room.max_batch_tokens > 0:
                more, want_rest, _, _ = _one_after_another(
                    want_rest, room, False, want[0].texts[0].model, strict=True)
                want += more
        assert [b.texts for b in batches] == [b.texts for b in want]
        assert [b.padded_len for b in batches] == [b.padded_len for b in want]
        assert rest == want_rest


def test_a_top_priority_request_runs_in_one_pass_among_a_flood_of_lower_ones():
    # 4 high texts of 12, 30, 45 and 80 tokens among 200 low texts of every length between:
    # grown among all, the first group filled the pass with low texts near 12 tokens, and the
    # request ran a text a pass (an outside check: 2-4 passes, some past a 2 s deadline).
    import random

    rng = random.Random(5)
    low = [T(rng.randint(8, 90), arrived=i, priority=-1) for i in range(200)]
    high = [T(n, arrived=300 + i, priority=1) for i, n in enumerate((12, 30, 45, 80))]
    limits = Limits(32, 8192, 0.0, 1.5, window=256)
    batches, rest = form_pass(low + high, limits, merges=lambda text: True)
    ran = [t for b in batches for t in b.texts]
    assert all(t in ran for t in high) and not any(t in rest for t in high)
    # The pass is then topped up with low texts to at most as many padded tokens as the high
    # ones' (top_up 1)...
    high_padded = sum(b.padded_tokens for b in batches if b.texts[0].priority == 1)
    assert high_padded < sum(b.padded_tokens for b in batches) <= 2 * high_padded
    assert len(ran) < 32
    # ... or filled, with no bound on the top-up
    full, _ = form_pass(low + high, replace(limits, top_up=1e6), merges=lambda text: True)
    assert sum(len(b.texts) for b in full) == 32
    # A model that runs one group a pass: the anchor's group, grown among all, as before
    (batch,), _ = form_pass(low + high, limits)
    assert high[0] in batch.texts and high[3] not in batch.texts
    assert sum(t.priority == -1 for t in batch.texts) > 16


def _finish_passes(queue, limits, merges=True):
    """The pass (0-based) in which each request's last text ran, by request."""
    finished, passes = {}, 0
    while queue:
        batches, queue = form_pass(queue, limits, merges=lambda text: merges)
        for batch in batches:
            for text in batch.texts:
                finished[text.model_request] = passes
        passes += 1
    return [finished[r] for r in sorted(finished)]


@dataclass(eq=False)
class R(T):
    model_request: int = 0


def _backlog(requests=30, texts=8, seed=3):
    import random

    rng = random.Random(seed)
    return [R(rng.randint(5, 200), arrived=r, model_request=r)
            for r in range(requests) for _ in range(texts)]


def test_under_a_backlog_a_pass_takes_the_oldest_requests_texts():
    limits = Limits(8, 4096, 0.0, 1.5, window=16)
    queue = _backlog()
    while queue:
        window = {id(t) for t in queue[:16]}
        batches, queue = form_pass(queue, limits, merges=lambda text: True)
        assert all(id(t) in window for b in batches for t in b.texts)


def test_a_window_finishes_requests_in_order_where_whole_queue_grouping_finishes_them_late():
    windowed = _finish_passes(_backlog(), Limits(8, 4096, 0.0, 1.5, window=16))
    whole = _finish_passes(_backlog(), Limits(8, 4096, 0.0, 1.5))
    assert len(windowed) == len(whole) == 30
    # The oldest request's 8 texts are in the first window: done within its first passes.
    assert windowed[0] <= 4 < whole[0]
    # On average requests finish earlier: grouping over all 240 texts spreads each request over
    # the whole drain.
    assert sum(windowed) < 0.8 * sum(whole)
    # Roughly in arrival order: no request finishes before one 3 requests older. Whole-queue
    # grouping finishes young requests of common lengths before old ones.
    assert all(windowed[r] >= windowed[r - 3] for r in range(3, 30))
    assert not all(whole[r] >= whole[r - 3] for r in range(3, 30))


def test_the_window_takes_higher_priorities_first_and_the_oldest_on_a_fair_turn():
    low = [T(20, arrived=i, priority=0) for i in range(40)]
    high = [T(20, arrived=40 + i, priority=1) for i in range(4)]
    limits = Limits(8, 4096, 0.0, 1.5, window=8)
    batch, _ = form_batch(low + high, limits)
    assert all(t in batch.texts for t in high)  # late, but first by priority
    batch, _ = form_batch(low + high, limits, fair_turn=True)
    assert batch.texts and all(t.priority == 0 for t in batch.texts)
    assert set(map(id, batch.texts)) <= set(map(id, low[:8]))


def test_a_queue_within_the_window_is_grouped_as_a_whole():
    import random

    rng = random.Random(11)
    for _ in range(300):
        queue = [T(rng.randint(1, 200), arrived=i, model=rng.choice("ab"),
                   priority=rng.choice([0, 1])) for i in range(rng.randint(1, 40))]
        fair = rng.random() < 0.3
        whole = form_pass(queue, Limits(8, 2048, 0.0, 1.5), fair, merges=lambda text: True)
        windowed = form_pass(queue, Limits(8, 2048, 0.0, 1.5, window=40), fair,
                             merges=lambda text: True)
        assert [b.texts for b in whole[0]] == [b.texts for b in windowed[0]]
        assert whole[1] == windowed[1]


def test_the_configs_pass_window_is_counted_in_batches_of_max_batch_size():
    from shmserve.config import BatchingConfig

    assert Limits.of(BatchingConfig(max_batch_size=32, pass_window=8)).window == 256
    assert Limits.of(BatchingConfig(pass_window=0)).window == 0  # the whole queue
