"""`dedicated` (exact): a separate old log-prob actor follows the rollout engine's versions.

The old log-prob operator sits right after generate on its own actor (its own CPU/GPU share) and
scores each batch as soon as it is generated, overlapping the trainer. The store holds a version
only until its batch is scored, so it switches at most as often as the generator.
"""

from __future__ import annotations

from trajflow.operators.contracts.stage import Placement
from trajflow.operators.strategies.base import OldLogprobsColumn, StageContext, old_logprob_stage
from trajflow.operators.strategies.registry import STRATEGIES


@STRATEGIES.register("dedicated")
class Dedicated(OldLogprobsColumn):
    kind = "exact"
    meaning = "a separate old log-prob model follows the rollout versions and scores each batch as it is generated"
    keep_history = True  # until the batch carrying a version is scored

    def stages(self, ctx: StageContext) -> list[Placement]:
        # its own actor and CPU/GPU share, overlapping generation and training
        return [Placement(old_logprob_stage(ctx, skip_filtered=False, own_process=True), after="generate")]
