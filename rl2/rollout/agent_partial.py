"""Partial rollout of agent files (`rollout.agent_path` with `rollout.partial_rollout`): as for env files
(`rl2.rollout.partial`), a step stops generating once its share of groups is done, and the other
trajectories go on in the next step under the new weights; here the agents themselves go on.

An agent is a coroutine on the rank's server loop, in the middle of its own code: it cannot move to another
rank or be saved. So each rank keeps its own groups in flight: its agents keep running between steps (a
request they make then waits in their slot), a generation the pause cut short keeps its tokens and is drawn
on from the same random stream under the new weights, and the reply the agent waits for carries tokens of
both versions, each recorded with its version. Each step a rank takes new prompts up to its share of the
`target + extra` groups in flight.

An agent's state cannot be saved, but what it was served can: a checkpoint keeps, per rank, each group in
flight with every generation its slots served and the turn a pause cut. A resumed run (the same world size)
starts those agents again on the same rank and in the same order, and their slots answer them from that log
(`EngineSlots.restore`): a deterministic agent is back where it was without generating anything, and the cut
turn goes on from its random stream, so the run goes on exactly. An agent that asks for something else
leaves the log there and is generated for live (`partial/replay_mismatches`); with another world size the
groups' agents start again from their prompts.
"""

import asyncio
import copy
import logging
import time
from dataclasses import dataclass, field

from rl2.distributed.process_group import all_gather_objects, rank, world_size
from rl2.engines import SamplingParams
from rl2.metrics import PhaseTimer
from rl2.rollout.partial import partial_metrics
from rl2.rollout.trajectory import Trajectory
from rl2.rollout.agent_rollout import agent_episodes, agent_trajectory, openai_client, score_unscored
from rl2.serve.session import AgentSession

logger = logging.getLogger(__name__)


@dataclass
class LiveGroup:
    """The agents of one prompt, running on this rank."""

    group: int  # its id: unique across steps
    prompt: dict
    started: int  # the policy version when its agents began
    sessions: list[AgentSession]
    keys: list[str] = field(default_factory=list)
    slots: list[int] = field(default_factory=list)
    left: int = 0  # agents still running


def shares(total: int) -> list[int]:
    """Each rank's part of `total` (as `rank_slice` deals it)."""
    size = world_size()
    return [total * (r + 1) // size - total * r // size for r in range(size)]


class AgentPartialRollout:
    """The groups of agents this rank keeps in flight from step to step (see the module)."""

    def __init__(self, service, target: int, extra: int, max_age: int, responses_per_prompt: int):
        self.service = service
        self.target, self.extra, self.max_age = target, extra, max_age
        self.responses_per_prompt = responses_per_prompt
        self.carried: list[LiveGroup] = []  # this rank's, in the order they started
        self.finished: list[LiveGroup] = []  # of those, the ones whose agents all ended, in that order
        self.restarts: list[dict] = []  # prompts to start again (a checkpoint of another world size)
        self.restored: list[dict] = []  # this rank's groups in flight at its checkpoint, with their slots' logs
        self.next_group = 0
        self.rollout = None  # the server's rollout, kept across steps
        self.client = None
        self._wanted: list[int] | None = None
        self._step: tuple[int, set[int]] | None = None  # this step's target and the groups that must finish

    def prompts_wanted(self) -> int:
        """New prompts this step takes: each rank fills its share of `target + extra` groups in flight."""
        carried = all_gather_objects([len(self.carried) + len(self.restored)])
        self._carried_counts = carried
        self._wanted = [max(share - count, 0) for share, count in zip(shares(self.target + self.extra), carried)]
        return max(sum(self._wanted) - len(self.restarts), 0)

    def generate(self, prompts: list[dict], params: SamplingParams, seed: int, version: int,
                 timer: PhaseTimer | None = None, sleep_after: bool = False) -> list[Trajectory]:
        """Let the carried agents go on and start agents on this rank's part of `prompts` under policy
        `version`; return the scored trajectories of the groups that train (every rank's, in rank order)."""
        timer = timer or PhaseTimer()
        service, rollout_config = self.service, self.service.rollout_config
        if self._wanted is None:
            self.prompts_wanted()
        prompts, self.restarts = self.restarts + prompts, []
        firsts = [sum(self._wanted[:r]) for r in range(len(self._wanted))]
        first = firsts[rank()]
        mine = prompts[first:first + self._wanted[rank()]]
        # every rank's groups in flight once each has started its part of `prompts` (no second gather)
        in_flight = sum(self._carried_counts) + sum(len(prompts[f:f + w]) for f, w in zip(firsts, self._wanted))
        if self.rollout is None:
            self.client = openai_client(service.server.base_url, rollout_config.agent_timeout)
            self.rollout = service.server.open_rollout(params, version, rollout_config.max_turns, service.max_length)
        self.rollout.params = params
        restored, self.restored = self.restored, []
        for saved in restored:
            self._start(saved["group"], saved["prompt"], saved["started"], saved["slots"])
        for j, prompt in enumerate(mine):
            self._start(self.next_group + first + j, prompt, version)
        if restored:
            self._replay(restored, rollout_config.agent_timeout)
        self.next_group += len(prompts)
        self._wanted = None

        target = shares(min(self.target, in_flight))[rank()]
        must_finish = {g.group for g in self.carried if version - g.started >= self.max_age}
        service.engine.wake()
        service.engine.reseed(seed * 1_000_003 + rank())
        with timer("rollout"):
            self._on_loop(self._set_step, target, must_finish)
            slots = [slot for g in self.carried for slot in g.slots]
            if not self._on_loop(self._reached):
                self.rollout.version = version
                firsts = self.rollout.slots.start(slots, version)
                if self._on_loop(self._reached):  # reached while the call was set up
                    self.rollout.slots.pause()
                try:
                    service.engine.generate_turns(firsts, params, self.rollout.slots.on_generation,
                                                  rollout_config.max_turns)
                except BaseException as error:  # every request waiting on the engine fails with it, none hangs
                    self.rollout.slots.fail(error)
                    raise
            trained = self._on_loop(self._take_trained)
        if sleep_after:
            service.engine.sleep()
        trajectories = [agent_trajectory(session, g.prompt, g.group, g.started)
                        for g in trained for session in g.sessions]
        if self.rollout.ignored_fields and trajectories:
            trajectories[0].agent_stats["ignored_fields"] = dict(self.rollout.ignored_fields)
        self.rollout.ignored_fields.clear()
        with timer("reward"):  # with an env file too, its reward_fn scores the ones whose run gave no reward
            score_unscored(service.env, trajectories)
        return all_gather_objects(trajectories)

    def _start(self, group_id: int, prompt: dict, version: int, replays: list[dict] | None = None) -> None:
        service, rollout_config = self.service, self.service.rollout_config
        from rl2.chat.tool_parsers import get_tool_parser

        sessions = [AgentSession(service.tokenizer, get_tool_parser(rollout_config.tool_parser),
                                 rollout_config.agent_sequences == "merge", prompt)
                    for _ in range(self.responses_per_prompt)]
        group = LiveGroup(group_id, prompt, version, sessions, left=len(sessions))
        episode = agent_episodes(service.agent, service.server, sessions, [prompt] * len(sessions), self.client,
                                 rollout_config.agent_timeout)
        self.carried.append(group)

        def ended(_: int) -> None:  # on the server's loop
            group.left -= 1
            if group.left == 0:
                self.finished.append(group)
                if self._step is not None and self._reached():
                    self.rollout.slots.pause()
                    service.engine.abort()

        group.keys, group.slots, _ = service.server.open_sessions(self.rollout, sessions, episode, ended, replays)

    def _replay(self, restored: list[dict], timeout: float) -> None:
        """Wait until the restored agents have been answered from their logs, then put the groups that had
        finished at the checkpoint back in their order."""
        ids = {saved["group"] for saved in restored}
        slots = [slot for g in self.carried if g.group in ids for slot in g.slots]
        done = {saved["group"]: saved["finished"] for saved in restored if saved["finished"] is not None}
        deadline = time.monotonic() + timeout
        while self.rollout.slots.replaying(slots) or not self._on_loop(self._have_finished, set(done)):
            if time.monotonic() > deadline:
                logger.warning("restored agents still replaying their logs after %.0f s: they go on live", timeout)
                break
            time.sleep(0.002)
        self._on_loop(lambda: self.finished.sort(key=lambda g: done.get(g.group, len(done))))

    def _have_finished(self, groups: set[int]) -> bool:
        return groups <= {g.group for g in self.finished}

    # ---- on the server's loop: the agents' callbacks run there ------------------------------------

    def _on_loop(self, fn, *args):
        async def call():
            return fn(*args)
        return asyncio.run_coroutine_threadsafe(call(), self.service.server.loop).result()

    def _set_step(self, target: int, must_finish: set[int]) -> None:
        self._step = (target, must_finish)

    def _reached(self) -> bool:
        target, must_finish = self._step
        return len(self.finished) >= target and must_finish <= {g.group for g in self.finished}

    def _take_trained(self) -> list[LiveGroup]:
        """The groups that train this step (the first `target` to finish, and those that had to), out of flight."""
        target, must_finish = self._step
        self._step = None
        trained = self.finished[:target] + [g for g in self.finished[target:] if g.group in must_finish]
        taken = {id(g) for g in trained}
        self.finished = [g for g in self.finished if id(g) not in taken]
        self.carried = [g for g in self.carried if id(g) not in taken]
        for group in trained:
            self.service.server.close_sessions(self.rollout, group.keys)
        return trained

    # ---- metrics and checkpoints ------------------------------------------------------------------

    def metrics(self, trained: list[Trajectory], version: int) -> dict[str, float]:
        """`partial_metrics` of this step, the groups in flight on every rank."""
        local = [[v for sequence in s.sequences for v in sequence.versions] for g in self.carried for s in g.sessions]
        carried = [versions for part in all_gather_objects([local]) for versions in part]
        metrics = partial_metrics(trained, carried, sum(all_gather_objects([len(self.carried)])), version)
        mismatches = self.rollout.slots.replay_mismatches if self.rollout is not None else 0
        metrics["partial/replay_mismatches"] = float(sum(all_gather_objects([mismatches])))
        return metrics

    def state_dict(self) -> dict:
        """Every rank's groups in flight, with what their slots served (their agents replay it on resume)."""
        order = {id(g): i for i, g in enumerate(self.finished)}
        mine = [{"group": g.group, "prompt": g.prompt, "started": g.started, "finished": order.get(id(g)),
                 "slots": self.rollout.slots.snapshot(g.slots)} for g in self.carried] + self.restored
        return {"next_group": self.next_group, "groups_by_rank": all_gather_objects([copy.deepcopy(mine)]),
                "restart_prompts": self.restarts}

    def load_state_dict(self, state: dict) -> None:
        self.next_group = state["next_group"]
        self.restarts = list(state.get("restart_prompts", []))
        by_rank = state.get("groups_by_rank", [])
        if len(by_rank) == world_size():
            self.restored = list(by_rank[rank()])
        elif any(by_rank):
            logger.warning("the checkpoint's groups in flight ran on %d ranks, this run has %d: their agents start "
                           "again from their prompts", len(by_rank), world_size())
            self.restarts += [saved["prompt"] for part in by_rank for saved in part]
