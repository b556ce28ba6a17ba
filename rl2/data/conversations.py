"""Torch datasets of conversation rows for RL (prompts), SFT (conversations) and preference pairs."""

import logging
from typing import Any

import datasets
import torch

from rl2.chat.template import _tokenize_conversation, render_chat, tokenize_conversation
from rl2.chat.tools import Tool, row_tools, warn_row_tools_render_differently
from rl2.data.image_rows import IMAGE_ROW, ImageInputs, check_image_file, image_row
from rl2.data.rows import Columns, DataError, load_rows, row_messages, row_prompt_text, validate_rows
from rl2.vision.inputs import build_vision_sample_truncated, text_messages

logger = logging.getLogger(__name__)


class _ConversationDataset(torch.utils.data.Dataset):
    """Rows loaded from a path (or given), validated eagerly for `kind`, tokenized lazily; the
    conversation is read from the `columns.messages_key` column, else the `columns.prompt_key` one (a
    string: one user message; `rl2.data.rows.row_messages`). The chat template renders each row with
    the tool schemas of its `tools` column (OpenAI-style schemas, or names of `tools`, the env file's),
    else with all of `tools`, else with none."""

    kind: str
    images: ImageInputs | None = None  # set on the class `reading_images` returns (SFT and pair rows)

    @classmethod
    def reading_images(cls, images: ImageInputs) -> type:
        """This dataset class for rows with images, turned into samples by `images`."""
        return type(cls.__name__, (cls,), {"images": images})

    def __init__(
        self,
        path_or_rows: str | datasets.Dataset,
        tokenizer,
        max_length: int | None,
        source: str | None = None,
        columns: Columns = Columns(),
        tools: dict[str, Tool] | None = None,
    ):
        if isinstance(path_or_rows, str):
            self.rows = load_rows(path_or_rows)
            self.source = source or path_or_rows
        else:
            self.rows = path_or_rows
            self.source = source or "<rows>"
        self.columns = columns
        self.tools = tools or {}
        validate_rows(self.rows, self.kind, self.source, columns)
        # Each row's tool schemas, read once (a malformed cell fails here, naming its row); None: no column.
        self.row_tools = ([self._read_tools(i) for i in range(len(self.rows))]
                          if "tools" in self.rows.column_names else None)
        self.tokenizer = tokenizer
        self.max_length = max_length
        if self.row_tools is not None and self.tools:
            warn_row_tools_render_differently(self.row_tools, self.tools, tokenizer, self.source)
        # Counted in the process that calls __getitem__ (a DataLoader worker's count stays there).
        self.num_truncated = 0

    def __len__(self) -> int:
        return len(self.rows)

    def _messages(self, i: int) -> list[dict]:
        return row_messages(self.rows[i], self.columns, f"{self.source}, row {i + 1}")

    def _tools(self, i: int) -> list[dict] | None:
        """The tool schemas row `i` is rendered with (None: no tools)."""
        return self.row_tools[i] if self.row_tools is not None else self._read_tools(i)

    def _read_tools(self, i: int) -> list[dict] | None:
        value = self.rows[i]["tools"] if "tools" in self.rows.column_names else None
        if value is None:
            return [tool.schema for tool in self.tools.values()] or None
        try:
            return row_tools(value, self.tools, f"{self.source}, row {i + 1}") or None
        except ValueError as exc:
            raise DataError(str(exc)) from None

    def _vision_sample(self, i: int, messages: list[dict]) -> tuple[dict[str, torch.Tensor], bool]:
        """Row `i` with `messages` as a vision-language sample (`build_vision_sample`, with its mRoPE
        positions), and whether it was cut at max_length."""
        where = f"{self.source}, row {i + 1}"
        if self._tools(i):
            raise DataError(f"{where}: rows with tool schemas are not supported with a vision-language model yet")
        image_key = self.columns.image_key or "images"
        key = self.columns.key_of(self.rows[i]) or self.columns.messages_key  # named in errors
        row = {key: messages, image_key: self.rows[i].get(image_key)}
        sample, truncated = build_vision_sample_truncated(
            row, i, self.tokenizer, self.images.image_processor, self.max_length, key, image_key,
            min_pixels=self.images.min_pixels, max_pixels=self.images.max_pixels, where=where)
        return self.images.positioned(sample), truncated


class SFTDataset(_ConversationDataset):
    """SFT conversations; item: {"input_ids", "loss_mask"} as LongTensors of at most max_length tokens.

    For a vision-language model (`reading_images`) an item is `rl2.vision.inputs.build_vision_sample`'s,
    with its mRoPE positions: images decoded and processed when the item is built (a data thread's work,
    `rl2.trainer.offline`), a bad image or image count a DataError naming the row and field."""

    kind = "sft"

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        if self.images is not None:
            return self._image_sample(i)
        tokens = tokenize_conversation(self._messages(i), self.tokenizer, self.max_length, self._tools(i))
        self.num_truncated += tokens["truncated"]
        return {"input_ids": torch.tensor(tokens["input_ids"]), "loss_mask": torch.tensor(tokens["loss_mask"])}


    def _image_sample(self, i: int) -> dict[str, torch.Tensor]:
        sample, truncated = self._vision_sample(i, self._messages(i))
        self.num_truncated += truncated
        return sample


class PairDataset(_ConversationDataset):
    """Preference pairs; item: {"chosen": {"input_ids", "loss_mask"}, "rejected": {...}} as LongTensors.
    Only the chosen / rejected response (with its end-of-turn token) is in the loss mask. For a vision-language
    model (`reading_images`) each is a `build_vision_sample` sample holding the prompt's images."""

    kind = "pair"

    def __getitem__(self, i: int) -> dict[str, dict[str, torch.Tensor]]:
        row = self.rows[i]
        messages = self._messages(i)
        item, truncated = {}, False
        for field in ("chosen", "rejected"):
            conversation = messages + [{"role": "assistant", "content": row[field]}]
            if self.images is not None:  # the prompt's images in both; the loss on the response only
                sample, cut = self._vision_sample(i, conversation)
                item[field] = {**sample, "loss_mask": last_run(sample["loss_mask"])}
                truncated |= cut
                continue
            tokens = _tokenize_conversation(conversation, self.tokenizer, self.max_length, loss_from=len(messages),
                                            tools=self._tools(i))
            truncated |= tokens["truncated"]
            item[field] = {
                "input_ids": torch.tensor(tokens["input_ids"]),
                "loss_mask": torch.tensor(tokens["loss_mask"]),
            }
        self.num_truncated += truncated
        return item


class RLDataset(_ConversationDataset):
    """RL prompts; item: {"prompt_ids": list[int], "messages": list[dict], "answer": ..., "tools", "row": the
    row's columns}. Prompts
    longer than max_length tokens are dropped at construction and counted in `num_skipped`.

    The prompt is the `columns.messages_key` conversation through the chat template, with the
    generation prompt. With `columns.apply_chat_template=False` (RL2's raw prompts: base models,
    Countdown) it is the `columns.prompt_key` text as is, tokenized with no special tokens added (a
    BOS the model needs must be in the text, as in RL2), and its `messages` are
    `[{"role": "user", "content": <the text>}]`: what the env file's `reward_fn` and `interact`
    see, followed by the assistant's messages (and the tools') of the rollout. With
    `columns.prompt_optional` (an env file whose `generate` makes the prompt, RL2 HEAD) a row without a
    prompt has no prompt ids and no messages: the file reads its columns (`row`).

    For a vision-language model (`columns.image_key` set) a row's messages may hold images (image parts,
    `<image>` placeholders filled from its `image_key` column): each image's count and file are checked here
    (errors name the row and field), its `messages` hold each image as the vision tokens' text, and its item
    carries the row (`IMAGE_ROW`) for the rank that rolls it out to decode and process the images once and
    expand the image-pad tokens (`rl2.rollout.images`); `prompt_ids` hold one pad per image until then, and
    the `max_length` check counts them so.
    """

    kind = "rl"

    def __init__(
        self,
        path_or_rows: str | datasets.Dataset,
        tokenizer,
        max_length: int | None,
        source: str | None = None,
        columns: Columns = Columns(),
        tools: dict[str, Tool] | None = None,
    ):
        super().__init__(path_or_rows, tokenizer, max_length, source, columns, tools)
        if columns.image_key is not None and columns.apply_chat_template:
            for i in range(len(self.rows)):
                self._check_image_files(i)
        texts = [self._rendered_prompt(i) for i in range(len(self.rows))]
        prompt_ids = tokenizer(texts, add_special_tokens=False)["input_ids"] if texts else []
        self.indices = [i for i, ids in enumerate(prompt_ids) if max_length is None or len(ids) <= max_length]
        self.prompt_ids = [list(prompt_ids[i]) for i in self.indices]
        self.num_skipped = len(self.rows) - len(self.indices)
        if self.num_skipped:
            first = next(i for i, ids in enumerate(prompt_ids) if len(ids) > max_length)
            logger.warning(
                "%s: dropped %d of %d prompts longer than max_length=%d tokens (first: row %d)",
                self.source, self.num_skipped, len(self.rows), max_length, first + 1,
            )
        if not self.indices:
            raise DataError(f"{self.source}: every prompt is longer than max_length={max_length} tokens")
        self.has_answers = "answer" in self.rows.column_names
        if not self.has_answers:
            logger.info("%s has no 'answer' column: the env file's functions get answer=None", self.source)

    def __len__(self) -> int:
        return len(self.indices)

    def _prompt_text(self, i: int) -> str | None:
        return row_prompt_text(self.rows[i], self.columns, f"{self.source}, row {i + 1}")

    def _rendered_prompt(self, i: int) -> str:
        """Row `i`'s prompt as the model reads it: its messages through the chat template, or its raw text;
        "" for a row without a prompt (`columns.prompt_optional`)."""
        if not self.columns.apply_chat_template:
            return self._prompt_text(i) or ""
        messages = self._text_messages(i)
        return render_chat(messages, self.tokenizer, True, self._tools(i)) if messages else ""

    def _images(self, i: int) -> list:
        images = self.rows[i].get(self.columns.image_key) or []
        return list(images) if isinstance(images, (list, tuple)) else [images]

    def _image_refs(self, i: int) -> tuple[list[dict], list]:
        """Row `i`'s messages with each image as the vision tokens' text, and its images in order (none read)."""
        key = self.columns.key_of(self.rows[i]) or self.columns.messages_key
        return text_messages(self._messages(i), self._images(i), f"{self.source}, row {i + 1}",
                             self.columns.image_key, key)

    def _text_messages(self, i: int) -> list[dict]:
        """Row `i`'s messages as the chat template reads them: an image as the vision tokens' text."""
        if self.columns.image_key is None:
            return self._messages(i)
        return self._image_refs(i)[0] if self._messages(i) else []

    def _check_image_files(self, i: int) -> None:
        """A DataError naming row `i` and the field of an image given as a path that is not a file."""
        if not self._messages(i):
            return
        for ref in self._image_refs(i)[1]:
            check_image_file(ref.value, f"{self.source}, row {i + 1}, {ref.field}")

    def _source(self, i: int) -> str | None:
        """Row `i`'s `data_source` (verl's column: the task or dataset it comes from), as text; None without one."""
        value = self.rows[i]["data_source"] if "data_source" in self.rows.column_names else None
        return None if value is None else str(value)

    def _prompt_messages(self, i: int) -> list[dict]:
        if self.columns.apply_chat_template:
            return self._text_messages(i)
        text = self._prompt_text(i)
        return [] if text is None else [{"role": "user", "content": text}]

    def __getitem__(self, i: int) -> dict[str, Any]:
        row_index = self.indices[i]
        item = self._item(i, row_index)
        if self.columns.image_key is not None and self.columns.apply_chat_template and self._image_refs(row_index)[1]:
            key = self.columns.key_of(self.rows[row_index]) or self.columns.messages_key
            row = {key: self._messages(row_index), self.columns.image_key: self._images(row_index)}
            item[IMAGE_ROW] = image_row(row, row_index, key, self.columns.image_key,
                                        f"{self.source}, row {row_index + 1}")
        return item

    def _item(self, i: int, row_index: int) -> dict[str, Any]:
        return {
            "prompt_ids": self.prompt_ids[i],
            "messages": self._prompt_messages(row_index),
            "answer": self.rows[row_index]["answer"] if self.has_answers else None,
            "tools": self._tools(row_index) if self.columns.apply_chat_template else None,
            "source": self._source(row_index),  # the `data_source` column: per-source test metrics
            "row": dict(self.rows[row_index]),  # every column, as RL2 HEAD's env files read it (`sample.sample`)
        }


def last_run(mask: torch.Tensor) -> torch.Tensor:
    """`mask` with only its last run of ones kept: a conversation's loss mask reduced to its last assistant
    message (the chosen or rejected response, with its end-of-turn token)."""
    ones = mask.nonzero().flatten()
    kept = torch.zeros_like(mask)
    if len(ones):
        end = int(ones[-1]) + 1
        start = end
        while start > 0 and mask[start - 1]:
            start -= 1
        kept[start:end] = mask[start:end]
    return kept
