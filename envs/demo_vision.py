"""Env file of the vision demo (`make demo-vision`, data from `rl2.testing.vision_task`): the reward is 1 when
the reply is exactly the answer (a digit for "How many shapes?", a colour's letter for "What colour?"), else 0."""


def reward_fn(messages: list[dict], answer: str) -> float:
    return float(messages[-1]["content"].strip() == str(answer))
