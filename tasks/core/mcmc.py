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

Batched, prompts computed afresh (`lockstep`: a backend that keeps no states, the scripted policy, or chains
over the KV budget): every step makes ONE generate call for all traces' proposals and ONE score call for their
terms. π(s | x, y_<i) of the current trace comes from a per-trace cache of its token log-probs, so only the new
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
model's keys, values and hidden states over c, y and x, y (models/hf/states.py) and q's log-probs of y: the
proposal samples from the first |c| + i positions without a prefill, q(s | c, y_<i) is read off, pi(s' | x,
y_<i) runs s' alone over the first |x| + i positions, and an accepted move extends the proposal state by s'
(the policy state it was scored with becomes the chain's). Per step the model runs the proposals' tokens and
the accepted suffixes, not the ~100-300-token prompts three times over. Such chains are not in lockstep
(`streamed`): their proposals decode in one running batch (the backend's `stream_from_states`), and a chain's
move is decided as soon as its own proposal ends, its next proposal joining the batch at once, so no chain
waits for the step's longest proposal (a proposal the limit cuts runs all 64 tokens; in a default round 0, 9
of 32 did, and lockstep decoded 472 steps where the busiest chain's own proposals took 389). Each chain draws
and decides exactly as in lockstep, in its own order; only the batching of the same computations differs.
It runs over 300 lines because the chains' two ways of computing the same densities (kept states, streamed;
or prompts scored afresh, in lockstep) share their draws and decisions (`draw_move`, `proposed_suffix`,
`decide`).
Traces are token ids, ending in end-of-sequence when complete; scores include that token.
"""

from __future__ import annotations

import difflib
import logging
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, field

from models.backend import Completion, KeepsStates, Sampling, TokenBackend
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


@dataclass
class Move:
    """One step's draws for a chain: the cut point i, the acceptance uniform, the proposal's sampling seed (in
    that order from the chain's own stream), and whether the move can be proposed at all (MH: the old suffix
    must be one the proposal could generate back)."""

    cut: int
    u: float
    seed: int
    movable: bool


def draw_move(t: Trace, variant: str, eos_ids: list[int], max_new_tokens: int) -> Move:
    """The chain's next step: its draws, counted as proposed (and as irreversible where it is not movable: an
    MH move whose old suffix the proposal could never generate back has A = 0 whatever y' is, so it is rejected
    from the cut point alone, and nothing is generated for it)."""
    cut, u, seed = t.rng.randrange(len(t.ids)), t.rng.random(), t.rng.getrandbits(31)
    t.proposed += 1
    movable = variant != "mh" or proposable(t.ids[cut:], eos_ids, max_new_tokens)
    if not movable:
        t.rejected_irreversible += 1
    return Move(cut, u, seed, movable)


def proposed_suffix(t: Trace, move: Move, c: Completion, eos_ids: list[int], max_new_tokens: int
                    ) -> tuple[list[int], list[float] | None] | None:
    """The suffix s' a finished proposal gives (the end token it stopped on included) and q(s' | c, y_<i) as it
    was drawn, where the backend reports the end token's log-prob (else None: to be scored); None for a
    proposal cut by the length limit (counted: not a complete trace) or one whose trace is outside C."""
    suffix = list(c.token_ids) + [c.stop_token if c.stop_token is not None else eos_ids[0]]
    if c.finish_reason != "stop" or not proposable(suffix, eos_ids, max_new_tokens):
        t.rejected_cut += 1
        return None
    if not t.in_c(t.ids[:move.cut] + suffix):
        return None
    drawn = c.stop_logprob is not None and len(c.logprobs) == len(c.token_ids)
    return suffix, (list(c.logprobs) + [c.stop_logprob] if drawn else None)


def decide(t: Trace, move: Move, suffix: list[int], pi_new: list[float], q_old: list[float] | None,
           q_new: list[float] | None, variant: str) -> bool:
    """Accept or reject the move to y_<i + s' (MH from the three terms; greedy: the mean log-prob rises), and
    apply it to the chain."""
    i = move.cut
    new, new_lp = t.ids[:i] + suffix, t.lp[:i] + pi_new
    if variant == "mh":
        log_a = mh_log_accept(sum(pi_new), sum(t.lp[i:]), sum(q_old), sum(q_new), len(t.ids), len(new))
        accept = math.log(max(move.u, 1e-300)) < min(0.0, log_a)
    else:
        accept = mean(new_lp) > mean(t.lp)
    t.decisions.append(accept)
    if accept:
        t.ids, t.lp = new, new_lp
        t.accepted += 1
    return accept


class ChainStates:
    """Each chain's model states (models/hf/states.py) where the backend keeps them (`open_states`): the policy's
    over x, y and the proposal's over c, y, with q's per-token log-probs of y. A proposal then starts from the
    first |c| + i positions of the proposal state (no prefill), q(s | c, y_<i) is read off the cache,
    pi(s' | x, y_<i) computes only s' over the policy state's first |x| + i positions, and an accepted move
    extends both states by s' from the cut. The same densities as computing every prefix again, to float
    rounding."""

    def __init__(self, backend: KeepsStates, traces: list[Trace]):
        self.backend = backend
        self.pi, lps = backend.open_states([t.prompt_ids for t in traces], [t.ids for t in traces])
        self.q, self.q_lp = backend.open_states([t.context_ids for t in traces], [t.ids for t in traces])
        self.pending: dict = {}  # the policy states the scored proposals would leave
        for t, lp in zip(traces, lps):
            t.lp, t.start_lp = lp, list(lp)

    def request(self, t: Trace, k: int, move: Move) -> tuple:
        """Chain k's proposal as `stream_from_states` takes it: its proposal state, cut after |c| + i tokens."""
        return self.q[k], len(t.context_ids) + move.cut, move.seed

    def score_new(self, traces: list[Trace], live: list[int], cuts: dict[int, int], suffixes: dict[int, list[int]]
                  ) -> dict[int, list[float]]:
        """pi(s' | x, y_<i) of each live proposal; the policy state each would leave is kept for `accept`."""
        states, lps = self.backend.extend_states([self.pi[k] for k in live],
                                                 [len(traces[k].prompt_ids) + cuts[k] for k in live],
                                                 [suffixes[k] for k in live]) if live else ([], [])
        self.pending = dict(zip(live, states))
        return dict(zip(live, lps))

    def accept(self, traces: list[Trace], moved: list[int], cuts: dict[int, int], suffixes: dict[int, list[int]]) -> None:
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
    if not all(callable(getattr(backend, m, None)) for m in ("open_states", "extend_states", "stream_from_states")):
        return False
    tokens = sum(len(t.prompt_ids) + len(t.context_ids) + 2 * (len(t.ids) + max_new_tokens) for t in traces)
    need = tokens * backend.kv_bytes_per_token
    if need > backend.kv_cache_bytes:
        log.info("MCMC: %d chains' states would hold %.2f GiB, over the KV budget of %.2f GiB: prompts are "
                 "computed afresh each step", len(traces), need / 2**30, backend.kv_cache_bytes / 2**30)
        return False
    return True


def score_missing(backend: TokenBackend, wanted: list[tuple[dict, int, list[int], list[int]]]) -> None:
    """One score call for the terms no state or proposal gave: (terms dict, chain, prompt, continuation)."""
    if wanted:
        for (terms, k, _, _), lp in zip(wanted, backend.score_ids([w[2] for w in wanted], [w[3] for w in wanted])):
            terms[k] = lp


def streamed(backend: KeepsStates, traces: list[Trace], states: ChainStates, steps: int, variant: str,
             max_new_tokens: int, eos_ids: list[int], advance: Callable[[int], None]) -> None:
    """`steps` steps of every chain that keeps states, without lockstep: each chain's proposal decodes in one
    running batch (`stream_from_states`), and as it finishes the move is decided (pi(s') from the policy
    state, q(s) from the proposal state, q(s') as drawn) and the chain's next proposal joins the batch. A step
    no longer waits for the step's longest proposal (64 tokens for every proposal the limit cuts); each chain
    draws and decides exactly as in lockstep, so the chains are the same either way. `advance(k)`: chain k
    finished a step."""
    done = [0] * len(traces)
    moves: dict[int, Move] = {}
    owner: list[int] = []  # request number -> chain
    drawn: list[Completion] = []

    def next_requests(chains: list[int]) -> list[tuple]:
        out = []
        for k in chains:
            while done[k] < steps:
                move = draw_move(traces[k], variant, eos_ids, max_new_tokens)
                if move.movable:
                    moves[k] = move
                    owner.append(k)
                    out.append(states.request(traces[k], k, move))
                    break
                traces[k].decisions.append(False)
                done[k] += 1
                advance(k)
        return out

    def finished(rows: list[tuple[int, Completion]]) -> list[tuple]:
        chains = [owner[num] for num, _ in rows]
        found = {}
        for k, (_, c) in zip(chains, rows):
            drawn.append(c)
            got = proposed_suffix(traces[k], moves[k], c, eos_ids, max_new_tokens)
            if got is not None:
                found[k] = got
        live = sorted(found)
        cuts = {k: moves[k].cut for k in chains}
        suffixes = {k: found[k][0] for k in live}
        pi_new = states.score_new(traces, live, cuts, suffixes)
        q_new = {k: found[k][1] for k in live if found[k][1] is not None}
        if variant == "mh":
            score_missing(backend, [(q_new, k, traces[k].context_ids + traces[k].ids[:cuts[k]], suffixes[k])
                                    for k in live if k not in q_new])
        moved = [k for k in live if decide(traces[k], moves[k], suffixes[k], pi_new[k], states.q_lp[k][cuts[k]:],
                                           q_new.get(k), variant)]
        for k in chains:
            if k not in found:
                traces[k].decisions.append(False)
        states.accept(traces, moved, cuts, suffixes)
        for k in chains:
            done[k] += 1
            advance(k)
        return next_requests(chains)

    backend.stream_from_states(next_requests(list(range(len(traces)))), Sampling(1.0, 1.0, max_new_tokens, 0),
                               finished)
    if drawn:
        record("mcmc", [drawn])  # one call: the chains' proposals decode in one running batch


def propose(backend: TokenBackend, traces: list[Trace], movable: list[int], moves: list[Move], step: int,
            max_new_tokens: int, reverse: bool) -> tuple[list, dict[int, list[float]]]:
    """The proposals of the `movable` traces (T = 1: kappa samples pi_ref, keyed per trace) and, with
    `reverse` (MH), the old suffixes' q(s | c, y_<i) where the backend scores them in the proposal's own
    prefill (`generate_and_score_ids`), {trace index: log-probs}; elsewhere the score call scores them."""
    if not movable:
        return [], {}
    sampling = Sampling(1.0, 1.0, max_new_tokens, step)
    prompts = [traces[k].context_ids + traces[k].ids[:moves[k].cut] for k in movable]
    seeds = [moves[k].seed for k in movable]
    fused = getattr(backend, "generate_and_score_ids", None) if reverse else None
    if fused is None:
        return record("mcmc", backend.generate_ids(prompts, 1, sampling, row_seeds=seeds)), {}
    out, q_old = fused(prompts, [traces[k].ids[moves[k].cut:] for k in movable], sampling, row_seeds=seeds)
    return record("mcmc", out), dict(zip(movable, q_old))


def lockstep(backend: TokenBackend, traces: list[Trace], step: int, variant: str, max_new_tokens: int,
             eos_ids: list[int]) -> None:
    """One MCMC step for every chain that keeps no states (prompts computed afresh): one batched generate call
    and one score call for the terms the proposal did not give: pi(s' | x, y_<i), q(s | c, y_<i), q(s' | c, y_<i)."""
    moves = [draw_move(t, variant, eos_ids, max_new_tokens) for t in traces]
    movable = [k for k, m in enumerate(moves) if m.movable]
    out, q_old = propose(backend, traces, movable, moves, step, max_new_tokens, variant == "mh")
    found = {}
    for k, g in zip(movable, out):
        got = proposed_suffix(traces[k], moves[k], g[0], eos_ids, max_new_tokens)
        if got is not None:
            found[k] = got
    pi_new: dict[int, list[float]] = {}
    q_new = {k: q for k, (_, q) in found.items() if q is not None}
    wanted = []
    for k, (suffix, _) in sorted(found.items()):
        t, i = traces[k], moves[k].cut
        wanted.append((pi_new, k, t.prompt_ids + t.ids[:i], suffix))
        if variant == "mh":
            wanted += [(q_old, k, t.context_ids + t.ids[:i], t.ids[i:])] if k not in q_old else []
            wanted += [(q_new, k, t.context_ids + t.ids[:i], suffix)] if k not in q_new else []
    score_missing(backend, wanted)
    for k, t in enumerate(traces):
        if k in found:
            decide(t, moves[k], found[k][0], pi_new[k], q_old.get(k), q_new.get(k), variant)
        else:
            t.decisions.append(False)


def shape_traces(backend: TokenBackend, traces: list[Trace], steps: int, variant: str = "mh", max_new_tokens: int = 64,
                 batched: bool = True, on_step=None) -> list[Trace]:
    """Run `steps` MCMC steps on every complete trace (ending in EOS) in C; the others are left as they are,
    unscored. Batched: all chains together (streamed where they keep states, else one generate and one score
    call per step); otherwise the same chains one trace at a time. `on_step(s)`: every chain finished step s."""
    if variant not in ("mh", "greedy"):
        raise ValueError(f"variant must be mh or greedy, got {variant!r}")
    eos_ids = list(backend.eos_ids)
    # a start without EOS is a cut trace: outside the target's support, and no move from it is reversible
    live = [t for t in traces if t.ids and t.ids[-1] in eos_ids and t.in_c(t.ids)]
    done = {id(t): 0 for t in live}
    reported = 0

    def advance(t: Trace) -> None:
        nonlocal reported
        done[id(t)] += 1
        while on_step and reported < min(done.values()):
            on_step(reported)
            reported += 1

    fresh = []
    for g in [g for g in ([live] if batched else [[t] for t in live]) if g]:
        if keeps_states(backend, g, max_new_tokens):  # scores the starts as it opens the states
            streamed(backend, g, ChainStates(backend, g), steps, variant, max_new_tokens, eos_ids,
                     lambda k, g=g: advance(g[k]))
            continue
        for t, lp in zip(g, backend.score_ids([t.prompt_ids for t in g], [t.ids for t in g])):
            t.lp, t.start_lp = lp, list(lp)
        fresh.append(g)
    for s in range(steps if fresh else 0):
        for g in fresh:
            lockstep(backend, g, s, variant, max_new_tokens, eos_ids)
            for t in g:
                advance(t)
    while on_step and reported < steps:  # no chain to shape: the steps pass empty
        on_step(reported)
        reported += 1
    return traces


def tokens_changed(a: list[int], b: list[int]) -> int:
    """Tokens of the longer sequence that are not part of a matching block.

    >>> tokens_changed([1, 2, 3, 4], [1, 2, 9, 4, 5])
    2
    """
    matched = sum(m.size for m in difflib.SequenceMatcher(None, a, b, autojunk=False).get_matching_blocks())
    return max(len(a), len(b)) - matched


