"""``lmcompact bench hf-beam``: beam search with PagedCache vs transformers' DynamicCache.

For each prompt length the same prompt runs through ``model.generate`` with
``num_beams`` beams and a fixed number of new tokens (EOS suppressed), once per
cache configuration, in one process::

    dynamic             DynamicCache, SDPA attention (the transformers default)
    paged               PagedCache, model dtype
    paged_int8          PagedCache, int8 K/V
    paged_compact       PagedCache, policy at --ratio after prefill
    paged_int8_compact  both

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
tokenizer, no weights needed).

``beam_time_ratio`` = paged / dynamic decode time per token and
``beam_kv_memory_ratio`` = paged / dynamic peak KV bytes, at the longest prompt.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path
from typing import Any

from lmcompact.cli._output import format_table, write_json

NAME = "hf-beam"
HELP = "beam search in transformers generate: PagedCache (+int8, +compaction) vs DynamicCache"
logger = logging.getLogger(__name__)

CONFIGS = ("dynamic", "paged", "paged_int8", "paged_compact", "paged_int8_compact")
GOALS = {"beam_time_ratio": 0.8, "paged_int8": 0.5, "paged_int8_compact": 0.3}


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2", help="prepare_model name or HF folder")
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


class _StepClock:
    """Forward hooks: prefill time, end of every forward, KV bytes after each forward."""

    def __init__(self, model: Any, kv_bytes: Any) -> None:
        import torch

        self.kv_bytes = kv_bytes
        cuda = next(model.parameters()).device.type == "cuda"
        self.sync = torch.cuda.synchronize if cuda else (lambda: None)
        self.starts: list[float] = []
        self.ends: list[float] = []
        self.kv: list[int] = []
        self._handles = [
            model.register_forward_pre_hook(lambda *_: self._mark(self.starts)),
            model.register_forward_hook(self._after),
        ]

    def _mark(self, into: list[float]) -> None:
        self.sync()
        into.append(time.perf_counter())

    def _after(self, *_: Any) -> None:
        self._mark(self.ends)
        self.kv.append(int(self.kv_bytes()))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _dynamic_kv_bytes(cache: Any) -> int:
    total = 0
    for layer in cache.layers:
        if getattr(layer, "keys", None) is not None and layer.keys.numel():
            total += layer.keys.nbytes + layer.values.nbytes
    return total


def _one_run(
    model: Any, ids: Any, config: str, args: argparse.Namespace, new_tokens: int | None = None
) -> dict[str, Any]:
    import torch

    new_tokens = args.new_tokens if new_tokens is None else new_tokens
    cuda = ids.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    from transformers import DynamicCache

    from lmcompact.hf.attention import enable_lmcompact_attention
    from lmcompact.hf.paged import PagedCache, blocks_needed
    from lmcompact.policies import make_policy

    cache: Any
    if config == "dynamic":
        model.set_attn_implementation("sdpa")
        cache = DynamicCache(config=model.config)
        kv_bytes = lambda: _dynamic_kv_bytes(cache)  # noqa: E731
    else:
        enable_lmcompact_attention(model)
        total = ids.shape[1] + new_tokens
        cache = PagedCache(
            model.config,
            num_blocks=blocks_needed(model.config, args.beams, total, args.block_size),
            block_size=args.block_size,
            kv_dtype="int8" if "int8" in config else "auto",
            policy=make_policy(args.policy, budget=args.ratio) if "compact" in config else None,
        )
        kv_bytes = cache.kv_bytes
    clock = _StepClock(model, kv_bytes)
    start = time.perf_counter()
    try:
        with torch.inference_mode():
            out = model.generate(
                ids,
                num_beams=args.beams,
                do_sample=False,
                max_new_tokens=new_tokens,
                min_new_tokens=new_tokens,
                past_key_values=cache,
                early_stopping=False,
            )
    finally:
        clock.remove()
    clock.sync()
    end = time.perf_counter()
    steps = max(new_tokens - 1, 1)
    row: dict[str, Any] = {
        "config": config,
        "prompt_tokens": int(ids.shape[1]),
        "prefill_s": clock.ends[0] - clock.starts[0],
        "decode_s_per_token": (end - clock.ends[0]) / steps,
        "total_s": end - start,
        "peak_kv_bytes": max(clock.kv),
        "final_kv_bytes": clock.kv[-1],
        "tokens": out[0, ids.shape[1] :].tolist(),
    }
    if cuda:
        row["cuda_peak_allocated_bytes"] = torch.cuda.max_memory_allocated()
    if config != "dynamic":
        row["pool_capacity_bytes"] = cache.kv_bytes(cache.pool.num_blocks)
        cache.check_accounting()
        cache.reset()
        row["pool_back_to_start"] = cache.pool.is_pristine()
    return row


def _plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    lengths = sorted({r["prompt_tokens"] for r in rows})
    configs = [c for c in CONFIGS if any(r["config"] == c for r in rows)]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    width = 0.8 / len(configs)
    for i, config in enumerate(configs):
        for ax, key, scale in (
            (axes[0], "decode_s_per_token", 1e3),
            (axes[1], "peak_kv_bytes", 2.0**-20),
        ):
            ys = [
                next(
                    (
                        r[key] * scale
                        for r in rows
                        if r["config"] == config and r["prompt_tokens"] == t
                    ),
                    0.0,
                )
                for t in lengths
            ]
            ax.bar([j + i * width for j in range(len(lengths))], ys, width, label=config)
    for ax, label in ((axes[0], "decode time per token (ms)"), (axes[1], "peak KV (MiB)")):
        ax.set_xticks([j + 0.4 - width / 2 for j in range(len(lengths))])
        ax.set_xticklabels([f"{t} prompt tokens" for t in lengths])
        ax.set_ylabel(label)
    axes[1].legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def run(args: argparse.Namespace) -> int:
    import torch
    import transformers
    from tqdm import tqdm
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    from lmcompact.hf.prepare import prepare_model
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
    folder = Path(args.model) if Path(args.model).is_dir() else prepare_model(args.model)
    if args.random_weights:
        torch.manual_seed(0)
        model_config = AutoConfig.from_pretrained(folder)
        model = AutoModelForCausalLM.from_config(model_config, dtype=torch.float32)
        prompt = lambda n: _random_ids(model_config.vocab_size, n)  # noqa: E731
    else:
        model = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
        tokenizer = AutoTokenizer.from_pretrained(folder)
        prompt = lambda n: _prompt_ids(tokenizer, n)  # noqa: E731
    model = model.to(args.device).eval()
    device = torch.device(args.device)
    warmup = device.type == "cuda" if args.warmup is None else args.warmup

    rows: list[dict[str, Any]] = []
    todo = [(t, c) for t in lengths for c in configs]
    for length, config in tqdm(todo, desc="bench hf-beam"):
        ids = prompt(length).to(args.device)
        if warmup:  # compile kernels, set up libraries: not timed
            _one_run(model, ids, config, args, new_tokens=4)
        rows.append(_one_run(model, ids, config, args))
    summary = _summarize(rows, max(lengths))
    for row in rows:
        base = next(
            r
            for r in rows
            if r["config"] == "dynamic" and r["prompt_tokens"] == row["prompt_tokens"]
        )
        row["time_ratio"] = row["decode_s_per_token"] / base["decode_s_per_token"]
        row["kv_memory_ratio"] = row["peak_kv_bytes"] / base["peak_kv_bytes"]
        row["same_tokens_as_dynamic"] = row["tokens"] == base["tokens"]
    columns = [
        "prompt_tokens",
        "config",
        "prefill_s",
        "decode_s_per_token",
        "time_ratio",
        "peak_kv_bytes",
        "kv_memory_ratio",
        "same_tokens_as_dynamic",
    ]
    print(format_table(rows, columns))
    print(format_table([summary["goals"]]))
    payload = {
        "benchmark": "hf-beam",
        "config": {
            "model": str(args.model),
            "prompt_lengths": lengths,
            "new_tokens": args.new_tokens,
            "beams": args.beams,
            "block_size": args.block_size,
            "policy": args.policy,
            "ratio": args.ratio,
            "device": args.device,
            "device_name": _device_name(device),
            "dtype": "float32",
            "torch_threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
            "triton": _triton_version(),
            "kernels": use_kernels(device),
            "warmup": warmup,
            "random_weights": args.random_weights,
            "prompt": "seeded random ids" if args.random_weights else "pydoc topics text",
        },
        **summary,
        "results": rows,
    }
    write_json(args.json, payload)
    if args.json and args.json != "-":
        plot = Path(args.plot) if args.plot else Path(args.json).with_suffix(".png")
        try:
            _plot(rows, plot, f"beam search x{args.beams}, {args.new_tokens} new tokens, {device}")
        except ImportError:
            logger.warning("matplotlib is not installed: no plot (the JSON is written)")
    return 0


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


def _summarize(rows: list[dict[str, Any]], length: int) -> dict[str, Any]:
    at = {r["config"]: r for r in rows if r["prompt_tokens"] == length}
    base = at["dynamic"]
    time_ratio = (
        at["paged"]["decode_s_per_token"] / base["decode_s_per_token"] if "paged" in at else None
    )
    memory = {
        c: r["peak_kv_bytes"] / base["peak_kv_bytes"] for c, r in at.items() if c != "dynamic"
    }
    goals: dict[str, Any] = {"at_prompt_tokens": length}
    if time_ratio is not None:
        goals["beam_time_ratio<=0.8"] = time_ratio <= GOALS["beam_time_ratio"]
    for config in ("paged_int8", "paged_int8_compact"):
        if config in memory:
            goals[f"{config} memory<={GOALS[config]}"] = memory[config] <= GOALS[config]
    return {"beam_time_ratio": time_ratio, "beam_kv_memory_ratio": memory, "goals": goals}
