"""One agent trajectory as the OpenAI-compatible server sees it: the requests its agent made, turned
into token sequences that hold exactly what the engine was given and sampled.

A request whose messages continue one of the trajectory's sequences (that sequence's conversation, its
last assistant message as the server returned it, then tool or user messages) is given that sequence's
token ids followed by the chat template's bridge to the new messages (`rl2.chat.bridge`): the sampled
tokens are never re-encoded. With `merge` the completion is appended to that sequence (one sequence for
an agent that only extends its conversation); otherwise every request is a sequence of its own, its
prompt still built from the sampled ids. A request that continues nothing (a rewritten history, a
sub-agent, a summariser) is rendered by the template; the assistant turns it holds are then re-encoded,
which is counted (`drift`).

A vision-language model's request may hold images (`image_url` parts with data URIs, `chat_images`): each
becomes the vision tokens' text in its message and its pad token is expanded as rl2's rendering expands it; a
sequence keeps the images its tokens stand for, and a conversation is continued only where its images are
the same.
"""

import copy
import json
from dataclasses import dataclass, field
from typing import Any

from rl2.chat.tool_parsers import ToolParser
from rl2.data.rows import parse_messages
from rl2.engines import Generation
from rl2.chat.bridge import observation_tokens
from rl2.chat.template import render_chat, template_renders_tools, tools_not_rendered
from rl2.serve.chat_images import IMAGE_DIGESTS, ChatImages
from rl2.vision.image_inputs import ImageInputs
from rl2.vision.inputs import IMAGE_TEXT


class RequestError(ValueError):
    """A request the server answers with 400: what is wrong with it."""


@dataclass
class AgentSequence:
    """Token ids the engine was given and sampled, with the conversation they render."""

    messages: list[dict]  # ends with the assistant message of the last completion
    tools: list[dict] | None
    token_ids: list[int] = field(default_factory=list)
    action_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    calls_made: int = 0  # tool-call ids given so far (the parser numbers them)
    images: ImageInputs | None = None  # the images its image-pad tokens stand for, in order

    def append(self, tokens: list[int], generated: bool, logprobs: list[float] | None = None,
               versions: list[int] | None = None) -> None:
        self.token_ids += tokens
        self.action_mask += [int(generated)] * len(tokens)
        self.logprobs += logprobs if logprobs is not None else [0.0] * len(tokens)
        self.versions += versions if versions is not None else [-1] * len(tokens)


@dataclass
class Kept:
    """What keeping one generation changed in a session, so that it can be dropped again (`AgentSession.drop`):
    a reply its agent never received is not trained."""

    sequence: AgentSequence
    new: bool  # the generation began this sequence
    start: int  # the sequence's length before it (its prompt's new part, then the generation)
    end: int  # and after it
    messages: list[dict]  # the sequence's messages before it
    calls_made: int
    reused: int
    rendered: int
    truncated: bool  # the session's `truncated` before it
    images: ImageInputs | None = None  # the sequence's images before it


@dataclass
class Plan:
    """What a request is generated from: its prompt ids, and the sequence it continues (None: a new
    one), as that sequence stood when the request came."""

    messages: list[dict]
    tools: list[dict] | None
    prompt_ids: list[int]
    base: AgentSequence | None = None
    base_length: int = 0
    reused: int = 0  # prompt tokens taken from sampled sequences rather than rendered
    images: ImageInputs | None = None  # the prompt's images, in order


def openai_messages(value: Any, images: ChatImages | None = None) -> list[dict]:
    """OpenAI chat messages in the form chat templates take: text parts joined, `developer` as `system`,
    `tool_calls` arguments decoded from their JSON strings; RequestError where malformed. With `images` (a
    vision-language model) an `image_url` part becomes the vision tokens' text, its image kept in `images` and
    its digest in the message's `image_digests`."""
    if not isinstance(value, list) or not value:
        raise RequestError("'messages' must be a non-empty list")
    plain = []
    for i, message in enumerate(value):
        if not isinstance(message, dict):
            raise RequestError(f"messages[{i}] must be an object")
        message = {key: item for key, item in message.items() if item is not None and key not in _CLIENT_ONLY_KEYS}
        if message.get("role") == "developer":
            message["role"] = "system"
        content = message.get("content")
        if isinstance(content, list):
            texts, digests = [], []
            for j, part in enumerate(content):
                kind = part.get("type") if isinstance(part, dict) else None
                if kind in ("text", "input_text", "output_text"):
                    texts.append(part.get("text", ""))
                elif kind == "image_url" and images is not None:
                    try:
                        digests.append(images.part(part, f"messages[{i}].content[{j}]"))
                    except ValueError as error:
                        raise RequestError(str(error)) from None
                    texts.append(IMAGE_TEXT)
                elif kind == "image_url":
                    raise RequestError(f"messages[{i}].content[{j}] is an image: this model reads text only")
                else:
                    raise RequestError(f"messages[{i}]: only text content parts are supported"
                                       + (" (and image_url parts)" if images is not None else ""))
            message["content"] = "".join(texts)
            if digests:
                message[IMAGE_DIGESTS] = digests
        elif content is None:
            message["content"] = ""
        plain.append(message)
    try:
        return parse_messages(plain, "the request")
    except ValueError as error:
        raise RequestError(str(error)) from None


# Keys clients send back on assistant messages that no chat template reads.
_CLIENT_ONLY_KEYS = ("refusal", "annotations", "audio", "function_call", "reasoning_content", "name_")


def same_message(ours: dict, theirs: dict) -> bool:
    """Whether a client's message is one the server holds (role, text, and the calls by name and arguments)."""
    def key(message: dict) -> tuple:
        calls = tuple((call["function"]["name"], json.dumps(call["function"].get("arguments") or {}, sort_keys=True))
                      for call in message.get("tool_calls") or [])
        return (message["role"], (message.get("content") or "").strip(), calls, message.get("tool_call_id"),
                tuple(message.get(IMAGE_DIGESTS, ())))

    return key(ours) == key(theirs)


def _expanded(ids: list[int], messages: list[dict], images: ChatImages | None) -> tuple[list[int], ImageInputs | None]:
    """`ids` rendered from `messages` with their images' pads expanded (`ChatImages.expand`), and those images."""
    if images is None:
        return ids, None
    try:
        return images.expand(ids, messages)
    except ValueError as error:
        raise RequestError(str(error)) from None


class AgentSession:
    """The sequences of one trajectory and what it cost to keep them exact."""

    def __init__(self, tokenizer, parser: ToolParser, merge: bool = True, row: dict | None = None):
        self.tokenizer, self.parser, self.merge = tokenizer, parser, merge
        # The dataset row's prompt, rendered by the same template: a first request for exactly its messages
        # and tools takes its ids instead of rendering them again.
        self.row_prompt = ((row["messages"], row.get("tools"), list(row["prompt_ids"]))
                           if row and row.get("prompt_ids") and row.get("messages") else None)
        self.sequences: list[AgentSequence] = []
        self.requests = 0  # generations kept
        self.requests_started = 0  # generations asked of the engine
        self.reused_tokens = 0  # prompt tokens taken from sampled sequences
        self.rendered_tokens = 0  # prompt tokens rendered by the template
        self.drift = 0  # requests that re-encoded assistant turns
        self.truncated = False
        self.at_request_limit = False  # a request was refused: the trajectory made its rollout.max_turns requests
        self.reward: float | None = None
        self.extras: dict[str, Any] = {}
        self.errors: list[str] = []
        self.tools_rendered = False  # the template was found to render tools (checked at the first request with some)

    def plan(self, messages: list[dict], tools: list[dict] | None, images: ChatImages | None = None) -> Plan:
        """The prompt ids of a request for `messages` (in template form) with `tools`; RequestError where the
        chat template would drop the tools. `images`: the request's images (a vision-language model), whose
        pad tokens are expanded."""
        if tools and not self.tools_rendered:
            if not template_renders_tools(self.tokenizer):
                raise RequestError(tools_not_rendered(self.tokenizer))
            self.tools_rendered = True
        for sequence in reversed(self.sequences):  # the latest first: the conversation an agent goes on with
            continued = len(sequence.messages)
            if (sequence.tools == tools and len(messages) > continued
                    and all(same_message(a, b) for a, b in zip(sequence.messages, messages[:continued]))
                    and all(m["role"] != "assistant" for m in messages[continued:])):
                new = messages[continued:]
                bridge = observation_tokens(self.tokenizer, sequence.token_ids, sequence.messages, new, True, tools)
                bridge, new_images = _expanded(bridge, new, images)
                prompt = sequence.token_ids + bridge
                return Plan(messages, tools, prompt, sequence, len(sequence.token_ids), reused=len(sequence.token_ids),
                            images=ImageInputs.concat([sequence.images, new_images]))
        if self.row_prompt is not None and not self.sequences and images is None:
            row_messages, row_tools, row_ids = self.row_prompt
            if row_tools == tools and len(row_messages) == len(messages) and all(
                    a == b for a, b in zip(row_messages, messages)):
                return Plan(messages, tools, list(row_ids))
        text = render_chat(messages, self.tokenizer, True, tools)
        prompt, prompt_images = _expanded(list(self.tokenizer(text, add_special_tokens=False)["input_ids"]), messages,
                                          images)
        self.drift += any(m["role"] == "assistant" for m in messages)
        return Plan(messages, tools, prompt, images=prompt_images)

    def plan_tokens(self, prompt_ids: list[int]) -> Plan:
        """The plan of a raw completion (`/v1/completions`): a prompt that starts with one of the
        trajectory's sequences continues it."""
        text = self.tokenizer.decode(prompt_ids, skip_special_tokens=False)
        messages = [{"role": "user", "content": text}]
        for sequence in sorted(self.sequences, key=lambda s: -len(s.token_ids)):
            if len(prompt_ids) > len(sequence.token_ids) and prompt_ids[:len(sequence.token_ids)] == sequence.token_ids:
                return Plan(messages, None, list(prompt_ids), sequence, len(sequence.token_ids),
                            reused=len(sequence.token_ids), images=sequence.images)
        return Plan(messages, None, list(prompt_ids))

    def record_tokens(self, plan: Plan, generation: Generation, versions: list[int],
                      kept: list[Kept] | None = None) -> None:
        """Keep a finished raw completion of `plan` (`versions`: the policy version of each token); what that
        changed is appended to `kept` (for `drop`)."""
        sequence = self._keep(plan, generation, versions, kept)
        text = self.tokenizer.decode(generation.token_ids, skip_special_tokens=False)
        sequence.messages = copy.deepcopy(plan.messages) + [{"role": "assistant", "content": text}]

    def _keep(self, plan: Plan, generation: Generation, versions: list[int],
              kept: list[Kept] | None = None) -> AgentSequence:
        """Append `plan`'s prompt (what is new of it) and its generation to the sequence they belong to; what
        that changed is appended to `kept`."""
        truncated = self.truncated
        self.requests += 1
        self.reused_tokens += plan.reused
        self.rendered_tokens += len(plan.prompt_ids) - plan.reused
        base = plan.base
        if base is not None and self.merge and len(base.token_ids) == plan.base_length:
            sequence, new = base, False  # the conversation goes on: one sequence
            undo = (sequence.messages, sequence.calls_made, len(sequence.token_ids), sequence.images)
            sequence.append(plan.prompt_ids[plan.base_length:], generated=False)
        else:  # a new request, a branch (n > 1, or two requests continuing one conversation), or each its own
            sequence, new = AgentSequence(copy.deepcopy(plan.messages), plan.tools,
                                          calls_made=base.calls_made if base else 0), True
            undo = (sequence.messages, sequence.calls_made, 0, None)
            sequence.append(plan.prompt_ids, generated=False)
            self.sequences.append(sequence)
        sequence.images = plan.images
        sequence.append(list(generation.token_ids), generated=True, logprobs=list(generation.logprobs),
                        versions=list(versions))
        self.truncated |= generation.finish_reason == "length"
        if kept is not None:
            kept.append(Kept(sequence, new, undo[2], len(sequence.token_ids), undo[0], undo[1], plan.reused,
                             len(plan.prompt_ids) - plan.reused, truncated, undo[3]))
        return sequence

    def drop(self, kept: list[Kept]) -> None:
        """Undo what keeping these generations changed (latest first): a reply that was never delivered (its
        client disconnected, or the request failed after generating) is not trained. A sequence another
        request has gone on with since is left as it is."""
        for entry in reversed(kept):
            self.requests -= 1
            self.reused_tokens -= entry.reused
            self.rendered_tokens -= entry.rendered
            self.truncated = entry.truncated
            sequence = entry.sequence
            if len(sequence.token_ids) != entry.end:
                continue
            if entry.new:
                self.sequences = [s for s in self.sequences if s is not sequence]
                continue
            for values in (sequence.token_ids, sequence.action_mask, sequence.logprobs, sequence.versions):
                del values[entry.start:]
            sequence.messages, sequence.calls_made, sequence.images = entry.messages, entry.calls_made, entry.images
        kept.clear()

    def record(self, plan: Plan, generation: Generation, versions: list[int], stop_ids: set[int],
               kept: list[Kept] | None = None) -> tuple[dict, str]:
        """Keep a finished generation of `plan` (`versions`: the policy version of each token); the assistant
        message it becomes (tool calls parsed when the request had tools) and its finish reason. What keeping
        it changed is appended to `kept` (for `drop`)."""
        sequence = self._keep(plan, generation, versions, kept)
        tokens = list(generation.token_ids)
        # A stop token id, or another special token the engine stops on (a generation config's eos), as
        # `rl2.rollout.multi_turn` reads a turn: the template writes the end-of-turn token itself.
        ends_with_stop = (generation.finish_reason == "stop" and bool(tokens)
                          and (tokens[-1] in stop_ids or tokens[-1] in self.tokenizer.all_special_ids))
        text = self.tokenizer.decode(tokens[:-1] if ends_with_stop else tokens, skip_special_tokens=False,
                                     clean_up_tokenization_spaces=False)
        message: dict[str, Any] = {"role": "assistant", "content": text}
        finish = "length" if generation.finish_reason == "length" else "stop"
        if plan.tools:
            parsed = self.parser.parse(text, plan.tools)
            calls = [call for call in parsed.calls if call.error is None]
            if calls:  # a call that did not parse stays in the text, as the model wrote it
                unparsed = [call.raw for call in parsed.calls if call.error is not None]
                message["content"] = "\n".join([parsed.content, *unparsed]).strip() if unparsed else parsed.content
                message["tool_calls"] = []
                for call in calls:
                    message["tool_calls"].append({"id": self.parser.call_id(sequence.calls_made), "type": "function",
                                                  "function": {"name": call.name, "arguments": call.arguments}})
                    sequence.calls_made += 1
                finish = "tool_calls"
        sequence.messages = copy.deepcopy(plan.messages) + [copy.deepcopy(message)]
        return message, finish
