"""Content-addressed prompt ids: the same text, answer and source always get the same id."""

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
    return hashlib.sha256(payload.encode("utf-8")).hexdigest()[:16]
