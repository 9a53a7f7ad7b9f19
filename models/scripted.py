"""A scripted policy: deterministic, model-like answers at a known per-prompt solve rate, with the real
token ids and log-probs of a real model (backend `scripted`, `model.backend = "scripted"`).

Why: the tiny random model never answers correctly, so a flow driven by it never takes the paths where the
policy succeeds (informative and saturated buckets, EPS-weighted selection, ladder promotion, LoPE rescue,
few-shot context, GRPO on mixed groups, accepted MCMC moves, pass@1 > 0). This backend decides *what* is
said by a script and leaves *how likely it is* to the model, so every stage downstream sees real data.

Method, and its choices:
- The text is scripted. The problem is the first arithmetic expression in the prompt's last user turn
  (reasoning-gym's products / chain_sum / basic_arithmetic questions, "What is 2 + 3?", and every child the
  refine stage derives from them: multiple choice, cloze, hint prefixes, hardened siblings). It is
  evaluated exactly (a whitelist of ast nodes over integers and fractions, never `eval`), so the right answer
  is computed from the question, not looked up. A prompt with no expression is never solved (it cannot be).
- Answers look like a model's: one reasoning line and `\\boxed{...}`, in one of a few phrasings; a correct
  answer states the computed value, a wrong one a plausible slip (off by one, two or ten, a digit swap, the
  wrong operation; for multiple choice, a distractor option).
- Solve rate r (a multiple of 1/8, clamped to [0, 1]): a base rate from a hash of the expression, spread
  evenly over 0, 1/8, ..., 1 so every bucket occurs; plus 6/8 for a 4-option and 4/8 for a 10-option
  multiple-choice rung, 2/8 for a cloze rung, 3/8 for a hint prefix, 2/8 with few-shot demonstrations in
  context, 2/8 under a Lorem-Ipsum system prefix (LoPE), 1/8 per trained policy version (the checkpoint
  folder's `v<N>`: a stand-in for learning, so reserve prompts can recover); at least 7/8 when the context
  holds a reference solution or states the answer (MCMC proposals, teacher solution requests).
- Which samples solve is systematic sampling: one uniform offset u per (prompt, seed), and sample j of n
  solves iff frac(u + j/n) < r, so a group of n holds floor(r n) or ceil(r n) correct samples (exactly r n
  when that is whole). Groups are as mixed as r says, with no binomial luck. With row seeds
  (`generate_ids(row_seeds=...)`, MCMC shaping) each row draws its own u. At temperature 0 every sample
  takes the modal outcome (solved iff r >= 1/2); other temperatures and top_p do not change r.
- Token ids are the model tokenizer's encoding of the scripted text, cut at `max_new_tokens` (then
  finish_reason "length"; otherwise it stops on the model's first end id, reported as `stop_token` with its
  score); log-probs are that model's scores of those tokens given the prompt at the
  sampling temperature (`score_ids(temperature=T)`, T = 1 for greedy), as the transformers backend reports
  them, i.e. what the trainer's importance ratios need. Rendering, `score`, `encode`, `tokenizer`,
  `model` and `eos_ids` are the wrapped transformers backend's own, so shaping, the `policy` embedder and
  the train stage (which loads the checkpoint folder itself) work unchanged, and the checkpoint it writes
  loads as a scripted backend again in the next round.
Everything is a function of the prompt text, the sample index and the seed: batch composition never
changes an answer. It runs over 300 lines because the script, its problem reader and the backend that
serves it are one policy.
"""

from __future__ import annotations

import ast
import hashlib
import operator
import re
from collections.abc import Callable
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path

from models.backend import Completion, Sampling
from models.cache import model_identity
from models.hf.backend import TransformersBackend
from models.lorem import LOREM

EIGHTHS = 8
RATE_BOOST = {"mcq4": 6, "mcq10": 4, "cloze": 2, "hint": 3, "fewshot": 2, "lorem": 2, "version": 1}
REFERENCE_RATE = 7  # eighths, at least, when the context holds the answer
_REFERENCE_MARKERS = ("Reference solution:", "correct final answer is")

_SPAN = re.compile(r"[0-9()+\-*/ \t]+")
_HAS_OP = re.compile(r"\d\s*[-+*/]\s*[-(\s]*\d")
_OPTION = re.compile(r"^\(([A-J])\) (.+)$", re.MULTILINE)
_TURN = re.compile(r"<\|im_start\|>(system|user|assistant)\n(.*?)(?:<\|im_end\|>|\Z)", re.DOTALL)
_BINARY = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}
_MAX_MAGNITUDE = 10**12  # products of larger values are not arithmetic questions this script answers


def _fraction(node: ast.AST) -> Fraction:
    """The value of an expression tree made only of integers, + - * / and unary minus (anything else raises)."""
    if isinstance(node, ast.Expression):
        return _fraction(node.body)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        return Fraction(node.value)
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        v = _fraction(node.operand)
        return -v if isinstance(node.op, ast.USub) else v
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        left, right = _fraction(node.left), _fraction(node.right)
        if abs(left) > _MAX_MAGNITUDE or abs(right) > _MAX_MAGNITUDE:
            raise ValueError("operands too large")
        return _BINARY[type(node.op)](left, right)  # x / 0 raises ZeroDivisionError
    raise ValueError(f"not plain arithmetic: {type(node).__name__}")


def _format(v: Fraction) -> str:
    return str(v.numerator) if v.denominator == 1 else f"{v.numerator}/{v.denominator}"


def arithmetic_problem(text: str) -> tuple[str, str] | None:
    """(expression, exact value) of the first arithmetic expression in `text`, or None.

    >>> arithmetic_problem("Solve the following multiplication: 7 * 8. Give only the result.")
    ('7 * 8', '56')
    >>> arithmetic_problem("State the final answer to the following arithmetic problem: 2 - -1 - 6 =")
    ('2 - -1 - 6', '-3')
    >>> arithmetic_problem("What is 12?") is None
    True
    """
    for m in _SPAN.finditer(text):
        span = m.group().strip()
        if not _HAS_OP.search(span):
            continue
        for candidate in (span, span.strip("()").strip(), span.rstrip("-+*/ ").strip()):
            try:
                value = _fraction(ast.parse(candidate, mode="eval"))
            except (SyntaxError, ValueError, ZeroDivisionError, RecursionError):
                continue
            return " ".join(candidate.split()), _format(value)
    return None


def _uniform(*parts: object) -> float:
    """A uniform in [0, 1) that is a pure function of `parts`."""
    h = hashlib.sha256("\x1f".join(map(str, parts)).encode()).hexdigest()
    return int(h[:13], 16) / 16**13


def base_rate(expression: str) -> float:
    """The solve rate of an open question, from a hash of its expression: one of 0, 1/8, ..., 1."""
    return int(_uniform("scripted-rate", expression) * (EIGHTHS + 1)) / EIGHTHS


def checkpoint_version(path: str) -> int:
    """The policy version of a run checkpoint folder (`.../run_id=<run>/v<N>`); 0 for any other model."""
    p = Path(path)
    m = re.fullmatch(r"v(\d+)", p.name)
    return int(m.group(1)) if m and p.parent.name.startswith("run_id=") else 0


@dataclass(frozen=True)
class Reading:
    """What the script reads from a rendered prompt."""

    question: str  # the last user turn (the whole text when the prompt is not a ChatML chat)
    partial: str  # the assistant's answer so far (MCMC proposals continue it)
    demonstrations: int  # assistant turns before the question (few-shot context)
    lorem: bool  # the system turn is a Lorem-Ipsum passage (LoPE)


def read_prompt(text: str) -> Reading:
    turns = _TURN.findall(text)
    users = [i for i, (role, _) in enumerate(turns) if role == "user"]
    if not users:
        return Reading(text, "", 0, False)
    last = users[-1]
    after = turns[last + 1 :]
    partial = after[0][1] if after and after[0][0] == "assistant" else ""
    demos = sum(role == "assistant" for role, _ in turns[:last])
    system = " ".join(c for role, c in turns if role == "system")
    return Reading(turns[last][1], partial, demos, _is_lorem(system))


def _is_lorem(text: str) -> bool:
    words = re.findall(r"[a-z]+", text.lower())
    vocab = set(LOREM)
    return len(words) >= 20 and sum(w in vocab for w in words) >= 0.9 * len(words)


def solve_rate(reading: Reading, version: int = 0) -> float:
    """The probability that a sample for this prompt is correct (see the module docstring)."""
    problem = arithmetic_problem(reading.question)
    if problem is None:
        return 0.0
    q = reading.question
    eighths = round(base_rate(problem[0]) * EIGHTHS)
    options = _OPTION.findall(q)
    if "Options:" in q and options:
        eighths += RATE_BOOST["mcq4" if len(options) <= 4 else "mcq10"]
    if "The answer should look like:" in q:
        eighths += RATE_BOOST["cloze"]
    if "A solution starts like this:" in q:
        eighths += RATE_BOOST["hint"]
    if reading.demonstrations:
        eighths += RATE_BOOST["fewshot"]
    if reading.lorem:
        eighths += RATE_BOOST["lorem"]
    eighths += RATE_BOOST["version"] * version
    if any(m in q for m in _REFERENCE_MARKERS):
        eighths = max(eighths, REFERENCE_RATE)
    return min(EIGHTHS, max(0, eighths)) / EIGHTHS


def _slip(expression: str, value: str, pick: float) -> str:
    """A plausible wrong value: off by one, two or ten, a digit swap, or the wrong operation."""
    try:
        v = int(value)
    except ValueError:
        return str(Fraction(value) + 1)
    nums = [int(x) for x in re.findall(r"\d+", expression)]
    cands = [v + 1, v - 1, v + 2, v - 2, v + 10, v - 10]
    if abs(v) >= 10:
        s = str(abs(v))
        cands.append(int(("-" if v < 0 else "") + s[::-1]))
    if len(nums) >= 2:
        cands += [nums[0] + nums[1], nums[0] * nums[1], nums[0] - nums[1]]
    wrong = [c for c in dict.fromkeys(cands) if c != v]
    return str(wrong[int(pick * len(wrong))])


SOLUTIONS = (
    "{expr} = {value}{which}.\n\\boxed{{{value}}}",
    "We compute {expr} = {value}{which}, so the answer is \\boxed{{{value}}}.",
    "First, {expr} is {value}{which}. Final answer: \\boxed{{{value}}}",
)
CONTINUATIONS = (  # an MCMC proposal continues a partial answer
    " so {expr} = {value}{which}.\n\\boxed{{{value}}}",
    "\nTherefore the answer is {value}{which}: \\boxed{{{value}}}.",
    " which gives {value}{which}. Final answer: \\boxed{{{value}}}",
)


def script(prompt: str, sample: int, n: int, seed: int, temperature: float = 1.0, version: int = 0) -> tuple[str, bool]:
    """(answer text, whether it is meant to be correct) for sample `sample` of `n` for a rendered prompt.

    >>> script("What is 7 * 8?", 0, 1, 0, version=8)  # 8 trained versions: every sample solves
    ('7 * 8 = 56.\\n\\\\boxed{56}', True)
    """
    reading = read_prompt(prompt)
    problem = arithmetic_problem(reading.question)
    if problem is None:
        numbers = re.findall(r"-?\d+", reading.question)
        guess = numbers[-1] if numbers else "0"
        return f"I am not sure how to solve this. My best guess is \\boxed{{{guess}}}.", False
    expr, right = problem
    rate = solve_rate(reading, version)
    u = _uniform("scripted-offset", prompt, seed)
    solved = rate >= 0.5 if temperature == 0 else (u + sample / n) % 1.0 < rate
    draw = 0 if temperature == 0 else sample
    value, which = right, ""
    options = [(k, o.strip()) for k, o in _OPTION.findall(reading.question)]
    if options:  # multiple choice: name the chosen option; a wrong answer is one of the distractors
        pool = [(k, o) for k, o in options if (o == right) == solved]
        if pool:
            letter, value = pool[int(_uniform("scripted-option", prompt, seed, draw) * len(pool))]
            which = f", which is option ({letter})"
    if not solved and not which:
        value = _slip(expr, right, _uniform("scripted-slip", prompt, seed, draw))
    templates = CONTINUATIONS if reading.partial.strip() else SOLUTIONS
    style = int(_uniform("scripted-style", prompt, seed, draw) * len(templates))
    return templates[style].format(expr=expr, value=value, which=which), solved


class ScriptedBackend(TransformersBackend):
    """Scripted answers (`script`), scored token by token by the wrapped transformers model."""

    generate_from_states = None  # proposals come from the script: MCMC keeps no states for it (tasks/core/mcmc.py)
    stream_from_states = None

    def __init__(self, model_path: str, device: str = "cpu", dtype: str = "auto", batch_size: int = 32,
                 version: int | None = None, **kw):
        super().__init__(model_path, device=device, dtype=dtype, batch_size=batch_size, **kw)
        self.name = f"scripted:{model_identity(model_path)}"  # the same wherever the weights are (models/cache.py)
        self.policy_version = checkpoint_version(model_path) if version is None else version

    def generate(self, prompts: list[str], n: int, sampling: Sampling,
                 progress: Callable[[int], None] | None = None,
                 row_seeds: list[int] | None = None) -> list[list[Completion]]:
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if row_seeds is not None and len(row_seeds) != len(prompts):
            raise ValueError("row_seeds needs one seed per prompt")
        seeds = row_seeds if row_seeds is not None else [sampling.seed] * len(prompts)
        texts = [[script(p, j, n, sd, sampling.temperature, self.policy_version)[0] for j in range(n)]
                 for p, sd in zip(prompts, seeds)]
        return self._completions(self.encode(prompts), texts, sampling, progress)

    def generate_ids(self, ids: list[list[int]], n: int, sampling: Sampling,
                     progress: Callable[[int], None] | None = None,
                     row_seeds: list[int] | None = None) -> list[list[Completion]]:
        """`generate` on token ids; with `row_seeds`, row i draws from its own seed alone (as the
        transformers backend does), so an MCMC chain is the same batched or alone."""
        if n < 1:
            raise ValueError(f"n must be >= 1, got {n}")
        if row_seeds is not None and len(row_seeds) != len(ids):
            raise ValueError("row_seeds needs one seed per prompt")
        prompts = self.tokenizer.batch_decode(ids, skip_special_tokens=False)
        seeds = row_seeds if row_seeds is not None else [sampling.seed] * len(ids)
        texts = [[script(p, j, n, s, sampling.temperature, self.policy_version)[0] for j in range(n)]
                 for p, s in zip(prompts, seeds)]
        return self._completions(ids, texts, sampling, progress)

    def generate_and_score_ids(self, ids, after, sampling, row_seeds=None):  # the script's, not the model's, samples
        return self.generate_ids(ids, 1, sampling, row_seeds=row_seeds), self.score_ids(ids, after)

    def _completions(self, prompt_ids: list[list[int]], texts: list[list[str]], sampling: Sampling,
                     progress: Callable[[int], None] | None) -> list[list[Completion]]:
        max_new_tokens = sampling.max_new_tokens
        full = [self.encode(group) if group else [] for group in texts]
        flat_p = [p for p, group in zip(prompt_ids, full) for _ in group]
        end = self.eos_ids[0]  # a complete answer stops on it, reported with its log-prob as the model's would be
        flat_c = [c[:max_new_tokens] + [end] * (len(c) <= max_new_tokens) for group in full for c in group]
        # at the sampling temperature, as the transformers backend's generate reports them (models/backend.py)
        scored = iter(self.score_ids(flat_p, flat_c, temperature=sampling.temperature) if flat_c else [])
        out = []
        for group in full:
            row = []
            for c in group:
                toks, lps, stop = c[:max_new_tokens], next(scored), len(c) <= max_new_tokens
                row.append(Completion(self.tokenizer.decode(toks, skip_special_tokens=True), toks, lps[: len(toks)],
                                      "stop" if stop else "length", end if stop else None, lps[-1] if stop else None))
            out.append(row)
            if progress:
                progress(len(row))
        return out
