"""The model backend protocol every policy, teacher and test model implements.

`generate` returns, for each prompt, n completions with their token ids, the per-token log-probabilities of
the sampled tokens, and a finish reason. `score` returns per-token log-probabilities of given completions
under the unmodified model (temperature 1). Prompts are fully rendered text (chat template already applied;
see `render`).

Which distribution a log-prob describes:
- `generate`'s log-probs describe the distribution the tokens were drawn from: log_softmax(logits / T) at the
  sampling temperature T, as verl and TRL compute them, so they agree with what the trainer recomputes for
  its importance ratio, its KL and LoPE's behaviour ratio (tasks/core/grpo.py), and the `mean_logprob` stored in
  `rollouts` is on the same scale.
- Top-p is *not* applied to them (the nucleus is not renormalised): the trainer, like verl's and TRL's,
  cannot reproduce the sampler's nucleus per position, and the default top_p is 1, where the two agree
  exactly. With top_p < 1 a sampled token's log-prob understates the truncated distribution's by
  log(nucleus mass) at that position.
- Temperature 0 (greedy) is a point mass, whose log-probs (0 for the chosen token) carry no information;
  it is defined to mean the unmodified model (T = 1), as vLLM's processed log-probs do for greedy rows.
  `logprob_temperature` is that rule, in one place.
- `score` stays at T = 1: its callers mean the model itself (MCMC's target pi_ref in shaping, the rewrite
  gate's fluency log-prob), not a sampling distribution.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable


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


def logprob_temperature(temperature: float) -> float:
    """The temperature that log-probs of samples drawn at `temperature` are computed at: T itself, and 1 for
    greedy decoding (T = 0), which would otherwise divide the logits by zero.

    >>> logprob_temperature(0.7), logprob_temperature(0.0)
    (0.7, 1.0)
    """
    if temperature < 0:
        raise ValueError(f"temperature must be >= 0, got {temperature}")
    return temperature if temperature > 0 else 1.0


@dataclass
class Completion:
    text: str
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "stop"  # "stop" (end of sequence) | "length" (hit max_new_tokens)
    # the end-of-sequence token that ended a "stop" completion and its log-prob at the sampling temperature,
    # where the backend reports them (transformers, vLLM); not part of token_ids/logprobs. MCMC shaping's
    # proposal density q(s') is the sampled tokens' log-probs plus this one (tasks/core/mcmc.py)
    stop_token: int | None = None
    stop_logprob: float | None = None

    @property
    def sampled_ids(self) -> list[int] | None:
        """The token ids as sampled, the end token included when it stopped; None where the end token is not
        known (a backend that does not report it)."""
        if (self.finish_reason == "stop" and self.stop_token is None) or (self.text and not self.token_ids):
            return None  # the end token, or every token (a text-only endpoint), unknown
        return list(self.token_ids) + ([self.stop_token] if self.stop_token is not None else [])

    @property
    def sampled_logprobs(self) -> list[float] | None:
        """Each of `sampled_ids`' log-probs at the sampling temperature; None where one is not reported."""
        ids = self.sampled_ids
        lps = list(self.logprobs) + ([self.stop_logprob] if self.stop_logprob is not None else [])
        return lps if ids is not None and len(lps) == len(ids) else None

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

    def generate(self, prompts: list[str], n: int, sampling: Sampling,
                 progress: Callable[[int], None] | None = None,
                 row_seeds: list[int] | None = None) -> list[list[Completion]]:
        """n samples per prompt; with `row_seeds` (one per prompt), each prompt's samples depend on its own
        seed alone, not on the batch (keyed sampling: tasks/core/seeds.py row_seeds)."""
        ...

    def score(self, prompts: list[str], completions: list[str]) -> list[list[float]]: ...


@runtime_checkable
class TokenBackend(Backend, Protocol):
    """A `Backend` that also works on token ids: what MCMC shaping, LoPE's trainer-side ratios and the
    `policy` embedder need (transformers and the scripted policy implement it; a backend that does not is
    refused up front by the stage that needs it, by name: `require_tokens`)."""

    tokenizer: Any  # a Hugging Face tokenizer: chat template, encode/decode
    eos_ids: list[int]  # every id that ends a completion

    def encode(self, texts: list[str]) -> list[list[int]]:
        """Each text's token ids, without special tokens added."""
        ...

    def generate_ids(self, ids: list[list[int]], n: int, sampling: Sampling,
                     progress: Callable[[int], None] | None = None,
                     row_seeds: list[int] | None = None) -> list[list[Completion]]:
        """`generate` on token ids; with `row_seeds`, each row's draws depend on its own seed alone."""
        ...

    def score_ids(self, prompt_ids: list[list[int]], completion_ids: list[list[int]],
                  temperature: float = 1.0) -> list[list[float]]:
        """Per-token log-probs of each completion given its prompt, at `temperature`."""
        ...


class KeepsStates(TokenBackend, Protocol):
    """A `TokenBackend` that keeps what it computed over a sequence (models/hf/states.py) and starts later calls
    from a prefix of it: MCMC shaping's chains (tasks/core/mcmc.py ChainStates). The transformers backend."""

    kv_bytes_per_token: int  # what one token of kept keys and values costs
    kv_cache_bytes: float  # the KV budget a call may hold

    def open_states(self, prompt_ids: list[list[int]], completion_ids: list[list[int]]) -> tuple[list, list[list[float]]]:
        """Each prompt + completion's state, and the completion's per-token log-probs (T = 1)."""
        ...

    def extend_states(self, states: list, cuts: list[int], conts: list[list[int]]) -> tuple[list, list[list[float]]]:
        """The states of states[r].ids[:cuts[r]] + conts[r], and the continuations' log-probs (T = 1)."""
        ...

    def generate_from_states(self, states: list, cuts: list[int], sampling: Sampling,
                             row_seeds: list[int] | None = None) -> list[list[Completion]]:
        """One sample after each state's first `cuts` tokens, as `generate_ids` would draw it."""
        ...

    def stream_from_states(self, requests: list[tuple], sampling: Sampling, on_done) -> list[Completion]:
        """`generate_from_states` of (state, cut, row seed) requests in one running batch, where each decode
        step's finished rows go to `on_done([(request number, Completion)])`, whose returned requests join it."""
        ...


def end_ids(generation_eos: int | list[int] | None, tokenizer) -> list[int]:
    """Every id that ends a completion: the generation config's end ids (one or a list) plus the tokenizer's
    own end token, as transformers' `generate` and vLLM stop on them.

    >>> class T: eos_token_id = 2
    >>> end_ids([2, 7], T()), end_ids(7, T()), end_ids(None, T())
    ([2, 7], [7, 2], [2])
    """
    ids = [generation_eos] if isinstance(generation_eos, int) else list(generation_eos or [])
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in ids:
        ids.append(tokenizer.eos_token_id)
    return ids


def require_tokens(backend: Backend, what: str) -> TokenBackend:
    """`backend` as a TokenBackend, or a one-line error naming `what` needs it and which backend lacks it."""
    if not isinstance(backend, TokenBackend):
        raise ValueError(f"{what} needs a backend that generates and scores token ids; {backend.name!r} does not")
    return backend
