"""Env file for Search-R1: answer questions by searching a retrieval service.

The model reasons in `<think>...</think>`, searches with `<search>query</search>` (the env answers
with a tool message `<information>Doc 1(Title: ...) ...</information>` holding the top documents)
and ends with `<answer>...</answer>`. Put `PROMPT` in the data's user message, as Search-R1 does:
`{"messages": [{"role": "user", "content": make_prompt(question)}], "answer": [gold, ...]}` (see
recipes/data/search_qa.jsonl).

`interact` reads the last assistant message: an `<answer>` ends the trajectory; else the first
`<search>` is looked up; else Search-R1's invalid-action message asks the model to try again. A
search the service does not answer is retried (riding out a service restart of a few seconds, each
retry counted in the step's `faults/search_retries`); one that still fails raises `SearchError`, an
env error (the trajectory is left out of training), never a tool message the model would learn
from. Stop generation at `</search>` and `</answer>` (sampling params `stop: ["</search>",
"</answer>"]`) so that a turn ends at its action, as in Search-R1.

`reward_fn` is Search-R1's exact match: 1.0 when the last `<answer>` of the final assistant message
equals one of the gold answers (a string, a list of strings, or Search-R1's `{"target": [...]}`)
after normalisation (lower case, no punctuation, no articles a/an/the, single spaces); else 0.0.

Start a service first, e.g. `python -m rl2.tools.retrieval_server --corpus corpus.jsonl --port 8000`.
Settings, read at each call from `rollout.env_args` in lower case (search_url, ...), else the environment:
    SEARCH_URL       the service's retrieve endpoint (default http://127.0.0.1:8000/retrieve)
    SEARCH_TOPK      documents per search (default 3)
    SEARCH_TIMEOUT   seconds per request attempt (default 10)
    SEARCH_RETRIES   further attempts after a connection error, timeout or HTTP 5xx (default 6,
                     after 0.5 s doubling up to 8 s: 23.5 s of waiting in all)
    SEARCH_API_KEY   sent as `Authorization: Bearer <key>` to a service started with --api-key
"""

import re
import string

from rl2.tools import search_client
from rl2.tools.faults import FaultCounter
from rl2.tools.search_client import passages_to_string, retrieve
from rl2.rollout.env import EnvArgs

env_args = globals().get("env_args", EnvArgs())  # rollout.env_args, set by rl2 when it loads this file

faults = FaultCounter()  # search_retries, for the trainer's faults/* metrics (rl2.rollout.env reads it)

PROMPT = (
    "Answer the given question. "
    "You must conduct reasoning inside <think> and </think> first every time you get new information. "
    "After reasoning, if you find you lack some knowledge, you can call a search engine by <search> query "
    "</search> and it will return the top searched results between <information> and </information>. "
    "You can search as many times as your want. "
    "If you find no further external knowledge needed, you can directly provide the answer inside <answer> "
    "and </answer>, without detailed illustrations. For example, <answer> Beijing </answer>. "
    "Question: {question}\n"
)  # Search-R1's prompt (scripts/data_process/nq_search.py), verbatim

INVALID_ACTION = (
    "My previous action is invalid. "
    "If I want to search, I should put the query between <search> and </search>. "
    "If I want to give the final answer, I should put the answer between <answer> and </answer>. "
    "Let me try again."
)  # Search-R1's reply to a turn with neither action

DEFAULT_URL = "http://127.0.0.1:8000/retrieve"
ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
SEARCH = re.compile(r"<search>(.*?)</search>", re.DOTALL)


def make_prompt(question: str) -> str:
    """The user message for `question`: Search-R1's instructions followed by the question."""
    return PROMPT.format(question=question.strip())


async def interact(messages: list[dict]) -> list[dict]:
    content = messages[-1]["content"] if messages and messages[-1].get("role") == "assistant" else ""
    if ANSWER.search(content):
        return []
    search = SEARCH.search(content)
    query = search.group(1).strip() if search else ""
    if not query:
        return [{"role": "tool", "content": INVALID_ACTION}]
    url = env_args.get("search_url", DEFAULT_URL)
    hits = await retrieve([query], url, topk=_setting("search_topk", 3, int),
                          timeout=_setting("search_timeout", 10.0, float),
                          retries=_setting("search_retries", search_client.RETRIES, int), faults=faults,
                          api_key=env_args.get("search_api_key", None))
    return [{"role": "tool", "content": f"<information>{passages_to_string(hits[0]).strip()}</information>"}]


def reward_fn(messages: list[dict], answer) -> float:
    final = next((m["content"] for m in reversed(messages) if m.get("role") == "assistant"), "")
    answers = ANSWER.findall(final)
    if not answers:
        return 0.0
    golds = answer.get("target", []) if isinstance(answer, dict) else answer
    golds = [golds] if isinstance(golds, (str, int, float)) else golds
    predicted = normalize_answer(answers[-1])
    return float(any(predicted == normalize_answer(str(gold)) for gold in golds))


def normalize_answer(text: str) -> str:
    """Search-R1's (and SQuAD's) normalisation: lower case, drop punctuation, then the articles
    a / an / the, then collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in string.punctuation)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def _setting(name: str, default, kind):
    """`rollout.env_args.<name>`, else the environment variable NAME, else `default`; checked in range."""
    value = env_args.get(name, kind(default))
    if value < 0 or (name == "search_topk" and value < 1):
        raise ValueError(f"search env setting {name}={value!r} is out of range")
    return value
