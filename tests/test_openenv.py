"""OpenEnv environments (`rl2.rollout.openenv`, `envs/openenv.py`): a word-chain game of our own served by
openenv-core's server helpers on loopback, played by rl2's multi-turn rollout through openenv-core's client,
one session per trajectory; step rewards summed; bad configuration and server errors named."""

import pytest

from rl2.chat.template import render_chat
from rl2.engines import SamplingParams
from rl2.rollout.env import Env, EnvError
from rl2.rollout.multi_turn import assign_rewards, rollout
from rl2.testing.tiny import build_tiny_tokenizer
from scripted_engine import ScriptedEngine
from server_process import REPO

pytest.importorskip("openenv.core")


def env_for(url: str, **extra) -> Env:
    args = {"openenv_url": url, "observation_field": "prompt", "reset_fields": ["letters"], **extra}
    return Env(f"{REPO}/envs/openenv.py", workers=0, need_interact=True, args=args)


def play(env, conversations: list[list[str]], letters: list[str]):
    """Each trajectory's replies, scripted by the number of its user turns so far."""
    tokenizer = build_tiny_tokenizer()
    messages = [{"role": "user", "content": "Let us play."}]
    ids = tokenizer(render_chat(messages, tokenizer, True), add_special_tokens=False)["input_ids"]
    rows = [{"prompt_ids": ids, "messages": messages, "answer": None, "row": {"letters": word}} for word in letters]

    def reply(text: str) -> str:
        game = next(i for i, word in enumerate(letters) if f"starts with {word[0]}." in text)
        return conversations[game][text.count("<|im_start|>user") - 2]

    trajectories = rollout(ScriptedEngine(tokenizer, reply), env, tokenizer, rows, 1, SamplingParams(), max_turns=5)
    assign_rewards(env, trajectories)
    return trajectories


def test_games_on_an_openenv_server_are_played_and_scored(word_chain_url):
    """Two games at once (one session each, their letters from the row through reset): the server's prompt
    is each user turn, the replies its actions, the rewards of its steps summed, the episode ends when the
    server says done."""
    env = env_for(word_chain_url)
    try:
        first, second = play(env, [["apple", "cat", "bird"], ["xylophone", "yak"]], ["abc", "xy"])
    finally:
        env.close()
    assert [(m["role"], m["content"]) for m in first.messages] == [
        ("user", "Let us play."), ("user", "Say a word that starts with a."), ("assistant", "apple"),
        ("user", "Now one that starts with b."), ("assistant", "cat"),
        ("user", "Now one that starts with c."), ("assistant", "bird")]
    assert first.step_rewards == [1.0, 0.0, 0.0] and first.reward == 1.0 and first.turns == 3
    assert second.step_rewards == [1.0, 1.0] and second.reward == 2.0 and second.turns == 2
    assert not first.errors and not second.errors and first.running is None


def test_openenv_mistakes_are_named(word_chain_url):
    """No URL, an observation with two text fields and none chosen, a step the server fails: each says what."""
    with pytest.raises(EnvError, match="openenv_url"):
        Env(f"{REPO}/envs/openenv.py", workers=0, need_interact=True, args={})
    env = env_for(word_chain_url, observation_field=None)
    try:
        (trajectory,) = play(env, [["apple"]], ["ab"])
    finally:
        env.close()
    assert trajectory.reward is None and "observation_field" in trajectory.errors[0]
    env = env_for(word_chain_url)
    try:
        (trajectory,) = play(env, [["boom"]], ["ab"])
    finally:
        env.close()
    assert trajectory.reward is None and trajectory.errors and "step" in trajectory.errors[0]


def test_a_checkpointed_episode_is_replayed_in_a_new_session(word_chain_url):
    """A paused trajectory's episode survives a checkpoint (pickled as its reset arguments and actions): the
    restored one opens a new session, replays its actions and goes on where the old one stood."""
    import pickle

    from rl2.rollout.gym_env import GymEpisode
    from rl2.rollout.openenv import OpenEnvClient

    client = OpenEnvClient(word_chain_url, observation_field="prompt", reset_fields=["letters"])
    episode = GymEpisode(client)
    assert episode.reset([{"role": "user", "content": "Let us play."}], None, letters="abc") == \
        "Say a word that starts with a."
    assert episode.step("apple") == [{"role": "user", "content": "Now one that starts with b."}]
    restored = pickle.loads(pickle.dumps(episode))
    episode.close()
    assert restored.step("bee") == [{"role": "user", "content": "Now one that starts with c."}]
    assert restored.step("dog") == [] and restored.done and restored.rewards == [1.0, 1.0, 0.0]
    restored.close()
