"""The model backend protocol every policy, teacher and test model implements.

`generate` returns, for each prompt, n completions with their token ids, the per-token log-probabilities of
the sampled tokens under the *unmodified* model distribution (temperature 1, no top-p: what the trainer's
importance ratios need), and a finish reason. `score` returns per-token log-probabilities of given
completions. Prompts are fully rendered text (chat template already applied; see `render`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.7
    top_p: float = 1.0
    max_new_tokens: int = 128
    seed: int = 0

    def __post_init__(self):
        if self.temperature < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be >= 1, got {self.max_new_tokens}")


@dataclass
class Completion:
    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "stop"  # "stop" (end of sequence) | "length" (hit max_new_tokens)

    @property
    def n_tokens(self) -> int:
        return len(self.token_ids) if self.token_ids else len(self.logprobs)

    @property
    def mean_logprob(self) -> float | None:
        return sum(self.logprobs) / len(self.logprobs) if self.logprobs else None


@runtime_checkable
class Backend(Protocol):
    name: str

    def render(self, messages: list[dict]) -> str:
        """Chat messages as the model's prompt text, ending with the assistant turn's opening."""
        ...

    def generate(self, prompts: list[str], n: int, sampling: Sampling) -> list[list[Completion]]: ...

    def score(self, prompts: list[str], completions: list[str]) -> list[list[float]]: ...
