"""Issue 12, step 1: which query-agnostic scores keep ``multi_needle`` facts (transformers).

For each context (``lmcompact.eval.tasks.build_stored_context``: pydoc text, facts at depths
0.1 / 0.5 / 0.9, three questions) one KVzip reconstruction pass (context + repeat prompt +
context, :func:`lmcompact.hf.reconstruct.reconstruct`) gives the reconstruction scores and,
from the first copy's queries, the single-pass ``kvzip`` scores the connector used before.
Every method keeps the same number of tokens per (layer, kv head) per 256-token chunk, as
the store does, and answers each question greedily from the gathered cache:

- ``recon``: reconstruction scores, ``kvzip`` policy per chunk (per-head choice);
- ``recon_global``: the same scores, one top-k over the whole context per (layer, head);
- ``recon_shared``: ``kvzip`` with ``share=True, kernel_size=15`` (one token set for all
  layers and heads from the mean score, wide max-pool; ``--share-kernels 7,15,31`` adds
  ``recon_shared_k7`` and ``recon_shared_k31``);
- ``kvzip1``: the single-pass stand-in (sampled prompt queries moved by RoPE to a repeat);
- ``streaming_llm``: sinks plus each chunk's most recent tokens;
- ``full``: the whole cache.

Usage: ``PYTHONPATH=. python scripts/reconstruct_check.py --context 2048 --samples 5 --json OUT``
(SmolLM2 only: the gathered-cache decode below assumes global attention in every layer).
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Any

import torch

from lmcompact.attention.scores import context_scores
from lmcompact.eval import tasks
from lmcompact.eval.text import text_stream
from lmcompact.hf.observe import rope_from_model
from lmcompact.hf.reconstruct import reconstruct
from lmcompact.policies import CompactionInputs, CompactionPolicy, LayerObservation, make_policy
from lmcompact.policies.kvzip import REPEAT_PROMPT, KVzip
from lmcompact.vllm.compaction import uniform_keep


def keep_indices(
    scores: torch.Tensor, policy: CompactionPolicy, chunk: int, kept: int
) -> torch.Tensor:
    """``(L, H, T * kept / chunk)`` kept positions from ``(L, H, T)`` scores, chunk by chunk."""
    layers, heads, t = scores.shape
    per_chunk = []
    for lo in range(0, t, chunk):
        obs = [
            LayerObservation(context_scores=scores[i][:, lo : lo + chunk]) for i in range(layers)
        ]
        inputs = CompactionInputs(
            chunk,
            heads,
            obs,
            positions=torch.arange(lo, lo + chunk).expand(heads, -1),
            budget_tokens=kept,
        )
        plan = policy.plan(inputs)
        rows = [
            torch.stack([uniform_keep(plan.kept[i][h], kept, chunk) + lo for h in range(heads)])
            for i in range(layers)
        ]
        per_chunk.append(torch.stack(rows))
    return torch.cat(per_chunk, dim=2)


@torch.no_grad()
def answer(
    model: Any, cache: Any, keep: torch.Tensor | None, t: int, question: list[int], n: int
) -> list[int]:
    """Greedy ``n`` tokens after ``question`` from the context cache restricted to ``keep``
    (positions stay logical: RoPE positions from ``t``, cache slots from the kept count)."""
    from transformers import DynamicCache

    new = DynamicCache(config=model.config)
    for i, layer in enumerate(cache.layers):
        k, v = layer.keys, layer.values
        if keep is not None:
            idx = keep[i].view(1, k.shape[1], -1, 1).expand(1, -1, -1, k.shape[-1])
            k, v = k.gather(2, idx), v.gather(2, idx)
        new.update(k.clone(), v.clone(), i)
    past, pos = new.get_seq_length(), t
    ids = torch.tensor([question])
    out: list[int] = []
    for _ in range(n):
        q = ids.shape[1]
        logits = model(
            input_ids=ids,
            past_key_values=new,
            position_ids=torch.arange(pos, pos + q).view(1, -1),
            cache_position=torch.arange(past, past + q),
            use_cache=True,
        ).logits
        out.append(int(logits[0, -1].argmax()))
        past, pos = past + q, pos + q
        ids = torch.tensor([[out[-1]]])
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--budgets", default="0.5,0.25")
    parser.add_argument("--chunk", type=int, default=256)
    parser.add_argument("--new-tokens", type=int, default=8)
    parser.add_argument(
        "--share-kernels",
        type=lambda text: [int(k) for k in text.split(",")],
        default=[15],
        help="max-pool widths of the shared variant (recon_shared is 15, others _kN)",
    )
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lmcompact.hf.prepare import prepare_model

    folder = str(prepare_model(args.model))
    tok = AutoTokenizer.from_pretrained(folder)
    model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32).eval()
    rope = rope_from_model(model)
    scale = float(model.config.head_dim) ** -0.5
    repeat_ids = list(tok(REPEAT_PROMPT, add_special_tokens=False)["input_ids"])
    budgets = [float(b) for b in args.budgets.split(",")]
    results: dict[str, list[float]] = {}
    rows: list[dict[str, Any]] = []
    for index in range(args.samples):
        stored = tasks.build_stored_context(
            tok, args.context, index, [0.1, 0.5, 0.9], text_stream(index)
        )
        t = len(stored.context_ids)
        sample = KVzip().context_queries(t)
        single: dict[int, torch.Tensor] = {}

        def on_layer(
            layer: int,
            q: torch.Tensor,
            k: torch.Tensor,
            t: int = t,
            sample: torch.Tensor = sample,
            single: dict[int, torch.Tensor] = single,
        ) -> None:
            shift = t if rope is not None else None
            single[layer] = context_scores(
                q[:, :, sample], k[:, :, :t], sample, scale=scale, shift=shift, rope=rope
            )[0]

        began = time.perf_counter()
        rec = reconstruct(model, stored.context_ids, repeat_ids, on_layer=on_layer)
        seconds = time.perf_counter() - began
        s1 = torch.stack([single[i] for i in sorted(single)])
        methods: dict[str, torch.Tensor | None] = {"full": None}
        for b in budgets:
            kept = int(args.chunk * b)
            methods[f"recon@{b}"] = keep_indices(
                rec.scores, make_policy("kvzip", budget=b), args.chunk, kept
            )
            methods[f"recon_global@{b}"] = keep_indices(
                rec.scores, make_policy("kvzip", budget=b), t, int(t * b)
            )
            for k in args.share_kernels:
                shared = make_policy("kvzip", budget=b, share=True, kernel_size=k)
                name = "recon_shared" + ("" if k == 15 else f"_k{k}")
                methods[f"{name}@{b}"] = keep_indices(rec.scores, shared, args.chunk, kept)
            methods[f"kvzip1@{b}"] = keep_indices(
                s1, make_policy("kvzip", budget=b), args.chunk, kept
            )
            methods[f"streaming_llm@{b}"] = keep_indices(
                torch.zeros_like(rec.scores),
                make_policy("streaming_llm", budget=b),
                args.chunk,
                kept,
            )
        for name, keep in methods.items():
            for q, needle in enumerate(stored.needles):
                ids = answer(model, rec.cache, keep, t, stored.question_ids[q], args.new_tokens)
                text = str(tok.decode(ids))
                acc = tasks.score_needle(text, needle.passkey)
                results.setdefault(name, []).append(acc)
                rows.append(
                    {
                        "sample": index,
                        "method": name,
                        "question": q,
                        "passkey": needle.passkey,
                        "answer": text,
                        "accuracy": acc,
                    }
                )
        line = ", ".join(f"{k} {sum(v) / len(v):.2f}" for k, v in results.items())
        print(f"sample {index}: reconstruction pass {seconds:.1f} s; {line}", flush=True)
    summary = {k: {"accuracy": sum(v) / len(v), "n": len(v)} for k, v in results.items()}
    print(json.dumps(summary, indent=1))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump({"args": vars(args), "summary": summary, "rows": rows}, fh, indent=1)


if __name__ == "__main__":
    main()
