"""Images in a chat completion request for a vision-language model: `image_url` content parts (base64 data URIs;
a URL is not fetched) become the vision tokens' text in the message, as rl2's own rendering writes them
(`rl2.vision.inputs`), with the images processed as rl2 processes them; the prompt's image-pad tokens are then
expanded, one per merged patch, so a request's prompt ids are those of rl2's rendering of the same messages."""

import hashlib
from collections.abc import Mapping
from dataclasses import dataclass, field

from rl2.errors import DataError
from rl2.vision.image_inputs import ImageInputs
from rl2.vision.images import load_image
from rl2.vision.processing import ImageProcessing

# A message's images, by digest of their data URI, in the order its content holds them (kept in the session's
# messages: two requests continue one conversation only where its images are the same).
IMAGE_DIGESTS = "image_digests"


@dataclass
class ChatImages:
    """The images of one request's messages (by digest), and how their pad tokens are expanded."""

    processing: ImageProcessing
    pad_id: int
    by_digest: dict[str, ImageInputs] = field(default_factory=dict)

    def part(self, part: Mapping, where: str) -> str:
        """An `image_url` part's image processed and kept; its digest. ValueError naming `where` for a part
        without a data URI (URLs are not fetched) or an image that does not decode."""
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, Mapping) else url
        if not isinstance(url, str) or not url:
            raise ValueError(f"{where}: an image_url part needs a url (a base64 data URI)")
        if not url.startswith("data:"):
            raise ValueError(f"{where}: image URLs are not fetched ({url[:80]}); send the image as a base64 data URI "
                             f"(data:image/png;base64,...)")
        digest = hashlib.sha256(url.encode()).hexdigest()[:32]
        if digest not in self.by_digest:
            try:
                image = load_image(url, where)
            except DataError as error:
                raise ValueError(str(error)) from None
            self.by_digest[digest] = self.processing([image])
        return digest

    def expand(self, ids: list[int], messages: list[dict]) -> tuple[list[int], ImageInputs | None]:
        """`ids` (rendered from `messages`, one pad token per image) with each image's pad expanded, and the
        images in order; ValueError when the pads do not match the messages' images."""
        images = [self.by_digest[digest] for message in messages for digest in message.get(IMAGE_DIGESTS, ())]
        pads = [i for i, token in enumerate(ids) if token == self.pad_id]
        if len(pads) != len(images):
            raise ValueError(f"the prompt has {len(pads)} image pad token(s) for {len(images)} image(s): image tokens "
                             f"in the text are not accepted, and the chat template must keep every message's text")
        expanded = []
        counts = [self.processing.pad_counts(image)[0] for image in images]
        for token in ids:
            expanded += [token] * counts.pop(0) if token == self.pad_id else [token]
        return expanded, ImageInputs.concat(images)

