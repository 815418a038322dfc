"""In-place per-head packs (``release.per_head``) against a transformers reference.

The vLLM CPU engine (float32, tiny Llama) packs one prompt at prefill end with Ada-KV's or
PyramidKV's own counts per (layer, kv head) as dense cells, then decodes. The reference is the
same model in float32 transformers with one mask per (layer, kv head): the prompt's rows see
the whole prompt (they were computed before the pack), every generated token sees only the
kept tokens of the packed span plus the rest. Greedy tokens must be identical and their
log-probabilities within 1e-5; the full cache's answer must differ (the comparison can tell
the kept sets apart).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.integration.vllm.tiny_model import build_tiny_llama, tiny_prompt_ids
from tests.integration.vllm_release.harness import release_engine
from tests.integration.vllm_sliding import reference

pytestmark = pytest.mark.integration

PROMPT = tiny_prompt_ids(600, seed=31)
NEW_TOKENS = 8
LOGPROB_ATOL = 1e-5
PER_HEAD = {"adakv": {"slack": 1.5}, "pyramidkv": {"slack": 2, "layer_slack": 1.5}}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_llama(tmp_path_factory.mktemp("tiny") / "llama")


@pytest.mark.parametrize("policy", sorted(PER_HEAD))
def test_in_place_per_head_equals_masked_reference(tiny_model: Path, policy: str) -> None:
    from connectors.vllm import worker as worker_module

    packs: list[tuple[int, list[list[torch.Tensor]]]] = []
    original = worker_module.pack_in_place

    def recording_pack(*args: Any, **kwargs: Any) -> list[list[torch.Tensor]]:
        chosen = original(*args, **kwargs)
        num_tokens = kwargs["num_tokens"] if "num_tokens" in kwargs else args[3]
        packs.append((int(num_tokens), [[k.cpu().long() for k in heads] for heads in chosen]))
        return chosen

    extra = {
        "policy": policy,
        "budget": 0.25,
        "window": 16,
        "store": False,
        "release": {"prefill": "pack", "per_head": PER_HEAD[policy]},
    }
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(worker_module, "pack_in_place", recording_pack)
        with release_engine(str(tiny_model), extra, max_model_len=2048) as llm:
            engine = reference.engine_greedy(llm, PROMPT, NEW_TOKENS)
    assert len(packs) == 1, "the prompt was not packed in place"
    span, kept = packs[0]
    counts = torch.tensor([[k.numel() for k in heads] for heads in kept])
    assert counts.unique().numel() > 1  # the policy's own counts per (layer, head)
    model = reference.load(str(tiny_model))
    compaction = reference.Compaction(span=span, from_query=len(PROMPT), kept=kept)
    reference.assert_engine_matches(model, PROMPT, engine, compaction, LOGPROB_ATOL)
