"""The conftest.py under which code-judge's own test file (`tests/test_main.py` of
github.com/0xWJ/code-judge) runs, unchanged, against rl2's code server.

code-judge's conftest builds its FastAPI app in-process (with fakeredis and its own workers) and
hands the tests a `fastapi.testclient.TestClient` as `test_client`. This one hands them a client
with the same calls (`get(path)`, `post(path, json=...)`, `.status_code`, `.json()`; paths with or
without a leading slash) that talks HTTP to the server at `RL2_CODE_SERVER_URL`.
`tests/test_code_judge_suite.py` copies the two files side by side and runs them.
"""

import os

import pytest
import requests


class LoopbackClient:
    """The part of `TestClient` code-judge's tests use, over real HTTP."""

    def __init__(self, url: str):
        self.url = url.rstrip("/")
        self.session = requests.Session()

    def get(self, path: str) -> requests.Response:
        return self.session.get(f"{self.url}/{path.lstrip('/')}", timeout=120)

    def post(self, path: str, json: dict | None = None) -> requests.Response:
        return self.session.post(f"{self.url}/{path.lstrip('/')}", json=json, timeout=120)


@pytest.fixture(scope="session")
def test_client():
    client = LoopbackClient(os.environ["RL2_CODE_SERVER_URL"])
    yield client
    client.session.close()
