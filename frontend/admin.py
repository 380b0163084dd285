"""Admin routes under /admin/: a bearer token (admin.token) compared in constant time; with no
token configured the routes answer 404, as if they did not exist."""

from __future__ import annotations

import hmac

from aiohttp import web

from frontend import codec
from frontend.app import CONFIG, MODELS, POOL
from frontend.errors import ApiError


def add_routes(app: web.Application) -> None:
    app.router.add_get("/admin/models", list_models)


def authorize(request: web.Request) -> None:
    token = request.app[CONFIG].admin.token
    if not token:
        raise ApiError("not_found", "admin routes are off (set admin.token)")
    sent = request.headers.get("Authorization", "")
    scheme, _, credential = sent.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(credential.encode(),
                                                             token.encode()):
        raise ApiError("unauthorized", "admin routes need 'Authorization: Bearer <admin.token>'")


async def list_models(request: web.Request) -> web.Response:
    """Each model's active revision and loading state, per worker."""
    authorize(request)
    pool = request.app[POOL]
    models = []
    for name, served in request.app[MODELS].by_name.items():
        workers = []
        for link in pool.links:
            info = next((m for m in link.beat.models if m.name == name), None) \
                if link.beat else None
            workers.append({
                "worker": link.index, "alive": link.alive,
                "state": "ready" if link.ready and info else
                         ("loading" if link.alive else "down"),
                "device": link.beat.device if link.beat else None,
                "revision": info.revision if info else None,
                "dtype": info.dtype if info else None})
        models.append({"name": name, "task": served.spec.task, "workers": workers})
    return codec.render(request, {"models": models})
