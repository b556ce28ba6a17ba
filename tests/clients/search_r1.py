"""Search-R1's retrieval client, reduced to what talks to the server: the request its
`GenerationManager._batch_search` sends and the text `_passages2string` makes of the answer.

Source: github.com/PeterGriffinJin/Search-R1, `search_r1/llm_agent/generation.py` (Apache-2.0).
Rewritten here with the same behaviour (one synchronous `requests.post` of every query at once,
`return_scores: true`, no error handling: a non-JSON answer raises, a JSON one without "result"
raises KeyError), so the tests see what that client sees.
"""

import requests


def batch_search(search_url: str, queries: list[str], topk: int) -> dict:
    """One POST of all `queries`; the decoded JSON answer."""
    payload = {"queries": queries, "topk": topk, "return_scores": True}
    return requests.post(search_url, json=payload).json()


def batch_search_texts(search_url: str, queries: list[str], topk: int) -> list[str]:
    """What the model is shown for each query (`_batch_search(...)["result"]` through `_passages2string`)."""
    return [passages_to_string(hits) for hits in batch_search(search_url, queries, topk)["result"]]


def passages_to_string(retrieval_result: list[dict]) -> str:
    """`Doc i(Title: <first line>) <the other lines>` per hit, each ending in a newline."""
    reference = ""
    for i, hit in enumerate(retrieval_result):
        lines = hit["document"]["contents"].split("\n")
        reference += f"Doc {i + 1}(Title: {lines[0]}) {chr(10).join(lines[1:])}\n"
    return reference
