"""Content-addressed ids and short digests, in one place.

Prompt ids: the same text, answer and source always get the same id. Every other digest the project stores or
keys by is `digest(text, width)` with one of the named widths below: sha256, truncated to hex characters.
- ID_HEX (16 hex, 64 bits): row ids (prompts, shaped traces), commit names, embedding keys.
- KEY_HEX (24 hex, 96 bits): teacher-call cache keys, which many prompts of many runs share.
- SEED_HEX (8 hex, 32 bits) and RNG_HEX (15 hex, 60 bits): seeds drawn from a key (`seed_of`).
- TAG_HEX (6 hex): a short tag that tells apart two names that print alike (report keys).
"""

from __future__ import annotations

import hashlib
import re
import unicodedata

_WS = re.compile(r"\s+")


def normalise_text(text: str) -> str:
    """NFC, trimmed, with every run of whitespace collapsed to one space."""
    return _WS.sub(" ", unicodedata.normalize("NFC", text)).strip()


def prompt_id(text: str, answer: str, source: str) -> str:
    """sha256 over the normalised (text, answer, source), as 16 hex characters (64 bits).

    >>> prompt_id("What is 2 +  2?", "4", "demo") == prompt_id(" What is 2 + 2? ", "4", "demo")
    True
    """
    payload = "\x1f".join((normalise_text(text), normalise_text(answer), source.strip()))
    return digest(payload)


ID_HEX, KEY_HEX, SEED_HEX, RNG_HEX, TAG_HEX = 16, 24, 8, 15, 6


def digest(text: str, width: int = ID_HEX) -> str:
    """sha256 of `text` (UTF-8) as its first `width` hex characters.

    >>> digest("abc"), digest("abc", TAG_HEX)
    ('ba7816bf8f01cfea', 'ba7816')
    """
    return hashlib.sha256(text.encode("utf-8")).hexdigest()[:width]


def seed_of(text: str, width: int = SEED_HEX) -> int:
    """An integer seed drawn from `text`: its digest's first `width` hex characters."""
    return int(digest(text, width), 16)
