"""API keys on the inference routes (auth.api_keys, auth.api_keys_file), through nginx, with
the clients users have: openai's, huggingface_hub's (TEI), and plain HTTP for msgpack."""

import asyncio
import json
import os
import signal
import time
import urllib.request

import huggingface_hub
import msgpack
import openai
import pytest
import tritonclient.http as triton
from huggingface_hub import InferenceClient

from tests.conftest import tiny_overrides
from tests.stack import Stack

INLINE, FROM_FILE = "inline-key-0123", "file-key-4567"
APP = "https://app.example"  # a browser origin allowed to call (nginx.cors_allow_origins)


@pytest.fixture(scope="module")
def stack(tmp_path_factory, tiny_model):
    root = tmp_path_factory.mktemp("auth")
    keys = root / "keys.txt"
    keys.write_text(f"# a mounted secret: one key a line\n\n{FROM_FILE}\n")
    s = Stack(root / "stack", tiny_overrides(
        tiny_model, auth={"api_keys": [INLINE], "api_keys_file": str(keys)},
        nginx={"cors_allow_origins": [APP]}))
    s.up()  # `up --wait` polls /ready, which stays open
    yield s
    s.down()


@pytest.mark.parametrize("key", [INLINE, FROM_FILE])
def test_the_openai_client_with_a_key_is_served(stack, key):
    with openai.OpenAI(base_url=stack.url + "/v1", api_key=key, max_retries=0) as client:
        got = client.embeddings.create(model="tiny", input=["hello", "world"])
    assert len(got.data) == 2 and len(got.data[0].embedding) == 32


def test_a_wrong_method_is_405_before_any_key_is_asked_for(stack):
    # The path exists (openapi.json lists it); the method is wrong whoever asks. It was 401,
    # also for an admin route called with the admin token.
    for method, path, allow in (("GET", "/v1/embeddings", "POST"),
                                ("POST", "/admin/models", "GET,HEAD")):
        status, headers, raw = stack.request(method, path, b"{}" if method == "POST" else None,
                                             {"Content-Type": "application/json"})
        assert status == 405 and headers["Allow"] == allow, raw


def test_a_browser_app_on_an_allowed_origin_can_call_with_its_key(stack):
    """CORS: the preflight (no key: browsers never send one on it) is answered, then the call
    with the key is served, its answer readable by the page, timings and request id too."""
    status, headers, _ = stack.request("OPTIONS", "/v1/embeddings", None, {
        "Origin": APP, "Access-Control-Request-Method": "POST",
        "Access-Control-Request-Headers": "authorization,content-type"})
    assert status == 204 and headers["Access-Control-Allow-Origin"] == APP
    assert headers["Access-Control-Allow-Headers"] == "authorization,content-type"
    status, headers, body = stack.post_json("/v1/embeddings", {"input": ["hello"]}, {
        "Origin": APP, "Authorization": f"Bearer {INLINE}"})
    assert status == 200 and len(body["data"]) == 1
    assert headers["Access-Control-Allow-Origin"] == APP
    exposed = {h.strip() for h in headers["Access-Control-Expose-Headers"].split(",")}
    assert {"X-Request-ID", "X-Total-Time", "X-Model-Revision", "Retry-After"} <= exposed
    # every header of ours the answer carries is readable by the page (TEI's X-Compute-* were
    # added without it)
    assert {h for h in headers if h.startswith("X-")} <= exposed, headers
    status, headers, body = stack.post_json("/v1/embeddings", {"input": ["hello"]},
                                            {"Origin": APP})
    assert status == 401 and headers["Access-Control-Allow-Origin"] == APP  # readable refusal
    # Another origin: served as before (CORS binds browsers, not the server), no CORS headers.
    status, headers, _ = stack.post_json("/v1/embeddings", {"input": ["hello"]}, {
        "Origin": "https://other.example", "Authorization": f"Bearer {INLINE}"})
    assert status == 200 and "Access-Control-Allow-Origin" not in headers


def test_without_cors_a_preflight_is_a_405_without_cors_headers(tiny_stack):
    status, headers, _ = tiny_stack.request("OPTIONS", "/v1/embeddings", None, {
        "Origin": APP, "Access-Control-Request-Method": "POST"})
    assert status == 405 and headers["Allow"] == "POST"
    assert not [k for k in headers if k.lower().startswith("access-control-")]


def test_the_native_client_sends_its_key(stack, monkeypatch):
    from shmserve.client import AsyncClient, Client, ShmserveError

    monkeypatch.delenv("SHMSERVE_API_KEY", raising=False)
    with Client(stack.url) as client:
        with pytest.raises(ShmserveError) as info:
            client.embed("hello")
    assert info.value.status == 401
    with Client(stack.url, api_key=INLINE) as client:
        assert client.embed(["hello", "world"]).shape == (2, 32)
    monkeypatch.setenv("SHMSERVE_API_KEY", FROM_FILE)  # as the bench and locust read it

    async def embed():
        async with AsyncClient(stack.url, format="json") as client:
            return await client.embed("hello")
    assert asyncio.run(embed()).shape == (32,)


@pytest.mark.parametrize("key", ["wrong-key-0000", INLINE + "x", INLINE[:-1]])
def test_a_wrong_key_is_refused(stack, key):
    with openai.OpenAI(base_url=stack.url + "/v1", api_key=key, max_retries=0) as client:
        with pytest.raises(openai.AuthenticationError) as info:
            client.embeddings.create(model="tiny", input=["hello"])
    assert info.value.status_code == 401
    assert info.value.body["type"] == "unauthorized"
    assert info.value.code == "invalid_api_key"  # OpenAI's code for it
    # a key was sent: the message says it matched none, not that one is needed
    assert info.value.body["message"].startswith("the bearer token sent is not one of"), \
        info.value.body


@pytest.mark.parametrize("space", ["\u00a0", "\u2003", "\u3000", "\u0085"])
def test_a_key_with_unicode_spaces_around_it_is_not_the_key(stack, space):
    """Spaces and tabs around a key are the header's; other spaces are the token's, as nginx's
    per-key rate limit reads it: the key with U+00A0 around it was served, and each such
    spelling was a client of its own to nginx, with the key's whole rate (an outside check)."""
    for token in (INLINE + space, space + INLINE):
        status, _, body = stack.request(
            "POST", "/predict", b'{"texts": ["x"]}',
            {"Content-Type": "application/json",
             "Authorization": ("Bearer " + token).encode().decode("latin-1")})
        assert status == 401, (space, body)
    assert stack.request("POST", "/predict", b'{"texts": ["x"]}', {
        "Content-Type": "application/json", "Authorization": f"Bearer \t {INLINE} \t"})[0] == 200


def test_no_key_gets_401_with_the_scheme_to_use(stack):
    assert stack.get("/v1/models")[0] == 401
    for path in ("/v1/embeddings", "/predict", "/embed", "/v1/rerank",
                 "/v2/models/tiny/infer"):
        status, headers, body = stack.post_json(path, {"input": ["hello"], "texts": ["hello"]})
        assert status == 401, (path, status, body)
        message = body["error"] if path.startswith("/v2") else body["error"]["message"]
        if not path.startswith("/v2"):  # KServe v2's error shape: the message alone
            assert body["error"]["type"] == "unauthorized"
            assert body["error"]["code"] == "invalid_api_key"
        assert message.startswith("this server needs 'Authorization: Bearer"), message
        assert message.endswith("the request has no Authorization header"), message
        assert headers["WWW-Authenticate"] == 'Bearer realm="shmserve"'
    status, _, body = stack.post_json("/v1/embeddings", {"input": ["hello"]},
                                      {"Authorization": f"Basic {INLINE}"})
    assert status == 401  # the key, but not as a bearer token
    assert body["error"]["message"].endswith("is not 'Bearer <token>'"), body


def test_probes_scrapes_and_the_description_stay_open(stack):
    for path in ("/health", "/ready", "/metrics", "/v2/health/ready", "/openapi.json",
                 "/v2/models/tiny/ready", "/v2/models/tiny/versions/tiny-r1/ready"):
        assert stack.get(path)[0] == 200, path
    # tritonclient's readiness calls agree without a key (is_model_ready said False: a 401).
    client = triton.InferenceServerClient(f"127.0.0.1:{stack.port}")
    try:
        assert client.is_server_ready() and client.is_model_ready("tiny")
        assert not client.is_model_ready("nope")  # 404
    finally:
        client.close()
    assert stack.get("/v2/models/tiny")[0] == 401  # metadata still asks for the key
    # Refusals are counted like any answer.
    metrics = stack.get("/metrics")[2].decode()
    assert 'status="401"' in metrics


def test_tei_client_and_msgpack_with_a_key(stack, monkeypatch):
    # conftest sets HF_HUB_OFFLINE, which makes the hub's client refuse even 127.0.0.1.
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    with InferenceClient(model=stack.url + "/embed", token=FROM_FILE) as hub:
        assert hub.feature_extraction("hello").shape[-1] == 32
    req = urllib.request.Request(
        stack.url + "/predict", data=msgpack.packb({"texts": ["hello", "world"]}),
        headers={"Content-Type": "application/msgpack", "Accept": "application/msgpack",
                 "Authorization": f"Bearer {INLINE}"})
    with urllib.request.urlopen(req, timeout=30) as resp:
        assert len(msgpack.unpackb(resp.read())["results"]) == 2


def test_keys_never_reach_the_logs(stack):
    served = stack.post_json("/v1/embeddings", {"input": ["hello"]},
                             {"Authorization": f"Bearer {INLINE}"})
    refused = stack.post_json("/v1/embeddings", {"input": ["hello"]},
                              {"Authorization": "Bearer wrong-key-0000"})
    ids = [served[1]["X-Request-ID"], refused[1]["X-Request-ID"]]

    def both_lines_in(programs: tuple[str, ...]) -> bool:
        logged = {line.get("request_id") for name in programs for line in stack.log_lines(name)}
        return all(rid in logged for rid in ids)
    # Both requests' lines, the frontends' and nginx's, before looking for what must not be in
    # them: a process writes its lines out every logging.flush_interval_ms, and earlier tests'
    # 401 lines let a wait for "a 401 line" pass before this test's lines were written.
    stack.wait_until(lambda: "wrong-key" not in stack.log("frontend-0") and any(
        line.get("status") == 401 and line.get("request_id") == ids[1]
        for name in ("frontend-0", "frontend-1") for line in stack.log_lines(name))
        and both_lines_in(("frontend-0", "frontend-1")) and both_lines_in(("nginx",)), 10,
        "the access lines")
    for program in ("frontend-0", "frontend-1", "nginx"):
        text = stack.log(program)
        assert INLINE not in text and FROM_FILE not in text and "wrong-key" not in text
    cfg = json.loads((stack.run_dir / "config.json").read_text())
    assert cfg["auth"]["api_keys_file"].endswith("keys.txt")  # the file's keys stay in it
    assert FROM_FILE not in json.dumps(cfg)


def test_paths_that_dress_up_as_open_routes_still_need_a_key(stack):
    """The key is asked for by the route a request matched, not by how its path begins: sent
    as is (no client-side normalising), none of these reaches a handler without a key."""
    import http.client

    for path in ("/admin/../v1/embeddings", "/health/../v1/embeddings",
                 "/%61dmin/../v1/embeddings", "/health%2F..%2Fv1%2Fembeddings",
                 "//v1/embeddings", "/v1/%65mbeddings"):
        conn = http.client.HTTPConnection("127.0.0.1", stack.port, timeout=30)
        conn.request("POST", path, body=json.dumps({"input": ["hi"]}),
                     headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        assert response.status == 401, (path, response.status, response.read()[:200])
        conn.close()


@pytest.mark.parametrize("api", ["openai", "msgpack"])
def test_the_benchmarks_send_the_key_from_the_environment(stack, monkeypatch, api):
    import sys

    from tests.stack import REPO, corpus_path

    sys.path.insert(0, str(REPO / "scripts"))
    benchkit = pytest.importorskip("benchkit")
    corpus = stack.root / "short.json"  # sentences within the tiny model's 64 tokens
    corpus.write_text(json.dumps([t for t in json.loads(corpus_path().read_text())
                                  if len(t) <= 80]))
    scenario = benchkit.Scenario("w", 4, "2", api=api)
    monkeypatch.setenv("SHMSERVE_API_KEY", INLINE)  # the server answers 401 to anything else
    # 3 s, as tests/e2e/test_bench.py's: a 2 s window (its spawn, ~1 s, not counted) came back
    # empty under a heavy load (a suite whose processes compiled every module they imported)
    window = benchkit.locust_window(stack.url, scenario, 3, corpus)
    assert window["failures"] == 0 and window["requests"] > 10
    assert benchkit.fetch_vectors(stack.url, ["hello"]).shape == (1, 32)


def test_keys_rotated_in_the_file_take_effect_without_a_restart(stack):
    """auth.api_keys_file changed under a running deployment (a mounted secret rotated): each
    frontend reads it again a second or two after, no restart; a file that does not load then keeps
    the keys in force (it needed `restart frontends`, apply saying "nothing to apply" with the
    old keys in force: an outside check)."""
    keys = stack.root.parent / "keys.txt"  # beside the stack's directory (the fixture's)
    kept = keys.read_text()
    rotated = "rotated-key-8901"
    frontends = [stack.pid(f"frontends:frontend-{i}") for i in (0, 1)]

    def statuses(key: str) -> set[int]:  # nginx alternates idle frontends: both are asked
        return {stack.post_json("/predict", {"texts": ["x"]},
                                {"Authorization": f"Bearer {key}"})[0] for _ in range(8)}

    def rewrite(text: str) -> None:  # into place, as a secret's mount or `mv` does
        (keys.parent / "keys.new").write_text(text)
        os.replace(keys.parent / "keys.new", keys)

    def logged(event: str) -> bool:
        return all(any(line.get("message") == event for line in stack.log_lines(f"frontend-{i}"))
                   for i in (0, 1))
    try:
        assert statuses(rotated) == {401}
        rewrite(f"{kept}{rotated}\n")  # added beside the old key
        stack.wait_until(lambda: statuses(rotated) == {200}, 15, "the added key served")
        assert statuses(FROM_FILE) == {200}
        rewrite(f"{rotated}\n")  # the old key removed
        stack.wait_until(lambda: statuses(FROM_FILE) == {401}, 15, "the removed key refused")
        assert statuses(rotated) == statuses(INLINE) == {200}
        stack.wait_until(lambda: logged("frontend.api_keys_reloaded"), 10, "both read it")
        keys.write_text("")  # emptied: the keys in force stay, never an open server
        time.sleep(2.5)  # more than two looks
        assert statuses(rotated) == {200} and statuses(FROM_FILE) == {401}
        assert stack.post_json("/predict", {"texts": ["x"]})[0] == 401
        stack.wait_until(lambda: logged("frontend.api_keys_file_refused"), 10, "the refusal")
        assert [stack.pid(f"frontends:frontend-{i}") for i in (0, 1)] == frontends
        assert all(rotated not in stack.log(f"frontend-{i}") for i in (0, 1))
    finally:
        rewrite(kept)
        stack.wait_until(lambda: statuses(FROM_FILE) == {200}, 15, "the fixture's key again")


def test_an_emptied_key_file_leaves_the_cli_working_and_refuses_a_frontend_restart(stack):
    """The file emptied while the deployment runs: status, ctl (and down) act on the running
    deployment, which needs no key to be found (all refused, exit 2, an outside check); a
    restart of the frontends, which read it as they start, is refused naming it."""
    keys = stack.root.parent / "keys.txt"  # beside the stack's directory (the fixture's)
    kept = keys.read_text()
    keys.write_text("")
    try:
        shown = stack.cli("status", check=False)
        assert shown.returncode == 0, shown.stdout + shown.stderr
        assert "holds no key" in shown.stderr and "as `up` started it" in shown.stderr
        assert shown.stderr.count("holds no key") == 1  # said once
        # and to monitoring: --json's warnings (it read `ready` and nothing else)
        (line,) = stack.cli("status", "--json", check=False).stdout.splitlines()
        assert any("holds no key" in w for w in json.loads(line)["warnings"]), line
        assert stack.cli("ctl", "status", check=False).returncode == 0
        refused = stack.cli("restart", "frontends", check=False)
        assert refused.returncode == 2 and "a frontend restarted now would not start" in \
            refused.stderr, refused.stderr
        assert stack.post_json("/predict", {"texts": ["x"]}, {
            "Authorization": f"Bearer {FROM_FILE}"})[0] == 200  # nothing was restarted
        # A worker, which needs no key, starts again meanwhile (it failed on the file: every
        # worker restarted then stayed down, 503, an outside check); the reaper too.
        for program in ("workers:worker-0", "reaper"):
            old = stack.pid(program)
            os.kill(old, signal.SIGKILL)
            stack.wait_until(lambda: stack.pid(program) not in (0, old), 60, f"{program} back")
        stack.wait_until(stack.all_ready, 120, "the restarted worker ready")
        assert stack.post_json("/predict", {"texts": ["x"]}, {
            "Authorization": f"Bearer {FROM_FILE}"})[0] == 200
    finally:
        keys.write_text(kept)
