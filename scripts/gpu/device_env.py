"""Shared start of the GPU check scripts in this folder (imported before vLLM or torch).

Sets the in-process vLLM environment the device machine needs (``.vcarry/py`` joins
``sys.path`` when the machine lacks the store's ``msgpack`` or ``xxhash``: the pure-Python
msgpack and the cp312 xxhash wheel unpacked there), and records the software a result came
from. A script may set any of these variables itself before importing this module;
``setdefault`` keeps its value. The repository root must be on ``PYTHONPATH``
(``source scripts/gpu/device_env.sh``, or ``PYTHONPATH=/tmp/site:$PWD``).

The scripts run engines through the project's one builder (:mod:`connectors.vllm.offline`) and
look inside them with :mod:`lmcompact.testing` (models built on the spot, attention probes,
references), as the integration tests do; this module adds what the device needs on top:
dtype and block size per device, the release-group engine of the release checks, stepping an
engine request by request and reading its pool, and one way to run checks and write their
JSON report (:func:`run_checks`).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Mapping
from contextlib import AbstractContextManager
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")

ROOT = Path(__file__).resolve().parents[2]
try:
    import msgpack  # noqa: F401  (the store's codec needs both; the GPU machine may lack them)
    import xxhash  # noqa: F401
except ImportError:  # copies carried in .vcarry/py (git-ignored)
    sys.path.append(str(ROOT / ".vcarry" / "py"))

import torch  # noqa: E402

from lmcompact.compare import rel_err as rel_err  # noqa: E402  (for the check scripts)


def on_cuda() -> bool:
    return torch.cuda.is_available()


def block_size() -> int:
    """KV block size of the checks: 16 under vLLM 0.26 on CUDA, 32 on the CPU build."""
    return 16 if on_cuda() else 32


def environment() -> dict[str, Any]:
    """Python, torch, vLLM and GPU of this run."""
    from connectors.vllm.patches.engine import vllm_version

    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "vllm": vllm_version(),
        "cuda": on_cuda(),
    }
    if on_cuda():
        env["gpu"] = torch.cuda.get_device_name(0)
    return env


def dtype() -> str:
    """Model dtype of the checks: bf16 on CUDA, float32 on the CPU (exact reloads)."""
    return "bfloat16" if on_cuda() else "float32"


def release_engine(args: argparse.Namespace, extra: dict[str, Any]) -> AbstractContextManager[Any]:
    """``LMCompactConnector`` engine of the release checks (``extra`` carries the
    ``"release"`` group; ``--model``, ``--load-format``, ``--prompt-tokens``,
    ``--new-tokens``, ``--requests``, ``--gpu-memory-utilization``), built by
    :func:`connectors.vllm.offline.engine`."""
    from connectors.vllm.offline import engine

    options: dict[str, Any] = {}
    if on_cuda():
        options["gpu_memory_utilization"] = args.gpu_memory_utilization
    return engine(
        args.model,
        extra,
        tokenizer=args.model,
        load_format=args.load_format,
        dtype=dtype(),
        block_size=block_size(),
        max_model_len=args.prompt_tokens + args.new_tokens + 64,
        max_num_seqs=max(4, args.requests),
        max_num_batched_tokens=max(2048, args.prompt_tokens),
        **options,
    )


def prompts(args: argparse.Namespace) -> dict[str, list[int]]:
    """``--requests`` random prompts of ``--prompt-tokens`` minus 37 per request (different
    lengths, different tails) over ``--vocab``."""
    from lmcompact.testing.tiny_llama import tiny_prompt_ids

    return {
        f"r{i}": tiny_prompt_ids(args.prompt_tokens - 37 * i, seed=100 + i, vocab=args.vocab)
        for i in range(args.requests)
    }


def engine_scheduler(llm: Any) -> Any:
    """The engine core's scheduler of an in-process ``LLM`` (its ``kv_cache_manager``, its
    ``connector``: the scheduler-side connector)."""
    return llm.llm_engine.engine_core.engine_core.scheduler


def held_blocks(llm: Any, req_id: str) -> int:
    """Non-null blocks the request (engine request id) holds now."""
    manager = engine_scheduler(llm).kv_cache_manager
    rows = manager.coordinator.single_type_managers[0].req_to_blocks
    return sum(1 for block in rows.get(req_id, []) if not block.is_null)


def engine_request_ids(llm: Any) -> dict[str, str]:
    """External request id -> engine request id, for requests the scheduler knows."""
    return {rid.rsplit("-", 1)[0]: rid for rid in engine_scheduler(llm).requests}


def run(
    llm: Any,
    prompts: Mapping[str, list[int]],
    max_tokens: int,
    on_step: Callable[[int, list[Any]], None] | None = None,
) -> dict[str, list[int]]:
    """Add every prompt, step the engine to the end, return greedy tokens per request id
    (``max_tokens`` each, end of sequence ignored). ``on_step(step_index, outputs)`` runs
    after each engine step."""
    from vllm import SamplingParams

    engine = llm.llm_engine
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    for req_id, ids in prompts.items():
        engine.add_request(req_id, {"prompt_token_ids": list(ids)}, params)
    tokens: dict[str, list[int]] = {}
    step = 0
    while engine.has_unfinished_requests():
        outputs = engine.step()
        for out in outputs:
            if out.finished:
                tokens[out.request_id] = list(out.outputs[0].token_ids)
        if on_step is not None:
            on_step(step, outputs)
        step += 1
    return tokens


Result = dict[str, Any]
Check = tuple[Result, Callable[[], "Result | list[Result]"]]
"""A check to run: the fields of its result should it raise (``check`` at least, and what
the script's summary line names), and the function returning its result(s)."""


def plain_line(result: Result) -> str:
    """``PASS``/``FAIL``, the check's name and its other fields as JSON."""
    tag = "PASS" if result.get("pass") else "FAIL"
    if "error" in result:
        return f"{tag} {result['check']}: {result['error'].strip().splitlines()[-1]}"
    body = {k: v for k, v in result.items() if k not in ("check", "pass")}
    return f"{tag} {result['check']}: {json.dumps(body, default=str)}"


def run_checks(
    checks: Iterable[Check], json_path: str | None, summary_line: Callable[[Result], str]
) -> int:
    """Run every check (an exception is a failed result carrying its traceback), print one
    summary line per result as it comes and all of them again at the end, write the report
    (:func:`write_report`); return the exit status (0: every check passed)."""
    began = time.time()
    env = environment()
    print("environment:", json.dumps(env), flush=True)
    results: list[Result] = []
    for fields, check in checks:
        t0 = time.time()
        try:
            out = check()
            batch = out if isinstance(out, list) else [out]
        except Exception:
            batch = [{**fields, "pass": False, "error": traceback.format_exc()}]
            print(batch[0]["error"], flush=True)
        for result in batch:
            result["seconds"] = round(time.time() - t0, 1)
            results.append(result)
            print(summary_line(result), flush=True)
    report = write_report(env, results, began, json_path)
    print("=" * 30, "results", "=" * 30)
    for result in results:
        print(summary_line(result))
    print(
        "SUMMARY:",
        "ALL PASS" if report["passed"] else "SOME FAILED",
        f"({sum(bool(r.get('pass')) for r in results)}/{len(results)} checks, "
        f"{report['seconds']}s)",
        flush=True,
    )
    return 0 if report["passed"] else 1


def write_report(
    env: dict[str, Any], results: list[dict[str, Any]], began: float, path: str | None
) -> dict[str, Any]:
    """The report every script writes (``--json``): environment, verdict, results, time."""
    report = {
        "environment": env,
        "passed": bool(results) and all(r.get("pass") for r in results),
        "results": results,
        "seconds": round(time.time() - began, 1),
        "command": " ".join([os.path.basename(sys.executable), *sys.argv]),
    }
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(report, indent=1, default=str))
    return report
