"""RL2 HEAD's env-file interface, so its env files run unchanged.

RL2 (github.com/ChenmienTan/RL2) moved its env files, in Oct 2025, from `reward_fn` / `interact` to a
`Sample` per trajectory: `async def env_step(sample) -> {"next_state", "done", "reward"}` with
`generate = partial(base_generate, env_step_fn=env_step)`, or a `generate(config, tokenizer, router_url,
sample)` of the file's own that posts to SGLang's `/generate` at `router_url`. Such files import
`from RL2.datasets import Sample, base_generate, initialize_state_dict, add_llm_response, add_env_response`
and `from RL2.utils.communication import async_request`. This module is those names, written here to RL2's
behaviour (read in RL2's `RL2/datasets/rl.py` and `RL2/utils/communication.py` at HEAD, 9161ede):
- a `Sample` holds the row (`sample.sample`), the state and action texts, and `state_dicts`: the token
  sequences it trains on (`states`, `actions`, `action_mask`, `logps`, `rewards`);
- a response's output ids and log-probs are appended as they were sampled (token-in, token-out);
- a `next_state` that extends `state_text + action_text` appends its new text's tokens; one that does not
  starts a new sequence; the episode's reward is the sum of each sequence's last reward.
`rl2_modules()` are what `rl2.rollout.rl2_head_worker` installs under those names while it loads such a file.

One difference, for rl2 gives each trajectory a URL of its own (`/s/{key}` on the rank's server) where RL2
gives every trajectory its router's: `async_request` sends a request for any trajectory URL of that server
to the URL of the trajectory whose task makes it (`TRAJECTORY_URL`, set in each trajectory's task). A file
that keeps the router URL in a global (deep_research.py: `ROUTER_URL`, `SERVER_URL`, set by whichever
trajectory came first or last, even at an earlier step) so still reaches its own trajectory.
"""

import asyncio
import types
from collections import defaultdict
from contextvars import ContextVar
from dataclasses import dataclass, field
from enum import Enum
from typing import Any, Callable

import aiohttp

# The URL of the trajectory whose task is running (each trajectory's task sets its own; a context variable:
# its value is per task, not shared).
TRAJECTORY_URL: ContextVar[str | None] = ContextVar("rl2_trajectory_url", default=None)


@dataclass
class Sample:
    """One trajectory, as RL2 HEAD's env files see it."""

    class Status(Enum):
        RUNNING = "running"
        ABORTED = "aborted"
        DONE = "done"

    sample: dict[str, Any] = field(default_factory=dict)
    state_text: str = ""
    action_text: str = ""
    state_dict: dict[str, list] = field(default_factory=dict)
    state_dicts: list[dict[str, list]] = field(default_factory=list)
    turn: int = 0
    metrics: dict[str, list] = field(default_factory=lambda: defaultdict(list))
    status: "Sample.Status" = Status.RUNNING
    previous_action_text: str = ""
    previous_response_length: int = 0

    def to_json(self) -> dict[str, Any]:
        data = dict(self.__dict__)
        data["metrics"], data["status"] = dict(self.metrics), self.status.value
        return data


def initialize_state_dict(tokenizer, state_text: str) -> dict[str, list]:
    """A sequence that starts with `state_text`'s tokens, none of them actions."""
    state = tokenizer.encode(state_text, add_special_tokens=False)
    return {"states": state, "actions": [0] * len(state), "action_mask": [0] * len(state),
            "logps": [0.0] * len(state), "rewards": [0.0] * len(state)}


def add_llm_response(sample: Sample, response: dict[str, Any]) -> None:
    """Append a `/generate` response's sampled ids and log-probs to the sample's sequence."""
    sample.action_text = sample.previous_action_text + response["text"]
    meta_info = response["meta_info"]
    logprobs = meta_info.get("output_token_logprobs") or []
    if logprobs and len(logprobs[0]) == 3:
        logps = [float(entry[0]) for entry in logprobs]
        actions = [int(entry[1]) for entry in logprobs]
        sample.state_dict["states"].extend(actions)
        sample.state_dict["actions"].extend(actions)
        sample.state_dict["action_mask"].extend([1] * len(actions))
        sample.state_dict["logps"].extend(logps)
        sample.state_dict["rewards"].extend([0.0] * len(actions))
    finish_reason = meta_info["finish_reason"]["type"]
    if finish_reason == "abort":
        sample.status = Sample.Status.ABORTED
        sample.previous_action_text = sample.action_text
        sample.previous_response_length += meta_info["completion_tokens"]
        return
    sample.turn += 1
    sample.metrics["response_length"].append(sample.previous_response_length + meta_info["completion_tokens"])
    sample.metrics["length_clip_ratio"].append(finish_reason == "length")
    sample.previous_action_text, sample.previous_response_length = "", 0


def add_env_response(tokenizer, sample: Sample, response: dict[str, Any]) -> None:
    """Take an `env_step` response: its reward on the last token; done, or the next state appended (when
    it extends what came before) or begun as a new sequence."""
    sample.state_dict["rewards"][-1] = response["reward"]
    if response["done"]:
        sample.status = Sample.Status.DONE
        sample.state_dicts.append(sample.state_dict)
        sample.metrics["turns"].append(sample.turn)
        sample.metrics["rewards"].append(sum(state_dict["rewards"][-1] for state_dict in sample.state_dicts))
        return
    before = sample.state_text + sample.action_text
    if response["next_state"].startswith(before):
        delta = initialize_state_dict(tokenizer, response["next_state"][len(before):])
        for key, values in delta.items():
            sample.state_dict[key].extend(values)
    else:
        sample.state_dicts.append(sample.state_dict)
        sample.state_dict = initialize_state_dict(tokenizer, response["next_state"])
    sample.state_text = response["next_state"]


async def base_generate(config, tokenizer, router_url: str, sample: Sample, env_step_fn: Callable) -> None:
    """RL2's generate loop: the prompt (through the chat template, or the raw prompt), then `/generate` and
    `env_step_fn` in turn until the episode is done (or the generation aborted)."""
    sampling_params = _plain(config.sampling_params)
    if sample.status == Sample.Status.RUNNING:
        if config.apply_chat_template:
            sample.state_text = tokenizer.apply_chat_template(sample.sample[config.messages_key],
                                                              add_generation_prompt=True, tokenize=False)
        else:
            sample.state_text = sample.sample[config.prompt_key]
        sample.state_dict = initialize_state_dict(tokenizer, sample.state_text)
    elif sample.status == Sample.Status.ABORTED:
        sample.status = Sample.Status.RUNNING
    else:
        return
    while True:
        response = await async_request(router_url, "generate", json={
            "input_ids": sample.state_dict["states"],
            "sampling_params": {**sampling_params,
                                "max_new_tokens": sampling_params["max_new_tokens"] - sample.previous_response_length,
                                "no_stop_trim": True},
            "return_logprob": True,
        })
        add_llm_response(sample, response)
        if sample.status == Sample.Status.ABORTED:
            return
        add_env_response(tokenizer, sample, await env_step_fn(sample))
        if sample.status == Sample.Status.DONE:
            return


async def async_request(url: str | list[str], endpoint: str, method: str = "POST", max_trials: int = 3,
                        retry_delay: float = 1, **kwargs) -> Any:
    """`method` `url/endpoint` with aiohttp's keyword arguments (`json=`, `params=`, `headers=`), its JSON (or
    text) reply; retried `max_trials` times, then the last error raised."""
    if isinstance(url, list):
        return await asyncio.gather(*(async_request(u, endpoint, method, max_trials, retry_delay, **kwargs) for u in url))
    url = routed(url)
    for trial in range(max_trials):
        try:  # no time limit, as RL2's session (the trajectory's own timeout bounds it)
            async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=None)) as session:
                async with session.request(method, f"{url}/{endpoint}", **kwargs) as response:
                    response.raise_for_status()
                    try:
                        return await response.json(content_type=None)
                    except ValueError:
                        return await response.text()
        except (aiohttp.ClientError, asyncio.TimeoutError):
            if trial == max_trials - 1:
                raise
            await asyncio.sleep(retry_delay)


def routed(url: str) -> str:
    """`url`, or, where it is a trajectory URL (`.../s/{key}`, any key) of the server of the calling
    trajectory's own (`TRAJECTORY_URL`), that trajectory's URL followed by the rest of `url`."""
    own = TRAJECTORY_URL.get()
    if not own or "/s/" not in own:
        return url
    prefix = own[:own.rindex("/s/") + len("/s/")]
    if not url.startswith(prefix):
        return url
    _, slash, rest = url[len(prefix):].partition("/")
    return own + slash + rest


def _plain(value: Any) -> Any:
    """An OmegaConf container (RL2 passes its config) or a plain one, as plain dicts and lists."""
    try:
        from omegaconf import OmegaConf

        if OmegaConf.is_config(value):
            return OmegaConf.to_container(value, resolve=True)
    except ImportError:
        pass
    return dict(value)


def rl2_modules() -> dict[str, types.ModuleType]:
    """Modules named as RL2's (`RL2`, `RL2.datasets`, `RL2.utils`, `RL2.utils.communication`) holding this
    module's names, for an RL2 HEAD env file to import."""
    package, datasets, utils, communication = (types.ModuleType(name) for name in
                                               ("RL2", "RL2.datasets", "RL2.utils", "RL2.utils.communication"))
    for name in ("Sample", "initialize_state_dict", "add_llm_response", "add_env_response", "base_generate"):
        setattr(datasets, name, globals()[name])
    communication.async_request = async_request
    package.__path__, utils.__path__ = [], []
    package.datasets, package.utils, utils.communication = datasets, utils, communication
    return {"RL2": package, "RL2.datasets": datasets, "RL2.utils": utils, "RL2.utils.communication": communication}
