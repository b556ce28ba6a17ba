"""API keys for rl2's services: `Authorization: Bearer <key>`, as vLLM, SGLang and OpenAI clients send it.

A service started with a key answers a request without it, or with another, with 401 and a JSON error;
its health check stays open. Keys are compared in constant time and never logged: a client or server
shows only whether it has one.
"""

import hmac
import os

from aiohttp import web


def api_key_from(given: str | None, variable: str) -> str | None:
    """The key given on the command line, else the environment variable `variable`, else None (open)."""
    key = given if given is not None else os.environ.get(variable)
    return key or None


def auth_headers(key: str | None) -> dict[str, str]:
    """The header a client sends with `key` (none without a key)."""
    return {"Authorization": f"Bearer {key}"} if key else {}


def require_api_key(key: str | None, open_paths: tuple[str, ...] = ()):
    """aiohttp middleware: requests outside `open_paths` need `Authorization: Bearer <key>` (no-op without a key)."""
    expected = f"Bearer {key}".encode() if key else None

    @web.middleware
    async def middleware(request: web.Request, handler) -> web.StreamResponse:
        if expected is None or request.path in open_paths:
            return await handler(request)
        given = request.headers.get("Authorization", "").encode()
        if not hmac.compare_digest(given, expected):
            reason = "no API key" if not given else "wrong API key"
            return web.json_response({"detail": f"{reason}: send the header 'Authorization: Bearer <key>'"},
                                     status=401, headers={"WWW-Authenticate": "Bearer"})
        return await handler(request)

    return middleware
