"""Helpers shared by the retrieval tests: the sample corpus and the retrieval server as a real process."""

import contextlib
import os

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
