"""Holes cut in the runner's input buffers, where full CUDA graphs read them.

:class:`TableCutting` is a part of :class:`lmcompact.vllm.worker_side.WorkerHalf` (a mixin):
it is the :class:`lmcompact.vllm.vllm_shim.StepTableEditor` the runner hooks of
:func:`lmcompact.vllm.vllm_shim.hook_step_tables` call.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from lmcompact.vllm import vllm_shim as shim
from lmcompact.vllm.holes import cut_holes_in_place
from lmcompact.vllm.metadata import StepMetadata
from lmcompact.vllm.worker_state import WorkerState

logger = logging.getLogger(__name__)


class TableCutting(WorkerState):
    """Stages each step's holes and cuts them from the gathered block tables and key lengths."""

    full_graphs: bool
    cut_at_build: bool
    _staged: StepMetadata | None
    _cut_for: StepMetadata | None
    _stage_seen: bool
    _forward_expected: bool

    def _choose_hole_cutting(self) -> None:
        """Cut holes in the runner's buffers where the runner allows it (full CUDA graphs
        need it); sliding-window layers need a cut of their own per layer kind, which only
        the per-layer path makes, so with them full graphs are refused."""
        self.full_graphs = shim.full_cudagraphs(self.vllm_config)
        self.cut_at_build = (
            self.config.cuda_graphs == "full"
            and not self.sliding_layers
            and shim.hook_step_tables()
        )
        if self.full_graphs and not self.cut_at_build:
            why = (
                f"the model has {len(self.sliding_layers)} sliding-window layers, whose "
                "windows are cut per layer inside attention"
                if self.sliding_layers
                else f"this vLLM ({shim.vllm_version()}) has no runner hook for hole cuts"
                if self.config.cuda_graphs == "full"
                else 'kv_connector_extra_config "cuda_graphs" is "piecewise"'
            )
            raise ValueError(
                f"LMCompactConnector cannot run with full CUDA graphs here: {why}, which a "
                "replayed graph skips. Start vLLM with piecewise graphs "
                '(compilation_config={"cudagraph_mode": "PIECEWISE"}, CLI '
                "-cc.cudagraph_mode=PIECEWISE) or enforce_eager"
            )
        logger.info(
            "holes cut %s (full CUDA graphs %s)",
            "in the runner's input buffers where its hooks run (vLLM's V2 GPU runner)"
            if self.cut_at_build
            else "per attention layer",
            "on" if self.full_graphs else "off",
        )

    # ------------------------------------------------------------------ runner hooks
    def stage(self, connector_metadata: Any, uniform: bool, has_tokens: bool) -> bool:
        """The coming step's metadata (see :class:`lmcompact.vllm.vllm_shim.StepTableEditor`)."""
        step = getattr(connector_metadata, "step", None)
        self._staged = step if isinstance(step, StepMetadata) else None
        self._stage_seen = True
        self._forward_expected = has_tokens
        captures = self._staged is not None and bool(self._staged.captures)
        eager = self.full_graphs and uniform and captures
        if eager:
            self.stats["eager_capture_steps"] += 1
        return eager

    def edit_tables(
        self,
        req_ids: list[str],
        block_tables: tuple[torch.Tensor, ...],
        seq_lens: torch.Tensor,
        seq_lens_upper: torch.Tensor,
    ) -> torch.Tensor | None:
        """Cut the staged step's holes out of the runner's buffers, by request id."""
        step = self._staged
        self._cut_for = step
        if step is None or not step.holes:
            return None
        bs = self.facts.block_size
        row_of = {req_id: row for row, req_id in enumerate(req_ids)}
        rows: list[int] = []
        starts: list[int] = []
        lengths: list[int] = []
        for hole in step.holes.values():
            if not hole.req_id:
                raise RuntimeError(f"hole without a request id: {hole}")
            row = row_of.get(hole.req_id)
            if row is None:
                continue
            end = (hole.start_block + hole.num_blocks) * bs
            if int(seq_lens_upper[row]) <= end:
                raise ValueError(
                    f"{hole.req_id}: hole blocks [{hole.start_block}, "
                    f"{hole.start_block + hole.num_blocks}) need more than {end} keys, the "
                    f"step has {int(seq_lens_upper[row])}"
                )
            rows.append(row)
            starts.append(hole.start_block)
            lengths.append(hole.num_blocks)
        if not rows:
            return None
        if len(block_tables) != 1:
            raise ValueError(f"holes need one KV-cache group, the runner has {len(block_tables)}")
        cut_holes_in_place(block_tables[0], seq_lens, rows, starts, lengths, bs)
        upper = seq_lens_upper.clone()
        for row, length in zip(rows, lengths, strict=True):
            upper[row] -= length * bs
        self.stats["rows_cut_in_buffers"] += len(rows)
        return upper
