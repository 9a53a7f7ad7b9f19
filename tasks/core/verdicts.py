"""The verifier applied to a prompt row: one call shape for every stage that scores completions.

A prompt row (prompt_id, text, answer, source, meta) and a completion go to `tasks.core.rewards.verify` with the
run's reward section (verifier, strict, format_weight); `verdicts` does it for a batch of groups, one verdict
per completion (each parses model text on its own).
"""

from __future__ import annotations

from collections.abc import Sequence

import polars as pl

from models.backend import Completion
from tasks.core.rewards import RewardConfig, Verdict, verify


def verify_row(row: dict, text: str, cfg: RewardConfig) -> Verdict:
    """The verdict on completion `text` for prompt `row`."""
    return verify(text, row["answer"], row["source"], row["text"], row["meta"], cfg.verifier, cfg.strict,
                  cfg.format_weight)


def verdicts(prompts: pl.DataFrame, groups: Sequence[Sequence[Completion]], cfg: RewardConfig) -> list[list[Verdict]]:
    """The verdict for every completion of every group (groups in the order of `prompts`' rows)."""
    return [[verify_row(row, c.text, cfg) for c in group] for row, group in zip(prompts.iter_rows(named=True), groups)]
