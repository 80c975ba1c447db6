"""M2PO's second-moment mask, hand-computed (algorithms/m2po.py)."""

import math

import pytest
import torch

from trajflow.algorithms import m2_cutoff, m2po_mask


def test_cutoff_masks_the_largest_until_the_mean_is_below_tau():
    # squared log-ratios 4, 1, 0.25, 0.01, 0: mean 5.26/5 = 1.052 > 0.5; without the 4: 1.26/4 = 0.315
    squared = torch.tensor([0.25, 4.0, 0.0, 1.0, 0.01])
    assert m2_cutoff(squared, 0.5) == 4.0                  # keep values < 4
    # tau 0.3: without 4 -> 0.315 > 0.3; without 4 and 1 -> 0.26/3 = 0.0867 <= 0.3
    assert m2_cutoff(squared, 0.3) == 1.0
    assert m2_cutoff(squared, 2.0) == math.inf             # 1.052 <= 2: nothing masked
    assert m2_cutoff(torch.tensor([]), 0.04) == math.inf
    assert m2_cutoff(torch.tensor([3.0, 2.0]), 1.0) == 2.0  # every value > tau: all masked
    with pytest.raises(ValueError, match="tau"):
        m2_cutoff(squared, -1.0)


def test_ties_at_the_cutoff_are_all_masked():
    # 1, 1, 0.1, 0.1 at tau 0.5: dropping one 1 gives 1.2/3 = 0.4, but the cutoff is a value, so both
    # 1s go (0.2/2 = 0.1): the mask does not depend on token order, and workers applying one global
    # cutoff to their own tokens reproduce the single-process mask
    assert m2_cutoff(torch.tensor([1.0, 0.1, 1.0, 0.1]), 0.5) == 1.0


def test_mask_on_a_batch_by_hand():
    # log r = log pi_theta - log mu on 2 sequences; the padded position (mask false) is ignored
    log_ratio = torch.tensor([[2.0, 0.1, -0.5], [-1.0, 0.0, 7.0]])
    loss_mask = torch.tensor([[True, True, True], [True, True, False]])
    m = m2po_mask(log_ratio, loss_mask, tau=0.5)
    # squared over loss tokens: 4, 0.01, 0.25, 1, 0 -> mean 1.052; masking 4 leaves 0.315 <= 0.5
    assert m.keep.tolist() == [[False, True, True], [True, True, False]]
    assert m.m2_before == pytest.approx(5.26 / 5) and m.m2_after == pytest.approx(1.26 / 4)
    assert (m.loss_tokens, m.masked_tokens) == (5, 1)


def test_global_cutoff_from_gathered_values_equals_one_process():
    # data-parallel use: each worker holds half the batch; the cutoff of the gathered values
    # applied locally gives the single-process mask
    torch.manual_seed(0)
    log_ratio = torch.randn(8, 5) * 0.4
    loss_mask = torch.rand(8, 5) > 0.2
    whole = m2po_mask(log_ratio, loss_mask, tau=0.04)
    squared = log_ratio.double() ** 2  # as m2po_mask computes them
    workers = [(squared[:4], loss_mask[:4]), (squared[4:], loss_mask[4:])]
    bound = m2_cutoff(torch.cat([sq[mask] for sq, mask in workers]), 0.04)  # all_gather, then once
    local = torch.cat([mask & (sq < bound) for sq, mask in workers])
    assert torch.equal(local, whole.keep) and 0 < whole.masked_tokens < whole.loss_tokens
    assert whole.m2_after <= 0.04 < whole.m2_before
