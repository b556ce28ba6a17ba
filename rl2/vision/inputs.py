"""A row with images → one sample's model inputs: token ids with each image's pad token repeated once per
merged patch, the loss mask, `mm_token_type_ids` (1 on image tokens), and the image processor's
`pixel_values` / `image_grid_thw`.

Images come from the messages' image content parts (`{"type": "image", "image": ...}`,
`{"type": "image_url", "image_url": {"url": ...}}`) and from the row's images column, whose entries fill,
in order, the `<image>` placeholders in text and the image parts that carry no image of their own. Each image
is rendered as `<|vision_start|><|image_pad|><|vision_end|>` in the message text before the chat template,
so any template that takes string content works; rl2 expands the pads itself (no AutoProcessor).
"""

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from rl2.chat.template import render_chat, tokenize_conversation
from rl2.errors import DataError
from rl2.vision.images import load_image

IMAGE_PLACEHOLDER = "<image>"
VISION_START, IMAGE_PAD, VISION_END = "<|vision_start|>", "<|image_pad|>", "<|vision_end|>"
IMAGE_TEXT = VISION_START + IMAGE_PAD + VISION_END


@dataclass(frozen=True)
class ImageRef:
    """One image of a row: where it came from (for errors) and its value (path, bytes, PIL, ...)."""

    field: str
    value: Any


def image_pad_id(tokenizer) -> int:
    """The id of the image pad token; a ValueError if the tokenizer has no such single token."""
    ids = tokenizer.encode(IMAGE_PAD, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"the tokenizer has no {IMAGE_PAD} token: is this a vision-language model's tokenizer?")
    return ids[0]


def text_messages(messages: list[dict], images: list, where: str, image_key: str = "images",
                  messages_key: str = "messages") -> tuple[list[dict], list[ImageRef]]:
    """`messages` with every image (content part or `<image>` placeholder) written as the vision tokens'
    text, string content only, and the row's images in the order they appear. `images` is the row's images
    column ([] if none); its entries must match exactly the placeholders and the image parts without
    an image of their own."""
    column = list(images)
    used = 0
    refs: list[ImageRef] = []

    def from_column(field: str) -> None:
        nonlocal used
        if used < len(column):
            refs.append(ImageRef(f"{image_key!r}[{used}]", column[used]))
        else:
            refs.append(ImageRef(field, None))  # counted; reported below with the totals
        used += 1

    def expand_text(text: str, field: str) -> str:
        for _ in range(text.count(IMAGE_PLACEHOLDER)):
            from_column(field)
        return text.replace(IMAGE_PLACEHOLDER, IMAGE_TEXT)

    out = []
    for m, message in enumerate(messages):
        content = message.get("content")
        field = f"{messages_key!r}[{m}].content"
        if isinstance(content, str):
            out.append({**message, "content": expand_text(content, field)})
            continue
        if not isinstance(content, list):
            out.append(message)
            continue
        pieces = []
        for p, part in enumerate(content):
            part_field = f"{field}[{p}]"
            kind = part.get("type") if isinstance(part, Mapping) else None
            if kind == "text":
                pieces.append(expand_text(str(part.get("text", "")), part_field))
            elif kind == "image":
                if part.get("image") is not None:
                    refs.append(ImageRef(part_field, part["image"]))
                else:
                    from_column(part_field)
                pieces.append(IMAGE_TEXT)
            elif kind == "image_url":
                url = part.get("image_url")
                url = url.get("url") if isinstance(url, Mapping) else url
                if not url:
                    raise DataError(f"{where}: {part_field} is an image_url part without a url")
                refs.append(ImageRef(part_field, url))
                pieces.append(IMAGE_TEXT)
            else:
                raise DataError(f"{where}: {part_field} has type {kind!r}; expected 'text', 'image' or 'image_url'")
        out.append({**message, "content": "".join(pieces)})
    if used != len(column):
        raise DataError(f"{where}: {image_key!r} has {len(column)} image(s) but the messages have {used} "
                        f"{IMAGE_PLACEHOLDER} placeholder(s) or image part(s) without an image of their own")
    return out, refs


def build_vision_sample(
    row: Mapping[str, Any],
    row_index: int,
    tokenizer,
    image_processor,
    max_length: int | None = None,
    messages_key: str = "messages",
    image_key: str = "images",
    add_generation_prompt: bool = False,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    where: str | None = None,
    tools: list[dict] | None = None,
) -> dict[str, torch.Tensor]:
    """One row's model inputs: `input_ids`, `loss_mask` and `mm_token_type_ids` ([L] each), plus
    `pixel_values` [patches, dim] and `image_grid_thw` [images, 3] where the row has images.

    With `add_generation_prompt` the messages are a prompt (loss mask all 0); otherwise the loss covers the
    assistant turns (never an image token). A sample longer than `max_length` is cut at it unless that
    would cut an image: then a DataError names the row, the image's field and its token count. Errors
    name the row as `where` (default "row <row_index>"). `tools`: the tool schemas the chat template renders."""
    return build_vision_sample_truncated(row, row_index, tokenizer, image_processor, max_length, messages_key,
                                         image_key, add_generation_prompt, min_pixels, max_pixels, where, tools)[0]


def build_vision_sample_truncated(
    row: Mapping[str, Any],
    row_index: int,
    tokenizer,
    image_processor,
    max_length: int | None = None,
    messages_key: str = "messages",
    image_key: str = "images",
    add_generation_prompt: bool = False,
    min_pixels: int | None = None,
    max_pixels: int | None = None,
    where: str | None = None,
    tools: list[dict] | None = None,
) -> tuple[dict[str, torch.Tensor], bool]:
    """`build_vision_sample`'s sample, and whether it was cut at `max_length`."""
    where = where or f"row {row_index}"
    messages = row.get(messages_key)
    if not isinstance(messages, list) or not messages:
        raise DataError(f"{where}: {messages_key!r} must be a non-empty list of messages")
    images = row.get(image_key) or []
    if not isinstance(images, (list, tuple)):
        images = [images]
    messages, refs = text_messages(messages, images, where, image_key, messages_key)
    if add_generation_prompt:
        text = render_chat(messages, tokenizer, add_generation_prompt=True, tools=tools)
        ids = tokenizer(text, add_special_tokens=False)
        ids, mask = list(ids["input_ids"]), [0] * len(ids["input_ids"])
    else:
        tokens = tokenize_conversation(messages, tokenizer, None, tools)
        ids, mask = tokens["input_ids"], tokens["loss_mask"]

    pad = image_pad_id(tokenizer)
    if ids.count(pad) != len(refs):
        raise DataError(f"{where}: the chat template wrote {ids.count(pad)} {IMAGE_PAD} token(s) for {len(refs)} "
                        f"image(s) (it must keep every message's text)")
    sample: dict[str, torch.Tensor] = {}
    counts: list[int] = []
    if refs:
        pil = [load_image(ref.value, f"{where}, {ref.field}") for ref in refs]
        size = dict(image_processor.size)  # shortest_edge / longest_edge: the min / max pixels of an image
        if min_pixels is not None:
            size["shortest_edge"] = min_pixels
        if max_pixels is not None:
            size["longest_edge"] = max_pixels
        processed = image_processor(images=pil, return_tensors="pt", size=size)
        merge = image_processor.merge_size
        sample["pixel_values"] = processed["pixel_values"]
        sample["image_grid_thw"] = processed["image_grid_thw"]
        counts = (processed["image_grid_thw"].prod(-1) // merge**2).tolist()

    expanded_ids, expanded_mask, types, image_ends = [], [], [], []
    images_seen = 0
    for token, in_loss in zip(ids, mask):
        if token != pad:
            expanded_ids.append(token)
            expanded_mask.append(in_loss)
            types.append(0)
            continue
        n = counts[images_seen]
        expanded_ids += [pad] * n
        expanded_mask += [0] * n  # image tokens are inputs, never targets
        types += [1] * n
        image_ends.append(len(expanded_ids))
        images_seen += 1

    truncated = max_length is not None and len(expanded_ids) > max_length
    if truncated:
        for k, end in enumerate(image_ends):
            if end > max_length:
                thw = sample["image_grid_thw"][k].tolist()
                raise DataError(
                    f"{where}: the image at {refs[k].field} ({counts[k]} tokens, grid {thw}) ends at token {end}, "
                    f"past max_length {max_length}; lower max_pixels or raise max_length (an image is never cut)")
        expanded_ids, expanded_mask, types = (x[:max_length] for x in (expanded_ids, expanded_mask, types))
    sample["input_ids"] = torch.tensor(expanded_ids, dtype=torch.long)
    sample["loss_mask"] = torch.tensor(expanded_mask, dtype=torch.long)
    sample["mm_token_type_ids"] = torch.tensor(types, dtype=torch.long)
    return sample, truncated
