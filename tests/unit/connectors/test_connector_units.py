"""Engine-free parts of the connector: options, page layouts, holes, compaction jobs."""

from __future__ import annotations

import pytest
import torch

from lmcompact.attention.scores import window_scores
from lmcompact.policies import Need, make_policy
from lmcompact.store import ChunkKeyer, StoreNamespace
from lmcompact.vllm.compaction import SaveJob, compact_job, observe_layer, uniform_keep
from lmcompact.vllm.config import ConnectorConfig
from lmcompact.vllm.engine_checks import validate_against_engine
from lmcompact.vllm.holes import Hole, skip_holes
from lmcompact.vllm.kv_layout import CpuPageLayout, GpuPageLayout, make_layout


def engine_checks(config: ConnectorConfig, **overrides: object) -> None:
    kwargs: dict[str, object] = {
        "block_size": 32,
        "num_layers": 2,
        "num_kv_heads": 2,
        "head_dim": 16,
    }
    kwargs.update(overrides)
    validate_against_engine(config, **kwargs)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("extra", "match"),
    [
        ({"polcy": "none"}, "unknown kv_connector_extra_config option"),
        ({"policy": "nope"}, "unknown policy 'nope'"),
        ({"budget": 1.5}, r"budget must be a kept fraction in \(0, 1\]"),
        ({"tiers": ["disk"]}, "tiers must be"),
        ({"tiers": ["redis"]}, "redis_url must be set exactly when"),
        ({"chunk_size": 0}, "chunk_size must be a positive int"),
        ({"policy": "snapkv", "policy_params": {"budget": 0.3}}, "top-level 'budget'"),
    ],
)
def test_bad_options_name_the_value(extra: dict[str, object], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        ConnectorConfig.from_extra(extra)


def test_engine_checks() -> None:
    with pytest.raises(ValueError, match="multiple of the engine block size 32"):
        engine_checks(ConnectorConfig.from_extra({"chunk_size": 100}))
    snap = ConnectorConfig.from_extra({"policy": "snapkv", "chunk_size": 64})
    engine_checks(snap)  # prefix caching is no longer refused (PrefixCacheGuard)
    with pytest.raises(ValueError, match="CUMULATIVE_SCORES"):
        engine_checks(ConnectorConfig.from_extra({"policy": "h2o", "chunk_size": 64}))
    with pytest.raises(ValueError, match="different numbers of tokens per head or layer"):
        engine_checks(
            ConnectorConfig.from_extra({"policy": "adakv", "chunk_size": 256}),
            num_layers=30,
            num_kv_heads=3,
            head_dim=64,
        )  # SmolLM2's shape
    adakv = ConnectorConfig.from_extra({"policy": "adakv", "chunk_size": 256})
    validate_against_engine(
        adakv,
        block_size=32,
        num_layers=30,
        num_kv_heads=3,
        head_dim=64,
        per_head_counts=True,  # release.per_head masks the padding
    )
    with pytest.raises(ValueError, match="CUMULATIVE_SCORES"):  # needs are still checked
        validate_against_engine(
            ConnectorConfig.from_extra({"policy": "h2o", "chunk_size": 64}),
            block_size=32,
            num_layers=2,
            num_kv_heads=2,
            head_dim=8,
            per_head_counts=True,
        )


def test_observe_layer_on_cpu_is_the_reference_exactly() -> None:
    """Off CUDA the window mass is the torch reference with the same arguments as before."""
    gen = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 3000, 8, generator=gen)
    queries = torch.randn(16, 6, 8, generator=gen)
    positions = torch.arange(3100 - 16, 3100)
    for needs in (Need.WINDOW_SCORES, Need.WINDOW_ATTENTION):
        mass, rows = observe_layer(keys, keys, queries, positions, 100, needs, 0.3, torch.bfloat16)
        want, want_rows = window_scores(
            queries.permute(1, 0, 2)[None],
            keys[None],
            query_positions=positions - 100,
            scale=0.3,
            chunk_size=1024,
            return_attention=needs is Need.WINDOW_ATTENTION,
        )
        assert mass is not None and torch.equal(mass, want[0])
        assert (rows is None) == (want_rows is None)
        if rows is not None and want_rows is not None:
            assert torch.equal(rows, want_rows[0])


def test_kept_per_chunk_is_block_aligned() -> None:
    assert ConnectorConfig.from_extra({"policy": "snapkv", "budget": 0.5}).kept_per_chunk(32) == 128
    assert ConnectorConfig.from_extra({"policy": "snapkv", "budget": 0.25}).kept_per_chunk(32) == 64
    assert ConnectorConfig.from_extra({"policy": "snapkv", "budget": 0.01}).kept_per_chunk(32) == 32
    assert ConnectorConfig.from_extra({"policy": "none", "budget": 0.3}).kept_per_chunk(32) == 256
    # the rounding above is refused at start-up where it changes the budget
    with pytest.raises(ValueError, match=r"budget 0\.01 cannot be honoured"):
        engine_checks(ConnectorConfig.from_extra({"policy": "snapkv", "budget": 0.01}))


@pytest.mark.parametrize("layout_cls", [CpuPageLayout, GpuPageLayout])
def test_layout_write_read_round_trip(layout_cls: type) -> None:
    bs, h, d = 32, 3, 8
    layout = layout_cls(bs)
    kv = torch.zeros(6, h, bs, 2 * d)
    keys, values = torch.randn(h, 2 * bs, d), torch.randn(h, 2 * bs, d)
    layout.write(kv, [4, 1, 5], bs, keys, values)  # logical blocks 1, 2 -> physical 1, 5
    got_k, got_v = layout.read(kv, [4, 1, 5], bs + 3, 2 * bs - 3)
    assert torch.equal(got_k, keys[:, 3:]) and torch.equal(got_v, values[:, 3:])
    assert kv[4].abs().sum() == 0  # untouched block
    with pytest.raises(ValueError, match="whole pages"):
        layout.write(kv, [4, 1, 5], 3, keys, values)


def test_cpu_layout_stores_keys_transposed() -> None:
    bs, d = 32, 4
    kv = torch.zeros(1, 1, bs, 2 * d)
    keys = torch.arange(bs * d, dtype=torch.float32).view(1, bs, d)
    make_layout("head_major_kt", bs).write(kv, [0], 0, keys, -keys)
    page = kv[0, 0].reshape(-1)
    assert torch.equal(page[: bs * d].view(d, bs), keys[0].T)  # K^T first
    assert torch.equal(page[bs * d :].view(bs, d), -keys[0])  # then V token-major


def test_skip_holes_cuts_blocks_and_shortens_seq_len() -> None:
    table = torch.tensor(
        [[11, 12, 13, 14, 15, 16, 17, 18], [21, 22, 0, 0, 0, 0, 0, 0]], dtype=torch.int32
    )
    lens = torch.tensor([8 * 32 - 5, 40], dtype=torch.int32)
    out = skip_holes(table, lens, 2, {11: Hole(11, 2, 4)}, 32)
    assert out is not None
    new_table, new_lens, rows = out
    assert rows == [0]
    assert new_table[0].tolist() == [11, 12, 17, 18, 0, 0, 0, 0]
    assert new_lens.tolist() == [8 * 32 - 5 - 128, 40]
    assert table[0, 2] == 13  # input untouched
    assert skip_holes(table, lens, 2, {99: Hole(99, 1, 1)}, 32) is None


def test_uniform_keep_pads_and_trims() -> None:
    assert uniform_keep(torch.tensor([0, 5]), 4, 10).tolist() == [0, 5, 8, 9]
    assert uniform_keep(torch.tensor([0, 1, 2, 3, 4, 5]), 4, 10).tolist() == [0, 1, 4, 5]


def test_compact_job_keeps_budget_and_positions() -> None:
    bs, h, d, layers, chunk = 32, 2, 16, 2, 64
    layout = CpuPageLayout(bs)
    keys = [torch.randn(h, 3 * bs, d) for _ in range(layers)]
    values = [torch.randn(h, 3 * bs, d) for _ in range(layers)]
    pages = [layout.tokens_to_pages(k, v) for k, v in zip(keys, values, strict=True)]
    ns = StoreNamespace("m", "float32", "rows")
    chunk_keys = ChunkKeyer(ns, chunk).keys(list(range(3 * bs)))
    queries = [torch.randn(8, 2 * h, d) for _ in range(layers)]
    job = SaveJob("r", chunk_keys, 0, 3 * bs, pages, queries, torch.arange(88, 96), d**-0.5)
    ((key, out),) = compact_job(job, layout, make_policy("snapkv", budget=0.5), chunk, 32)
    assert key == chunk_keys[0]
    assert out.uniform_count() == 32 and out.num_tokens == chunk
    for layer in range(layers):
        for head in range(h):
            k, v, pos = out.head(layer, head)
            assert torch.equal(k, keys[layer][head, pos.long()])
            assert torch.equal(v, values[layer][head, pos.long()])


def test_snapkv_pools_over_15_by_default_in_the_connector() -> None:
    """The connector's snapkv default kernel is 15 (POLICY_DEFAULTS, measured in
    docs/eval/RESULTS.md); policy_params override it, and the stored chunks of two kernels
    live in two namespaces."""
    base = {"policy": "snapkv", "budget": 0.25}
    default = ConnectorConfig.from_extra(base)
    assert default.make_policy().kernel_size == 15  # type: ignore[attr-defined]
    paper = ConnectorConfig.from_extra({**base, "policy_params": {"kernel_size": 7}})
    assert paper.make_policy().kernel_size == 7  # type: ignore[attr-defined]
    assert default.namespace_params() == {"kernel_size": 15, "budget": 0.25}
    assert paper.namespace_params() != default.namespace_params()
    # other policies keep their own defaults
    knorm = ConnectorConfig.from_extra({"policy": "knorm", "budget": 0.25})
    assert knorm.effective_params == {}


def test_expected_attention_shares_one_token_set_by_default_in_the_connector() -> None:
    """expected_attention runs shared and pooled over 15 in the connector (POLICY_DEFAULTS,
    measured in docs/eval/RESULTS.md); policy_params override it; kvzip and the class keep
    their per-head defaults."""
    ea = ConnectorConfig.from_extra({"policy": "expected_attention", "budget": 0.25})
    assert ea.make_policy().params()["share"] is True
    assert ea.namespace_params() == {"share": True, "kernel_size": 15, "budget": 0.25}
    per_head = ConnectorConfig.from_extra(
        {"policy": "expected_attention", "budget": 0.25, "policy_params": {"share": False}}
    ).make_policy()
    assert per_head.params()["share"] is False and per_head.params()["kernel_size"] == 15
    kvzip = ConnectorConfig.from_extra({"policy": "kvzip", "budget": 0.25}).make_policy()
    assert kvzip.params()["allocation"] == "head" and kvzip.params()["share"] is False
    assert make_policy("expected_attention").params()["share"] is False
