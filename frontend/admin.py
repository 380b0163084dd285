"""Admin routes under /admin/: a bearer token (admin.token, checked by its digest as the API
keys are: frontend.auth.bearer_matches); with no token configured the routes answer 404, as if
they did not exist.

    GET  /admin/models                   each model's variants and weights, and per worker its
                                         active revision, loading state and standby revision
    POST /admin/models/{name}/reload     {"source"?, "revision"?, "variant"?}: hot reload
                                         (frontend.reload); an empty body reloads the current
                                         source from disk
    PUT  /admin/models/{name}/split      {"weights": {VARIANT: number}}: A/B weights for every
                                         frontend (frontend.variants)
"""

from __future__ import annotations

import asyncio
import json
import math

from aiohttp import web

from frontend import codec, reload
from frontend.app import CONFIG, MODEL_NAME, MODELS, POOL, SPLITS, ServedModel
from frontend.auth import bearer_matches, bearer_refusal, key_digests
from frontend.errors import ApiError
from frontend.links import unit_state
from frontend.variants import Variant
from shmserve import state
from shmserve.checks import MAX_WEIGHT, REVISION, REVISION_RULE
from shmserve.sources import SOURCE_MAX


def add_routes(app: web.Application) -> None:
    app.router.add_get("/admin/models", list_models)
    # {name:.+}: model names may hold slashes (org/model)
    app.router.add_post("/admin/models/{name:.+}/reload", reload_model)
    app.router.add_put("/admin/models/{name:.+}/split", set_split)


LOOPBACK = ("127.0.0.1", "::1")


def authorize(request: web.Request) -> None:
    cfg = request.app[CONFIG]
    # nginx's `location /admin/` keeps other clients out, but it matches the normalized path,
    # and a frontend routes the raw one: /admin/models/..%2F..%2Fx/reload reached this token
    # check from any address through nginx's general location (a security review). The client
    # address nginx gives every request (X-Real-IP, its $remote_addr) is checked here too; a
    # request on a frontend's socket from this machine carries none.
    client = request.headers.get("X-Real-IP")
    if cfg.nginx.admin_loopback_only and client is not None and client not in LOOPBACK:
        raise ApiError("forbidden", "admin routes answer loopback clients only "
                       "(nginx.admin_loopback_only)")
    token = cfg.admin.token
    if not token:
        raise ApiError("not_found", "admin routes are off (set admin.token)")
    if not bearer_matches(request, key_digests((token,))):
        raise ApiError("unauthorized", bearer_refusal(
            request, "admin routes need 'Authorization: Bearer <admin.token>'",
            "the bearer token sent is not this server's admin.token"))


async def list_models(request: web.Request) -> web.Response:
    """Each model's variants, and per worker its active revision and loading state."""
    authorize(request)
    pool, splits = request.app[POOL], request.app[SPLITS]
    models = []
    for name, served in request.app[MODELS].by_name.items():
        arms = []
        weights = splits.weights(name, served.variants)
        for variant, weight in zip(served.variants, weights):
            workers = []
            for link in pool.links:
                info = next((m for m in link.beat.models if m.name == variant.unit), None) \
                    if link.beat else None
                unloaded = next((u for u in link.unloaded if u.model == variant.unit), None)
                if link.beat is not None and info is None and unloaded is None:
                    continue  # this worker does not host it (models.devices)
                workers.append({
                    "worker": link.index, "alive": link.alive,
                    "state": unit_state(link, variant.unit),
                    "load_error": unloaded.error if unloaded else None,
                    "device": link.beat.device if link.beat else None,
                    "revision": (info.revision or None) if info else None,
                    "standby": (info.standby or None) if info else None,
                    "dtype": info.dtype if info else None,
                    "loader": (info.loader or None) if info else None})
            entry = {"unit": variant.unit, "workers": workers}
            if variant.name:
                entry = {"name": variant.name, "weight": weight, **entry}
            arms.append(entry)
        model = {"name": name, "task": served.spec.task}
        if served.variants[0].name:
            model.update(variants=arms, sticky_key=served.sticky_key or None)
        else:
            model.update(workers=arms[0]["workers"])
        models.append(model)
    return codec.render(request, {"models": models})


async def reload_model(request: web.Request) -> web.Response:
    authorize(request)
    served = request.app[MODELS].resolve(request.match_info["name"])
    # its access line and metrics name the model, refused or not (a refused variant's said
    # model "": an outside check)
    request[MODEL_NAME] = served.spec.name
    body = await codec.read_raw(request)
    body = codec.decode_body(body, codec.media_type(request), "Content-Type" in
                             request.headers, request.headers.get("Content-Type", "")
                             ) if body else {}
    if not isinstance(body, dict):
        raise ApiError("invalid_request", "the request body must be an object")
    source, revision = _string(body, "source"), _string(body, "revision")
    if not source.isprintable():  # a NUL reaches no path (500), control characters no log
        raise ApiError("invalid_request", "'source' holds a control character", param="source")
    if len(source) > SOURCE_MAX:  # before the workers, which logged all 100 KB of one
        raise ApiError("invalid_request", f"'source' is {len(source)} characters; a model "
                       f"source is at most {SOURCE_MAX} (a path's limit)", param="source")
    if revision and not REVISION.fullmatch(revision):
        raise ApiError("invalid_request", f"'revision' must be {REVISION_RULE}",
                       param="revision")
    variant = _variant(served, _string(body, "variant"))
    # Shielded: a caller that goes away must not stop a reload between its two phases (the run
    # state written, the commits not sent); it finishes, and only the answer is lost.
    task = asyncio.ensure_future(reload.reload(request.app, served, variant, source, revision))
    task.add_done_callback(lambda t: t.cancelled() or t.exception())  # retrieved if orphaned
    answer = await asyncio.shield(task)
    return codec.render(request, answer)


async def set_split(request: web.Request) -> web.Response:
    authorize(request)
    served = request.app[MODELS].resolve(request.match_info["name"])
    request[MODEL_NAME] = served.spec.name  # (it said model "", set or refused)
    body = codec.decode_body(await codec.read_raw(request), codec.media_type(request),
                             "Content-Type" in request.headers,  # malformed: 400 first
                             request.headers.get("Content-Type", ""))
    names = [v.name for v in served.variants]
    if not names[0]:
        raise ApiError("invalid_request", f"model {served.spec.name!r} has no variants to split "
                       "(models.variants)", param="model")
    weights = body.get("weights") if isinstance(body, dict) else None
    why = _weights_problem(weights, names)
    if why:
        raise ApiError("invalid_request", f"'weights' must give every variant ({', '.join(names)})"
                       f" a number from 0 to {MAX_WEIGHT:g}, not all 0: {why}", param="weights")
    new = {k: float(w) for k, w in weights.items()}
    state.update(request.app[CONFIG],
                 lambda tree: tree["splits"].__setitem__(served.spec.name, new))
    answer = {"model": served.spec.name, "weights": new}
    weighted = [v for v in served.variants if new[v.name] > 0]
    if not any(request.app[POOL].ready_links(v.unit) for v in weighted):
        # A share of 0 stays 0: an arm of weight 0 answers nothing, even when the others have
        # no worker (an outside check set a=0 b=1 with b not loaded: every request 503)
        answer["warning"] = (f"no worker serves {', '.join(v.name for v in weighted)} now, "
                             "and the other variants have weight 0: this model's requests "
                             "are answered 503 until one does")
    return codec.render(request, answer)


def _weights_problem(weights: object, names: list[str]) -> str:
    """What is wrong with a split's new weights ("" when nothing)."""
    if not isinstance(weights, dict):
        return "give an object {variant: weight}"
    missing = [n for n in names if n not in weights]
    unknown = [str(n) for n in weights if n not in names]
    if missing or unknown:  # both named: `a=1 c=1` is likely `b` misspelt
        return "; ".join(([f"{', '.join(missing)} missing"] if missing else [])
                         + ([f"no variant {', '.join(unknown)}"] if unknown else []))
    for name, w in weights.items():
        if not (isinstance(w, (int, float)) and not isinstance(w, bool) and math.isfinite(w)
                and 0 <= w <= MAX_WEIGHT):
            shown = f"{w:g}" if isinstance(w, float) else json.dumps(w, default=repr)
            return f"{name}: {shown} is not a number from 0 to {MAX_WEIGHT:g}"
    if sum(weights.values()) <= 0:
        return "all are 0"
    return ""


def _variant(served: ServedModel, name: str) -> Variant:
    names = [v.name for v in served.variants]
    if not names[0]:
        if name:
            raise ApiError("invalid_request", f"model {served.spec.name!r} has no variants",
                           param="variant")
        return served.variants[0]
    for variant in served.variants:
        if variant.name == name:
            return variant
    if name:
        raise ApiError("invalid_request", f"model {served.spec.name!r} has no variant {name!r}; "
                       f"its variants are {', '.join(names)}", param="variant")
    raise ApiError("invalid_request", f"model {served.spec.name!r} is split: name the "
                   f"variant to reload, one of {', '.join(names)} ('variant' in the body, "
                   "`shmserve reload --variant`)", param="variant")


def _string(body: dict, key: str) -> str:
    value = body.get(key, "")
    if not isinstance(value, str):
        raise ApiError("invalid_request", f"'{key}' must be a string", param=key)
    return value
