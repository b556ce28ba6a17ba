"""The retrieval index (`rl2.tools.retrieval_index`) and server (`rl2.tools.retrieval_server`):
a real server process on the sample corpus, Search-R1's API shapes, what its pydantic model accepts,
422s in FastAPI's shape for bad requests, JSON for every error, the saved index reused on restart
and rebuilt when the corpus changes, malformed corpora."""

import asyncio
import json
import os
import shutil
import subprocess
import sys

import pytest

from retrieval_helpers import SAMPLE_CORPUS, running
from server_process import REPO, python_env, request, serving
from rl2.tools.retrieval_index import BM25Index, CorpusError, open_index
from rl2.tools.retrieval_server import make_app

MAX_QUERIES = 8  # the shared server's --max-queries


def titles(documents: list[dict]) -> list[str]:
    return [doc["contents"].split("\n")[0] for doc in documents]


def retrieve(url: str, body) -> tuple[int, object]:
    kwargs = {"data": body} if isinstance(body, (str, bytes)) else {"json": body}
    return asyncio.run(request("POST", f"{url}/retrieve", **kwargs))


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> str:
    """A copy of the sample corpus, so its index is saved in a temp dir, not in the repository."""
    path = tmp_path_factory.mktemp("corpus") / "search_corpus.jsonl"
    shutil.copy(SAMPLE_CORPUS, path)
    return str(path)


@pytest.fixture(scope="module")
def server(corpus):
    with running(corpus, "--topk", "3", "--max-queries", str(MAX_QUERIES)) as server:
        yield server


# ----------------------------------------------------------------------------------------------
# the API


@pytest.mark.parametrize("query,title", [
    ("The Night Watch", "The Night Watch"),
    ("Mount Kilimanjaro", "Mount Kilimanjaro"),
    ("Canberra", "Canberra"),
    ("Who composed the ballet Swan Lake?", "Pyotr Ilyich Tchaikovsky"),
    ("mercury planet closest to the sun", "Mercury (planet)"),
    ("mercury element liquid metal", "Mercury (element)"),
])
def test_query_returns_its_document_first(server, query, title):
    status, body = retrieve(server.url, {"queries": [query], "topk": 3, "return_scores": True})
    assert status == 200, body
    (hits,) = body["result"]
    assert titles([hit["document"] for hit in hits])[0] == title
    assert set(hits[0]["document"]) == {"id", "contents", "url"} and isinstance(hits[0]["document"]["id"], str)
    assert hits[0]["document"]["url"] == ""  # the sample corpus has no urls


def test_scores_sorted_topk_and_batch_order(server):
    queries = ["capital city", "the Louvre in Paris", "first published in"]
    status, body = retrieve(server.url, {"queries": queries, "topk": 7, "return_scores": True})
    assert status == 200
    assert len(body["result"]) == 3
    for hits in body["result"]:
        assert len(hits) == 7
        scores = [hit["score"] for hit in hits]
        assert all(isinstance(s, float) and s > 0 for s in scores)
        assert scores == sorted(scores, reverse=True)
    # Each query's list is what it gets alone: results come back in query order.
    for query, hits in zip(queries, body["result"]):
        assert retrieve(server.url, {"queries": [query], "topk": 7, "return_scores": True})[1]["result"] == [hits]


def test_return_scores_false_gives_documents_like_search_r1(server):
    with_scores = retrieve(server.url, {"queries": ["Danube Black Sea", "Jane Austen"], "topk": 2, "return_scores": True})[1]
    status, body = retrieve(server.url, {"queries": ["Danube Black Sea", "Jane Austen"], "topk": 2, "return_scores": False})
    assert status == 200
    assert body["result"] == [[hit["document"] for hit in hits] for hits in with_scores["result"]]
    assert titles(body["result"][0])[0] == "Danube"
    # Defaults: no return_scores means documents only; no topk means the server's --topk (3).
    status, body = retrieve(server.url, {"queries": ["capital city"]})
    assert status == 200 and len(body["result"][0]) == 3 and "contents" in body["result"][0][0]


def test_no_match_and_no_queries(server):
    status, body = retrieve(server.url, {"queries": ["zxqv wvut", "", "the of and"], "topk": 3, "return_scores": True})
    assert status == 200 and body == {"result": [[], [], []]}  # nothing scores above zero
    assert retrieve(server.url, {"queries": []}) == (200, {"result": []})


def test_health(server):
    status, body = asyncio.run(request("GET", f"{server.url}/health"))
    assert status == 200 and body == {"status": "ok", "documents": 314, "retriever": "bm25"}


@pytest.mark.parametrize("body,kind,loc", [
    ("not json", "json_invalid", []),
    ("", "json_invalid", []),
    ([1, 2], "model_attributes_type", []),
    ({"topk": 3}, "missing", ["queries"]),
    ({"queries": "capital"}, "list_type", ["queries"]),
    ({"queries": ["ok", 3]}, "string_type", ["queries", 1]),
    ({"queries": ["a"], "topk": -2}, "greater_than_equal", ["topk"]),
    ({"queries": ["a"], "topk": "three"}, "int_parsing", ["topk"]),
    ({"queries": ["a"], "topk": 2.5}, "int_from_float", ["topk"]),
    ({"queries": ["a"], "topk": True}, "int_type", ["topk"]),
    ({"queries": ["a"], "topk": 101}, "less_than_equal", ["topk"]),
    ({"queries": ["a"], "return_scores": "maybe"}, "bool_parsing", ["return_scores"]),
    ({"queries": ["a"], "return_scores": [True]}, "bool_type", ["return_scores"]),
])
def test_bad_requests_get_422_in_fastapis_shape(server, body, kind, loc):
    status, answer = retrieve(server.url, body)
    assert status == 422, answer
    (entry,) = answer["detail"]
    assert entry["type"] == kind and entry["loc"] == ["body", *loc] and entry["msg"] and "input" in entry


def test_what_search_r1s_model_accepts(server):
    """topk 0 or null means the server's --topk (3), as in Search-R1; numbers and booleans as strings."""
    expected = retrieve(server.url, {"queries": ["capital city"], "topk": 3, "return_scores": True})[1]
    for body in ({"topk": 0, "return_scores": True}, {"topk": None, "return_scores": "true"},
                 {"topk": "3", "return_scores": 1}, {"topk": 3.0, "return_scores": "yes"}):
        assert retrieve(server.url, {"queries": ["capital city"], **body}) == (200, expected)
    assert retrieve(server.url, {"queries": ["capital city"], "return_scores": "off"})[1]["result"] == [
        [hit["document"] for hit in expected["result"][0]]]


def test_other_errors_are_json(server):
    status, answer = retrieve(server.url, {"queries": ["a"] * (MAX_QUERIES + 1)})
    assert status == 413 and answer == {"detail": f"too many queries: {MAX_QUERIES + 1} (at most {MAX_QUERIES} "
                                                  "per request, --max-queries)"}
    assert asyncio.run(request("GET", f"{server.url}/nowhere")) == (404, {"detail": "Not Found"})
    assert asyncio.run(request("GET", f"{server.url}/retrieve")) == (405, {"detail": "Method Not Allowed"})


def test_a_whole_rollouts_queries_in_one_request_searched_in_chunks():
    """Search-R1's client sends a rollout's queries at once (2,560 in its script); the server takes far
    more by default, searches them a chunk at a time in order, and its body limit is configurable."""

    class CountingIndex:
        kind = "test"

        def __init__(self):
            self.chunks = []

        def __len__(self) -> int:
            return 1

        def search(self, queries, topk):
            self.chunks.append(len(queries))
            return [[({"id": str(i), "contents": f"T\n{q}", "url": f"https://x/{q}"}, 1.0)] for i, q in enumerate(queries)]

        def close(self):
            pass

    index = CountingIndex()
    queries = [f"q{i}" for i in range(2560)]

    async def main():
        async with serving(make_app(index, search_chunk=1000)) as url:
            whole = await request("POST", f"{url}/retrieve", json={"queries": queries, "topk": 5})
        async with serving(make_app(index, max_request_mb=0.01)) as url:
            too_big = await request("POST", f"{url}/retrieve", json={"queries": queries})
        return whole, too_big

    whole, too_big = asyncio.run(main())
    assert whole[0] == 200 and [row[0]["contents"] for row in whole[1]["result"]] == [f"T\n{q}" for q in queries]
    assert whole[1]["result"][7][0]["url"] == "https://x/q7"  # the corpus's url kept
    assert index.chunks == [1000, 1000, 560]
    assert too_big[0] == 413 and "Maximum request body size 10485 exceeded" in too_big[1]["detail"]


def test_in_process_app_and_search_errors():
    """make_app serves any index in-process; a failing search is a 500 with the error, and the
    server keeps answering."""

    class FlakyIndex:
        kind = "test"
        calls: list = []

        def __len__(self) -> int:
            return 1

        def search(self, queries, topk):
            self.calls.append((list(queries), topk))
            if queries == ["boom"]:
                raise RuntimeError("disk on fire")
            return [[({"id": "0", "contents": f"T\n{q}"}, 1.0)] for q in queries]

        def close(self):
            pass

    index = FlakyIndex()

    async def main():
        async with serving(make_app(index, topk=5)) as url:
            bad = await request("POST", f"{url}/retrieve", json={"queries": ["boom"]})
            good = await request("POST", f"{url}/retrieve", json={"queries": ["x"], "return_scores": True})
            return bad, good

    bad, good = asyncio.run(main())
    assert bad[0] == 500 and "disk on fire" in bad[1]["detail"]
    assert good == (200, {"result": [[{"document": {"id": "0", "contents": "T\nx", "url": ""}, "score": 1.0}]]})
    assert index.calls[-1] == (["x"], 5)  # the app's default topk


# ----------------------------------------------------------------------------------------------
# the saved index


def index_files(directory: str) -> dict[str, int]:
    return {name: os.stat(os.path.join(directory, name)).st_mtime_ns for name in sorted(os.listdir(directory))}


def test_index_is_saved_reused_on_restart_and_rebuilt_when_the_corpus_changes(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    shutil.copy(SAMPLE_CORPUS, corpus)
    index_dir = str(corpus) + ".bm25"
    query = {"queries": ["Sydney Opera House architect"], "topk": 3, "return_scores": True}

    with running(str(corpus)) as first:
        answer = retrieve(first.url, query)
    assert "built BM25 index of 314 documents" in first.log() and "loaded" not in first.log()
    assert "meta.json" in os.listdir(index_dir) and not any(".tmp-" in name for name in os.listdir(tmp_path))
    saved = index_files(index_dir)

    with running(str(corpus)) as second:
        assert retrieve(second.url, query) == answer
    assert "loaded BM25 index of 314 documents" in second.log() and "building" not in second.log()
    assert index_files(index_dir) == saved  # loaded, not rewritten

    with open(corpus, "a") as f:  # a new document: the saved index no longer matches
        f.write(json.dumps({"id": "new", "contents": "Zorblax\nZorblax is a made-up word."}) + "\n")
    with running(str(corpus)) as third:
        status, body = retrieve(third.url, {"queries": ["zorblax"], "return_scores": True})
    assert "the corpus changed since the index was built" in third.log()
    assert "built BM25 index of 315 documents" in third.log()
    assert body["result"][0][0]["document"] == {"id": "new", "contents": "Zorblax\nZorblax is a made-up word.", "url": ""}


def test_index_dir_option_and_in_process_reload(tmp_path):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("".join(json.dumps({"id": str(i), "contents": f"Doc {i}\nword{i} shared"}) + "\n" for i in range(5)))
    index_dir = tmp_path / "elsewhere"
    built = BM25Index.open(str(corpus), str(index_dir))
    hits = built.search(["word3", "shared"], topk=10)
    built.close()
    assert [doc["id"] for doc, _ in hits[0]] == ["3"]
    assert len(hits[1]) == 5  # topk above the corpus size: every matching document
    assert not os.path.exists(str(corpus) + ".bm25") and os.path.isfile(index_dir / "meta.json")
    loaded = open_index(str(corpus), index_dir=str(index_dir))
    assert loaded.search(["word3", "shared"], topk=10) == hits
    loaded.close()


def test_unsavable_index_is_kept_in_memory(tmp_path, caplog):
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text(json.dumps({"id": "a", "contents": "A\nalpha"}) + "\n")
    (tmp_path / "file").write_text("not a folder")
    index = open_index(str(corpus), index_dir=str(tmp_path / "file" / "index"))
    assert index.search(["alpha"], topk=1)[0][0][0] == {"id": "a", "contents": "A\nalpha"}
    index.close()
    assert "could not save the index to" in caplog.text and "kept in memory only" in caplog.text
    assert sorted(os.listdir(tmp_path)) == ["corpus.jsonl", "file"]


# ----------------------------------------------------------------------------------------------
# malformed corpora


@pytest.mark.parametrize("line,message", [
    ('{"id": "2", "contents": "Two\\ntext"', "line 3: malformed JSON"),
    ('["2", "Two"]', "line 3: expected a JSON object, got list"),
    ('{"id": "2", "text": "Two"}', "line 3: no 'contents' field"),
    ('{"id": "2", "contents": 7}', "line 3: 'contents' is int, expected a string"),
    ('{"contents": "Two\\ntext"}', "line 3: 'id' is missing or not a string"),
])
def test_malformed_corpus_line_is_named(tmp_path, line, message):
    corpus = tmp_path / "bad.jsonl"
    good = [json.dumps({"id": "0", "contents": "Zero\ntext"}), "", line, json.dumps({"id": "3", "contents": "Three\ntext"})]
    corpus.write_text("\n".join(good) + "\n")
    with pytest.raises(CorpusError) as error:
        open_index(str(corpus))
    assert f"{corpus}, {message}" in str(error.value)
    assert not os.path.exists(str(corpus) + ".bm25")


def test_corpus_errors_from_the_command_line(tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n\n")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "0", "contents": "A\\nb"}\n{oops\n')
    for corpus, message in [(empty, f"{empty}: no documents"), (bad, f"{bad}, line 2: malformed JSON"),
                            (tmp_path / "missing.jsonl", "corpus not found")]:
        result = subprocess.run([sys.executable, "-m", "rl2.tools.retrieval_server", "--corpus", str(corpus), "--port", "0"],
                                capture_output=True, text=True, timeout=60, cwd=REPO, env=python_env())
        assert result.returncode == 1, result.stderr
        assert "retrieval_server: error: " in result.stderr and message in result.stderr, result.stderr


def test_command_line_option_errors(tmp_path):
    for args, message in [(["--retriever", "dense"], "--retriever dense needs --encoder PATH"),
                          (["--encoder", str(tmp_path)], "--encoder is only used with --retriever dense"),
                          (["--topk", "0"], "1 <= --topk <= --max-topk, got 65536, 0, 100")]:
        result = subprocess.run([sys.executable, "-m", "rl2.tools.retrieval_server", "--corpus", SAMPLE_CORPUS,
                                 "--index-dir", str(tmp_path / "index"), "--port", "0", *args],
                                capture_output=True, text=True, timeout=60, cwd=REPO, env=python_env())
        assert result.returncode != 0 and message in result.stderr, result.stderr


# ----------------------------------------------------------------------------------------------
# dense retrieval (optional packages)


def test_dense_without_its_packages_names_them(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "faiss", None)  # as if not installed
    with pytest.raises(ImportError, match=r"pip install sentence-transformers faiss-cpu"):
        open_index(SAMPLE_CORPUS, "dense", index_dir=str(tmp_path), encoder=str(tmp_path))
    with pytest.raises(ValueError, match="needs an encoder"):
        open_index(SAMPLE_CORPUS, "dense")


def test_dense_retrieval_with_a_tiny_local_encoder(tmp_path, tiny_model_dir, caplog):
    """Only where sentence-transformers and faiss are installed. The encoder is rl2's random-init
    tiny model with mean pooling, built here (nothing downloaded): its rankings mean nothing, but
    a query equal to a document's text has cosine 1 with it."""
    pytest.importorskip("faiss")
    models = pytest.importorskip("sentence_transformers.models")
    from sentence_transformers import SentenceTransformer

    word = models.Transformer(tiny_model_dir)
    encoder = str(tmp_path / "encoder")
    SentenceTransformer(modules=[word, models.Pooling(word.auto_model.config.hidden_size, "mean")], device="cpu").save(encoder)
    corpus = tmp_path / "corpus.jsonl"
    with open(SAMPLE_CORPUS) as f:
        documents = [json.loads(line) for line in f][:40]
    corpus.write_text("".join(json.dumps(doc) + "\n" for doc in documents))

    caplog.set_level("INFO", logger="rl2.tools.dense_index")
    index = open_index(str(corpus), "dense", encoder=encoder)
    hits = index.search([documents[7]["contents"], documents[30]["contents"]], topk=5)
    index.close()
    for hits_of_query, expected in zip(hits, (documents[7], documents[30])):
        assert hits_of_query[0][0] == expected and hits_of_query[0][1] == pytest.approx(1.0, abs=1e-4)
        scores = [score for _, score in hits_of_query]
        assert len(scores) == 5 and scores == sorted(scores, reverse=True)
    reloaded = open_index(str(corpus), "dense", encoder=encoder)
    (again,) = reloaded.search([documents[7]["contents"]], topk=5)  # alone, not in a batch of 2: scores may
    assert [doc for doc, _ in again] == [doc for doc, _ in hits[0]]  # differ in the last bits
    assert [score for _, score in again] == pytest.approx([score for _, score in hits[0]], abs=1e-4)
    reloaded.close()
    assert "built dense index of 40 documents" in caplog.text and "loaded dense index of 40 documents" in caplog.text

    with running(str(corpus), "--retriever", "dense", "--encoder", encoder) as server:
        status, body = retrieve(server.url, {"queries": [documents[3]["contents"]], "topk": 2, "return_scores": True})
    assert status == 200 and body["result"][0][0]["document"] == documents[3]
    assert "loaded dense index of 40 documents" in server.log()
