"""The retrieval index (`rl2.tools.retrieval_index`) and server (`rl2.tools.retrieval_server`):
a real server process on the sample corpus, Search-R1's API shapes, 400s for bad requests, the
saved index reused on restart and rebuilt when the corpus changes, malformed corpora."""

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
    assert set(hits[0]["document"]) == {"id", "contents"} and isinstance(hits[0]["document"]["id"], str)


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


@pytest.mark.parametrize("body,needle", [
    ("not json", "not JSON"),
    ("", "not JSON"),
    ([1, 2], "expected a JSON object"),
    ({"topk": 3}, "'queries' must be a list of strings (missing)"),
    ({"queries": "capital"}, "'queries' must be a list of strings, got str"),
    ({"queries": ["ok", 3]}, "'queries' item 1 is int"),
    ({"queries": ["a"], "topk": 0}, "'topk' must be an integer from 1 to 100, got 0"),
    ({"queries": ["a"], "topk": -2}, "got -2"),
    ({"queries": ["a"], "topk": "3"}, 'got "3"'),
    ({"queries": ["a"], "topk": 2.5}, "got 2.5"),
    ({"queries": ["a"], "topk": True}, "got true"),
    ({"queries": ["a"], "topk": 101}, "got 101"),
    ({"queries": ["a"] * (MAX_QUERIES + 1)}, f"too many queries: {MAX_QUERIES + 1} (at most {MAX_QUERIES} per request)"),
    ({"queries": ["a"], "return_scores": "yes"}, "'return_scores' must be true or false"),
])
def test_bad_requests_get_400_with_a_message(server, body, needle):
    status, answer = retrieve(server.url, body)
    assert status == 400
    assert needle in answer["error"], answer


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
    assert bad[0] == 500 and "disk on fire" in bad[1]["error"]
    assert good == (200, {"result": [[{"document": {"id": "0", "contents": "T\nx"}, "score": 1.0}]]})
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
    assert body["result"][0][0]["document"] == {"id": "new", "contents": "Zorblax\nZorblax is a made-up word."}


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
                          (["--topk", "0"], "1 <= --topk <= --max-topk, got 1024, 0, 100")]:
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
