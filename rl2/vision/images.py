"""A row's images decoded to RGB PIL images: from a path, `file://` URI, base64 data URI, bytes, a
`{"bytes", "path"}` dict (a `datasets` Image cell) or a PIL image. Errors name the row and field."""

import base64
import io
import os
from typing import Any

from PIL import Image

from rl2.errors import DataError


def load_image(value: Any, where: str) -> Image.Image:
    """`value` as an RGB PIL image; `where` names it in errors (e.g. "row 3, 'images'[1]")."""
    if isinstance(value, Image.Image):
        return value.convert("RGB")
    if isinstance(value, dict):
        if value.get("bytes") is not None:
            return load_image(value["bytes"], where)
        if value.get("path") is not None:
            return load_image(value["path"], where)
        if value.get("url") is not None:
            return load_image(value["url"], where)
        raise DataError(f"{where}: an image dict needs 'bytes', 'path' or 'url', got keys {sorted(value)}")
    if isinstance(value, (bytes, bytearray)):
        return _decode(bytes(value), where)
    if isinstance(value, str):
        if value.startswith("data:"):
            header, _, payload = value.partition(",")
            if ";base64" not in header:
                raise DataError(f"{where}: a data URI image must be base64 ({header!r})")
            try:
                data = base64.b64decode(payload, validate=True)
            except ValueError as error:
                raise DataError(f"{where}: the data URI is not valid base64 ({error})") from error
            return _decode(data, where)
        if value.startswith(("http://", "https://")):
            raise DataError(f"{where}: image URLs are not fetched ({value}); give a path, bytes or a data URI")
        path = value.removeprefix("file://")
        if not os.path.isfile(path):
            raise DataError(f"{where}: image file not found: {path}")
        with open(path, "rb") as f:
            return _decode(f.read(), where)
    raise DataError(f"{where}: expected an image path, bytes, data URI or PIL image, got {type(value).__name__}")


def _decode(data: bytes, where: str) -> Image.Image:
    try:
        image = Image.open(io.BytesIO(data))
        image.load()
    except Exception as error:  # PIL raises several types for undecodable data
        raise DataError(f"{where}: not a readable image ({type(error).__name__}: {error})") from error
    return image.convert("RGB")
