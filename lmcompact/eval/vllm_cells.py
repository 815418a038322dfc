"""The cells of ``lmcompact eval --engine vllm``: what one run measures
(:class:`VllmEvalConfig`), its cases, and each cell's connector options.

A cell is one (mode, policy, budget); the modes (``save``, ``load``, ``inplace``) and the
full-cache baseline are described in :mod:`lmcompact.eval.vllm_runner`, which runs them.
Engine-free: nothing here imports vLLM.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from lmcompact.eval import tasks
from lmcompact.eval.text import haystack_text

TASKS = ("multi_needle", "needle")
MODES = ("default", "save", "load", "both", "inplace")
DEFAULT_MODE = "default"
"""The connector with nothing but ``budget`` (and a fresh store namespace): its defaults
choose the policy, where it runs and the store's encoding, as a ``vllm serve`` user who
sets only a budget gets them."""
STORED_MODES = ("default", "save", "load", "both")
BASELINE = "none"
"""``compact_on`` of the full-cache rows (no connector)."""


@dataclass
class VllmEvalConfig:
    """What one ``lmcompact eval --engine vllm`` run measures (validated on creation).

    Attributes:
        models: prepared model names or folders.
        policies: policy names (the connector refuses those it cannot run in vLLM).
        budgets: kept fractions in (0, 1).
        contexts: context lengths in tokens (multiples of ``chunk_size`` store whole).
        samples: contexts per cell and depth (``needle``) or per cell (``multi_needle``).
        depths: needle depths; ``multi_needle`` puts one needle per depth into one context.
        tasks: subset of :data:`TASKS`.
        modes: subset of :data:`MODES`.
        new_tokens: greedy tokens per question.
        chunk_size: store chunk, tokens.
        window: observation-window queries.
        seed: picks texts, passkeys and colors.
        reconstruct: in ``save`` mode, store contexts for policies that read context
            scores (``kvzip``) with KVzip's reconstruction request.
        policy_params: per policy name, ``policy_params`` of the connector (e.g.
            ``{"kvzip": {"share": True, "kernel_size": 15}}``).
        text: the haystacks' natural text, ``"pydoc"`` (Python's language reference) or
            ``"licenses"`` (Debian's license texts, :func:`lmcompact.eval.text.license_stream`).
        per_head_slack: in ``save`` mode, the connector's ``store.per_head`` slack (stored
            chunks keep per-(layer, head) counts, each at most ``slack`` x the budget's);
            None: one count per (layer, head).
        per_head_layer_slack: with ``per_head_slack``, the ``store.per_head`` layer slack
            (a layer's heads together keep at most ``layer_slack`` x the budget's per head:
            the blocks a loaded prefix holds); None: the connector's default (1).
        store_budget: in ``both`` mode, the stored kept fraction (``store.budget``); cells
            whose budget is not below it are skipped.
        store_policy: in ``both`` mode, the store's policy (``store.policy``); None: the
            connector's default.
        baseline: run the full-cache cell (False: its rows come from another run of the
            same cases).
        client_scores: store ``self_info`` contexts with scores the client computes and
            sends (``store.token_scores`` "client", a ``prompt_logprobs`` request first);
            False: the engine scores them during the storing request's own prefill.
    """

    models: list[str] = field(default_factory=lambda: ["smollm2"])
    policies: list[str] = field(default_factory=lambda: ["snapkv"])
    budgets: list[float] = field(default_factory=lambda: [0.5, 0.25])
    contexts: list[int] = field(default_factory=lambda: [2048])
    samples: int = 5
    depths: list[float] = field(default_factory=lambda: [0.1, 0.5, 0.9])
    tasks: list[str] = field(default_factory=lambda: ["multi_needle"])
    modes: list[str] = field(default_factory=lambda: list(MODES))
    new_tokens: int = 10
    chunk_size: int = 256
    window: int = 32
    seed: int = 0
    reconstruct: bool = True
    policy_params: dict[str, dict[str, Any]] = field(default_factory=dict)
    per_head_slack: float | None = None
    per_head_layer_slack: float | None = None
    text: str = "pydoc"
    store_budget: float = 0.5
    store_policy: str | None = None
    client_scores: bool = False
    baseline: bool = True

    def __post_init__(self) -> None:
        if self.text not in ("pydoc", "licenses"):
            raise ValueError(f"unknown haystack text {self.text!r}; allowed: pydoc, licenses")
        if self.per_head_slack is not None and not self.per_head_slack >= 1.0:
            raise ValueError(f"per_head_slack must be >= 1, got {self.per_head_slack}")
        bad = [t for t in self.tasks if t not in TASKS]
        if bad or not self.tasks:
            raise ValueError(f"unknown tasks {bad or self.tasks}; allowed: {', '.join(TASKS)}")
        bad = [m for m in self.modes if m not in MODES]
        if bad or not self.modes:
            raise ValueError(
                f"unknown --compact-on modes {bad or self.modes}; allowed: {', '.join(MODES)}"
            )
        for budget in self.budgets:
            if not 0.0 < budget < 1.0:
                raise ValueError(f"budgets must be ratios in (0, 1), got {budget}")
        for context in self.contexts:
            if context < 2 * self.chunk_size:
                raise ValueError(f"context must be >= {2 * self.chunk_size} tokens, got {context}")
        if not self.depths or any(not 0.0 <= d <= 1.0 for d in self.depths):
            raise ValueError(f"depths must be in [0, 1], got {self.depths}")
        bad = [p for p in self.policy_params if p not in self.policies]
        if bad:
            raise ValueError(f"policy_params for {bad}, which are not among the policies")
        if self.samples < 1 or self.new_tokens < 1:
            raise ValueError(
                f"samples and new_tokens must be >= 1, got {self.samples}, {self.new_tokens}"
            )


@dataclass(frozen=True)
class Case:
    """One stored context and the questions asked against it."""

    task: str
    context: int
    sample: int
    stored: tasks.StoredContext


def build_cases(tokenizer: Any, config: VllmEvalConfig, context: int) -> list[Case]:
    """Deterministic contexts of one length for every task."""
    cases = []
    for task in config.tasks:
        for index in range(config.samples):
            seed = config.seed * 1000 + index
            if task == "multi_needle":
                stored = tasks.build_stored_context(
                    tokenizer, context, seed, config.depths, haystack_text(config.text, seed)
                )
                cases.append(Case(task, context, index, stored))
                continue
            for d, depth in enumerate(config.depths):
                cseed = seed * 10 + d
                stored = tasks.build_stored_context(
                    tokenizer, context, cseed, [depth], haystack_text(config.text, cseed)
                )
                cases.append(Case(task, context, index, stored))
    return cases


def connector_extra(
    mode: str, policy: str, budget: float, config: VllmEvalConfig, namespace: str
) -> dict[str, Any]:
    """``kv_connector_extra_config`` of one cell (saves inline, so a question always finds
    what the first request stored; the ``default`` mode keeps the background saves and the
    runner waits for them)."""
    if mode == DEFAULT_MODE:
        store_options: dict[str, Any] = {"model_id": namespace}
        if config.chunk_size != VllmEvalConfig.chunk_size:
            store_options["chunk_size"] = config.chunk_size
        return {"budget": budget, "store": store_options}
    store: dict[str, Any] = {
        "chunk_size": config.chunk_size,
        "async_save": False,
        "model_id": namespace,
    }
    store["token_scores"] = "client" if config.client_scores else "engine"
    extra: dict[str, Any] = {
        "policy": policy,
        "budget": budget,
        "window": config.window,
        "store": store,
    }
    if config.policy_params.get(policy):
        extra["policy_params"] = dict(config.policy_params[policy])
    if mode == "save":
        store["compact_on"] = "save"
        extra["release"] = {"prefill": "off"}
        if config.per_head_slack is not None:
            store["per_head"] = {"slack": config.per_head_slack}
            if config.per_head_layer_slack is not None:
                store["per_head"]["layer_slack"] = config.per_head_layer_slack
    elif mode == "both":
        store.update(compact_on="both", budget=config.store_budget)
        if config.store_policy is not None:
            store["policy"] = config.store_policy
        extra["release"] = {"prefill": "pack"}
    elif mode == "load":
        store["compact_on"] = "load"
        extra["release"] = {"prefill": "pack"}
    elif mode == "inplace":
        store.update(save=False, load=False)
        extra["release"] = {"prefill": "pack"}
    else:
        raise ValueError(f"unknown mode {mode!r}; allowed: {', '.join(MODES)}")
    return extra


def uses_reconstruction(mode: str, policy: str, config: VllmEvalConfig) -> bool:
    """Whether the cell stores its contexts with KVzip's reconstruction request."""
    if mode != "save" or not config.reconstruct or policy == BASELINE:
        return False
    from lmcompact.policies import Need, make_policy

    params = config.policy_params.get(policy, {})
    made = make_policy(policy, budget=0.5, **params)
    return Need.CONTEXT_SCORES in made.needs and not made.scores_given


def uses_surprisal(mode: str, policy: str, config: VllmEvalConfig) -> bool:
    """Whether the cell stores its contexts with given surprisal scores (``self_info``:
    context scores it cannot compute from the request's own queries)."""
    if mode != "save" or policy == BASELINE:
        return False
    from lmcompact.policies import make_policy

    made = make_policy(policy, budget=0.5, **config.policy_params.get(policy, {}))
    return made.scores_given and config.client_scores


def policy_label(policy: str, config: VllmEvalConfig, reconstruct: bool, mode: str = "save") -> str:
    """The ``policy`` of a row: the name, ``+reconstruct`` when the store request was
    KVzip's reconstruction pass, any ``policy_params`` (``kvzip+reconstruct(share=True)``),
    ``@chunk N`` when the store chunk is not the default 256 tokens (rows of different
    chunk sizes must not merge as one cell), and ``/per_head S`` for save rows with
    ``store.per_head``."""
    label = policy + ("+reconstruct" if reconstruct else "")
    if config.client_scores and uses_surprisal(mode, policy, config):
        label += "+client_scores"
    params = config.policy_params.get(policy)
    if params:
        label += "(" + ",".join(f"{k}={v}" for k, v in sorted(params.items())) + ")"
    if config.chunk_size != VllmEvalConfig.chunk_size:
        label += f"@chunk{config.chunk_size}"
    if config.per_head_slack is not None and mode == "save":
        label += f"/per_head{config.per_head_slack:g}"
        if config.per_head_layer_slack is not None:
            label += f"x{config.per_head_layer_slack:g}"
    if mode == "both":
        label += f"<-{config.store_policy or 'self_info'}@{config.store_budget:g}"
    return label if mode != DEFAULT_MODE else DEFAULT_MODE


def cells(config: VllmEvalConfig) -> Iterator[tuple[str, str, float]]:
    """``(mode, policy, budget)`` of every compacted cell, baseline first."""
    if config.baseline:
        yield BASELINE, BASELINE, 1.0
    for mode in config.modes:
        if mode == DEFAULT_MODE:
            yield from ((mode, "auto", budget) for budget in config.budgets)
            continue
        for policy in config.policies:
            for budget in config.budgets:
                if mode == "both" and budget >= config.store_budget:
                    continue  # the store must keep more than the final budget
                yield mode, policy, budget


def count_questions(cases: list[Case]) -> int:
    return sum(len(c.stored.question_ids) for c in cases)
