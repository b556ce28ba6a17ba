"""A code-judge-compatible HTTP service that runs Python and C++ in the local sandbox.

    python -m rl2.tools.code_server --host 127.0.0.1 --port 8000 --workers 8 --timeout 10 --memory-mb 512

It speaks the API of code-judge (github.com/0xWJ/code-judge, `app/main.py`, `app/model.py`), so a
client written for one works against the other (code-judge's own test suite passes against it):

- `POST /run` with a submission `{"type": "python" | "cpp", "solution": CODE, "input": STDIN,
  "expected_output": null, "sub_id": null}` answers a result `{"sub_id", "success", "run_success",
  "cost", "stdout", "stderr", "reason"}`. `run_success`: the program exited 0 within its limits (a
  long output is cut to `--output-limit` characters, 1,000 as in code-judge, and is not a failure);
  `success`: `run_success` and, when `expected_output` is given, stdout matches it (stripped,
  compared before the cut); `cost`: seconds; `reason`: "" (it ran: passed or failed),
  "worker_timeout" (killed at the time limit; stdout ends with code-judge's "Suicide from
  timeout."), "queue_timeout" (no worker free in time), "internal_error" (the sandbox failed, or
  the type cannot run here: "math", or "cpp" without g++). On the last two stdout is null and
  stderr says why.
- `POST /run/batch` and `POST /run/long-batch` with `{"type": "batch", "submissions": [...]}`
  answer `{"sub_id", "results": [...]}` in submission order. As in code-judge, `/run` and
  `/run/batch` give up on a submission that waits longer than `--queue-timeout` seconds for a
  free worker (reason "queue_timeout"; clients resubmit it); `/run/long-batch` waits as long as it
  takes. `/judge`, `/judge/batch`, `/judge/long-batch` answer the same without stdout/stderr.
- `GET /ping` answers "pong"; `GET /status` answers `{"queue": waiting, "num_workers": N}`.

A malformed request gets HTTP 422 with FastAPI's error shape, `{"detail": [{"type", "loc", "msg"}]}`,
naming the field; unknown paths 404, wrong methods 405, bodies over `--max-request-mb` 413, all as
JSON `{"detail": ...}`. docs/reference/services.md ("The code service") lists where rl2 differs from code-judge, and why.
"""

import argparse
import asyncio
import json
import logging
import os
import signal
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from aiohttp import web

from rl2.tools.api_key import api_key_from, require_api_key
from rl2.tools.code_client import not_run_result
from rl2.tools.http_errors import BadRequest, json_errors
from rl2.tools.sandbox import Sandbox, SandboxError

logger = logging.getLogger("rl2.tools.code_server")

CODE_JUDGE_TYPES = ("python", "cpp", "math")  # what code-judge's Submission.type accepts
QUEUE_TIMEOUT = 4.0  # code-judge's MAX_QUEUE_WORK_LIFE_TIME default
OUTPUT_LIMIT = 1000  # characters of stdout and of stderr in a result: code-judge's MAX_STDOUT_ERROR_LENGTH
COMPARED_OUTPUT = 1 << 20  # characters of stdout kept for comparing with expected_output before the cut
TIMEOUT_LINE = "Suicide from timeout.\n"  # what code-judge's timed-out programs print last
# sandbox reason -> code-judge's ("" is a program that ran, whether it passed or failed)
REASONS = {"timeout": "worker_timeout", "sandbox_error": "internal_error", "not_installed": "internal_error"}


@dataclass
class Submission:
    """One program to run (code-judge's `Submission`, validated)."""

    sub_id: str
    type: str
    solution: str
    input: str
    expected_output: str | None


# ----------------------------------------------------------------------------------------------
# requests and results


def _optional_str(body: dict, key: str, loc: tuple) -> str | None:
    value = body.get(key)
    if value is not None and not isinstance(value, str):
        raise BadRequest(loc + (key,), f"'{key}' must be a string or null, got {type(value).__name__}", "string_type")
    return value


def parse_submission(body: Any, loc: tuple = ("body",)) -> Submission:
    """A validated `Submission` from decoded JSON; raises `BadRequest` naming the problem."""
    if not isinstance(body, dict):
        raise BadRequest(loc, f"a submission must be a JSON object, got {type(body).__name__}", "model_attributes_type")
    if "type" not in body:
        raise BadRequest(loc + ("type",), "'type' is missing (this service runs type 'python')", "missing")
    kind = body["type"]
    if kind not in CODE_JUDGE_TYPES:
        raise BadRequest(loc + ("type",), f"unsupported type {kind!r}: code-judge's types are {CODE_JUDGE_TYPES}",
                         "literal_error")
    if "solution" not in body:
        raise BadRequest(loc + ("solution",), "'solution' (the program's source) is missing", "missing")
    if not isinstance(body["solution"], str):
        raise BadRequest(loc + ("solution",), f"'solution' must be a string, got {type(body['solution']).__name__}",
                         "string_type")
    options = body.get("options")
    if options is not None and not isinstance(options, dict):
        raise BadRequest(loc + ("options",), "'options' must be an object or null", "dict_type")
    return Submission(
        sub_id=_optional_str(body, "sub_id", loc) or str(uuid.uuid4()),
        type=kind,
        solution=body["solution"],
        input=_optional_str(body, "input", loc) or "",
        expected_output=_optional_str(body, "expected_output", loc),
    )


def parse_batch(body: Any) -> tuple[str, list[Submission]]:
    """(batch sub_id, submissions) from a decoded `BatchSubmission`; raises `BadRequest`."""
    loc = ("body",)
    if not isinstance(body, dict):
        raise BadRequest(loc, f"a batch must be a JSON object, got {type(body).__name__}", "model_attributes_type")
    if body.get("type", "batch") != "batch":
        raise BadRequest(loc + ("type",), f"a batch's type must be 'batch', got {body['type']!r} "
                         "(single submissions go to /run)", "literal_error")
    submissions = body.get("submissions")
    if not isinstance(submissions, list) or not submissions:
        problem = "is missing" if submissions is None else "must be a non-empty list"
        raise BadRequest(loc + ("submissions",), f"'submissions' {problem}", "missing" if submissions is None else "too_short")
    sub_id = _optional_str(body, "sub_id", loc) or str(uuid.uuid4())
    return sub_id, [parse_submission(item, loc + ("submissions", i)) for i, item in enumerate(submissions)]


def judge_result(sub: Submission, run: Any, output_limit: int = OUTPUT_LIMIT) -> dict:
    """code-judge's `SubmissionResult` for a sandbox `RunResult`: `run_success` is a zero exit within
    the limits (a long output is cut, not a failure); stdout is compared with `expected_output`
    before it is cut to `output_limit` characters; a timed-out program's stdout ends with
    code-judge's "Suicide from timeout." line."""
    if run.reason in ("sandbox_error", "not_installed"):
        return not_run_result(sub.sub_id, "internal_error", run.stderr, float(run.wall_time))
    run_success = run.reason == "ok" or (run.reason == "output_limit" and run.exit_code == 0)
    matches = sub.expected_output is None or run.stdout.strip() == sub.expected_output.strip()
    stdout = run.stdout + TIMEOUT_LINE if run.reason == "timeout" else run.stdout
    return {
        "sub_id": sub.sub_id,
        "success": run_success and matches,
        "run_success": run_success,
        "cost": float(run.wall_time),
        "stdout": stdout[:output_limit],
        "stderr": run.stderr[:output_limit],
        "reason": REASONS.get(run.reason, ""),
    }


# ----------------------------------------------------------------------------------------------
# execution


class CodeService:
    """Runs submissions on a sandbox with at most `workers` at once; the state behind one app."""

    def __init__(self, sandbox: Any, workers: int, queue_timeout: float, output_limit: int = OUTPUT_LIMIT):
        if workers < 1:
            raise ValueError(f"code service workers must be at least 1, got {workers}")
        self.sandbox, self.workers, self.queue_timeout = sandbox, workers, queue_timeout
        self.output_limit = output_limit
        self.languages = tuple(getattr(sandbox, "languages", ("python",)))
        self.waiting = 0  # submissions waiting for a worker
        self._slots = asyncio.Semaphore(workers)
        # Our own threads: the loop's default executor may have fewer than `workers`.
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="rl2-code-server")

    async def judge(self, sub: Submission, long_batch: bool) -> dict:
        """Run one submission; without `long_batch` give up if no worker frees within the queue timeout."""
        if sub.type not in self.languages:  # as code-judge answers a type it cannot run
            why = "g++ is not installed here" if sub.type == "cpp" else "this service runs no such programs"
            return not_run_result(sub.sub_id, "internal_error", f"type {sub.type!r} cannot run: {why}")
        start = time.monotonic()
        self.waiting += 1
        try:
            if long_batch:
                await self._slots.acquire()
            else:
                await asyncio.wait_for(self._slots.acquire(), self.queue_timeout)
        except asyncio.TimeoutError:
            return not_run_result(sub.sub_id, "queue_timeout",
                                  f"no worker free within {self.queue_timeout}s; resubmit, or use /run/long-batch",
                                  time.monotonic() - start)
        finally:
            self.waiting -= 1
        try:
            run = await asyncio.get_running_loop().run_in_executor(self._pool, self._run, sub)
        except Exception as error:
            logger.exception("sandbox failed on submission %s", sub.sub_id)
            return not_run_result(sub.sub_id, "internal_error", f"sandbox failed: {type(error).__name__}: {error}",
                                  time.monotonic() - start)
        finally:
            self._slots.release()
        return judge_result(sub, run, self.output_limit)

    def _run(self, sub: Submission) -> Any:
        if sub.type == "python":
            return self.sandbox.run(sub.solution, sub.input)
        return self.sandbox.run(sub.solution, sub.input, language=sub.type)

    async def judge_all(self, subs: list[Submission], long_batch: bool) -> list[dict]:
        """Results for `subs`, in order; they run concurrently."""
        return list(await asyncio.gather(*(self.judge(sub, long_batch) for sub in subs)))

    def status(self) -> dict:
        return {"queue": self.waiting, "num_workers": self.workers}

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


# ----------------------------------------------------------------------------------------------
# HTTP


SERVICE = web.AppKey("service", CodeService)
API_KEY_VARIABLE = "CODE_SERVER_API_KEY"


async def _read_json(request: web.Request) -> Any:
    raw = await request.read()  # raises HTTPRequestEntityTooLarge past client_max_size
    try:
        return json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise BadRequest(("body",), f"the request body is not valid JSON: {error}", "json_invalid") from None


def _handlers(with_output: bool) -> tuple:
    """The single and batch handlers; `with_output=False` drops stdout/stderr (the /judge routes)."""

    def shape(result: dict) -> dict:
        return result if with_output else {key: value for key, value in result.items() if key not in ("stdout", "stderr")}

    async def run_one(request: web.Request) -> web.Response:
        sub = parse_submission(await _read_json(request))
        result = await request.app[SERVICE].judge(sub, long_batch=False)
        return web.json_response(shape(result))

    def run_batch(long_batch: bool):
        async def handler(request: web.Request) -> web.Response:
            sub_id, subs = parse_batch(await _read_json(request))
            started = time.monotonic()
            results = await request.app[SERVICE].judge_all(subs, long_batch)
            logger.debug("batch %s: %d submissions in %.2fs", sub_id, len(subs), time.monotonic() - started)
            return web.json_response({"sub_id": sub_id, "results": [shape(result) for result in results]})
        return handler

    return run_one, run_batch(False), run_batch(True)


async def _ping(request: web.Request) -> web.Response:
    return web.json_response("pong")


async def _status(request: web.Request) -> web.Response:
    return web.json_response(request.app[SERVICE].status())


def make_app(sandbox: Any, workers: int | None = None, queue_timeout: float = QUEUE_TIMEOUT,
             max_request_mb: int = 64, output_limit: int = OUTPUT_LIMIT, api_key: str | None = None) -> web.Application:
    """The service's aiohttp app over `sandbox` (anything with `run(code, stdin) -> RunResult`, and
    `run(code, stdin, language=...)` for the `languages` it lists besides "python").

    `workers`: how many submissions run at once; give the sandbox's worker count (read from
    `sandbox.workers` when not given). `output_limit`: characters of stdout and stderr in a result.
    With `api_key` every request but `/ping` needs `Authorization: Bearer <api_key>` (else 401).
    The app does not close the sandbox: its owner does.
    """
    workers = workers or getattr(sandbox, "workers", None)
    if not workers:
        raise ValueError("make_app needs workers= (how many programs the sandbox runs at once)")
    service = CodeService(sandbox, int(workers), queue_timeout, output_limit)
    app = web.Application(middlewares=[require_api_key(api_key, ("/ping",)), json_errors],
                          client_max_size=max_request_mb * 1024 * 1024)
    app[SERVICE] = service
    run, run_batch, run_long_batch = _handlers(with_output=True)
    judge, judge_batch, judge_long_batch = _handlers(with_output=False)
    app.router.add_post("/run", run)
    app.router.add_post("/run/batch", run_batch)
    app.router.add_post("/run/long-batch", run_long_batch)
    app.router.add_post("/judge", judge)
    app.router.add_post("/judge/batch", judge_batch)
    app.router.add_post("/judge/long-batch", judge_long_batch)
    app.router.add_get("/ping", _ping)
    app.router.add_get("/status", _status)

    async def close_service(_: web.Application) -> None:
        service.close()

    app.on_cleanup.append(close_service)
    return app


async def serve(app: web.Application, host: str, port: int, description: str = "") -> None:
    """Serve `app` until SIGINT or SIGTERM, logging a ready line with the URL (port 0: any free port)."""
    runner = web.AppRunner(app, access_log=None, shutdown_timeout=5.0)
    await runner.setup()
    try:
        # SO_REUSEADDR (asyncio's default on Unix, made explicit): a service restarted after a crash binds
        # its port again at once, though connections of the one that died linger in TIME_WAIT.
        site = web.TCPSite(runner, host, port, reuse_address=True)
        await site.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        bound_host, bound_port = runner.addresses[0][:2]
        url_host = f"[{bound_host}]" if ":" in bound_host else bound_host
        logger.info("code service ready at http://%s:%d%s", url_host, bound_port, f" ({description})" if description else "")
        await stop.wait()
        logger.info("code service stopping")
    finally:
        await runner.cleanup()


# ----------------------------------------------------------------------------------------------
# command line


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m rl2.tools.code_server", description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    parser.add_argument("--port", type=int, default=8000, help="port (0: any free port; the ready line says which)")
    parser.add_argument("--workers", type=int, default=os.cpu_count() or 1,
                        help="programs run at once (default: the number of CPUs)")
    parser.add_argument("--timeout", type=float, default=10.0, help="seconds a program may run (default 10)")
    parser.add_argument("--memory-mb", type=int, default=512, help="address-space limit of a program (default 512)")
    parser.add_argument("--output-limit", type=int, default=OUTPUT_LIMIT,
                        help=f"characters of stdout and of stderr in a result (default {OUTPUT_LIMIT}, as code-judge); "
                             f"stdout is compared with expected_output before the cut")
    parser.add_argument("--isolation", default="auto", choices=("auto", "bwrap", "uid", "none"),
                        help="sandbox isolation (default auto: bubblewrap, refused without it; uid or none "
                             "accept a weaker isolation explicitly)")
    parser.add_argument("--queue-timeout", type=float, default=QUEUE_TIMEOUT,
                        help=f"seconds /run and /run/batch let a submission wait for a worker (default {QUEUE_TIMEOUT})")
    parser.add_argument("--max-request-mb", type=int, default=64, help="largest request body accepted (default 64)")
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO; DEBUG logs every batch)")
    parser.add_argument("--api-key", default=None,
                        help=f"requests but /ping need 'Authorization: Bearer <key>' (default: ${API_KEY_VARIABLE}; "
                             "unset = open to whoever reaches the port)")
    return parser


def main(argv: list[str] | None = None) -> int:
    """Start the sandbox and serve until SIGINT/SIGTERM; the exit status."""
    args = _parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        sandbox = Sandbox(workers=args.workers, timeout=args.timeout, memory_mb=args.memory_mb,
                          output_limit=max(args.output_limit, COMPARED_OUTPUT), isolation=args.isolation)
    except (SandboxError, ValueError) as error:
        logger.error("cannot start the sandbox: %s", error)
        return 1
    with sandbox:
        api_key = api_key_from(args.api_key, API_KEY_VARIABLE)
        description = (f"{args.workers} workers, timeout {args.timeout:g}s, memory {args.memory_mb} MB, "
                       f"languages: {', '.join(sandbox.languages)}, isolation: {sandbox.isolation}, "
                       f"{'API key required' if api_key else 'no API key: open to whoever reaches the port'}")
        try:
            asyncio.run(serve(make_app(sandbox, args.workers, args.queue_timeout, args.max_request_mb, args.output_limit,
                                       api_key), args.host, args.port, description))
        except OSError as error:  # the port is taken, the address is not ours
            logger.error("cannot serve on %s:%d: %s", args.host, args.port, error)
            return 1
    logger.info("code service stopped; sandbox closed")
    return 0


if __name__ == "__main__":
    sys.exit(main())
