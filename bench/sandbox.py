"""Code execution throughput and latency: the local sandbox (`Sandbox.run`) and the code service
(`rl2.tools.code_server` through `CodeClient`) against a plain `subprocess.run([python, "-c", code])`
baseline with no isolation at all, in the same run.

Two programs: `print(1+1)` (trivial) and a small CPU one (a sum of 20k squares, ~2 ms). Each method
runs `--runs` programs from `--clients` concurrent callers; the figures are programs per second
(wall) and p50 / p95 latency per call, and p50 of single calls on an idle executor.
Target on the 2-core box: at least 210 small programs/s with full isolation, p50 <= 20 ms for
`print(1+1)`.

    python bench/sandbox.py [--runs 600 --workers 2 --clients 4 --isolation auto|bwrap|uid|none --no-service]
"""

import argparse
import asyncio
import os
import socket
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

from rl2.tools.sandbox import Sandbox

PROGRAMS = {"trivial": "print(1+1)", "small": "print(sum(i * i for i in range(20000)))"}


def measure(call: Callable[[str], str], code: str, runs: int, clients: int) -> dict:
    """Run `code` `runs` times from `clients` threads; check every output."""
    expected = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout

    def timed(_) -> float:
        start = time.perf_counter()
        assert call(code) == expected
        return time.perf_counter() - start

    with ThreadPoolExecutor(clients) as pool:
        list(pool.map(timed, range(clients)))  # warm-up
        start = time.perf_counter()
        latencies = sorted(pool.map(timed, range(runs)))
        wall = time.perf_counter() - start
    idle = sorted(timed(i) for i in range(min(runs, 100)))
    return {
        "per_s": runs / wall,
        "p50_ms": 1000 * statistics.median(latencies),
        "p95_ms": 1000 * latencies[int(0.95 * (len(latencies) - 1))],
        "idle_p50_ms": 1000 * statistics.median(idle),
    }


def subprocess_call(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True).stdout


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_code_server(workers: int) -> tuple[subprocess.Popen, str]:
    port = free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "rl2.tools.code_server", "--host", "127.0.0.1", "--port", str(port),
         "--workers", str(workers)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
            return server, url
        except OSError:
            time.sleep(0.1)
    server.kill()
    raise RuntimeError("the code server did not start")


def service_caller(url: str, clients: int) -> tuple[Callable[[str], str], Callable[[], None]]:
    """A blocking call into the service through `CodeClient`, one event loop per client thread."""
    from rl2.tools.code_client import CodeClient

    loops: dict[int, asyncio.AbstractEventLoop] = {}

    def call(code: str) -> str:
        import threading

        loop = loops.setdefault(threading.get_ident(), asyncio.new_event_loop())
        result = loop.run_until_complete(CodeClient(url, concurrency=1).run(code))
        return result["stdout"]

    def close() -> None:
        for loop in loops.values():
            loop.close()

    return call, close


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=600)
    parser.add_argument("--workers", type=int, default=2, help="sandbox workers (and code-service workers)")
    parser.add_argument("--clients", type=int, default=4, help="concurrent callers")
    parser.add_argument("--no-service", action="store_true", help="skip the HTTP code service")
    parser.add_argument("--isolation", default="auto", choices=["auto", "bwrap", "uid", "none"],
                        help="the sandbox's isolation (the service always uses auto)")
    args = parser.parse_args()

    rows = []
    for name, code in PROGRAMS.items():
        rows.append(("subprocess.run, no isolation", name, measure(subprocess_call, code, args.runs, args.clients)))
    with Sandbox(workers=args.workers, isolation=args.isolation) as box:
        isolation = box.isolation
        for name, code in PROGRAMS.items():
            rows.append(("Sandbox.run", name, measure(lambda c: box.run(c).stdout, code, args.runs, args.clients)))
    if not args.no_service:
        server, url = start_code_server(args.workers)
        call, close = service_caller(url, args.clients)
        try:
            for name, code in PROGRAMS.items():
                rows.append(("code service (HTTP)", name, measure(call, code, args.runs, args.clients)))
        finally:
            close()
            server.terminate()
            server.wait()

    print(f"{os.cpu_count()} cores, {args.workers} sandbox workers, {args.clients} concurrent callers, "
          f"{args.runs} runs each; isolation: {isolation}")
    print(f"{'method':32s} {'program':8s} {'programs/s':>11s} {'p50 ms':>8s} {'p95 ms':>8s} {'idle p50 ms':>12s}")
    baseline = {name: figures["per_s"] for method, name, figures in rows if method.startswith("subprocess")}
    for method, name, f in rows:
        print(f"{method:32s} {name:8s} {f['per_s']:11.0f} {f['p50_ms']:8.1f} {f['p95_ms']:8.1f} {f['idle_p50_ms']:12.1f}"
              f"   {f['per_s'] / baseline[name]:.1f}x baseline")


if __name__ == "__main__":
    main()
