"""Client for the Search-R1 retrieval API (`rl2.tools.retrieval_server`, or Search-R1's own server).

    hits = await retrieve(["capital of france"], "http://127.0.0.1:8000/retrieve", topk=3)
    passages_to_string(hits[0])   # 'Doc 1(Title: Paris) Paris is ...\\nDoc 2(Title: ...) ...\\n'

`retrieve` opens an aiohttp session per call (so it can run on any event loop, e.g. one made per
rollout batch), retries connection errors, timeouts and HTTP 5xx with exponential backoff, counting
each retried attempt as `search_retries` in the `faults` counter it is given, and raises
`SearchError` when the service cannot answer. The default retries (6, after 0.5 s doubling up to
8 s: 23.5 s of waiting in all) ride out a restart of a service that comes back within seconds
(`recipes/lib.sh`'s `start_service` restarts one that died); one that takes longer, such as a
server loading a large index, fails the calls made meanwhile.
"""

import asyncio
import json
import logging

import aiohttp

from rl2.tools.api_key import auth_headers
from rl2.tools.faults import FaultCounter

logger = logging.getLogger(__name__)

RETRIES, BACKOFF, MAX_BACKOFF = 6, 0.5, 8.0  # 23.5 s of backoff in all


class SearchError(RuntimeError):
    """The retrieval service could not be reached or gave an unusable answer."""


async def retrieve(queries: list[str], url: str, topk: int = 3, timeout: float = 10.0, retries: int = RETRIES,
                   backoff: float = BACKOFF, max_backoff: float = MAX_BACKOFF,
                   faults: FaultCounter | None = None, api_key: str | None = None) -> list[list[dict]]:
    """For each query, the service's hits `{"document": {"id", "contents", ...}, "score": float}`,
    best first. `timeout` is per attempt in seconds; `retries` more attempts follow a connection
    error, a timeout or an HTTP 5xx, after `backoff`, 2 * `backoff`, ... seconds (at most
    `max_backoff` each), each counted as `search_retries` in `faults` when given. `api_key` goes in the
    `Authorization: Bearer` header (a service started with `--api-key` refuses requests without it)."""
    payload = {"queries": list(queries), "topk": topk, "return_scores": True}
    problem = ""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=timeout), headers=auth_headers(api_key)) as session:
        for attempt in range(retries + 1):
            if attempt:
                if faults is not None:
                    faults.add("search_retries")
                delay = min(backoff * 2 ** (attempt - 1), max_backoff)
                logger.warning("retrieval service at %s: %s; attempt %d/%d, retrying in %.2gs",
                               url, problem, attempt, retries + 1, delay)
                await asyncio.sleep(delay)
            try:
                async with session.post(url, json=payload) as response:
                    text = await response.text()
                    if response.status >= 500:
                        problem = f"HTTP {response.status}: {_error_message(text)}"
                        continue
                    if response.status != 200:
                        raise SearchError(f"retrieval service at {url} refused the request: HTTP {response.status}: "
                                          f"{_error_message(text)}")
                    return _check_result(text, len(queries), url)
            except (aiohttp.ClientConnectionError, asyncio.TimeoutError) as e:
                problem = f"{type(e).__name__}: {e}" if str(e) else type(e).__name__
    attempts = f"{retries + 1} attempts" if retries else "1 attempt"
    raise SearchError(f"retrieval service at {url} failed ({attempts}): {problem}")


def passages_to_string(hits: list[dict]) -> str:
    """Search-R1's rendering of one query's hits: `Doc i(Title: <first line>) <rest>` per line.
    Takes hits with scores (`{"document": ..., "score": ...}`) or bare documents."""
    lines = []
    for i, hit in enumerate(hits, 1):
        document = hit.get("document", hit)
        title, _, text = document["contents"].partition("\n")
        lines.append(f"Doc {i}(Title: {title}) {text}\n")
    return "".join(lines)


def _check_result(text: str, n_queries: int, url: str) -> list[list[dict]]:
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        raise SearchError(f"retrieval service at {url} answered with something other than JSON: {text[:200]!r}") from None
    result = body.get("result") if isinstance(body, dict) else None
    if not isinstance(result, list) or len(result) != n_queries or not all(isinstance(row, list) for row in result):
        raise SearchError(f"retrieval service at {url} answered without a 'result' list of {n_queries} lists: {text[:200]!r}")
    for row in result:
        for hit in row:
            document = hit.get("document") if isinstance(hit, dict) else None
            if not isinstance(document, dict) or not isinstance(document.get("contents"), str):
                raise SearchError(f"retrieval service at {url} returned a hit without document contents: {hit!r:.200}")
    return result


def _error_message(text: str) -> str:
    """The message of a JSON error body (`{"detail": str}`, FastAPI's `{"detail": [{"loc", "msg"}]}`,
    or `{"error": str}`), else the start of the body."""
    try:
        body = json.loads(text)
    except json.JSONDecodeError:
        return text[:200] or "(empty body)"
    message = body.get("detail", body.get("error")) if isinstance(body, dict) else None
    if isinstance(message, str):
        return message
    if isinstance(message, list) and message and all(isinstance(entry, dict) for entry in message):
        return "; ".join(f"{'.'.join(map(str, entry.get('loc', [])))}: {entry.get('msg')}" for entry in message)
    return text[:200]
