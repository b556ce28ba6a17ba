"""RLinf's local search client, reduced to what talks to the server: `AsyncSearchClient.query_async`
(one POST per tool call, `raise_for_status`, documents read as `r["contents"]` and `r["url"]`,
retried 10 times 10 s apart on any error, the missing `url` included) and the tool's text.

Source: github.com/RLinf/RLinf, `rlinf/agents/tools/mas_search_tool_worker.py` (Apache-2.0).
Rewritten here with the same behaviour; `retries` and `delay` are parameters so a test can see a
failure without waiting 100 s.
"""

import asyncio

import aiohttp


async def query(server_addr: str, queries: list[str], topk: int, retries: int = 10, delay: float = 10.0) -> list[dict]:
    """For each query, {"documents": [contents], "urls": [url]}; RuntimeError after `retries` failures."""
    payload = {"queries": queries, "topk": topk, "return_scores": False}
    last = None
    async with aiohttp.ClientSession() as session:
        for _ in range(retries):
            try:
                async with session.post(f"http://{server_addr}/retrieve", json=payload) as response:
                    response.raise_for_status()
                    answer = await response.json()
                    return [{"documents": [r["contents"] for r in result], "urls": [r["url"] for r in result]}
                            for result in answer["result"]]
            except Exception as e:  # noqa: BLE001 - as the client does: every error is retried
                last = e
                await asyncio.sleep(delay)
    raise RuntimeError("Fail to post search query to RAG server") from last


def tool_text(result: dict) -> str:
    """The search tool's answer to the model: `[Doc k](url):` and the document's first 5,000 characters."""
    if not result["documents"]:
        return "No search results are found."
    return "\n\n".join(f"[Doc {k + 1}]({url}):\n" + doc[:5000]
                       for k, (doc, url) in enumerate(zip(result["documents"], result["urls"])))
