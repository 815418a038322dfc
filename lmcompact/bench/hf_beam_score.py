"""Is a configuration's decode as accurate as DynamicCache's? Judged against float32.

In bf16/fp16 two attention implementations round differently. On a random-weight
model (near-uniform logits over a large vocabulary) beam search's candidates are
nearly tied, so the beams of two correct implementations part after a few steps;
torch's own SDPA backends do the same to each other (the ``dynamic_math``
control). Comparing generated tokens then measures rounding luck, not
correctness. Two measures that do not depend on luck:

* **teacher-forced error** (:func:`forced_logits`): every configuration decodes
  the *same* tokens (DynamicCache's beam, rotated by one step per row so the rows
  differ, with a fixed seeded beam reorder every step, so copy-on-write and shared
  prompt blocks are exercised); its logits are compared with DynamicCache's in
  the same dtype (``forced_rel_err_to_dynamic``) and with the same steps run
  through DynamicCache in float32 (``forced_logit_rel_err``). The goal: a paged
  configuration is no farther from DynamicCache than torch's math SDPA backend is
  (``dynamic_math``, a second torch implementation of the same attention).
* **beam likelihood** (:func:`sequence_logprob`): each configuration's own beam
  scored by one cache-free float32 forward (beam search's own score of it with
  ``length_penalty=0``; transformers applies ``min_new_tokens``'s EOS mask after
  the log-softmax, so plain log-softmax values are summed). ``fp32_logprob_gap``:
  the row's score minus DynamicCache's, positive for a likelier beam.
"""

from __future__ import annotations

from typing import Any

from lmcompact.compare import rel_err

# configurations whose decode should be as accurate as DynamicCache's in the same dtype
# (int8 K/V and compaction change what attention sees on purpose: reported, not judged)
SAME_PRECISION = ("paged", "paged_eager")


def sequence_logprob(model: Any, prompt_ids: Any, tokens: list[int]) -> float:
    """Sum over ``tokens`` of log p(token | prompt, earlier tokens), one forward.

    ``model`` runs in its current dtype (call ``model.float()`` first);
    ``prompt_ids`` is ``(1, P)`` on the model's device.
    """
    import torch

    new = torch.tensor([tokens], dtype=prompt_ids.dtype, device=prompt_ids.device)
    inputs = torch.cat([prompt_ids, new[:, :-1]], dim=1)
    with torch.inference_mode():
        logits = model(input_ids=inputs, logits_to_keep=len(tokens)).logits[0].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        return float(logprobs.gather(1, new[0, :, None]).sum())


def reorders(beams: int, steps: int) -> Any:
    """``(steps, beams)`` seeded beam parents, sorted (as beam search's are), with repeats."""
    import torch

    gen = torch.Generator().manual_seed(beams * 1000 + steps)
    return torch.randint(0, beams, (steps, beams), generator=gen).sort(dim=1).values


def forced_logits(model: Any, cache: Any, prompt_ids: Any, tokens: list[int], beams: int) -> Any:
    """``(len(tokens), beams, vocab)`` float32 logits, on the CPU, of a teacher-forced decode.

    The prompt ``(1, P)`` is expanded to ``beams`` rows and prefilled into ``cache``;
    then for each step but the last: the cache is reordered by :func:`reorders`
    and row ``b`` is fed ``tokens[(step + b) % len(tokens)]`` (distinct rows, so a
    wrong reorder changes the logits). The model's attention implementation must
    already match the cache (SDPA for DynamicCache, lmcompact's for PagedCache).
    """
    import torch

    parents = reorders(beams, len(tokens) - 1).to(prompt_ids.device)
    order = torch.tensor(tokens, device=prompt_ids.device)
    fed = torch.stack([order.roll(-b) for b in range(beams)], dim=1)  # (T, beams)
    with torch.inference_mode():
        out = model(prompt_ids.expand(beams, -1), past_key_values=cache, use_cache=True)
        logits = [out.logits[:, -1].float().cpu()]
        for step in range(len(tokens) - 1):
            cache.reorder_cache(parents[step])
            out = model(fed[step, :, None], past_key_values=cache, use_cache=True)
            logits.append(out.logits[:, -1].float().cpu())
    return torch.stack(logits)


def reference_rows(
    model: Any, prompt: Any, rows: list[dict[str, Any]], forced: dict[tuple[int, str], Any]
) -> None:
    """Float32 reference: fill ``fp32_logprob`` / ``fp32_logprob_gap`` (every row) and
    ``forced_logit_rel_err`` (rows with teacher-forced logits in ``forced``, keyed by
    (prompt tokens, config)) in place. Converts ``model`` to float32 SDPA in place.
    ``prompt(length)`` gives the prompt ids ``(1, length)`` the rows were run with.
    """
    import torch
    from transformers import DynamicCache

    model.float()
    model.set_attn_implementation("sdpa")
    device = next(model.parameters()).device
    for length in sorted({r["prompt_tokens"] for r in rows}):
        ids = prompt(length).to(device)
        at = [r for r in rows if r["prompt_tokens"] == length]
        base = next(r for r in at if r["config"] == "dynamic")
        for row in at:
            row["fp32_logprob"] = sequence_logprob(model, ids, row["tokens"])
            row["fp32_logprob_gap"] = row["fp32_logprob"] - base["fp32_logprob"]
        if any(key[0] == length for key in forced):
            beams = next(v for k, v in forced.items() if k[0] == length).shape[1]
            cache = DynamicCache(config=model.config)
            want = forced_logits(model, cache, ids, base["tokens"], beams)
            dynamic = forced.get((length, "dynamic"))
            for row in at:
                if (length, row["config"]) in forced:
                    got = forced[length, row["config"]]
                    row["forced_logit_rel_err"] = rel_err(got, want)
                    if dynamic is not None:
                        row["forced_rel_err_to_dynamic"] = rel_err(got, dynamic)
        if device.type == "cuda":
            torch.cuda.empty_cache()


def fidelity_goals(rows: list[dict[str, Any]], length: int) -> dict[str, bool]:
    """Per same-precision paged config at ``length``: its teacher-forced logits are no
    farther from DynamicCache's (same dtype) than ``dynamic_math``'s are (torch's math
    SDPA backend: what a second correct implementation differs by). Needs both runs."""
    at = {r["config"]: r for r in rows if r["prompt_tokens"] == length}
    key = "forced_rel_err_to_dynamic"
    if key not in at.get("dynamic_math", {}):
        return {}
    bound = at["dynamic_math"][key]
    return {
        f"{c} forced diff<=dynamic_math's": at[c][key] <= bound
        for c in SAME_PRECISION
        if key in at.get(c, {})
    }
