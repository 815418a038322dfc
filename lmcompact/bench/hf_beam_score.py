"""How likely each configuration's beam is, judged by one float32 reference forward.

In bf16/fp16 two attention implementations round differently. On a random-weight
model (near-uniform logits over a large vocabulary) beam search's candidates are
nearly tied, so the beams of two correct implementations part after a few steps;
torch's own SDPA backends do the same to each other (the ``dynamic_math`` control).
"Same tokens" is then the wrong test of correctness. The right one: is the beam a
configuration returned as likely as DynamicCache's, under the same model evaluated
in float32? Beam search maximizes the summed log-probability of the new tokens
(all beams have the same length here, so the length penalty does not reorder
them); :func:`sequence_logprob` computes that sum with one cache-free float32
forward (transformers applies ``min_new_tokens``'s EOS mask after the log-softmax,
so the sum is over plain log-softmax values).
"""

from __future__ import annotations

from typing import Any

# the configurations whose tokens should match DynamicCache's up to rounding
# (int8 K/V and compaction change the model's inputs on purpose)
SAME_PRECISION = ("paged", "paged_eager")


def sequence_logprob(model: Any, prompt_ids: Any, tokens: list[int]) -> float:
    """Sum over ``tokens`` of log p(token | prompt, earlier tokens), float32 math.

    ``model`` is evaluated in its current dtype (call ``model.float()`` first);
    ``prompt_ids`` is ``(1, P)`` on the model's device. The result is beam
    search's own score of the beam with ``length_penalty=0``.
    """
    import torch

    new = torch.tensor([tokens], dtype=prompt_ids.dtype, device=prompt_ids.device)
    inputs = torch.cat([prompt_ids, new[:, :-1]], dim=1)
    with torch.inference_mode():
        logits = model(input_ids=inputs, logits_to_keep=len(tokens)).logits[0].float()
        logprobs = torch.log_softmax(logits, dim=-1)
        return float(logprobs.gather(1, new[0, :, None]).sum())


def score_rows(model: Any, prompt: Any, rows: list[dict[str, Any]]) -> None:
    """Add ``fp32_logprob`` to every row and ``fp32_logprob_gap`` (row minus the
    ``dynamic`` row of the same prompt; positive: a likelier beam) in place.

    ``prompt(length)`` gives the prompt ids ``(1, length)`` the rows were run with.
    The model is converted to float32 in place and set to SDPA attention.
    """
    import torch

    model.float()
    model.set_attn_implementation("sdpa")
    device = next(model.parameters()).device
    for length in sorted({r["prompt_tokens"] for r in rows}):
        ids = prompt(length).to(device)
        at = [r for r in rows if r["prompt_tokens"] == length]
        for row in at:
            row["fp32_logprob"] = sequence_logprob(model, ids, row["tokens"])
        base = next(r for r in at if r["config"] == "dynamic")["fp32_logprob"]
        for row in at:
            row["fp32_logprob_gap"] = row["fp32_logprob"] - base
        if device.type == "cuda":
            torch.cuda.empty_cache()


def beam_goals(rows: list[dict[str, Any]], length: int) -> dict[str, bool]:
    """Per same-precision paged config at ``length``: its tokens are DynamicCache's, or
    its beam is at least as likely (float32 log-prob) as the less likely of the two
    DynamicCache runs (torch's default SDPA and ``dynamic_math``): whatever the two
    torch implementations disagree about is rounding, not an error of the cache."""
    at = {r["config"]: r for r in rows if r["prompt_tokens"] == length}
    if "fp32_logprob" not in at["dynamic"]:
        return {}
    floor = min(r["fp32_logprob"] for c, r in at.items() if c.startswith("dynamic"))
    return {
        f"{c} tokens or an as likely beam": bool(
            at[c]["tokens"] == at["dynamic"]["tokens"] or at[c]["fp32_logprob"] >= floor
        )
        for c in SAME_PRECISION
        if c in at
    }
