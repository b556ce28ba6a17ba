"""A server of ours (`python -m rl2.tools.<server> ...`) as a real process on 127.0.0.1, for the tests."""

import contextlib
import os
import re
import signal
import socket
import subprocess
import sys
import threading

import aiohttp
from aiohttp import web

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python_env() -> dict:
    """os.environ with the repository first on PYTHONPATH."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [REPO, os.environ.get("PYTHONPATH")]))}


def free_port() -> int:
    """A port nobody listens on (closed again at once)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`python -m module *args` in a subprocess; a thread collects its log lines and its base URL
    from the line matching `ready_pattern` (one group: the URL)."""

    def __init__(self, module: str, args: list[str], ready_pattern: str, name: str, env: dict | None = None):
        self.name, self.ready_pattern = name, re.compile(ready_pattern)
        self.process = subprocess.Popen([sys.executable, "-m", module, *args], stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True, cwd=REPO, env={**python_env(), **(env or {})},
                                        start_new_session=True)
        self.lines: list[str] = []
        self.url: str | None = None
        self._ready = threading.Event()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            self.lines.append(line)
            match = self.ready_pattern.search(line)
            if match:
                self.url = match.group(1)
                self._ready.set()
        self._ready.set()  # exited

    def log(self) -> str:
        return "".join(self.lines)

    def wait_ready(self, timeout: float = 30.0) -> str:
        """The server's base URL once it is ready; fails with its log if it exits or hangs first."""
        self._ready.wait(timeout)
        if self.url is None:
            self.kill()
            raise AssertionError(f"{self.name} did not become ready:\n{self.log()}")
        return self.url

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, signal.SIGKILL)
        self.process.wait()

    def stop(self) -> int:
        self.process.send_signal(signal.SIGTERM)
        try:
            return self.process.wait(timeout=15)
        except subprocess.TimeoutExpired:
            self.kill()
            raise AssertionError(f"{self.name} ignored SIGTERM:\n{self.log()}")


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
