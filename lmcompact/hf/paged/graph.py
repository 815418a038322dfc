"""CUDA graphs of a model's decode forward over a :class:`PagedCache`.

A decode step of a small or mid-sized model on a fast GPU is bound by the host:
Python and hundreds of kernel launches per step, while the GPU work is a few
milliseconds. A PagedCache's decode forward has fixed shapes and, once the
cache prepared the step (:meth:`PagedCache.prepare_decode_step`), reads every
changing value (block tables, lengths, write slots) from device buffers with
fixed addresses. So the whole forward can be captured once and replayed::

    generate -> model(input_ids (B, 1), past_key_values=cache)
        DecodeGraphs._call:
            cache.prepare_decode_step()         host: tables, COW, one upload
            ids, position -> static buffers
            graph.replay()                      every layer: write K/V, attend, MLP
            -> logits (a copy of the static output)

The first eligible step runs eagerly (it compiles the kernels and computes the
step), then the same step is captured again: writing the same K/V into the
same slots is idempotent. A new graph is captured when the batch changes or
the step buffers are rebuilt (a table outgrew their width). If a capture
fails, the runner logs why (``failure``) and every later step runs eagerly. Anything else
(prefill, a compaction pending, CPU tensors, extra outputs asked for) goes to
the model's own forward.

Positions come from the cache (``get_seq_length()``, the same for every
row) and the attention mask is not read (the ``"lmcompact"`` attention never
reads it): batches must be unpadded, as everywhere with a PagedCache.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from transformers.modeling_outputs import CausalLMOutputWithPast

from lmcompact.hf.paged.cache import PagedCache
from lmcompact.hf.paged.step import DecodeState

logger = logging.getLogger(__name__)

PASSED_THROUGH = frozenset(
    {"attention_mask", "position_ids", "use_cache", "return_dict", "logits_to_keep"}
)
"""Keyword arguments a graphed step accepts (and ignores): generate passes them."""


@dataclass
class _Captured:
    graph: torch.cuda.CUDAGraph
    input_ids: torch.Tensor
    position_ids: torch.Tensor
    logits: torch.Tensor
    state: DecodeState


class DecodeGraphs:
    """Replays a CUDA graph of ``model``'s decode forward when the cache is a PagedCache.

    Use as a context manager around ``generate`` (:func:`graphed_decode`), or
    :meth:`install` / :meth:`remove`. ``captures`` and ``replays`` count what
    happened (the benchmark reports them).

    Args:
        model: A transformers causal LM whose attention is ``"lmcompact"``.
    """

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._forward: Callable[..., Any] | None = None
        self._graphs: dict[int, _Captured] = {}
        self.captures = 0
        self.replays = 0
        self.eager_steps = 0
        self.failure: str | None = None

    def install(self) -> None:
        if self._forward is not None:
            return
        self._forward = original = self.model.forward

        @functools.wraps(original)  # generate inspects the forward's signature
        def forward(*args: Any, **kwargs: Any) -> Any:
            return self._call(*args, **kwargs)

        self.model.forward = forward  # type: ignore[method-assign]

    def remove(self) -> None:
        """Restore the model's own forward and free the graphs."""
        if self._forward is None:
            return
        del self.model.forward
        self._forward = None
        self._graphs.clear()

    # ------------------------------------------------------------------ calls
    def _call(
        self,
        input_ids: torch.Tensor | None = None,
        past_key_values: Any = None,
        **kwargs: Any,
    ) -> Any:
        forward = self._forward
        assert forward is not None
        if not self._eligible(input_ids, past_key_values, kwargs):
            self.eager_steps += 1
            return forward(input_ids=input_ids, past_key_values=past_key_values, **kwargs)
        assert input_ids is not None
        cache: PagedCache = past_key_values
        position = cache.get_seq_length()
        state = cache.prepare_decode_step()
        captured = self._graphs.get(input_ids.shape[0])
        if captured is None or captured.state is not state:
            return self._capture(input_ids, cache, position, state)
        captured.input_ids.copy_(input_ids)
        captured.position_ids.fill_(position)
        captured.graph.replay()
        self.replays += 1
        return _output(captured.logits.clone(), cache)

    def _eligible(self, input_ids: torch.Tensor | None, cache: Any, kwargs: dict[str, Any]) -> bool:
        if input_ids is None or input_ids.dim() != 2 or input_ids.shape[1] != 1:
            return False
        if self.failure is not None:
            return False
        if input_ids.device.type != "cuda" or not isinstance(cache, PagedCache):
            return False
        if any(k not in PASSED_THROUGH and v not in (None, False) for k, v in kwargs.items()):
            return False
        storage = cache.shared.storage
        if storage is None or storage.device != input_ids.device:
            return False
        from lmcompact.kernels.dispatch import use_kernels

        return use_kernels(input_ids.device) and cache.decoding(input_ids.shape[0])

    def _capture(
        self, input_ids: torch.Tensor, cache: PagedCache, position: int, state: DecodeState
    ) -> Any:
        """Run the prepared step eagerly, capture it again, keep the graph; return the eager
        output."""
        forward = self._forward
        assert forward is not None
        self._graphs.pop(input_ids.shape[0], None)
        static_ids = input_ids.clone()
        static_pos = torch.full_like(input_ids, position)
        inputs = {
            "input_ids": static_ids,
            "position_ids": static_pos,
            "past_key_values": cache,
            "use_cache": True,
            "return_dict": True,
        }
        out = forward(**inputs)  # the step itself, eagerly: kernels compile here
        logits = out.logits.clone()
        cache.mark_step_prepared()
        graph = torch.cuda.CUDAGraph()
        torch.cuda.synchronize()
        try:
            with torch.cuda.graph(graph):
                static_out = forward(**inputs)
        except RuntimeError as exc:  # the eager output stands; later steps stay eager
            self.failure = repr(exc)
            cache.clear_step_flags()
            logger.warning("CUDA graph capture failed, decoding eagerly from now on: %s", exc)
            return _output(logits, cache)
        self._graphs[input_ids.shape[0]] = _Captured(
            graph, static_ids, static_pos, static_out.logits, state
        )
        self.captures += 1
        logger.info(
            "captured the decode step of %d rows (%d layers) in a CUDA graph",
            input_ids.shape[0],
            state.num_layers,
        )
        return _output(logits, cache)


def _output(logits: torch.Tensor, cache: PagedCache) -> CausalLMOutputWithPast:
    return CausalLMOutputWithPast(logits=logits, past_key_values=cache)  # type: ignore[arg-type]


@contextmanager
def graphed_decode(model: torch.nn.Module) -> Iterator[DecodeGraphs]:
    """Decode steps of ``model`` over a PagedCache replay CUDA graphs inside this block.

    Example::

        with graphed_decode(model) as graphs:
            out = model.generate(ids, num_beams=4, past_key_values=cache)
        print(graphs.captures, graphs.replays)
    """
    graphs = DecodeGraphs(model)
    graphs.install()
    try:
        yield graphs
    finally:
        graphs.remove()
