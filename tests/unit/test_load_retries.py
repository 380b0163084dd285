"""A serving worker's models that failed to load, tried again (gpu_workers.loading.Retries)."""

import queue
import time

from gpu_workers import loading
from gpu_workers.loading import Retries


def test_a_model_that_failed_is_tried_again_later_each_time_until_it_loads(monkeypatch):
    posted: queue.Queue = queue.Queue()
    outcomes = [OSError("disk\n  gone"), "model"]

    def load(name):
        outcome = outcomes.pop(0)
        if isinstance(outcome, Exception):
            raise outcome
        return ("config", outcome, 0.5)

    retries = Retries(load, posted.put)
    assert not retries
    now = [100.0]
    monkeypatch.setattr(loading.time, "monotonic", lambda: now[0])
    retries.failed("b", loading.describe(ValueError("bad weights")))
    [one] = retries.unloaded()
    assert (one.model, one.error, one.failures, one.retry_in_s) == (
        "b", "ValueError: bad weights", 1, 1.0)
    retries.start_due({})  # not yet: 1 s after the failure
    assert posted.empty()
    now[0] += 1.0
    retries.start_due({})
    failed = posted.get(timeout=5)
    assert (failed.name, failed.loaded, failed.error) == ("b", None, "OSError: disk gone")
    assert retries.unloaded()[0].retry_in_s == 0.0  # being tried
    retries.start_due({})  # one try at a time
    time.sleep(0.05)
    assert posted.empty()
    retries.done(failed)
    [two] = retries.unloaded()
    assert (two.error, two.failures, two.retry_in_s) == ("OSError: disk gone", 2, 2.0)
    now[0] += 1.9
    retries.start_due({})
    assert posted.empty()
    now[0] += 0.1
    retries.start_due({})
    loaded = posted.get(timeout=5)
    assert loaded.loaded == ("config", "model", 0.5) and loaded.error == ""
    retries.done(loaded)
    assert not retries and retries.unloaded() == ()


def test_the_wait_doubles_up_to_its_cap():
    retries = Retries(lambda name: None, lambda item: None)
    waits = []
    for _ in range(8):
        missing = retries.failed("b", "RuntimeError: x")
        waits.append(missing.retry_at - time.monotonic())
    assert [round(w) for w in waits] == [1, 2, 4, 8, 16, 30, 30, 30]


def test_a_reload_recorded_for_it_is_tried_at_once():
    """A reload of a model a worker did not load records its new source in the run state
    (frontend.reload): the worker tries it at once, not at the end of its wait."""
    posted: queue.Queue = queue.Queue()
    retries = Retries(lambda name: ("config", "model", 0.1), posted.put)
    retries.failed("b", "RuntimeError: x")
    retries.start_due({})
    assert posted.empty()  # its 1 s wait
    retries.start_due({"b": {"source": "/models/b2", "revision": ""}})
    assert posted.get(timeout=5).loaded == ("config", "model", 0.1)
