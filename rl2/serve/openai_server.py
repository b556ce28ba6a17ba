"""An OpenAI-compatible HTTP server over the rollout engine, one per rank, bound to 127.0.0.1.

Agents written against the OpenAI API (the OpenAI SDK, the Agents SDK, LangGraph) talk to it as to any
endpoint: `POST /v1/chat/completions` (tools, n, logprobs, streaming), `POST /v1/completions`,
`GET /v1/models`, `POST /tokenize`, and `POST /rl/reward` for an agent that reports its reward itself.
Each trajectory has its own API key: the key says which trajectory a request belongs to (`AgentSession`),
and an unknown key is refused (401). Generation uses the run's sampling parameters (a request's
`temperature`, `top_p` or `stop` would make the behaviour policy another one than the one trained: they
are ignored and counted); a request's `max_tokens` is honoured. vLLM's `return_token_ids` extension
returns the prompt's and the completion's token ids. For a vision-language model (`image_processing` given),
chat messages may hold `image_url` parts with base64 data URIs (a URL is refused, 400 naming the part): the
prompt's tokens are rl2's rendering of the messages, image pads expanded, and the images go to the engine with
the prompt and to the trajectory (`chat_images`).

What the server refuses, so that no request of one agent can end the run or stall the others: a body past
`max_request_mb` (413), any request but `/v1/models` without its trajectory's key (401), token ids outside
the vocabulary (400, before they reach the engine), a request whose `n` generations would pass the
trajectory's request limit (400, none generated), a reward that is not a finite number (400). A reply
its client never received (it disconnected, or the request failed after generating) is not trained.
"""

import asyncio
import json
import logging
import math
import numbers
import secrets
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import Future
from dataclasses import dataclass, field

from aiohttp import web

from rl2.engines import Engine, SamplingParams, Turn
from rl2.serve.engine_slots import EngineSlots, Served
from rl2.serve.chat_images import ChatImages
from rl2.serve.session import AgentSession, Kept, Plan, RequestError, openai_messages
from rl2.vision.inputs import image_pad_id
from rl2.vision.processing import ImageProcessing

logger = logging.getLogger(__name__)

# SGLang's tool-call parser names (`/parse_function_call`) -> rl2's (`rollout.tool_parser`).
SGLANG_PARSERS = {"qwen25": "hermes", "qwen": "hermes", "qwen3": "hermes", "llama3": "llama3_json",
                  "mistral": "mistral", "qwen3_coder": "qwen3_coder"}

# Request fields that choose how to sample: the run's own sampling parameters are used instead.
SAMPLING_FIELDS = ("temperature", "top_p", "top_k", "stop", "presence_penalty", "frequency_penalty", "seed",
                   "logit_bias", "min_p", "repetition_penalty")

# A request body longer than this is parsed (and its prompt rendered) in a worker thread, off the event loop
# that serves every session of the rank.
OFF_LOOP_BYTES = 64 * 1024
# Where `_body` notes a request's body length (aiohttp's request is a mapping; typed keys since aiohttp 3.12).
BODY_BYTES = web.RequestKey("rl2_body_bytes", int) if hasattr(web, "RequestKey") else "rl2_body_bytes"


@dataclass
class Rollout:
    """How one rollout's requests are generated: its slots (one per trajectory), sampling parameters, the
    policy version generating, and the limits; kept across steps by a partial rollout."""

    slots: EngineSlots
    params: SamplingParams
    version: int
    max_requests: int
    max_length: int | None
    stop_ids: set[int]
    ignored_fields: dict[str, int] = field(default_factory=dict)
    # Chat and text completions at a trajectory URL (`/s/{key}/v1/...`: an RL2 HEAD file's judge or
    # summariser) are served, not trained, and no turns: at most this many a trajectory, counted by slot.
    served_requests: int = 0
    served: dict[int, int] = field(default_factory=dict)


class OpenAIServer:
    """The server, on an event loop of its own thread; `open` makes a rollout's sessions reachable."""

    def __init__(self, tokenizer, model_name: str = "rl2-policy", max_request_mb: float = 4.0,
                 image_processing: ImageProcessing | None = None):
        if not max_request_mb > 0:
            raise ValueError(f"rollout.agent_max_request_mb must be a positive number of MB, not {max_request_mb!r}")
        self.tokenizer, self.model_name = tokenizer, model_name
        self.image_processing = image_processing  # a vision-language model's: chat messages may hold images
        self.image_pad_id = image_pad_id(tokenizer) if image_processing is not None else None
        self.max_request_bytes = int(max_request_mb * 2**20)  # a longer body is refused (413)
        self.vocab_size = len(tokenizer)  # token ids a request may hold: 0 to vocab_size - 1
        self.sessions: dict[str, tuple[Rollout, int, AgentSession]] = {}  # by API key: its rollout, slot, session
        self.max_length: int | None = None
        self.loop = asyncio.new_event_loop()
        self._started = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="openai-server", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            raise self._error

    # ---- life cycle ----------------------------------------------------------------------

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self._error = None
        try:
            self.loop.run_until_complete(self._start())
        except Exception as error:  # noqa: BLE001 - raised in the constructor's thread
            self._error = error
            self._started.set()
            return
        self._started.set()
        self.loop.run_forever()

    async def _start(self) -> None:
        app = web.Application(client_max_size=self.max_request_bytes)
        app.add_routes([
            web.post("/v1/chat/completions", self.chat_completions),
            web.post("/v1/completions", self.completions),
            web.get("/v1/models", self.models),
            web.post("/tokenize", self.tokenize),
            web.post("/rl/reward", self.reward),
            web.post("/v1/responses", self.responses),
            # A trajectory's own URL (`session_url`), for code that posts to a router without an API key: RL2
            # HEAD's env files (SGLang's /generate and what their own generate functions call).
            web.post("/s/{key}/generate", self.generate),
            web.post("/s/{key}/v1/chat/completions", self.chat_completions),
            web.post("/s/{key}/v1/completions", self.completions),
            web.get("/s/{key}/v1/models", self.models),
            web.get("/s/{key}/list_workers", self.list_workers),
            web.post("/s/{key}/parse_function_call", self.parse_function_call),
        ])
        # handler_cancellation: a client that disconnects cancels its handler, which drops what it generated
        self._runner = web.AppRunner(app, access_log=None, shutdown_timeout=1.0, handler_cancellation=True)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.port = site._server.sockets[0].getsockname()[1]

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def session_url(self, key: str) -> str:
        """The URL of a trajectory's own endpoints (`/generate`, `/v1/...`): its key in the path."""
        return f"http://127.0.0.1:{self.port}/s/{key}"

    def close(self) -> None:
        if not self.loop.is_running():
            return

        async def stop() -> None:  # agents still running (a partial rollout's) end here
            others = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()]
            for task in others:
                task.cancel()
            await asyncio.gather(*others, return_exceptions=True)
            await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), self.loop).result(timeout=10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(timeout=10)

    def open_rollout(self, params: SamplingParams, version: int, max_requests: int,
                     max_length: int | None, served_requests: int = 0) -> Rollout:
        """A rollout whose sessions (`open_sessions`) are generated with `params`, at most `max_requests`
        generations each (and `served_requests` completions at their trajectory URL) and `max_length`
        tokens a sequence."""
        stop_ids = set(params.stop_token_ids)
        if not params.ignore_eos and self.tokenizer.eos_token_id is not None:
            stop_ids.add(self.tokenizer.eos_token_id)
        self.max_length = max_length
        return Rollout(EngineSlots(), params, version, max_requests, max_length, stop_ids,
                       served_requests=served_requests)

    def open_sessions(self, rollout: Rollout, sessions: list[AgentSession], episode: Callable[[int, str], Awaitable],
                      on_end: Callable[[int], None] | None = None,
                      replays: list[dict] | None = None) -> tuple[list[str], list[int], list[Future]]:
        """Make `sessions` reachable (an API key and a slot of `rollout` each) and start `episode(i, key)` for
        each on this server's loop; a session's slot closes when its episode ends, then `on_end(i)` runs (on
        the loop). `replays`: each slot's `EngineSlots.snapshot` from an earlier run, answered from first.
        Returns the keys, the slots and the episodes' futures."""
        keys = [f"rl2-{secrets.token_hex(12)}" for _ in sessions]
        slots = rollout.slots.add(len(sessions))
        for slot, saved in zip(slots, replays or []):
            rollout.slots.restore(slot, saved)
        for key, slot, session in zip(keys, slots, sessions):
            self.sessions[key] = (rollout, slot, session)

        async def one(i: int) -> None:
            try:
                await episode(i, keys[i])
            finally:
                rollout.slots.close(slots[i])
                if on_end is not None:
                    on_end(i)

        return keys, slots, [asyncio.run_coroutine_threadsafe(one(i), self.loop) for i in range(len(sessions))]

    def close_sessions(self, rollout: Rollout, keys: list[str]) -> None:
        """Refuse `keys` from now on and drop their slots."""
        slots = [self.sessions.pop(key)[1] for key in keys if key in self.sessions]
        rollout.slots.remove(slots)

    @staticmethod
    def run_engine(engine: Engine, rollout: Rollout, slots: list[int], version: int) -> None:
        """Generate the requests of `slots` with `engine` (policy `version`) until each slot's episode ends,
        or until `rollout.slots.pause()`."""
        rollout.version = version
        try:
            engine.generate_turns(rollout.slots.start(slots, version), rollout.params, rollout.slots.on_generation,
                                  rollout.max_requests + rollout.served_requests)
        except BaseException as error:  # every request waiting on the engine fails with it, none hangs
            rollout.slots.fail(error)
            raise

    def serve_rollout(self, engine: Engine, sessions: list[AgentSession], episode: Callable[[int, str], Awaitable],
                      params: SamplingParams, version: int, max_requests: int,
                      max_length: int | None, served_requests: int = 0) -> dict[str, int]:
        """Serve `sessions` while `episode(i, key)` drives session i on this server's loop and `engine`
        generates their requests, at most `max_requests` each (and `served_requests` completions at their
        trajectory URL); their keys are refused once all are done. Returns the request fields that were
        ignored, counted."""
        rollout = self.open_rollout(params, version, max_requests, max_length, served_requests)
        keys, slots, running = self.open_sessions(rollout, sessions, episode)
        try:
            self.run_engine(engine, rollout, slots, version)
            for future in running:
                future.result()
        finally:
            self.close_sessions(rollout, keys)
        return rollout.ignored_fields

    # ---- handlers ------------------------------------------------------------------------

    def _session(self, request: web.Request) -> tuple[Rollout, int, AgentSession]:
        key = request.match_info.get("key") or request.headers.get("Authorization", "").removeprefix("Bearer ").strip()
        if key not in self.sessions:
            raise _Refused(401, "invalid_api_key", "unknown API key: each trajectory has its own, given to its agent")
        return self.sessions[key]

    async def _body(self, request: web.Request) -> dict:
        """The request's JSON object: 413 past `max_request_bytes`; a long one parsed off the event loop."""
        try:
            raw = await request.read()
        except web.HTTPRequestEntityTooLarge:
            raise _Refused(413, "request_too_large", f"the request body is larger than "
                           f"{self.max_request_bytes / 2**20:g} MB (rollout.agent_max_request_mb)") from None
        request[BODY_BYTES] = len(raw)
        try:
            if len(raw) > OFF_LOOP_BYTES:
                body = await asyncio.get_running_loop().run_in_executor(None, json.loads, raw)
            else:
                body = json.loads(raw)
        except (ValueError, RecursionError):  # not JSON, not UTF-8, an integer past Python's limit, too deep
            raise _Refused(400, "invalid_request_error", "the request body is not JSON") from None
        if not isinstance(body, dict):
            raise _Refused(400, "invalid_request_error", "the request body must be a JSON object")
        return body

    def _token_ids(self, value, name: str) -> list[int]:
        """`value` as a prompt's token ids: a non-empty list of ints of the vocabulary; RequestError naming the
        first that is not (the engine would fail on it, with every request of the rank)."""
        if not isinstance(value, list) or not value:
            raise RequestError(f"'{name}' must be a non-empty list of token ids")
        for token in value:
            if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < self.vocab_size:
                raise RequestError(f"'{name}' holds {token!r:.40}, which is not a token id of this model: the "
                                   f"vocabulary has {self.vocab_size} tokens (ids 0 to {self.vocab_size - 1})")
        return list(value)

    @staticmethod
    def _reserve(rollout: Rollout, slot: int, session: AgentSession, n: int, served: bool) -> None:
        """Count `n` generations against the trajectory's limits before any is generated: a request that would
        pass one is refused whole, so that no generation its agent never receives is trained."""
        if served:
            if rollout.served.get(slot, 0) + n > rollout.served_requests:
                raise _Refused(400, "invalid_request_error",
                               f"this trajectory made its {rollout.served_requests} completions of its own")
            rollout.served[slot] = rollout.served.get(slot, 0) + n
            return
        if session.requests_started + n > rollout.max_requests:
            session.at_request_limit = True  # the episode ends here, scored as it stands (`score_unscored`)
            left = rollout.max_requests - session.requests_started
            more = f" ({left} left, {n} asked with 'n')" if 0 < left < n else ""
            raise _Refused(400, "invalid_request_error",
                           f"this trajectory made its {rollout.max_requests} requests (rollout.max_turns){more}")
        session.requests_started += n

    async def _generate(self, rollout: Rollout, slot: int, session: AgentSession, plan: Plan,
                        max_tokens: int | None) -> Served | None:
        """The generation of `plan` in its trajectory's slot (counted by `_reserve` beforehand); None where no
        token fits the length limit; 500 where the engine failed."""
        room = rollout.params.max_new_tokens
        if max_tokens is not None:
            room = min(room, max_tokens)
        if rollout.max_length is not None:
            room = min(room, rollout.max_length - len(plan.prompt_ids))
        if room < 1:
            session.truncated = True
            return None
        try:
            served = await asyncio.wrap_future(rollout.slots.submit(slot, Turn(plan.prompt_ids, room,
                                                                                images=plan.images)))
        except Exception as error:  # noqa: BLE001 - the engine call failed (`EngineSlots.fail`)
            raise _Refused(500, "engine_error", f"the engine failed: {type(error).__name__}: {error}"[:500]) from None
        if served.generation.was_refused:  # this request alone: the engine went on with the others
            raise _Refused(400, "invalid_request_error", served.generation.error[:500])
        return served

    async def _plan(self, session: AgentSession, messages: list[dict], tools: list[dict] | None, large: bool,
                    images: ChatImages | None = None) -> Plan:
        """`session.plan`, rendered and tokenised off the event loop for a large request."""
        if large:
            return await asyncio.to_thread(session.plan, messages, tools, images)
        return session.plan(messages, tools, images)

    def _chat_images(self) -> ChatImages | None:
        """A request's images, to be filled by `openai_messages`: None for a text model."""
        if self.image_processing is None:
            return None
        return ChatImages(self.image_processing, self.image_pad_id)

    async def _messages(self, value, images: ChatImages | None, large: bool) -> list[dict]:
        """`openai_messages`, off the event loop for a large request (its images are decoded and processed)."""
        if large:
            return await asyncio.to_thread(openai_messages, value, images)
        return openai_messages(value, images)

    async def _send(self, request: web.Request, response: web.StreamResponse, session: AgentSession,
                    kept: list[Kept]) -> web.StreamResponse:
        """Send `response` from the handler: where the client is gone before it has it all, the generations
        the request kept are dropped (nothing the agent never received is trained)."""
        try:
            if request.transport is None or request.transport.is_closing():
                raise ConnectionResetError("the client disconnected")
            await response.prepare(request)
            await response.write_eof()
        except (ConnectionError, asyncio.CancelledError):
            session.drop(kept)
            raise
        return response

    async def chat_completions(self, request: web.Request) -> web.StreamResponse:
        kept: list[Kept] = []  # what this request's generations changed in its session, dropped if not delivered
        try:
            rollout, slot, session = self._session(request)
            body = await self._body(request)
            large = request.get(BODY_BYTES, 0) > OFF_LOOP_BYTES
            images = self._chat_images()
            messages = await self._messages(body.get("messages"), images, large)
            tools = _tools(body)
            n, max_tokens = _count(body, "n", 1), _max_tokens(body)
            if not isinstance(body.get("stream_options") or {}, dict):  # read once the stream has begun
                raise RequestError("'stream_options' must be an object")
            _count_ignored(rollout, body)
            choices, prompt_ids = [], []
            self._reserve(rollout, slot, session, n, "key" in request.match_info)
            for index in range(n):
                plan = await self._plan(session, messages, tools, large, images)
                prompt_ids = plan.prompt_ids
                served = await self._generate(rollout, slot, session, plan, max_tokens)
                if served is None:
                    choices.append(({"role": "assistant", "content": ""}, "length", [], []))
                    continue
                generation = served.generation
                message, finish = session.record(plan, generation, served.versions, rollout.stop_ids, kept)
                choices.append((message, finish, list(generation.token_ids), list(generation.logprobs)))
        except _Refused as refused:
            return refused.response()
        except RequestError as error:
            return _Refused(400, "invalid_request_error", str(error)).response()
        except BaseException:  # the client disconnected (the handler is cancelled), or an error: nothing delivered
            if kept:
                session.drop(kept)
            raise
        reply = {
            "id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": body.get("model") or self.model_name,
            "choices": [self._choice(i, *choice, body) for i, choice in enumerate(choices)],
            "usage": _usage(len(prompt_ids), sum(len(choice[2]) for choice in choices)),
        }
        if body.get("return_token_ids"):
            reply["prompt_token_ids"] = prompt_ids
        if body.get("stream"):
            return await self._stream(request, reply, body, session, kept)
        return await self._send(request, web.json_response(reply), session, kept)

    def _choice(self, index: int, message: dict, finish: str, token_ids: list[int], logprobs: list[float],
                body: dict) -> dict:
        shown = {"role": "assistant", "content": message["content"] or None if message.get("tool_calls") else message["content"]}
        if message.get("tool_calls"):
            shown["tool_calls"] = [{"id": call["id"], "type": "function",
                                    "function": {"name": call["function"]["name"],
                                                 "arguments": json.dumps(call["function"]["arguments"])}}
                                   for call in message["tool_calls"]]
        choice = {"index": index, "message": shown, "finish_reason": finish,
                  "logprobs": {"content": self._token_logprobs(token_ids, logprobs)} if body.get("logprobs") else None}
        if body.get("return_token_ids"):
            choice["token_ids"] = token_ids
        return choice

    def _token_logprobs(self, token_ids: list[int], logprobs: list[float]) -> list[dict]:
        """Per token: its text, the log-prob it was sampled with; `top_logprobs` is empty (the engine keeps
        only the sampled token's)."""
        texts = self.tokenizer.convert_ids_to_tokens(token_ids)
        return [{"token": text, "logprob": logprob, "bytes": list(text.encode()), "top_logprobs": []}
                for text, logprob in zip(texts, logprobs)]

    async def _stream(self, request: web.Request, reply: dict, body: dict, session: AgentSession,
                      kept: list[Kept]) -> web.StreamResponse:
        """The finished reply as server-sent chunks (the engine does not stream tokens); where the client is
        gone before the last, the request's generations are dropped."""
        try:
            return await self._chunks(request, reply, body)
        except (ConnectionError, asyncio.CancelledError):
            session.drop(kept)
            raise

    async def _chunks(self, request: web.Request, reply: dict, body: dict) -> web.StreamResponse:
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await response.prepare(request)
        base = {key: reply[key] for key in ("id", "created", "model")} | {"object": "chat.completion.chunk"}

        async def send(choices: list[dict], **extra) -> None:
            await response.write(f"data: {json.dumps(base | {'choices': choices} | extra)}\n\n".encode())

        for choice in reply["choices"]:
            i, message = choice["index"], choice["message"]
            await send([{"index": i, "delta": {"role": "assistant", "content": ""}, "finish_reason": None}])
            if message.get("content"):
                await send([{"index": i, "delta": {"content": message["content"]}, "finish_reason": None,
                             "logprobs": choice["logprobs"]}])
            for k, call in enumerate(message.get("tool_calls") or []):
                await send([{"index": i, "delta": {"tool_calls": [{"index": k, **call}]}, "finish_reason": None}])
            await send([{"index": i, "delta": {}, "finish_reason": choice["finish_reason"]}])
        if (body.get("stream_options") or {}).get("include_usage"):
            await send([], usage=reply["usage"])
        await response.write(b"data: [DONE]\n\n")
        await response.write_eof()
        return response

    async def completions(self, request: web.Request) -> web.Response:
        """Raw completion of a prompt (text or token ids), no chat template: a prompt that starts with one
        of the trajectory's sequences continues it."""
        kept: list[Kept] = []  # what this request's generations changed in its session, dropped if not delivered
        try:
            rollout, slot, session = self._session(request)
            body = await self._body(request)
            prompt = body.get("prompt")
            if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
                prompt = prompt[0]
            if isinstance(prompt, str):
                ids = await self._encode(prompt, request.get(BODY_BYTES, 0) > OFF_LOOP_BYTES)
            elif isinstance(prompt, list):
                ids = self._token_ids(prompt, "prompt")
            else:
                raise RequestError("'prompt' must be a string or a list of token ids")
            _count_ignored(rollout, body)
            n, choices = _count(body, "n", 1), []
            self._reserve(rollout, slot, session, n, "key" in request.match_info)
            for index in range(n):
                plan = session.plan_tokens(ids)
                served = await self._generate(rollout, slot, session, plan, _max_tokens(body))
                generation = served.generation if served else None
                tokens = list(generation.token_ids) if generation else []
                if served is not None:
                    session.record_tokens(plan, generation, served.versions, kept)
                choice = {"index": index, "text": self.tokenizer.decode(tokens, skip_special_tokens=False),
                          "finish_reason": generation.finish_reason if generation else "length", "logprobs": None}
                if body.get("return_token_ids"):
                    choice["token_ids"] = tokens
                choices.append(choice)
        except _Refused as refused:
            return refused.response()
        except RequestError as error:
            return _Refused(400, "invalid_request_error", str(error)).response()
        except BaseException:  # the client disconnected (the handler is cancelled), or an error: nothing delivered
            if kept:
                session.drop(kept)
            raise
        reply = {"id": f"cmpl-{uuid.uuid4().hex}", "object": "text_completion", "created": int(time.time()),
                 "model": body.get("model") or self.model_name, "choices": choices,
                 "usage": _usage(len(ids), sum(len(c.get("token_ids", [])) for c in choices))}
        if body.get("return_token_ids"):
            reply["prompt_token_ids"] = ids
        return await self._send(request, web.json_response(reply), session, kept)

    async def _encode(self, text: str, large: bool) -> list[int]:
        """The token ids of `text` (no special tokens added), tokenised off the event loop when `large`."""
        if large:
            return await asyncio.to_thread(lambda: list(self.tokenizer(text, add_special_tokens=False)["input_ids"]))
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    async def responses(self, request: web.Request) -> web.Response:
        """The Responses API is not served: refused in OpenAI's shape, saying what to use (a bare 404 leaves
        the Agents SDK's default model and `ChatOpenAI(use_responses_api=True)` with "Error code: 404")."""
        return _Refused(404, "unsupported_endpoint",
                        "rl2's server does not serve the Responses API (/v1/responses): use /v1/chat/completions "
                        "(Agents SDK: OpenAIChatCompletionsModel or set_default_openai_api('chat_completions'); "
                        "LangChain: ChatOpenAI without use_responses_api)").response()

    async def models(self, request: web.Request) -> web.Response:
        max_length = self.max_length
        return web.json_response({"object": "list", "data": [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "rl2", "max_model_len": max_length}]})

    async def list_workers(self, request: web.Request) -> web.Response:
        """SGLang router's `/list_workers`: the trajectory's own URL is its one worker."""
        return web.json_response({"urls": [self.session_url(request.match_info["key"])]})

    async def generate(self, request: web.Request) -> web.Response:
        """SGLang's `/generate`: `input_ids` (or `text`), `sampling_params` (its `max_new_tokens` honoured, the
        rest the run's), `return_logprob`; the reply's `output_token_logprobs` are `[logprob, id, None]` of the
        sampled tokens, `text` their decoding (special tokens skipped unless `skip_special_tokens` is false).
        Past the trajectory's `max_requests` (rollout.max_turns) the reply is an aborted one (finish reason
        `abort`, no tokens), as SGLang's to a request it aborted: RL2's files return on it."""
        try:
            rollout, slot, session = self._session(request)
            body = await self._body(request)
            ids = body.get("input_ids")
            if ids is None and isinstance(body.get("text"), str):
                ids = await self._encode(body["text"], request.get(BODY_BYTES, 0) > OFF_LOOP_BYTES)
            if not isinstance(ids, list) or not ids:
                raise RequestError("'input_ids' must be a non-empty list of token ids (or give 'text')")
            ids = self._token_ids(ids, "input_ids")
            sampling = body.get("sampling_params") or {}
            if not isinstance(sampling, dict):
                raise RequestError("'sampling_params' must be an object")
            skip_special = True if sampling.get("skip_special_tokens") is None else sampling["skip_special_tokens"]
            if not isinstance(skip_special, bool):
                raise RequestError("'sampling_params.skip_special_tokens' must be true or false")
            differing = {name: value for name, value in sampling.items()
                         if name in ("temperature", "top_p", "top_k") and value != getattr(rollout.params, name)}
            _count_ignored(rollout, differing)
            max_tokens = sampling.get("max_new_tokens")
            if session.requests_started >= rollout.max_requests:  # rollout.max_turns: the episode ends here
                meta = {"id": uuid.uuid4().hex, "finish_reason": {"type": "abort"}, "prompt_tokens": len(ids),
                        "completion_tokens": 0}
                return web.json_response({"text": "", "output_ids": [], "meta_info": meta})
            self._reserve(rollout, slot, session, 1, False)
            served = await self._generate(rollout, slot, session, Plan([], None, list(ids)),
                                          max_tokens if isinstance(max_tokens, int) and max_tokens > 0 else None)
            generation = served.generation if served else None
        except _Refused as refused:
            return refused.response()
        except RequestError as error:
            return _Refused(400, "invalid_request_error", str(error)).response()
        tokens = list(generation.token_ids) if generation else []
        logprobs = list(generation.logprobs) if generation else []
        reason = generation.finish_reason if generation else "length"
        meta = {"id": uuid.uuid4().hex, "finish_reason": {"type": reason}, "prompt_tokens": len(ids),
                "completion_tokens": len(tokens)}
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = [[logprob, token, None] for logprob, token in zip(logprobs, tokens)]
        text = self.tokenizer.decode(tokens, skip_special_tokens=skip_special)
        return web.json_response({"text": text, "output_ids": tokens, "meta_info": meta})

    async def parse_function_call(self, request: web.Request) -> web.Response:
        """SGLang's `/parse_function_call`: `text`, `tools`, `tool_call_parser` (SGLang's names) -> the text
        outside the calls and the calls, `parameters` as JSON."""
        from rl2.chat.tool_parsers import get_tool_parser

        try:
            self._session(request)
            body = await self._body(request)
            name = body.get("tool_call_parser")
            if not isinstance(name, str):
                raise RequestError("'tool_call_parser' must be a string: the name of a tool-call parser")
            try:
                parser = get_tool_parser(SGLANG_PARSERS.get(name, name))
            except ValueError as error:
                raise RequestError(str(error)) from None
            given = body.get("tools") or []
            if not isinstance(given, list) or not all(isinstance(t, dict) for t in given):
                raise RequestError("'tools' must be a list of tool objects")
            tools = [{"type": "function", "function": t.get("function", t)} for t in given] or None
            parsed = parser.parse(str(body.get("text", "")), tools)
        except _Refused as refused:
            return refused.response()
        except RequestError as error:
            return _Refused(400, "invalid_request_error", str(error)).response()
        calls = [{"tool_index": i, "name": call.name, "parameters": json.dumps(call.arguments)}
                 for i, call in enumerate(c for c in parsed.calls if c.error is None)]
        return web.json_response({"normal_text": parsed.content, "calls": calls})

    async def tokenize(self, request: web.Request) -> web.Response:
        """vLLM's `/tokenize`: the token ids of `prompt`, or of `messages` through the chat template."""
        try:
            self._session(request)  # it costs work: a trajectory's key only
            body = await self._body(request)
            large = request.get(BODY_BYTES, 0) > OFF_LOOP_BYTES
            if "messages" in body:
                from rl2.chat.template import render_chat

                images = self._chat_images()
                messages, tools = await self._messages(body["messages"], images, large), _tools(body)
                generation_prompt = bool(body.get("add_generation_prompt", True))
                if large:
                    text = await asyncio.to_thread(render_chat, messages, self.tokenizer, generation_prompt, tools)
                else:
                    text = render_chat(messages, self.tokenizer, generation_prompt, tools)
            elif isinstance(body.get("prompt"), str):
                text, images = body["prompt"], None
            else:
                raise RequestError("give 'prompt' (a string) or 'messages'")
            tokens = await self._encode(text, large)
            if images is not None:
                try:
                    tokens, _ = images.expand(tokens, messages)
                except ValueError as error:
                    raise RequestError(str(error)) from None
        except _Refused as refused:
            return refused.response()
        except RequestError as error:
            return _Refused(400, "invalid_request_error", str(error)).response()
        max_length = self.max_length
        return web.json_response({"tokens": tokens, "count": len(tokens), "max_model_len": max_length})

    async def reward(self, request: web.Request) -> web.Response:
        """`{"reward": float}`: the trajectory's reward, reported by its agent."""
        try:
            _, _, session = self._session(request)
            body = await self._body(request)
            value = finite_reward(body.get("reward"))
            if value is None:
                raise RequestError(f"'reward' must be a finite number, not {body.get('reward')!r:.40}")
        except _Refused as refused:
            return refused.response()
        except RequestError as error:
            return _Refused(400, "invalid_request_error", str(error)).response()
        session.reward = value
        return web.json_response({"ok": True})


class _Refused(Exception):
    """An error answered in OpenAI's shape."""

    def __init__(self, status: int, code: str, message: str):
        super().__init__(message)
        self.status, self.code, self.message = status, code, message

    def response(self) -> web.Response:
        kind = ("authentication_error" if self.status == 401 else "server_error" if self.status >= 500
                else "invalid_request_error")
        return web.json_response({"error": {"message": self.message, "type": kind, "param": None, "code": self.code}},
                                 status=self.status)


def finite_reward(value) -> float | None:
    """`value` as a reward: a finite real number (not a bool), else None."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real):
        return None
    try:
        reward = float(value)
    except OverflowError:  # an int too large for a float
        return None
    return reward if math.isfinite(reward) else None


def _tools(body: dict) -> list[dict] | None:
    tools = body.get("tools")
    if tools is None or body.get("tool_choice") == "none":
        return None
    if not isinstance(tools, list) or not all(isinstance(t, dict) and t.get("type", "function") == "function"
                                              and isinstance(t.get("function"), dict) for t in tools):
        raise RequestError("'tools' must be a list of {\"type\": \"function\", \"function\": {...}}")
    return [{"type": "function", "function": t["function"]} for t in tools] or None


def _count(body: dict, key: str, default: int) -> int:
    value = body.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise RequestError(f"'{key}' must be a positive integer, got {value!r}")
    return value


def _max_tokens(body: dict) -> int | None:
    for key in ("max_completion_tokens", "max_tokens"):
        if body.get(key) is not None:
            return _count(body, key, 1)
    return None


def _count_ignored(rollout: Rollout, body: dict) -> None:
    """Count the request's fields that generation does not follow: sampling fields, and tool-choice
    constraints (`tool_choice` "required" or a named function, `parallel_tool_calls` false) that would
    need the reply cut or forced, which would make it differ from the tokens sampled."""
    ignored = [name for name in SAMPLING_FIELDS if body.get(name) is not None]
    if body.get("tool_choice") not in (None, "auto", "none"):
        ignored.append("tool_choice")
    if body.get("parallel_tool_calls") is False:
        ignored.append("parallel_tool_calls")
    for name in ignored:
        rollout.ignored_fields[name] = rollout.ignored_fields.get(name, 0) + 1


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}
