"""/embed_sparse's answer (frontend.tei): TEI's shape, float32 values written short, and a
bound on its size."""

import numpy as np
import orjson
import pytest

from frontend.errors import ApiError
from frontend.tei import SPARSE_VALUES, bounded, sparse
from shmserve.client import SparseVector


def test_non_zero_values_in_index_order_written_as_float32():
    row = np.array([0, 0.9179002642631531, 0, 1.5, 0], np.float32)
    got = orjson.dumps(sparse(row), option=orjson.OPT_SERIALIZE_NUMPY)
    # float32's shortest decimal: Python's float of it took 17 digits (20% more JSON)
    assert got == b'[{"index":1,"value":0.91790026},{"index":3,"value":1.5}]'


def test_an_answer_past_the_bound_is_a_413():
    """A checkpoint whose vectors are not sparse gave 26,000 values a text: 256 texts made
    297 MB of JSON and a 2.4 GB frontend (an outside check)."""
    rows = np.zeros((64, 30522), np.float32)
    rows[:, :SPARSE_VALUES // 64] = 1
    assert bounded(rows) is rows
    rows[0, -1] = 1  # one more
    with pytest.raises(ApiError) as info:
        bounded(rows)
    assert info.value.status == 413 and "non-zero values" in info.value.message


def test_a_sparse_vector_made_dense_names_a_size_too_small():
    vector = SparseVector(np.array([3, 30000]), np.array([0.5, 1.0], np.float32))
    assert vector.dense(30522)[30000] == 1.0
    with pytest.raises(ValueError, match="index 30000 is past a vector of 10"):
        vector.dense(10)
