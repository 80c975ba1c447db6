"""`snapshot` (exact): score each token with the stored weights of its own version.

The policy store keeps the weights of every version still inside the staleness window (at most
max_staleness + 1 copies); the old log-prob operator runs right before the train step, after the
filter, so rows that will not be trained are never scored.
"""

from __future__ import annotations

from trajflow.operators.contracts.stage import Placement
from trajflow.operators.strategies.base import OldLogprobsColumn, StageContext, old_logprob_stage
from trajflow.operators.strategies.registry import STRATEGIES


@STRATEGIES.register("snapshot")
class Snapshot(OldLogprobsColumn):
    kind = "exact"
    meaning = "score each token with the stored weights of its own version (policy-store snapshots)"
    keep_history = True

    def stages(self, ctx: StageContext) -> list[Placement]:
        return [Placement(old_logprob_stage(ctx, skip_filtered=True), before="train")]
