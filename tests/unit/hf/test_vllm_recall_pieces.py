"""The pieces of ``lmcompact.eval.vllm_recall`` that need no engine: the connector options
each mode sends (checked by the connector's own parser) and the agreement arithmetic."""

from __future__ import annotations

import pytest

from connectors.vllm.config import ConnectorConfig
from lmcompact.compaction.hole_planner import PrefillMode
from lmcompact.eval.vllm_recall import EngineCell, _extra, compare


@pytest.mark.parametrize(
    ("prompt_budget", "protect", "mode"),
    [(None, False, PrefillMode.OFF), (0.5, False, PrefillMode.PACK), (None, True, PrefillMode.OFF)],
)
def test_each_mode_is_a_valid_connector_configuration(
    prompt_budget: float | None, protect: bool, mode: PrefillMode
) -> None:
    config = ConnectorConfig.from_extra(_extra("recent", 512, prompt_budget, protect))
    assert config.release is not None
    assert config.release_mode is mode
    assert config.release.decode_budget_tokens == 512
    assert config.release.protect_prompt is protect


def test_a_merging_policy_after_a_packed_prompt_cannot_protect_it() -> None:
    with pytest.raises(ValueError, match="protect_prompt with prefill mode 'pack'"):
        ConnectorConfig.from_extra(_extra("rkv", 512, 0.5, True))


def test_agreement_counts_the_steps_from_each_requests_first_compacted_one() -> None:
    cell = EngineCell("recent", 512, 1.0, 2, None, None, ["a", "b"], 1.0)
    full = [([1, 2, 3, 4], [-0.5, -0.5, -0.5, -0.5]), ([5, 6], [-1.0, -1.0])]
    steps = [([9, 2, 3, 0], [-9.0, -0.75, -0.5, -1.5]), ([5, 7], [-1.0, -2.0])]
    out = compare(cell, steps, full, skip=[1, 0])
    # request 0 from step 1: 2 of 3 agree; request 1: 1 of 2 -> 3 of 5
    assert out.top1_agreement == pytest.approx(3 / 5)
    assert out.mean_abs_logprob_gap == pytest.approx((0.25 + 0 + 1.0 + 0 + 1.0) / 5)
    assert out.tokens_compared == 5
