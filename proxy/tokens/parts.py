"""What of a chat message's content parts a backend renders as prompt text, and the fixed
estimate of its media parts (images, audio, files): the content rule every counter shares.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any

__all__ = ["MEDIA_TOKENS", "MEDIA_TOKENS_LOW", "media_tokens", "split_content"]

# A fixed estimate per media part (image, audio, file): counting real media tokens needs the
# media. 765 is OpenAI's price of a 1024x1024 image at high detail, 85 at low detail.
MEDIA_TOKENS = 765
MEDIA_TOKENS_LOW = 85

# The field holding the text of each part type a backend renders as text: OpenAI's chat parts
# (text, refusal), the Responses API's (input_text, output_text), and the ones vLLM's chat
# parser also reads as text (thinking, and a tool_reference's name).
_TEXT_FIELDS: Mapping[str, str] = {
    "text": "text",
    "input_text": "text",
    "output_text": "text",
    "refusal": "refusal",
    "thinking": "thinking",
    "tool_reference": "name",
}
# Part types a backend reads as media: OpenAI's chat and Responses parts, and vLLM's.
_MEDIA_TYPES = frozenset(
    {
        "image_url",
        "input_image",
        "input_audio",
        "input_file",
        "file",
        "audio_url",
        "video_url",
        "image_embeds",
        "audio_embeds",
        "image_pil",
        "prompt_embeds",
    }
)
# The keys vLLM reads a media part by when it has no type, or has a `uuid` (then its type is
# not looked at).
_MEDIA_KEYS = (
    "image_url",
    "image_pil",
    "image_embeds",
    "audio_embeds",
    "prompt_embeds",
    "audio_url",
    "input_audio",
    "video_url",
)


def media_tokens(part: Mapping[str, Any]) -> int:
    """The fixed estimate for one media part; OpenAI's `detail: low` images cost less, where
    OpenAI reads the detail: inside an image part's `image_url` (chat's), or beside an
    `input_image`'s URL (the Responses API's). Anywhere else (beside a video, an audio, or
    chat's image_url) no backend reads it, and the part is counted in full."""
    kind = part.get("type")
    if kind == "input_image" and "uuid" not in part:
        detail = part.get("detail")
    elif kind == "image_url" or not isinstance(kind, str) or "uuid" in part:
        # a part vLLM reads by its keys reads `image_url` first: an image
        image = part.get("image_url")
        detail = image.get("detail") if isinstance(image, Mapping) else None
    else:
        detail = None
    return MEDIA_TOKENS_LOW if detail == "low" else MEDIA_TOKENS


def split_content(content: object) -> tuple[list[str], int]:
    """A message's text pieces and the estimated tokens of its media parts.

    `content` is a string, None, or a list of parts. A text part counts the string in its
    type's field (`text`, `refusal`, `thinking`, ...); a media part counts `media_tokens`.
    Any other part (an unknown type, a text part without its string, a part with no type and
    no media) counts as its JSON text: whatever a backend renders of it, it cannot render
    more of its strings than that, so no text can hide from the count.
    """
    if isinstance(content, str):
        return [content], 0
    if not isinstance(content, Sequence):
        return [], 0
    texts: list[str] = []
    media = 0
    for part in content:
        # The usual part first, and as cheap as a part can be checked (JSON gives dicts).
        if type(part) is dict and part.get("type") == "text" and "uuid" not in part:
            text = part.get("text")
            if type(text) is str:
                texts.append(text)
                continue
        if isinstance(part, Mapping):
            media += _part(part, part.get("type"), texts)
        elif isinstance(part, str):
            texts.append(part)
        else:
            texts.append(_json(part))
    return texts, media


def _part(part: Mapping[str, Any], kind: object, texts: list[str]) -> int:
    """Adds a part's text to `texts`; returns its media estimate."""
    # vLLM reads a part with a uuid by its keys, as it reads a part with no type.
    if isinstance(kind, str) and "uuid" not in part:
        field = _TEXT_FIELDS.get(kind)
        if field is not None:
            text = part.get(field)
            if isinstance(text, str):
                texts.append(text)
                return 0
        elif kind in _MEDIA_TYPES:
            return media_tokens(part)
    elif any(part.get(key) is not None for key in _MEDIA_KEYS):
        return media_tokens(part)
    texts.append(_json(part))
    return 0


def _json(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, default=str)
