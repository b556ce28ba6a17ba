"""Env file whose reward is an LLM judge's score of the last assistant message (LLM-as-judge).

    torchrun --nproc_per_node=8 -m rl2.trainer.ppo rollout.env_path=envs/judge_reward.py \\
        rollout.env_args.judge_base_url=http://127.0.0.1:8000/v1 rollout.env_args.judge_model=Qwen/Qwen2.5-72B-Instruct ...

The judge is any OpenAI-compatible chat endpoint (vLLM, SGLang, OpenAI): it gets the rubric with the
question (the last user message), the response (the last assistant message) and the row's `answer` as
the reference (empty when the data has none), and replies with a score (`rl2.tools.judge`); the reward
is the score divided by JUDGE_MAX_SCORE, in [0, 1]. The same question and response are judged once per run.

A judge that cannot be reached (after the retries, each counted in the step's `faults/judge_retries`),
refuses, or replies without a score makes `reward_fn` raise `JudgeError`: an env error (the trajectory
gets no reward and is left out of training), never a reward of 0. `rollout.env_timeout` (60 s by default)
bounds each call, retries included: raise it for a slow judge.

Settings, from `rollout.env_args` in lower case (judge_base_url, ...), else the environment:
    JUDGE_BASE_URL     the API's root, requests go to {JUDGE_BASE_URL}/chat/completions (required)
    JUDGE_MODEL        the judge's model name (required)
    JUDGE_API_KEY      sent as `Authorization: Bearer <key>`
    JUDGE_RUBRIC       the rubric, a text with {question}, {response} and {answer} (default
                       rl2.tools.judge.DEFAULT_RUBRIC: a score 0-10 in <score>N</score>), or
    JUDGE_RUBRIC_FILE  a file holding it
    JUDGE_MAX_SCORE    the rubric's best score (default 10)
    JUDGE_CONCURRENCY  requests in flight at once (default 16)
    JUDGE_TIMEOUT      seconds per request attempt (default 60)
    JUDGE_RETRIES      further attempts after a connection error, timeout, HTTP 5xx or 429 (default 6)
    JUDGE_MAX_TOKENS   the judge's reply length limit (default 1024)
"""

from rl2.rollout.env import EnvArgs
from rl2.tools import judge as judge_client
from rl2.tools.judge import Judge

env_args = globals().get("env_args", EnvArgs())  # rollout.env_args, set by rl2 when it loads this file


def _rubric() -> str:
    path = env_args.get("judge_rubric_file", None)
    if path:
        with open(path) as file:
            return file.read()
    return env_args.get("judge_rubric", judge_client.DEFAULT_RUBRIC)


if not env_args.get("judge_base_url") or not env_args.get("judge_model"):
    raise RuntimeError("envs/judge_reward.py: set rollout.env_args.judge_base_url and judge_model (or JUDGE_BASE_URL "
                       "and JUDGE_MODEL) to an OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1")

# Made once per loaded env file (rl2 loads each env file as a fresh module); rl2 logs its faults.
judge = Judge(
    env_args.get("judge_base_url"),
    env_args.get("judge_model"),
    rubric=_rubric(),
    max_score=env_args.get("judge_max_score", 10.0),
    api_key=env_args.get("judge_api_key", None),
    concurrency=env_args.get("judge_concurrency", 16),
    timeout=env_args.get("judge_timeout", 60.0),
    retries=env_args.get("judge_retries", judge_client.RETRIES),
    max_tokens=env_args.get("judge_max_tokens", 1024),
)


async def reward_fn(messages: list[dict], answer) -> float:
    question = next((m["content"] for m in reversed(messages) if m.get("role") == "user"), "")
    response = next((m["content"] for m in reversed(messages) if m.get("role") == "assistant"), "")
    return await judge.score(str(question or ""), str(response or ""), answer)
