"""Named plug-ins of one kind (refinement strategies, selectors): one class per file, registered by a decorator,
found by name.

A `Registry` is a dict of name -> instance (one instance per class: plug-ins are stateless), so callers read it
as one (`sorted(REGISTRY)`, `REGISTRY[name]`, `.items()`). `register` is the class decorator: a second class
under a taken name is refused in one line naming both (re-registering the same class, as a re-import does, is
a no-op). `named` is the lookup whose error names the folder and what is registered, the line a user sees for
a misspelt name.
"""

from __future__ import annotations

from typing import Generic, TypeVar

T = TypeVar("T")
C = TypeVar("C", bound=type)


class Registry(dict[str, T], Generic[T]):
    """name -> instance for one kind of plug-in (`kind`, `kinds`: its name, singular and plural, in errors;
    `folder`: where its files live)."""

    def __init__(self, kind: str, kinds: str, folder: str):
        super().__init__()
        self.kind, self.kinds, self.folder = kind, kinds, folder

    def register(self, cls: C) -> C:
        """Class decorator: `cls.name` is `cls()` from now on (one class per name)."""
        if cls.name in self and type(self[cls.name]) is not cls:
            raise ValueError(f"two {self.kinds} are named {cls.name!r}: {type(self[cls.name]).__name__} and "
                             f"{cls.__name__}")
        self[cls.name] = cls()
        return cls

    def named(self, name: str) -> T:
        """The registered `name`, or a one-line error naming what is registered."""
        if name not in self:
            raise ValueError(f"no {self.kind} {name!r} is registered under {self.folder} "
                             f"(registered: {', '.join(sorted(self))})")
        return self[name]
