"""A vision-language policy's images in a rollout: each prompt's row turned into its prompt ids (image-pad tokens
expanded) and `ImageInputs`, and the images a tool's messages return turned into theirs.

Images are decoded and processed on this object's data threads (a prompt's once, for all of its group's
trajectories) or on the tool's thread that answered, never on the training loop's.
"""

from concurrent.futures import ThreadPoolExecutor

from rl2.config import DataConfig
from rl2.data.image_rows import IMAGE_ROW
from rl2.data.image_rows import ImageInputs as ImageProcessing
from rl2.errors import DataError
from rl2.vision.detect import is_vision_model
from rl2.vision.image_inputs import ImageInputs
from rl2.vision.images import load_image
from rl2.vision.inputs import build_vision_sample, image_pad_id, text_messages


class RolloutImages:
    """The image processor of the policy (`rl2.data.image_rows.ImageInputs`) and its tokenizer, for a rollout."""

    def __init__(self, processing: ImageProcessing, tokenizer, threads: int = 2):
        self.processing, self.tokenizer = processing, tokenizer
        self.pad = image_pad_id(tokenizer)
        self.executor = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="rl2-images")

    @classmethod
    def for_model(cls, model_name: str, data: DataConfig, tokenizer) -> "RolloutImages | None":
        """For a vision-language `model_name` (`data.min_pixels` / `data.max_pixels` bound its images); None
        for a text-only model."""
        if not is_vision_model(model_name):  # also when its config cannot be read: the engine says why
            return None
        return cls(ImageProcessing.for_model(model_name, data), tokenizer)

    def prepare(self, prompts: list[dict]) -> list[dict]:
        """`prompts` with each one that carries an unprocessed row (`IMAGE_ROW`) given its prompt ids (pads
        expanded) and `images`, built on the data threads; the others as they are."""
        futures = [self.executor.submit(self._prompt, prompt) if IMAGE_ROW in prompt else None for prompt in prompts]
        return [future.result() if future is not None else prompt for prompt, future in zip(prompts, futures)]

    def _prompt(self, prompt: dict) -> dict:
        spec = prompt[IMAGE_ROW]
        processing = self.processing
        sample = build_vision_sample(spec["row"], spec["index"], self.tokenizer, processing.image_processor,
                                     None, spec["messages_key"], spec["image_key"], add_generation_prompt=True,
                                     min_pixels=processing.min_pixels, max_pixels=processing.max_pixels,
                                     where=spec["where"], tools=prompt.get("tools"))
        prepared = {key: value for key, value in prompt.items() if key != IMAGE_ROW}
        prepared["prompt_ids"] = sample["input_ids"].tolist()
        prepared["images"] = ImageInputs.of_sample(sample)
        return prepared

    def tool_messages(self, messages: list[dict], where: str) -> tuple[list[dict], ImageInputs | None, list[int]]:
        """A tool's (or `interact`'s) `messages` with string content only, each image (an image part holding a
        PIL image, path, bytes or data URI) written as the vision tokens' text; their `ImageInputs` and each
        image's pad-token count. Errors name `where` (the trajectory) and the message's field."""
        text, refs = text_messages(messages, [], where, image_key="(none: a tool's images are its message's parts)",
                                   messages_key="the tool's messages")
        if not refs:
            return text, None, []
        pil = [load_image(ref.value, f"{where}, {ref.field}") for ref in refs]
        processor = self.processing.image_processor
        size = dict(processor.size)
        if self.processing.min_pixels is not None:
            size["shortest_edge"] = self.processing.min_pixels
        if self.processing.max_pixels is not None:
            size["longest_edge"] = self.processing.max_pixels
        processed = processor(images=pil, return_tensors="pt", size=size)
        counts = (processed["image_grid_thw"].prod(-1) // processor.merge_size**2).tolist()
        return text, ImageInputs(processed["pixel_values"], processed["image_grid_thw"]), counts

    def counts(self, images: ImageInputs) -> list[int]:
        """Each of `images`' pad-token count."""
        return (images.image_grid_thw.prod(-1) // self.processing.image_processor.merge_size**2).tolist()

    def expand(self, tokens: list[int], counts: list[int], where: str) -> list[int]:
        """`tokens` with the k-th image-pad token repeated `counts[k]` times."""
        if tokens.count(self.pad) != len(counts):
            raise DataError(f"{where}: the chat template wrote {tokens.count(self.pad)} image-pad token(s) for the "
                            f"tool's {len(counts)} image(s)")
        out: list[int] = []
        images = iter(counts)
        for token in tokens:
            out += [token] * next(images) if token == self.pad else [token]
        return out

    def close(self) -> None:
        self.executor.shutdown(wait=False, cancel_futures=True)


def has_image_parts(messages: list[dict]) -> bool:
    """Whether any message's content is a list of parts (text and images) rather than a string."""
    return any(isinstance(message.get("content"), list) for message in messages)

