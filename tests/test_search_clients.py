"""Real retrieval clients, unchanged but for the URL, against rl2's retrieval server on the sample
corpus: Search-R1's (a whole rollout's 2,560 queries in one request) and RLinf's (which needs a
`url` in every document). Their request and parsing code is in tests/clients/."""

import asyncio
import json
import shutil

import pytest

from clients import rlinf, search_r1
from retrieval_helpers import SAMPLE_CORPUS, running


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    """The server with its default limits, on a copy of the sample corpus (its index saved in a temp dir)."""
    path = tmp_path_factory.mktemp("corpus") / "search_corpus.jsonl"
    shutil.copy(SAMPLE_CORPUS, path)
    with running(str(path), "--topk", "3") as server:
        yield server


def corpus_titles() -> list[str]:
    return [json.loads(line)["contents"].split("\n")[0] for line in open(SAMPLE_CORPUS)]


def test_search_r1_client_sends_a_whole_rollout_at_once(server):
    """512 prompts x 5 responses: 2,560 queries in one request, each answered with its own passages,
    rendered as Search-R1 shows them to the model."""
    titles = corpus_titles()
    queries = [titles[i % len(titles)] for i in range(2560)]
    texts = search_r1.batch_search_texts(f"{server.url}/retrieve", queries, topk=3)
    assert len(texts) == 2560
    assert all(text.startswith("Doc 1(Title: ") and 1 <= text.count("\n") <= 3 for text in texts)
    found = sum(f"(Title: {query})" in text for query, text in zip(queries, texts))
    assert found >= 0.9 * len(queries)  # the document of that title is among the top 3 (BM25 on titles)
    for i in range(0, 2560, 257):  # each answer is the query's own, in order
        assert search_r1.batch_search_texts(f"{server.url}/retrieve", [queries[i]], topk=3) == [texts[i]]


def test_search_r1_client_on_errors_gets_json(server):
    """A malformed request answers JSON (the client decodes every answer): FastAPI's 422 shape."""
    answer = search_r1.batch_search(f"{server.url}/retrieve", ["ok", 7], topk=3)
    assert answer["detail"][0]["loc"] == ["body", "queries", 1]


def test_rlinf_client_reads_urls_and_renders_its_tool_text(server):
    address = server.url.removeprefix("http://")
    results = asyncio.run(rlinf.query(address, ["Who composed the ballet Swan Lake?"], topk=2, retries=1, delay=0))
    (result,) = results
    assert len(result["documents"]) == 2 and result["urls"] == ["", ""]  # the sample corpus has no urls
    text = rlinf.tool_text(result)
    assert text.startswith("[Doc 1]():\nPyotr Ilyich Tchaikovsky") and "\n\n[Doc 2]():\n" in text
