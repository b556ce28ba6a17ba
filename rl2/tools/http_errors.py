"""Errors of rl2's HTTP services in FastAPI's shape, as the services they stand in for answer them
(code-judge, Search-R1's retrieval server): a malformed request is a 422 with
`{"detail": [{"type", "loc", "msg", ...}]}`, any other HTTP error is JSON `{"detail": message}`."""

import logging

from aiohttp import web

logger = logging.getLogger(__name__)


class BadRequest(Exception):
    """A request that does not follow the API: `loc` is the path of the offending field (starting
    with "body"), `kind` pydantic's error type; `fields` (e.g. `input=value`) join the entry."""

    def __init__(self, loc: tuple, msg: str, kind: str = "value_error", **fields):
        super().__init__(msg)
        self.msg = msg
        self.entry = {"type": kind, "loc": list(loc), "msg": msg, **fields}


@web.middleware
async def json_errors(request: web.Request, handler) -> web.StreamResponse:
    """`BadRequest` as a 422, aiohttp's own errors (unknown path, wrong method, body over the limit)
    as JSON `{"detail"}`: the reason, as FastAPI words it, or for 413 the limit that was passed."""
    try:
        return await handler(request)
    except BadRequest as error:
        logger.debug("bad request to %s: %s", request.path, error.msg)
        return web.json_response({"detail": [error.entry]}, status=422)
    except web.HTTPException as error:
        if error.status < 400:
            raise
        message = error.text if error.status == 413 else error.reason
        return web.json_response({"detail": message}, status=error.status,
                                 headers={key: value for key, value in error.headers.items() if key.lower() == "allow"})
