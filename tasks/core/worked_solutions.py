"""Worked reference solutions for reasoning-gym arithmetic prompts, written from the item's own metadata.

A prompt with a reference solution can be refined by `hint_prefix` (tasks/strategies/hint.py shows its first
words) and is shaped from it (tasks/shape.py starts MCMC from it, origin "reference") instead of from a teacher
or the policy's own trace (issue 50, item 3). Reasoning-gym items carry no solution, but the arithmetic tasks
carry their expression in `metadata["expression"]`, so one can be written exactly.

Method, and its choices:
- The expression is parsed (integers, + - * /, unary minus, parentheses; never `eval`) and evaluated in the
  usual order, innermost and leftmost first. Each binary operation is one step, written the way a person does it
  on paper, in the style the policy is prompted for (steps, then `\\boxed{answer}`):
  - a product of two one-digit numbers is a table fact: `7 × 8 = 56`;
  - otherwise one factor is split by place value, as in long multiplication: the one with fewer non-zero
    digits (the second on a tie), unless it has only one: `23 × 45 = 23 × 40 + 23 × 5 = 920 + 115 = 1035`,
    `45 × 7 = 40 × 7 + 5 × 7 = 280 + 35 = 315`; a negative factor is multiplied as its absolute value and the
    sign stated after;
  - a sum or difference adds a negative term as a subtraction (`5 + -3 = 5 - 3`), turns a smaller minus a
    larger number round (`5 - 9 = -(9 - 5) = -4`: the results below zero are where the small policy slips), and
    takes the second term a place value at a time when it has more than one non-zero digit:
    `57 + 87 = 57 + 80 + 7 = 137 + 7 = 144`;
  - a quotient is written only when it is exact (`84 / 4 = 21`); reasoning-gym's `/` is floor division, and a
    floored step is not something a worked solution should show, so such an item gets no solution.
- Nothing is guessed: the computed value must equal the item's answer (as an integer) or the writer returns
  None, and a task without a writer gets None. A wrong solution would teach the shaping SFT term a wrong trace
  and leak a wrong start through hint prefixes; no solution only means those two parts skip the prompt.
- Tasks: `products`, `basic_arithmetic` and `chain_sum` (the default pool's and the evidence pools'), and
  `gcd` / `lcm` of two numbers (Euclid's algorithm on the item's `metadata["numbers"]`), which cost a few lines.
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
from collections.abc import Callable
from typing import Any

Node = tuple  # ("num", int) | ("neg", Node) | (op, Node, Node)
_TOKEN = re.compile(r"\s*(?:(\d+)|([-+*/()]))")
_MAX_TOKENS = 400  # longer expressions are not prompts a worked solution helps with (and bound the recursion)


class NoSolution(ValueError):
    """The item cannot be given an exact worked solution (an unknown token, an inexact division, ...)."""


def _tokens(expression: str) -> list[str]:
    out, pos, text = [], 0, expression.rstrip()
    while pos < len(text):
        m = _TOKEN.match(text, pos)
        if not m:
            raise NoSolution(f"unexpected text at {text[pos:pos + 10]!r}")
        out.append(m.group(1) or m.group(2))
        pos = m.end()
    if not out or len(out) > _MAX_TOKENS:
        raise NoSolution("empty or too long")
    return out


def parse(expression: str) -> Node:
    """The expression tree of `expression` (+ - left-associative below * /, unary minus binding tightest).

    >>> parse("2 - -1 * 3")
    ('-', ('num', 2), ('*', ('num', -1), ('num', 3)))
    """
    toks, i = _tokens(expression), 0

    def peek() -> str | None:
        return toks[i] if i < len(toks) else None

    def take() -> str:
        nonlocal i
        if i >= len(toks):
            raise NoSolution("the expression ends early")
        i += 1
        return toks[i - 1]

    def expr() -> Node:
        node = term()
        while peek() in ("+", "-"):
            op = take()
            node = (op, node, term())
        return node

    def term() -> Node:
        node = unary()
        while peek() in ("*", "/"):
            op = take()
            node = (op, node, unary())
        return node

    def unary() -> Node:
        if peek() == "-":
            take()
            inner = unary()
            return ("num", -inner[1]) if inner[0] == "num" else ("neg", inner)
        tok = take()
        if tok.isdigit():
            return ("num", int(tok))
        if tok == "(":
            node = expr()
            if take() != ")":
                raise NoSolution("unbalanced parenthesis")
            return node
        raise NoSolution(f"unexpected {tok!r}")

    tree = expr()
    if i != len(toks):
        raise NoSolution(f"unexpected {toks[i]!r}")
    return tree


def place_parts(n: int) -> list[int]:
    """The non-zero place values of n >= 0, largest first.

    >>> place_parts(1045), place_parts(7), place_parts(0)
    ([1000, 40, 5], [7], [0])
    """
    s = str(n)
    parts = [int(d) * 10 ** (len(s) - k - 1) for k, d in enumerate(s) if d != "0"]
    return parts or [0]


def product_step(a: int, b: int) -> str:
    """One multiplication, split by place value where it is more than a table fact.

    >>> product_step(23, 45)
    '23 × 45 = 23 × 40 + 23 × 5 = 920 + 115 = 1035'
    >>> product_step(45, 7)
    '45 × 7 = 40 × 7 + 5 × 7 = 280 + 35 = 315'
    >>> product_step(-7, 12)
    '7 × 12 = 7 × 10 + 7 × 2 = 70 + 14 = 84, so -7 × 12 = -84'
    """
    if a < 0 or b < 0:
        return f"{product_step(abs(a), abs(b))}, so {a} × {b} = {a * b}"
    pa, pb = place_parts(a), place_parts(b)
    if (a < 10 and b < 10) or max(len(pa), len(pb)) == 1:
        return f"{a} × {b} = {a * b}"
    if len(pb) == 1 or 1 < len(pa) < len(pb):  # split the first factor: 45 × 7 = 40 × 7 + 5 × 7
        terms, values = [f"{p} × {b}" for p in pa], [p * b for p in pa]
    else:
        terms, values = [f"{a} × {p}" for p in pb], [a * p for p in pb]
    return " = ".join([f"{a} × {b}", " + ".join(terms), " + ".join(map(str, values)), str(a * b)])


def sum_step(a: int, op: str, b: int) -> str:
    """One addition or subtraction, the second term taken a place value at a time.

    >>> sum_step(57, "+", 87)
    '57 + 87 = 57 + 80 + 7 = 137 + 7 = 144'
    >>> sum_step(17, "-", 73)
    '17 - 73 = -(73 - 17) = -(73 - 10 - 7) = -(63 - 7) = -56'
    >>> sum_step(-53, "-", 3)
    '-53 - 3 = -56'
    >>> sum_step(2, "-", -1)
    '2 - -1 = 2 + 1 = 3'
    """
    chain = [f"{a} {op} {b}"]
    if b < 0:  # adding a negative is subtracting, and the other way round
        op, b = ("-" if op == "+" else "+"), -b
        chain.append(f"{a} {op} {b}")
    if op == "-" and 0 <= a < b:  # a smaller minus a larger: the difference the other way round, negated
        inner = sum_step(b, "-", a).split(" = ")
        return " = ".join(chain + [f"-({x})" for x in inner[:-1]] + [str(a - b)])
    sign = 1 if op == "+" else -1
    parts = place_parts(b)
    if len(parts) > 1:
        acc = a
        chain.append(" ".join([str(a)] + [f"{op} {p}" for p in parts]))
        for k, p in enumerate(parts[:-1]):
            acc += sign * p
            chain.append(" ".join([str(acc)] + [f"{op} {q}" for q in parts[k + 1:]]))
    chain.append(str(a + sign * b))
    return " = ".join(chain)


def _evaluate(node: Node, steps: list[str]) -> int:
    kind = node[0]
    if kind == "num":
        return node[1]
    if kind == "neg":
        v = _evaluate(node[1], steps)
        steps.append(f"-({v}) = {-v}")
        return -v
    a, b = _evaluate(node[1], steps), _evaluate(node[2], steps)
    if kind == "*":
        steps.append(product_step(a, b))
        return a * b
    if kind == "/":
        if b == 0 or a % b:
            raise NoSolution(f"{a} / {b} is not exact")
        steps.append(f"{a} / {b} = {a // b}, since {a // b} × {b} = {a}")
        return a // b
    steps.append(sum_step(a, kind, b))
    return a + b if kind == "+" else a - b


def value_of(expression: str) -> int:
    """The exact integer value of `expression` (NoSolution where it has none: an inexact division, a bad token).

    >>> value_of("42 * 5"), value_of("7 - 9 + 3")
    (210, 1)
    """
    try:
        return _evaluate(parse(expression), [])
    except RecursionError:
        raise NoSolution("too deeply nested") from None


def arithmetic_solution(expression: str, answer: str) -> str | None:
    """The worked solution of `expression` ending in `\\boxed{answer}`, or None when its value is not `answer`.

    >>> arithmetic_solution("42 - 25 - 73", "-56")
    '42 - 25 = 42 - 20 - 5 = 22 - 5 = 17. 17 - 73 = -(73 - 17) = -(73 - 10 - 7) = -(63 - 7) = -56. \\\\boxed{-56}'
    >>> arithmetic_solution("4 * 1", "5") is None
    True
    """
    steps: list[str] = []
    try:
        value = _evaluate(parse(expression), steps)
        expected = int(answer.strip())
    except (NoSolution, ValueError, RecursionError):
        return None
    if value != expected or not steps:
        return None
    return " ".join(s + "." for s in steps) + f" \\boxed{{{answer.strip()}}}"


def euclid_solution(a: int, b: int, task: str, answer: str) -> str | None:
    """gcd (or lcm = a × b / gcd) of two positive integers by Euclid's algorithm, or None if it is not `answer`.

    >>> euclid_solution(4, 6, "lcm", "12")
    'gcd(4, 6): 6 = 1 × 4 + 2. 4 = 2 × 2 + 0. So gcd(4, 6) = 2. lcm(4, 6) = 4 × 6 / 2 = 24 / 2 = 12. \\\\boxed{12}'
    """
    if a < 1 or b < 1:
        return None
    x, y = max(a, b), min(a, b)
    steps = []
    while y:
        steps.append(f"{x} = {x // y} × {y} + {x % y}")
        x, y = y, x % y
    g = x
    text = f"gcd({a}, {b}): " + ". ".join(steps) + f". So gcd({a}, {b}) = {g}."
    value = g
    if task == "lcm":
        value = a * b // g
        text += f" lcm({a}, {b}) = {a} × {b} / {g} = {a * b} / {g} = {value}."
    if str(value) != answer.strip() or value != (math.gcd(a, b) if task == "gcd" else math.lcm(a, b)):
        return None
    return f"{text} \\boxed{{{value}}}"


def _arithmetic(question: str, answer: str, meta: dict) -> str | None:
    expression = meta.get("expression")
    return arithmetic_solution(expression, answer) if isinstance(expression, str) else None


def _euclid(task: str) -> Callable[[str, str, dict], str | None]:
    def write(question: str, answer: str, meta: dict) -> str | None:
        nums = meta.get("numbers")  # two numbers only: a gcd of several would need a fold
        if not (isinstance(nums, list) and len(nums) == 2 and all(type(n) is int for n in nums)):
            return None
        return euclid_solution(nums[0], nums[1], task, answer)
    return write


WRITERS: dict[str, Callable[[str, str, dict], str | None]] = {
    "products": _arithmetic, "basic_arithmetic": _arithmetic, "chain_sum": _arithmetic,
    "gcd": _euclid("gcd"), "lcm": _euclid("lcm"),
}


def worked_solution(task: str, question: str, answer: str, meta: dict | str | None) -> str | None:
    """The worked solution of reasoning-gym item (`question`, `answer`, `meta`: its metadata, as a dict or its
    JSON) of task `task`, or None where this module has no writer for the task or cannot write an exact one."""
    writer = WRITERS.get(task)
    if writer is None:
        return None
    if isinstance(meta, str):
        try:
            meta = json.loads(meta)
        except ValueError:
            return None
    return writer(question, str(answer), meta if isinstance(meta, dict) else {})


def with_solutions(task: str, rows: list[Any]) -> list[Any]:
    """`rows` (SourceRows of task `task`, meta as JSON) with their worked solutions attached where one exists."""
    return [dataclasses.replace(r, solution=worked_solution(task, r.text, r.answer, r.meta)) for r in rows]
