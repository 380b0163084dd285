import numpy as np
import pytest

from tests.e2e.test_api import TEXTS


@pytest.fixture(scope="session")
def native(tiny_stack):
    """TEXTS through the native /predict: what every other protocol must return."""
    status, _, body = tiny_stack.post_json("/predict", {"texts": TEXTS})
    assert status == 200
    return np.array(body["results"], dtype=np.float32)
