"""Known answers and bad input for ``self_info`` and its request parameters."""

from __future__ import annotations

import pytest
import torch

from connectors.vllm.reconstruct import PARAMS_KEY, save_allowed, token_scores
from lmcompact.compaction.page_layout import CpuPageLayout
from lmcompact.compaction.save_job import SaveJob, compact_job
from lmcompact.policies import CompactionInputs, LayerObservation, make_policy
from lmcompact.policies.self_info import local_mean, surprisal_from_logprobs
from lmcompact.store import ChunkKeyer, StoreNamespace


def _inputs(scores: torch.Tensor, layers: int = 2) -> CompactionInputs:
    heads, t = scores.shape
    return CompactionInputs(t, heads, [LayerObservation(context_scores=scores)] * layers)


def test_a_dense_surprising_span_beats_one_spike() -> None:
    """Smoothing first: 5 moderately surprising tokens (2.0 each) outrank one token of
    5.0 among zeros; the max-pool then keeps the span's neighbours too."""
    scores = torch.zeros(1, 64)
    scores[0, 10] = 5.0
    scores[0, 40:45] = 2.0
    plan = make_policy("self_info", budget=9, n_sink=2, smooth=5, kernel_size=3, warmup=0).plan(
        _inputs(scores)
    )
    kept = plan.kept[0][0].tolist()
    assert kept[:2] == [0, 1]
    assert set(range(39, 46)) <= set(kept)  # span 40..44 plus one neighbour each side
    assert 10 not in kept
    assert plan.kept[1][0].tolist() == kept  # every layer keeps the same tokens
    # control: without smoothing the spike wins
    spiky = make_policy("self_info", budget=3, n_sink=2, smooth=1, kernel_size=1, warmup=0)
    assert spiky.plan(_inputs(scores)).kept[0][0].tolist() == [0, 1, 10]


def test_background_ranks_a_span_by_how_much_it_stands_out() -> None:
    """A long uniformly surprising stretch (a document's opening, a code block: 5.0 on
    positions 0..79) fills the budget when ranked raw; with the local background
    subtracted a short span that stands out from its flat surroundings (4.0 on 150..154
    over 1.0) is kept whole instead."""
    scores = torch.ones(1, 256)
    scores[0, :80] = 5.0
    scores[0, 150:155] = 4.0
    params = {"budget": 16, "n_sink": 0, "smooth": 1, "kernel_size": 5, "warmup": 0}
    raw = make_policy("self_info", **params).plan(_inputs(scores)).kept[0][0].tolist()
    assert all(p < 80 for p in raw)
    contrast = make_policy("self_info", background=63, **params)
    kept = contrast.plan(_inputs(scores)).kept[0][0].tolist()
    assert set(range(150, 155)) <= set(kept)
    # the mean counts only real positions: a flat chunk stays flat up to its edges
    flat = local_mean(torch.full((1, 40), 2.0, dtype=torch.float64), 63)
    assert torch.allclose(flat, torch.full_like(flat, 2.0))
    assert torch.equal(local_mean(scores.double(), 1), torch.zeros(1, 256, dtype=torch.float64))


def test_warmup_discounts_the_opening_of_a_document() -> None:
    """The opening tokens are surprising because nothing precedes them (6.0 on positions
    0..39, falling under a raw ranking into the budget); a fact later in the chunk (4.0 on
    100..104) is kept once the surprisal ramps up over the first 64 positions. Positions
    are absolute: a later chunk (from 256 on) is not discounted."""
    scores = torch.ones(1, 256)
    scores[0, :40] = 6.0
    scores[0, 100:105] = 4.0
    params = {"budget": 16, "n_sink": 0, "smooth": 1, "kernel_size": 5}
    raw = make_policy("self_info", warmup=0, **params).plan(_inputs(scores)).kept[0][0].tolist()
    assert all(p < 40 for p in raw)
    warm = make_policy("self_info", **params)  # the default warm-up: 64 positions
    assert warm.warmup == 64  # type: ignore[attr-defined]
    assert set(range(100, 105)) <= set(warm.plan(_inputs(scores)).kept[0][0].tolist())
    later = CompactionInputs(
        256,
        1,
        [LayerObservation(context_scores=scores)],
        positions=torch.arange(256, 512)[None],
    )
    assert warm.plan(later).kept[0][0].tolist() == raw


@pytest.mark.parametrize(
    ("params", "key"),
    [
        ({"smooth": 4}, "smooth"),
        ({"kernel_size": 0}, "kernel_size"),
        ({"kernel_size": 2.0}, "kernel_size"),
        ({"n_sink": -1}, "n_sink"),
        ({"background": 64}, "background"),
        ({"warmup": -1}, "warmup"),
    ],
)
def test_bad_params_name_the_key(params: dict[str, object], key: str) -> None:
    with pytest.raises(ValueError, match=key):
        make_policy("self_info", budget=0.5, **params)


def test_missing_scores_are_an_error() -> None:
    inputs = CompactionInputs(8, 1, [LayerObservation(keys=torch.zeros(1, 8, 4))])
    with pytest.raises(ValueError, match="context_scores"):
        make_policy("self_info", budget=0.5).plan(inputs)


def test_surprisal_from_logprobs() -> None:
    assert surprisal_from_logprobs([None, -0.5, -2.0]) == [0.0, 0.5, 2.0]


def test_request_parameters_are_validated() -> None:
    assert save_allowed(None) and save_allowed({PARAMS_KEY: {}})
    assert not save_allowed({PARAMS_KEY: {"save": False}})
    with pytest.raises(ValueError, match=r"\['save'\] must be a bool"):
        save_allowed({PARAMS_KEY: {"save": "no"}})
    assert token_scores({PARAMS_KEY: {"token_scores": [0, 1.5]}}, 2) == [0.0, 1.5]
    assert token_scores({"other": 1}, 2) is None
    for bad in ([1.0], [1.0, float("nan")], "ab", [1.0, "x"]):
        with pytest.raises(ValueError, match="token_scores"):
            token_scores({PARAMS_KEY: {"token_scores": bad}}, 2)


def test_a_job_with_given_scores_keeps_their_spans_in_every_layer_and_head() -> None:
    """compact_job with context_scores given (as the worker builds them from token_scores):
    each 64-token chunk keeps its surprising span, the same in both layers and heads."""
    bs, heads, dim, layers, chunk = 32, 2, 8, 2, 64
    layout = CpuPageLayout(bs)
    generator = torch.Generator().manual_seed(0)
    pages = [
        layout.tokens_to_pages(
            torch.randn(heads, 128, dim, generator=generator),
            torch.randn(heads, 128, dim, generator=generator),
        )
        for _ in range(layers)
    ]
    given = torch.zeros(128)
    given[20:24] = 3.0
    given[100:104] = 3.0
    scores = [given.expand(heads, -1) for _ in range(layers)]
    keys = ChunkKeyer(StoreNamespace("m", "float32", "rows"), chunk).keys(list(range(128)))
    job = SaveJob("r", keys, 0, 128, pages, None, None, dim**-0.5, context_scores=scores)
    policy = make_policy("self_info", budget=0.25, n_sink=2, smooth=1, kernel_size=1)
    out = compact_job(job, layout, policy, chunk, 16)
    for c, (_, stored) in enumerate(out):
        span = range(20, 24) if c == 0 else range(36, 40)
        for layer in range(layers):
            for head in range(heads):
                kept = stored.head(layer, head)[2].tolist()
                assert len(kept) == 16 and set(span) <= set(kept)
