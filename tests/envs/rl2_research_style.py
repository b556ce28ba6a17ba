"""An RL2 HEAD env file in the shape of RL2's envs/deep_research.py: the router URL, the server's URL and the
model's length kept in module globals (set by whichever trajectory comes first or last, and kept across
steps); `list_workers`, `v1/models` (`max_model_len`), `parse_function_call` at the server's URL; its own
generate, with TOOLS in the chat template; a summariser and a judge of its own posting `v1/chat/completions`
to the router, the judge's verdict read with a regex; its own add_env_response ending an episode at the
model's length. The web tools are local stubs (`PAGES`) where deep_research calls SerpAPI and Jina.

`env_args.log` (a path; rl2's own, for the tests to look inside): each episode appends what it saw there."""

import asyncio
import json
import re
from typing import Any

from omegaconf import OmegaConf

from RL2.datasets import Sample, add_llm_response, initialize_state_dict
from RL2.utils.communication import async_request

SYSTEM_PROMPT = "You research a question with tools, then give the answer within <answer></answer>."
SUMMARY_TEMPLATE = "Summarise this page for the goal.\nPage: {page}\nGoal: {goal}"
JUDGE_TEMPLATE = "Judge the response.\n[question]: {question}\n[response]: {response}\n[correct_answer]: {correct}\nSay correct: yes or correct: no."
TOOLS = [
    {"type": "function", "function": {
        "name": "search", "description": "Search the web.",
        "parameters": {"type": "object", "properties": {"query": {"type": "array", "items": {"type": "string"}}},
                       "required": ["query"]}}},
    {"type": "function", "function": {
        "name": "visit", "description": "Visit pages and summarise them for a goal.",
        "parameters": {"type": "object", "properties": {"url": {"type": "array", "items": {"type": "string"}},
                                                        "goal": {"type": "string"}},
                       "required": ["url", "goal"]}}},
]
PAGES = {"box.example": "The box holds the code 42."}

ROUTER_URL = None
SERVER_URL = None
MAX_TOKENS = None


async def _call_llm(prompt: str) -> str:
    reply = await async_request(ROUTER_URL, "v1/chat/completions", json={
        "model": "", "messages": [{"role": "user", "content": prompt}], "temperature": 0.7})
    return reply["choices"][0]["message"]["content"]


async def search(query: str | list[str]) -> str:
    if isinstance(query, list):
        return "\n=======\n".join(await asyncio.gather(*(search(q) for q in query)))
    return f"Results for '{query}': 1. [The box](box.example)"


async def visit(url: str | list[str], goal: str) -> str:
    if isinstance(url, list):
        return "\n=======\n".join(await asyncio.gather(*(visit(u, goal) for u in url)))
    summary = await _call_llm(SUMMARY_TEMPLATE.format(page=PAGES.get(url, "Not found."), goal=goal))
    return summary.split("</think>")[-1]


async def env_step(sample: Sample) -> dict[str, Any]:
    parsed = await async_request(SERVER_URL, "parse_function_call", json={
        "text": sample.action_text, "tools": TOOLS, "tool_call_parser": "qwen25"})
    calls = parsed["calls"]
    if not calls:
        verdict = await _call_llm(JUDGE_TEMPLATE.format(question=sample.sample["prompt"], response=sample.action_text,
                                                        correct=sample.sample["answer"]))
        match = re.search(r"correct: (yes|no)", verdict)
        return {"next_state": None, "done": True, "reward": float(match is not None and match.group(1) == "yes")}

    async def call(name: str, arguments: dict) -> str:
        try:
            return await {"search": search, "visit": visit}[name](**arguments)
        except Exception as error:
            return str(error)

    results = await asyncio.gather(*(call(c["name"], json.loads(c["parameters"])) for c in calls))
    observation = "<|im_end|>\n<|im_start|>user\n".join(results)
    next_state = (sample.state_text + sample.action_text + "\n<|im_start|>user\n" + observation
                  + "<|im_end|>\n<|im_start|>assistant\n")
    return {"next_state": next_state, "done": False, "reward": 0.0}


def _finish(sample: Sample) -> None:
    sample.status = Sample.Status.DONE
    sample.metrics["turns"].append(sample.turn)
    sample.metrics["rewards"].append(sum(state["rewards"][-1] for state in sample.state_dicts))


def add_env_response(tokenizer, sample: Sample, response: dict[str, Any]) -> None:
    sample.state_dict["rewards"][-1] = response["reward"]
    if response["done"]:
        sample.state_dicts.append(sample.state_dict)
        _finish(sample)
        return
    before = sample.state_text + sample.action_text
    if response["next_state"].startswith(before):
        delta = initialize_state_dict(tokenizer, response["next_state"][len(before):])
        if len(sample.state_dict["states"]) + len(delta["states"]) >= MAX_TOKENS - 1:
            sample.state_dicts.append(sample.state_dict)
            _finish(sample)
            return
        for key, values in delta.items():
            sample.state_dict[key].extend(values)
    else:
        sample.state_dicts.append(sample.state_dict)
        sample.state_dict = initialize_state_dict(tokenizer, response["next_state"])
        if len(sample.state_dict["states"]) >= MAX_TOKENS - 1:
            _finish(sample)
            return
    sample.state_text = response["next_state"]


def _log(sample: Sample) -> None:
    if env_args.get("log"):  # noqa: F821 - rl2's global of an env file's settings
        with open(env_args["log"], "a") as f:  # noqa: F821
            f.write(json.dumps({"prompt": sample.sample["prompt"], "max_tokens": MAX_TOKENS,
                                "server_url": SERVER_URL, "router_url": ROUTER_URL}) + "\n")


async def generate(config, tokenizer, router_url: str, sample: Sample) -> None:
    sampling_params = OmegaConf.to_container(config.sampling_params)
    global ROUTER_URL, SERVER_URL, MAX_TOKENS
    if ROUTER_URL != router_url:
        ROUTER_URL = router_url
    if SERVER_URL is None:
        SERVER_URL = (await async_request(ROUTER_URL, "list_workers", "GET"))["urls"][0]
    if MAX_TOKENS is None:
        MAX_TOKENS = (await async_request(SERVER_URL, "v1/models", "GET"))["data"][0]["max_model_len"]
    match sample.status:
        case Sample.Status.RUNNING:
            messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": sample.sample["prompt"]}]
            sample.state_text = tokenizer.apply_chat_template(messages, tools=TOOLS, add_generation_prompt=True,
                                                              tokenize=False)
            sample.state_dict = initialize_state_dict(tokenizer, sample.state_text)
        case Sample.Status.ABORTED:
            sample.status = Sample.Status.RUNNING
        case Sample.Status.DONE:
            return
    _log(sample)
    while True:
        max_new_tokens = min(sampling_params["max_new_tokens"] - sample.previous_response_length,
                             MAX_TOKENS - len(sample.state_dict["states"]) - 1)
        response = await async_request(ROUTER_URL, "generate", json={
            "input_ids": sample.state_dict["states"],
            "sampling_params": {**sampling_params, "max_new_tokens": max_new_tokens, "no_stop_trim": True},
            "return_logprob": True,
        })
        add_llm_response(sample, response)
        if sample.status == Sample.Status.ABORTED:
            return
        add_env_response(tokenizer, sample, await env_step(sample))
        if sample.status == Sample.Status.DONE:
            return
