"""Harness pieces without a model: needles, scoring, agreement, budgets, report."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from lmcompact.eval import report, tasks
from lmcompact.eval.policies import policy_params, resolve_policy_names
from lmcompact.eval.text import paragraphs, text_stream


class CharTokenizer:
    """A character-level tokenizer with a tiny chat template (exact round trips)."""

    eos_token_id = 0

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": [ord(c) for c in text]}

    def decode(self, ids: list[int]) -> str:
        return "".join(chr(i) for i in ids)

    def apply_chat_template(self, messages, add_generation_prompt: bool, tokenize: bool) -> str:
        body = "".join(f"<{m['role']}>{m['content']}</{m['role']}>" for m in messages)
        return body + ("<assistant>" if add_generation_prompt else "")


def test_needles_are_distinct_and_reproducible() -> None:
    a = tasks.make_needles(3, [0.1, 0.5, 0.9])
    assert a == tasks.make_needles(3, [0.1, 0.5, 0.9])
    assert len({n.color for n in a}) == 3
    assert all(len(n.passkey) == 5 and n.passkey.isdigit() for n in a)
    assert a != tasks.make_needles(4, [0.1, 0.5, 0.9])


def test_needle_depth_is_validated() -> None:
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        tasks.make_needles(0, [1.5])


def test_insert_needles_at_depths() -> None:
    hay = list(range(100))
    out = tasks.insert_needles(hay, [(0.5, [-1, -2]), (0.0, [-3])])
    assert out[0] == -3
    assert out[51:53] == [-1, -2]
    assert [x for x in out if x >= 0] == hay


def test_pydoc_chat_prompt_has_exact_length_and_contains_needles() -> None:
    tok = CharTokenizer()
    prompt = tasks.build_needle_prompt(
        tok,
        600,
        seed=1,
        depths=(0.2, 0.8),
        ask=1,
        haystack="pydoc",
        prompt_format="chat",
        text=text_stream(1),
    )
    assert len(prompt.input_ids) == 600
    text = tok.decode(prompt.input_ids)
    for needle in prompt.needles:
        assert needle.sentence in text
    color = prompt.target.color
    assert text.endswith(f"<assistant>The secret passkey of the {color} door is")
    assert f"What is the secret passkey of the {color} door?</user>" in text
    assert prompt.target is prompt.needles[1]
    # the first needle sits before the second one
    assert text.index(prompt.needles[0].sentence) < text.index(prompt.needles[1].sentence)


def test_passkey_prompt_is_the_classic_one() -> None:
    tok = CharTokenizer()
    prompt = tasks.build_needle_prompt(tok, 1000, seed=2)
    assert len(prompt.input_ids) == 1000
    text = tok.decode(prompt.input_ids)
    key = prompt.target.passkey
    assert text.startswith(tasks.PASSKEY_INTRO + "\nThe grass is green.")
    # between two whole filler sentences, as in Mohtashami & Jaggi's prompt
    needle = f"again. The pass key is {key}. Remember it. {key} is the pass key. The grass"
    assert needle in text
    assert text.endswith("\nWhat is the pass key? The pass key is")
    assert 0.4 < text.index(needle) / len(text) < 0.6


def test_passkey_prompt_labels_several_needles() -> None:
    tok = CharTokenizer()
    prompt = tasks.build_needle_prompt(tok, 1000, seed=2, depths=(0.1, 0.9), ask=0)
    text = tok.decode(prompt.input_ids)
    for needle in prompt.needles:
        assert f"The pass key of the {needle.color} door is {needle.passkey}." in text
    assert text.endswith(f"The pass key of the {prompt.target.color} door is")


def test_needle_prompt_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="too short"):
        tasks.build_needle_prompt(CharTokenizer(), 130, seed=0)
    with pytest.raises(ValueError, match="prompt format"):
        tasks.build_needle_prompt(CharTokenizer(), 600, seed=0, prompt_format="xml")
    with pytest.raises(ValueError, match="haystack"):
        tasks.build_needle_prompt(CharTokenizer(), 600, seed=0, haystack="bible")
    with pytest.raises(ValueError, match="needs its text"):
        tasks.build_needle_prompt(CharTokenizer(), 600, seed=0, haystack="pydoc")


def test_insert_needles_snaps_to_units() -> None:
    out = tasks.insert_needles(list(range(100)), [(0.43, [-1])], unit=10)
    assert out.index(-1) == 40


@pytest.mark.parametrize(
    ("answer", "expected"),
    [
        (" 48213.", 1.0),
        (" 48,213 and more", 1.0),
        (" 48214.", 0.0),
        (" none", 0.0),
        (" 7 then 48213", 0.0),
    ],
)
def test_score_needle(answer: str, expected: float) -> None:
    assert tasks.score_needle(answer, "48213") == expected


def test_agreement() -> None:
    same = tasks.agreement([1, 2, 3, 4], [1, 2, 3, 4])
    assert same == tasks.Agreement(1.0, None, 4)
    diverged = tasks.agreement([1, 2, 3, 4], [1, 2, 9, 4])
    assert diverged.token_accuracy == 0.75 and diverged.first_divergence == 2
    short = tasks.agreement([1, 2, 3, 4], [1, 2])
    assert short.token_accuracy == 0.5 and short.first_divergence == 2
    with pytest.raises(ValueError):
        tasks.agreement([], [1])


def test_perplexity() -> None:
    assert tasks.perplexity(0.0, 5) == 1.0
    assert math.isclose(tasks.perplexity(2 * math.log(3), 2), 3.0)
    with pytest.raises(ValueError):
        tasks.perplexity(1.0, 0)


def test_text_is_offline_and_long_enough() -> None:
    assert len(paragraphs()) > 500
    assert len(text_stream(0)) > 350_000
    assert text_stream(0) != text_stream(1)
    assert text_stream(5) == text_stream(5)


def test_policy_names() -> None:
    assert "snapkv" in resolve_policy_names("all")
    assert resolve_policy_names("snapkv, h2o") == ["snapkv", "h2o"]
    with pytest.raises(ValueError, match="allowed"):
        resolve_policy_names("snapkv,nope")


def test_duoattention_budget_mapping_meets_the_budget() -> None:
    for budget in (0.5, 0.25, 0.1):
        p = policy_params("duoattention", budget, 2048)
        m = p["sink_size"] + p["recent_size"]
        kept = (1 - p["sparsity"]) + p["sparsity"] * m / 2048
        assert math.isclose(kept, budget, rel_tol=1e-9)
    assert policy_params("duoattention", 1.0, 2048) == {"sparsity": 0.0}
    assert policy_params("fastgen", 1.0, 2048)["recovery_threshold"] == 1.0
    assert policy_params("snapkv", 0.25, 2048) == {"budget": 0.25}
    with pytest.raises(ValueError):
        policy_params("snapkv", 0.0, 2048)


def test_summary_table_and_plots(tmp_path: Path) -> None:
    rows = []
    for sample, acc in enumerate((1.0, 0.0)):
        base = {"impl": "lmcompact", "context": 512, "sample": sample}
        rows.append({**base, "task": "needle", "policy": "full", "budget": 1.0, "accuracy": 1.0})
        rows.append(
            {
                **base,
                "task": "needle",
                "policy": "snapkv",
                "budget": 0.25,
                "accuracy": acc,
                "kept_ratio": 0.25,
                "compaction_s": 0.1,
            }
        )
        rows.append(
            {
                **base,
                "task": "agreement",
                "policy": "snapkv",
                "budget": 1.0,
                "accuracy": 1.0,
                "first_divergence": None,
            }
        )
    summary = report.summarize(rows)
    snap = next(r for r in summary if r["policy"] == "snapkv" and r["task"] == "needle")
    assert snap["accuracy"] == 0.5 and snap["samples"] == 2
    agree = next(r for r in summary if r["task"] == "agreement")
    assert agree["exact"] is True and agree["first_divergence_min"] is None
    table = report.markdown(summary)
    assert "| 512 | snapkv | lmcompact |" in table and "### needle" in table
    paths = report.plot(summary, tmp_path, "t")
    assert {p.name for p in paths} == {"t_needle_512.png", "t_agreement_512.png"}
    assert all(p.stat().st_size > 1000 for p in paths)
