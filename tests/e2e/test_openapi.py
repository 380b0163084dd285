"""GET /openapi.json through nginx: a valid document, and a bounded schemathesis fuzz of every
operation in it against the live stack: no answer may be a 5xx."""

import json

import msgpack
import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from openapi_spec_validator import validate


@schemathesis.serializer("application/msgpack")
def _msgpack(ctx, value):
    # Every POST route takes msgpack too: fuzz it like JSON. msgpack has no integers past 64
    # bits, so a msgpack client can only send those as floats.
    return {"data": msgpack.packb(_floats(value), use_bin_type=True)}


def _floats(value):
    if isinstance(value, bool):
        return value
    if isinstance(value, int) and not -(1 << 63) <= value < (1 << 64):
        return float(value)
    if isinstance(value, list):
        return [_floats(v) for v in value]
    if isinstance(value, dict):
        return {k: _floats(v) for k, v in value.items()}
    return value


def test_openapi_json_is_served_and_valid(tiny_stack):
    status, headers, raw = tiny_stack.get("/openapi.json")
    assert status == 200 and headers["Content-Type"].startswith("application/json")
    doc = json.loads(raw)
    validate(doc)
    assert {"/predict", "/v1/embeddings", "/embed", "/rerank", "/tokenize", "/info",
            "/v2/models/{model}/infer", "/v2/models/{model}/config"} <= set(doc["paths"])
    # The stack serves embedding models only: no rerank model to name.
    schemas = doc["components"]["schemas"]
    assert schemas["EmbeddingsRequest"]["properties"]["model"]["enum"][0] == "tiny"
    assert "enum" not in schemas["RerankRequest"]["properties"]["model"]
    _, texts = doc["components"]["schemas"]["PredictRequest"]["properties"]["texts"]["oneOf"]
    assert texts["maxItems"] == 64  # the stack's limits.max_texts_per_request


# Bounds: operations x modes x MAX_EXAMPLES requests, each a few milliseconds on the tiny
# model; derandomized, so every run sends the same cases. 16 since the fifty-fourth session's
# six new operations (about the requests 20 sent before them: the suite's time).
MAX_EXAMPLES = 16


def test_fuzz_every_operation_no_5xx(tiny_stack):
    schema = schemathesis.openapi.from_url(tiny_stack.url + "/openapi.json")
    schema.config.update(base_url=tiny_stack.url)
    failures, sent = [], {}
    for result in schema.get_all_operations():
        operation = result.ok()
        for mode in (GenerationMode.POSITIVE, GenerationMode.NEGATIVE):
            @given(case=operation.as_strategy(generation_mode=mode))
            @settings(max_examples=MAX_EXAMPLES, derandomize=True, database=None,
                      deadline=None, suppress_health_check=list(HealthCheck),
                      phases=[Phase.explicit, Phase.generate])  # no shrinking: report as is
            def no_5xx(case):
                response = case.call(timeout=30)
                sent.setdefault(operation.label, []).append(response.status_code)
                assert response.status_code < 500, (
                    f"{case.method} {case.formatted_path} {response.status_code}: "
                    f"{response.text[:300]!r}; body {case.body!r:.300}")

            try:
                no_5xx()
            except AssertionError as exc:
                failures.append(f"{operation.label} ({mode.value}): {exc}")
            except Unsatisfiable:  # nothing to make invalid: a GET without parameters
                assert mode is GenerationMode.NEGATIVE, operation.label
    assert not failures, "\n".join(failures)
    # Every operation was exercised (schemathesis leaves out the document's own path), and
    # valid bodies reached the model, not only the validation.
    documented = json.loads(tiny_stack.get("/openapi.json")[2])["paths"]
    assert {label.split()[1] for label in sent} == set(documented) - {"/openapi.json"}
    assert sum(map(len, sent.values())) >= 10 * 2 * MAX_EXAMPLES
    for label in ("POST /predict", "POST /v1/embeddings", "POST /embed", "POST /tokenize"):
        assert 200 in sent[label], (label, sent[label])
