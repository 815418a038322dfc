"""Budget parsing and resolution."""

from __future__ import annotations

import pytest

from lmcompact.policies import Budget


@pytest.mark.parametrize(
    ("text", "length", "expected"),
    [("0.5", 100, 50), (0.25, 10, 2), ("64", 100, 64), (100, 100, 100), (1.0, 7, 7)],
)
def test_resolve(text: str | float | int, length: int, expected: int) -> None:
    assert Budget.parse(text).resolve(length) == expected


@pytest.mark.parametrize("bad", [0, -3, 0.0, 1.5, "-0.1", "abc", True])
def test_bad_budgets_raise(bad: object) -> None:
    with pytest.raises(ValueError, match="budget"):
        Budget.parse(bad)  # type: ignore[arg-type]


def test_token_budget_longer_than_sequence() -> None:
    with pytest.raises(ValueError, match="exceeds the sequence length 10"):
        Budget(tokens=11).resolve(10)
