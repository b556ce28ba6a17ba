"""Multi-turn rollouts: generate → run the tools (or `interact`) → append the tools' tokens → generate again.

Trajectories are kept as token ids (token-in, token-out): the model's tokens are never
re-tokenised. With native function calling (an env file with `TOOLS`) each turn's text is parsed into
`tool_calls` (`ToolCalling`), the calls run, and their results become tool messages; otherwise the env's
`interact(messages)` gives the new messages. Either way they are appended as the tokens the chat
template adds after the assistant turn (`rl2.chat.bridge`), so the trajectory is the templated
conversation. With raw prompts (`apply_chat_template=False`: base models, as Search-R1 trains them)
there is no template: a tool's messages are appended as their plain text and the model continues after it.
Where the engine records routes (R3 routing replay), a trajectory's routes grow with each turn's generation:
the tokens added between turns get theirs when the next turn's prompt is prefilled (`grown_routes`).

Per turn (`rollout.trajectory_format=per_turn`) each turn after the first starts a sequence of its own:
the chat template's rendering of the whole conversation so far, as the template would show it at
inference (Qwen3 drops the reasoning of turns before the last user message), then the turn's tokens.
The trajectory's `token_ids` hold those sequences one after the other (`Trajectory.turn_starts`), each
trained as its own sequence with the trajectory's reward.

An episode ends when the env says so (`interact` returns [], a turn makes no tool call, a gym-style
environment's step is done: terminated or truncated), at `max_turns` generations, or at the sequence
length limit; a turn cut by max_new_tokens ends it too, except with a gym-style environment, which is
stepped on the cut text and goes on until it is done. However it ends, it is scored as it stands
(`assign_rewards`: `reward_fn` on the conversation so far, or the environment's rewards of its steps, the
last turn's step included): an episode that never answered is penalised by its reward, not dropped.
Only a failure (an env call that raised or timed out, an aborted generation) leaves it out of training.

A vision-language policy's trajectory carries its images (`Trajectory.images`, each turn's `Turn.images`): its
prompt's (`rl2.rollout.images`), then those its tools return as image parts (a PIL image, a path), each written
as the image-pad tokens it stands for; an image that does not fit the length limit is left out whole.
"""

import contextlib
import copy
import dataclasses
import logging
import threading
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any, Callable

import torch

from rl2.chat.bridge import observation_tokens
from rl2.chat.template import render_chat
from rl2.chat.tool_parsers import FunctionToolParser, ToolParser, get_tool_parser
from rl2.config import RolloutConfig
from rl2.engines import Engine, Generation, SamplingParams, Turn
from rl2.errors import DataError
from rl2.models.routing_replay import UNRECORDED
from rl2.rollout.env import Env, EnvResult, Interactions, ToolResult
from rl2.rollout.images import RolloutImages, has_image_parts
from rl2.rollout.trajectory import RunningState, Trajectory
from rl2.vision.image_inputs import ImageInputs

CHARS_PER_TOKEN = 32  # characters kept per token of room when a message is cut before tokenising: more than any token spans

logger = logging.getLogger(__name__)


@dataclass
class ToolCalling:
    """Native function calling in a rollout: how a turn's calls are parsed, and how many of them run."""

    parser: ToolParser
    max_calls: int = 8

    @classmethod
    def for_env(cls, env: Env | None, config: RolloutConfig) -> "ToolCalling | None":
        """For an env file with `TOOLS`: its own `parse_tool_calls`, else `rollout.tool_parser`."""
        if env is None or not env.has_tools:
            return None
        parser = FunctionToolParser(env.parse_tool_calls) if env.parse_tool_calls else get_tool_parser(config.tool_parser)
        return cls(parser, config.max_tool_calls)


def rollout(
    engine: Engine,
    env: Env | None,
    tokenizer,
    prompts: list[dict],
    responses_per_prompt: int,
    params: SamplingParams,
    max_turns: int = 1,
    max_length: int | None = None,
    first_group: int = 0,
    apply_chat_template: bool = True,
    version: int = 0,
    tool_calling: ToolCalling | None = None,
    per_turn: bool = False,
    images: RolloutImages | None = None,
) -> list[Trajectory]:
    """`responses_per_prompt` trajectories for each prompt ({"prompt_ids", "messages", "answer"}, and
    "tools": the schemas the prompt was rendered with, "source": its row's `data_source`),
    grouped by prompt, of at most `max_turns` generations and `max_length` tokens in all (per turn:
    in each turn's sequence). `apply_chat_template` says how the prompts were made (`RLDataset`), and so
    how tool messages are appended: through the chat template, or as plain text (`observation_tokens`).
    `version` is the policy version that samples (recorded per token). A vision-language policy's prompts
    carry their `images` (`RolloutImages.prepare`), and `images` turns those its tools return into its inputs."""
    trajectories = new_trajectories(prompts, responses_per_prompt, first_group, version, per_turn)
    continue_rollout(engine, env, tokenizer, trajectories, params, max_turns, max_length, apply_chat_template, version,
                     tool_calling=tool_calling, images=images)
    return trajectories


def new_trajectories(prompts: list[dict], responses_per_prompt: int, first_group: int = 0,
                     version: int = 0, per_turn: bool = False) -> list[Trajectory]:
    """The trajectories of `prompts`, before their first turn, `responses_per_prompt` of each, grouped;
    with `per_turn`, each turn of theirs a sequence of its own."""
    return [
        Trajectory(
            messages=copy.deepcopy(prompt["messages"]),
            answer=prompt["answer"],
            group=first_group + g,
            token_ids=list(prompt["prompt_ids"]),
            action_mask=[0] * len(prompt["prompt_ids"]),
            logprobs=[0.0] * len(prompt["prompt_ids"]),
            versions=[-1] * len(prompt["prompt_ids"]),
            started=version,
            tools=copy.deepcopy(prompt.get("tools")),
            turn_starts=[0] if per_turn else None,
            source=prompt.get("source"),
            running=RunningState(row=prompt.get("row")),
            images=prompt.get("images"),  # shared by the group's trajectories: never changed in place
            turn_images=[[0, prompt["images"].count]] if per_turn and prompt.get("images") is not None else None,
        )
        for g, prompt in enumerate(prompts)
        for _ in range(responses_per_prompt)
    ]


class Pause:
    """Ends a partial rollout early: `now()` aborts the engine's generations, and the generations that
    come back aborted are kept as paused (continued later), not as failures."""

    def __init__(self, engine: Engine):
        self.engine = engine
        self.requested = threading.Event()

    def now(self) -> None:
        self.requested.set()
        self.engine.abort()


def continue_rollout(
    engine: Engine,
    env: Env | None,
    tokenizer,
    trajectories: list[Trajectory],
    params: SamplingParams,
    max_turns: int = 1,
    max_length: int | None = None,
    apply_chat_template: bool = True,
    version: int = 0,
    on_done: Callable[[Trajectory], None] | None = None,
    pause: Pause | None = None,
    tool_calling: ToolCalling | None = None,
    images: RolloutImages | None = None,
) -> None:
    """Take `trajectories` on from where each stands (`RunningState.stage`): new ones from their first
    turn, paused ones from inside their turn (the tokens drawn so far kept, the same random stream
    continued) or from their tool call. Each one that ends is passed to `on_done` (from the engine's
    thread or a tool's, one at a time); after `pause.now()` the call returns at once and the unfinished
    ones keep what they have, to be continued by a later call (a tool call still running is cancelled
    and made again). With `tool_calling` each turn's calls are parsed and run; a turn without one goes
    to the env's `interact` if it has one, else ends the episode. An episode at `max_turns` or at the
    length limit ends unfailed, to be scored as it stands (see the module's docstring). A tool message with
    image parts (a vision-language policy's `images`) adds its images to the trajectory's, for the next turn."""
    if max_turns > 1 and (env is None or not (env.has_interact or env.has_tools or env.steps_environment)):
        raise ValueError("rollout.max_turns > 1 needs an env file that defines interact(messages), TOOLS or make_env")
    stop_ids = set(params.stop_token_ids)
    if not params.ignore_eos and tokenizer.eos_token_id is not None:
        stop_ids.add(tokenizer.eos_token_id)
    stepping = env is not None and env.steps_environment  # gym-style: its environment says when the episode ends
    lock = threading.Lock()

    def finish(trajectory: Trajectory) -> None:
        trajectory.done = True
        if on_done is not None:
            with lock:
                on_done(trajectory)

    if env is not None and env.environment_factory is not None:
        _start_environments(env, [t for t in trajectories if not t.done], tokenizer, apply_chat_template, images)
    for trajectory in trajectories:
        if trajectory.running is not None:
            trajectory.running.row = None  # read by make_env only: not carried into the gathers and checkpoints
    for trajectory in trajectories:
        if not trajectory.done and trajectory.errors:  # its environment did not start
            finish(trajectory)
        elif not trajectory.done and _room(trajectory, max_length) <= 0:
            trajectory.truncated = True  # a prompt that fills the limit
            finish(trajectory)
    active = [t for t in trajectories if not t.done]

    def next_turn(trajectory: Trajectory, result: EnvResult) -> Turn | None:
        """Runs when the tool answered: append its tokens, or end the episode."""
        if result.error is not None:
            trajectory.errors.append(result.error)
        if result.error is not None or not result.value:
            finish(trajectory)
            return None
        if has_image_parts(result.value):
            try:  # a tool's image that cannot be read or placed ends the episode as an env error
                new_messages, added = _tool_images(trajectory, result.value, images)
                _append_observation(trajectory, new_messages, tokenizer, max_length, apply_chat_template, images, added)
            except DataError as exc:
                trajectory.errors.append(str(exc))
                finish(trajectory)
                return None
        else:  # per turn, the next sequence holds the images so far again
            _append_observation(trajectory, result.value, tokenizer, max_length, apply_chat_template, images)
        if trajectory.done:
            finish(trajectory)
            return None
        trajectory.running.stage = "generate"
        return _turn(trajectory, params, max_length)

    with env.interactions() if max_turns > 1 else contextlib.nullcontext() as interactions:

        def ask_tool(trajectory: Trajectory) -> Future:
            trajectory.running.stage = "interact"
            if trajectory.running.pending_calls:
                answered = _run_calls(interactions, trajectory, tool_calling.max_calls)
            elif env.steps_environment:  # gym-style: the environment steps on the turn's text
                answered = interactions.step(trajectory.running.environment, trajectory.messages[-1]["content"])
            elif env.has_interact:
                answered = interactions(trajectory.messages)
            else:  # no call, and nobody else to answer: the episode ends
                answered = Future()
                answered.set_result(EnvResult([], None))
            return _then(answered, lambda result: next_turn(trajectory, result))

        def on_generation(index: int, generation: Generation) -> Future | None:
            trajectory = active[index]
            paused = generation.finish_reason == "abort" and pause is not None and pause.requested.is_set()
            wrote_pad = images is not None and images.pad in generation.token_ids
            if wrote_pad:
                # The model's forward puts an image's features at every image-pad token: one the policy wrote
                # stands for no image (the trainer's forward would fail). The turn ends before it; the
                # episode is left out of training.
                cut = generation.token_ids.index(images.pad)
                generation = dataclasses.replace(generation, token_ids=generation.token_ids[:cut],
                                                 logprobs=generation.logprobs[:cut], finish_reason="length")
                paused = False
            _append_generation(trajectory, generation, tokenizer, stop_ids, max_length, version, paused,
                               length_ends_episode=not stepping)
            if wrote_pad:
                trajectory.errors.append("the policy generated an image-pad token")
                trajectory.done = True
            if paused and not trajectory.done and trajectory.running.generating_from >= 0:
                return None
            if tool_calling is not None:
                _parse_calls(trajectory, tool_calling.parser)
            if trajectory.turns == max_turns:
                trajectory.done = True
            if trajectory.done and stepping and not trajectory.errors:
                last_steps.append(step_last_turn(trajectory))  # its reward is the environment's to give
                return None
            if trajectory.done:
                finish(trajectory)
                return None
            return ask_tool(trajectory)

        def step_last_turn(trajectory: Trajectory) -> Future:
            """A gym-style environment steps the episode's last turn too (at rollout.max_turns or the length
            limit): no turn follows, but the step's reward counts."""
            def stepped(result: EnvResult) -> None:
                if result.error is not None:
                    trajectory.errors.append(result.error)
                finish(trajectory)

            return _then(interactions.step(trajectory.running.environment, trajectory.messages[-1]["content"]), stepped)

        last_steps: list[Future] = []
        first = [ask_tool(t) if t.running.stage == "interact" else _turn(t, params, max_length) for t in active]
        engine.generate_turns(first, params, on_generation, max_turns)  # also with none: a lockstep engine's call
        for step in last_steps:
            step.result()


def _parse_calls(trajectory: Trajectory, parser: ToolParser) -> None:
    """Read the tool calls out of the turn just generated: its message gets the text outside them as
    `content` and the calls that parsed as `tool_calls` (the ones that did not stay in the text, so the
    message keeps all the model said); every call, parsed or not, waits in `pending_calls` for its answer."""
    message = trajectory.messages[-1]
    parsed = parser.parse(message["content"], trajectory.tools)
    if not parsed.calls:
        return
    calls = []
    for call in parsed.calls:
        calls.append({"id": parser.call_id(trajectory.running.calls_made), "name": call.name,
                      "arguments": call.arguments, "error": call.error})
        trajectory.running.calls_made += 1
    unparsed = [call.raw for call in parsed.calls if call.error is not None]
    message["content"] = "\n".join([parsed.content, *unparsed]).strip() if unparsed else parsed.content
    well_formed = [call for call in calls if call["error"] is None]
    if well_formed:
        message["tool_calls"] = [{"id": call["id"], "type": "function",
                                  "function": {"name": call["name"], "arguments": call["arguments"]}}
                                 for call in well_formed]
    trajectory.running.pending_calls = calls


def _run_calls(interactions: Interactions, trajectory: Trajectory, max_calls: int) -> Future:
    """A future of the `EnvResult` of the trajectory's pending calls: one tool message per call, in order
    (a call that did not parse, or past `max_calls`, is answered with what was wrong), and the first
    infrastructure error, if any (then the episode ends)."""
    calls = trajectory.running.pending_calls
    runnable = [call for call in calls[:max_calls] if call["error"] is None]
    results = interactions.call_tools([(call["name"], call["arguments"]) for call in runnable],
                                      trajectory.running.environment)

    def tool_messages(outcomes: list[ToolResult]) -> EnvResult:
        by_id = {call["id"]: outcome for call, outcome in zip(runnable, outcomes)}
        messages, env_error = [], None
        for i, call in enumerate(calls):
            outcome = by_id.get(call["id"])
            if outcome is None:
                why = call["error"] or f"not run: at most {max_calls} tool calls are run per turn"
                outcome = ToolResult(f"Error: {why}", error=why)
            env_error = env_error or outcome.env_error
            known = call["name"] in interactions.env.tools  # a name the model made up is counted as "(unknown)"
            if outcome.env_error is None:  # an infrastructure failure counts in env_errors
                trajectory.tool_stats.append({"name": call["name"] if known else "(unknown)",
                                              "error": outcome.error is not None, "seconds": outcome.seconds})
            messages.append({"role": "tool", "tool_call_id": call["id"], "name": call["name"] or "unknown",
                             "content": outcome.content})
        trajectory.running.pending_calls = []
        return EnvResult(messages, env_error)

    return _then(results, tool_messages)


def _start_environments(env: Env, trajectories: list[Trajectory], tokenizer, apply_chat_template: bool,
                        images: RolloutImages | None = None) -> None:
    """A stateful environment for each trajectory that has none yet (`reset` gets the row's messages and
    answer); an observation `reset` returns is appended to the prompt as a user message (nothing has been
    generated yet: the prompt is rendered again, its images' pad tokens expanded again). One that fails to
    start is an env error."""
    new = [t for t in trajectories if t.running.environment is None and t.turns == 0 and t.running.generating_from < 0]
    rows = [{**((t.running.row or {}) if env.steps_environment else {}), "messages": copy.deepcopy(t.messages),
             "answer": t.answer} for t in new]  # make_env(row) gets the row's columns; ENVIRONMENT.reset its own
    for trajectory, result in zip(new, env.start_environments(rows)):
        if result.error is not None:
            trajectory.errors.append(result.error)
            continue
        trajectory.running.environment, observation = result.value
        if observation:
            trajectory.messages += ([{"role": "user", "content": observation}] if isinstance(observation, str)
                                    else copy.deepcopy(observation))
            text = (render_chat(trajectory.messages, tokenizer, True, trajectory.tools) if apply_chat_template
                    else tokenizer.decode(trajectory.token_ids, skip_special_tokens=False) + observation)
            ids = list(tokenizer(text, add_special_tokens=False)["input_ids"])
            if trajectory.images is not None and images is not None:
                ids = images.expand(ids, images.counts(trajectory.images), f"the prompt of group {trajectory.group}")
            trajectory.token_ids, trajectory.action_mask = ids, [0] * len(ids)
            trajectory.logprobs, trajectory.versions = [0.0] * len(ids), [-1] * len(ids)


def _turn(trajectory: Trajectory, params: SamplingParams, max_length: int | None) -> Turn:
    """The trajectory's next generation; inside a paused turn, the rest of it, from the same random stream."""
    running = trajectory.running
    drawn = len(trajectory.token_ids) - running.generating_from if running.generating_from >= 0 else 0
    room = min(params.max_new_tokens - drawn, _room(trajectory, max_length))
    return Turn(trajectory.token_ids[trajectory.sequence_start:], room, stream=running.stream if drawn else None,
                offset=drawn, images=trajectory.images)


def _then(future: Future, fn: Callable[[Any], Any]) -> Future:
    """A future of `fn(future's result)`; `fn` runs in the thread that completes `future`."""
    chained: Future = Future()

    def run(done: Future) -> None:
        try:
            chained.set_result(fn(done.result()))
        except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on `chained`
            chained.set_exception(exc)

    future.add_done_callback(run)
    return chained


def _room(trajectory: Trajectory, max_length: int | None) -> int:
    """Tokens the sequence being generated may still grow by."""
    return 2**62 if max_length is None else max_length - (len(trajectory.token_ids) - trajectory.sequence_start)


def _append_generation(
    trajectory: Trajectory, generation: Generation, tokenizer, stop_ids: set[int], max_length: int | None,
    version: int = 0, paused: bool = False, length_ends_episode: bool = True,
) -> None:
    """Append a generation's tokens, then (unless `paused` inside it) end the turn: its message is all
    the turn's tokens, those drawn before a pause included. A turn that fills the sequence length limit
    ends the episode; one cut by max_new_tokens too, unless not `length_ends_episode` (a gym-style
    environment steps on the cut text and says itself whether its episode goes on)."""
    tokens, logprobs = list(generation.token_ids), list(generation.logprobs)
    room = _room(trajectory, max_length)
    cut = len(tokens) > room
    tokens, logprobs = tokens[:room], logprobs[:room]
    running = trajectory.running
    if running.generating_from < 0:
        running.generating_from = len(trajectory.token_ids)
    trajectory.token_ids += tokens
    trajectory.action_mask += [1] * len(tokens)
    trajectory.logprobs += logprobs
    if len(trajectory.versions) == len(trajectory.token_ids) - len(tokens):  # tracked since the prompt
        trajectory.versions += [version] * len(tokens)
    if generation.routes is not None:
        trajectory.routes = grown_routes(trajectory, generation.routes)
    if paused and not cut and _room(trajectory, max_length) > 0:
        running.stream = generation.stream
        return
    tokens = trajectory.token_ids[running.generating_from:]
    running.generating_from, running.stream = -1, None
    trajectory.turns += 1
    # The message holds what the model said; the template adds the end-of-turn token again.
    # A stop token id, or another special token the engine stops on (a generation config's eos).
    ends_with_stop = (
        generation.finish_reason == "stop"
        and not cut
        and bool(tokens)
        and (tokens[-1] in stop_ids or tokens[-1] in tokenizer.all_special_ids)
    )
    content_tokens = tokens[:-1] if ends_with_stop else tokens
    content = tokenizer.decode(content_tokens, skip_special_tokens=False, clean_up_tokenization_spaces=False)
    trajectory.messages.append({"role": "assistant", "content": content})
    if generation.finish_reason == "abort":
        trajectory.errors.append(generation.error or "the engine aborted the generation")
        trajectory.done = True
    at_limit = cut or _room(trajectory, max_length) <= 0  # the sequence length limit
    trajectory.truncated = at_limit or generation.finish_reason == "length"  # its latest turn was cut
    if at_limit or (generation.finish_reason == "length" and length_ends_episode):
        trajectory.done = True


def grown_routes(trajectory: Trajectory, routes: torch.Tensor) -> torch.Tensor:
    """The trajectory's routes (R3) grown by a generation's (`Generation.routes`, from the start of the sequence
    it continued): the tokens routed before keep their routes, those after get the generation's, the
    trajectory's tokens the engine fed no forward (a per-turn sequence's last sampled token) UNRECORDED."""
    # A trajectory resumed after a pause (partial rollout) has its prefix prefilled again under the new weights:
    # the routes recorded before the pause are kept, not the re-prefill's, since the tokens after each of them
    # were sampled under that routing (what R3 replays); the token sampled last before the pause was never fed,
    # so it, and all after it, get the new weights' routes.
    start, old = trajectory.sequence_start, trajectory.routes
    if old is None:
        old = routes.new_full((0, *routes.shape[1:]), UNRECORDED)
    if len(old) < start:
        old = torch.cat([old, old.new_full((start - len(old), *old.shape[1:]), UNRECORDED)])
    return torch.cat([old, routes[len(old) - start:]])[: len(trajectory.token_ids)]


def _tool_images(trajectory: Trajectory, messages: list[dict],
                 images: RolloutImages | None) -> tuple[list[dict], tuple[ImageInputs, list[int]] | None]:
    """A tool's messages with image parts as string content, their images and each one's pad-token count."""
    where = f"the tool's reply in the trajectory of group {trajectory.group}"
    if images is None:
        raise DataError(f"{where}: a message's content is a list of parts (an image?), but the policy is not a "
                        "vision-language model: give the content as a string")
    text, added, counts = images.tool_messages(messages, where)
    return text, (added, counts) if added is not None else None


def _append_observation(
    trajectory: Trajectory, new_messages: list[dict], tokenizer, max_length: int | None, apply_chat_template: bool,
    images: RolloutImages | None = None, added: tuple[ImageInputs, list[int]] | None = None,
) -> None:
    """Append the tokens of `new_messages` (a tool's); `added`: their images and each one's pad-token count."""
    if trajectory.turn_starts is not None:
        _start_turn_sequence(trajectory, new_messages, tokenizer, max_length, images, added)
        return
    new_messages, cut = _cut_to_room(new_messages, _room(trajectory, max_length))
    tokens = observation_tokens(tokenizer, trajectory.token_ids, trajectory.messages, new_messages, apply_chat_template,
                                trajectory.tools)
    if added is not None and cut:  # cut for room: the episode ends here, before the first image
        tokens, added = tokens[:tokens.index(images.pad)] if images.pad in tokens else tokens, None
    elif added is not None:
        tokens = images.expand(tokens, added[1], f"the tool's reply in the trajectory of group {trajectory.group}")
    trajectory.messages.extend(new_messages)
    room = _room(trajectory, max_length)
    kept = len(added[1]) if added is not None else 0
    if len(tokens) >= room or cut:
        # No room left to answer after the tool output: the episode ends at the limit.
        tokens = tokens[: max(room, 0)]
        if added is not None:  # an image is never cut: the tokens end before the first one that does not fit
            tokens, kept = _whole_images(tokens, images.pad, added[1])
        trajectory.truncated = True
        trajectory.done = True
    if kept:
        trajectory.images = ImageInputs.concat([trajectory.images, _first_images(added[0], kept)])
    trajectory.token_ids += tokens
    trajectory.action_mask += [0] * len(tokens)
    trajectory.logprobs += [0.0] * len(tokens)
    if len(trajectory.versions) == len(trajectory.token_ids) - len(tokens):
        trajectory.versions += [-1] * len(tokens)


def _whole_images(tokens: list[int], pad: int, counts: list[int]) -> tuple[list[int], int]:
    """`tokens` (cut) ending before the first image whose `counts[k]` pad tokens they do not all hold, and how
    many images they hold whole."""
    position, k = 0, 0
    while position < len(tokens):
        if tokens[position] != pad:
            position += 1
            continue
        if position + counts[k] > len(tokens):
            return tokens[:position], k
        position += counts[k]
        k += 1
    return tokens, k


def _first_images(images: ImageInputs, count: int) -> ImageInputs:
    """The first `count` of `images`."""
    if count == images.count:
        return images
    patches = int(images.image_grid_thw[:count].prod(-1).sum())
    return ImageInputs(images.pixel_values[:patches], images.image_grid_thw[:count])


def _cut_to_room(new_messages: list[dict], room: int) -> tuple[list[dict], bool]:
    """`new_messages` with each content cut to `CHARS_PER_TOKEN` characters a token of the `room` left,
    before they are tokenised (a 10 MB tool result would take half a minute and gigabytes to tokenise, for
    the few thousand tokens kept); and whether any was cut (then the sequence is full: the episode ends)."""
    limit = max(room, 0) * CHARS_PER_TOKEN
    if all(not isinstance(m.get("content"), str) or len(m["content"]) <= limit for m in new_messages):
        return new_messages, False
    return [{**m, "content": m["content"][:limit]} if isinstance(m.get("content"), str) else m
            for m in new_messages], True


def _start_turn_sequence(trajectory: Trajectory, new_messages: list[dict], tokenizer, max_length: int | None,
                         images: RolloutImages | None = None,
                         added: tuple[ImageInputs, list[int]] | None = None) -> None:
    """Per turn: the next turn's sequence begins with the template's rendering of the whole conversation,
    `new_messages` and the generation prompt included, every image's pad tokens expanded (the trajectory's
    images and `added`, those of `new_messages`, which it then holds all of). One that leaves no room to
    generate is not begun: the episode ends at the limit."""
    new_messages, cut = _cut_to_room(new_messages, 2**62 if max_length is None else max_length)
    trajectory.messages.extend(new_messages)
    text = render_chat(trajectory.messages, tokenizer, True, trajectory.tools)
    tokens = list(tokenizer(text, add_special_tokens=False)["input_ids"])
    held = ImageInputs.concat([trajectory.images, added[0] if added is not None else None])
    if held is not None and not cut:
        tokens = images.expand(tokens, images.counts(held), f"turn {len(trajectory.turn_starts) + 1} of the "
                                                            f"trajectory of group {trajectory.group}")
    if max_length is not None and (len(tokens) >= max_length or cut):
        trajectory.truncated = True
        trajectory.done = True
        return
    if held is not None:
        trajectory.turn_images = (trajectory.turn_images or [[0, 0]] * len(trajectory.turn_starts)) + [[0, held.count]]
        trajectory.images = held
    trajectory.turn_starts.append(len(trajectory.token_ids))
    trajectory.token_ids += tokens
    trajectory.action_mask += [0] * len(tokens)
    trajectory.logprobs += [0.0] * len(tokens)
    if len(trajectory.versions) == len(trajectory.token_ids) - len(tokens):
        trajectory.versions += [-1] * len(tokens)


def assign_rewards(env: Env | None, trajectories: list[Trajectory]) -> None:
    """Score the trajectories with the env's `reward_fn` (concurrently), or their stateful environments'
    `reward()` where the env file has no `reward_fn`; a failed call leaves the reward None and its error is
    kept on the trajectory. A trajectory that already failed (an env error, an aborted generation) is not
    scored: its outcome is not the policy's. Their stateful environments are closed then, and their episodes
    are over (`running` None). Without an env file (on-policy distillation alone) nothing is scored."""
    if env is not None:
        _score(env, trajectories)
    for trajectory in trajectories:
        trajectory.running = None


def _score(env: Env, trajectories: list[Trajectory]) -> None:
    to_score = [t for t in trajectories if not t.errors]
    by_instance = [t for t in to_score if _environment(t) is not None and env.scores_with_environment]
    by_function = [t for t in to_score if not (_environment(t) is not None and env.scores_with_environment)]
    results = env.rewards([t.messages for t in by_function], [t.answer for t in by_function]) if by_function else []
    results += env.environment_rewards([_environment(t) for t in by_instance]) if by_instance else []
    for trajectory, result in zip(by_function + by_instance, results):
        trajectory.reward = result.value
        if result.error is not None:
            trajectory.errors.append(result.error)
    with_environments = [t for t in trajectories if _environment(t) is not None]
    for trajectory in with_environments:
        trajectory.step_rewards = list(getattr(_environment(trajectory), "rewards", []))  # a gym-style episode's
    env.close_environments([_environment(t) for t in with_environments])


def _environment(trajectory: Trajectory) -> Any:
    """The trajectory's stateful environment, if it has one (none once its episode is over)."""
    return trajectory.running.environment if trajectory.running is not None else None
