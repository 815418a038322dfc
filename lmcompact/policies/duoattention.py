"""DuoAttention: retrieval heads keep everything, streaming heads keep sinks + recent."""

from __future__ import annotations

import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from lmcompact.plan import KeepPlan
from lmcompact.policies._select import recent_mask, sink_mask
from lmcompact.policies.base import Budget, CompactionInputs, CompactionPolicy, Need, Phase

logger = logging.getLogger(__name__)


@dataclass
class DuoAttention(CompactionPolicy):
    """Split heads into retrieval heads (full KV) and streaming heads (sinks + recent).

    Xiao et al., "DuoAttention: Efficient Long-Context LLM Inference with
    Retrieval and Streaming Heads", https://arxiv.org/abs/2410.10819. A head
    pattern gives every (layer, kv_head) a score, higher meaning more
    retrieval-like (the paper's learned gate ``alpha``). Retrieval heads keep all
    valid candidates; streaming heads keep the candidates at original positions
    ``< sink_size`` plus the ``recent_size`` most recent ones.

    Which heads are retrieval heads: with ``threshold`` set, those scoring
    ``>= threshold``; otherwise the ``sparsity`` fraction of all heads with the
    lowest scores are streaming heads (the paper's 50% for GQA models).

    Where the pattern comes from, first match wins: ``head_scores`` (nested
    lists ``[layer][kv_head]``), ``pattern_path`` (see :func:`load_head_scores`),
    else a calibration pass on the inputs' own window attention
    (:func:`calibrate_head_scores`; then ``needs`` is WINDOW_ATTENTION). The
    paper learns the gates by optimization on synthetic passkey data; the
    calibration here is a cheaper stand-in computed from attention.

    Budget: ignored (the kept fraction follows from the pattern, ``sparsity``
    and the two sizes); it defaults to 1.0.

    Shapes: head pattern ``(layers, kv_heads)``; window_attention ``(H, W, T)``
    when calibrating.

    Attributes:
        sink_size: Initial tokens a streaming head keeps (paper: 64).
        recent_size: Recent tokens a streaming head keeps (paper: 256).
        sparsity: Fraction of heads that are streaming heads, in [0, 1].
        threshold: Score at or above which a head is a retrieval head; when set,
            it takes precedence over ``sparsity``.
        head_scores: In-memory head pattern ``[layer][kv_head]``.
        pattern_path: File with the head pattern (.json, .npy, .tsv/.csv/.txt).
    """

    name = "duoattention"
    needs = Need.WINDOW_ATTENTION
    phases = Phase.BOTH

    budget: Budget = field(default_factory=lambda: Budget(ratio=1.0))
    sink_size: int = 64
    recent_size: int = 256
    sparsity: float = 0.5
    threshold: float | None = None
    head_scores: list[list[float]] | None = None
    pattern_path: str | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.sink_size < 0 or self.recent_size < 0:
            raise ValueError(
                f"sink_size and recent_size must be >= 0, got {self.sink_size} and "
                f"{self.recent_size}"
            )
        if not 0.0 <= self.sparsity <= 1.0:
            raise ValueError(f"sparsity must be in [0, 1], got {self.sparsity}")
        if self.head_scores is not None and self.pattern_path is not None:
            raise ValueError("give either head_scores or pattern_path, not both")
        self._pattern: torch.Tensor | None = None
        if self.head_scores is not None:
            self._pattern = _as_pattern(self.head_scores, "head_scores")
        elif self.pattern_path is not None:
            self._pattern = load_head_scores(self.pattern_path)
        if self._pattern is not None:
            self.__dict__["needs"] = Need.NOTHING  # nothing to calibrate on

    def head_pattern(self, inputs: CompactionInputs) -> torch.Tensor:
        """``(layers, kv_heads)`` scores: the given pattern, or calibrated on ``inputs``."""
        if self._pattern is None:
            attention = self.require(inputs, "window_attention")
            return calibrate_head_scores(
                attention, self.sink_size, self.recent_size, inputs.positions, inputs.valid
            )
        expected = (inputs.num_layers, inputs.num_kv_heads)
        if tuple(self._pattern.shape) != expected:
            raise ValueError(
                f"duoattention head pattern has shape {tuple(self._pattern.shape)}, the inputs "
                f"have {expected[0]} layers x {expected[1]} kv heads; allowed: a pattern "
                "made for this model"
            )
        return self._pattern

    def retrieval_heads(self, inputs: CompactionInputs) -> torch.Tensor:
        """``(layers, kv_heads)`` bool, True for retrieval (full-KV) heads."""
        scores = self.head_pattern(inputs)
        if self.threshold is not None:
            return scores >= self.threshold
        flat = scores.flatten()
        streaming = round(self.sparsity * flat.numel())
        order = torch.sort(flat, stable=True).indices  # lowest first, ties by index
        retrieval = torch.ones(flat.numel(), dtype=torch.bool)
        retrieval[order[:streaming]] = False
        return retrieval.view_as(scores)

    def plan(self, inputs: CompactionInputs) -> KeepPlan:
        self.check_inputs(inputs)
        retrieval = self.retrieval_heads(inputs)
        valid = inputs.valid_or_all().cpu()
        streaming = sink_mask(inputs, self.sink_size) | recent_mask(inputs, self.recent_size)
        layers = []
        for layer in range(inputs.num_layers):
            keep = torch.where(retrieval[layer].unsqueeze(-1), valid, streaming)
            layers.append(tuple(torch.nonzero(row).flatten() for row in keep))
        return KeepPlan(seq_len=inputs.num_candidates, kept=tuple(layers))


def calibrate_head_scores(
    window_attention: Sequence[torch.Tensor],
    sink_size: int,
    recent_size: int,
    positions: torch.Tensor | None = None,
    valid: torch.Tensor | None = None,
) -> torch.Tensor:
    """Head pattern from attention over a prompt: the mass a streaming head would lose.

    For each window query at position ``p`` a streaming head sees the keys at
    positions ``< sink_size`` and in ``(p - recent_size, p]``. A head's score is
    ``1 - mean_w(mass on those keys)``: near 0 for heads that look only at sinks
    and recent tokens (streaming), high for heads that fetch from far back
    (retrieval). Run it on window attention of a calibration prompt (longer
    than ``sink_size + recent_size``) and save it with :func:`save_head_scores`.

    Args:
        window_attention: One ``(H, W, T)`` tensor per layer; rows sum to 1 over
            the keys each query sees.
        sink_size: Sink tokens of a streaming head.
        recent_size: Recent tokens of a streaming head.
        positions: ``(H, T)`` original key positions (default ``arange(T)``);
            the window queries are taken to follow the last key, at positions
            ``max - W + 1 .. max`` (the last W prompt tokens).
        valid: ``(H, T)`` bool; invalid (padding) slots are ignored.

    Returns:
        ``(layers, kv_heads)`` float32 scores in [0, 1].
    """
    out = []
    for attention in window_attention:
        heads, window, length = attention.shape
        keys = positions if positions is not None else torch.arange(length).expand(heads, -1)
        mask = valid.cpu() if valid is not None else torch.ones(heads, length, dtype=torch.bool)
        keys = keys.cpu().masked_fill(~mask, -1)
        last = keys.max(dim=-1, keepdim=True).values  # (H, 1)
        queries = last - window + 1 + torch.arange(window)  # (H, W)
        seen = (keys.unsqueeze(1) < sink_size) | (
            keys.unsqueeze(1) > queries.unsqueeze(-1) - recent_size
        )  # (H, W, T)
        rows = attention.detach().double().cpu() * mask.unsqueeze(1)
        covered = (rows * seen).sum(-1) / rows.sum(-1).clamp(min=1e-30)
        out.append(1.0 - covered.mean(dim=-1))
    return torch.stack(out).float().clamp(0.0, 1.0)


def _as_pattern(value: object, source: str) -> torch.Tensor:
    try:
        pattern = torch.as_tensor(np.asarray(value, dtype=np.float64), dtype=torch.float32)
    except (TypeError, ValueError) as error:
        raise ValueError(f"{source}: head pattern is not numeric: {error}") from None
    if pattern.dim() != 2 or pattern.numel() == 0:
        raise ValueError(
            f"{source}: head pattern must be 2-D (layers, kv_heads), got shape "
            f"{tuple(pattern.shape)}"
        )
    if not bool(torch.isfinite(pattern).all()):
        raise ValueError(f"{source}: head pattern has non-finite values")
    return pattern


def load_head_scores(path: str | Path) -> torch.Tensor:
    """Read a ``(layers, kv_heads)`` head pattern.

    Formats by suffix: ``.json`` (a list of per-layer lists, or an object with a
    ``"head_scores"`` list), ``.npy`` (a 2-D array), ``.tsv``/``.csv``/``.txt``
    (one row per layer, the layout of DuoAttention's released patterns).
    """
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"duoattention pattern file {str(path)!r} does not exist")
    suffix = path.suffix.lower()
    data: object
    if suffix == ".json":
        data = json.loads(path.read_text())
        if isinstance(data, dict):
            data = data.get("head_scores")
    elif suffix == ".npy":
        data = np.load(path, allow_pickle=False)
    elif suffix in (".tsv", ".csv", ".txt"):
        delimiter = "," if suffix == ".csv" else None
        data = np.loadtxt(path, delimiter=delimiter, ndmin=2)
    else:
        raise ValueError(
            f"unsupported head pattern file {str(path)!r}; allowed: .json, .npy, .tsv, .csv, .txt"
        )
    return _as_pattern(data, str(path))


def save_head_scores(path: str | Path, scores: torch.Tensor) -> None:
    """Write a ``(layers, kv_heads)`` pattern as JSON (``.json``) or NumPy (``.npy``)."""
    path = Path(path)
    pattern = _as_pattern(scores.detach().cpu().numpy(), "scores")
    if path.suffix.lower() == ".npy":
        np.save(path, pattern.numpy())
    elif path.suffix.lower() == ".json":
        path.write_text(json.dumps({"head_scores": pattern.tolist()}))
    else:
        raise ValueError(f"save_head_scores writes .json or .npy, got {str(path)!r}")
    logger.info("saved a %s head pattern to %s", tuple(pattern.shape), path)
