"""The pure pieces of the DecodingPress comparison (no kvpress venv, no model).

The worker itself runs only in kvpress's venv (``scripts/kvpress_env.sh``); its
end-to-end run is ``python -m lmcompact.eval.kvpress_decoding_compare``.
"""

from __future__ import annotations

import pytest

from lmcompact.eval.kvpress_decoding_compare import (
    CaseRun,
    _case_from_questions,
    cell_metrics,
    forced_positions,
)


def _run(
    gen_top1: list[int], gen_lp: list[float], q_top1: list[list[int]], q_lp: list[list[float]]
) -> CaseRun:
    return CaseRun(gen_top1, gen_lp, q_top1, q_lp, [[1]] * len(q_top1), 0.0)


def test_positions_count_the_generated_text_once_then_each_question_after_it() -> None:
    assert forced_positions(4, 3, [2, 1]) == [4, 5, 6, 7, 8, 7]


def test_metrics_skip_tokens_whose_context_fits_the_budget() -> None:
    ref = _run([1, 2, 3], [-1.0, -1.0, -1.0], [[4], [5]], [[-1.0], [-1.0]])
    got = _run([1, 9, 9], [-1.0, -1.5, -3.0], [[4], [9]], [[-1.0], [-2.0]])
    where = [forced_positions(4, 3, [1, 1])]  # [4, 5, 6, 7, 7]
    agree, gap, n = cell_metrics([ref], [got], where, 5)  # contexts 6, 7, 7 count
    assert n == 3
    assert agree == pytest.approx(1 / 3)
    assert gap == pytest.approx((2.0 + 0.0 + 1.0) / 3)
    agree, gap, n = cell_metrics([ref], [got], where, None)  # every token
    assert (n, agree) == (5, pytest.approx(2 / 5))
    assert cell_metrics([ref], [got], where, 100) == (None, None, 0)


def test_metrics_refuse_runs_with_different_forced_tokens() -> None:
    ref = _run([1, 2], [0.0, 0.0], [[1]], [[0.0]])
    short = _run([1], [0.0], [[1]], [[0.0]])
    with pytest.raises(ValueError, match="disagree"):
        cell_metrics([ref], [short], [forced_positions(1, 2, [1])], None)


def test_per_question_runs_split_into_shared_generation_and_questions() -> None:
    per_question = [
        ([1, 2, 3, 4], [-0.1, -0.2, -0.3, -0.4], [7]),
        ([1, 2, 5], [-0.1, -0.2, -0.5], [8]),
    ]
    case = _case_from_questions(per_question, 2, 1.5)
    assert case.generated_top1 == [1, 2] and case.generated_logprob == [-0.1, -0.2]
    assert case.question_top1 == [[3, 4], [5]]
    assert case.answers == [[7], [8]] and case.seconds == 1.5
    assert case.flat() == ([1, 2, 3, 4, 5], [-0.1, -0.2, -0.3, -0.4, -0.5])


def test_worker_output_reads_into_a_case_run() -> None:
    raw = {
        "generated": {"top1": [1], "logprob": [-0.5]},
        "questions": [{"top1": [2], "logprob": [-0.25], "answer_ids": [3], "cache_length": 9}],
        "seconds": 2.0,
    }
    case = CaseRun.from_worker(raw)
    assert case.flat() == ([1, 2], [-0.5, -0.25]) and case.answers == [[3]]
