"""MCMC on-policy shaping of off-policy traces (docs/algorithms.md §5; arXiv 2610.02140, 2510.14901), on plain torch.

An off-policy trace y for prompt x (a reference solution, or a teacher's) is moved towards the policy's own
distribution while it keeps a verified answer: the chain targets p_C(y) ∝ π(y | x) 1[y ∈ C], C = the traces
the verifier accepts, π = the current policy without privileged context.

Proposal κ(y' | y): a cut point i ~ U{0..|y|-1}; keep y_<i and sample the suffix from π prompted with the
question, the reference trace and "continue this partial answer in your own words", then y_<i (the
privileged trace is only in the proposal's context). Acceptance
    A = min(1, π(y'|x) κ(y|y') / (π(y|x) κ(y'|y)))
      = min(1, exp([π(s'|x,y_<i) - π(s|x,y_<i)] + [q(s|c,y_<i) - q(s'|c,y_<i)]) * |y| / |y'|),
with s, s' the old and new suffixes and q the proposal model in context c. The prefix terms cancel; the cut
point's 1/|y| vs 1/|y'| does not when the lengths differ, so that factor is kept. Proposals outside C are
rejected without scoring. The greedy variant accepts iff the mean per-token log-prob under π rises.

Reversibility. The proposal samples at most L = max_new_tokens tokens, so κ(s' | c, y_<i) is q(s' | c, y_<i)
for a complete suffix (ending in end-of-sequence) of at most L tokens, EOS included, and 0 for any other.
Hence, in both directions:
- a proposal cut off by the limit (or one longer than L) is not a complete trace, outside the target's
  support: rejected, for both variants, so no cut trace ever becomes the chain's state (nor training data);
- MH: a move whose OLD suffix is longer than L, or has no EOS, could never be generated back (κ(y|y') = 0,
  log A = -inf): rejected whatever the log-probs say, decided from the cut point alone, before generating.
  Without this the unconstrained q(s|c,y_<i) stands in for a probability that is 0. The greedy variant is
  an optimiser, not a sampler, and needs no reverse move.
A start without EOS (a trace cut before it ended) is therefore never shaped: no move from it is reversible,
and an incomplete trace is not in the target's support. Each trace counts its rejections for either reason.

Batched: every step makes ONE generate call for all traces' proposals and ONE score call for their terms.
π(s | x, y_<i) of the current trace comes from a per-trace cache of its token log-probs, so only the new
suffix is scored under π. q(s' | c, y_<i) is the proposal's own log-probs as it sampled s' (T = 1, no
nucleus: exactly the density s' was drawn from), end-of-sequence token included, where the backend reports
that token and its log-prob (transformers, vLLM: `Completion.stop_token`); elsewhere (the scripted
backend) s' is scored like s. The suffix ends in the end token the proposal actually stopped on.
q(s | c, y_<i) is read off the proposal's own prefill where the backend offers `generate_and_score_ids`
(transformers: the prompt c, y_<i is computed once for both), and goes into the score call otherwise. All
randomness (cut points, acceptance uniforms, the suffix tokens via keyed sampling) is drawn per trace, so a
trace's chain is the same batched or alone (`shape_traces(batched=False)`).
Kept states (`ChainStates`, where the backend keeps sequence states: transformers). Every prompt a chain
computes is a prefix of its current trace: c, y_<i of c, y and x, y_<i of x, y. So each chain keeps the
model's keys, values and hidden states over c, y and x, y (models/states.py) and q's log-probs of y: the
proposal samples from the first |c| + i positions without a prefill, q(s | c, y_<i) is read off, pi(s' | x,
y_<i) runs s' alone over the first |x| + i positions, and an accepted move extends the proposal state by s'
(the policy state it was scored with becomes the chain's). Per step the model runs the proposals' tokens and
the accepted suffixes, not the ~100-300-token prompts three times over. It runs over 300 lines because the
chains' two ways of computing the same densities (kept states, or prompts scored afresh) share the step.
Traces are token ids, ending in end-of-sequence when complete; scores include that token.
"""

from __future__ import annotations

import difflib
import logging
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from models.backend import KeepsStates, Sampling, TokenBackend
from models.meter import record
from tasks.core.ids import RNG_HEX, seed_of

log = logging.getLogger("refinery.shape")

CONTINUE = "Continue this partial answer in your own words."
@dataclass
class Trace:
    """One chain: the plain prompt's ids, the proposal context's ids, the current trace (ending in EOS when
    complete) and its per-token log-probs under π, and its own random stream. `rejected_irreversible` and
    `rejected_cut` count the proposals rejected because the move could not be reversed or the proposal was
    cut by the length limit."""

    key: str
    prompt_ids: list[int]
    context_ids: list[int]
    ids: list[int]
    in_c: Callable[[list[int]], bool]  # the verifier: is this trace in C?
    lp: list[float] = field(default_factory=list)
    start_ids: list[int] = field(default_factory=list)
    start_lp: list[float] = field(default_factory=list)
    accepted: int = 0
    proposed: int = 0
    rejected_irreversible: int = 0
    rejected_cut: int = 0
    decisions: list[bool] = field(default_factory=list)
    rng: random.Random | None = None

    @property
    def rng_seed(self) -> int:
        return seed_of(self.key, RNG_HEX)

    def __post_init__(self):
        self.rng = random.Random(self.rng_seed)
        self.start_ids = list(self.ids)


def mean(x: list[float]) -> float:
    return sum(x) / len(x) if x else float("nan")


def mh_log_accept(pi_new: float, pi_old: float, q_old: float, q_new: float, len_old: int, len_new: int) -> float:
    """log A (before the min with 0) from the suffix log-prob sums and the two trace lengths.

    >>> round(mh_log_accept(-2.0, -3.0, -1.0, -1.5, 10, 10), 6)
    1.5
    >>> round(mh_log_accept(-2.0, -2.0, -1.0, -1.0, 10, 20), 6) == round(math.log(0.5), 6)
    True
    """
    return (pi_new - pi_old) + (q_old - q_new) + math.log(len_old / len_new)


def proposable(suffix: list[int], eos_ids: list[int], max_new_tokens: int) -> bool:
    """Whether the length-limited proposal can generate `suffix`: complete (its last token, and only that,
    is end-of-sequence) and at most `max_new_tokens` tokens long, EOS included.

    >>> proposable([5, 6, 2], [2], 3), proposable([5, 6, 2], [2], 2), proposable([5, 6, 7], [2], 8)
    (True, False, False)
    """
    return (0 < len(suffix) <= max_new_tokens and suffix[-1] in eos_ids
            and not any(tok in eos_ids for tok in suffix[:-1]))


class ChainStates:
    """Each chain's model states (models/states.py) where the backend keeps them (`open_states`): the policy's
    over x, y and the proposal's over c, y, with q's per-token log-probs of y. A step's proposal then starts
    from the first |c| + i positions of the proposal state (no prefill), q(s | c, y_<i) is read off the
    cache, pi(s' | x, y_<i) computes only s' over the policy state's first |x| + i positions, and an accepted
    move extends both states by s' from the cut. The same densities as computing every prefix again, to float
    rounding."""

    def __init__(self, backend: KeepsStates, traces: list[Trace]):
        self.backend = backend
        self.pi, lps = backend.open_states([t.prompt_ids for t in traces], [t.ids for t in traces])
        self.q, self.q_lp = backend.open_states([t.context_ids for t in traces], [t.ids for t in traces])
        self.pending: dict = {}  # the policy states the step's scored proposals would leave
        for t, lp in zip(traces, lps):
            t.lp, t.start_lp = lp, list(lp)

    def propose(self, traces: list[Trace], movable: list[int], cuts: list[int], sampling: Sampling,
                seeds: list[int]) -> tuple[list, dict[int, list[float]]]:
        out = self.backend.generate_from_states([self.q[k] for k in movable],
                                                [len(traces[k].context_ids) + cuts[k] for k in movable], sampling,
                                                row_seeds=[seeds[k] for k in movable])
        return out, {k: self.q_lp[k][cuts[k]:] for k in movable}

    def score_new(self, traces: list[Trace], live: list[int], cuts: list[int], suffixes: dict[int, list[int]]
                  ) -> dict[int, list[float]]:
        """pi(s' | x, y_<i) of each live proposal; the policy state each would leave is kept for `accept`."""
        states, lps = self.backend.extend_states([self.pi[k] for k in live],
                                                 [len(traces[k].prompt_ids) + cuts[k] for k in live],
                                                 [suffixes[k] for k in live]) if live else ([], [])
        self.pending = dict(zip(live, states))
        return dict(zip(live, lps))

    def accept(self, traces: list[Trace], moved: list[int], cuts: list[int], suffixes: dict[int, list[int]]) -> None:
        """The accepted moves' states: the policy's as scored, the proposal's extended by s' from the cut."""
        if moved:
            states, lps = self.backend.extend_states([self.q[k] for k in moved],
                                                     [len(traces[k].context_ids) + cuts[k] for k in moved],
                                                     [suffixes[k] for k in moved])
            for k, st, lp in zip(moved, states, lps):
                self.pi[k], self.q[k], self.q_lp[k] = self.pending[k], st, self.q_lp[k][:cuts[k]] + lp
        self.pending = {}


def keeps_states(backend: TokenBackend, traces: list[Trace], max_new_tokens: int) -> bool:
    """Whether `backend` keeps sequence states for these chains: it can (the transformers backend; not the
    scripted policy, whose proposals come from its script), and their states fit in its KV budget
    (`kv_cache_gib`): x, y and c, y per chain, each with room for a suffix of `max_new_tokens`. Otherwise every
    prompt is computed afresh each step (the same densities, more compute), and the log says why."""
    if not all(callable(getattr(backend, m, None)) for m in ("open_states", "extend_states", "generate_from_states")):
        return False
    tokens = sum(len(t.prompt_ids) + len(t.context_ids) + 2 * (len(t.ids) + max_new_tokens) for t in traces)
    need = tokens * backend.kv_bytes_per_token
    if need > backend.kv_cache_bytes:
        log.info("MCMC: %d chains' states would hold %.2f GiB, over the KV budget of %.2f GiB: prompts are "
                 "computed afresh each step", len(traces), need / 2**30, backend.kv_cache_bytes / 2**30)
        return False
    return True


def propose(backend: TokenBackend, traces: list[Trace], movable: list[int], cuts: list[int], seeds: list[int],
            step: int, max_new_tokens: int, reverse: bool, states: ChainStates | None = None
            ) -> tuple[list, dict[int, list[float]]]:
    """The proposals of the `movable` traces (T = 1: kappa samples pi_ref, keyed per trace) and, with
    `reverse` (MH), the old suffixes' q(s | c, y_<i) where the backend gives them with the proposal (from the
    chains' `states`, or scored in the proposal's own prefill by `generate_and_score_ids`), {trace index:
    log-probs}; elsewhere the score call scores them."""
    if not movable:
        return [], {}
    sampling = Sampling(1.0, 1.0, max_new_tokens, step)
    if states is not None:
        out, q_old = states.propose(traces, movable, cuts, sampling, seeds)
        return record("mcmc", out), q_old if reverse else {}
    prompts = [traces[k].context_ids + traces[k].ids[:cuts[k]] for k in movable]
    fused = getattr(backend, "generate_and_score_ids", None) if reverse else None
    if fused is None:
        return record("mcmc", backend.generate_ids(prompts, 1, sampling, row_seeds=[seeds[k] for k in movable])), {}
    out, q_old = fused(prompts, [traces[k].ids[cuts[k]:] for k in movable], sampling,
                       row_seeds=[seeds[k] for k in movable])
    return record("mcmc", out), dict(zip(movable, q_old))


def _step(backend: TokenBackend, traces: list[Trace], step: int, variant: str, max_new_tokens: int,
          eos_ids: list[int], states: ChainStates | None = None) -> None:
    """One MCMC step for every trace: one batched generate call, one batched score call (with `states`: one
    extension of the policy states by the proposals, and one of the proposal states by the accepted ones)."""
    cuts = [t.rng.randrange(len(t.ids)) for t in traces]
    us = [t.rng.random() for t in traces]
    seeds = [t.rng.getrandbits(31) for t in traces]
    for t in traces:
        t.proposed += 1
    # MH: a move whose old suffix the proposal could never generate back has A = 0 whatever y' is, so it is
    # rejected from the cut point alone, and nothing is generated for it
    movable = [k for k, (t, i) in enumerate(zip(traces, cuts))
               if variant != "mh" or proposable(t.ids[i:], eos_ids, max_new_tokens)]
    for k in set(range(len(traces))) - set(movable):
        traces[k].rejected_irreversible += 1
    out, q_old_of = propose(backend, traces, movable, cuts, seeds, step, max_new_tokens, variant == "mh", states)
    news: list[tuple[list[int], list[int]] | None] = [None] * len(traces)
    q_sampled: dict[int, list[float]] = {}  # q(s' | c, y_<i) as the proposal drew s', end token included
    for k, g in zip(movable, out):
        t, i, c = traces[k], cuts[k], g[0]
        suffix = list(c.token_ids) + [c.stop_token if c.stop_token is not None else eos_ids[0]]
        if c.finish_reason != "stop" or not proposable(suffix, eos_ids, max_new_tokens):
            t.rejected_cut += 1  # cut by the limit: not a complete trace
            continue
        new = t.ids[:i] + suffix
        news[k] = (new, suffix) if t.in_c(new) else None
        if c.stop_logprob is not None and len(c.logprobs) == len(c.token_ids):
            q_sampled[k] = list(c.logprobs) + [c.stop_logprob]
    live = [k for k, n in enumerate(news) if n is not None]
    suffixes = {k: news[k][1] for k in live}
    # the three terms per live move: from the chains' states and the proposal where they give them, the rest in
    # one score call: pi(s' | x, y_<i), q(s | c, y_<i), q(s' | c, y_<i)
    terms = {"pi_new": states.score_new(traces, live, cuts, suffixes) if states is not None else {},
             "q_old": q_old_of, "q_new": q_sampled}
    wanted, score_p, score_c = [], [], []
    for k in live:
        t, i, suffix = traces[k], cuts[k], suffixes[k]
        rows = [("pi_new", t.prompt_ids + t.ids[:i], suffix)]
        if variant == "mh":
            rows += [("q_old", t.context_ids + t.ids[:i], t.ids[i:]), ("q_new", t.context_ids + t.ids[:i], suffix)]
        for name, prompt, cont in rows:
            if k not in terms[name]:
                wanted.append((name, k))
                score_p.append(prompt)
                score_c.append(cont)
    for (name, k), lp in zip(wanted, backend.score_ids(score_p, score_c) if score_p else []):
        terms[name][k] = lp
    moved = []
    for k, (t, i, u) in enumerate(zip(traces, cuts, us)):
        if news[k] is None:
            t.decisions.append(False)
            continue
        new, _ = news[k]
        pi_new = terms["pi_new"][k]
        new_lp = t.lp[:i] + pi_new
        if variant == "mh":
            log_a = mh_log_accept(sum(pi_new), sum(t.lp[i:]), sum(terms["q_old"][k]), sum(terms["q_new"][k]),
                                  len(t.ids), len(new))
            accept = math.log(max(u, 1e-300)) < min(0.0, log_a)
        else:
            accept = mean(new_lp) > mean(t.lp)
        t.decisions.append(accept)
        if accept:
            t.ids, t.lp = new, new_lp
            t.accepted += 1
            moved.append(k)
    if states is not None:
        states.accept(traces, moved, cuts, suffixes)


def shape_traces(backend: TokenBackend, traces: list[Trace], steps: int, variant: str = "mh", max_new_tokens: int = 64,
                 batched: bool = True, on_step=None) -> list[Trace]:
    """Run `steps` MCMC steps on every complete trace (ending in EOS) in C; the others are left as they are,
    unscored. Batched: one generate and one score call per step for all traces; otherwise the same chains
    one trace at a time."""
    if variant not in ("mh", "greedy"):
        raise ValueError(f"variant must be mh or greedy, got {variant!r}")
    eos_ids = list(backend.eos_ids)
    # a start without EOS is a cut trace: outside the target's support, and no move from it is reversible
    live = [t for t in traces if t.ids and t.ids[-1] in eos_ids and t.in_c(t.ids)]
    groups = [g for g in ([live] if batched else [[t] for t in live]) if g]
    kept: list[ChainStates | None] = []
    for g in groups:
        if keeps_states(backend, g, max_new_tokens):  # scores the starts as it opens the states
            kept.append(ChainStates(backend, g))
            continue
        kept.append(None)
        for t, lp in zip(g, backend.score_ids([t.prompt_ids for t in g], [t.ids for t in g])):
            t.lp, t.start_lp = lp, list(lp)
    for s in range(steps):
        for g, states in zip(groups, kept):
            _step(backend, g, s, variant, max_new_tokens, eos_ids, states)
        if on_step:
            on_step(s)
    return traces


def tokens_changed(a: list[int], b: list[int]) -> int:
    """Tokens of the longer sequence that are not part of a matching block.

    >>> tokens_changed([1, 2, 3, 4], [1, 2, 9, 4, 5])
    2
    """
    matched = sum(m.size for m in difflib.SequenceMatcher(None, a, b, autojunk=False).get_matching_blocks())
    return max(len(a), len(b)) - matched


