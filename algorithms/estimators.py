"""The advantage estimators behind one registry (trajflow/registry.py): `advantage: {estimator: NAME,
<keys>}` names one, built-in, registered (`@ESTIMATORS.register("name")`) or by import path
(module:Class / path/to/file.py:Class). Torch-free at import (AdvantageConfig checks its estimator
while a job config is validated); the math is algorithms/advantages.py's, imported when used.

An estimator declares what the config asks of it, once:

    keys            the `advantage:` keys it reads beyond the shared ones (the overlong shaping);
                    another estimator's key set away from its default is refused
    min_group_size  the smallest group_size that trains (a group-relative baseline needs 2)
    needs_values    its advantages are per token from a critic's values (GAE): the pipeline's GAE
                    path computes them (operators/advantage.py `gae_columns`), not `compute_advantages`

and computes one advantage per row in `advantages` (rewards already shaped); an estimator with
per-token advantages from rewards alone (REINFORCE++ with gamma < 1) also `token_advantages`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

from trajflow.registry import Registry

if TYPE_CHECKING:
    from trajflow.algorithms.config import AdvantageConfig


class AdvantageEstimator:
    """An advantage estimator (see the module docstring); stateless, built per call."""

    name: ClassVar[str]
    keys: ClassVar[tuple[str, ...]] = ()
    min_group_size: ClassVar[int] = 1
    needs_values: ClassVar[bool] = False

    def advantages(self, config: AdvantageConfig, rewards: Any, group_ids: Any, *,
                   token_counts: Any = None) -> Any:
        """One advantage per row [N] (float32, numpy or torch as `rewards`) from the shaped rewards
        [N], the group labels [N] and, when given, each row's loss tokens [N]."""
        raise NotImplementedError(f"advantage estimator {self.name!r} does not define advantages()")

    def token_advantages(self, config: AdvantageConfig, rewards: Any, loss_mask: Any) -> Any:
        """Per-token advantages [N, T] float32 from the shaped rewards [N] and the loss mask [N, T]
        (asked for when `config.gamma` < 1)."""
        raise ValueError(f"advantage estimator {self.name} gives one advantage per row, not one per token")


def _check_keys(cls: type[AdvantageEstimator]) -> None:
    from trajflow.algorithms.config import ESTIMATOR_KEYS

    if getattr(cls, "Settings", None) is not None:
        raise ValueError("an estimator reads keys of the advantage: section (declare them in `keys`), not Settings")
    unknown = sorted(set(cls.keys) - set(ESTIMATOR_KEYS))
    if unknown:
        raise ValueError(f"keys {', '.join(unknown)} are not keys of advantage: ({', '.join(ESTIMATOR_KEYS)})")
    if not isinstance(cls.min_group_size, int) or isinstance(cls.min_group_size, bool) or cls.min_group_size < 1:
        raise ValueError(f"min_group_size must be an integer >= 1, got {cls.min_group_size!r}")


ESTIMATORS: Registry[AdvantageEstimator] = Registry(
    "advantage estimator", AdvantageEstimator, ("trajflow.algorithms.estimators",), key="advantage.estimator",
    check=_check_keys)


@ESTIMATORS.register("grpo")
class Grpo(AdvantageEstimator):
    """GRPO: (r - group mean) / (group std + eps); the std per `advantage.std`."""

    keys = ("std",)
    min_group_size = 2

    def advantages(self, config: AdvantageConfig, rewards: Any, group_ids: Any, *, token_counts: Any = None) -> Any:
        from trajflow.algorithms.advantages import grpo

        return grpo(rewards, group_ids, std=config.std)


@ESTIMATORS.register("dr_grpo")
class DrGrpo(AdvantageEstimator):
    """Dr.GRPO: r - group mean (no std division: no per-prompt difficulty reweighting)."""

    min_group_size = 2

    def advantages(self, config: AdvantageConfig, rewards: Any, group_ids: Any, *, token_counts: Any = None) -> Any:
        from trajflow.algorithms.advantages import dr_grpo

        return dr_grpo(rewards, group_ids)


@ESTIMATORS.register("leave_one_out")
class LeaveOneOut(AdvantageEstimator):
    """RLOO: r - the mean of the other rewards of its group."""

    min_group_size = 2

    def advantages(self, config: AdvantageConfig, rewards: Any, group_ids: Any, *, token_counts: Any = None) -> Any:
        from trajflow.algorithms.advantages import leave_one_out

        return leave_one_out(rewards, group_ids)


@ESTIMATORS.register("reinforce_plus_plus")
class ReinforcePlusPlus(AdvantageEstimator):
    """REINFORCE++: r whitened over the batch (each row weighted by its loss tokens, as veRL); with
    gamma < 1 every token its own discounted advantage (algorithms/discounted.py)."""

    keys = ("gamma",)

    def advantages(self, config: AdvantageConfig, rewards: Any, group_ids: Any, *, token_counts: Any = None) -> Any:
        from trajflow.algorithms.advantages import reinforce_plus_plus

        return reinforce_plus_plus(rewards, group_ids, token_counts=token_counts)

    def token_advantages(self, config: AdvantageConfig, rewards: Any, loss_mask: Any) -> Any:
        from trajflow.algorithms.discounted import reinforce_plus_plus_discounted

        return reinforce_plus_plus_discounted(rewards, loss_mask, config.gamma)


@ESTIMATORS.register("reinforce_plus_plus_baseline")
class ReinforcePlusPlusBaseline(AdvantageEstimator):
    """REINFORCE++-baseline: r - group mean, then whitened over the batch."""

    min_group_size = 2

    def advantages(self, config: AdvantageConfig, rewards: Any, group_ids: Any, *, token_counts: Any = None) -> Any:
        from trajflow.algorithms.advantages import reinforce_plus_plus_baseline

        return reinforce_plus_plus_baseline(rewards, group_ids, token_counts=token_counts)


@ESTIMATORS.register("gae")
class Gae(AdvantageEstimator):
    """GAE: per-token advantages on a learned critic's values (needs `critic:`; algorithms/gae.py)."""

    keys = ("gamma", "lam", "whiten")
    needs_values = True
