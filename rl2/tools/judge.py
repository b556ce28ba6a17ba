"""An LLM judge for rewards: a model behind an OpenAI-compatible endpoint scores a response with a rubric.

    judge = Judge("http://127.0.0.1:8000/v1", "Qwen/Qwen2.5-72B-Instruct")
    reward = await judge.score(question, response, answer)    # in [0, 1]
    reward = judge.score_sync(question, response, answer)     # the same, from a sync reward_fn

Each call renders `rubric` (its `{question}`, `{response}` and `{answer}` replaced; other braces are
kept) as the user message of one `POST {base_url}/chat/completions` (OpenAI's chat API, temperature 0),
reads a score from the reply with `parse` (default `parse_score`: the last `<score>x</score>`, else
the last number) and returns it divided by `max_score`.

A score is never made up: a judge that cannot be reached, refuses the request, answers something other
than a chat completion, or replies without a score in [0, `max_score`] makes the call raise `JudgeError`,
naming the endpoint and what failed. Raised in an env file's `reward_fn`, it is an env error: the
trajectory gets no reward and is left out of training, as for any failing `reward_fn`.

Connection errors, timeouts and HTTP 5xx / 408 / 429 are retried `retries` times after `backoff`,
2 x `backoff`, ... seconds (at most `max_backoff` each; the defaults wait 23.5 s in all), each retried
attempt counted as `judge_retries` in `faults`, which rl2 logs each step as `faults/judge_retries` for
a Judge kept at an env file's module level. At most `concurrency` requests are in flight at once per
event loop (an async `reward_fn`'s batch shares one; `score_sync` makes one request at a time).

Scores are cached by (model, rendered prompt), so the same question and response are judged once in
a run, also when asked again while the first request is still in flight (identical answers in one
group). The cache keeps the latest `cache_size` scores (their prompts' SHA-256, not the prompts);
failures are not cached. `counts()` says how many calls were made, answered from the cache, retried
and failed.
"""

import asyncio
import concurrent.futures
import hashlib
import json
import logging
import re
import threading
import weakref
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

import aiohttp

from rl2.coroutines import run_coroutine
from rl2.tools.api_key import api_key_from, auth_headers
from rl2.tools.faults import FaultCounter
from rl2.tools.http_post import BODY_CHARS, Retryable, post_json

logger = logging.getLogger(__name__)

RETRIES, BACKOFF, MAX_BACKOFF = 6, 0.5, 8.0  # 23.5 s of backoff in all, as rl2's other clients

DEFAULT_RUBRIC = """\
You are grading a response to a question. Judge whether it is correct, complete and clear. \
If a reference answer is given, a response that disagrees with it is wrong.

Question:
{question}

Reference answer (may be empty):
{answer}

Response:
{response}

Explain your judgement in a few sentences, then give a score from 0 (worst) to 10 (best) \
on the last line as <score>N</score>."""

_PLACEHOLDER = re.compile(r"\{(question|response|answer)\}")
_SCORE_TAG = re.compile(r"<score>\s*(.*?)\s*</score>", re.DOTALL | re.IGNORECASE)
_NUMBER = r"[-+]?(?:\d+(?:\.\d*)?|\.\d+)"
# A number, with the denominator of "x/10" or "x out of 10" after it (not a score of its own).
_LAST_NUMBER = re.compile(rf"({_NUMBER})(?:\s*(?:/|out of)\s*{_NUMBER})?", re.IGNORECASE)


class JudgeError(RuntimeError):
    """The judge could not be reached, refused, or gave no usable score: the response is not scored."""


def parse_score(reply: str) -> float:
    """The score in a judge's reply: the last `<score>x</score>`, else the last number (of "8/10" or
    "8 out of 10", the 8). `ValueError` if there is none."""
    tags = _SCORE_TAG.findall(reply)
    if tags:
        try:
            return float(tags[-1])
        except ValueError:
            raise ValueError(f"<score> holds no number: {tags[-1][:50]!r}") from None
    numbers = _LAST_NUMBER.findall(reply)
    if not numbers:
        raise ValueError("no <score>x</score> and no number in the reply")
    return float(numbers[-1])


class _Abandoned(Exception):
    """The request a call waited for was cancelled: the call makes its own."""


@dataclass
class Judge:
    """Scores responses with an LLM behind an OpenAI-compatible endpoint; see the module docstring.

    `base_url` is the API's root, as OpenAI clients take it (`https://api.openai.com/v1`,
    `http://127.0.0.1:8000/v1` for vLLM / SGLang). `api_key` is sent as `Authorization: Bearer`; without
    one, the environment variable named `api_key_env` is used, if set. `parse(reply)` returns the raw
    score (raising `ValueError` when the reply has none). `timeout` is per attempt, in seconds."""

    base_url: str
    model: str
    rubric: str = field(default=DEFAULT_RUBRIC, repr=False)
    max_score: float = 10.0
    parse: Callable[[str], float] = parse_score
    system_prompt: str | None = None
    api_key: str | None = field(default=None, repr=False)
    api_key_env: str = "JUDGE_API_KEY"
    temperature: float = 0.0
    max_tokens: int = 1024
    timeout: float = 60.0
    retries: int = RETRIES
    backoff: float = BACKOFF
    max_backoff: float = MAX_BACKOFF
    concurrency: int = 16
    cache_size: int = 100_000

    def __post_init__(self):
        if not self.base_url.startswith(("http://", "https://")):
            raise ValueError(f"judge base_url must start with http:// or https://, got {self.base_url!r}")
        if "{response}" not in self.rubric:
            raise ValueError("the judge's rubric has no {response} placeholder: the judge would not see the response")
        if not self.max_score > 0 or self.concurrency < 1 or self.max_tokens < 1:
            raise ValueError("judge max_score must be positive, concurrency and max_tokens at least 1")
        if self.timeout <= 0 or self.retries < 0 or self.backoff < 0 or self.cache_size < 0:
            raise ValueError("judge timeout must be positive, retries, backoff and cache_size non-negative")
        self.base_url = self.base_url.rstrip("/")
        self.url = self.base_url + "/chat/completions"
        self._headers = auth_headers(api_key_from(self.api_key, self.api_key_env))  # sent, never shown
        self.faults = FaultCounter()  # judge_retries, logged by the trainer as faults/judge_retries
        self._counts = FaultCounter()  # calls, cache_hits, retries, failures
        self._lock = threading.Lock()
        self._cache: OrderedDict[bytes, float] = OrderedDict()
        self._pending: dict[bytes, concurrent.futures.Future] = {}  # prompts being judged, by cache key
        self._limits: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # a semaphore per event loop

    # ------------------------------------------------------------------------------------------
    # public

    def render(self, question: str, response: str, answer: Any = None) -> str:
        """The rubric with the question, the response and the reference answer ("" for None) filled in."""
        answer = "" if answer is None else answer if isinstance(answer, str) else json.dumps(answer, default=str)
        values = {"question": question, "response": response, "answer": answer}
        return _PLACEHOLDER.sub(lambda match: values[match.group(1)], self.rubric)  # one pass: values stay as they are

    async def score(self, question: str, response: str, answer: Any = None) -> float:
        """The judge's score of `response` to `question` (with the reference `answer`), in [0, 1];
        `JudgeError` when there is none."""
        self._counts.add("calls")
        try:
            return await self._score(self.render(question, response, answer))
        except Exception:
            self._counts.add("failures")
            raise

    def score_sync(self, question: str, response: str, answer: Any = None) -> float:
        """`score` from synchronous code (on a new event loop; in a new thread if a loop already runs here)."""
        return run_coroutine(lambda: self.score(question, response, answer))

    def counts(self) -> dict[str, int]:
        """Running totals: `calls` (of score), `cache_hits` (answered without a request of their own),
        `retries` (attempts retried) and `failures` (calls that raised)."""
        counts = self._counts.counts()
        return {name: counts.get(name, 0) for name in ("calls", "cache_hits", "retries", "failures")}

    # ------------------------------------------------------------------------------------------
    # cache

    async def _score(self, prompt: str) -> float:
        key = hashlib.sha256(f"{self.model}\0{prompt}".encode()).digest()
        while True:
            with self._lock:
                if key in self._cache:
                    self._cache.move_to_end(key)
                    self._counts.add("cache_hits")
                    return self._cache[key]
                pending = self._pending.get(key)
                leading = pending is None
                if leading:
                    pending = self._pending[key] = concurrent.futures.Future()
                    pending.set_running_or_notify_cancel()  # so that a waiter's cancellation cannot cancel it
            if leading:
                return await self._lead(key, prompt, pending)
            try:
                score = await asyncio.wrap_future(pending)
            except _Abandoned:
                continue
            except Exception as error:
                raise JudgeError(str(error)) from error
            self._counts.add("cache_hits")
            return score

    async def _lead(self, key: bytes, prompt: str, pending: concurrent.futures.Future) -> float:
        """Judge `prompt` for this call and the calls waiting on `pending`; cache the score."""
        try:
            score = await self._judge(prompt)
        except BaseException as error:
            with self._lock:
                del self._pending[key]
            pending.set_exception(error if isinstance(error, Exception) else _Abandoned())
            raise
        with self._lock:
            del self._pending[key]
            if self.cache_size:
                self._cache[key] = score
                while len(self._cache) > self.cache_size:
                    self._cache.popitem(last=False)
        pending.set_result(score)
        return score

    # ------------------------------------------------------------------------------------------
    # requests

    async def _judge(self, prompt: str) -> float:
        """One score from the endpoint, retried; `JudgeError` when there is none."""
        messages = [{"role": "user", "content": prompt}]
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        payload = {"model": self.model, "messages": messages, "temperature": self.temperature,
                   "max_tokens": self.max_tokens}
        attempts = self.retries + 1
        problem = ""
        async with aiohttp.ClientSession(headers=self._headers) as session:
            for attempt in range(1, attempts + 1):
                try:
                    reply = await self._post(session, payload)
                    break
                except Retryable as error:
                    problem = str(error)
                if attempt < attempts:
                    self.faults.add("judge_retries")
                    self._counts.add("retries")
                    delay = min(self.backoff * 2 ** (attempt - 1), self.max_backoff)
                    logger.warning("judge at %s %s; attempt %d/%d, retrying in %.2gs", self.url, problem,
                                   attempt, attempts, delay)
                    await asyncio.sleep(delay)
            else:
                raise JudgeError(f"judge at {self.url} {problem} (gave up after {attempts} attempts)")
        try:
            raw = float(self.parse(reply))
        except ValueError as error:
            raise JudgeError(f"judge at {self.url} (model {self.model!r}) gave no score: {error}; "
                             f"reply: {reply[:BODY_CHARS]!r}") from None
        if not 0 <= raw <= self.max_score:  # also NaN
            raise JudgeError(f"judge at {self.url} (model {self.model!r}) scored {raw:g}, outside 0..{self.max_score:g}; "
                             f"reply: {reply[:BODY_CHARS]!r}")
        return raw / self.max_score

    def _limit(self) -> asyncio.Semaphore:
        loop = asyncio.get_running_loop()
        with self._lock:
            limit = self._limits.get(loop)
            if limit is None:
                limit = self._limits[loop] = asyncio.Semaphore(self.concurrency)
        return limit

    async def _post(self, session: aiohttp.ClientSession, payload: dict) -> str:
        """The content of the reply to one request; `Retryable`, or `JudgeError` for what a retry would repeat."""
        async with self._limit():
            status, body = await post_json(session, self.url, payload, self.timeout)
        if status in (401, 403):
            raise JudgeError(f"judge at {self.url} refused the request: HTTP {status} "
                             f"({'wrong' if self._headers else 'no'} API key? set {self.api_key_env}): {body[:BODY_CHARS]}")
        if status in (404, 405):
            raise JudgeError(f"judge at {self.url}: no such endpoint (HTTP {status}; base_url is the API's root, "
                             f"e.g. http://host:port/v1): {body[:BODY_CHARS]}")
        if status != 200:
            raise JudgeError(f"judge at {self.url} rejected the request with HTTP {status}: {body[:BODY_CHARS]}")
        try:
            content = json.loads(body)["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise JudgeError(f"judge at {self.url} answered something other than a chat completion: "
                             f"{body[:BODY_CHARS]}") from None
        if not isinstance(content, str) or not content.strip():
            raise JudgeError(f"judge at {self.url} (model {self.model!r}) replied with no content: {body[:BODY_CHARS]}")
        return content


__all__ = ["DEFAULT_RUBRIC", "Judge", "JudgeError", "parse_score"]
