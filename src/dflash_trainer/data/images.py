"""Image parts of conversations: where each image is, and reading it.

A user turn's content may be a list of OpenAI-style parts: `{"type": "text", "text": ...}` and
`{"type": "image_url", "image_url": {"url": ...}}`, where the url is a local file (absolute, or relative to the data
file's folder) or a `data:image/png;base64,...` / `data:image/jpeg;base64,...` URL. A row is read only when each of
its images decodes (Pillow), once, when the row is read: a missing, unreadable or undecodable image drops the row as
`unreadable_image`, counted and warned about with the first cause (never trained on without its image).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import io
import re
from pathlib import Path
from typing import Optional

from PIL import Image, UnidentifiedImageError

_DATA_URL = re.compile(r"data:image/(png|jpe?g);base64,(.*)", re.S | re.I)


class UnreadableImage(Exception):
    """An image part that cannot be read; the message names it and why."""


def _image_bytes(url: str) -> bytes:
    if url.startswith("data:"):
        match = _DATA_URL.fullmatch(url)
        if match is None:
            raise UnreadableImage(f"{url[:40]!r}...: a data URL that is not base64 PNG or JPEG")
        try:
            return base64.b64decode(match.group(2), validate=True)
        except (binascii.Error, ValueError) as e:
            raise UnreadableImage(f"{url[:40]!r}...: bad base64 ({e})") from None
    try:
        return Path(url).read_bytes()
    except OSError as e:
        raise UnreadableImage(f"{url}: {e.strerror or e}") from None


def decode_image(url: str, sha256: str = "") -> Image.Image:
    """The image at `url` (a path or data URL, as `resolve_image` returns), in RGB; `UnreadableImage` otherwise, and
    when `sha256` is given and the bytes read no longer have it (the file changed since it was first read)."""
    data = _image_bytes(url)
    if sha256 and hashlib.sha256(data).hexdigest() != sha256:
        raise UnreadableImage(f"{url[:80]}: changed since the data was read (its SHA-256 is no longer "
                              f"{sha256[:12]}...)")
    try:
        image = Image.open(io.BytesIO(data))
        image.load()  # decode every pixel now: a truncated file fails here, not in the middle of training
    except (UnidentifiedImageError, OSError, ValueError, Image.DecompressionBombError) as e:
        raise UnreadableImage(f"{url[:80]}: not a readable image ({e})") from None
    return image.convert("RGB")


def image_data_url(url: str) -> str:
    """The image at `url` (a path or data URL, as `resolve_image` returns) as a data URL, for a server that cannot
    read this machine's files: a data URL as it is, a file's bytes base64-encoded under the MIME type of the format
    Pillow finds in them (what the file holds, whatever its name says). `UnreadableImage` when it cannot be read."""
    if url.startswith("data:"):
        return url
    data = _image_bytes(url)
    try:
        with Image.open(io.BytesIO(data)) as image:
            mime = Image.MIME.get(image.format or "")
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise UnreadableImage(f"{url[:80]}: not a readable image ({e})") from None
    if mime is None:
        raise UnreadableImage(f"{url[:80]}: Pillow knows no MIME type for its format {image.format!r}")
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def resolve_image(url: object, base_dir: Optional[Path]) -> tuple[str, str]:
    """`(url, sha256)` of an image part's url: a local path made absolute against `base_dir` (the data file's folder)
    with the digest of its bytes, or a data URL as it is (digest ""); decoded once to check it. `UnreadableImage`
    when it cannot be read."""
    if not isinstance(url, str) or not url:
        raise UnreadableImage(f"image_url.url is {type(url).__name__}, not a path or data URL")
    if url.startswith("file://"):
        url = url[len("file://"):]
    if not url.startswith("data:"):
        if "://" in url:
            raise UnreadableImage(f"{url[:80]}: remote images are not fetched; download them and give local paths")
        path = Path(url).expanduser()
        url = str(path if path.is_absolute() or base_dir is None else (base_dir / path).resolve())
    decode_image(url)
    return url, "" if url.startswith("data:") else hashlib.sha256(Path(url).read_bytes()).hexdigest()


def changed_image_files(images: list[tuple[str, str]]) -> Optional[str]:
    """The first of `(path, sha256)` whose file no longer has that digest (or is gone), or None."""
    for path, digest in images:
        try:
            if hashlib.sha256(Path(path).read_bytes()).hexdigest() != digest:
                return path
        except OSError:
            return path
    return None
