"""How the harness maps one budget onto every policy.

Most policies take the budget directly. Two have no budget of their own:

- ``duoattention`` keeps every token of its retrieval heads, so the budget is
  met by the fraction of streaming heads: with ``m = min(sink+recent, b*T/2)``
  tokens per streaming head, ``sparsity = (1 - b) / (1 - m / T)`` (clipped to
  [0, 1]); at ``b = 1`` sparsity is 0 (all retrieval heads).
- ``fastgen`` is adaptive; the budget caps every head, and at ``b = 1`` the
  recovery threshold is 1.0 (every head keeps the profile recovering all of
  its attention, i.e. everything).

The measured kept fraction is reported next to every score.
"""

from __future__ import annotations

from typing import Any

from lmcompact.policies.base import CompactionPolicy
from lmcompact.policies.registry import available_policies, make_policy

DUO_SINK, DUO_RECENT = 64, 256


def resolve_policy_names(spec: str | list[str]) -> list[str]:
    """``"all"`` or comma-separated names -> validated list (ValueError lists the allowed)."""
    names = spec.split(",") if isinstance(spec, str) else list(spec)
    names = [n.strip() for n in names if n.strip()]
    known = available_policies()
    if names == ["all"]:
        return known
    bad = [n for n in names if n not in known]
    if bad or not names:
        raise ValueError(f"unknown policies {bad or names}; allowed: all, {', '.join(known)}")
    return names


def policy_params(name: str, budget: float, context: int) -> dict[str, Any]:
    """Hyper-parameters for ``name`` at kept fraction ``budget`` of ``context`` tokens."""
    if not 0.0 < budget <= 1.0:
        raise ValueError(f"budget must be a ratio in (0, 1], got {budget}")
    if name == "none":
        return {}
    if name == "duoattention":
        if budget >= 1.0:
            return {"sparsity": 0.0}
        m = min(DUO_SINK + DUO_RECENT, int(budget * context / 2))
        sink = min(DUO_SINK, m // 5)
        sparsity = min(1.0, max(0.0, (1.0 - budget) / (1.0 - m / context)))
        return {"sparsity": sparsity, "sink_size": sink, "recent_size": m - sink}
    if name == "fastgen":
        params: dict[str, Any] = {"budget": budget}
        if budget >= 1.0:
            params["recovery_threshold"] = 1.0
        return params
    return {"budget": budget}


def policy_for(name: str, budget: float, context: int) -> CompactionPolicy:
    """The policy instance the harness runs for ``(name, budget, context)``."""
    return make_policy(name, **policy_params(name, budget, context))
