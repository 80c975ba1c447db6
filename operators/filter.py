"""Filter: decide which rows are not trained, and say why (Ray Data task, Arrow in and out).

Rows are never dropped from the stream here: they get a `filter_reason` and the train step skips
them, so every generated trajectory is accounted for (trained, or counted under its reason).

- `reward_error` (set by the reward stage): the reward function failed on the row;
- `nonfinite`: NaN/inf in a log-prob column — quarantined, never trained on;
- `zero_variance`: the whole group got the same reward, so every advantage is zero;
- `no_loss_tokens`: nothing the policy produced is in the loss.
Over-stale tokens are handled at the train step, which knows the trainer's version.
"""

from __future__ import annotations

import numpy as np
import pyarrow as pa

from trajflow.algorithms.advantages import zero_variance_groups
from trajflow.schemas import nonfinite_rows
from trajflow.schemas.columns import group_codes, list_values, mark_filtered


class Filter:
    def __init__(self, drop_zero_variance_groups: bool) -> None:
        self.drop_zero_variance_groups = drop_zero_variance_groups

    def __call__(self, batch: pa.Table) -> pa.Table:
        batch = mark_filtered(batch, nonfinite_rows(batch), "nonfinite")
        if self.drop_zero_variance_groups:
            rewards = batch["reward"].to_numpy(zero_copy_only=False).astype(np.float64)
            scored = np.isfinite(rewards)  # rows whose reward failed already carry reward_error
            constant = np.zeros(len(rewards), bool)
            constant[scored] = zero_variance_groups(rewards[scored], group_codes(batch)[scored])
            batch = mark_filtered(batch, constant, "zero_variance")
        mask, offsets = list_values(batch["loss_mask"])
        loss_tokens = np.add.reduceat(mask.astype(np.int64), offsets[:-1]) if len(mask) else np.zeros(0)
        lengths = np.diff(offsets)
        loss_tokens = np.where(lengths > 0, loss_tokens, 0)  # reduceat repeats values for empty rows
        return mark_filtered(batch, loss_tokens == 0, "no_loss_tokens")
