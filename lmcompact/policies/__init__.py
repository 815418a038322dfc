"""Compaction policies: one module each, looked up by name through the registry."""

from lmcompact.policies.base import (
    Budget,
    CompactionInputs,
    CompactionPolicy,
    LayerObservation,
    Need,
    Phase,
    ScorePolicy,
    plan_from_scores,
    topk_keep,
)
from lmcompact.policies.registry import (
    ENTRY_POINT_GROUP,
    available_policies,
    get_policy_class,
    make_policy,
    register_policy,
)

__all__ = [
    "ENTRY_POINT_GROUP",
    "Budget",
    "CompactionInputs",
    "CompactionPolicy",
    "LayerObservation",
    "Need",
    "Phase",
    "ScorePolicy",
    "available_policies",
    "get_policy_class",
    "make_policy",
    "plan_from_scores",
    "register_policy",
    "topk_keep",
]
