"""One JSON POST to a service (a code-judge, an LLM judge), its failures sorted into those worth another attempt
(`Retryable`) and the answers the caller reads."""

import asyncio

import aiohttp

RETRY_STATUSES = (408, 429)  # besides 5xx
BODY_CHARS = 300  # how much of an unexpected answer a message quotes


class Retryable(Exception):
    """A failure worth another attempt (connection, timeout, 5xx, 408, 429)."""


async def post_json(session: aiohttp.ClientSession, url: str, payload: dict, timeout: float) -> tuple[int, str]:
    """The status and body of the answer to `payload` posted to `url`; `Retryable` when there is none within `timeout`
    seconds, the service is unreachable or the status says to try again."""
    try:
        async with session.post(url, json=payload, timeout=aiohttp.ClientTimeout(total=timeout)) as response:
            status, body = response.status, await response.text(errors="replace")
    except asyncio.TimeoutError:
        raise Retryable(f"did not answer within {timeout:g}s") from None
    except aiohttp.ClientError as error:
        raise Retryable(f"unreachable: {type(error).__name__}: {error}") from None
    if status >= 500 or status in RETRY_STATUSES:
        raise Retryable(f"failed with HTTP {status}: {body[:BODY_CHARS]}")
    return status, body
