"""The multi-turn demo's game (`envs/demo_lookup_gym.py`'s `LookupGame`) as an OpenEnv environment, served with
openenv-core's `create_fastapi_app` and uvicorn: what an environment written for OpenEnv looks like to rl2.

    python recipes/openenv_demo/lookup_server.py --port 8765      # then recipes/openenv_demo/run.sh

Each session's `reset` takes the row's `messages` and `answer` (rl2 sends them: `reset_fields`), each `step`
the model's reply as `{"message": ...}`; the observation's `output` is the tool's reply, if any.
"""

import argparse
import os
import sys

import uvicorn
from openenv.core.env_server import Environment, create_fastapi_app
from openenv.core.env_server.types import Action, Observation, State

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "envs"))
from demo_lookup_gym import LookupGame  # noqa: E402


class ReplyAction(Action):
    message: str


class LookupObservation(Observation):
    output: str = ""


class LookupEnvironment(Environment):
    SUPPORTS_CONCURRENT_SESSIONS = True

    def __init__(self):
        super().__init__()
        self.game, self.steps = None, 0

    def reset(self, seed=None, episode_id=None, messages=(), answer: str = "", **kwargs) -> LookupObservation:
        self.game, self.steps = LookupGame(messages[-1]["content"], str(answer)), 0
        return LookupObservation(output=self.game.reset())

    def step(self, action: ReplyAction, timeout_s=None, **kwargs) -> LookupObservation:
        self.steps += 1
        observation, reward, done, _ = self.game.step(action.message)
        output = observation[0]["content"] if observation else ""
        return LookupObservation(output=output, reward=reward, done=done)

    @property
    def state(self) -> State:
        return State(step_count=self.steps)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--port", type=int, default=8765)
    parser.add_argument("--sessions", type=int, default=256, help="concurrent sessions (trajectories in flight)")
    args = parser.parse_args()
    app = create_fastapi_app(LookupEnvironment, ReplyAction, LookupObservation, max_concurrent_envs=args.sessions)
    print(f"OpenEnv lookup game on http://127.0.0.1:{args.port}", flush=True)
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")


if __name__ == "__main__":
    main()
