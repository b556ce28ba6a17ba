"""Token-exact turns: the tokens that follow a generated assistant turn, found by *bridging*.

The trajectory keeps the tokens the model sampled; what comes after them (the end of the assistant turn
the model did not generate, the tool results or other new messages, the next assistant header) is the
text the chat template writes after that turn's end-of-turn token in a stub conversation ending in it:

    render(stub + [assistant] + new_messages, generation prompt), from the assistant turn's end on

So the whole conversation is never re-rendered, and a template that renders earlier turns differently
once more messages follow (Qwen3 drops an empty or earlier reasoning block; Mistral's templates move the
tool list before the last user message; templates re-render `tool_calls` from structure) never changes a
token already in the trajectory: the model is trained on exactly what it saw and produced. `rewrites_history`
says whether a template does (then the trajectory differs from the template's rendering of its conversation).
"""

from rl2.chat.template import render_chat

STUB_USER = {"role": "user", "content": "(earlier turns)"}


class HistoryRewritten(ValueError):
    """The template writes no end-of-turn token and renders the turn differently once messages follow it."""


def bridge_text(tokenizer, assistant: dict, new_messages: list[dict], tools: list[dict] | None = None,
                generated_end: str | None = None) -> str:
    """The text to append after a generated assistant turn (`assistant`, as its message) so that the
    conversation continues with `new_messages` and the next assistant header. `generated_end` is the
    text of the special token the model ended its turn with (its end-of-turn token), None when the turn
    ended otherwise (a stop string): then the template's end of the turn is part of the bridge."""
    header = render_chat([STUB_USER], tokenizer, True, tools)
    full = render_chat([STUB_USER, assistant, *new_messages], tokenizer, True, tools)
    start = len(header) if full.startswith(header) else 0
    if generated_end and generated_end in full[start:]:  # the model's end-of-turn token, which the template writes
        return full[full.find(generated_end, start) + len(generated_end):]
    base = render_chat([STUB_USER, assistant], tokenizer, False, tools)
    start = start if base.startswith(header) else 0
    end = _turn_end_token(tokenizer, base[start:], generated_end)
    if end is None:  # no end-of-turn token to find the turn's end by: the turn must render the same
        if not full.startswith(base):
            raise HistoryRewritten(
                "the chat template writes no end-of-turn token and renders an assistant turn differently once "
                "more messages follow it, so where the tokens after the turn begin cannot be found")
        return full[len(base):]
    position = full.find(end, start)
    return full[position + len(end):] if generated_end else full[position:]


def rewrites_history(tokenizer, assistant: dict, new_messages: list[dict], tools: list[dict] | None = None) -> bool:
    """Whether the template renders `assistant` differently once `new_messages` follow it (then a
    trajectory's tokens differ from the template's rendering of its conversation)."""
    base = render_chat([STUB_USER, assistant], tokenizer, False, tools)
    return not render_chat([STUB_USER, assistant, *new_messages], tokenizer, True, tools).startswith(base)


def _turn_end_token(tokenizer, turn: str, generated_end: str | None) -> str | None:
    """The template's end-of-turn token in the rendered `turn`: the one the model generated where the template
    writes it too, else the last special token the template writes (Llama's <|eot_id|> where the model
    ended with <|eom_id|>)."""
    if generated_end and generated_end in turn:
        return generated_end
    return _last_special_token(tokenizer, turn)[1]


def _last_special_token(tokenizer, text: str) -> tuple[int, str | None]:
    """Where the last special token in `text` starts, and which (the longest at that place)."""
    best, found = -1, None
    for token in tokenizer.all_special_tokens:
        position = text.rfind(token)
        if position > best or (position == best and found is not None and len(token) > len(found)):
            best, found = position, token
    return best, found if best >= 0 else None


def observation_tokens(
    tokenizer, token_ids: list[int], messages: list[dict], new_messages: list[dict], apply_chat_template: bool = True,
    tools: list[dict] | None = None,
) -> list[int]:
    """Token ids to append after `token_ids` (the trajectory so far, ending with the assistant turn that is
    `messages[-1]`) so that it continues with `new_messages` and the next generation prompt.

    Through the chat template (rendered with `tools`), it is the bridge of `rl2.chat.bridge`: the end of the
    assistant turn the model did not generate (e.g. the newline after `<|im_end|>`, or the whole end-of-turn
    marker when a stop string ended the turn), the new messages and the next assistant header. With
    `apply_chat_template=False` (raw prompts) it is the new messages' contents, concatenated as they are
    (no roles, no separators: the env's text is what the model reads), tokenized without special tokens.
    """
    if not apply_chat_template:
        text = "".join(message["content"] for message in new_messages)
        return list(tokenizer(text, add_special_tokens=False)["input_ids"])
    last = token_ids[-1] if token_ids else None
    generated_end = (tokenizer.decode([last], skip_special_tokens=False)
                     if last is not None and last in tokenizer.all_special_ids else None)
    text = bridge_text(tokenizer, messages[-1], new_messages, tools, generated_end)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])
