"""frontend.app's error rendering, on mocked requests: no stack, no sockets."""

import json

import msgpack
import pytest
from aiohttp import web
from aiohttp.test_utils import make_mocked_request

from frontend.app import LOG_FIELDS, REQUEST_ID, error_response
from frontend.errors import ApiError


def render(path: str, exc: ApiError, accept: str = "") -> web.Response:
    request = make_mocked_request("POST", path, headers={"Accept": accept} if accept else {},
                                  app=web.Application())
    request[REQUEST_ID] = "rid-1"
    request[LOG_FIELDS] = {}
    return error_response(request, exc)


@pytest.mark.parametrize("path", ["/v2", "/v2/models/nope/infer", "/v2/no/such/route",
                                  "/v2/models/org/m/versions/3/ready"])
def test_every_v2_error_is_kserves_string_shape(path):
    # Triton's client does "[" + status + "] " + body["error"]: anything but a string raises.
    response = render(path, ApiError("overloaded", "busy", retry_after=1))
    assert json.loads(response.body) == {"error": "busy"}
    assert response.status == 429 and response.headers["Retry-After"] == "1"
    response = render(path, ApiError("not_found", "no model", param="model"),
                      accept="application/msgpack")
    assert response.status == 404 and msgpack.unpackb(response.body) == {"error": "no model"}


@pytest.mark.parametrize("path", ["/predict", "/v1/embeddings", "/v2x", "/embed"])
def test_other_routes_keep_the_openai_error_object(path):
    response = render(path, ApiError("unauthorized", "key?"))
    assert json.loads(response.body) == {"error": {"message": "key?", "type": "unauthorized",
                                                   "param": None, "code": None},
                                         "message": "key?"}  # TEI's and Cohere's place
    assert response.status == 401 and "WWW-Authenticate" in response.headers


def test_a_5xx_names_the_request_id_in_either_shape():
    for path in ("/v2/models/m/infer", "/predict"):
        body = json.loads(render(path, ApiError("unavailable", "no worker")).body)
        message = body["error"] if path.startswith("/v2") else body["error"]["message"]
        assert message == "no worker (request id rid-1)"


HEADER, CONFIGURED, CUT = "X-Request-Timeout", "frontends.request_timeout_s", \
    "nginx.proxy_read_timeout_s"


@pytest.mark.parametrize("header,proxy,deadline", [
    (None, 120, (30.0, CONFIGURED)), ("2.5", 120, (2.5, HEADER)), ("119", 120, (119.0, HEADER)),
    ("600", 120, (119.0, CUT)), ("3600", 4000, (3600.0, HEADER)), ("600", 2, (1.0, CUT)),
])
def test_a_deadline_stays_under_nginxs_read_timeout(header, proxy, deadline):
    # nginx gives up on a request after proxy_read_timeout_s: a longer deadline would never
    # reach the client as the frontend's 504, so it is cut a second under it (and its 504
    # names nginx's setting).
    import dataclasses

    from frontend.app import CONFIG
    from frontend.request_headers import timeout
    from shmserve import config

    cfg = config.load(environ={})
    app = web.Application()
    app[CONFIG] = dataclasses.replace(cfg, nginx=dataclasses.replace(
        cfg.nginx, proxy_read_timeout_s=proxy))
    request = make_mocked_request("POST", "/predict", app=app,
                                  headers={"X-Request-Timeout": header} if header else {})
    assert timeout(request, 30.0) == deadline


@pytest.mark.parametrize("header", ["١٠", "1_0", "0x10", "nan", "inf", "-1", "0", "3601", "",
                                    "10s", "1e4", "1e", "++5", "+-5", "+"])
def test_a_deadline_header_is_ascii_decimal_seconds(header):
    """float() reads other scripts' digits and underscores (an outside check: "١٠" and "1_0"
    were taken as 10 s)."""
    from frontend.app import CONFIG
    from frontend.errors import ApiError
    from frontend.request_headers import timeout
    from shmserve import config

    app = web.Application()
    app[CONFIG] = config.load(environ={})
    request = make_mocked_request("POST", "/predict", app=app,
                                  headers={"X-Request-Timeout": header})
    with pytest.raises(ApiError) as info:
        timeout(request, 30.0)
    assert info.value.status == 422 and info.value.param == "X-Request-Timeout"


@pytest.mark.parametrize("header,seconds", [("10", 10.0), ("2.5", 2.5), (".5", 0.5), ("1e1", 10.0),
                                            ("1e-06", 1e-06), (" 3 ", 3.0), ("3600", 3600.0),
                                            ("+5", 5.0)])
def test_a_deadline_header_in_seconds_as_clients_write_them(header, seconds):
    """shmserve.client writes a microsecond as 1e-06 (str of a float)."""
    from frontend.app import CONFIG
    from frontend.request_headers import timeout
    from shmserve import config

    app = web.Application()
    app[CONFIG] = config.load(environ={})
    request = make_mocked_request("POST", "/predict", app=app,
                                  headers={"X-Request-Timeout": header})
    assert timeout(request, 30.0) == (pytest.approx(min(seconds, 119.0)),
                                      HEADER if seconds <= 119 else CUT)


@pytest.mark.parametrize("header,deadline", [
    (None, (5.0, "parameters.timeout")), ("10", (5.0, "parameters.timeout")),
    ("2", (2.0, HEADER)), ("5", (5.0, HEADER))])
def test_a_deadline_names_what_set_it(header, deadline):
    """KServe's parameters.timeout and X-Request-Timeout: the shorter sets the deadline, and
    its 504 names that one (a parameter's named the header or the config: an outside check)."""
    from frontend.app import CONFIG, TIMEOUT_S
    from frontend.request_headers import timeout
    from shmserve import config

    app = web.Application()
    app[CONFIG] = config.load(environ={})
    request = make_mocked_request("POST", "/v2/models/tiny/infer", app=app,
                                  headers={HEADER: header} if header else {})
    request[TIMEOUT_S] = 5.0
    assert timeout(request, 30.0) == deadline
    assert ApiError.deadline_passed().set_by(deadline[1]).message == (
        f"request deadline passed ({deadline[1]})")


@pytest.mark.parametrize("value,level", [("3", 3), ("-10", -10), ("+1", 1), (" high ", 1),
                                         ("٣", None), ("1_0", None), ("0x1", None),
                                         ("1" * 5000, None), ("11", None)])
def test_a_priority_is_a_name_or_an_ascii_integer(value, level):
    from shmserve.protocol import priority_level

    assert priority_level(value) == level


def test_predict_without_a_model_takes_the_first_embedding_model():
    """As /v1/embeddings does: with a classifier listed first, /predict classified and
    shmserve.client's embed() got a 422 while an embedding model was served (an outside
    check). With no embedding model, the first classifier; with neither, the first model."""
    from types import SimpleNamespace

    from frontend.routes import default_predict_model

    def models(*tasks):
        by_name = {f"m{i}": SimpleNamespace(spec=SimpleNamespace(task=t))
                   for i, t in enumerate(tasks)}
        return SimpleNamespace(by_name=by_name, resolve=lambda name: by_name["m0"])

    for tasks, want in ((("classification", "embedding"), "m1"),
                        (("rerank", "classification", "embedding", "embedding"), "m2"),
                        (("rerank", "classification"), "m1"),
                        (("sparse", "rerank"), "m0"),
                        (("null",), "m0")):
        found = models(*tasks)
        assert default_predict_model(found) is found.by_name[want], tasks


def test_the_media_type_is_read_without_aiohttps_parameter_parser(monkeypatch):
    """aiohttp's `request.content_type` parses every parameter with the email package: ~0.9 s
    of a frontend's event loop for a 15 KB header of 1,900 parameters (a security review: 16
    such requests held both frontends for 9 s and failed a readiness probe)."""
    from pathlib import Path

    from frontend import codec

    monkeypatch.setattr(web.BaseRequest, "content_type", property(
        lambda self: pytest.fail("aiohttp's Content-Type parser was used")))
    long = "application/json;" + ";".join(f"a{i}=b" for i in range(1900))
    for sent, media in ((long, "application/json"),
                        ("Application/MsgPack ; q=1", "application/msgpack"),
                        (None, "application/octet-stream"), ("", "application/octet-stream"),
                        ("junk;;;", "junk")):
        request = make_mocked_request("POST", "/v1/embeddings",
                                      headers={} if sent is None else {"Content-Type": sent})
        assert codec.media_type(request) == media
    for module in Path(codec.__file__).parent.glob("*.py"):  # and no route reads it another way
        assert ".content_type in" not in module.read_text() and \
            "request.content_type" not in module.read_text(), module


def test_a_refused_content_type_shows_a_byte_that_is_not_utf8_as_the_byte():
    """It showed Python's surrogate escape ('application/js\\udcffon'; an outside check)."""
    from frontend import codec

    with pytest.raises(ApiError) as info:
        codec.decode_body(b"x", "application/js\udcffon", True, "application/js\udcffon")
    assert info.value.message.startswith("Content-Type 'application/js\\xffon' is not")
