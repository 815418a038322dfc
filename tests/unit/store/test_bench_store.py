"""``lmcompact bench store`` end to end on tiny chunks (no Redis): JSON, table and PNG."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from lmcompact.bench import store as bench_store

pytestmark = pytest.mark.filterwarnings("ignore:The given buffer is not writable")


def bench_args(tmp_path: Path, *extra: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    bench_store.add_arguments(parser)
    tiny = ["--layers", "2", "--kv-heads", "2", "--chunk-tokens", "64", "--chunks", "2"]
    rounds = ["--iters", "2", "--repeats", "2", "--json", str(tmp_path / "store.json")]
    return parser.parse_args([*tiny, *rounds, *extra])


def test_bench_store_writes_paired_ratios(tmp_path, capsys):
    assert bench_store.run(bench_args(tmp_path, "--no-redis", "--budgets", "1.0,0.25")) == 0
    result = json.loads((tmp_path / "store.json").read_text())
    assert [r["budget"] for r in result["rows"]] == [1.0, 0.25]
    for row in result["rows"]:
        assert row["rounds"] == 4  # iters x repeats, pooled
        for key in ("codec_vs_memcpy", "cpu_vs_memcpy", "encode_gbps", "decode_gbps"):
            assert row[key] > 0
        assert "redis_vs_raw" not in row
    assert result["min_over_budgets"]["codec_vs_memcpy"] == min(
        r["codec_vs_memcpy"] for r in result["rows"]
    )
    assert result["targets"] == {"codec_vs_memcpy": 0.5, "redis_vs_raw": 0.8}
    assert (tmp_path / "store.png").stat().st_size > 0
    assert "| codec_vs_memcpy |" in capsys.readouterr().out


def test_bench_store_validates_rounds(tmp_path):
    with pytest.raises(SystemExit, match="repeats"):
        bench_store.run(bench_args(tmp_path, "--no-redis", "--repeats", "0"))
