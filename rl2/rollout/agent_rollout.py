"""Rollouts of agent files: the user's agent, written against the OpenAI API, run once per trajectory
against this rank's `OpenAIServer`, and the requests it made turned into the trajectory's sequences.

An agent file (`rollout.agent_path`) defines

    async def run(row: dict, client: openai.AsyncOpenAI) -> float      # or a dict with "reward"

and may take `base_url` and `api_key` keywords too, for frameworks that build their own client
(LangGraph's `ChatOpenAI`, the Agents SDK's `OpenAIChatCompletionsModel`). A sync `run` runs in a thread.
Its return value is the reward; it may instead `POST /rl/reward`. An exception or a timeout in `run`
leaves the trajectory without a reward, with the error kept (as a failing `reward_fn` does).

`rollout.max_turns` bounds a trajectory's requests: past it the server answers 400 and the episode ends
there, as a multi-turn rollout's does at its turn limit, scored as it stands: by the reward `run` returns
(or posted) after catching the refusal, else, where `run` raised or gave none, by the env file's
`reward_fn` on the conversation so far (`score_unscored`); without an env file that is an env error
saying so.
"""

import asyncio
import inspect
import logging
import numbers
from collections.abc import Awaitable, Callable
from typing import Any

from rl2.chat.tool_parsers import ToolParser
from rl2.engines import Engine, SamplingParams
from rl2.rollout.env import Env
from rl2.rollout.env_file import EnvArgs, EnvError, describe_exception, load_env_file, where
from rl2.rollout.multi_turn import assign_rewards
from rl2.rollout.trajectory import Trajectory
from rl2.serve.openai_server import OpenAIServer, finite_reward
from rl2.serve.session import AgentSession
from rl2.data.image_rows import IMAGE_ROW
from rl2.vision.image_inputs import ImageInputs
from rl2.vision.inputs import image_pad_id

logger = logging.getLogger(__name__)


class AgentFile:
    """The `run` of an agent file, checked at start-up."""

    def __init__(self, path: str, args: dict[str, Any] | None = None):
        self.path = path
        module = load_env_file(path, EnvArgs(args, path))
        run = getattr(module, "run", None)
        if not callable(run):
            raise EnvError(f"agent file {path} does not define run(row, client) (async def run(row, client) -> float)")
        parameters = inspect.signature(run).parameters
        required = [p for p in parameters.values() if p.default is inspect.Parameter.empty
                    and p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name not in ("base_url", "api_key")]
        if len(required) > 2:
            raise EnvError(f"agent file {path}: run{inspect.signature(run)} cannot be called as run(row, client)")
        self.run = run
        self.is_async = inspect.iscoroutinefunction(run)
        takes_any = any(p.kind is p.VAR_KEYWORD for p in parameters.values())
        self.extra = [name for name in ("base_url", "api_key") if takes_any or name in parameters]

    async def __call__(self, row: dict, client: Any, base_url: str, api_key: str) -> Any:
        extra = {name: value for name, value in (("base_url", base_url), ("api_key", api_key)) if name in self.extra}
        if self.is_async:
            return await self.run(row, client, **extra)
        return await asyncio.to_thread(self.run, row, client, **extra)


def openai_client(base_url: str, timeout: float):
    """The `openai.AsyncOpenAI` the trajectories share (each takes a copy with its own key: a client of its
    own would build an HTTP client and an SSL context, ~50 ms of CPU each); no retries: a failed request
    is the agent's to handle."""
    try:
        import openai
    except ImportError:
        raise EnvError("rollout.agent_path needs the openai package: pip install 'rl2[agents]'") from None
    return openai.AsyncOpenAI(base_url=base_url, api_key="rl2", max_retries=0, timeout=timeout)


def agent_episodes(agent: AgentFile, server: OpenAIServer, sessions: list[AgentSession], rows: list[dict],
                   client, timeout: float) -> Callable[[int, str], Awaitable]:
    """`episode(i, key)`: one run of the agent on `rows[i]` with a copy of `client` holding `key`, its
    reward (or its error) kept on `sessions[i]`; a run that raises once a request was refused at the
    request limit is no error: its trajectory ends there, unscored, to be scored as it stands."""

    async def run_one(i: int, key: str) -> None:
        session, row = sessions[i], _agent_row(rows[i])
        keyed = client.with_options(api_key=key)  # shares the connection pool: not closed here
        try:
            result = await asyncio.wait_for(agent(row, keyed, server.base_url, key), timeout)
            _take_reward(session, result, agent.path)
        except asyncio.TimeoutError:
            session.errors.append(f"agent {agent.path}: run did not finish within {timeout:g} s (rollout.agent_timeout)")
        except Exception as error:  # noqa: BLE001 - the user's agent: recorded on its trajectory
            said = f"agent {agent.path}: run raised{where(error, agent.path)} {describe_exception(error)}"
            if session.at_request_limit:  # the refusal's error, most likely: the episode ended at the limit
                logger.debug("%s after its trajectory's request limit: scored as it stands", said)
            else:
                session.errors.append(said)

    return run_one


def close_client(server: OpenAIServer, client) -> None:
    """Close the shared client's connection pool, which lives on the server's loop, where the agents ran."""
    asyncio.run_coroutine_threadsafe(client.close(), server.loop).result(timeout=10)


def agent_rollout(
    server: OpenAIServer,
    engine: Engine,
    agent: AgentFile,
    tokenizer,
    parser: ToolParser,
    prompts: list[dict],
    responses_per_prompt: int,
    params: SamplingParams,
    max_requests: int,
    max_length: int | None = None,
    first_group: int = 0,
    version: int = 0,
    merge: bool = True,
    timeout: float = 600.0,
) -> list[Trajectory]:
    """`responses_per_prompt` trajectories of `prompts` (dataset rows), each one run of the agent, grouped by
    prompt; at most `max_requests` generations each and `max_length` tokens a sequence."""
    rows = [prompt for prompt in prompts for _ in range(responses_per_prompt)]
    sessions = [AgentSession(tokenizer, parser, merge, row) for row in rows]
    shared = openai_client(server.base_url, timeout)
    try:
        episode = agent_episodes(agent, server, sessions, rows, shared, timeout)
        ignored = server.serve_rollout(engine, sessions, episode, params, version, max_requests, max_length)
    finally:
        close_client(server, shared)
    trajectories = [agent_trajectory(session, row, first_group + i // responses_per_prompt, version)
                    for i, (session, row) in enumerate(zip(sessions, rows))]
    if ignored and trajectories:
        trajectories[0].agent_stats["ignored_fields"] = ignored
    return trajectories


def _agent_row(prompt: dict) -> dict:
    """What `run` gets of a dataset row: its columns, with its messages, answer and tools as rl2 read them."""
    return {**prompt.get("row", {}), **{key: prompt.get(key) for key in ("messages", "answer", "tools")}}


def _take_reward(session: AgentSession, result: Any, path: str) -> None:
    if isinstance(result, dict):
        session.extras = {key: value for key, value in result.items() if key != "reward"}
        result = result.get("reward")
    if result is None:
        if session.reward is None and not session.at_request_limit:
            session.errors.append(f"agent {path}: run returned no reward and none was posted to /rl/reward")
        return
    if isinstance(result, bool) or not isinstance(result, numbers.Real):
        session.errors.append(f"agent {path}: run returned {type(result).__name__}, not a number")
        return
    reward = finite_reward(result)
    if reward is None:  # NaN or inf would make the loss NaN: the trajectory's env error instead
        session.errors.append(f"agent {path}: run returned a reward of {result!r:.40}, expected a finite number")
        return
    session.reward = reward


def agent_trajectory(session: AgentSession, row: dict, group: int, version: int) -> Trajectory:
    """A trajectory of the session's sequences, one after the other (each trained as its own when there
    are several, as `rollout.trajectory_format=per_turn` does)."""
    token_ids, action_mask, logprobs, versions, starts = [], [], [], [], []
    for sequence in session.sequences:
        starts.append(len(token_ids))
        token_ids += sequence.token_ids
        action_mask += sequence.action_mask
        logprobs += sequence.logprobs
        versions += sequence.versions
    errors = list(session.errors)
    if not session.sequences:  # nothing to train: the prompt alone keeps the trajectory's place in its group
        errors = errors or ["the agent made no request"]
        token_ids = list(row["prompt_ids"])
        if IMAGE_ROW in row:  # its images never processed: the prompt without their pad tokens (it trains nothing)
            token_ids = [token for token in token_ids if token != image_pad_id(session.tokenizer)]
        action_mask, logprobs, versions = [0] * len(token_ids), [0.0] * len(token_ids), [-1] * len(token_ids)
    messages = session.sequences[-1].messages if session.sequences else list(row["messages"])
    counts = [sequence.images.count if sequence.images is not None else 0 for sequence in session.sequences]
    firsts = [sum(counts[:k]) for k in range(len(counts))]
    return Trajectory(
        messages=messages, answer=row.get("answer"), group=group, token_ids=token_ids, action_mask=action_mask,
        logprobs=logprobs, turns=session.requests, truncated=session.truncated, done=True,
        reward=session.reward if not errors else None, errors=errors, versions=versions, started=version,
        tools=session.sequences[-1].tools if session.sequences else None,
        images=ImageInputs.concat([sequence.images for sequence in session.sequences]),
        turn_starts=starts if len(starts) > 1 else None,
        turn_images=[list(pair) for pair in zip(firsts, counts)] if len(starts) > 1 and any(counts) else None,
        source=row.get("source"),
        agent_stats={"extras": session.extras, "requests": session.requests, "sequences": len(session.sequences),
                     "reused_tokens": session.reused_tokens, "rendered_tokens": session.rendered_tokens,
                     "drift_requests": session.drift, "at_request_limit": session.at_request_limit},
    )


def score_unscored(env: Env | None, trajectories: list[Trajectory]) -> None:
    """Score the agents' trajectories that came back with neither a reward nor an error (a run that gave no
    reward, or raised, once its trajectory reached the request limit) as they stand, with the env file's
    `reward_fn`; without an env file each gets an env error that says how to score it."""
    unscored = [t for t in trajectories if t.reward is None and not t.errors]
    if env is not None:
        if unscored:
            assign_rewards(env, unscored)
        return
    for trajectory in unscored:
        trajectory.errors.append(
            f"the agent's run ended at the request limit ({trajectory.turns} requests, rollout.max_turns) without "
            "a reward: catch the refused request in run and return a reward (or POST /rl/reward), or give an "
            "env file (rollout.env_path) whose reward_fn scores the conversation as it stands")
