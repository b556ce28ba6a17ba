"""An OpenEnv environment of our own, served with openenv-core's server helpers (`create_fastapi_app` +
uvicorn): a word-chain game whose letters come with `reset` (one game per row), each reply scored 1 when it
starts with the letter asked for.

    python tests/openenv_word_chain.py PORT
"""

import sys

import uvicorn
from openenv.core.env_server import Environment, create_fastapi_app
from openenv.core.env_server.types import Action, Observation, State


class WordAction(Action):
    message: str


class WordObservation(Observation):
    prompt: str = ""
    letter: str = ""  # a second text field: the client must be told which one the model reads


class WordChain(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self.letters, self.steps = [], 0

    def reset(self, seed=None, episode_id=None, letters: str = "abc", **kwargs) -> WordObservation:
        self.letters, self.steps = list(letters), 0
        return WordObservation(prompt=f"Say a word that starts with {self.letters[0]}.", letter=self.letters[0])

    def step(self, action: WordAction, timeout_s=None, **kwargs) -> WordObservation:
        if action.message == "boom":
            raise RuntimeError("the game broke")
        self.steps += 1
        right = action.message.strip().lower().startswith(self.letters.pop(0))
        if not self.letters:
            return WordObservation(prompt="", reward=float(right), done=True)
        return WordObservation(prompt=f"Now one that starts with {self.letters[0]}.", letter=self.letters[0],
                               reward=float(right), done=False)

    @property
    def state(self) -> State:
        return State(step_count=self.steps)


if __name__ == "__main__":
    app = create_fastapi_app(WordChain, WordAction, WordObservation, max_concurrent_envs=64)
    print(f"serving on http://127.0.0.1:{sys.argv[1]}", flush=True)
    uvicorn.run(app, host="127.0.0.1", port=int(sys.argv[1]), log_level="warning")
