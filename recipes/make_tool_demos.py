"""SFT demonstrations of a recipe's tool format, for the tiny CPU variants' warm-up.

    python recipes/make_tool_demos.py --tool python|search --rows train.jsonl --out demos.jsonl [--copies 8]

A random-init tiny model never writes a tool call by chance; a short SFT on these conversations
teaches it the format, so the 2-step RL runs of the tiny recipes reach the real sandbox / retrieval
server. Each RL row (`{"messages", "answer"}`) becomes one conversation that calls the tool once and
answers with the row's answer:
- python: `<tool_call>{"name": "python", "arguments": {"code": "print(ANSWER)"}}</tool_call>`, the
  program's output as the tool message, then `\\boxed{ANSWER}`;
- search: `<think>..</think><search>QUESTION</search>`, an `<information>` tool message, then
  `<answer>GOLD</answer>`.
A real model (Qwen2.5-Instruct) follows the tool prompt without this.
"""

import argparse
import json
import os
import re


def python_demo(row: dict) -> list[dict]:
    answer = str(row["answer"])
    call = json.dumps({"name": "python", "arguments": {"code": f"print({json.dumps(answer)})"}})
    return row["messages"] + [
        {"role": "assistant", "content": f"Let me compute it.\n<tool_call>\n{call}\n</tool_call>"},
        {"role": "tool", "content": answer + "\n"},
        {"role": "assistant", "content": f"The answer is \\boxed{{{answer}}}."},
    ]


def search_demo(row: dict) -> list[dict]:
    gold = row["answer"][0] if isinstance(row["answer"], list) else str(row["answer"])
    question = re.split(r"Question:\s*", row["messages"][-1]["content"])[-1].strip()
    return row["messages"] + [
        {"role": "assistant", "content": f"<think>I need to look this up.</think>\n<search> {question} </search>"},
        {"role": "tool", "content": f"<information>Doc 1(Title: {gold}) {gold}</information>"},
        {"role": "assistant", "content": f"<think>Found it.</think>\n<answer> {gold} </answer>"},
    ]


DEMOS = {"python": python_demo, "search": search_demo}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tool", choices=sorted(DEMOS), required=True)
    parser.add_argument("--rows", required=True, help="RL rows (JSON lines) written by the recipe's prepare_data.py")
    parser.add_argument("--out", required=True)
    parser.add_argument("--copies", type=int, default=8, help="each demonstration repeated this many times")
    args = parser.parse_args()
    with open(args.rows, encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w", encoding="utf-8") as f:
        for _ in range(args.copies):
            for row in rows:
                f.write(json.dumps({"messages": DEMOS[args.tool](row)}) + "\n")
    print(f"{args.copies * len(rows)} {args.tool} demonstrations -> {args.out}")


if __name__ == "__main__":
    main()
