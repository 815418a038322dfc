"""``lmcompact bench hf-beam``: beam search with PagedCache vs transformers' DynamicCache.

For each prompt length the same prompt runs through ``model.generate`` with
``num_beams`` beams and a fixed number of new tokens (EOS suppressed), once per
cache configuration, in one process::

    dynamic             DynamicCache, SDPA attention (the transformers default)
    dynamic_math        the same with SDPA's math backend only (a second torch
                        implementation: how far rounding alone moves the beams)
    paged               PagedCache, model dtype
    paged_eager         the same, never a CUDA graph (on the CPU: the same as paged)
    paged_int8          PagedCache, int8 K/V
    paged_compact       PagedCache, policy at --ratio after prefill
    paged_int8_compact  both

On CUDA (``--cuda-graphs``, the default there) the PagedCache configurations
decode through a CUDA graph of the model's forward
(:mod:`lmcompact.hf.paged.graph`): the cache prepares each step on the host in
one pass and the graph replays every layer. The cache and its graph are made
once per (prompt, config) and reused by the warm-up and the timed run (as a
server keeps them), so the capture is not timed; ``graph_captures`` says how
many happened in the timed run.

Measured per run (forward hooks on the model):

* ``decode_s_per_token``: wall time from the end of the prefill forward to the
  end of ``generate``, over the decode steps (``new_tokens - 1``). It includes
  the cache's reorder between steps, which is where DynamicCache copies.
* ``peak_kv_bytes``: the most K/V bytes the cache held after any forward
  (DynamicCache: its tensors' bytes; PagedCache: blocks in use x bytes per
  block, scales included). The pool's preallocated capacity is reported apart,
  and on CUDA ``cuda_peak_allocated_bytes`` (``torch.cuda.max_memory_allocated``
  over the run: weights, activations and the whole pool included).

On CUDA every timestamp is taken after ``torch.cuda.synchronize()``, and each
(prompt length, config) pair first runs a short untimed ``generate`` with the
same prompt (``--warmup``, default on CUDA) so that Triton compilation and
CUDA library setup are not timed. ``--random-weights`` builds the model from
the folder's ``config.json`` alone and feeds seeded random token ids (no
tokenizer, no weights needed); ``--shape 1b`` / ``8b`` does the same with the
Llama-3.2-1B / Llama-3-8B shapes built in (:data:`SHAPES`). ``--dtype`` sets
the model's (and so the cache's) dtype; ``--sdpa-backends`` limits the SDPA
backends of every configuration (DynamicCache's decode attention and every
prefill use SDPA; torch 2.11 on the H200 picks cuDNN for these decode shapes
by default). ``--profile N`` runs N more decode
steps per configuration under the torch profiler and reports, per step, host
time and the CUDA runtime calls (kernel launches, copies, synchronizations).

``same_tokens_as_dynamic`` compares the generated tokens; in bf16/fp16 two
attention implementations round differently and beams on random weights
(near-tied logits) part after some steps, so ``common_prefix_tokens`` says
how many leading tokens agree. ``--score-fp32`` (default on below float32)
judges accuracy against the same model in float32 instead
(:mod:`lmcompact.bench.hf_beam_score`): every configuration decodes
DynamicCache's tokens teacher-forced (``forced_rel_err_to_dynamic``; goal: a
paged configuration is no farther from DynamicCache than ``dynamic_math`` is;
``forced_logit_rel_err``: the distance to the float32 logits) and each beam is
scored by a float32 forward (``fp32_logprob_gap``).

``beam_time_ratio`` = paged / dynamic decode time per token and
``beam_kv_memory_ratio`` = paged / dynamic peak KV bytes, at the longest prompt.
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path
from typing import Any

from lmcompact.bench.hf_beam_report import CONFIGS, GOALS, plot_rows, summarize
from lmcompact.bench.hf_beam_runs import (
    SDPA_BACKENDS,
    Setup,
    one_run,
    profile_decode,
    release,
    sdpa_backends,
)
from lmcompact.bench.hf_beam_score import forced_logits, reference_rows
from lmcompact.bench.shapes import LLAMA_SHAPES
from lmcompact.results import format_table, write_json

NAME = "hf-beam"
HELP = "beam search in transformers generate: PagedCache (+int8, +compaction) vs DynamicCache"
logger = logging.getLogger(__name__)

__all__ = ["CONFIGS", "GOALS", "add_arguments", "run"]

DTYPES = ("float32", "bfloat16", "float16")
SHAPES: dict[str, dict[str, Any]] = {
    "1b": LLAMA_SHAPES["1b"],
    # the 8B shape's trained context, enough for these prompts
    "8b": {**LLAMA_SHAPES["8b"], "max_position_embeddings": 8192},
}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", help="prepare_model name or HF folder")
    parser.add_argument(
        "--shape",
        choices=sorted(SHAPES),
        default=None,
        help="random weights at a built-in Llama shape (1b: Llama-3.2-1B, 8b: Llama-3-8B); "
        "overrides --model",
    )
    parser.add_argument("--dtype", choices=DTYPES, default="float32", help="model and KV dtype")
    parser.add_argument(
        "--cuda-graphs",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="PagedCache decode steps replay a CUDA graph on CUDA (paged_eager never does)",
    )
    parser.add_argument(
        "--sdpa-backends",
        default=None,
        help="comma-separated SDPA backends allowed for every config (from "
        + ",".join(SDPA_BACKENDS)
        + "; default: torch's choice). DynamicCache's decode attention and every prefill run "
        "through SDPA",
    )
    parser.add_argument(
        "--profile",
        type=int,
        default=0,
        metavar="STEPS",
        help="profile this many extra decode steps per config (torch profiler)",
    )
    parser.add_argument(
        "--score-fp32",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="after the runs, score every beam's tokens with a float32 forward of the same "
        "model (default: on when --dtype is not float32; converts the model in place)",
    )
    parser.add_argument("--prompt-lengths", default="1024,4096", help="comma-separated")
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--beams", type=int, default=4)
    parser.add_argument("--block-size", type=int, default=64)
    parser.add_argument("--policy", default="snapkv", help="compaction policy name")
    parser.add_argument("--ratio", type=float, default=0.5, help="compaction budget ratio")
    parser.add_argument(
        "--configs", default=",".join(CONFIGS), help="subset of " + ",".join(CONFIGS)
    )
    parser.add_argument("--device", default="cpu")
    parser.add_argument(
        "--warmup",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="an untimed short generate per run first (default: on for CUDA, off for CPU)",
    )
    parser.add_argument(
        "--random-weights",
        action="store_true",
        help="build the model from the folder's config.json with seeded random weights and "
        "feed seeded random token ids (no tokenizer or weights needed; times and KV bytes are "
        "those of the real model, the tokens are not meaningful)",
    )
    parser.add_argument(
        "--quick", action="store_true", help="CPU sizes: one 1024-token prompt, 32 new tokens"
    )
    parser.add_argument("--json", default=None, help="write results here ('-' for stdout)")
    parser.add_argument("--plot", default=None, help="PNG path (default: beside --json)")


def _random_ids(vocab_size: int, length: int) -> Any:
    """Seeded random token ids ``(1, length)`` (the prompt of a random-weight model)."""
    import torch

    gen = torch.Generator().manual_seed(length)
    return torch.randint(0, vocab_size, (1, length), generator=gen)


def _prompt_ids(tokenizer: Any, length: int) -> Any:
    """The first ``length`` tokens of Python's own documentation topics (public domain text)."""
    from pydoc_data.topics import topics

    import torch

    text = "\n\n".join(topics[k] for k in sorted(topics))
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :length]
    if ids.shape[1] < length:
        raise ValueError(f"prompt text has only {ids.shape[1]} tokens, asked for {length}")
    return ids.to(torch.long)


def run(args: argparse.Namespace) -> int:
    import torch
    import transformers
    from tqdm import tqdm
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from lmcompact.kernels.dispatch import use_kernels

    if args.quick:
        args.prompt_lengths, args.new_tokens = "1024", 32
    lengths = [int(x) for x in args.prompt_lengths.split(",")]
    configs = [c.strip() for c in args.configs.split(",")]
    bad = [c for c in configs if c not in CONFIGS]
    if bad or "dynamic" not in configs:
        raise ValueError(f"--configs must include 'dynamic' and come from {CONFIGS}; got {configs}")
    if args.new_tokens < 2 or args.beams < 1:
        raise ValueError(
            f"need --new-tokens >= 2 and --beams >= 1, got {args.new_tokens}, {args.beams}"
        )
    if args.profile < 0:
        raise ValueError(f"--profile must be >= 0, got {args.profile}")
    dtype = getattr(torch, args.dtype)
    device = torch.device(args.device)
    random_weights = args.random_weights or args.shape is not None
    if random_weights:
        if args.shape is not None:
            model_config = transformers.LlamaConfig(**SHAPES[args.shape])
        else:
            model_config = AutoConfig.from_pretrained(_folder(args.model))
        torch.manual_seed(0)
        with device:  # initialize on the device: an 8B model in seconds, not minutes
            model = AutoModelForCausalLM.from_config(model_config, dtype=dtype)
        prompt = lambda n: _random_ids(model_config.vocab_size, n)  # noqa: E731
    else:
        folder = _folder(args.model)
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        prompt = lambda n: _prompt_ids(tokenizer, n)  # noqa: E731
    model = model.to(device).eval()
    warmup = device.type == "cuda" if args.warmup is None else args.warmup

    score = args.dtype != "float32" if args.score_fp32 is None else args.score_fp32
    rows: list[dict[str, Any]] = []
    forced: dict[tuple[int, str], Any] = {}  # teacher-forced logits per (prompt, config)
    configs.sort(key=lambda c: c != "dynamic")  # DynamicCache's tokens are the ones forced
    todo = [(t, c) for t in lengths for c in configs]
    for length, config in tqdm(todo, desc="bench hf-beam"):
        ids = prompt(length).to(device)
        setup = Setup(model, ids, config, args)
        backends = "math" if config == "dynamic_math" else args.sdpa_backends
        try:
            if warmup:  # compile kernels, capture graphs, set up libraries: not timed
                with sdpa_backends(backends):
                    one_run(setup, ids, args, new_tokens=4)
            with sdpa_backends(backends):
                rows.append(one_run(setup, ids, args))
                if score:
                    forced[length, config] = _forced(setup, ids, rows, args.beams)
            if args.profile:
                try:
                    with sdpa_backends(backends):
                        rows[-1]["profile"] = profile_decode(setup, ids, args)
                except Exception as exc:  # a profiler failure must not lose the timings
                    logger.warning("profiling %s failed: %s", config, exc)
                    rows[-1]["profile"] = {"error": repr(exc), "calls_per_step": {}}
        finally:
            setup.close()
    if score:
        reference_rows(model, prompt, rows, forced)
    summary = summarize(rows, max(lengths))
    for row in rows:
        base = next(
            r
            for r in rows
            if r["config"] == "dynamic" and r["prompt_tokens"] == row["prompt_tokens"]
        )
        row["time_ratio"] = row["decode_s_per_token"] / base["decode_s_per_token"]
        row["kv_memory_ratio"] = row["peak_kv_bytes"] / base["peak_kv_bytes"]
        row["same_tokens_as_dynamic"] = row["tokens"] == base["tokens"]
        row["common_prefix_tokens"] = _common_prefix(row["tokens"], base["tokens"])
    columns = [
        "prompt_tokens",
        "config",
        "prefill_s",
        "decode_s_per_token",
        "time_ratio",
        "peak_kv_bytes",
        "kv_memory_ratio",
        "same_tokens_as_dynamic",
        "common_prefix_tokens",
    ]
    if score:
        columns += ["forced_rel_err_to_dynamic", "forced_logit_rel_err", "fp32_logprob_gap"]
    print(format_table(rows, columns))
    for row in rows:
        if "profile" in row:
            calls = ", ".join(f"{k} {v:.1f}" for k, v in row["profile"]["calls_per_step"].items())
            print(f"profile {row['prompt_tokens']} {row['config']} per decode step: {calls}")
    print(format_table([summary["goals"]]))
    payload = {
        "benchmark": "hf-beam",
        "config": {
            "model": f"random weights, {args.shape} shape" if args.shape else str(args.model),
            "shape": SHAPES[args.shape] if args.shape else None,
            "cuda_graphs": args.cuda_graphs and device.type == "cuda",
            "sdpa_backends": args.sdpa_backends or "torch default",
            "score_fp32": score,
            "prompt_lengths": lengths,
            "new_tokens": args.new_tokens,
            "beams": args.beams,
            "block_size": args.block_size,
            "policy": args.policy,
            "ratio": args.ratio,
            "device": args.device,
            "device_name": _device_name(device),
            "dtype": args.dtype,
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "triton": _triton_version(),
            "kernels": use_kernels(device),
            "warmup": warmup,
            "random_weights": random_weights,
            "prompt": "seeded random ids" if random_weights else "pydoc topics text",
        },
        **summary,
        "results": rows,
    }
    write_json(args.json, payload)
    if args.json and args.json != "-":
        plot = Path(args.plot) if args.plot else Path(args.json).with_suffix(".png")
        try:
            title = f"beam search x{args.beams}, {args.new_tokens} new tokens, {args.dtype}"
            title += f", {device}"
            plot_rows(rows, plot, title)
        except ImportError:
            logger.warning("matplotlib is not installed: no plot (the JSON is written)")
    return 0


def _forced(setup: Setup, ids: Any, rows: list[dict[str, Any]], beams: int) -> Any:
    """Teacher-forced logits of ``setup``'s cache on DynamicCache's tokens for ``ids``."""
    base = next(r for r in rows if r["config"] == "dynamic" and r["prompt_tokens"] == ids.shape[1])
    cache, _ = setup.fresh_cache()
    logits = forced_logits(setup.model, cache, ids, base["tokens"], beams)
    if setup.cache is not None:
        release(cache, {})
    return logits


def _folder(model: str) -> Path:
    from lmcompact.hf.prepare import prepare_model

    return Path(model) if Path(model).is_dir() else prepare_model(model)


def _common_prefix(a: list[int], b: list[int]) -> int:
    """Leading tokens ``a`` and ``b`` agree on."""
    n = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        n += 1
    return n


def _device_name(device: Any) -> str:
    import platform

    import torch

    if device.type == "cuda":
        return str(torch.cuda.get_device_name(device))
    return platform.processor() or platform.machine()


def _triton_version() -> str | None:
    try:
        import triton  # type: ignore[import-untyped]
    except ImportError:
        return None
    return str(triton.__version__)
