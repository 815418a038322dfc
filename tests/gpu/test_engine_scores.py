"""In-engine self-information on the GPU (vLLM's V2 runner): the connector's default store
path scores every stored prompt token by the model's own next-token log-probability, and
those scores are the model's (skipped without CUDA and vLLM).

A small Llama with transformers' initialisation (std 0.02), saved and loaded with its real
weights, through the connector with nothing but a budget (``{"budget": 0.25}``: a
``self_info`` selection stored, ``snapkv`` packs at load), CUDA graphs on:

* the storing request's prefill is scored (every prompt token but the first) and stored:
  the V2 runner's hidden states reach the worker (the V1 runner hook alone never ran on
  vLLM 0.26's GPU runner);
* the scores equal a float32 transformers reference of ``-log p(token | prefix)`` within
  bf16 tolerance and follow its token-to-token variation (Pearson r > 0.95: rows mapped to
  the wrong tokens would not);
* a later request with the same prefix loads the stored chunks and is packed in place.
"""

from __future__ import annotations

import importlib.util
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.gpu.test_serve_graphs import engine, generate, model_dir, prompt

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(
        not torch.cuda.is_available() or importlib.util.find_spec("vllm") is None,
        reason="needs CUDA and vLLM",
    ),
]

__all__ = ["model_dir"]  # the module fixture, shared


def reference_surprisal(model_dir: Path, ids: list[int]) -> torch.Tensor:
    """``(T,)`` float32 ``-log p(ids[t] | ids[:t])`` from transformers (0 at t = 0)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).cuda()
    with torch.no_grad():
        logits = model(torch.tensor([ids], device="cuda")).logits[0].float()
    logp = torch.log_softmax(logits[:-1], dim=-1)
    picked = logp.gather(1, torch.tensor(ids[1:], device="cuda")[:, None])[:, 0]
    return torch.cat([torch.zeros(1), -picked.cpu()])


def test_default_store_scores_prompts_in_the_engine(model_dir: Path) -> None:
    from connectors.vllm import offline

    ids = prompt(7)[:768]  # three 256-token chunks
    extra = {"budget": 0.25, "store": {"async_save": False, "model_id": uuid.uuid4().hex}}
    captured: dict[str, torch.Tensor] = {}
    with engine(model_dir, extra) as llm:
        worker: Any = offline.worker_connector().worker
        observe = worker.observe_hidden_states

        def spy(hidden: torch.Tensor, model: Any) -> None:
            observe(hidden, model)
            for req_id, scores in worker._surprisal.items():
                captured[req_id] = scores.clone()

        worker.observe_hidden_states = spy
        generate(llm, ids, 1)
        stats = offline.connector_stats()
        before = offline.request_counters(llm)
        generate(llm, ids + prompt(8)[:40], 4)
        after = offline.request_counters(llm)
    assert stats["surprisal_tokens"] >= len(ids) - 1, stats
    assert stats["saved_chunks"] == 3 and stats["bytes_stored"] < 0.25 * stats["bytes_full_bf16"]
    assert after["hit_chunks"] - before["hit_chunks"] == 3
    assert after["packs"] - before["packs"] == 1
    ours = next(iter(captured.values()))  # the storing request's (scored first)
    ref = reference_surprisal(model_dir, ids)
    n = len(ids)
    gap = (ours[1:n] - ref[1:n]).abs().max()
    assert torch.allclose(ours[1:n], ref[1:n], atol=0.05, rtol=0.02), gap
    r = torch.corrcoef(torch.stack([ours[1:n], ref[1:n]]))[0, 1]
    assert r > 0.95, r
