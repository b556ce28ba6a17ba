"""A trajectory: one episode of a rollout, as token ids and as messages, with its reward."""

import base64
import dataclasses
import pickle
from dataclasses import dataclass, field
from typing import Any

import torch

from rl2.vision.image_inputs import ImageInputs


@dataclass
class RunningState:
    """Where a trajectory's episode stands while it is rolled out (a partial rollout pauses it here)."""

    stage: str = "generate"  # what it does next: `generate` a turn, or `interact` (call its tool)
    # Where the turn being generated began in `token_ids` (-1: none is being generated); a paused turn
    # goes on from there, drawing from `stream` (the random stream its tokens came from).
    generating_from: int = -1
    stream: tuple[int, int] | None = None
    # Native function calling: the last turn's calls not yet answered ({"id", "name", "arguments",
    # "error"}), and how many calls the episode made (the parser numbers them).
    pending_calls: list[dict] = field(default_factory=list)
    calls_made: int = 0
    # A stateful environment's instance (an env file's ENVIRONMENT, or a gym-style `make_env`'s), from the
    # episode's start until it is scored.
    environment: Any = None
    # The dataset row's other columns, for a gym-style environment's `make_env(row)`; None once it started.
    row: dict | None = None

    @classmethod
    def from_dict(cls, fields: dict) -> "RunningState":
        stream, environment = fields.get("stream"), fields.get("environment")
        if isinstance(environment, str):  # pickled by `state()`
            environment = pickle.loads(base64.b64decode(environment))
        return cls(**{**fields, "stream": tuple(stream) if stream is not None else None, "environment": environment})

    def state(self) -> dict:
        """The fields as JSON holds them; a stateful environment pickled."""
        environment, self.environment = self.environment, None
        try:
            fields = dataclasses.asdict(self)
        finally:
            self.environment = environment
        if environment is not None:
            fields["environment"] = base64.b64encode(pickle.dumps(environment)).decode()
        return fields


# A checkpoint written before `RunningState` holds its fields in the trajectory's, `generating_from` as `turn_start`.
OLD_RUNNING_FIELDS = ("stage", "turn_start", "stream", "pending_calls", "calls_made", "environment", "row")


@dataclass
class Trajectory:
    """One episode: the conversation, its token ids, which tokens the policy generated, and its reward."""

    messages: list[dict]
    answer: Any
    group: int  # index of the prompt: trajectories of one prompt form a group
    token_ids: list[int]
    action_mask: list[int]  # 1 on generated tokens, 0 on prompt and tool tokens
    logprobs: list[float]  # the engine's log-probs of generated tokens, 0 elsewhere
    turns: int = 0
    truncated: bool = False  # cut at the length limit
    done: bool = False
    reward: float | None = None  # None until scored, and when reward_fn failed
    errors: list[str] = field(default_factory=list)
    # Per token, the policy version that sampled it (-1 on prompt and tool tokens); empty where untracked.
    versions: list[int] = field(default_factory=list)
    started: int = 0  # the policy version when the episode began
    # Native function calling: the tool schemas the prompt was rendered with, and per call run
    # {"name", "error", "seconds"} for the `tools/*` metrics.
    tools: list[dict] | None = None
    tool_stats: list[dict] = field(default_factory=list)
    # rollout.trajectory_format=per_turn: where each turn's own sequence (its prompt as the chat template
    # renders the conversation so far, then its generation) begins in `token_ids`; None: one sequence.
    turn_starts: list[int] | None = None
    # An agent's trajectory (`rollout.agent_path`): what its requests cost, for the `agent/*` metrics.
    agent_stats: dict = field(default_factory=dict)
    # A gym-style environment's reward at each of its steps (`rl2.rollout.gym_env`), for the dumps.
    step_rewards: list[float] = field(default_factory=list)
    # The row's `data_source` (the task or dataset it comes from): test metrics per source; None: none.
    source: str | None = None
    # The episode's place while it is rolled out, until it is scored (`RunningState`); None after, and for
    # the trajectories made whole (an agent's, an RL2 HEAD file's).
    running: RunningState | None = None
    # A vision-language model's trajectory: the images its image-pad tokens stand for, in order (the
    # prompt's, then those tool results added); None: none. With several sequences (`turn_starts`), the k-th
    # holds `images[first : first + count]`, `turn_images[k] = [first, count]` (per turn: those of the
    # conversation so far, first = 0; an agent's: each sequence's own); None: no images, or one sequence.
    images: ImageInputs | None = None
    turn_images: list[list[int]] | None = None
    # Routing replay (actor.router_replay=r3, a mixture-of-experts policy): the experts the engine routed each
    # token to, [tokens, moe layers, k] int8/int16 (`rl2.models.routing_replay`); None: not recorded.
    routes: torch.Tensor | None = None

    @classmethod
    def from_dict(cls, fields: dict) -> "Trajectory":
        """A trajectory from its fields as JSON gives them back (`state()`, then a round trip); also from a
        checkpoint written before `running`, whose fields were the trajectory's own then."""
        fields = dict(fields)
        running = fields.pop("running", None)
        flat = {name: fields.pop(name) for name in OLD_RUNNING_FIELDS if name in fields}
        if flat:
            running = {("generating_from" if name == "turn_start" else name): value for name, value in flat.items()}
        images = fields.pop("images", None)
        routes = fields.pop("routes", None)
        return cls(**fields, running=RunningState.from_dict(running) if running is not None else None,
                   images=ImageInputs.from_state(images) if images is not None else None,
                   routes=_routes_from_state(routes) if routes is not None else None)

    def state(self) -> dict:
        """The trajectory's fields as JSON holds them (a checkpoint); a stateful environment pickled."""
        running, images, routes = self.running, self.images, self.routes
        self.running = self.images = self.routes = None
        try:
            fields = dataclasses.asdict(self)
        finally:
            self.running, self.images, self.routes = running, images, routes
        fields["running"] = running.state() if running is not None else None
        fields["images"] = images.state() if images is not None else None
        del fields["routes"]  # absent without routes: such trajectories' checkpoints stay as they were
        if routes is not None:
            fields["routes"] = {"dtype": str(routes.dtype).removeprefix("torch."), "shape": list(routes.shape),
                                "data": base64.b64encode(routes.contiguous().numpy().tobytes()).decode()}
        return fields

    @property
    def sequence_start(self) -> int:
        """Where the sequence the next turn continues begins in `token_ids` (0 unless per turn)."""
        return self.turn_starts[-1] if self.turn_starts else 0

    @property
    def response_length(self) -> int:
        return sum(self.action_mask)

    @property
    def excluded(self) -> bool:
        """Left out of training: an env call failed or the engine aborted, so the episode's
        outcome (or its score) is not the policy's doing."""
        return bool(self.errors) or self.reward is None

    def to_json(self) -> dict:
        """What a trajectory dump shows: the conversation and its outcome."""
        return {
            "group": self.group,
            "messages": self.messages,
            "answer": self.answer,
            "reward": self.reward,
            "turns": self.turns,
            "response_length": self.response_length,
            "truncated": self.truncated,
            "errors": self.errors,
            **({"source": self.source} if self.source is not None else {}),
            **({"step_rewards": self.step_rewards} if self.step_rewards else {}),
            # Each image's (t, h, w) patch grid, in the order the messages' image-pad tokens stand for them.
            **({"images": self.images.image_grid_thw.tolist()} if self.images is not None else {}),
        }


def _routes_from_state(state: dict) -> torch.Tensor:
    """`Trajectory.routes` from what `Trajectory.state` wrote."""
    data = bytearray(base64.b64decode(state["data"]))
    return torch.frombuffer(data, dtype=getattr(torch, state["dtype"])).reshape(state["shape"]).clone()
