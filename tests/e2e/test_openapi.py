"""GET /openapi.json through nginx: a valid document, and a bounded schemathesis fuzz of every
operation in it against the live stack: no answer may be a 5xx, and every answer is as the
document says (its status declared, its content type and its body's schema)."""

import json

import schemathesis
from hypothesis import HealthCheck, Phase, given, settings
from hypothesis.errors import Unsatisfiable
from schemathesis import GenerationMode
from schemathesis.config._checks import NegativeDataRejectionConfig
from schemathesis.specs.openapi.checks import (content_type_conformance,
                                               negative_data_rejection,
                                               response_schema_conformance,
                                               status_code_conformance)
from openapi_spec_validator import validate

from tests import schemathesis_hooks  # noqa: F401 - msgpack bodies and answers

# What an answer must hold to the document (an outside fuzz, schemathesis' `--checks all`,
# found infinity's `dimensions: 0` answered 200 where the document said at least 1, and
# Cohere's msgpack vectors as bytes where it said arrays of numbers)
CONFORMANCE = [status_code_conformance, content_type_conformance, response_schema_conformance,
               negative_data_rejection]


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
    # A body the document calls invalid is refused: 413 too (too many texts, too long a text)
    rejection = schema.config.checks.negative_data_rejection
    schema.config.checks.negative_data_rejection = NegativeDataRejectionConfig(
        expected_statuses=[*rejection.expected_statuses, "413"])
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
                said = (f"{case.method} {case.formatted_path} {response.status_code}: "
                        f"{response.text[:300]!r}; body {case.body!r:.300}")
                assert response.status_code < 500, said
                try:
                    case.validate_response(response, checks=CONFORMANCE)
                except Exception as exc:  # schemathesis' Failure or FailureGroup
                    raise AssertionError(f"{said}\n{exc}") from None

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


def test_the_document_holds_at_its_edges(tiny_stack, tmp_path):
    """schemathesis' coverage phase, deterministic: each schema's edges (a value just past a
    minimum, a key left out, a wrong type, ...) on every operation, answered in JSON and in
    msgpack. Every answer is as the document says, and what it calls invalid is refused (413
    too: too many texts, too long a text). The random fuzz above missed two places an outside
    run of schemathesis' every phase found: the document's `dimensions` minimum of 1 on
    infinity's /embeddings, where 0 is the model's width and answered 200, and Cohere's
    msgpack vectors, bytes where the document said arrays of numbers."""
    import os
    import re
    import subprocess
    import sys
    from pathlib import Path

    from tests.stack import REPO

    config = tmp_path / "schemathesis.toml"
    config.write_text("[checks.negative_data_rejection]\nexpected-statuses = "
                      "[400, 401, 403, 404, 405, 406, 409, 413, 415, 422, 428, 429]\n")
    document = tmp_path / "openapi.json"  # read as JSON: asked for msgpack, it is msgpack
    document.write_bytes(tiny_stack.get("/openapi.json")[2])
    checks = ",".join([check.__name__ for check in CONFORMANCE] + ["not_a_server_error"])
    for accept in ("application/json", "application/msgpack"):
        done = subprocess.run(
            [str(Path(sys.executable).parent / "schemathesis"), "--config-file", str(config),
             "--no-color", "run", str(document), "--url", tiny_stack.url, "--phases",
             "coverage", "--checks", checks, "--header", f"Accept: {accept}", "--workers", "1",
             "--generation-database", "none", "--request-timeout", "30",
             "--continue-on-failure"],
            # its cache (.schemathesis/) in the test's directory, the hooks from the repository
            cwd=tmp_path, env={**os.environ, "SCHEMATHESIS_HOOKS": "tests.schemathesis_hooks",
                               "PYTHONPATH": str(REPO)},
            capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, (accept, done.stdout[-8000:])
        # every operation, each answer's body read (msgpack too, through the hooks)
        selected = re.search(r"Selected: (\d+)/(\d+)", done.stdout)
        assert selected and selected[1] == selected[2] and int(selected[1]) > 40 and \
            f"Tested: {selected[1]}" in done.stdout, (accept, done.stdout[-3000:])
        assert "cannot validate" not in done.stdout, (accept, done.stdout[-3000:])
