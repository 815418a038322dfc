"""Dispatch switch and pooling, on CPU (where the references always run)."""

from __future__ import annotations

import pytest
import torch

from lmcompact.attention.pooling import pool_scores
from lmcompact.attention.scores import window_scores as window_scores_reference
from lmcompact.kernels import dispatch
from lmcompact.policies import Budget, CompactionInputs, LayerObservation
from lmcompact.policies.snapkv import SnapKV


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
    maxed = pool_scores(mass, 3, "maxpool")
    torch.testing.assert_close(maxed, torch.tensor([[[1.0, 1, 1, 3, 3]]]))
    torch.testing.assert_close(pool_scores(mass, 1), mass)
    # SnapKV / kvpress: zero padding counts in the average (count_include_pad=True)
    avg = pool_scores(mass, 3, "avgpool")
    torch.testing.assert_close(avg, torch.tensor([[[1 / 3, 1 / 3, 1 / 3, 1.0, 1.0]]]))
    assert pool_scores(mass[0], 3, "avgpool").shape == (1, 5)  # (H, T) as the policies pass
    with pytest.raises(ValueError, match="odd"):
        pool_scores(mass, 4)
    with pytest.raises(ValueError, match=r"pooling must be one of \('maxpool', 'avgpool'\)"):
        pool_scores(mass, 3, "max")


@pytest.mark.parametrize("pooling", ["maxpool", "avgpool"])
def test_dispatch_pools_as_snapkv_does(pooling: str) -> None:
    """The pooled window scores of the kernel path rank as SnapKV's policy pooling does."""
    q = torch.randn(1, 4, 4, 8, generator=torch.Generator().manual_seed(0))
    k = torch.randn(1, 2, 30, 8, generator=torch.Generator().manual_seed(1))
    raw = dispatch.window_scores(q, k)
    pooled = dispatch.window_scores(q, k, pool_size=5, pool=pooling)
    policy = SnapKV(budget=Budget(ratio=0.5), window_size=0, kernel_size=5, pooling=pooling)
    inputs = CompactionInputs(
        num_candidates=30, num_kv_heads=2, layers=[LayerObservation(window_scores=raw[0])]
    )
    by_policy = policy.score(inputs, 0)  # pooled + a 1e-9 relative tie-break
    torch.testing.assert_close(by_policy.float(), pooled[0], atol=1e-6, rtol=1e-6)


def test_pooled_window_scores() -> None:
    q = torch.randn(1, 2, 4, 8)
    k = torch.randn(1, 1, 30, 8)
    pooled = dispatch.window_scores(q, k, pool_size=5, pool="maxpool")
    assert pooled.shape == (1, 1, 30)
    assert bool((pooled >= dispatch.window_scores(q, k) - 1e-7).all())
