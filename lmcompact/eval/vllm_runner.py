"""Quality through the real vLLM connector (``lmcompact eval --engine vllm``).

Every prompt runs in vLLM (CPU build, in-process engine, float32, block size 32) with
``LMCompactConnector``, in one of three modes (the ``compact_on`` column of a row):

``save``
    A first request holding the context alone computes it and stores it compacted (the
    policy's observation window is the end of the context: no question exists yet). Every
    question request (context + question) then loads the compacted prefix from the store
    and computes only its question. For a policy that reads context scores (``kvzip``) the
    first request is KVzip's reconstruction pass instead (``context + repeat prompt +
    context``, :func:`connectors.vllm.reconstruct.store_context`; rows say
    ``store_request: "reconstruct"``): only the first copy's chunks are stored, compacted
    with the repeat's attention (``reconstruct=False`` stores the context alone, scored by
    its own sampled queries). For a policy that scores with given per-token scores
    (``self_info``) the context runs twice: once for its ``prompt_logprobs`` (not
    stored), then stored with their surprisal as ``token_scores``
    (:func:`connectors.vllm.reconstruct.store_surprisal_context`; ``store_request:
    "surprisal"``).
``load``
    The first request stores the context whole (``"compact_on": "load"``); every question
    request loads it whole and packs it in place at its prefill end, with the question as
    the observation window; the freed blocks go back to vLLM's pool.
``inplace``
    No store: every question request computes the whole prompt and packs it in place.

A full-cache row (policy ``none``, ``compact_on`` ``none``) comes from a plain engine on
the same prompts, with vLLM's own prefix cache on (the questions of one context share
it). One engine serves all prompts of a (model, context length, mode, policy, budget)
cell; its store namespace is fresh (a per-cell ``model_id``) and every context differs,
so a hit is always on what the cell itself stored. Each row records the store hits and
packs its request caused, so a miss cannot pass for a compacted answer.

Tasks: ``multi_needle`` (one context, one labelled needle per depth, one question per
needle: :func:`lmcompact.eval.tasks.build_stored_context`) and ``needle`` (one needle and
one question per context, a context per depth).
"""

from __future__ import annotations

import logging
import time
import uuid
from typing import Any

from lmcompact.eval import tasks
from lmcompact.eval.vllm_cells import (
    BASELINE,
    MODES,
    STORED_MODES,
    TASKS,
    Case,
    VllmEvalConfig,
    build_cases,
    cells,
    connector_extra,
    count_questions,
    policy_label,
    uses_reconstruction,
    uses_surprisal,
)

logger = logging.getLogger(__name__)

__all__ = [
    "BASELINE",
    "CONNECTOR",
    "MODES",
    "SURPRISAL_STEP",
    "TASKS",
    "Case",
    "VllmEvalConfig",
    "build_cases",
    "cells",
    "connector_extra",
    "count_questions",
    "model_positions",
    "policy_label",
    "run_cell",
    "run_vllm_eval",
    "uses_reconstruction",
    "uses_surprisal",
]

CONNECTOR = "LMCompactConnector"
SURPRISAL_STEP = 1024
"""Prefill step (``max_num_batched_tokens``) of cells whose contexts are stored with their
``prompt_logprobs`` (``self_info``): bounds the logprobs' ``step x vocab`` floats."""


def _delta(after: dict[str, float], before: dict[str, float], key: str) -> float:
    return after.get(key, 0.0) - before.get(key, 0.0)


def run_cell(
    llm: Any,
    tokenizer: Any,
    cases: list[Case],
    mode: str,
    config: VllmEvalConfig,
    progress: Any = None,
    reconstruct: bool = False,
    max_len: int | None = None,
    surprisal: bool = False,
) -> list[dict[str, Any]]:
    """Every case through one engine; one row per question.

    Row fields: ``task, context, sample, question, accuracy, answer, passkey, seconds``
    and the connector counters this question's request moved (``hit_chunks``,
    ``expected_hit_chunks``, ``packs``, ``blocks_released``, ``holes_adopted``,
    ``pack_s``); ``warm_s`` is the first request's time (store modes), ``store_request``
    what it was (``context``, ``reconstruct`` or ``surprisal``) and ``reconstruct_s`` the
    worker's time scoring its repeat; ``max_len`` caps the reconstruction prompt (the
    model's positions: a longer one repeats only the context's beginning).
    """
    from connectors.vllm import offline
    from connectors.vllm.reconstruct import REPEAT_PROMPT, store_context, store_surprisal_context

    repeat_ids = list(tokenizer(REPEAT_PROMPT, add_special_tokens=False)["input_ids"])

    rows: list[dict[str, Any]] = []
    stored_modes = STORED_MODES
    for case in cases:
        warm_s = None
        recon_s = None
        store_bytes: dict[str, float] = {}
        if mode in stored_modes:
            before = offline.request_counters(llm)
            began = time.perf_counter()
            if reconstruct:
                store_context(llm, case.stored.context_ids, repeat_ids, max_len=max_len)
            elif surprisal:
                store_surprisal_context(llm, case.stored.context_ids)
            else:
                offline.generate(llm, case.stored.context_ids, max_tokens=1)
            warm_s = time.perf_counter() - began
            after = offline.request_counters(llm)
            recon_s = _delta(after, before, "reconstruct_s")
            store_bytes = {
                key: _delta(after, before, key)
                for key in ("bytes_stored", "bytes_full", "bytes_full_bf16")
            }
            if _delta(after, before, "hit_chunks"):
                logger.error(
                    "the first request of %s sample %d hit the store: the namespace is not fresh",
                    case.task,
                    case.sample,
                )
        stored_chunks = len(case.stored.context_ids) // config.chunk_size
        for q, needle in enumerate(case.stored.needles):
            prompt = case.stored.prompt(q)
            # the connector computes the last window of sliding-window models itself
            loadable = offline.loadable_chunks(llm, len(prompt))
            expected = 0 if mode not in stored_modes else min(stored_chunks, loadable or 0)
            before = offline.request_counters(llm)
            out = offline.generate(llm, prompt, config.new_tokens)
            after = offline.request_counters(llm)
            text = tokenizer.decode(out.token_ids)
            row = {
                "task": case.task,
                "context": case.context,
                "sample": case.sample,
                "question": q,
                "depth": needle.depth,
                "passkey": needle.passkey,
                "answer": text,
                "accuracy": tasks.score_needle(text, needle.passkey),
                "seconds": out.seconds,
                "warm_s": warm_s,
                "store_request": (
                    "reconstruct" if reconstruct else "surprisal" if surprisal else "context"
                ),
                "reconstruct_s": recon_s,
                "expected_hit_chunks": expected,
                "prompt_blocks": len(prompt) // offline.DEFAULT_BLOCK_SIZE,
            }
            row.update(store_bytes)
            for key in ("hit_chunks", "packs", "blocks_released", "holes_adopted", "pack_s"):
                row[key] = _delta(after, before, key)
            if row["hit_chunks"] != expected:
                logger.error(
                    "%s: question %d of %s sample %d hit %d chunks, expected %d",
                    mode,
                    q,
                    case.task,
                    case.sample,
                    row["hit_chunks"],
                    expected,
                )
            rows.append(row)
            if progress is not None:
                progress.update(1)
    return rows


def model_positions(folder: str) -> int:
    """The model's trained positions (``max_position_embeddings``; vLLM's RoPE tables end
    there: a longer prompt reads past them)."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(folder)
    text = getattr(config, "text_config", None) or config
    return int(getattr(text, "max_position_embeddings", 1 << 30))


def run_vllm_eval(config: VllmEvalConfig, progress_factory: Any = None) -> list[dict[str, Any]]:
    """Every (model, context, cell); rows carry ``engine, model, policy, budget,
    compact_on`` and the cell's wall time ``cell_s`` besides :func:`run_cell`'s fields."""
    from connectors.vllm import offline

    offline.in_process_env(kv_cache_gib=1)
    from transformers import AutoTokenizer

    from lmcompact.hf.prepare import prepare_model

    rows: list[dict[str, Any]] = []
    for model in config.models:
        folder = str(prepare_model(model))
        tokenizer = AutoTokenizer.from_pretrained(folder)
        positions = model_positions(folder)
        for context in config.contexts:
            cases = build_cases(tokenizer, config, context)
            per_cell = count_questions(cases)
            all_cells = list(cells(config))
            bar = (
                progress_factory(total=per_cell * len(all_cells), desc=f"{model} {context}")
                if progress_factory is not None
                else None
            )
            for mode, policy, budget in all_cells:
                began = time.perf_counter()
                namespace = f"eval-{uuid.uuid4().hex[:12]}"
                extra = (
                    None
                    if mode == BASELINE
                    else connector_extra(mode, policy, budget, config, namespace)
                )
                recon = uses_reconstruction(mode, policy, config)
                base = {
                    "engine": "vllm",
                    "impl": "lmcompact",
                    "model": model,
                    "policy": (
                        policy if mode == BASELINE else policy_label(policy, config, recon, mode)
                    ),
                    "budget": budget,
                    "compact_on": mode,
                    "haystack": config.text,
                }
                wanted = (2 * context if recon else context) + 64 + config.new_tokens
                max_model_len = min(wanted, max(positions, context + 64 + config.new_tokens))
                surprisal = uses_surprisal(mode, policy, config)
                try:
                    llm = offline.build_llm(
                        folder,
                        extra,
                        max_model_len=max_model_len,
                        connector=CONNECTOR,
                        # prompt logprobs hold (step tokens x vocab) floats a few times over:
                        # 4k x 262k (Gemma-3) in one step ran out of memory here
                        max_num_batched_tokens=SURPRISAL_STEP if surprisal else None,
                        # the full cache's questions share their context: vLLM's own prefix
                        # cache prefills it once (exact KV, several times faster on a CPU)
                        prefix_caching=mode == BASELINE,
                    )
                except Exception as error:  # a refused config is a result, not a crash
                    logger.error("%s %s %s refused: %s", mode, policy, budget, error)
                    rows.append(
                        {**base, "context": context, "task": None, "error": str(error)[:500]}
                    )
                    if bar is not None:
                        bar.update(per_cell)
                    continue
                try:
                    cell_rows = run_cell(
                        llm,
                        tokenizer,
                        cases,
                        mode,
                        config,
                        bar,
                        recon,
                        max_model_len - 1,
                        surprisal=surprisal,
                    )
                finally:
                    offline.shutdown(llm)
                    del llm
                    import gc

                    gc.collect()
                seconds = time.perf_counter() - began
                logger.info("cell %s %s %s: %.1f s", mode, policy, budget, seconds)
                rows += [{**base, **r, "cell_s": seconds} for r in cell_rows]
            if bar is not None:
                bar.close()
    return rows
