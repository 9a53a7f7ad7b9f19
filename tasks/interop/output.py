"""Where `refinery export` writes, and how it writes without leaving anything half-written.

OUT is a file when it ends in `.parquet`: the table goes there and its dataset card to `<stem>.md` beside it.
Any other OUT is a folder in the Hugging Face dataset-repo layout: `data/...` and `README.md` (the card); the
lm-eval format always writes a folder. Refused: a URL (export writes locally), an OUT inside the store (its
folders hold landed data), a file OUT or its card that exists (unless `overwrite`), a folder OUT that exists and
is not empty (unless `overwrite` and it is an earlier export: its README.md carries the `refinery:` provenance
key; any other folder is never replaced), and an OUT whose parent folder does not exist.

Everything is written into a staging folder `.<name>.<pid>.tmp` beside OUT and renamed into place only once it
is complete, so a failed export leaves nothing. A replaced folder is first renamed aside and removed after the
new one is in place; a file OUT's two files are renamed one after the other (the table last).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from storage.store import Store


@dataclass(frozen=True)
class Target:
    path: Path  # the .parquet file or the folder
    folder: bool

    @property
    def card(self) -> Path:
        return self.path / "README.md" if self.folder else self.path.with_suffix(".md")


def in_store(store: Store, path: Path) -> Path | None:
    """`path` relative to the root of the local store `store` (`.` for the root itself) when it lies inside it,
    links resolved; else None (a remote store holds no local path)."""
    if not store.local:
        return None
    root, path = Path(store.root).resolve(), path.expanduser().resolve()
    return path.relative_to(root) if path == root or root in path.parents else None


def an_export(folder: Path) -> bool:
    """Whether `folder` is one an earlier export wrote (its card has Refinery's provenance key)."""
    card = folder / "README.md"
    return card.is_file() and "\nrefinery:\n" in card.read_text(errors="replace").split("\n---", 1)[0]


def check_out(store: Store, out: str, overwrite: bool, folder_only: bool = False) -> Target:
    """The output, refused when it would land inside the store or replace something unasked."""
    if "://" in out:
        raise ValueError(f"OUT {out!r}: export writes a local file (copy it to object storage afterwards)")
    path = Path(out).expanduser().resolve()
    if in_store(store, path) is not None:
        raise ValueError(f"OUT {out!r} is inside the store {store.uri}; the store's folders hold landed data, "
                         "export elsewhere")
    folder = folder_only or path.suffix != ".parquet"
    if folder_only and path.suffix == ".parquet":
        raise ValueError(f"OUT {out!r}: this format writes a folder; name one (not a .parquet file)")
    target = Target(path, folder)
    if folder and path.is_dir() and any(path.iterdir()):
        if not an_export(path):
            raise ValueError(f"OUT {out!r} is a folder that holds other files; name a new or empty folder, or a "
                             ".parquet file")
        if not overwrite:
            raise ValueError(f"OUT {out!r} holds an earlier export; pass --overwrite to replace it")
    elif folder and path.exists() and not path.is_dir():
        raise ValueError(f"OUT {out!r} exists and is not a folder; name a folder, or a .parquet file")
    elif not folder and path.is_dir():
        raise ValueError(f"OUT {out!r} is a folder; name a .parquet file, or a folder without the suffix")
    elif not folder:
        for p in (path, target.card):
            if p.exists() and not overwrite:
                raise ValueError(f"OUT {out!r}: {p.name} exists; pass --overwrite to replace it")
    if not path.parent.is_dir():
        raise ValueError(f"OUT {out!r}: its folder {path.parent} does not exist")
    return target


@contextmanager
def staged(target: Target) -> Iterator[Path]:
    """A staging folder beside OUT to write into: on a clean exit its contents are renamed into place (the
    folder itself for a folder OUT; the table and the card for a file OUT); it never outlives the block."""
    stage = target.path.with_name(f".{target.path.name}.{os.getpid()}.tmp")
    old = target.path.with_name(f".{target.path.name}.{os.getpid()}.old")
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir()
    try:
        yield stage
        if target.folder:
            if target.path.is_dir() and any(target.path.iterdir()):
                os.replace(target.path, old)  # an earlier export (check_out refused anything else)
            os.replace(stage, target.path)
        else:
            os.replace(stage / target.card.name, target.card)
            os.replace(stage / target.path.name, target.path)
    finally:
        shutil.rmtree(stage, ignore_errors=True)
        shutil.rmtree(old, ignore_errors=True)
