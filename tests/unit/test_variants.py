"""A/B routing without a server: weights, the even split, sticky keys, the shared state file."""

import json
from collections import Counter
from pathlib import Path

import pytest

from frontend.variants import Splits, Variant, bucket, sticky_point
from shmserve import config, state
from shmserve.models import ModelSpec

SPEC = ModelSpec("m@a", Path("/m"), "embedding", "mean", True, 64, 32, "fp32", "")
VARIANTS = (Variant("a", "m@a", SPEC, None, 0.7), Variant("b", "m@b", SPEC, None, 0.3))


@pytest.fixture
def cfg(tmp_path):
    cfg = config.from_tree({"server": {"run_dir": str(tmp_path)},
                            "models": [{"name": "m", "variants": [
                                {"name": "a", "source": "/m", "weight": 0.7},
                                {"name": "b", "source": "/m", "weight": 0.3}]}]})
    return cfg


def test_bucket_edges():
    assert [bucket([1, 1], u) for u in (0.0, 0.49, 0.5, 0.99)] == [0, 0, 1, 1]
    assert bucket([0, 1], 0.0) == 1 and bucket([1, 0], 0.999999) == 0
    assert bucket([0.3, 0.7], 1.0) == 1  # rounding never falls off the end


@pytest.mark.parametrize("n", [10, 100, 2000])
def test_unsticky_split_is_within_a_few_requests_of_the_weights(cfg, n):
    splits = Splits(state.Watch(cfg))
    counts = Counter(splits.choose("m", VARIANTS, None).name for _ in range(n))
    # From any starting point, the golden-ratio sequence puts at most 3.3 points more or fewer
    # than n * weight into a share up to n = 2000 (checked over a fine grid of starts).
    assert abs(counts["b"] - 0.3 * n) <= 4, counts


def test_sticky_keys_are_stable_and_spread(cfg):
    splits = Splits(state.Watch(cfg))
    first = {f"user-{i}": splits.choose("m", VARIANTS, f"user-{i}").name for i in range(400)}
    again = {key: Splits(state.Watch(cfg)).choose("m", VARIANTS, key).name for key in first}
    assert first == again  # another frontend, or a restart: the same answer
    assert 0.2 < Counter(first.values())["b"] / 400 < 0.4
    assert sticky_point("m", "x") == sticky_point("m", "x") != sticky_point("other", "x")


def test_an_arm_no_worker_serves_gives_its_share_to_the_served_ones(cfg):
    """Its workers restarting, or its model not loaded (gpu_workers.loading.Retries): its
    requests go to an arm that is served (X-Model-Variant names it), not to a 503; sticky keys
    of the served arms keep theirs, and come back once it is served again."""
    splits = Splits(state.Watch(cfg))
    down = {"m@b"}
    serving = lambda unit: unit not in down  # noqa: E731
    assert Counter(splits.choose("m", VARIANTS, None, serving).name
                   for _ in range(200)) == {"a": 200}
    keys = [f"user-{i}" for i in range(200)]
    before = {key: splits.choose("m", VARIANTS, key).name for key in keys}
    during = {key: splits.choose("m", VARIANTS, key, serving).name for key in keys}
    assert set(during.values()) == {"a"}
    assert all(during[k] == "a" for k in keys if before[k] == "a")
    down.add("m@a")  # none served: the weights' choice (the dispatcher says why it fails)
    assert {splits.choose("m", VARIANTS, key, serving).name for key in keys} == {"a", "b"}
    down.clear()
    assert {key: splits.choose("m", VARIANTS, key, serving).name for key in keys} == before


def test_admin_weights_in_the_state_file_win_and_are_reread(cfg):
    watch = state.Watch(cfg)
    splits = Splits(watch)
    assert splits.weights("m", VARIANTS) == [0.7, 0.3]
    state.update(cfg, lambda tree: tree["splits"].__setitem__("m", {"a": 0, "b": 2}))
    assert splits.weights("m", VARIANTS) == [0.0, 2.0]
    assert {splits.choose("m", VARIANTS, None).name for _ in range(50)} == {"b"}
    # Weights that do not name exactly these variants are ignored, as is a damaged file.
    state.update(cfg, lambda tree: tree["splits"].__setitem__("m", {"a": 1}))
    assert splits.weights("m", VARIANTS) == [0.7, 0.3]
    state.path(cfg).write_text("{not json")
    assert splits.weights("m", VARIANTS) == [0.7, 0.3]


def test_state_updates_keep_other_entries_and_remove_clears(cfg):
    state.update(cfg, lambda t: t["sources"].__setitem__("m@a", {"source": "/x", "revision": "2"}))
    state.update(cfg, lambda t: t["splits"].__setitem__("m", {"a": 1.0, "b": 1.0}))
    now = state.read(cfg)
    assert now.sources == {"m@a": {"source": "/x", "revision": "2"}}
    assert now.splits == {"m": {"a": 1.0, "b": 1.0}}
    assert json.loads(state.path(cfg).read_text())["sources"]["m@a"]["source"] == "/x"
    assert oct(state.path(cfg).stat().st_mode & 0o777) == "0o600"
    state.remove(cfg)
    assert state.read(cfg) == state.State()


def test_one_reload_of_a_unit_at_a_time_across_processes(cfg):
    # The lock is a file in the run directory, so it holds across frontends; another unit's
    # reload is not held up.
    with state.reloading(cfg, "m@a"):
        with pytest.raises(state.Busy):
            with state.reloading(cfg, "m@a"):
                pass
        with state.reloading(cfg, "m@b"):
            pass
    with state.reloading(cfg, "m@a"):  # released when the first call ended
        pass
    # A model's name may hold a slash, or the name of another's lock file
    for unit, other in (("org/m", "org%2Fm"), ("org/m@a", "m@a"), ("../m", "m")):
        with state.reloading(cfg, unit):
            with pytest.raises(state.Busy):
                with state.reloading(cfg, unit):
                    pass
            with state.reloading(cfg, other):
                pass
    assert {p.name for p in cfg.run_dir.iterdir() if p.name.startswith("reload-")} == {
        "reload-m@a.lock", "reload-m@b.lock", "reload-org%2Fm.lock", "reload-org%2Fm@a.lock",
        "reload-..%2Fm.lock", "reload-m.lock", "reload-org%252Fm.lock"}
