"""A retrieval service speaking Search-R1's API over a local JSON lines corpus.

    python -m rl2.tools.retrieval_server --corpus corpus.jsonl [--host 127.0.0.1 --port 8000 --topk 3]

`POST /retrieve` with `{"queries": [str, ...], "topk": int (optional), "return_scores": bool
(optional, default false)}` (other fields are ignored) answers `{"result": [...]}` with one list per
query, best first: `[{"document": {"id", "contents", "url", ...}, "score": float}, ...]` with scores,
or just the documents without (as Search-R1's retrieval_server.py does). `GET /health` answers
`{"status": "ok", "documents": n, "retriever": "bm25"}`.

What Search-R1's server (FastAPI, pydantic) accepts is accepted: `topk` null or 0 means `--topk`;
numbers and booleans sent as strings ("5", "true") are read as such. A malformed request gets HTTP
422 with FastAPI's error shape, `{"detail": [{"type", "loc", "msg", "input"}]}`; every other error
is JSON `{"detail": message}` too (404, 405, 413 over `--max-request-mb` or `--max-queries`, 500).
Differences, on purpose: a negative `topk` or one above `--max-topk` is a 422 (Search-R1 passes it
to its index); every document has a `url` (the corpus row's, else ""), which some clients (RLinf's,
ASearcher's) require.

A whole rollout's queries come in one request (Search-R1's client sends 512 × 5 = 2,560); they are
searched `--search-chunk` at a time, so `/health` and other requests are answered in between. The
index is BM25 by default (`--retriever dense --encoder PATH` for embeddings); it is built at the
first start and saved next to the corpus (see `rl2.tools.retrieval_index`).
"""

import argparse
import asyncio
import concurrent.futures
import json
import logging
import signal
import time
from typing import Any

from aiohttp import web

from rl2.tools.api_key import api_key_from, require_api_key
from rl2.tools.http_errors import BadRequest, json_errors
from rl2.tools.retrieval_index import SearchIndex, open_index

logger = logging.getLogger("rl2.tools.retrieval_server")  # not __name__: "__main__" under `python -m`

MAX_QUERIES = 65536  # per request
MAX_TOPK = 100
MAX_REQUEST_MB = 64
SEARCH_CHUNK = 1024  # queries per index search

_EXECUTOR = web.AppKey("executor", concurrent.futures.ThreadPoolExecutor)
API_KEY_VARIABLE = "RETRIEVAL_API_KEY"


def make_app(index: SearchIndex, topk: int = 3, max_queries: int = MAX_QUERIES, max_topk: int = MAX_TOPK,
             max_request_mb: float = MAX_REQUEST_MB, search_chunk: int = SEARCH_CHUNK,
             api_key: str | None = None) -> web.Application:
    """The aiohttp app serving `index`; `topk` is used when a request names none (or 0). With `api_key`
    every request but `/health` needs `Authorization: Bearer <api_key>` (else 401)."""
    if not 1 <= topk <= max_topk:
        raise ValueError(f"default topk must be between 1 and max_topk={max_topk}, got {topk}")
    app = web.Application(client_max_size=int(max_request_mb * 2**20),
                          middlewares=[require_api_key(api_key, ("/health",)), json_errors])

    async def make_executor(app: web.Application):
        app[_EXECUTOR] = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rl2-retrieval")
        yield
        app[_EXECUTOR].shutdown(wait=False, cancel_futures=True)

    async def retrieve(request: web.Request) -> web.Response:
        queries, k, return_scores = parse_request(await request.read(), topk, max_topk)
        if len(queries) > max_queries:
            return web.json_response({"detail": f"too many queries: {len(queries)} (at most {max_queries} per "
                                                f"request, --max-queries)"}, status=413)
        started = time.perf_counter()
        hits = []
        try:
            for start in range(0, len(queries), search_chunk):
                chunk = queries[start : start + search_chunk]
                hits += await asyncio.get_running_loop().run_in_executor(app[_EXECUTOR], index.search, chunk, k)
        except Exception as e:
            logger.exception("search failed for %d queries (topk %d)", len(queries), k)
            return web.json_response({"detail": f"search failed: {type(e).__name__}: {e}"}, status=500)
        logger.debug("%d queries, topk %d: %.1f ms", len(queries), k, 1000 * (time.perf_counter() - started))
        with_url = lambda doc: {**doc, "url": doc.get("url") or ""}  # noqa: E731
        result = [[{"document": with_url(doc), "score": score} if return_scores else with_url(doc) for doc, score in row]
                  for row in hits]
        return web.json_response({"result": result})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "documents": len(index), "retriever": index.kind})

    app.cleanup_ctx.append(make_executor)
    app.router.add_post("/retrieve", retrieve)
    app.router.add_get("/health", health)
    return app


def parse_request(body: bytes, default_topk: int, max_topk: int) -> tuple[list[str], int, bool]:
    """(queries, topk, return_scores) from a /retrieve body, read as Search-R1's pydantic model
    `QueryRequest(queries: list[str], topk: int | None, return_scores: bool = False)` reads it;
    `BadRequest` says what is wrong."""
    try:
        request = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise _invalid("json_invalid", (), f"JSON decode error: {e}", body[:200].decode(errors="replace")) from None
    if not isinstance(request, dict):
        raise _invalid("model_attributes_type", (), "Input should be a valid dictionary or object to extract "
                      "fields from", request)
    if "queries" not in request:
        raise _invalid("missing", ("queries",), "Field required", request)
    queries = request["queries"]
    if not isinstance(queries, list):
        raise _invalid("list_type", ("queries",), "Input should be a valid list", queries)
    for i, query in enumerate(queries):
        if not isinstance(query, str):
            raise _invalid("string_type", ("queries", i), "Input should be a valid string", query)
    topk = _lax_int(request.get("topk"), "topk")
    if topk is None or topk == 0:  # Search-R1: `if not request.topk: request.topk = config.retrieval_topk`
        topk = default_topk
    elif topk < 0:
        raise _invalid("greater_than_equal", ("topk",), "Input should be greater than or equal to 0", topk)
    elif topk > max_topk:
        raise _invalid("less_than_equal", ("topk",), f"Input should be less than or equal to {max_topk} "
                      "(the server's --max-topk)", topk)
    return queries, topk, _lax_bool(request.get("return_scores", False), "return_scores")


def _invalid(kind: str, loc: tuple, msg: str, value: Any) -> BadRequest:
    """A pydantic-style error entry for the body field at `loc`, with the offending input."""
    return BadRequest(("body", *loc), msg, kind, input=value)


def _lax_int(value: Any, name: str) -> int | None:
    """pydantic's lax int: an int, a float without a fraction, or a string holding an integer."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        return value
    if isinstance(value, float):
        if value.is_integer():
            return int(value)
        raise _invalid("int_from_float", (name,), "Input should be a valid integer, got a number with a "
                      "fractional part", value)
    if isinstance(value, str):
        try:
            return int(value.strip())
        except ValueError:
            raise _invalid("int_parsing", (name,), "Input should be a valid integer, unable to parse string "
                          "as an integer", value) from None
    raise _invalid("int_type", (name,), "Input should be a valid integer", value)


_TRUE, _FALSE = {"1", "on", "t", "true", "y", "yes"}, {"0", "off", "f", "false", "n", "no"}


def _lax_bool(value: Any, name: str) -> bool:
    """pydantic's lax bool: a bool, 0 / 1, or a string such as "true", "no", "1"."""
    if isinstance(value, bool):
        return value
    if isinstance(value, (int, float)) and value in (0, 1):
        return bool(value)
    if isinstance(value, str) and value.strip().lower() in _TRUE | _FALSE:
        return value.strip().lower() in _TRUE
    raise _invalid("bool_parsing" if isinstance(value, str) else "bool_type", (name,),
                  "Input should be a valid boolean" + (", unable to interpret input" if isinstance(value, str) else ""),
                  value)


# ----------------------------------------------------------------------------------------------
# command line


async def serve(app: web.Application, host: str, port: int, n_docs: int, kind: str) -> None:
    """Serve `app` until SIGINT / SIGTERM."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        # SO_REUSEADDR (asyncio's default on Unix, made explicit): a service restarted after a crash binds
        # its port again at once, though connections of the one that died linger in TIME_WAIT.
        site = web.TCPSite(runner, host, port, reuse_address=True)
        await site.start()
        bound_port = runner.addresses[0][1] if runner.addresses else port  # --port 0 picks a free port
        logger.info("retrieval server ready on http://%s:%d (%d documents, %s)", host, bound_port, n_docs, kind)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
        logger.info("retrieval server stopping")
    finally:
        await runner.cleanup()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m rl2.tools.retrieval_server", description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--corpus", required=True, help="JSON lines corpus: {\"id\": str, \"contents\": \"title\\ntext\"} per line")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0 picks a free port (logged when ready)")
    parser.add_argument("--topk", type=int, default=3, help="documents per query when a request names no topk")
    parser.add_argument("--retriever", choices=("bm25", "dense"), default="bm25")
    parser.add_argument("--encoder", help="local sentence-transformers model folder (with --retriever dense)")
    parser.add_argument("--index-dir", help="where the index is saved and looked for (default: <corpus>.bm25 or .dense)")
    parser.add_argument("--max-queries", type=int, default=MAX_QUERIES, help="queries per request at most")
    parser.add_argument("--max-topk", type=int, default=MAX_TOPK)
    parser.add_argument("--max-request-mb", type=float, default=MAX_REQUEST_MB, help="request bodies at most")
    parser.add_argument("--search-chunk", type=int, default=SEARCH_CHUNK, help="queries per index search")
    parser.add_argument("--api-key", default=None,
                        help=f"requests but /health need 'Authorization: Bearer <key>' (default: ${API_KEY_VARIABLE}; "
                             "unset = open to whoever reaches the port)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    logging.getLogger("bm25s").setLevel(logging.WARNING)  # it logs each step at DEBUG

    if args.retriever == "dense" and not args.encoder:
        parser.error("--retriever dense needs --encoder PATH (a local sentence-transformers model folder)")
    if args.retriever == "bm25" and args.encoder:
        parser.error("--encoder is only used with --retriever dense")
    if args.max_queries < 1 or args.max_topk < 1 or not 1 <= args.topk <= args.max_topk:
        parser.error(f"need --max-queries >= 1 and 1 <= --topk <= --max-topk, got {args.max_queries}, {args.topk}, {args.max_topk}")
    if args.max_request_mb <= 0 or args.search_chunk < 1:
        parser.error(f"need --max-request-mb > 0 and --search-chunk >= 1, got {args.max_request_mb}, {args.search_chunk}")
    try:
        index = open_index(args.corpus, args.retriever, args.index_dir, args.encoder)
        api_key = api_key_from(args.api_key, API_KEY_VARIABLE)
        app = make_app(index, args.topk, args.max_queries, args.max_topk, args.max_request_mb, args.search_chunk, api_key)
        logger.info("API key required" if api_key else "no API key: open to whoever reaches the port")
    except (ValueError, ImportError, OSError) as e:
        parser.exit(1, f"{parser.prog}: error: {e}\n")
    try:
        asyncio.run(serve(app, args.host, args.port, len(index), index.kind))
    except OSError as e:  # the port is taken, the address is not this machine's
        parser.exit(1, f"{parser.prog}: error: cannot serve on {args.host}:{args.port}: {e}\n")
    finally:
        index.close()


if __name__ == "__main__":
    main()
