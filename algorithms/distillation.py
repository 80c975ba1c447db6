r"""On-policy distillation: a teacher's log-probs on the student's own tokens, as terms of the
decoupled objective (`distill:`; the teacher scores in operators/teacher.py).

Reverse KL per sampled token. On tokens x_t the student sampled, with s_t = log pi_student(x_t)
and T_t = log pi_teacher(x_t), the per-token reverse KL KL(pi_theta || pi_teacher) is estimated by
s_t - T_t, and its gradient on-policy is E_x[(log pi_theta(x) - T(x)) grad log pi_theta(x)]. So
the distillation's advantage of token t is

    A_t = - reverse_kl_coef (s_t - T_t)   (+ task_advantage_coef x the task's advantage)

detached, and it enters the policy term J(r_s, A) of the decoupled objective like any advantage:
the r_d mask, the PPO clip on r_s, TIS and every strategy's pi_old apply to it unchanged (a
distillation run replays under any correction). Which student gives s_t
(`reverse_kl_student`) is the point of AsyncOPD (arXiv 2606.24143): with stale rollouts

    current   s_t = log pi_theta(x_t), recomputed in the update: the gradient above (its IS ratio
              r_s from the strategy), the student's entropy included. AsyncOPD's correction.
    old       s_t = the strategy's pi_old(x_t), the student that generated the rollout (what a
              teacher-minus-student score cached at generation time holds). With staleness the
              advantage no longer measures the current student: the update follows
              grad E[log pi_theta (T - log pi_old)], which drops the current student's entropy
              term and is biased; on-policy (pi_old = pi_theta) the two agree.

Forward KL on the top-k support. With the sampler's K ids S of token t and the teacher's and the
current student's log-probs on them, KL(pi_teacher || pi_theta) on S plus the tail bucket
(algorithms/distributions.py `support_kl`), times forward_kl_coef, is added to the loss with the
objective's token weights: a supervised term whose gradient is
pi_theta(j) - pi_teacher(j) [j in S] - pi_teacher(tail) pi_theta(j) / pi_theta(tail) [j not in S]
per logit j. It needs no IS ratio: stale positions only change where it is evaluated (AsyncOPD:
forward KL tolerates stale rollouts).
"""

from __future__ import annotations

import torch
from torch import Tensor

from trajflow.settings import check_number

from .distributions import support_kl, support_mass
from .masked import masked_mean


def reverse_kl_advantages(student: Tensor, teacher: Tensor, coef: float) -> Tensor:
    """[B, T] detached: -coef (student - teacher) per sampled token (0 where either is not finite:
    such a token is out of the loss anyway)."""
    check_number("reverse_kl_advantages", coef=coef)
    finite = torch.isfinite(student) & torch.isfinite(teacher)
    diff = torch.where(finite, student.detach(), 0.0) - torch.where(finite, teacher.detach(), 0.0)
    return (-coef * diff).detach()


def distillation_advantages(student: Tensor, teacher: Tensor, task: Tensor, reverse_kl_coef: float,
                            task_advantage_coef: float) -> Tensor:
    """Per-token advantages [B, T]: the reverse-KL advantage plus task_advantage_coef x the task's
    advantages (`task` [B] or [B, T])."""
    check_number("distillation_advantages", reverse_kl_coef=reverse_kl_coef,
                 task_advantage_coef=task_advantage_coef)
    advantages = reverse_kl_advantages(student, teacher, reverse_kl_coef)
    if task_advantage_coef:
        task = task[:, None] if task.dim() == 1 else task
        advantages = advantages + task_advantage_coef * task.to(advantages.dtype)
    return advantages


def forward_kl_tokens(teacher_top_k: Tensor, current_top_k: Tensor) -> Tensor:
    """KL(pi_teacher || pi_theta) [B, T] on the support [B, T, K] plus the tail bucket;
    differentiable in the student's `current_top_k` (the teacher's is a constant)."""
    return support_kl(teacher_top_k.detach(), current_top_k)


def distillation_diagnostics(inference: Tensor, teacher: Tensor, sampler_top_k: Tensor | None,
                             teacher_top_k: Tensor | None, loss_mask: Tensor) -> dict[str, float]:
    """How far the student that sampled (mu: `inference`, its sampled-token log-probs [B, T]) is
    from the teacher (`teacher` [B, T]), over the loss tokens:

        distill/reverse_kl   mean of log mu(x_t) - log pi_teacher(x_t): an unbiased estimate of
                             KL(mu || pi_teacher) per token on mu's own samples
        distill/forward_kl   mean KL(pi_teacher || mu) on the top-k support plus the tail (K > 0)
        distill/teacher_support_mass   the teacher's mass on the sampler's K ids (mean)"""
    m = loss_mask & torch.isfinite(teacher)
    out = {"distill/reverse_kl": float(masked_mean((inference - torch.where(m, teacher, 0.0)).double(), m))}
    if sampler_top_k is not None and teacher_top_k is not None:
        out["distill/forward_kl"] = float(masked_mean(support_kl(teacher_top_k.double(), sampler_top_k.double()), m))
        out["distill/teacher_support_mass"] = float(masked_mean(support_mass(teacher_top_k.double()), m))
    return out
