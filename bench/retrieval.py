"""BM25 retrieval throughput: index build and load time, queries/s in-process and through the
HTTP service.

    python bench/retrieval.py [--docs 100000 --batch 64 --batches 30 --topk 3]

Writes `--docs` synthetic passages (a title and 40-120 words drawn from a Zipf-distributed
vocabulary of 50,000 made-up words, about the length of Search-R1's 100-word Wikipedia passages)
to a temp dir, then reports:
  build    BM25Index.open on a fresh corpus: read + check the JSONL, tokenise, index, save
  load     BM25Index.open again: the saved index is loaded
  search   in-process `search` on batches of `--batch` queries (3-6 words taken from a random
           passage, so every query has matches), topk `--topk`
  http     the same batches POSTed to `python -m rl2.tools.retrieval_server` (a real process on
           127.0.0.1) one request at a time, then with 4 requests in flight
Seeds are fixed, so the corpus and queries are the same on every run.
"""

import argparse
import asyncio
import json
import logging
import os
import re
import statistics
import subprocess
import sys
import tempfile
import threading
import time

import aiohttp
import numpy as np

from rl2.tools.retrieval_index import BM25Index

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
VOCABULARY = 50_000


def make_words(rng: np.random.Generator) -> np.ndarray:
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz"))
    lengths = rng.integers(3, 10, VOCABULARY)
    return np.array(["".join(rng.choice(letters, n)) for n in lengths])


def write_corpus(path: str, n_docs: int, seed: int) -> list[list[str]]:
    """Write the corpus; returns each passage's words (for making queries)."""
    rng = np.random.default_rng(seed)
    words = make_words(rng)
    passages = []
    with open(path, "w") as f:
        for i in range(n_docs):
            ids = np.minimum(rng.zipf(1.2, rng.integers(40, 121)), VOCABULARY) - 1
            text = words[ids].tolist()
            title = " ".join(words[rng.integers(0, VOCABULARY, 2)]).title()
            passages.append(text)
            f.write(json.dumps({"id": str(i), "contents": f"{title}\n{' '.join(text)}"}) + "\n")
    return passages


def make_batches(passages: list[list[str]], n_batches: int, batch: int, seed: int) -> list[list[str]]:
    rng = np.random.default_rng(seed + 1)
    batches = []
    for _ in range(n_batches):
        queries = []
        for _ in range(batch):
            text = passages[rng.integers(len(passages))]
            queries.append(" ".join(rng.choice(text, rng.integers(3, 7), replace=False)))
        batches.append(queries)
    return batches


def start_server(corpus: str) -> tuple[subprocess.Popen, str, list[str]]:
    command = [sys.executable, "-m", "rl2.tools.retrieval_server", "--corpus", corpus, "--port", "0", "--max-queries", "4096"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=REPO,
                               env={**os.environ, "PYTHONPATH": REPO})
    lines: list[str] = []
    ready = threading.Event()

    def read() -> None:
        for line in process.stdout:
            lines.append(line)
            if "ready on" in line:
                ready.set()
        ready.set()

    threading.Thread(target=read, daemon=True).start()
    ready.wait(600)
    match = re.search(r"ready on (http://\S+)", "".join(lines))
    if not match:
        process.kill()
        raise RuntimeError("retrieval server did not start:\n" + "".join(lines))
    return process, match.group(1), lines


async def http_qps(url: str, batches: list[list[str]], topk: int, in_flight: int) -> float:
    async with aiohttp.ClientSession() as session:
        async def post(queries: list[str]) -> None:
            async with session.post(url, json={"queries": queries, "topk": topk, "return_scores": True}) as response:
                body = await response.json()
                assert response.status == 200 and len(body["result"]) == len(queries), body

        await post(batches[0])  # warm-up: connection, first search
        semaphore = asyncio.Semaphore(in_flight)

        async def limited(queries: list[str]) -> None:
            async with semaphore:
                await post(queries)

        start = time.perf_counter()
        await asyncio.gather(*(limited(queries) for queries in batches))
        return sum(len(b) for b in batches) / (time.perf_counter() - start)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--docs", type=int, default=100_000)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--batches", type=int, default=30)
    parser.add_argument("--topk", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    logging.getLogger("bm25s").setLevel(logging.WARNING)  # bm25s sets its own logger to DEBUG

    with tempfile.TemporaryDirectory() as tmp:
        corpus = os.path.join(tmp, "corpus.jsonl")
        start = time.perf_counter()
        passages = write_corpus(corpus, args.docs, args.seed)
        batches = make_batches(passages, args.batches, args.batch, args.seed)
        n_words = sum(len(p) for p in passages)
        del passages
        print(f"corpus: {args.docs:,} passages, {n_words / args.docs:.0f} words each on average, "
              f"{os.path.getsize(corpus) / 2**20:.1f} MiB (written in {time.perf_counter() - start:.1f}s); "
              f"{os.cpu_count()} CPUs")

        start = time.perf_counter()
        index = BM25Index.open(corpus)
        build_s = time.perf_counter() - start
        index.close()
        index_dir = corpus + ".bm25"
        index_mib = sum(os.path.getsize(os.path.join(index_dir, name)) for name in os.listdir(index_dir)) / 2**20
        start = time.perf_counter()
        index = BM25Index.open(corpus)
        load_s = time.perf_counter() - start

        index.search(batches[0], args.topk)  # warm-up
        times = []
        for queries in batches:
            start = time.perf_counter()
            results = index.search(queries, args.topk)
            times.append(time.perf_counter() - start)
            assert len(results) == len(queries) and all(results)
        index.close()
        search_qps = args.batch / statistics.median(times)

        process, url, lines = start_server(corpus)
        try:
            assert any("loaded BM25 index" in line for line in lines), "".join(lines)
            http_1 = asyncio.run(http_qps(f"{url}/retrieve", batches, args.topk, in_flight=1))
            http_4 = asyncio.run(http_qps(f"{url}/retrieve", batches, args.topk, in_flight=4))
        finally:
            process.terminate()
            process.wait(30)

    print(f"{'step':<34} {'figure':>12}")
    print(f"{'build index (read, tokenise, save)':<34} {build_s:10.2f} s   ({index_mib:.1f} MiB on disk)")
    print(f"{'load saved index':<34} {load_s:10.2f} s")
    print(f"{'search in-process, batch ' + str(args.batch):<34} {search_qps:10.0f} q/s ({1000 * statistics.median(times):.1f} ms per batch)")
    print(f"{'HTTP, batch ' + str(args.batch) + ', 1 in flight':<34} {http_1:10.0f} q/s")
    print(f"{'HTTP, batch ' + str(args.batch) + ', 4 in flight':<34} {http_4:10.0f} q/s")
    print(json.dumps({"docs": args.docs, "batch": args.batch, "topk": args.topk, "build_s": round(build_s, 2),
                      "load_s": round(load_s, 2), "index_mib": round(index_mib, 1), "search_qps": round(search_qps),
                      "http_qps_1": round(http_1), "http_qps_4": round(http_4)}))


if __name__ == "__main__":
    main()
