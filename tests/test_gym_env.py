"""Gym-style environments (`make_env(row)` with `reset()` / `step(action)`, sync or async, gymnasium's tuples too):
one per trajectory, its observations the user turns, its step rewards summed into the trajectory's reward and
kept in the dumps, closed when scored, failures env errors."""

import textwrap

import pytest

from rl2.chat.template import render_chat
from rl2.engines import SamplingParams
from rl2.rollout.env import Env, EnvError
from rl2.rollout.multi_turn import assign_rewards, rollout
from rl2.rollout.trajectory import RunningState, Trajectory
from rl2.testing.tiny import build_tiny_tokenizer
from scripted_engine import ScriptedEngine

# A word-chain game of our own: each reply must be a word that starts with the letter asked for.
WORD_CHAIN = '''
CLOSED = []


class WordChain:
    def __init__(self, letters):
        self.letters = list(letters)

    def reset(self):
        return f"Say a word that starts with {self.letters[0]}."

    def step(self, action):
        if action == "boom":
            raise RuntimeError("the game broke")
        right = action.strip().lower().startswith(self.letters.pop(0))
        if not self.letters:
            return "", float(right), True, {}
        return f"Now one that starts with {self.letters[0]}.", float(right), False, {}

    def close(self):
        CLOSED.append(True)


def make_env(row):
    return WordChain(row["answer"])
'''

ASYNC_GYMNASIUM = '''
class Countdown:
    async def reset(self):
        self.left = 2
        return "Count down from 2.", {"info": 1}          # gymnasium's (observation, info)

    async def step(self, action):
        self.left -= 1
        return f"{self.left} left", 0.5, self.left == 0, False, {}   # gymnasium's 5-tuple


async def make_env(row):
    return Countdown()
'''


def write(tmp_path, source: str) -> Env:
    path = tmp_path / "game.py"
    path.write_text(textwrap.dedent(source))
    return Env(str(path), workers=0, need_interact=True)


def play(env, replies, answer, max_turns=5):
    tokenizer = build_tiny_tokenizer()
    messages = [{"role": "user", "content": "Let us play."}]
    ids = tokenizer(render_chat(messages, tokenizer, True), add_special_tokens=False)["input_ids"]
    turns = iter(replies)
    engine = ScriptedEngine(tokenizer, lambda text: next(turns))
    (trajectory,) = rollout(engine, env, tokenizer, [{"prompt_ids": ids, "messages": messages, "answer": answer}], 1,
                            SamplingParams(), max_turns=max_turns)
    assign_rewards(env, [trajectory])
    return trajectory


def test_a_word_chain_game_is_played_scored_and_closed(tmp_path):
    """reset's observation is the first user turn after the row's; each reply is stepped; the rewards of the
    steps are summed and kept; the game ends when the environment says done, and is closed."""
    env = write(tmp_path, WORD_CHAIN)
    try:
        trajectory = play(env, ["apple", "cat", "bird"], answer="abc")
        closed = env._module.CLOSED
    finally:
        env.close()
    roles = [(m["role"], m["content"]) for m in trajectory.messages]
    assert roles == [("user", "Let us play."), ("user", "Say a word that starts with a."), ("assistant", "apple"),
                     ("user", "Now one that starts with b."), ("assistant", "cat"),
                     ("user", "Now one that starts with c."), ("assistant", "bird")]
    assert trajectory.step_rewards == [1.0, 0.0, 0.0] and trajectory.reward == 1.0 and trajectory.turns == 3
    assert trajectory.to_json()["step_rewards"] == [1.0, 0.0, 0.0] and closed == [True]
    assert trajectory.running is None and not trajectory.errors  # the episode is over: no environment left


def test_async_environments_and_gymnasium_tuples(tmp_path):
    env = write(tmp_path, ASYNC_GYMNASIUM)
    try:
        trajectory = play(env, ["two", "one"], answer=None)
    finally:
        env.close()
    assert [m["content"] for m in trajectory.messages if m["role"] == "user"] == [
        "Let us play.", "Count down from 2.", "1 left"]
    assert trajectory.step_rewards == [0.5, 0.5] and trajectory.reward == 1.0


def test_a_failing_step_is_an_env_error_and_the_episode_survives_a_checkpoint(tmp_path):
    """A step that raises ends the episode with an env error (no reward); a paused trajectory's episode is
    pickled with it (`Trajectory.state`) and comes back playing."""
    env = write(tmp_path, WORD_CHAIN)
    try:
        broken = play(env, ["apple", "boom"], answer="abc")
        assert broken.reward is None and "step raised RuntimeError: the game broke" in broken.errors[0]
        episode = env.environment_factory()
        episode.reset([{"role": "user", "content": "hi"}], "ab")
        episode.step("ant")
        state = Trajectory(messages=[], answer="ab", group=0, token_ids=[1], action_mask=[0], logprobs=[0.0],
                           running=RunningState(environment=episode)).state()
        restored = Trajectory.from_dict(state).running.environment
        assert restored.rewards == [1.0] and restored.step("bee") == [] and restored.reward() == 2.0
    finally:
        env.close()


def test_make_env_beside_environment_is_refused(tmp_path):
    path = tmp_path / "both.py"
    path.write_text(WORD_CHAIN + "\nclass Other:\n    def reward(self):\n        return 0\n\n\nENVIRONMENT = Other\n")
    with pytest.raises(EnvError, match="both ENVIRONMENT and make_env"):
        Env(str(path), workers=0)


def test_step_rewards_are_discounted_by_gamma(tmp_path):
    """With a step discount (`adv.gamma`) the trajectory's reward is the return from the first step,
    r_0 + gamma r_1 + gamma^2 r_2; the dumps keep the undiscounted step rewards."""
    path = tmp_path / "game.py"
    path.write_text(textwrap.dedent(WORD_CHAIN))
    env = Env(str(path), workers=0, need_interact=True, step_discount=0.5)
    try:
        trajectory = play(env, ["cat", "bird", "cow"], answer="abc")
    finally:
        env.close()
    assert trajectory.step_rewards == [0.0, 1.0, 1.0] and trajectory.reward == 0.5 + 0.25


def test_the_last_turn_is_stepped_at_the_turn_limit(tmp_path):
    """At rollout.max_turns the episode ends, but its last reply is still stepped: its reward counts (the
    game is not over, so nothing follows)."""
    env = write(tmp_path, WORD_CHAIN)
    try:
        trajectory = play(env, ["apple", "bee"], answer="abc", max_turns=2)
    finally:
        env.close()
    assert trajectory.turns == 2 and trajectory.step_rewards == [1.0, 1.0] and trajectory.reward == 2.0
    assert [m["role"] for m in trajectory.messages] == ["user", "user", "assistant", "user", "assistant"]


# A game in the pattern of third-party gym packages (textarena, gem-llm) wrapped by make_env: `step(text)`
# returns gymnasium's (observation, reward, terminated, truncated, info); guessing takes several turns, a reply
# it cannot read costs a point and the game goes on; it gives up (truncated) after `patience` replies.
GUESSING = '''
class Guessing:
    def __init__(self, secret, patience=6):
        self.secret, self.patience, self.replies = int(secret), patience, 0

    def reset(self):
        return "Guess my number from 1 to 9, one digit a reply.", {}

    def step(self, text):
        self.replies += 1
        guess = text.strip()
        if not guess.isdigit():
            reward, observation = -1.0, "One digit, please."
        elif int(guess) == self.secret:
            return "", 1.0, True, False, {"won": True}
        else:
            reward, observation = 0.0, "Higher." if int(guess) < self.secret else "Lower."
        return observation, reward, False, self.replies >= self.patience, {}


def make_env(row):
    return Guessing(row["answer"])
'''

RAMBLE = "let me think about which number it could be, first of all the range is from one to nine so"


def guess(tmp_path, replies, max_new_tokens=8, max_turns=6, max_length=None):
    env = write(tmp_path, GUESSING)
    tokenizer = build_tiny_tokenizer()
    messages = [{"role": "user", "content": "Let us play."}]
    ids = tokenizer(render_chat(messages, tokenizer, True), add_special_tokens=False)["input_ids"]
    turns = iter(replies)
    engine = ScriptedEngine(tokenizer, lambda text: next(turns))
    try:
        (trajectory,) = rollout(engine, env, tokenizer, [{"prompt_ids": ids, "messages": messages, "answer": "7"}], 1,
                                SamplingParams(max_new_tokens=max_new_tokens), max_turns=max_turns,
                                max_length=max_length and len(ids) + max_length)
        assign_rewards(env, [trajectory])
    finally:
        env.close()
    return trajectory


def test_a_turn_cut_by_max_new_tokens_does_not_end_the_game(tmp_path):
    """A reply cut by max_new_tokens (finish reason "length") is stepped as it is, and the game goes on until the
    environment says it is over (terminated here, on the third reply)."""
    trajectory = guess(tmp_path, [RAMBLE, "5", "7"])
    assert trajectory.turns == 3 and trajectory.step_rewards == [-1.0, 0.0, 1.0] and trajectory.reward == 0.0
    assert not trajectory.truncated and trajectory.errors == []
    users = [m["content"] for m in trajectory.messages if m["role"] == "user"]
    assert users == ["Let us play.", "Guess my number from 1 to 9, one digit a reply.", "One digit, please.", "Higher."]


def test_a_game_that_gives_up_or_reaches_the_turn_limit_is_scored(tmp_path):
    """A model whose every reply is cut plays until the environment gives up (truncated, after 6 replies) or
    until rollout.max_turns: either way the episode is scored with the rewards of its steps, not an env error."""
    given_up = guess(tmp_path, [RAMBLE] * 6)
    assert given_up.turns == 6 and given_up.step_rewards == [-1.0] * 6 and given_up.reward == -6.0
    assert given_up.errors == [] and given_up.truncated  # its last turn was cut
    at_limit = guess(tmp_path, [RAMBLE] * 3, max_turns=3)
    assert at_limit.turns == 3 and at_limit.step_rewards == [-1.0] * 3 and at_limit.reward == -3.0
    assert at_limit.errors == []


def test_a_game_at_the_sequence_length_limit_is_scored(tmp_path):
    """The sequence length limit ends the game (its cut reply is still stepped); scored, not an env error."""
    trajectory = guess(tmp_path, [RAMBLE, "5", "6", "7"], max_length=40)
    assert trajectory.truncated and trajectory.errors == [] and 1 <= trajectory.turns < 4
    assert trajectory.step_rewards[0] == -1.0 and trajectory.reward == sum(trajectory.step_rewards)
    assert len(trajectory.step_rewards) == trajectory.turns


FAILING_GAME = '''
class Game:
    def __init__(self, fails):
        self.fails = fails

    def reset(self):
        if self.fails == "reset":
            raise KeyError("no board")
        return "go"

    async def step(self, action):
        raise RuntimeError("the move broke")


def make_env(row):
    if row["answer"] == "make_env":
        raise ValueError("no such game")
    return Game(row["answer"])
'''


@pytest.mark.parametrize("fails, error", [("make_env", "make_env raised ValueError: no such game"),
                                          ("reset", "reset raised KeyError: 'no board'"),
                                          ("step", "step raised RuntimeError: the move broke")])
def test_a_failure_names_the_function_of_the_env_file_that_raised(tmp_path, fails, error):
    """make_env, reset or step: the error names the one that raised, not the rl2 call that drove it (nor reward_fn)."""
    env = write(tmp_path, FAILING_GAME)
    try:
        trajectory = play(env, ["a move"], answer=fails)
    finally:
        env.close()
    assert trajectory.reward is None and trajectory.errors == [error]
