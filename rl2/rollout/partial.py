"""Partial rollout (Kimi k1.5; RL2's `rollout.train.partial_rollout`): a step stops generating once it has
the groups it trains on; the trajectories still generating or waiting for their tool keep their tokens,
behaviour log-probs and the policy version of every token, and continue in the next step under the new
weights (their prefix prefilled again, never regenerated; a tool call still running is made again).

Each step has `target + extra` groups in flight: the carried-over ones first, then new prompts. The groups
are dealt to the ranks in contiguous slices. A rank generates until `target` of its share (its slice of the
target count) have every trajectory done, and every group that has waited `max_age` steps is done too, then
pauses the rest. The groups that finished first train, in the order they finished; the others carry over.
Every rank holds all the carried-over groups (they are gathered), so a checkpoint saves them and a resumed
run continues them where they stood.
"""


from rl2.config import RolloutConfig
from rl2.distributed.process_group import all_gather_objects, rank, rank_slice
from rl2.engines import SamplingParams
from rl2.metrics import PhaseTimer
from rl2.rollout.multi_turn import Pause, assign_rewards, continue_rollout, new_trajectories
from rl2.rollout.trajectory import Trajectory

Group = list[Trajectory]


def partial_extra_prompts(rollout: RolloutConfig, prompts_per_step: int) -> int:
    """`rollout.partial_extra_prompts`, or a quarter of a step's prompts (at least 1)."""
    return rollout.partial_extra_prompts or max(1, prompts_per_step // 4)


def partial_rollout(service, rollout: RolloutConfig, prompts_per_step: int,
                    responses_per_prompt: int) -> "PartialRollout | None":
    """With `rollout.partial_rollout`: the `PartialRollout` of `service`'s engine, `prompts_per_step` groups a
    step of `responses_per_prompt` trajectories each."""
    if not rollout.partial_rollout:
        return None
    extra = partial_extra_prompts(rollout, prompts_per_step)
    if getattr(service, "agent", None) is not None:  # agents go on where they run: each rank keeps its own
        from rl2.rollout.agent_partial import AgentPartialRollout

        return AgentPartialRollout(service, prompts_per_step, extra, rollout.partial_max_age, responses_per_prompt)
    return PartialRollout(service, prompts_per_step, extra, rollout.partial_max_age, responses_per_prompt)


class GroupTarget:
    """Counts a rank's groups as their trajectories end (`done`, called from the engine's thread or a
    tool's, one at a time) and pauses the rollout once `target` groups are complete and every group in
    `must_finish` is."""

    def __init__(self, groups: list[Group], target: int, must_finish: set[int], pause: Pause):
        self.group_of = {id(t): g for g, group in enumerate(groups) for t in group}
        self.left = [sum(not t.done for t in group) for group in groups]
        self.finished = [g for g, left in enumerate(self.left) if left == 0]  # in the order they finished
        self.target, self.must_finish, self.pause = target, must_finish, pause

    def reached(self) -> bool:
        return len(self.finished) >= self.target and self.must_finish <= set(self.finished)

    def done(self, trajectory: Trajectory) -> None:
        g = self.group_of[id(trajectory)]
        self.left[g] -= 1
        if self.left[g] == 0:
            self.finished.append(g)
            if self.reached() and not self.pause.requested.is_set():
                self.pause.now()


class PartialRollout:
    """The groups carried from one step to the next, and the step that continues them (see the module)."""

    def __init__(self, service, target: int, extra: int, max_age: int, responses_per_prompt: int):
        self.service = service
        self.target, self.extra, self.max_age = target, extra, max_age
        self.responses_per_prompt = responses_per_prompt
        self.carried: list[Group] = []
        self.next_group = 0  # a new group's id: ids stay unique across steps

    def prompts_wanted(self) -> int:
        """New prompts this step takes: room for `target + extra` groups in flight."""
        return max(self.target + self.extra - len(self.carried), 0)

    def generate(self, prompts: list[dict], params: SamplingParams, seed: int, version: int,
                 timer: PhaseTimer | None = None, sleep_after: bool = False) -> list[Trajectory]:
        """Continue the carried-over groups and start `prompts` under policy `version`; return the scored
        trajectories of the groups that train (every rank's, in rank order), and keep the others."""
        timer = timer or PhaseTimer()
        service = self.service
        images = getattr(service, "images", None)
        if images is not None:  # a vision-language policy: this rank's new prompts' images (the others' are not rolled out here)
            first, last = (max(edge - len(self.carried), 0) for edge in rank_slice(len(self.carried) + len(prompts)))
            prompts = prompts[:first] + images.prepare(prompts[first:last]) + prompts[last:]
        fresh = new_trajectories(prompts, self.responses_per_prompt, self.next_group, version,
                                 service.rollout_config.trajectory_format == "per_turn")
        self.next_group += len(prompts)
        groups = self.carried + [fresh[i:i + self.responses_per_prompt]
                                 for i in range(0, len(fresh), self.responses_per_prompt)]
        start, end = rank_slice(len(groups))
        mine = groups[start:end]
        low, high = rank_slice(min(self.target, len(groups)))
        must_finish = {g for g, group in enumerate(mine) if version - group[0].started >= self.max_age}
        pause = Pause(service.engine)
        target = GroupTarget(mine, min(high - low, len(mine)), must_finish, pause)
        service.engine.wake()
        service.engine.reseed(seed * 1_000_003 + rank())
        with timer("rollout"):
            if not target.reached():
                continue_rollout(service.engine, service.env, service.tokenizer, [t for g in mine for t in g], params,
                                 service.rollout_config.max_turns, service.max_length,
                                 service.data_config.apply_chat_template, version, target.done, pause,
                                 service.tool_calling, images)
        if sleep_after:
            with timer("sync"):  # the engine hands its memory back: part of the sync
                service.engine.sleep()
        trained_ids = target.finished[:target.target] + [g for g in target.finished[target.target:] if g in must_finish]
        trained = [t for g in trained_ids for t in mine[g]]
        kept = [group for g, group in enumerate(mine) if g not in set(trained_ids)]
        with timer("reward"):
            assign_rewards(service.env, trained)
        self.carried = [group for part in all_gather_objects([kept]) for group in part]
        return all_gather_objects(trained)

    def metrics(self, trained: list[Trajectory], version: int) -> dict[str, float]:
        """`partial_metrics` of this step (the carried groups are every rank's)."""
        carried = [t.versions for group in self.carried for t in group]
        return partial_metrics(trained, carried, len(self.carried), version)

    def state_dict(self) -> dict:
        """The carried-over groups (JSON-able) and the next group id, for a checkpoint."""
        return {"next_group": self.next_group,
                "carried": [[t.state() for t in group] for group in self.carried]}

    def load_state_dict(self, state: dict) -> None:
        self.next_group = state["next_group"]
        self.carried = [[Trajectory.from_dict(fields) for fields in group] for group in state["carried"]]


def partial_metrics(trained: list[Trajectory], carried_versions: list[list[int]], carried_groups: int,
                    version: int) -> dict[str, float]:
    """How much of what trains was sampled by older policies, how old, and what generating cost:
    `partial/resumed_ratio` (trajectories begun in an earlier step), `partial/stale_token_ratio`,
    `partial/age_mean` and `partial/age_max` (policy versions behind, over generated tokens),
    `partial/carried_groups`, and `partial/generated_per_trained` (tokens generated this step, by
    every group in flight, per generated token that trains); `carried_versions` are the token versions of
    every trajectory carried over."""
    ages = [version - v for t in trained for v, m in zip(t.versions, t.action_mask) if m]
    generated_now = sum(v == version for versions in carried_versions for v in versions)
    generated_now += sum(v == version for t in trained for v in t.versions)
    return {
        "partial/resumed_ratio": sum(t.started < version for t in trained) / max(len(trained), 1),
        "partial/stale_token_ratio": sum(age > 0 for age in ages) / max(len(ages), 1),
        "partial/age_mean": sum(ages) / max(len(ages), 1),
        "partial/age_max": float(max(ages, default=0)),
        "partial/carried_groups": float(carried_groups),
        "partial/generated_per_trained": generated_now / max(len(ages), 1),
    }
