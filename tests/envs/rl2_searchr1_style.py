"""An RL2 HEAD env file in the shape of RL2's envs/searchr1.py (run by its scripts with rollout.train.max_turns=2
until Dec 2025): an action with neither a search nor an answer gets a note appended and the episode goes on,
a search posts to a retrieval service, an answer ends it with exact match. A policy that never answers reaches
the turn limit, where it must be scored (0.0 here), not dropped."""

import re
import string
from functools import partial
from typing import Any

import aiohttp

from RL2.datasets import Sample, base_generate

SEARCH_URL = "http://127.0.0.1:9/search"  # nothing listens: a test policy never searches
INVALID = "\nMy previous action is invalid. Put a query between <search> and </search>, or the answer between " \
          "<answer> and </answer>. Let me try again.\n"


def normalize(text: str) -> str:
    text = "".join(ch for ch in text.lower() if ch not in set(string.punctuation))
    return " ".join(re.sub(r"\b(a|an|the)\b", " ", text).split())


async def env_step(sample: Sample) -> dict[str, Any]:
    found = re.search(r"<(search|answer)>(.*?)</\1>", sample.action_text, re.DOTALL)
    so_far = sample.state_text + sample.action_text
    if found is None:
        return {"next_state": so_far + INVALID, "done": False, "reward": 0.0}
    if found.group(1) == "search":
        async with aiohttp.ClientSession() as session:
            async with session.post(SEARCH_URL, json={"query": found.group(2).strip()}) as response:
                passage = (await response.json())["passage"].strip()
        return {"next_state": so_far + f"\n\n<information>{passage}</information>\n\n", "done": False, "reward": 0.0}
    answers = sample.sample["answer"]
    answers = [answers] if isinstance(answers, str) else answers
    return {"next_state": None, "done": True,
            "reward": float(normalize(found.group(2)) in [normalize(a) for a in answers])}


generate = partial(base_generate, env_step_fn=env_step)
