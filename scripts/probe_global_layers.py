"""Where a sliding-window model's answers go at a budget: its global layers' selection.

For each ``multi_needle`` question of ``lmcompact eval --engine vllm`` (the same cases:
``build_cases``, seed 0), a float32 transformers model masks what an in-place pack of the
whole prompt keeps (the masked reference of ``tests/integration/vllm_sliding``): sliding
layers the ``budget`` most recent tokens, as the connector makes them keep; global layers
the choice of a registered policy, scored by the attention of the prompt's last ``window``
queries (softmax mass summed over them, averaged over each kv head's query heads, as the
connector captures it). Rows: the full cache, then each ``--variants`` entry
``POLICY[:FRACTION]``, the global layers keeping ``FRACTION`` of the prompt (default the
budget) while the sliding layers keep the budget. Answers are scored as the eval scores
them (``tasks.score_needle``).

    python scripts/probe_global_layers.py --model gemma3-270m --context 2048 \
        --haystack licenses --budget 0.25 --variants snapkv chunkkv snapkv:0.5 snapkv:0.75 \
        --json docs/eval/probe_global_layers_gemma3_2k_licenses.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from connectors.vllm.config import POLICY_DEFAULTS
from lmcompact.eval import tasks
from lmcompact.eval.vllm_cells import VllmEvalConfig, build_cases
from lmcompact.hf.prepare import prepare_model
from lmcompact.policies import CompactionInputs, LayerObservation, make_policy
from tests.integration.vllm_sliding import reference


def window_scores(model: Any, prompt: list[int], window: int) -> list[torch.Tensor]:
    """Per layer ``(Hkv, T)``: softmax mass from the last ``window`` queries."""
    seen: dict[int, torch.Tensor] = {}

    def keep(module: Any, args: Any, kwargs: Any, out: Any) -> None:
        seen[module.layer_idx] = out[1][0, :, -window:, :].sum(1)

    hooks = [
        layer.self_attn.register_forward_hook(keep, with_kwargs=True)
        for layer in model.model.layers
    ]
    implementation = model.config._attn_implementation
    model.set_attn_implementation("eager")
    try:
        with torch.no_grad():
            model(torch.tensor([prompt]), output_attentions=True, logits_to_keep=1)
    finally:
        model.set_attn_implementation(implementation)
        for hook in hooks:
            hook.remove()
    kv_heads = model.config.num_key_value_heads
    return [s.view(kv_heads, -1, s.shape[-1]).mean(1) for _, s in sorted(seen.items())]


def global_choice(policy: str, scores: torch.Tensor, keep: int, window: int) -> list[torch.Tensor]:
    params = {**POLICY_DEFAULTS.get(policy, {}), "window_size": window}  # as the connector
    planner = make_policy(policy, budget=keep, **params)
    heads, length = scores.shape
    inputs = CompactionInputs(length, heads, [LayerObservation(window_scores=scores)])
    return list(planner.plan(inputs).kept[0])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="gemma3-270m")
    parser.add_argument("--context", type=int, default=2048)
    parser.add_argument("--haystack", default="licenses", choices=["pydoc", "licenses"])
    parser.add_argument("--samples", type=int, default=5)
    parser.add_argument("--budget", type=float, default=0.25)
    parser.add_argument("--window", type=int, default=32)
    parser.add_argument("--new-tokens", type=int, default=12)
    parser.add_argument("--variants", nargs="+", default=["snapkv", "chunkkv"])
    parser.add_argument("--json", type=Path, required=True)
    args = parser.parse_args()

    from transformers import AutoTokenizer

    model_dir = str(prepare_model(args.model))
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    config = VllmEvalConfig(
        models=[args.model], contexts=[args.context], samples=args.samples, text=args.haystack
    )
    cases = build_cases(tokenizer, config, args.context)
    model = reference.load(model_dir)
    windows = [getattr(layer.self_attn, "sliding_window", None) for layer in model.model.layers]
    variants = [
        (name, float(fraction or args.budget))
        for name, _, fraction in (v.partition(":") for v in args.variants)
    ]
    rows: list[dict[str, Any]] = []
    started = time.monotonic()
    questions = [(c, q) for c in cases for q in range(len(c.stored.needles))]
    for case, question in tqdm(questions, desc="questions"):
        prompt = case.stored.prompt(question)
        passkey = case.stored.needles[question].passkey
        length = len(prompt)
        recent = int(args.budget * length)
        scores = window_scores(model, prompt, args.window)
        for policy, fraction in [("full cache", 1.0), *variants]:
            compaction = None
            if policy != "full cache":
                kept = [
                    [torch.arange(length - recent, length)] * scores[layer].shape[0]
                    if windows[layer]
                    else global_choice(policy, scores[layer], int(fraction * length), args.window)
                    for layer in range(len(windows))
                ]
                compaction = reference.Compaction(span=length, from_query=length, kept=kept)
            tokens, _ = reference.greedy(model, prompt, args.new_tokens, compaction)
            answer = str(tokenizer.decode(tokens))
            rows.append(
                {
                    "sample": case.sample,
                    "question": question,
                    "policy": policy,
                    "global_fraction": fraction,
                    "passkey": passkey,
                    "answer": answer,
                    "accuracy": tasks.score_needle(answer, passkey),
                }
            )
    summary: dict[str, float] = {}
    for row in rows:
        label = f"{row['policy']}@{row['global_fraction']:g}"
        summary[label] = summary.get(label, 0.0) + row["accuracy"]
    result = {
        "command": " ".join(sys.argv),
        "model": args.model,
        "context": args.context,
        "haystack": args.haystack,
        "budget": args.budget,
        "sliding_layers": [i for i, w in enumerate(windows) if w],
        "questions": len(questions),
        "correct": summary,
        "elapsed_s": time.monotonic() - started,
        "rows": rows,
    }
    args.json.parent.mkdir(parents=True, exist_ok=True)
    args.json.write_text(json.dumps(result, indent=1) + "\n")
    for label, correct in summary.items():
        print(f"{label:>24} {correct:.0f}/{len(questions)}")


if __name__ == "__main__":
    main()
