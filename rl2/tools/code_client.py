"""An async client for a code-judge-compatible service (`rl2.tools.code_server`, or code-judge).

    client = CodeClient("http://127.0.0.1:8000", concurrency=8, batch_size=32)
    result = await client.run("print(input())", stdin="hi")      # {"success": True, "stdout": "hi\\n", ...}
    results = await client.run_many(["print(1)", ("print(input())", "x")])

Results are code-judge result dicts: `sub_id`, `success`, `run_success`, `cost`, `stdout`,
`stderr`, `reason` (see `rl2.tools.code_server`). `run_many` sends the programs in batches of
`batch_size` to `/run/long-batch` (or `/run/batch`), at most `concurrency` requests at once per
event loop, and returns the results in order.

Connection errors, timeouts, HTTP 5xx/408/429 and "queue_timeout" results are retried `retries`
times after `backoff`, 2 x `backoff`, ... seconds (at most `max_backoff` each), and each retried
attempt counts `code_service_retries` in `client.faults` (a `rl2.tools.faults.FaultCounter`). The
defaults (6 retries, 0.5 s doubling up to 8 s: 0.5 + 1 + 2 + 4 + 8 + 8 = 23.5 s of waiting) ride
out a service restart of a few seconds, such as `recipes/lib.sh`'s `start_service` does when the
service dies; a request that hangs costs its `timeout` on each attempt.

The client never raises for a service failure: what could not be run comes back as a result with
`success=False`, `run_success=False`, `reason` "internal_error" (service unreachable, failing, or
not a code service at that URL), "queue_timeout" (still no free worker after the retries) or
"invalid_input" (the service rejected the program, e.g. too large), and a message in `stderr` such
as "code service at http://127.0.0.1:8000 unreachable: ... (gave up after 7 attempts)". Callers
must tell these apart from a program that ran and failed: "internal_error" and "queue_timeout"
mean the program did not run (`envs/python_tool.py` makes them an env error).

The client keeps no connection between calls unless used as `async with client:` (one session
for the block, on that block's event loop), so it is safe in rl2 env functions, which run on a
fresh event loop for each batch. `run_sync` / `run_many_sync` are the same from synchronous code.
"""

import asyncio
import contextlib
import json
import logging
import uuid
import weakref
from typing import Any, AsyncIterator, Sequence

import aiohttp

from rl2.coroutines import run_coroutine
from rl2.tools.api_key import auth_headers
from rl2.tools.faults import FaultCounter
from rl2.tools.http_post import BODY_CHARS, Retryable, post_json

logger = logging.getLogger("rl2.tools.code_client")

RETRIES, BACKOFF, MAX_BACKOFF = 6, 0.5, 8.0  # 23.5 s of backoff in all: rides out a restart of a few seconds

Program = str | tuple[str, str]  # code, or (code, stdin)


class _Rejected(Exception):
    """A failure that another attempt would repeat (4xx, an answer not in the API's shape)."""

    def __init__(self, message: str, reason: str):
        super().__init__(message)
        self.reason = reason


class CodeClient:
    """Runs Python programs on a code-judge-compatible service; see the module docstring."""

    def __init__(self, url: str, *, concurrency: int = 8, batch_size: int = 32, timeout: float = 300.0,
                 retries: int = RETRIES, backoff: float = BACKOFF, max_backoff: float = MAX_BACKOFF,
                 long_batch: bool = True, language: str = "python", api_key: str | None = None):
        if concurrency < 1 or batch_size < 1:
            raise ValueError(f"concurrency and batch_size must be at least 1, got {concurrency} and {batch_size}")
        if timeout <= 0 or retries < 0 or backoff < 0:
            raise ValueError("timeout must be positive, retries and backoff non-negative")
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"code service URL must start with http:// or https://, got {url!r}")
        self.url = url.rstrip("/")
        self.concurrency, self.batch_size, self.timeout = concurrency, batch_size, float(timeout)
        self.retries, self.backoff, self.max_backoff = retries, float(backoff), float(max_backoff)
        self.language = language
        self._headers = auth_headers(api_key)  # the key is sent, never shown (repr, logs, errors)
        self.endpoint = "/run/long-batch" if long_batch else "/run/batch"
        self.faults = FaultCounter()  # code_service_retries: attempts retried
        self._session: aiohttp.ClientSession | None = None
        self._session_loop: asyncio.AbstractEventLoop | None = None
        # One request limit per event loop: a semaphore belongs to the loop it is first used on.
        self._limits: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()

    def __repr__(self) -> str:
        return (f"CodeClient({self.url!r}, endpoint={self.endpoint!r}, concurrency={self.concurrency}, "
                f"batch_size={self.batch_size}, timeout={self.timeout:g}, retries={self.retries}, "
                f"api_key={'set' if self._headers else 'none'})")

    # ------------------------------------------------------------------------------------------
    # public

    async def __aenter__(self) -> "CodeClient":
        if self._session is not None:
            raise RuntimeError(f"{self!r} is already open (async with)")
        self._session, self._session_loop = self._new_session(), asyncio.get_running_loop()
        return self

    async def __aexit__(self, *exc_info) -> None:
        session, self._session, self._session_loop = self._session, None, None
        if session is not None:
            await session.close()

    async def run(self, code: str, stdin: str = "") -> dict:
        """Run one program; its code-judge result dict."""
        return (await self.run_many([(code, stdin)]))[0]

    async def run_many(self, programs: Sequence[Program]) -> list[dict]:
        """Run `programs` (code strings or (code, stdin) pairs); their results, in order."""
        submissions = [self._submission(program) for program in programs]
        if not submissions:
            return []
        chunks = [submissions[i:i + self.batch_size] for i in range(0, len(submissions), self.batch_size)]
        async with self._session_for_call() as session:
            parts = await asyncio.gather(*(self._run_chunk(session, chunk) for chunk in chunks))
        return [result for part in parts for result in part]

    async def ping(self) -> bool:
        """Whether the service answers `GET /ping` (one attempt, no retries)."""
        try:
            async with self._session_for_call() as session:
                async with session.get(self.url + "/ping", timeout=aiohttp.ClientTimeout(total=min(self.timeout, 10.0))) as response:
                    return response.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    def run_sync(self, code: str, stdin: str = "") -> dict:
        """`run` from synchronous code (on a new event loop; in a new thread if a loop already runs here)."""
        return run_coroutine(lambda: self.run(code, stdin))

    def run_many_sync(self, programs: Sequence[Program]) -> list[dict]:
        """`run_many` from synchronous code."""
        return run_coroutine(lambda: self.run_many(programs))

    # ------------------------------------------------------------------------------------------
    # requests

    def _submission(self, program: Program) -> dict:
        if isinstance(program, str):
            code, stdin = program, ""
        elif isinstance(program, (tuple, list)) and len(program) == 2 and all(isinstance(p, str) for p in program):
            code, stdin = program
        else:
            raise TypeError(f"a program is a code string or a (code, stdin) pair of strings, got {program!r:.100}")
        return {"sub_id": uuid.uuid4().hex, "type": self.language, "solution": code, "input": stdin}

    def _new_session(self) -> aiohttp.ClientSession:
        return aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=self.concurrency), headers=self._headers)

    @contextlib.asynccontextmanager
    async def _session_for_call(self) -> AsyncIterator[aiohttp.ClientSession]:
        """The `async with` session when it belongs to this loop, else one for this call only."""
        if self._session is not None and self._session_loop is asyncio.get_running_loop():
            yield self._session
            return
        session = self._new_session()
        try:
            yield session
        finally:
            await session.close()

    def _limit(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        try:
            limit = self._limits.get(loop)
            if limit is None:
                limit = self._limits[loop] = asyncio.Semaphore(self.concurrency)
        except TypeError:  # a loop without weak references: only the session's connection limit applies
            limit = asyncio.Semaphore(self.concurrency)
        return limit

    async def _run_chunk(self, session: aiohttp.ClientSession, subs: list[dict]) -> list[dict]:
        """Results for one batch, retrying failed requests and queue-timed-out submissions."""
        results: list[dict | None] = [None] * len(subs)
        pending = list(range(len(subs)))
        attempts = self.retries + 1
        problem = ""
        for attempt in range(1, attempts + 1):
            try:
                answers = await self._post(session, [subs[i] for i in pending])
            except Retryable as error:
                problem = str(error)
            except _Rejected as error:
                message = f"code service at {self.url} {error}"
                logger.error("%s", message)
                for i in pending:
                    results[i] = not_run_result(subs[i]["sub_id"], error.reason, message)
                return results
            else:
                for i, answer in zip(pending, answers):
                    results[i] = answer  # a queue_timeout answer stays if no retry succeeds
                pending = [i for i, answer in zip(pending, answers) if answer.get("reason") == "queue_timeout"]
                if not pending:
                    return results
                problem = f"left {len(pending)} submission(s) waiting too long in its queue (queue_timeout)"
            if attempt < attempts:
                self.faults.add("code_service_retries")
                delay = min(self.backoff * 2 ** (attempt - 1), self.max_backoff)
                logger.warning("code service at %s %s; attempt %d/%d, retrying in %.2gs",
                               self.url, problem, attempt, attempts, delay)
                await asyncio.sleep(delay)
        message = f"code service at {self.url} {problem} (gave up after {attempts} attempts)"
        logger.error("%s", message)
        for i in pending:
            if results[i] is None:
                results[i] = not_run_result(subs[i]["sub_id"], "internal_error", message)
        return results

    async def _post(self, session: aiohttp.ClientSession, subs: list[dict]) -> list[dict]:
        """One batch request; the results, or `Retryable` / `_Rejected`."""
        payload = {"type": "batch", "submissions": subs}
        async with self._limit():
            status, body = await post_json(session, self.url + self.endpoint, payload, self.timeout)
        if status == 401:  # the service wants a key this client does not have (or another one)
            raise _Rejected(f"refused the request: HTTP 401 ({'wrong' if self._headers else 'no'} API key; set "
                            f"code_server_api_key in rollout.env_args or CODE_SERVER_API_KEY)", "invalid_input")
        if status in (404, 405):  # no code service at this URL: nothing the program did
            raise _Rejected(f"has no {self.endpoint} (HTTP {status}; is the URL the service's root?): "
                            f"{body[:BODY_CHARS]}", "internal_error")
        if status != 200:
            raise _Rejected(f"rejected the request with HTTP {status}: {body[:BODY_CHARS]}", "invalid_input")
        return _check_answer(body, subs)


def _check_answer(body: str, subs: list[dict]) -> list[dict]:
    """The `results` of a batch answer, checked against the submissions; `_Rejected` if malformed."""
    try:
        results = json.loads(body)["results"]
    except (ValueError, KeyError, TypeError):
        raise _Rejected(f"answered with an unexpected body: {body[:BODY_CHARS]}", "internal_error") from None
    if (not isinstance(results, list) or len(results) != len(subs)
            or any(not isinstance(r, dict) or r.get("sub_id") != s["sub_id"] for r, s in zip(results, subs))):
        raise _Rejected(f"answered results that do not match the {len(subs)} submissions: {body[:BODY_CHARS]}",
                        "internal_error")
    return results


def not_run_result(sub_id: Any, reason: str, message: str, cost: float = 0.0) -> dict:
    """A code-judge result for a submission that did not run (`reason` "queue_timeout" or
    "internal_error"), from the service or from this client: stdout is null, as in code-judge, and
    stderr says why (null in code-judge)."""
    return {"sub_id": sub_id, "success": False, "run_success": False, "cost": cost,
            "stdout": None, "stderr": message, "reason": reason}


__all__ = ["CodeClient", "not_run_result"]
