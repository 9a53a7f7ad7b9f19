"""Teacher calls, cached in the store: ask a teacher many prompts at once, land each answer in `teacher_calls` as
it returns, and answer a repeated prompt from the store (docs/algorithms.md §3.3).

A teacher is any model backend (models/backend.py): a local model answers in `generate` calls of its batch size;
an `Endpoint` (an OpenAI-compatible server, models/openai_http.py) answers concurrently through `ask`. Calls are
keyed on a hash of the teacher's name and the prompt (`call_key`); the refine stage (teacher_scaffold rewrites,
multiple-choice distractors) and the shape stage (reference traces) share the cache.

Choices, and why:
- Answers land as they return, not after the whole batch: an endpoint's every LAND_EVERY_S, a local model's per
  batch (its efficient unit, and one commit whatever its timing), so a crash costs at most those last answers
  and a rerun never pays twice.
- A failed call is not cached: a later stage or run asks again.
- Each answer is sampled with noise keyed by its own call key (keyed sampling, `row_seeds`): the same answer
  whatever else is asked in its batch and however the decoder orders and drops rows, so a rerun, a resumed
  stage and a faster decoder ask exactly the same. (Before, a batch drew from one seed in row order, so an
  answer depended on its batch and on the decoder's bookkeeping.)
- The budget (models/meter.py, purpose `teacher`) counts every answer a call uses, from the cache or fresh,
  by the tokens stored with it (`n_tokens`): an answer is part of what the method costs whether this process,
  a killed attempt of it, or another run on the store generated it, so a resumed stage and an arm that
  shares the store's cache count what an uninterrupted, lone run counts. An endpoint's answers carry no
  token ids and count 0 tokens (a call and a completion each).
- `TeacherConfig` (the config's `[teacher]` section) is here, beside the calls it tunes, because two stages ask
  the same teacher: refine and shape both read it. Its fields were `refine.teacher*` before; a stored or given
  config with those keys is read with them moved here (flows/config.py `renamed`, from `renamed_from`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import ClassVar, Protocol, runtime_checkable

import polars as pl
import pyarrow as pa
from pydantic import Field

from models.backend import Backend, Sampling
from models.config import Section
from models.meter import meter_counts
from storage.query import scan
from storage.store import Store
from tasks.core.ids import KEY_HEX, digest, seed_of

LAND_EVERY_S = 2.0  # answers that returned within this long land as one commit: a commit per answer would
                   # cost a Parquet file and a commit record each, for no safety a crash could notice
SEED_HEX = 7  # hex digits of a call key's digest that seed its answer


class TeacherConfig(Section):
    """The teacher that refine (teacher_scaffold rewrites, distractors) and shape (reference traces) ask, and how
    it is reached (docs/algorithms.md §3.3)."""

    renamed_from: ClassVar[dict] = {  # where each field lived before this section: old configs are read so
        "model": "refine.teacher", "max_new_tokens": "refine.teacher_max_new_tokens",
        "temperature": "refine.teacher_temperature", "timeout_s": "refine.teacher_timeout_s",
        "retries": "refine.teacher_retries", "backoff_s": "refine.teacher_backoff_s",
        "concurrency": "refine.teacher_concurrency"}

    model: str = Field("policy", description="'policy', `openai:<base url>#<model>`, or a model spec")
    max_new_tokens: int = Field(128, ge=8, le=4096, description="longest teacher answer, in tokens")
    temperature: float = Field(0.7, ge=0.0, le=2.0, description="the teacher's sampling temperature")
    timeout_s: float = Field(60.0, gt=0.0, le=3600.0, description="openai teacher: seconds to connect and to wait "
                             "for each reply's bytes, per request; also caps a 429's Retry-After")
    retries: int = Field(3, ge=0, le=20, description="openai teacher: retries of a request after a connection "
                         "error, timeout, 429 or 5xx; then that prompt falls back ('teacher unavailable: ...' in "
                         "refinements) and the round goes on")
    backoff_s: float = Field(1.0, ge=0.0, le=600.0, description="openai teacher: wait before the first retry, "
                             "doubled for each next one (a 429's Retry-After replaces it)")
    concurrency: int = Field(4, ge=1, le=256, description="openai teacher: requests in flight at once")

    @property
    def is_policy(self) -> bool:
        """Is the teacher the run's own policy?"""
        return self.model == "policy"


@runtime_checkable
class Endpoint(Protocol):
    """A teacher that answers many chat questions concurrently (models/openai_http.py)."""

    name: str

    def ask(self, questions: Mapping[str, tuple[list[dict], Sampling]],
            on_answer: Callable[[str, str | None, str | None], None]) -> None: ...


Teacher = Backend | Endpoint  # a local model answers through `generate`, an endpoint through `ask`


def call_key(teacher_name: str, payload: str) -> str:
    """The cache key of asking `teacher_name` the prompt `payload`."""
    return digest(f"{teacher_name}\x1f{payload}", KEY_HEX)


def teacher_cache(store: Store) -> dict[str, str]:
    """Every stored teacher answer, by key."""
    calls = scan(store, "teacher_calls").select("key", "response").unique("key").collect()
    return dict(calls.iter_rows())


def ask_teacher(store: Store, teacher: Teacher, payloads: dict[str, str], cache: dict[str, str],
                max_new_tokens: int, temperature: float = 0.7) -> tuple[set[str], dict[str, str]]:
    """Ask the teacher every payload ({key: prompt text}) not in `cache`, at `temperature`; answers land in
    `teacher_calls` and in `cache` as they return. Returns (keys answered now, {key: one-line reason} of the
    payloads it could not answer)."""
    missing = [k for k in payloads if k not in cache]
    fresh: set[str] = set()
    failed: dict[str, str] = {}
    landing = Landing(store, teacher.name, cache, fresh)
    if missing:
        _ask(teacher, payloads, missing, landing, failed, max_new_tokens, temperature)
        landing.land()
    used = [k for k in payloads if k in cache]
    if used:
        meter_counts("teacher", calls=1, completions=len(used), tokens=teacher_tokens(store, used))
    return fresh, failed


def teacher_tokens(store: Store, keys: list[str]) -> int:
    """Generated tokens of the stored answers to `keys`, summed (an answer with none recorded counts 0)."""
    from storage.query import table_rows_with_schema

    rows = table_rows_with_schema(store, "teacher_calls", ["key", "n_tokens"])
    return int(rows.filter(pl.col("key").is_in(keys)).unique("key")["n_tokens"].fill_null(0).sum())


def _ask(teacher: Teacher, payloads: dict[str, str], missing: list[str], landing: Landing, failed: dict[str, str],
         max_new_tokens: int, temperature: float) -> None:

    def on_answer(key: str, text: str | None, error: str | None) -> None:
        if error is not None:
            failed[key] = error
        else:
            landing.returned.append((key, text.strip(), None))
        if time.monotonic() - landing.last >= LAND_EVERY_S:
            landing.land()

    def messages(key: str) -> list[dict]:
        return [{"role": "user", "content": payloads[key]}]

    def seed(key: str) -> int:  # each answer's own seed: a rerun asks the same, whatever its batch
        return seed_of(key, SEED_HEX)

    if isinstance(teacher, Endpoint):
        teacher.ask({k: (messages(k), Sampling(temperature, 1.0, max_new_tokens, seed(k))) for k in missing},
                    on_answer)
    else:
        step = max(1, int(getattr(teacher, "batch_size", 0) or len(missing)))
        for i in range(0, len(missing), step):
            batch = missing[i : i + step]
            groups = teacher.generate([teacher.render(messages(k)) for k in batch], 1,
                                      Sampling(temperature, 1.0, max_new_tokens, seed(batch[0])),
                                      row_seeds=[seed(k) for k in batch])
            landing.returned += [(k, g[0].text.strip(), g[0].n_tokens)  # a batch lands whole
                                 for k, g in zip(batch, groups)]
            landing.land()


class Landing:
    """Answers that returned and have not landed yet, and when the last landing was."""

    def __init__(self, store: Store, teacher: str, cache: dict[str, str], fresh: set[str]):
        self.store, self.teacher, self.cache, self.fresh = store, teacher, cache, fresh
        self.returned: list[tuple[str, str, int | None]] = []  # (key, answer, generated tokens)
        self.last = time.monotonic()

    def land(self) -> None:
        """Commit the returned answers to `teacher_calls` (one commit), and note them in the cache."""
        if self.returned:
            keys = [k for k, _, _ in self.returned]
            self.store.commit(f"teacher-{digest(''.join(keys))}", {"teacher_calls": pa.table({
                "key": keys, "teacher": [self.teacher] * len(keys), "response": [r for _, r, _ in self.returned],
                "created_at": [datetime.now(UTC)] * len(keys),
                "n_tokens": pa.array([n for _, _, n in self.returned], pa.int64())})})
            self.cache.update((k, r) for k, r, _ in self.returned)
            self.fresh.update(keys)
            self.returned.clear()
        self.last = time.monotonic()
