"""The `Selector` protocol every selector implements, and the registry that finds them by name.

A selector is a class in its own file under tasks/selectors/, decorated with `@register`; its `name` is one of
`SelectConfig.selector`'s choices, which are built from this registry (tasks/select.py), and what
`selections.selector` says of its picks. The select stage (tasks/select.py) reads the round's candidates and
their latest EPS, embeds them when the selector asks (`needs_embeddings`), calls `select`, and lands what it
returns (`Picks`): the picks as `selections` rows, k-means centroids if any, and any further per-prompt tables.

Choices, and why:
- One signature, `select(candidates, view, cfg) -> Picks`, and the differences between selectors as explicit
  class flags that other stages read instead of testing names: `needs_embeddings` (the stage embeds the
  candidates with `cfg.embedder` and passes last round's centroids of the same embedding space to warm-start
  from), `generates` (the collect stage over-samples for it, batch by batch, and refills from the candidates
  (tasks/sampling/dynamic.py); the sampler API, which does not generate, refuses it) and `whole_pool` (no select
  stage runs: collect takes the round's whole active pool, and the sampler refuses it).
- Selectors read the select settings through `Settings`, the fields they use, which `SelectConfig` has: a
  protocol, so this folder never imports the stage that imports it. A new selector's own fields go into
  `SelectConfig` (config sections live beside the stage that uses them).
- `Picks.tables` leaves room for per-prompt records beside the picks (a pass-rate model's predicted pass rate
  and P(informative) per candidate, for a `predictions` table): the stage lands each frame under its table name
  with run_id, round and selector added; a selector returns none until its table exists in storage/schemas.py.
- The pure algorithms stay in tasks/core/ (tasks/core/selection.py, tasks/core/dapo.py); a selector's file
  is the thin glue from the protocol to them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, ClassVar, Protocol

import numpy as np
import polars as pl

from tasks.core.registry import Registry

if TYPE_CHECKING:  # embed.py imports tasks/stage.py: types only, no import at run time
    from storage.store import Store
    from tasks.stage import RoundContext

PICK_SCHEMA = {"prompt_id": pl.String, "cluster": pl.Int32, "weight": pl.Float64, "reason": pl.String}


class Settings(Protocol):
    """The select settings the built-in selectors read (each is a `SelectConfig` field, described there)."""

    batch_size: int
    k_max: int
    temperature: float
    bonus: float
    embedder: str
    minibatch_above: int
    dapo_oversample: float
    dapo_max_batches: int
    pass_rate_prior: str


@dataclass(frozen=True)
class Candidates:
    """The prompts a round may select, sorted by prompt_id: `frame` (prompt_id, text, eps: the latest EPS of an
    earlier round of this run, null when never scored), `eps` as an array (NaN: never scored) and, for a
    selector that `needs_embeddings`, their vectors `x` in embedding space `space` and last round's centroids
    in that space (`init`, None when there are none)."""

    frame: pl.DataFrame
    eps: np.ndarray
    x: np.ndarray | None = None
    space: str | None = None
    init: np.ndarray | None = None

    @property
    def ids(self) -> list[str]:
        return self.frame["prompt_id"].to_list()


@dataclass(frozen=True)
class RoundView:
    """What a selector may read of the round besides the candidates: its context, the store (read only: the
    stage commits) and the round's selection seed (tasks/core/seeds.py `round_seed` of `select.seed`)."""

    ctx: RoundContext
    store: Store
    seed: int


@dataclass(frozen=True)
class Picks:
    """What a selector returns: `rows` (prompt_id, cluster, weight, reason: the `selections` columns it sets;
    the stage adds run_id, round and selector), `centroids` (cluster, size, utility, weight, vector: landed in
    `centroids` with the embedding space), `summary` (added to the stage's summary) and `tables` (further rows
    keyed by prompt_id, landed under their table names with run_id, round and selector added)."""

    rows: pl.DataFrame
    centroids: pl.DataFrame | None = None
    summary: Mapping[str, object] = field(default_factory=dict)
    tables: Mapping[str, pl.DataFrame] = field(default_factory=dict)


def pick_rows(prompt_ids: list[str], reasons: list[str] | str) -> pl.DataFrame:
    """`selections` columns for picks with no cluster and no weight."""
    reasons = [reasons] * len(prompt_ids) if isinstance(reasons, str) else reasons
    return pl.DataFrame({"prompt_id": prompt_ids, "cluster": [None] * len(prompt_ids),
                         "weight": [None] * len(prompt_ids), "reason": reasons}, schema=PICK_SCHEMA)


class Selector(Protocol):
    """A selector (see the module docstring). Subclassing it gives the defaults below."""

    name: ClassVar[str]  # its name in SelectConfig.selector, and selections.selector of its picks
    description: ClassVar[str]  # one clause for the config field's description (the UI form shows it)
    needs_embeddings: ClassVar[bool] = False  # the stage embeds the candidates (select.embedder) before `select`
    generates: ClassVar[bool] = False  # collect over-samples and refills for it (tasks/sampling/dynamic.py)
    whole_pool: ClassVar[bool] = False  # no select stage: collect takes the round's whole active pool

    def select(self, candidates: Candidates, view: RoundView, cfg: Settings) -> Picks:
        """The round's picks among `candidates` (at most `cfg.batch_size`, unless the selector says otherwise)."""
        ...


REGISTRY: Registry[Selector] = Registry("selector", "selectors", "tasks/selectors/")
register = REGISTRY.register  # class decorator: the selector `cls.name` is `cls()` from now on (one per name)
selector = REGISTRY.named  # the registered selector `name`, or a one-line error naming what is registered
