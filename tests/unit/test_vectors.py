import numpy as np
import pytest

from frontend import vectors
from frontend.errors import ApiError


def test_shorten_keeps_a_prefix_renormalised_only_for_normalised_models():
    rows = np.array([[3, 4, 12], [1, 0, 0]], np.float32)
    np.testing.assert_allclose(vectors.shorten(rows, 2, True), [[0.6, 0.8], [1, 0]], atol=1e-7)
    np.testing.assert_array_equal(vectors.shorten(rows, 2, False), rows[:, :2])
    assert vectors.shorten(rows, None, True) is rows
    assert vectors.shorten(rows, 3, True) is rows


def test_normalize_leaves_zero_rows_finite():
    out = vectors.normalize(np.array([[0, 0], [0, 2]], np.float32))
    assert out.dtype == np.float32 and np.isfinite(out).all()
    np.testing.assert_array_equal(out, [[0, 0], [0, 1]])


def test_dimensions_over_the_model_are_refused():
    vectors.check_dimensions(None, 32)
    vectors.check_dimensions(32, 32)
    with pytest.raises(ApiError) as info:
        vectors.check_dimensions(33, 32)
    assert info.value.status == 422 and info.value.param == "dimensions"
