"""SnapKV during generation: re-rank the cache by the last window's attention every N steps."""

from __future__ import annotations

from dataclasses import dataclass

from lmcompact.policies.base import Need, Phase
from lmcompact.policies.snapkv import SnapKV


@dataclass
class DecodingSnapKV(SnapKV):
    """SnapKV at the end of prefill and again every ``interval`` generated tokens.

    Li et al., "SnapKV: LLM Knows What You are Looking for Before Generation",
    https://arxiv.org/abs/2404.14469, applied during decoding as kvpress's
    ``DecodingPress`` applies a scorer: every ``interval`` steps the cache goes back to its
    budget, each (layer, head) keeping the tokens the last ``window_size`` queries attend to
    most (max-pooled along the sequence, width ``kernel_size``) plus the window's own tokens.

    During decode the window queries are the last ``window_size`` generated tokens, and the
    most recent ``window_size`` candidates (their own keys) are kept; a caller that keeps
    its recent tokens elsewhere passes the window's tokens as the newest candidates and
    takes the others from the plan.

    Shapes: window_scores ``(H, T)`` (mass summed over the window queries, softmax over
    every key each query sees, GQA-averaged) -> scores ``(H, T)``; the window scores +inf.

    Attributes:
        interval: Generated tokens between two re-compactions (kvpress's
            ``compression_interval``) in the transformers cache; the vLLM connector
            re-compacts whenever a block leaves its decode budget (every block of tokens).
    """

    name = "decoding_snapkv"
    needs = Need.WINDOW_SCORES
    phases = Phase.BOTH

    interval: int = 32

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.interval < 1:
            raise ValueError(f"interval must be >= 1, got {self.interval}")
