"""`interrupt` (exact): at each weight publish, score in-flight prefixes, then resume.

Generation takes new weights between decode steps; before it does, it scores every token sampled
under the still-resident version with training numerics (operators/generate.py), so a trajectory
may span versions and carries exact old log-probs per token. No history is kept. In a replay
(no generator) the same values come from the old log-prob operator (`replay_stages`).
"""

from __future__ import annotations

from typing import Any

from trajflow.operators.strategies.base import OldLogprobsColumn
from trajflow.operators.strategies.registry import STRATEGIES


@STRATEGIES.register("interrupt")
class Interrupt(OldLogprobsColumn):
    kind = "exact"
    meaning = "at each weight publish, score in-flight prefixes with the still-resident version, then resume"
    scores_at_switch = True

    def check(self, config: Any) -> None:
        if config.num_generators != 1:
            raise ValueError(f"num_generators: the {self.name} strategy needs exactly one generator "
                             f"(it scores prefixes at each weight switch), got {config.num_generators}")
