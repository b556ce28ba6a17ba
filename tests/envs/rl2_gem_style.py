"""An RL2 HEAD env file in the shape of RL2's envs/gem.py: a module-level pool of game environments guarded by
an asyncio.Semaphore and an asyncio.Lock made at import (they bind to the first event loop that waits on
them), its own generate (OmegaConf.to_container of config.sampling_params, RL2's helpers), each turn's state
the chat template of the game's observation. `Game` stands in for a `gem.make(...)` environment."""

import asyncio
from collections import deque
from typing import Any

from omegaconf import OmegaConf

from RL2.datasets import Sample, add_env_response, add_llm_response, initialize_state_dict
from RL2.utils.communication import async_request

POOL_SIZE = 2
WORDS = ["banana", "letter", "abracadabra"]


class Game:
    """How many a's in a word, two words a game (terminated after the second answer)."""

    def __init__(self, seed: int):
        self.seed = seed

    def reset(self) -> tuple[str, dict]:
        self.round = 0
        return self._question(), {}

    def step(self, action: str) -> tuple[str, float, bool, bool, dict]:
        right = str(WORDS[(self.seed + self.round) % len(WORDS)].count("a")) in action
        self.round += 1
        terminated = self.round == 2
        return ("" if terminated else self._question()), float(right), terminated, False, {}

    def _question(self) -> str:
        return f"How many a's in {WORDS[(self.seed + self.round) % len(WORDS)]}?"


GAMES = [Game(seed) for seed in range(POOL_SIZE)]
FREE = deque(range(POOL_SIZE))
SEMAPHORE = asyncio.Semaphore(POOL_SIZE)
LOCK = asyncio.Lock()


def chat(tokenizer, observation: str) -> str:
    content = f"Question: {observation}\nAnswer with a number."
    return tokenizer.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                         tokenize=False)


async def env_step(tokenizer, sample: Sample) -> dict[str, Any]:
    observation, reward, terminated, truncated, _ = GAMES[sample.sample["game"]].step(sample.action_text)
    done = terminated or truncated
    if done:
        async with LOCK:
            FREE.append(sample.sample["game"])
        SEMAPHORE.release()
    return {"next_state": chat(tokenizer, observation), "done": done, "reward": reward}


async def generate(config, tokenizer, router_url: str, sample: Sample) -> None:
    sampling_params = OmegaConf.to_container(config.sampling_params)
    match sample.status:
        case Sample.Status.RUNNING:
            await SEMAPHORE.acquire()
            async with LOCK:
                game = FREE.popleft()
            observation, _ = GAMES[game].reset()
            await asyncio.sleep(0.01)  # holds its game a while: the others wait on the semaphore
            sample.sample["game"] = game
            sample.state_text = chat(tokenizer, observation)
            sample.state_dict = initialize_state_dict(tokenizer, sample.state_text)
        case Sample.Status.ABORTED:
            sample.status = Sample.Status.RUNNING
        case Sample.Status.DONE:
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
        add_env_response(tokenizer, sample, await env_step(tokenizer, sample))
        if sample.status == Sample.Status.DONE:
            return
