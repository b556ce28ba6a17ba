"""A retrieval service speaking Search-R1's API over a local JSON lines corpus.

    python -m rl2.tools.retrieval_server --corpus corpus.jsonl [--host 127.0.0.1 --port 8000 --topk 3]

`POST /retrieve` with `{"queries": [str, ...], "topk": int (optional), "return_scores": bool
(optional, default false)}` (other fields are ignored) answers `{"result": [...]}` with one list per query, best first:
`[{"document": {"id", "contents", ...}, "score": float}, ...]` with scores, or just the documents
without (as Search-R1's retrieval_server.py does). `GET /health` answers `{"status": "ok",
"documents": n, "retriever": "bm25"}`. A malformed request gets HTTP 400 and `{"error": message}`.

The index is BM25 by default (`--retriever dense --encoder PATH` for embeddings); it is built at
the first start and saved next to the corpus (see `rl2.tools.retrieval_index`). Searches run one
batch at a time in a worker thread, so `/health` answers while a batch is searched.
"""

import argparse
import asyncio
import concurrent.futures
import json
import logging
import signal
import time

from aiohttp import web

from rl2.tools.retrieval_index import SearchIndex, open_index

logger = logging.getLogger("rl2.tools.retrieval_server")  # not __name__: "__main__" under `python -m`

MAX_QUERIES = 1024  # per request
MAX_TOPK = 100

_EXECUTOR = web.AppKey("executor", concurrent.futures.ThreadPoolExecutor)


class BadRequest(ValueError):
    """A request that does not follow the API; answered with HTTP 400."""


def make_app(index: SearchIndex, topk: int = 3, max_queries: int = MAX_QUERIES, max_topk: int = MAX_TOPK) -> web.Application:
    """The aiohttp app serving `index`; `topk` is used when a request names none."""
    if not 1 <= topk <= max_topk:
        raise ValueError(f"default topk must be between 1 and max_topk={max_topk}, got {topk}")
    app = web.Application()

    async def make_executor(app: web.Application):
        app[_EXECUTOR] = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="rl2-retrieval")
        yield
        app[_EXECUTOR].shutdown(wait=False, cancel_futures=True)

    async def retrieve(request: web.Request) -> web.Response:
        try:
            queries, k, return_scores = parse_request(await request.read(), topk, max_queries, max_topk)
        except BadRequest as e:
            return web.json_response({"error": str(e)}, status=400)
        started = time.perf_counter()
        try:
            hits = await asyncio.get_running_loop().run_in_executor(app[_EXECUTOR], index.search, queries, k)
        except Exception as e:
            logger.exception("search failed for %d queries (topk %d)", len(queries), k)
            return web.json_response({"error": f"search failed: {type(e).__name__}: {e}"}, status=500)
        logger.debug("%d queries, topk %d: %.1f ms", len(queries), k, 1000 * (time.perf_counter() - started))
        if return_scores:
            result = [[{"document": doc, "score": score} for doc, score in row] for row in hits]
        else:
            result = [[doc for doc, _ in row] for row in hits]
        return web.json_response({"result": result})

    async def health(request: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "documents": len(index), "retriever": index.kind})

    app.cleanup_ctx.append(make_executor)
    app.router.add_post("/retrieve", retrieve)
    app.router.add_get("/health", health)
    return app


def parse_request(body: bytes, default_topk: int, max_queries: int, max_topk: int) -> tuple[list[str], int, bool]:
    """(queries, topk, return_scores) from a /retrieve body, or BadRequest saying what is wrong."""
    try:
        request = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise BadRequest(f"the body is not JSON: {e}") from None
    if not isinstance(request, dict):
        raise BadRequest(f"expected a JSON object with 'queries', got {type(request).__name__}")
    queries = request.get("queries")
    if not isinstance(queries, list):
        raise BadRequest("'queries' must be a list of strings" + (" (missing)" if queries is None else f", got {type(queries).__name__}"))
    for i, query in enumerate(queries):
        if not isinstance(query, str):
            raise BadRequest(f"'queries' item {i} is {type(query).__name__}, expected a string")
    if len(queries) > max_queries:
        raise BadRequest(f"too many queries: {len(queries)} (at most {max_queries} per request)")

    topk = request.get("topk")
    if topk is None:
        topk = default_topk
    elif not isinstance(topk, int) or isinstance(topk, bool) or not 1 <= topk <= max_topk:
        raise BadRequest(f"'topk' must be an integer from 1 to {max_topk}, got {json.dumps(topk)}")

    return_scores = request.get("return_scores", False)
    if not isinstance(return_scores, bool):
        raise BadRequest(f"'return_scores' must be true or false, got {json.dumps(return_scores)}")
    return queries, topk, return_scores


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
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s: %(message)s")
    logging.getLogger("bm25s").setLevel(logging.WARNING)  # it logs each step at DEBUG

    if args.retriever == "dense" and not args.encoder:
        parser.error("--retriever dense needs --encoder PATH (a local sentence-transformers model folder)")
    if args.retriever == "bm25" and args.encoder:
        parser.error("--encoder is only used with --retriever dense")
    if args.max_queries < 1 or args.max_topk < 1 or not 1 <= args.topk <= args.max_topk:
        parser.error(f"need --max-queries >= 1 and 1 <= --topk <= --max-topk, got {args.max_queries}, {args.topk}, {args.max_topk}")
    try:
        index = open_index(args.corpus, args.retriever, args.index_dir, args.encoder)
        app = make_app(index, args.topk, args.max_queries, args.max_topk)
    except (ValueError, ImportError, OSError) as e:
        parser.exit(1, f"{parser.prog}: error: {e}\n")
    try:
        asyncio.run(serve(app, args.host, args.port, len(index), index.kind))
    finally:
        index.close()


if __name__ == "__main__":
    main()
