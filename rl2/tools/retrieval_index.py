"""Search over a JSON lines corpus: BM25 (with `bm25s`) by default, dense embeddings optionally.

The corpus has one document per line, `{"id": str, "contents": "title\\ntext", ...}` (Search-R1's
format; other fields are kept and returned). The index is built once and saved next to the corpus
(`<corpus>.bm25/`, or `index_dir`); a later start loads it instead, unless the corpus changed since
(its size or modification time differs from what the index recorded), in which case it is rebuilt.

    index = open_index("corpus.jsonl")
    index.search(["capital of france"], topk=3)   # [[(doc, score), ...]] best first

Documents are read back from the corpus file by byte offset, so memory holds the index and the
offsets, not the texts; the corpus file must not be rewritten while an index is open.
"""

import json
import logging
import os
import shutil
import time
from typing import Protocol

import bm25s
import numpy as np

logger = logging.getLogger(__name__)

INDEX_FORMAT = 1  # bump when the saved layout changes: older saved indexes are then rebuilt
STOPWORDS = "en"  # bm25s' English stopword list, for documents and queries alike
META_FILE = "meta.json"  # written last: its presence marks a complete index
OFFSETS_FILE = "offsets.npy"

Hit = tuple[dict, float]


class CorpusError(ValueError):
    """An unreadable or malformed corpus; the message names the file and, where it can, the line."""


class SearchIndex(Protocol):
    """What the retrieval server needs from an index."""

    kind: str  # "bm25" or "dense"

    def __len__(self) -> int: ...

    def search(self, queries: list[str], topk: int) -> list[list[Hit]]: ...

    def close(self) -> None: ...


# ----------------------------------------------------------------------------------------------
# corpus


class Corpus:
    """A JSON lines corpus read by byte offset: `corpus[i]` parses line i's document on demand."""

    def __init__(self, path: str, offsets: np.ndarray):
        self.path = path
        self.offsets = offsets  # (n, 2) int64: start and end byte of each document's line
        self._fd = os.open(path, os.O_RDONLY)

    @classmethod
    def scan(cls, path: str) -> tuple["Corpus", list[str]]:
        """Read and check every line; the corpus and each document's `contents`, in file order."""
        offsets, texts = [], []
        position = 0
        with _open_corpus(path) as f:
            for lineno, line in enumerate(f, 1):
                start, position = position, position + len(line)
                if not line.strip():
                    continue
                texts.append(_contents(_parse(line, path, lineno), path, lineno))
                offsets.append((start, position))
        if not texts:
            raise CorpusError(f"{path}: no documents (the file is empty)")
        return cls(path, np.asarray(offsets, dtype=np.int64)), texts

    def __len__(self) -> int:
        return len(self.offsets)

    def __getitem__(self, i: int) -> dict:
        start, end = (int(x) for x in self.offsets[i])
        return json.loads(os.pread(self._fd, end - start, start))

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def _open_corpus(path: str):
    try:
        return open(path, "rb")
    except OSError as e:
        raise CorpusError(f"corpus {path}: cannot be read: {e.strerror or e}") from None


def _parse(line: bytes, path: str, lineno: int) -> dict:
    try:
        row = json.loads(line)
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorpusError(f"{path}, line {lineno}: malformed JSON: {e}") from None
    if not isinstance(row, dict):
        raise CorpusError(f"{path}, line {lineno}: expected a JSON object, got {type(row).__name__}")
    return row


def _contents(row: dict, path: str, lineno: int) -> str:
    if "contents" not in row:
        raise CorpusError(f"{path}, line {lineno}: no 'contents' field (expected {{\"id\": ..., \"contents\": \"title\\ntext\"}})")
    if not isinstance(row["contents"], str):
        raise CorpusError(f"{path}, line {lineno}: 'contents' is {type(row['contents']).__name__}, expected a string")
    if not isinstance(row.get("id"), (str, int)) or isinstance(row.get("id"), bool):
        raise CorpusError(f"{path}, line {lineno}: 'id' is missing or not a string (or integer)")
    return row["contents"]


# ----------------------------------------------------------------------------------------------
# saved indexes


def corpus_stamp(path: str) -> dict:
    """What identifies a corpus version: its size and modification time."""
    stat = os.stat(path)
    return {"corpus_bytes": stat.st_size, "corpus_mtime_ns": stat.st_mtime_ns}


def read_fresh_meta(index_dir: str, corpus_path: str, expect: dict) -> tuple[dict | None, str]:
    """The saved index's metadata if it is complete and matches the corpus and `expect`, else
    (None, why not)."""
    meta_path = os.path.join(index_dir, META_FILE)
    if not os.path.isfile(meta_path):
        return None, "no saved index"
    try:
        with open(meta_path) as f:
            meta = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        return None, f"unreadable {meta_path} ({e})"
    if {key: meta.get(key) for key in corpus_stamp(corpus_path)} != corpus_stamp(corpus_path):
        return None, "the corpus changed since the index was built"
    for key, value in expect.items():
        if meta.get(key) != value:
            return None, f"the saved index has {key}={meta.get(key)!r}, this run needs {value!r}"
    return meta, ""


def save_atomically(index_dir: str, write) -> bool:
    """Call `write(tmp_dir)` and move the result to `index_dir` (replacing an old one), so a
    crash or a concurrent start never leaves a half-written index. False (with a warning) when
    that fails: the index then lives only in memory."""
    tmp_dir = f"{index_dir.rstrip(os.sep)}.tmp-{os.getpid()}"
    try:
        shutil.rmtree(tmp_dir, ignore_errors=True)
        os.makedirs(tmp_dir)
        write(tmp_dir)
        shutil.rmtree(index_dir, ignore_errors=True)
        os.rename(tmp_dir, index_dir)
        return True
    except OSError as e:  # e.g. a read-only folder, or another process moving its index in first
        shutil.rmtree(tmp_dir, ignore_errors=True)
        logger.warning("could not save the index to %s (%s); it is kept in memory only (use index_dir= / "
                       "--index-dir to choose a writable place)", index_dir, e)
        return False


def write_meta(directory: str, meta: dict) -> None:
    with open(os.path.join(directory, META_FILE), "w") as f:
        json.dump(meta, f, indent=1)


# ----------------------------------------------------------------------------------------------
# BM25


class BM25Index:
    """BM25 (bm25s, Lucene variant, English stopwords, no stemming) over a corpus.

    Use `BM25Index.open(corpus_path)` to build or load; `search` returns documents with a score
    above zero (a query sharing no word with the corpus gets no results), best first.
    """

    kind = "bm25"

    def __init__(self, corpus: Corpus, retriever):
        self.corpus = corpus
        self.retriever = retriever

    @classmethod
    def open(cls, corpus_path: str, index_dir: str | None = None) -> "BM25Index":
        """Load the index saved for `corpus_path` if it is up to date, else build (and save) it."""
        corpus_path = os.path.abspath(os.path.expanduser(corpus_path))
        index_dir = os.path.abspath(os.path.expanduser(index_dir or corpus_path + ".bm25"))
        if not os.path.isfile(corpus_path):
            raise CorpusError(f"corpus not found: {corpus_path}")
        expect = {"format": INDEX_FORMAT, "kind": "bm25", "stopwords": STOPWORDS}

        start = time.perf_counter()
        meta, why = read_fresh_meta(index_dir, corpus_path, expect)
        if meta is not None:
            retriever = bm25s.BM25.load(index_dir, show_progress=False)
            corpus = Corpus(corpus_path, np.load(os.path.join(index_dir, OFFSETS_FILE)))
            logger.info("loaded BM25 index of %d documents from %s in %.2fs", len(corpus), index_dir,
                        time.perf_counter() - start)
            return cls(corpus, retriever)

        logger.info("building BM25 index for %s (%s)", corpus_path, why)
        stamp = corpus_stamp(corpus_path)
        corpus, texts = Corpus.scan(corpus_path)
        scanned = time.perf_counter()
        tokenizer = bm25s.tokenization.Tokenizer(stopwords=STOPWORDS)
        token_ids = tokenizer.tokenize(texts, return_as="ids", show_progress=False)
        del texts
        retriever = bm25s.BM25()
        retriever.index((token_ids, tokenizer.get_vocab_dict()), show_progress=False)
        built = time.perf_counter()

        def write(directory: str) -> None:
            retriever.save(directory, show_progress=False)
            np.save(os.path.join(directory, OFFSETS_FILE), corpus.offsets)
            write_meta(directory, {**expect, **stamp, "corpus": corpus_path, "n_docs": len(corpus),
                                   "bm25s_version": bm25s.__version__})

        saved = save_atomically(index_dir, write)
        logger.info("built BM25 index of %d documents in %.2fs (read %.2fs, index %.2fs%s)", len(corpus),
                    time.perf_counter() - start, scanned - start, built - scanned,
                    f", save {time.perf_counter() - built:.2f}s to {index_dir}" if saved else ", not saved")
        return cls(corpus, retriever)

    def __len__(self) -> int:
        return len(self.corpus)

    def search(self, queries: list[str], topk: int) -> list[list[Hit]]:
        """The `topk` best documents for each query, as (document, score) pairs, best first."""
        if topk < 1:
            raise ValueError(f"topk must be at least 1, got {topk}")
        if not queries:
            return []
        k = min(topk, len(self.corpus))
        tokens = bm25s.tokenize(queries, stopwords=STOPWORDS, return_ids=False, show_progress=False)
        indices, scores = self.retriever.retrieve(tokens, k=k, show_progress=False)
        return [
            [(self.corpus[int(i)], float(s)) for i, s in zip(row_indices, row_scores) if s > 0]
            for row_indices, row_scores in zip(indices, scores)
        ]

    def close(self) -> None:
        self.corpus.close()


# ----------------------------------------------------------------------------------------------


def open_index(corpus_path: str, retriever: str = "bm25", index_dir: str | None = None,
               encoder: str | None = None) -> SearchIndex:
    """Build or load the index of `corpus_path`: "bm25" (default) or "dense" (needs `encoder`, a
    local sentence-transformers model folder, and the sentence-transformers and faiss packages)."""
    if retriever == "bm25":
        if encoder is not None:
            raise ValueError("an encoder is only used with retriever='dense'")
        return BM25Index.open(corpus_path, index_dir)
    if retriever == "dense":
        from rl2.tools.dense_index import DenseIndex

        if not encoder:
            raise ValueError("retriever='dense' needs an encoder: the path of a local sentence-transformers model")
        return DenseIndex.open(corpus_path, encoder, index_dir)
    raise ValueError(f"unknown retriever {retriever!r}; expected 'bm25' or 'dense'")
