"""Refinement strategies behind one protocol, and the validity gate beside them (docs/algorithms.md §3).

One file per strategy: ladder.py (the format ladder and its promotion), hint.py (hint_prefix and its
annealing), harden.py, teacher.py (teacher_scaffold); each implements `Strategy` (base.py) and registers
itself with `@register`. gate.py and numbers.py judge children; teacher_calls.py asks the teacher and caches
its answers; ledger.py keeps the round's rows and caps. The refine stage (tasks/refine.py) routes each scored
parent over the enabled strategies.

Every module of this folder is imported here, so a strategy's file registers it without a line anywhere else:
adding a strategy is its file plus its name in `RefineConfig.strategies`' choices (docs/architecture.md).
"""

from __future__ import annotations

import importlib
import pkgutil

from tasks.strategies.base import PROMOTE, REGISTRY, Parent, Proposal, RoundView, Strategy, register, strategy

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["PROMOTE", "REGISTRY", "Parent", "Proposal", "RoundView", "Strategy", "register", "strategy"]
