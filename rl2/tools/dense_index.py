"""Dense retrieval: sentence-transformers embeddings in an exact (flat, inner product) faiss index.

Optional: needs `pip install sentence-transformers faiss-cpu` (or faiss-gpu) and a local
sentence-transformers model folder; imported only when `open_index(..., retriever="dense")` asks
for it. Embeddings are L2-normalised, so scores are cosine similarities. The index is saved like
the BM25 one (`<corpus>.dense/`), and rebuilt when the corpus or the encoder path changes.
Encoders that expect instruction prefixes (e.g. e5's "query: " / "passage: ") get the plain texts.
"""

import logging
import os
import time

import numpy as np

from rl2.tools.retrieval_index import (
    INDEX_FORMAT,
    OFFSETS_FILE,
    Corpus,
    CorpusError,
    Hit,
    corpus_stamp,
    read_fresh_meta,
    save_atomically,
    write_meta,
)

logger = logging.getLogger(__name__)

FAISS_FILE = "flat_ip.faiss"
BATCH_SIZE = 64  # texts per encoder forward pass


def _import_dense():
    """(faiss, SentenceTransformer), or an ImportError naming the pip packages to install."""
    try:
        import faiss
        from sentence_transformers import SentenceTransformer
    except ImportError as e:
        raise ImportError(f"dense retrieval needs the sentence-transformers and faiss packages "
                          f"(pip install sentence-transformers faiss-cpu): {e}") from e
    return faiss, SentenceTransformer


class DenseIndex:
    """Exact cosine-similarity search over sentence-transformers embeddings of each document."""

    kind = "dense"

    def __init__(self, corpus: Corpus, encoder, faiss_index):
        self.corpus = corpus
        self.encoder = encoder
        self.faiss_index = faiss_index

    @classmethod
    def open(cls, corpus_path: str, encoder_path: str, index_dir: str | None = None) -> "DenseIndex":
        """Load the embeddings saved for `corpus_path` and this encoder if up to date, else embed
        the corpus (slow on CPU for large corpora) and save them."""
        faiss, SentenceTransformer = _import_dense()
        corpus_path = os.path.abspath(os.path.expanduser(corpus_path))
        encoder_path = os.path.abspath(os.path.expanduser(encoder_path))
        index_dir = os.path.abspath(os.path.expanduser(index_dir or corpus_path + ".dense"))
        if not os.path.isfile(corpus_path):
            raise CorpusError(f"corpus not found: {corpus_path}")
        if not os.path.isdir(encoder_path):
            raise FileNotFoundError(f"encoder not found: {encoder_path} (expected a local sentence-transformers model folder)")
        encoder = SentenceTransformer(encoder_path)
        expect = {"format": INDEX_FORMAT, "kind": "dense", "encoder": encoder_path}

        start = time.perf_counter()
        meta, why = read_fresh_meta(index_dir, corpus_path, expect)
        if meta is not None:
            faiss_index = faiss.read_index(os.path.join(index_dir, FAISS_FILE))
            corpus = Corpus(corpus_path, np.load(os.path.join(index_dir, OFFSETS_FILE)))
            logger.info("loaded dense index of %d documents from %s in %.2fs", len(corpus), index_dir,
                        time.perf_counter() - start)
            return cls(corpus, encoder, faiss_index)

        logger.info("building dense index for %s with %s (%s)", corpus_path, encoder_path, why)
        stamp = corpus_stamp(corpus_path)
        corpus, texts = Corpus.scan(corpus_path)
        embeddings = _embed(encoder, texts)
        faiss_index = faiss.IndexFlatIP(embeddings.shape[1])
        faiss_index.add(embeddings)
        built = time.perf_counter()

        def write(directory: str) -> None:
            faiss.write_index(faiss_index, os.path.join(directory, FAISS_FILE))
            np.save(os.path.join(directory, OFFSETS_FILE), corpus.offsets)
            write_meta(directory, {**expect, **stamp, "corpus": corpus_path, "n_docs": len(corpus),
                                   "dim": int(embeddings.shape[1])})

        saved = save_atomically(index_dir, write)
        logger.info("built dense index of %d documents in %.2fs%s", len(corpus), built - start,
                    f" (saved to {index_dir})" if saved else " (not saved)")
        return cls(corpus, encoder, faiss_index)

    def __len__(self) -> int:
        return len(self.corpus)

    def search(self, queries: list[str], topk: int) -> list[list[Hit]]:
        """The `topk` most similar documents for each query, as (document, cosine) pairs, best first."""
        if topk < 1:
            raise ValueError(f"topk must be at least 1, got {topk}")
        if not queries:
            return []
        scores, indices = self.faiss_index.search(_embed(self.encoder, queries), min(topk, len(self.corpus)))
        return [
            [(self.corpus[int(i)], float(s)) for i, s in zip(row_indices, row_scores) if i >= 0]
            for row_indices, row_scores in zip(indices, scores)
        ]

    def close(self) -> None:
        self.corpus.close()


def _embed(encoder, texts: list[str]) -> np.ndarray:
    embeddings = encoder.encode(texts, batch_size=BATCH_SIZE, normalize_embeddings=True, convert_to_numpy=True,
                                show_progress_bar=False)
    return np.ascontiguousarray(embeddings, dtype=np.float32)
