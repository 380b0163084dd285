"""The order `shmserve apply` restarts programs in (shmserve.apply_plan.plan, unit_order,
lone_during): what the change needs served meanwhile, and what it says it cannot serve."""

from __future__ import annotations

import dataclasses

from shmserve import apply_plan, config
from tests.unit.test_apply import NONE, with_


def test_the_order_follows_what_the_change_needs_served_meanwhile(base, capsys):  # noqa: F811
    dropped = dataclasses.replace(base, models=[*base.models, dataclasses.replace(
        base.models[0], name="other")])
    # A model removed: the frontends stop routing to it before the workers unload it.
    assert apply_plan.plan(dropped, base, NONE).frontends_first
    # A model added: the workers load it before the frontends route to it.
    assert not apply_plan.plan(base, dropped, NONE).frontends_first
    # Workers added while the kept ones restart: the frontends learn the new ones first.
    grown = apply_plan.plan(base, with_(base, workers={"cpu_workers": 3},
                                   batching={"max_batch_size": 4}),
                       {**NONE, "added": ["workers:worker-2"]})
    assert grown.frontends_first and grown.roll_workers == ["worker-0", "worker-1"]
    assert grown.lines()[:3] == ["  start: worker-2", "  restart one at a time: frontend-0, "
                                 "frontend-1", "  restart one at a time: worker-0, worker-1"]
    # Models both added and removed (one renamed, the default replaced): the workers that
    # serve the new ones restart first while the others still serve the old ones, then the
    # frontends, then the rest; with three workers, the old model's last host restarts last
    # (the old order restarted every worker first: the old frontends' default model went
    # unserved, 503s to requests naming none, in an outside check).
    three = with_(base, workers={"cpu_workers": 3})
    placed = dataclasses.replace(three, models=[
        dataclasses.replace(base.models[0], name="a", devices=[0, 1]),
        dataclasses.replace(base.models[0], name="b", devices=[2])])
    renamed = dataclasses.replace(three, models=[dataclasses.replace(base.models[0], name="c")])
    steps = apply_plan.plan(placed, renamed, NONE)
    assert steps.workers_before_frontends == ["worker-0"] and not steps.frontends_first
    assert steps.lines() == ["  restart one at a time: worker-0",
                             "  restart one at a time: frontend-0, frontend-1",
                             "  restart one at a time: worker-1, worker-2"]
    # No warning of b "only on worker-2": by its restart the frontends no longer route to it
    # (an outside check's warning named it; nothing failed)
    assert apply_plan.lone_during(placed, renamed, steps) == {}
    # Where a model's other host has already moved, its last one's restart is a gap: said
    # (a on 0, 1 and e on 2 -> e on 0, 1 and a on 1, 2: worker-1 is a's last host by then;
    # e, "only on worker-2" by the config alone, is on worker-0 by worker-2's restart)
    moved = dataclasses.replace(three, models=[
        dataclasses.replace(base.models[0], name="e", devices=[0, 1]),
        dataclasses.replace(base.models[0], name="a", devices=[1, 2])])
    before = dataclasses.replace(three, models=[
        dataclasses.replace(base.models[0], name="a", devices=[0, 1]),
        dataclasses.replace(base.models[0], name="e", devices=[2])])
    steps_moved = apply_plan.plan(before, moved, NONE)
    assert steps_moved.roll_workers == ["worker-0", "worker-1", "worker-2"]
    assert apply_plan.lone_during(before, moved, steps_moved) == {"worker-1": ["a"]}
    # Back: a (workers 0, 1) and b (worker 2) must each have a restarted host, and c one left.
    steps = apply_plan.plan(renamed, placed, NONE)
    assert steps.workers_before_frontends == ["worker-0", "worker-2"], steps
    assert steps.lines()[-1] == "  restart one at a time: worker-1"
    # One worker: no order serves both sides; the workers first as before (a gap).
    one = with_(base, workers={"cpu_workers": 1})
    swap = apply_plan.plan(one, dataclasses.replace(one, models=[dataclasses.replace(
        base.models[0], name="c")]), NONE)
    assert swap.workers_before_frontends == [] and not swap.frontends_first
    assert swap.lines()[0] == "  restart one at a time: worker-0"
    # No order serves both: each old model on a worker a new one needs. Warned of, naming
    # them (an outside check saw the default's 503s with no warning).
    split_up = dataclasses.replace(base, models=[
        dataclasses.replace(base.models[0], name="c", devices=[0]),
        dataclasses.replace(base.models[0], name="d", devices=[1])])
    steps = apply_plan.plan(base, split_up, NONE)
    assert steps.unserved == ["m"] and steps.workers_before_frontends == []
    apply_plan.warn_gaps(base, split_up, steps)
    assert ("requests for m and those naming no model fail from the restart of the last "
            "worker serving them until every frontend has restarted") in capsys.readouterr().err
    # A new model only on an added worker: it loads, the frontends restart, then the kept
    # workers (they restarted first, and the old default went unserved: an outside check).
    x = dataclasses.replace(base.models[0], name="x")
    grown = apply_plan.plan(
        dataclasses.replace(base, models=[x, base.models[0]]),
        dataclasses.replace(with_(base, workers={"cpu_workers": 3}), models=[
            base.models[0], dataclasses.replace(base.models[0], name="b", devices=[2])]),
        {**NONE, "added": ["workers:worker-2"]})
    assert grown.frontends_first and not grown.unserved, grown
    assert grown.lines()[:2] == ["  start: worker-2",
                                 "  restart one at a time: frontend-0, frontend-1"]
    # A model to A/B variants under the same name with two workers: one worker loads the arms
    # while the other still serves the model, then the frontends (no warning needed).
    ab2 = dataclasses.replace(base.models[0], source="", variants=[
        config.VariantConfig(name="a", source="/x/a"), config.VariantConfig(name="b",
                                                                            source="/x/b")])
    steps = apply_plan.plan(base, dataclasses.replace(base, models=[ab2]), NONE)
    assert steps.workers_before_frontends == ["worker-0"] and steps.reshaped == []
    # A model to A/B variants under the same name, one worker: warned of (no order serves it).
    ab = dataclasses.replace(base.models[0], source="", variants=[
        config.VariantConfig(name="a", source="/x/a"), config.VariantConfig(name="b",
                                                                            source="/x/b")])
    assert apply_plan.plan(one, dataclasses.replace(one, models=[ab]), NONE).reshaped == ["m"]
