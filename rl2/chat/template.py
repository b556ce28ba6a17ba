"""Conversations through the tokenizer's chat template: rendered text, and token ids with the loss
mask of the assistant turns.

A loss mask comes from the template: the conversation is rendered once, tokenized once, and each token
whose first character lies in an assistant message's content or end-of-turn token is in the loss.
"""

from rl2.errors import DataError


def tokenize_conversation(messages: list[dict], tokenizer, max_length: int | None,
                          tools: list[dict] | None = None) -> dict:
    """Tokenize a conversation (with the tool schemas `tools`, where given) with the tokenizer's chat
    template. Returns `input_ids`, `loss_mask` (1 on every assistant message's content, its tool calls as
    the template writes them and its end-of-turn token, 0 elsewhere) and `truncated` (whether it was cut to
    `max_length` tokens, keeping the start). Needs a fast tokenizer."""
    return _tokenize_conversation(messages, tokenizer, max_length, loss_from=0, tools=tools)


def _tokenize_conversation(messages: list[dict], tokenizer, max_length: int | None, loss_from: int,
                           tools: list[dict] | None = None) -> dict:
    """As tokenize_conversation, with only assistant messages at index >= `loss_from` in the loss."""
    text = render_chat(messages, tokenizer, add_generation_prompt=False, tools=tools)
    spans = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant" or i < loss_from:
            continue
        start = len(_render_prefix(messages[:i], tokenizer, text, add_generation_prompt=True, tools=tools))
        end = len(_render_prefix(messages[: i + 1], tokenizer, text, add_generation_prompt=False, tools=tools))
        # The turn's rendering may end with separators after the end-of-turn token ("<|im_end|>\n");
        # the model should learn to stop, not to emit the separator.
        eos = text.rfind(tokenizer.eos_token, start, end) if tokenizer.eos_token else -1
        if eos != -1:
            end = eos + len(tokenizer.eos_token)
        spans.append((start, end))

    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids = list(encoding["input_ids"])
    loss_mask = [int(any(start <= char < end for start, end in spans)) for char, _ in encoding["offset_mapping"]]
    truncated = max_length is not None and len(input_ids) > max_length
    if truncated:
        input_ids, loss_mask = input_ids[:max_length], loss_mask[:max_length]
    return {"input_ids": input_ids, "loss_mask": loss_mask, "truncated": truncated}


def render_chat(messages: list[dict], tokenizer, add_generation_prompt: bool, tools: list[dict] | None = None) -> str:
    """`messages` (and the tool schemas `tools`, where given) as text through the tokenizer's chat template."""
    # tokenize=False: in transformers 5 tokenize=True returns a BatchEncoding, and tokenizing the
    # rendered text ourselves keeps input_ids identical to a plain tokenization of the text.
    return tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                         add_generation_prompt=add_generation_prompt)


# A conversation and a tool to find out whether a chat template writes tool schemas into the prompt.
_PROBE_MESSAGES = ({"role": "user", "content": "hi"},)
_PROBE_TOOL = {"type": "function", "function": {"name": "rl2_probe", "description": "A probe.",
                                                "parameters": {"type": "object", "properties": {}}}}


def template_renders_tools(tokenizer) -> bool:
    """Whether the tokenizer's chat template writes the tool schemas it is given into the prompt (a template
    without tool support renders a conversation the same with and without them); True where rendering with
    tools fails (that error is the one to show)."""
    messages = [dict(message) for message in _PROBE_MESSAGES]
    try:
        with_tools = render_chat(messages, tokenizer, add_generation_prompt=True, tools=[_PROBE_TOOL])
    except Exception:  # noqa: BLE001 - a template that rejects tools says why when the real request renders
        return True
    return with_tools != render_chat(messages, tokenizer, add_generation_prompt=True)


def tools_not_rendered(tokenizer) -> str:
    """Why tool schemas given to a template that does not render them are refused, and the fix."""
    return (f"the chat template of {tokenizer.name_or_path or 'the tokenizer'} does not render tools: the model "
            "would never see the `tools` given (the prompt is the same without them). Use a model or "
            "actor.tokenizer_name whose chat template renders tools (a tiny model: python -m rl2.testing.tiny DIR "
            "--template qwen2.5), or describe the tools in the messages and send no `tools`")


def _render_prefix(messages: list[dict], tokenizer, full_text: str, add_generation_prompt: bool,
                   tools: list[dict] | None = None) -> str:
    """Render the first messages of a conversation, checking that this is a prefix of `full_text`."""
    prefix = render_chat(messages, tokenizer, add_generation_prompt=add_generation_prompt, tools=tools)
    if not full_text.startswith(prefix):
        raise DataError(
            f"the chat template is not prefix-consistent: rendering the first {len(messages)} messages "
            f"(add_generation_prompt={add_generation_prompt}) does not give a prefix of the whole conversation, "
            "so assistant turns cannot be located for the loss mask; use a chat template that renders earlier "
            "turns the same way whatever follows (e.g. one that does not strip earlier reasoning)"
        )
    return prefix
