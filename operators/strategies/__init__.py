"""Correction strategies: one file each, a base class and a registry.

    from trajflow.operators.strategies import Strategy, STRATEGIES, resolve_strategy, BUILTIN

See base.py for what a strategy declares and registry.py for user strategies by import path.
"""

from trajflow.operators.strategies.base import (
    KINDS,
    OldLogprobsColumn,
    StageContext,
    Strategy,
    StrategyKind,
    Trainer,
    old_logprob_stage,
)
from trajflow.operators.strategies.registry import (
    BUILTIN,
    STRATEGIES,
    format_strategies,
    resolve_strategy,
    strategy_class,
    strategy_names,
)

__all__ = [
    "BUILTIN", "KINDS", "STRATEGIES", "OldLogprobsColumn", "StageContext", "Strategy", "StrategyKind", "Trainer",
    "format_strategies", "old_logprob_stage", "resolve_strategy", "strategy_class", "strategy_names",
]
