"""RL2 HEAD's env files, run unchanged: each trajectory is an RL2 `Sample` driven by the file's
`generate(config, tokenizer, router_url, sample)` (RL2's `base_generate` with the file's `env_step`, or the
file's own), against this rank's server (`rl2.serve.openai_server`: SGLang's `/generate`, and the
`/v1/chat/completions`, `/v1/models`, `/list_workers`, `/parse_function_call` its files use) at a URL of
the trajectory's own. The sample's sequences (`state_dicts`, token ids as sampled) become the trajectory's,
its reward the sum of each sequence's last reward, as RL2 trains them (`rl2.compat.rl2_head`).
"""

import asyncio
import inspect
from typing import Any

from rl2.compat.rl2_head import Sample, rl2_modules
from rl2.engines import Engine, SamplingParams
from rl2.rollout.env_file import EnvArgs, EnvError, describe_exception, load_env_file, where
from rl2.rollout.trajectory import Trajectory
from rl2.serve.openai_server import OpenAIServer
from rl2.serve.session import AgentSession


class RL2HeadFile:
    """An env file written to RL2 HEAD's interface: its `generate`, checked at start-up."""

    def __init__(self, path: str, args: dict[str, Any] | None = None):
        self.path = path
        self.module = load_env_file(path, EnvArgs(args, path), modules=rl2_modules())
        generate = getattr(self.module, "generate", None)
        if not callable(generate):
            raise EnvError(f"env file {path} is written to RL2's interface but defines no generate(config, tokenizer, "
                           f"router_url, sample) (RL2's: generate = partial(base_generate, env_step_fn=env_step))")
        if not inspect.iscoroutinefunction(getattr(generate, "func", generate)):
            raise EnvError(f"env file {path}: generate must be async, as RL2 runs it")
        self.generate = generate


class RL2RolloutConfig(dict):
    """The `config` RL2 passes to `generate` (its `rollout.train` / `rollout.test` section), with
    attribute access as OmegaConf gives."""

    __getattr__ = dict.__getitem__


def rl2_rollout_config(params: SamplingParams, apply_chat_template: bool, messages_key: str, prompt_key: str,
                       responses_per_prompt: int) -> RL2RolloutConfig:
    sampling = {"temperature": params.temperature, "max_new_tokens": params.max_new_tokens,
                "stop": params.stop or None}
    return RL2RolloutConfig(sampling_params=RL2RolloutConfig(sampling), apply_chat_template=apply_chat_template,
                            messages_key=messages_key, prompt_key=prompt_key, responses_per_prompt=responses_per_prompt,
                            partial_rollout=False, dynamic_filtering=False)


def rl2_head_rollout(
    server: OpenAIServer,
    engine: Engine,
    env_file: RL2HeadFile,
    tokenizer,
    prompts: list[dict],
    responses_per_prompt: int,
    params: SamplingParams,
    config: RL2RolloutConfig,
    max_requests: int,
    max_length: int | None = None,
    first_group: int = 0,
    version: int = 0,
    timeout: float = 600.0,
) -> list[Trajectory]:
    """`responses_per_prompt` trajectories of each prompt (its dataset row as `sample.sample`), grouped."""
    from rl2.chat.tool_parsers import get_tool_parser

    rows = [prompt for prompt in prompts for _ in range(responses_per_prompt)]
    samples = [Sample(sample=dict(row.get("row") or _row(row))) for row in rows]
    # Sessions for the chat completions a file makes for itself (a summariser, a judge): served, not trained.
    hermes = get_tool_parser("hermes")
    sessions = [AgentSession(tokenizer, hermes) for _ in rows]
    errors: list[list[str]] = [[] for _ in rows]

    async def run_one(i: int, key: str) -> None:
        try:
            await asyncio.wait_for(env_file.generate(config, tokenizer, server.session_url(key), samples[i]), timeout)
            if samples[i].status != Sample.Status.DONE:
                errors[i].append(f"env file {env_file.path}: generate returned with the sample {samples[i].status.value}")
        except asyncio.TimeoutError:
            errors[i].append(f"env file {env_file.path}: generate did not finish within {timeout:g} s")
        except Exception as error:  # noqa: BLE001 - the user's file: recorded on its trajectory
            errors[i].append(f"env file {env_file.path}: generate raised{where(error, env_file.path)} "
                             f"{describe_exception(error)}")

    server.serve_rollout(engine, sessions, run_one, params, version, max_requests, max_length)
    return [_trajectory(sample, row, errors[i], first_group + i // responses_per_prompt, version)
            for i, (sample, row) in enumerate(zip(samples, rows))]


def _row(prompt: dict) -> dict:
    return {key: value for key, value in prompt.items() if key not in ("prompt_ids", "tools")}


def _trajectory(sample: Sample, prompt: dict, errors: list[str], group: int, version: int) -> Trajectory:
    """The sample's sequences one after the other (each trained as its own when there are several)."""
    token_ids, action_mask, logprobs, starts = [], [], [], []
    for state_dict in sample.state_dicts:
        starts.append(len(token_ids))
        token_ids += state_dict["states"]
        action_mask += state_dict["action_mask"]
        logprobs += state_dict["logps"]
    if not token_ids:
        errors = errors or ["the episode produced no sequence"]
        token_ids = list(prompt["prompt_ids"])
        action_mask, logprobs = [0] * len(token_ids), [0.0] * len(token_ids)
    reward = sum(state_dict["rewards"][-1] for state_dict in sample.state_dicts) if sample.state_dicts else None
    messages = [{"role": "user", "content": sample.state_text}, {"role": "assistant", "content": sample.action_text}]
    return Trajectory(
        messages=messages, answer=prompt.get("answer"), group=group, token_ids=token_ids, action_mask=action_mask,
        logprobs=logprobs, turns=sample.turn, truncated=any(sample.metrics.get("length_clip_ratio", [])), done=True,
        reward=None if errors else float(reward), errors=list(errors), started=version,
        versions=[version if m else -1 for m in action_mask], turn_starts=starts if len(starts) > 1 else None,
        source=prompt.get("source"),
    )
