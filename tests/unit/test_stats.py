"""frontend.stats: Triton's $model_stat objects from the hidden metric samples."""

from __future__ import annotations

from prometheus_client.samples import Sample

from frontend.stats import model_stats


def sample(name: str, value: float, **labels: str) -> Sample:
    return Sample(name, labels, value)


def test_a_model_stat_sums_its_processes_and_maps_an_arm_to_its_model():
    samples = [
        # two frontends' counts of revision r1 of model m, one of r2 (its other A/B arm)
        *[sample("shmserve_stats_requests_total", 2, model="m", revision="r1",
                 outcome="success") for _ in range(2)],
        sample("shmserve_stats_requests_total", 1, model="m", revision="r1", outcome="fail"),
        sample("shmserve_stats_requests_total", 5, model="m", revision="r2", outcome="success"),
        sample("shmserve_stats_seconds_total", 0.5, model="m", revision="r1", part="success"),
        sample("shmserve_stats_seconds_total", 0.25, model="m", revision="r1", part="success"),
        sample("shmserve_stats_seconds_total", 2.0, model="m", revision="r1", part="fail"),
        sample("shmserve_stats_seconds_total", 0.125, model="m", revision="r1", part="queue"),
        sample("shmserve_stats_inferences_total", 7, model="m", revision="r1"),
        sample("shmserve_stats_last_inference_ms", 1000, model="m", revision="r1"),
        sample("shmserve_stats_last_inference_ms", 3000, model="m", revision="r1"),
        # workers name the arm's unit; batch sizes come back in order
        sample("shmserve_stats_executions_total", 1, model="m@a", revision="r1", batch_size="4"),
        sample("shmserve_stats_execution_seconds_total", 0.01, model="m@a", revision="r1",
               batch_size="4"),
        sample("shmserve_stats_executions_total", 3, model="m@a", revision="r1", batch_size="1"),
        sample("shmserve_stats_execution_seconds_total", 0.03, model="m@a", revision="r1",
               batch_size="1"),
        sample("shmserve_stats_executions_total", 9, model="m@b", revision="r2", batch_size="5"),
        # another model's, and a revision no longer served: not asked for
        sample("shmserve_stats_inferences_total", 99, model="other", revision="r1"),
        sample("shmserve_stats_inferences_total", 99, model="m", revision="old"),
    ]
    got = model_stats(samples, {"m": ["r1", "r2"]}, {"m@a": "m", "m@b": "m"})
    assert [(s["name"], s["version"]) for s in got] == [("m", "r1"), ("m", "r2")]
    r1, r2 = got
    assert r1["inference_count"] == 7 and r1["last_inference"] == 3000
    assert r1["execution_count"] == 4
    assert r1["batch_stats"] == [
        {"batch_size": 1, "compute_infer": {"count": 3, "ns": 30_000_000}},
        {"batch_size": 4, "compute_infer": {"count": 1, "ns": 10_000_000}}]
    stats = r1["inference_stats"]
    assert stats["success"] == {"count": 4, "ns": 750_000_000}
    assert stats["fail"] == {"count": 1, "ns": 2_000_000_000}
    assert stats["queue"] == {"count": 4, "ns": 125_000_000}  # one per success
    assert stats["compute_infer"] == {"count": 4, "ns": 0}
    assert r2["inference_stats"]["success"]["count"] == 5 and r2["execution_count"] == 9
    assert r2["inference_count"] == 0 and r2["last_inference"] == 0


def test_a_version_nothing_ran_on_is_all_zero():
    [stat] = model_stats([], {"m": ["r1"]}, {})
    assert stat["execution_count"] == stat["inference_count"] == 0
    assert stat["batch_stats"] == []
    assert all(d == {"count": 0, "ns": 0} for d in stat["inference_stats"].values())


def test_a_turns_requests_are_summed_and_written_once_the_turn_ends():
    """frontend.metrics.StatsTally: the requests of one event-loop turn add to one row per
    model and revision, written when the turn ends; outside a loop, at once."""
    import asyncio

    from frontend import metrics
    from shmserve.metrics import hidden_samples

    def mine() -> dict:
        return {(s.name, s.labels.get("outcome") or s.labels.get("part", "")): s.value
                for s in hidden_samples() if s.labels.get("model") == "tally-m"
                and not s.name.endswith("_created")}

    stages = {"tokenize": 0.25, "queue": 0.5, "inference": 1.0, "transfer": 0.125,
              "handoff": 9.0, "total": 9.0}

    async def turn() -> tuple[dict, dict]:
        for now in (30, 10):
            metrics.stats.add("tally-m", "r", 2.0, stages, 3, now)
        metrics.stats.add("tally-m", "r", 4.0, None, 0, 20)
        held = mine()
        await asyncio.sleep(0)  # the turn ends
        return held, mine()

    held, written = asyncio.run(turn())
    assert held == {}
    assert written == {
        ("shmserve_stats_requests_total", "success"): 2.0,
        ("shmserve_stats_requests_total", "fail"): 1.0,
        ("shmserve_stats_seconds_total", "success"): 4.0,
        ("shmserve_stats_seconds_total", "fail"): 4.0,
        ("shmserve_stats_seconds_total", "compute_input"): 0.5,
        ("shmserve_stats_seconds_total", "queue"): 1.0,
        ("shmserve_stats_seconds_total", "compute_infer"): 2.0,
        ("shmserve_stats_seconds_total", "compute_output"): 0.25,
        ("shmserve_stats_inferences_total", ""): 6.0,
        ("shmserve_stats_last_inference_ms", ""): 30.0}
    metrics.stats.add("tally-m", "r", 1.0, stages, 1, 5)  # no loop: at once, the latest kept
    now = mine()
    assert now[("shmserve_stats_requests_total", "success")] == 3.0
    assert now[("shmserve_stats_last_inference_ms", "")] == 30.0


def test_a_rows_counts_are_written_after_its_seconds_and_its_end(monkeypatch):
    """Another frontend reads the files while a turn's rows are written: one that sees a
    request counted sees its seconds, stages, inputs and end as well (Stack.settled waits on
    the counts; a CI run read a failure counted with the previous request's end)."""
    from frontend import metrics
    from shmserve.metrics import hidden_samples

    def mine() -> dict:
        return {(s.name, s.labels.get("outcome") or s.labels.get("part", "")): s.value
                for s in hidden_samples() if s.labels.get("model") == "order-m"
                and not s.name.endswith("_created")}

    seen = []

    def counting(*labels):
        child = metrics.stats_requests(*labels)

        class Seen:
            def inc(self, amount):
                seen.append((labels[-1], mine()))
                child.inc(amount)
        return Seen()

    monkeypatch.setattr(metrics.StatsTally, "_SERIES", tuple(
        (counting if children is metrics.stats_requests else children, *label)
        for children, *label in metrics.StatsTally._SERIES))
    stages = {"tokenize": 0.25, "queue": 0.5, "inference": 1.0, "transfer": 0.125}
    metrics.stats.add("order-m", "r", 2.0, stages, 3, 40)  # no loop: written at once
    metrics.stats.add("order-m", "r", 4.0, None, 0, 50)
    assert [outcome for outcome, _ in seen] == ["success", "fail"]
    [(_, before_success), (_, before_fail)] = seen
    assert before_success[("shmserve_stats_last_inference_ms", "")] == 40.0
    assert before_success[("shmserve_stats_seconds_total", "success")] == 2.0
    assert before_success[("shmserve_stats_seconds_total", "compute_infer")] == 1.0
    assert before_success[("shmserve_stats_inferences_total", "")] == 3.0
    assert before_fail[("shmserve_stats_last_inference_ms", "")] == 50.0
    assert before_fail[("shmserve_stats_seconds_total", "fail")] == 4.0
    assert before_fail.get(("shmserve_stats_requests_total", "fail"), 0.0) == 0.0
