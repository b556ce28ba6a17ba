"""The multi-turn demo (`envs/demo_lookup.py`) as a gym-style environment (`make_env`): the same task and
rewards, written as a game with `reset()` / `step(reply)` instead of `interact` and `reward_fn`.

A reply that calls `<tool_call>lookup</tool_call>` gets the box's code as a tool message (reward 0, the game
goes on); any other reply is the answer: reward 1 when its last number is the code, and the game ends.

    TASK=lookup bash recipes/ppo_tiny.sh rollout.env_path=envs/demo_lookup_gym.py
"""

from demo_lookup import QUESTION, secret_code, tool_reply
from demo_lookup import reward_fn as answer_reward  # not named reward_fn here: the steps' rewards score


class LookupGame:
    """One box's game: the question names the box, `answer` is its code."""

    def __init__(self, question: str, answer: str):
        colour, thing = QUESTION.search(question).groups()
        self.code, self.answer, self.looked = secret_code(colour, thing), answer, False

    def reset(self) -> str:
        return ""  # the row's question is the first turn

    def step(self, reply: str):
        if "<tool_call>lookup</tool_call>" in reply and not self.looked:
            self.looked = True
            return [{"role": "tool", "content": tool_reply(self.code)}], 0.0, False, {}
        return "", answer_reward([{"role": "assistant", "content": reply}], self.answer), True, {}


def make_env(row: dict) -> LookupGame:
    return LookupGame(row["messages"][-1]["content"], row["answer"])
