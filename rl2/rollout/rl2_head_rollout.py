"""RL2 HEAD's env files, run unchanged: each trajectory is an RL2 `Sample` driven by the file's
`generate(config, tokenizer, router_url, sample)` (RL2's `base_generate` with the file's `env_step`, or the
file's own), against this rank's server (`rl2.serve.openai_server`: SGLang's `/generate`, and the
`/v1/chat/completions`, `/v1/models`, `/list_workers`, `/parse_function_call` its files use) at a URL of
the trajectory's own. The sample's sequences (`state_dicts`, token ids as sampled) become the trajectory's,
its reward the sum of each sequence's last reward, as RL2 trains them (`rl2.compat.rl2_head_api`).

As under RL2:
- `generate` runs on an event loop in the main thread of a process that loaded the file once
  (`rl2.rollout.rl2_head_worker`, `rollout.env_workers` of them a rank, each running its share of the
  episodes concurrently): math-verify's signal timeouts work, module-level asyncio objects and globals
  live on; a worker that crashes or hangs costs its share (errors naming the file), not the run. With
  `rollout.env_workers=0` it runs in this process on the server's loop thread instead (no signals there).
- `config` is an OmegaConf section with the keys of RL2's `rollout.train` / `rollout.test`
  (`rl2_rollout_config`).
- a request to any trajectory URL goes to the trajectory that makes it (`rl2.compat.rl2_head_api.routed`), so
  a router URL kept in a global (deep_research.py) works; the file's own chat completions (a judge, a
  summariser) are served, not trained, and are no turns.
- `rollout.max_turns` bounds the `/generate` calls: the one past it is answered as SGLang answers an
  aborted request, the file returns as it does after an abort, and the episode ends there, scored
  (`end_at_turn_limit`), as an episode the env had ended at that state.
"""

import asyncio
import copy
import logging
import os
from typing import Any

from omegaconf import DictConfig, OmegaConf

from rl2.compat.rl2_head_api import Sample
from rl2.config import DataConfig, RolloutConfig
from rl2.engines import Engine, SamplingParams
from rl2.rollout.env_file import EnvArgs
from rl2.rollout.rl2_head_worker import load_generate, run_episodes
from rl2.rollout.rl2_head_workers import RL2HeadWorkers
from rl2.rollout.trajectory import Trajectory
from rl2.serve.openai_server import OpenAIServer
from rl2.serve.session import AgentSession

logger = logging.getLogger(__name__)

SERVED_PER_TURN = 16  # chat completions a file may ask for itself (a judge, a summariser) per /generate turn


class RL2HeadFile:
    """An env file written to RL2 HEAD's interface, loaded and its `generate` checked at start-up (`EnvError`):
    in `workers` worker processes given `tokenizer`, each limited to `memory_mb` (0: no limit), or, with
    `workers=0`, in this process (`module`)."""

    def __init__(self, path: str, args: dict[str, Any] | None = None, tokenizer=None, workers: int = 0,
                 memory_mb: int = 0):
        self.path, self.module = path, None
        self._workers: RL2HeadWorkers | None = None
        if workers > 0:
            if tokenizer is None:
                raise ValueError("RL2HeadFile: worker processes need the tokenizer")
            self._workers = RL2HeadWorkers(path, dict(args or {}), tokenizer, workers, memory_mb)
        else:
            self.module, self._generate = load_generate(path, EnvArgs(args, path))

    def shares(self, count: int) -> list[list[int]]:
        """Which episodes run together: a worker's share each (in this process: each alone)."""
        return self._workers.shares(count) if self._workers else [[i] for i in range(count)]

    async def run(self, config: DictConfig, tokenizer, urls: list[str], samples: list[Sample],
                  timeout: float) -> list[tuple[Sample, str | None]]:
        """The episodes of one share: each sample as its episode left it, and why it failed (None: it did not)."""
        if self._workers is not None:
            return await self._workers.run(config, urls, samples, timeout)
        errors = await run_episodes(self._generate, self.path, config, tokenizer, urls, samples, timeout)
        return list(zip(samples, errors))

    def close(self) -> None:
        if self._workers is not None:
            self._workers.close()


def rl2_rollout_config(data: DataConfig, rollout: RolloutConfig, save_dir: str | None, params: SamplingParams,
                       responses_per_prompt: int, train: bool = True) -> DictConfig:
    """The `config` RL2 passes to `generate`: its `rollout.train` (or `rollout.test`) section, with the keys
    RL2's ppo.yaml gives it, filled from rl2's `data` and `rollout` sections, the run's `save_dir`
    (`actor.save_dir`) and the rollout's sampling `params`."""
    section = "train" if train else "test"
    return OmegaConf.create({
        "path": data.path if train else data.test_path,
        "prompt_key": data.prompt_key,
        "messages_key": data.messages_key,
        "apply_chat_template": data.apply_chat_template,
        "prompts_per_rollout": data.prompts_per_rollout,
        "responses_per_prompt": responses_per_prompt,
        "sampling_params": {"temperature": params.temperature, "max_new_tokens": params.max_new_tokens,
                            "stop": list(params.stop) or None},
        "dynamic_filtering": train and rollout.dynamic_filtering,
        "partial_rollout": train and rollout.partial_rollout,
        "save_dir": os.path.join(save_dir or "ckpts", section),
    })


def rl2_head_rollout(
    server: OpenAIServer,
    engine: Engine,
    env_file: RL2HeadFile,
    tokenizer,
    prompts: list[dict],
    responses_per_prompt: int,
    params: SamplingParams,
    config: DictConfig,
    max_requests: int,
    max_length: int,
    first_group: int = 0,
    version: int = 0,
    timeout: float = 600.0,
) -> list[Trajectory]:
    """`responses_per_prompt` trajectories of each prompt (its dataset row as `sample.sample`), grouped, each
    at most `max_requests` `/generate` turns (`rollout.max_turns`) and `timeout` seconds; the server says
    `max_length` is the model's length (`/v1/models`)."""
    from rl2.chat.tool_parsers import get_tool_parser

    rows = [prompt for prompt in prompts for _ in range(responses_per_prompt)]
    samples = [Sample(sample=copy.deepcopy(row.get("row") or _row(row))) for row in rows]
    # Sessions for the chat completions a file makes for itself (a summariser, a judge): served, not trained.
    hermes = get_tool_parser("hermes")
    sessions = [AgentSession(tokenizer, hermes) for _ in rows]
    errors: list[str | None] = [None] * len(rows)
    share_of = {i: share for share in env_file.shares(len(rows)) for i in share}
    urls: dict[int, str] = {}
    ended: dict[int, asyncio.Future] = {}  # by a share's first episode: its run is over

    async def run_one(i: int, key: str) -> None:
        """Episode i's part: its URL known; the last of its share to start runs the share; all wait for it."""
        share = share_of[i]
        urls[i] = server.session_url(key)
        if share[0] not in ended:
            ended[share[0]] = asyncio.get_running_loop().create_future()
        done = ended[share[0]]
        if all(j in urls for j in share):
            try:
                outcomes = await env_file.run(config, tokenizer, [urls[j] for j in share], [samples[j] for j in share],
                                              timeout)
                for j, (sample, error) in zip(share, outcomes):
                    samples[j], errors[j] = sample, error
                done.set_result(None)
            except Exception as error:
                done.set_exception(error)
            finally:
                if not done.done():
                    done.cancel()
        await done

    server.serve_rollout(engine, sessions, run_one, params, version, max_requests, max_length,
                         served_requests=max_requests * SERVED_PER_TURN)
    trajectories, cut = [], 0
    for i, (sample, row) in enumerate(zip(samples, rows)):
        if errors[i] is None and sample.status == Sample.Status.ABORTED and sessions[i].requests_started >= max_requests:
            end_at_turn_limit(sample)
            cut += 1
        if errors[i] is None and sample.status != Sample.Status.DONE:
            errors[i] = f"env file {env_file.path}: generate returned with the sample {sample.status.value}"
        fallback = row.get("prompt_ids") or [tokenizer.eos_token_id or 0]
        trajectories.append(_trajectory(sample, row, errors[i], first_group + i // responses_per_prompt, version,
                                        fallback))
    if cut:
        logger.warning("%d of %d episodes of env file %s reached rollout.max_turns=%d and ended there, scored as the "
                       "env left them; a file that holds something until its episode is done (gem.py's environment "
                       "pool) never gets it back: set rollout.max_turns to the most /generate calls an episode makes",
                       cut, len(rows), env_file.path, max_requests)
    return trajectories


def end_at_turn_limit(sample: Sample) -> None:
    """End an episode the turn limit cut (its last `/generate` aborted) as one the env ended at that state:
    its sequence up to its last action, the observation after it trimmed (nothing was generated from it), so
    its reward is the last env_step's on that action; a sequence begun since (no action yet) is dropped."""
    state_dict = sample.state_dict
    last = max((k for k, mask in enumerate(state_dict.get("action_mask", [])) if mask), default=-1)
    if last >= 0:
        sample.state_dicts.append({key: values[:last + 1] for key, values in state_dict.items()})
    sample.status = Sample.Status.DONE
    sample.metrics["turns"].append(sample.turn)
    sample.metrics["rewards"].append(sum(state["rewards"][-1] for state in sample.state_dicts))


def _row(prompt: dict) -> dict:
    return {key: value for key, value in prompt.items() if key not in ("prompt_ids", "tools")}


def _trajectory(sample: Sample, prompt: dict, error: str | None, group: int, version: int,
                fallback_ids: list[int]) -> Trajectory:
    """The sample's sequences one after the other (each trained as its own when there are several); a
    sample with none (an error) holds `fallback_ids`, untrained."""
    token_ids, action_mask, logprobs, starts = [], [], [], []
    for state_dict in sample.state_dicts:
        starts.append(len(token_ids))
        token_ids += state_dict["states"]
        action_mask += state_dict["action_mask"]
        logprobs += state_dict["logps"]
    errors = [error] if error else []
    if not token_ids:
        errors = errors or ["the episode produced no sequence"]
        token_ids = list(fallback_ids)
        action_mask, logprobs = [0] * len(token_ids), [0.0] * len(token_ids)
    reward = sum(state_dict["rewards"][-1] for state_dict in sample.state_dicts) if sample.state_dicts else None
    messages = [{"role": "user", "content": sample.state_text}, {"role": "assistant", "content": sample.action_text}]
    return Trajectory(
        messages=messages, answer=prompt.get("answer"), group=group, token_ids=token_ids, action_mask=action_mask,
        logprobs=logprobs, turns=sample.turn, truncated=any(sample.metrics.get("length_clip_ratio", [])), done=True,
        reward=None if errors else float(reward), errors=errors, started=version,
        versions=[version if m else -1 for m in action_mask], turn_starts=starts if len(starts) > 1 else None,
        source=prompt.get("source"),
    )
