"""Issue 12, step 1: which query-agnostic scores keep ``multi_needle`` facts (transformers).

For each context (``lmcompact.eval.tasks.build_stored_context``: pydoc text, facts at depths
0.1 / 0.5 / 0.9, three questions) one KVzip reconstruction pass (context + repeat prompt +
context, :func:`lmcompact.hf.reconstruct.reconstruct`) gives the reconstruction scores of
every layer and each context token's surprisal. Every method keeps the same number of
tokens per (layer, kv head) per 256-token chunk, as the store does, and answers each
question greedily from the context's whole cache with the dropped keys masked out
(positions stay logical; each layer keeps its own sliding window over logical positions).

What the vLLM store does with sliding-window layers is mirrored: they keep each chunk's
most recent tokens, and a later request sees only the last chunk's of them (the hole's
``window_lead``, ``lmcompact/compaction/holes.py``). Scores come from the layers that can see the
first copy (the global ones; every layer on a model without sliding windows).

Methods (``--methods``, each ``NAME@budget`` in the output; one token set shared by every
scored layer and head, from one ``(T,)`` score, max-pooled with width ``kN``):

- ``full``: the whole cache; ``streaming_llm``: sinks plus each chunk's recent tokens;
- ``mean_kN``: mean reconstruction score over scored layers and heads (``kvzip`` ``share``);
- ``rank_kN``: each (layer, head) rank-normalized over the context first, then the mean;
- ``max_kN``: each (layer, head) divided by its maximum, then the max over them;
- ``surp_kN``: surprisal alone (Selective Context / LLMLingua's self-information);
- ``mix_kN``: mean of the ranks of ``mean`` and of ``surp``; ``rmix_kN``: of ``rank`` and ``surp``;
- suffix ``_aN``: average-pool the score over ``N`` tokens first (a span's density);
- suffix ``_wN``: scale the score of the first ``N`` positions by ``position / N`` first
  (``self_info``'s ``warmup``: a document's opening is improbable for lack of context);
- suffix ``_bN``: then subtract its mean over the ``N`` nearest tokens (``self_info``'s
  ``background``: a span ranks by how much it stands out from its surroundings);
- suffix ``_glob``: one top-k over the whole context instead of per chunk (ragged counts).

Per-head methods (each (layer, kv head) keeps its own tokens, KVzip's own allocation; the
first sinks scored 1 as kvpress's ``KVzipPress``; output also gives each method's padded
footprint, the largest per-head count over ``T``, what a vLLM block row would hold):

- ``kvz_glob``: one top-k over every (layer, head, token) of the whole context (kvpress's
  ``KVzipPress`` with ``layerwise=False``);
- ``kvz_chunk``: the same top-k within each chunk (the store's chunks, counts per chunk);
- ``kvz_head``: each (layer, head) its own top-k over the whole context (uniform counts);
- suffix ``_sN``: cap each (layer, head) at ``N / 100`` times the budget's count (the
  padded footprint then is at most that).

Haystacks (``--text``): ``pydoc`` (the eval's, default) or ``licenses``: the plain-English
license texts of Debian's ``/usr/share/common-licenses`` (GPL, LGPL, GFDL, Apache, ...),
paragraphs rotated to a seed-chosen start, a second kind of prose to check a rule on.

Usage: ``PYTHONPATH=. python scripts/reconstruct_check.py --model gemma3-270m --context 2048
--samples 5 --json OUT``.
"""

from __future__ import annotations

import argparse
import json
import math
import time
import uuid
from collections.abc import Callable
from typing import Any

import torch

from lmcompact.attention.pooling import pool_scores
from lmcompact.eval import tasks
from lmcompact.eval.text import license_stream, text_stream
from lmcompact.hf.reconstruct import Reconstruction, reconstruct
from lmcompact.policies.allocation import ragged_keep_mask
from lmcompact.policies.kvzip import REPEAT_PROMPT
from lmcompact.policies.self_info import local_mean

DEFAULT_METHODS = "streaming_llm,mean_k15,mean_k31,rank_k15,max_k15,surp_k15,mix_k15,mean_k15_glob"
N_SINK = 4


def ranks(x: torch.Tensor) -> torch.Tensor:
    """``x`` (``(..., T)``) replaced by its rank along the last axis, in ``[0, 1]``."""
    order = x.argsort(dim=-1).argsort(dim=-1).double()
    return order / max(1, x.shape[-1] - 1)


def shared_score(rec: Reconstruction, kind: str) -> torch.Tensor:
    """``(T,)`` one score per context token from the scored layers' ``(L, H, T)`` maps."""
    scored = [i for i in range(rec.scores.shape[0]) if i not in rec.sliding]
    maps = rec.scores[scored].double()
    if kind == "mean":
        return maps.mean(dim=(0, 1))
    if kind == "rank":
        return ranks(maps).mean(dim=(0, 1))
    if kind == "max":
        return (maps / maps.amax(dim=-1, keepdim=True).clamp_min(1e-12)).amax(dim=(0, 1))
    if kind == "surp":
        return rec.surprisal.double()
    if kind == "mix":
        return (ranks(maps.mean(dim=(0, 1))) + ranks(rec.surprisal.double())) / 2
    if kind == "rmix":
        return (ranks(ranks(maps).mean(dim=(0, 1))) + ranks(rec.surprisal.double())) / 2
    raise ValueError(f"unknown score kind {kind!r}")


def select(score: torch.Tensor, chunk: int, kept: int, kernel: int, glob: bool) -> torch.Tensor:
    """``(T,)`` bool kept tokens: top ``kept`` per ``chunk`` (or ``kept * T / chunk`` over
    the whole context with ``glob``) of the max-pooled score, the first sinks always."""
    t = score.numel()
    pooled = pool_scores(score[None], kernel, "maxpool")[0] + score * 1e-6
    pooled[:N_SINK] = float("inf")
    keep = torch.zeros(t, dtype=torch.bool)
    span = t if glob else chunk
    for lo in range(0, t, span):
        part = pooled[lo : lo + span]
        count = kept * part.numel() // chunk
        keep[lo + part.topk(count).indices] = True
    return keep


def perhead_masks(rec: Reconstruction, method: str, budget: float, chunk: int) -> torch.Tensor:
    """``(L, Hkv, T)`` bool kept keys of a per-head method (``kvz_*``): kvzip's
    ``allocation="ragged"`` choice (:func:`ragged_keep_mask`) over each span."""
    _, mode, *options = method.split("_")
    slack = next((int(o[1:]) / 100 for o in options if o.startswith("s")), None)
    scores = rec.scores.double().clone()
    scores[..., :N_SINK] = 1.0 + 1e-3  # kvpress: sinks at 1 (the largest softmax weight)
    t = scores.shape[-1]
    keep = torch.zeros(scores.shape, dtype=torch.bool)
    span = chunk if mode == "chunk" else t
    for lo in range(0, t, span):
        part = scores[..., lo : lo + span]
        width = part.shape[-1]
        count = int(width * budget)
        cap = width if slack is None else min(width, math.ceil(width * budget * slack))
        if mode == "head":
            cap = count  # every (layer, head) its own top-k
        keep[..., lo : lo + span] = ragged_keep_mask(part, count, cap)
    return keep


def keep_masks(
    rec: Reconstruction, method: str, budget: float, chunk: int, heads: int
) -> torch.Tensor:
    """``(L, Hkv, T)`` bool kept keys of one method, sliding layers as the store leaves them."""
    t, layers = rec.context_len, rec.scores.shape[0]
    kept = int(chunk * budget)
    if method.startswith("kvz_"):
        return perhead_masks(rec, method, budget, chunk)
    if method == "streaming_llm":
        shared = torch.zeros(t, dtype=torch.bool)
        shared[:N_SINK] = True
        for lo in range(0, t, chunk):
            shared[lo + chunk - (kept - (N_SINK if lo == 0 else 0)) : lo + chunk] = True
    else:
        kind, *options = method.split("_")
        kernel = next((int(o[1:]) for o in options if o.startswith("k")), 1)
        smooth = next((int(o[1:]) for o in options if o.startswith("a")), 1)
        background = next((int(o[1:]) for o in options if o.startswith("b")), 1)
        warmup = next((int(o[1:]) for o in options if o.startswith("w")), 0)
        raw = shared_score(rec, kind)
        if warmup:
            raw = raw * (torch.arange(t, dtype=torch.float64) / warmup).clamp(max=1.0)
        score = pool_scores(raw[None], smooth, "avgpool")
        score = (score - local_mean(score, background))[0]
        shared = select(score, chunk, kept, kernel, "glob" in options)
    masks = shared.expand(layers, heads, t).clone()
    recent = torch.zeros(t, dtype=torch.bool)
    recent[t - kept :] = True  # the last chunk's recent tokens (window_lead cuts the rest)
    for layer in rec.sliding:
        masks[layer] = recent
    return masks


def masked_attention(model: Any) -> tuple[str, Callable[[torch.Tensor | None], None]]:
    """Register an attention that also drops masked context keys; returns its name and a
    setter for the current ``(L, Hkv, T)`` keep mask (None: keep all)."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    state: dict[str, torch.Tensor | None] = {"keep": None}

    def full_mask(*args: Any, **kwargs: Any) -> Any:
        kwargs["allow_is_causal_skip"] = False
        return sdpa_mask(*args, **kwargs)

    def attention(
        module: torch.nn.Module,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        attention_mask: torch.Tensor | None,
        **kwargs: Any,
    ) -> Any:
        keep = state["keep"]
        if keep is not None and attention_mask is not None:
            layer = int(getattr(module, "layer_idx"))  # noqa: B009 (an int attribute)
            group = query.shape[1] // keep.shape[1]
            row = torch.ones(query.shape[1], key.shape[2], dtype=torch.bool)
            row[:, : keep.shape[2]] = keep[layer].repeat_interleave(group, dim=0)
            attention_mask = attention_mask.bool() & row[None, :, None, :]
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)

    name = f"lmcompact_keep_{uuid.uuid4().hex[:8]}"
    AttentionInterface.register(name, attention)
    AttentionMaskInterface.register(name, full_mask)

    def set_keep(keep: torch.Tensor | None) -> None:
        state["keep"] = keep

    return name, set_keep


@torch.no_grad()
def answer(model: Any, rec: Reconstruction, question: list[int], n: int) -> list[int]:
    """Greedy ``n`` tokens after ``question`` from a copy of the context's cache."""
    import copy

    cache = copy.deepcopy(rec.cache)
    ids = torch.tensor([question])
    out: list[int] = []
    for _ in range(n):
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True).logits
        out.append(int(logits[0, -1].argmax()))
        ids = torch.tensor([[out[-1]]])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--first-sample", type=int, default=0)
    parser.add_argument("--budgets", default="0.5,0.25")
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument("--methods", default=DEFAULT_METHODS)
    parser.add_argument("--text", choices=("pydoc", "licenses"), default="pydoc")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lmcompact.hf.prepare import prepare_model

    folder = str(prepare_model(args.model))
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    heads = int(model.config.num_key_value_heads)
    repeat_ids = list(tok(REPEAT_PROMPT, add_special_tokens=False)["input_ids"])
    budgets = [float(b) for b in args.budgets.split(",")]
    results: dict[str, list[float]] = {}
    footprints: dict[str, list[float]] = {}
    rows: list[dict[str, Any]] = []
    for index in range(args.first_sample, args.first_sample + args.samples):
        stored = tasks.build_stored_context(
            tok,
            args.context,
            index,
            [0.1, 0.5, 0.9],
            text_stream(index) if args.text == "pydoc" else license_stream(index),
        )
        began = time.perf_counter()
        rec = reconstruct(model, stored.context_ids, repeat_ids)
        seconds = time.perf_counter() - began
        name, set_keep = masked_attention(model)
        previous = model.config._attn_implementation
        model.set_attn_implementation(name)
        try:
            methods: list[tuple[str, torch.Tensor | None]] = [("full", None)]
            for b in budgets:
                for m in args.methods.split(","):
                    methods.append((f"{m}@{b}", keep_masks(rec, m, b, args.chunk, heads)))
            for method, keep in methods:
                if keep is not None:
                    footprint = float(keep.sum(-1).max()) / rec.context_len
                    footprints.setdefault(method, []).append(footprint)
                set_keep(keep)
                for q, needle in enumerate(stored.needles):
                    ids = answer(model, rec, stored.question_ids[q], args.new_tokens)
                    text = str(tok.decode(ids))
                    acc = tasks.score_needle(text, needle.passkey)
                    results.setdefault(method, []).append(acc)
                    rows.append(
                        {
                            "sample": index,
                            "method": method,
                            "question": q,
                            "passkey": needle.passkey,
                            "answer": text,
                            "accuracy": acc,
                        }
                    )
        finally:
            model.set_attn_implementation(previous)
        line = ", ".join(f"{k} {sum(v) / len(v):.2f}" for k, v in results.items())
        print(f"sample {index}: reconstruction pass {seconds:.1f} s; {line}", flush=True)
    summary: dict[str, dict[str, float]] = {
        k: {"accuracy": sum(v) / len(v), "n": len(v)} for k, v in results.items()
    }
    for k, f in footprints.items():
        summary[k]["padded_footprint"] = max(f)
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "summary": summary, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
