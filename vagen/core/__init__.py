"""StarPO / TRICO algorithms as pure functions over tensors (imports torch only).

All tensors are [B, L] (B sequences, L tokens) unless a docstring says otherwise.
"""

from vagen.core.advantages import (
    GIGPO_NORMS,
    compact_index,
    gae,
    gigpo_advantages,
    grpo_advantages,
    masked_whiten,
    turn_level_gae,
)
from vagen.core.losses import (
    AGG_MODES,
    aggregate_loss,
    entropy_from_logits,
    kl_penalty,
    logprobs_from_logits,
    loss_denominator,
    ppo_policy_loss,
    value_loss,
)
from vagen.core.monitor import CollapseMonitor, collapse_indicators, distinct_n, echo_rate
from vagen.core.selection import (
    FILTER_MODES,
    SELECT_MODES,
    filter_groups_by_reward_std,
    select_critical_tokens,
)

__all__ = [
    "AGG_MODES",
    "FILTER_MODES",
    "GIGPO_NORMS",
    "SELECT_MODES",
    "CollapseMonitor",
    "aggregate_loss",
    "collapse_indicators",
    "compact_index",
    "distinct_n",
    "echo_rate",
    "entropy_from_logits",
    "filter_groups_by_reward_std",
    "gae",
    "gigpo_advantages",
    "grpo_advantages",
    "kl_penalty",
    "logprobs_from_logits",
    "loss_denominator",
    "masked_whiten",
    "ppo_policy_loss",
    "select_critical_tokens",
    "turn_level_gae",
    "value_loss",
]
