"""Dispatch switch and pooling, on CPU (where the references always run)."""

from __future__ import annotations

import pytest
import torch

from lmcompact.attention.scores import window_scores as window_scores_reference
from lmcompact.kernels import dispatch
from lmcompact.kernels.pooling import pool_scores


def test_cpu_uses_the_reference() -> None:
    assert not dispatch.use_kernels(torch.device("cpu"))
    q = torch.randn(1, 4, 3, 8)
    k = torch.randn(1, 2, 20, 8)
    want, _ = window_scores_reference(q, k)
    torch.testing.assert_close(dispatch.window_scores(q, k), want)


def test_force_reference_context_and_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(dispatch.FORCE_REFERENCE_ENV, raising=False)
    assert not dispatch.reference_forced()
    with dispatch.force_reference():
        assert dispatch.reference_forced()
        with dispatch.force_reference(False):
            assert not dispatch.reference_forced()
    monkeypatch.setenv(dispatch.FORCE_REFERENCE_ENV, "1")
    assert dispatch.reference_forced()
    monkeypatch.setenv(dispatch.FORCE_REFERENCE_ENV, "0")
    assert not dispatch.reference_forced()


def test_pooling() -> None:
    mass = torch.tensor([[[0.0, 1.0, 0.0, 0.0, 3.0]]])
    torch.testing.assert_close(pool_scores(mass, 3, "max"), torch.tensor([[[1.0, 1, 1, 3, 3]]]))
    torch.testing.assert_close(pool_scores(mass, 1), mass)
    avg = pool_scores(mass, 3, "avg")
    torch.testing.assert_close(avg[0, 0, 0], torch.tensor(0.5))
    with pytest.raises(ValueError, match="odd"):
        pool_scores(mass, 4)


def test_pooled_window_scores() -> None:
    q = torch.randn(1, 2, 4, 8)
    k = torch.randn(1, 1, 30, 8)
    pooled = dispatch.window_scores(q, k, pool_size=5, pool="max")
    assert pooled.shape == (1, 1, 30)
    assert bool((pooled >= dispatch.window_scores(q, k) - 1e-7).all())
