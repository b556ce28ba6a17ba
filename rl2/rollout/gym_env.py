"""Gym-style environments in an env file: `make_env(row)` returns an environment with `reset()` and
`step(action)` (gymnasium's shape; sync or async), made once per trajectory.

    def make_env(row: dict):                    # the row: messages, answer and its other columns
        return WordChain(row["answer"])

    class WordChain:
        def reset(self) -> str: ...             # or messages, or gymnasium's (observation, info)
        def step(self, action: str):            # the assistant's reply
            return observation, reward, done, info          # gymnasium's 5-tuple is taken too
        def close(self): ...                    # optional

The observation of `reset` is the trajectory's first user message (after the row's own messages); each
`step` gets the turn's text, and its observation is the next user message until `done` (terminated or
truncated). Only the environment ends the episode, or rollout's limits: a turn cut by max_new_tokens is
stepped on the text it has and the game goes on; at `rollout.max_turns` or the sequence length limit the
last turn is stepped too and the episode ends there, scored with the rewards of its steps. The rewards of the
steps are summed into the trajectory's reward, each discounted by `adv.gamma` per step before it (the return
from the start: r_0 + gamma r_1 + gamma^2 r_2 ...; an env file's `reward_fn`, if it has one, scores instead);
each step's reward is kept in the dumps (`step_rewards`). rl2 runs these as it runs `ENVIRONMENT`
instances: `GymEpisode` is one.
"""

import contextlib
import inspect
from typing import Any, Callable, Iterator


class GymCallFailed(Exception):
    """The env file's `function` (`make_env`, or its environment's `reset` / `step` / `close`) raised
    `__cause__`: the error names it, not the rl2 call that drove it."""

    def __init__(self, function: str):
        super().__init__(function)
        self.function = function


class GymEpisode:
    """One trajectory's episode of a `make_env` environment, as rl2's stateful environments are driven:
    `reset(messages, answer, **row)`, `step(text)` after each turn, `reward()`, `close()`."""

    def __init__(self, make_env: Callable[[dict], Any], discount: float = 1.0):
        self.make_env, self.discount = make_env, discount
        self.env: Any = None
        self.rewards: list[float] = []
        self.done = False

    def reset(self, messages: list[dict], answer: Any = None, **row) -> Any:
        """Make the environment and reset it: its observation as a user message's text (or messages)."""
        with _naming("make_env"):
            made = self.make_env({**row, "messages": messages, "answer": answer})
        if inspect.isawaitable(made):
            async def finish() -> Any:
                with _naming("make_env"):
                    self.env = await made
                with _naming("reset"):
                    return await _observed(self.env.reset())
            return finish()
        self.env = made
        with _naming("reset"):
            observation = self.env.reset()
        if inspect.isawaitable(observation):
            return _named("reset", _observed(observation))
        return _observation(observation)

    def step(self, action: str) -> Any:
        """The environment's step on the turn's text: the next user message(s), [] once done."""
        with _naming("step"):
            result = self.env.step(action)
        if inspect.isawaitable(result):
            async def finish() -> list[dict]:
                with _naming("step"):
                    taken = await result
                return self._take(taken)
            return finish()
        return self._take(result)

    def reward(self) -> float:
        """The steps' rewards, discounted from the first step."""
        return float(sum(reward * self.discount ** t for t, reward in enumerate(self.rewards)))

    def close(self) -> Any:
        close = getattr(self.env, "close", None)
        if close is None:
            return None
        with _naming("close"):
            result = close()
        return _named("close", result) if inspect.isawaitable(result) else result

    def _take(self, result: Any) -> list[dict]:
        if not isinstance(result, tuple) or len(result) not in (4, 5):
            raise TypeError(f"step returned {type(result).__name__}; expected (observation, reward, done, info) "
                            "or gymnasium's (observation, reward, terminated, truncated, info)")
        observation, reward, *flags, _info = result
        if isinstance(reward, bool) or not isinstance(reward, (int, float)):
            raise TypeError(f"step returned reward {reward!r}; expected a number")
        self.rewards.append(float(reward))
        self.done = any(bool(flag) for flag in flags)
        if self.done:
            return []
        return _messages(_observation(observation))


@contextlib.contextmanager
def _naming(function: str) -> Iterator[None]:
    """Re-raises an exception of the env file's code as `GymCallFailed(function)`."""
    try:
        yield
    except GymCallFailed:
        raise
    except Exception as exc:
        raise GymCallFailed(function) from exc


async def _named(function: str, awaitable: Any) -> Any:
    with _naming(function):
        return await awaitable


async def _observed(observation: Any) -> Any:
    return _observation(await observation)


def _observation(observation: Any) -> Any:
    """A reset's or step's observation as text or messages (gymnasium's reset returns (observation, info))."""
    if isinstance(observation, tuple) and len(observation) == 2 and isinstance(observation[1], dict):
        observation = observation[0]
    if isinstance(observation, str) or (isinstance(observation, list) and all(isinstance(m, dict) for m in observation)):
        return observation
    raise TypeError(f"the environment's observation is {type(observation).__name__}; expected text or messages")


def _messages(observation: Any) -> list[dict]:
    return [{"role": "user", "content": observation}] if isinstance(observation, str) else list(observation)
