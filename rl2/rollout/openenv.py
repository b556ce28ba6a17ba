"""OpenEnv environments (`openenv-core`: environments served over HTTP/WebSocket with `reset` / `step` /
`state`) as rl2's gym-style environments: `OpenEnvClient(url, ...)` is a `make_env(row)` for an env file, each
trajectory an episode in a session of its own on the server, through openenv-core's `GenericEnvClient`.

    # envs/openenv.py, or an env file of your own:
    make_env = OpenEnvClient(env_args["openenv_url"], action_field="message", observation_field="prompt")

The model's reply is sent as the action `{action_field: reply}`; the observation's `observation_field` (or its
only text field) is the next user message (a tool message with `observation_role="tool"`, for environments
that answer tool calls); the step's `reward` and `done` are the server's. Row columns named
in `reset_fields` are passed to the server's `reset` (OpenEnv's reset takes extra fields), so one server can
play a different game per row. The sessions' WebSockets are bound to one event loop: a thread of the client's
own runs it, and rl2 calls the episodes' methods from its threads. A session lives on the server and cannot be
saved: a paused trajectory's episode is checkpointed as its reset arguments and the actions taken, and a
resumed run opens a new session and replays them (the same state for a deterministic environment).
"""

import asyncio
import threading
from typing import Any

from rl2.rollout.env_file import EnvError


class OpenEnvClient:
    """A `make_env(row)` whose episodes are sessions on the OpenEnv server at `url`."""

    def __init__(self, url: str, action_field: str = "message", observation_field: str | None = None,
                 reset_fields: tuple[str, ...] | list[str] = (), timeout: float = 60.0,
                 observation_role: str = "user"):
        try:
            from openenv.core import GenericEnvClient
        except ImportError:
            raise EnvError("OpenEnv environments need openenv-core: pip install 'rl2[envs]' "
                           "(or pip install openenv-core)") from None
        self.client_class = GenericEnvClient
        self.url, self.action_field, self.observation_field = url, action_field, observation_field
        self.reset_fields, self.timeout = tuple(reset_fields), timeout
        if observation_role not in ("user", "tool"):
            raise EnvError(f"OpenEnv observation_role must be user or tool, got {observation_role!r}")
        self.observation_role = observation_role
        self._loop: asyncio.AbstractEventLoop | None = None
        self._lock = threading.Lock()

    def __getstate__(self) -> dict:
        return {key: value for key, value in self.__dict__.items() if key not in ("_loop", "_lock", "client_class")}

    def __setstate__(self, state: dict) -> None:
        from openenv.core import GenericEnvClient

        self.__dict__.update(state, client_class=GenericEnvClient, _loop=None, _lock=threading.Lock())

    def __call__(self, row: dict) -> "OpenEnvEpisode":
        return OpenEnvEpisode(self, {name: row[name] for name in self.reset_fields if name in row})

    def run(self, coroutine) -> Any:
        """`coroutine` on the sessions' event loop (started at the first call), within `timeout`."""
        with self._lock:
            if self._loop is None:
                self._loop = asyncio.new_event_loop()
                threading.Thread(target=self._loop.run_forever, name="openenv-client", daemon=True).start()
        future = asyncio.run_coroutine_threadsafe(asyncio.wait_for(coroutine, self.timeout), self._loop)
        return future.result()

    def observation_turn(self, observation: dict) -> str | list[dict]:
        """The observation as the next turn: its text (a user message), or a tool message with
        `observation_role="tool"`; nothing where the text is empty."""
        text = self.observation_text(observation)
        if self.observation_role == "tool" and text:
            return [{"role": "tool", "content": text}]
        return text

    def observation_text(self, observation: dict) -> str:
        """The observation's text: `observation_field`, else its only text field."""
        if self.observation_field is not None:
            if self.observation_field not in observation:
                raise EnvError(f"OpenEnv server {self.url}: the observation has no field "
                               f"{self.observation_field!r} (it has {sorted(observation)}): set observation_field")
            return str(observation[self.observation_field])
        texts = [key for key, value in observation.items() if isinstance(value, str)]
        if len(texts) != 1:
            raise EnvError(f"OpenEnv server {self.url}: the observation has {len(texts)} text fields "
                           f"({texts or sorted(observation)}): say which one the model reads with observation_field")
        return observation[texts[0]]


class OpenEnvEpisode:
    """One trajectory's session: `reset()`, `step(reply)` in gym's shape, `close()`."""

    def __init__(self, client: OpenEnvClient, reset_arguments: dict):
        self.client, self.reset_arguments = client, reset_arguments
        self.session = None
        self.actions: list[str] = []  # taken so far: replayed in a new session after a checkpoint

    def reset(self) -> str | list[dict]:
        result = self.client.run(self._start())
        return self.client.observation_turn(result.observation)

    def step(self, action: str) -> tuple[str | list[dict], float, bool, dict]:
        if self.session is None:  # restored from a checkpoint: a new session, brought to where this one was
            self.client.run(self._start())
            for taken in self.actions:
                self.client.run(self.session.step({self.client.action_field: taken}))
        result = self.client.run(self.session.step({self.client.action_field: action}))
        self.actions.append(action)
        turn = "" if result.done else self.client.observation_turn(result.observation)
        return turn, float(result.reward or 0.0), bool(result.done), {"observation": result.observation}

    async def _start(self) -> Any:
        self.session = self.client.client_class(base_url=self.client.url)
        await self.session.connect()
        return await self.session.reset(**self.reset_arguments)

    def close(self) -> None:
        if self.session is not None:
            session, self.session = self.session, None
            self.client.run(session.close())

    def __getstate__(self) -> dict:
        return {"client": self.client, "reset_arguments": self.reset_arguments, "actions": self.actions}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state, session=None)
