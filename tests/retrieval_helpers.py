"""Helpers shared by the retrieval tests: the retrieval server as a real process, in-process
serving of an aiohttp app, and one-shot requests."""

import contextlib
import os

import aiohttp
from aiohttp import web

from server_process import REPO, ServerProcess
SAMPLE_CORPUS = os.path.join(REPO, "recipes", "data", "search_corpus.jsonl")


class RetrievalServer(ServerProcess):
    """`python -m rl2.tools.retrieval_server --port 0 ...` in a subprocess."""

    def __init__(self, corpus: str, *args: str):
        super().__init__("rl2.tools.retrieval_server", ["--corpus", corpus, "--host", "127.0.0.1", "--port", "0", *args],
                         r"retrieval server ready on (http://\S+)", "retrieval server")


@contextlib.contextmanager
def running(corpus: str, *args: str):
    """A ready retrieval server on `corpus`; yields it and stops it (cleanly) afterwards."""
    server = RetrievalServer(corpus, *args)
    try:
        server.wait_ready()
        yield server
    finally:
        if server.process.poll() is None:
            assert server.stop() == 0, server.log()


@contextlib.asynccontextmanager
async def serving(app: web.Application):
    """Serve `app` in this process on a free port; yields its base URL."""
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    try:
        yield f"http://127.0.0.1:{runner.addresses[0][1]}"
    finally:
        await runner.cleanup()


async def request(method: str, url: str, **kwargs) -> tuple[int, object]:
    """(status, decoded JSON body) of one request."""
    async with aiohttp.ClientSession() as session:
        async with session.request(method, url, **kwargs) as response:
            return response.status, await response.json(content_type=None)
