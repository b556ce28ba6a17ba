"""Env file for search with native function calling: the model calls `search(query)`, a typed function
whose schema its chat template shows it, and answers in `<answer>...</answer>` (scored as Search-R1
scores, `envs/search.py`'s exact match). For instruct models with a template that has tools (Qwen2.5,
Qwen3, Llama 3.x); base models keep Search-R1's text protocol in `envs/search.py`.

A search the service does not answer is retried (counted in `faults/search_retries`); one that still
fails raises `rl2.tools.ToolUnavailable`: an env error, never a tool message the model would learn from.
Settings as `envs/search.py` (search_url, search_topk, search_timeout, search_retries, search_api_key).
"""

from search import DEFAULT_URL, reward_fn  # noqa: F401  (reward_fn: this file's)

from rl2.rollout.env import EnvArgs
from rl2.tools import ToolUnavailable, search_client
from rl2.tools.faults import FaultCounter
from rl2.tools.search_client import SearchError, passages_to_string, retrieve

env_args = globals().get("env_args", EnvArgs())  # rollout.env_args, set by rl2 when it loads this file
faults = FaultCounter()  # search_retries, for the trainer's faults/* metrics


async def search(query: str) -> str:
    """Search Wikipedia and return the top passages, each with its title.

    Args:
        query: what to look for, in a few words
    """
    if not query.strip():
        raise ValueError("the query is empty")
    try:
        hits = await retrieve([query], env_args.get("search_url", DEFAULT_URL), topk=int(env_args.get("search_topk", 3)),
                              timeout=float(env_args.get("search_timeout", 10.0)),
                              retries=int(env_args.get("search_retries", search_client.RETRIES)), faults=faults,
                              api_key=env_args.get("search_api_key", None))
    except SearchError as error:
        raise ToolUnavailable(str(error)) from error
    return passages_to_string(hits[0]).strip()


TOOLS = [search]
