"""PagedCache on CUDA against DynamicCache (tiny random Llama, no downloads; needs a GPU).

Decode goes through the fixed-grid Triton kernel (float and int8 K/V), or,
under ``force_reference()``, through the torch shared-block path; with
``graphed_decode`` the steps replay a CUDA graph. Decode is
compared by *teacher-forced* logits (same tokens and beam reorders fed to both
caches) with a tolerance, and by ``generate`` tokens in float32 (the kernel
takes IEEE float32 dot products unless TF32 is switched on in torch), on a
model whose logits are far apart (``initializer_range`` 0.1).
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

transformers = pytest.importorskip("transformers")

from lmcompact.hf.attention import enable_lmcompact_attention  # noqa: E402
from lmcompact.hf.paged import PagedCache, blocks_needed  # noqa: E402
from lmcompact.hf.paged.graph import graphed_decode  # noqa: E402
from lmcompact.kernels.dispatch import force_reference, use_kernels  # noqa: E402
from lmcompact.policies import make_policy  # noqa: E402
from tests.gpu.errors import rel_err  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

PROMPT, NEW, BLOCK, BEAMS = 100, 16, 16, 4
# beam reorders fed at each step: duplicated parents force copy-on-write of the last block
REORDERS = [[0, 0, 1, 2], [1, 1, 1, 3], [0, 1, 2, 3], [3, 2, 2, 0]]


@pytest.fixture(scope="module")
def model() -> Any:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=1024,
        initializer_range=0.1,
    )
    return transformers.LlamaForCausalLM(config).to("cuda").eval()


@pytest.fixture(scope="module")
def prompt() -> torch.Tensor:
    gen = torch.Generator().manual_seed(1)
    return torch.randint(0, 512, (1, PROMPT), generator=gen).to("cuda")


def paged(model: Any, rows: int, **kwargs: Any) -> PagedCache:
    blocks = blocks_needed(model.config, rows, PROMPT + NEW, BLOCK)
    return PagedCache(model.config, num_blocks=blocks, block_size=BLOCK, **kwargs)


def forced_logits(model: Any, cache: Any, prompt: torch.Tensor) -> torch.Tensor:
    """``(NEW + 1, BEAMS, vocab)`` logits: prefill of BEAMS copies, then NEW steps with
    the fixed :data:`REORDERS` and seeded tokens."""
    if isinstance(cache, PagedCache):
        enable_lmcompact_attention(model)
    else:
        model.set_attn_implementation("sdpa")
    gen = torch.Generator().manual_seed(2)
    tokens = torch.randint(0, 512, (NEW, BEAMS), generator=gen).to("cuda")
    with torch.inference_mode():
        out = model(prompt.expand(BEAMS, -1), past_key_values=cache, use_cache=True)
        logits = [out.logits[:, -1]]
        for step in range(NEW):
            beam_idx = torch.tensor(REORDERS[step % len(REORDERS)], device="cuda")
            cache.reorder_cache(beam_idx)
            out = model(tokens[step, :, None], past_key_values=cache, use_cache=True)
            logits.append(out.logits[:, -1])
            if isinstance(cache, PagedCache):
                cache.check_accounting()
    return torch.stack(logits).float()


def _reset(cache: PagedCache) -> None:
    cache.reset()
    assert cache.pool.is_pristine()


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-3), (torch.bfloat16, 5e-2)])
def test_kernel_decode_matches_dynamic_cache(
    model: Any, prompt: torch.Tensor, dtype: torch.dtype, tol: float
) -> None:
    assert use_kernels(prompt.device), "the Triton kernel path is not taken on this machine"
    model.to(dtype)
    try:
        want = forced_logits(model, transformers.DynamicCache(config=model.config), prompt)
        cache = paged(model, BEAMS)
        got = forced_logits(model, cache, prompt)
        assert rel_err(got, want) < tol
        _reset(cache)
    finally:
        model.to(torch.float32)


def _generate(model: Any, prompt: torch.Tensor, beams: int, cache: Any) -> Any:
    with torch.inference_mode():
        return model.generate(
            prompt,
            num_beams=beams,
            do_sample=False,
            max_new_tokens=NEW,
            min_new_tokens=NEW,
            past_key_values=cache,
            output_logits=True,
            return_dict_in_generate=True,
        )


@pytest.mark.parametrize("graphs", [False, True])
@pytest.mark.parametrize("beams", [1, 4])
def test_generate_tokens_identical_to_dynamic_cache(
    model: Any, prompt: torch.Tensor, beams: int, graphs: bool
) -> None:
    model.set_attn_implementation("sdpa")
    want = _generate(model, prompt, beams, transformers.DynamicCache(config=model.config))
    enable_lmcompact_attention(model)
    cache = paged(model, beams)
    if graphs:
        with graphed_decode(model) as g:
            got = _generate(model, prompt, beams, cache)
        assert (g.captures, g.replays) == (1, NEW - 2)  # prefill and the captured step eager
    else:
        got = _generate(model, prompt, beams, cache)
    assert torch.equal(got.sequences, want.sequences)
    cache.check_accounting()
    _reset(cache)


@pytest.mark.parametrize(
    ("kv_dtype", "policy"), [("auto", None), ("int8", None), ("auto", "snapkv"), ("int8", "snapkv")]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_graphed_decode_matches_eager_decode(
    model: Any, prompt: torch.Tensor, kv_dtype: str, policy: str | None, dtype: torch.dtype
) -> None:
    """Replayed steps compute what the eager steps compute (same kernels, same buffers),
    also after a compaction (per-head kept lengths and the hole in the step buffers)."""
    model.to(dtype)
    try:
        enable_lmcompact_attention(model)
        runs = []
        for graphs in (False, True):
            compact = make_policy(policy, budget=0.5) if policy else None
            cache = paged(model, BEAMS, kv_dtype=kv_dtype, policy=compact)
            if graphs:
                with graphed_decode(model) as g:
                    runs.append(_generate(model, prompt, BEAMS, cache))
                # the step after a compaction runs eagerly (the compaction is host work)
                assert g.replays == NEW - (3 if policy else 2) and g.failure is None
            else:
                runs.append(_generate(model, prompt, BEAMS, cache))
            table = cache.paged_layers[0].table
            assert table is not None and (table.tail_start > 0) == (policy is not None)
            cache.check_accounting()
            _reset(cache)
        eager, graphed = runs
        assert torch.equal(graphed.sequences, eager.sequences)
        assert rel_err(torch.stack(graphed.logits), torch.stack(eager.logits)) < 1e-5
    finally:
        model.to(torch.float32)


def test_int8_decode_close_to_float(model: Any, prompt: torch.Tensor) -> None:
    want = forced_logits(model, transformers.DynamicCache(config=model.config), prompt)
    cache = paged(model, BEAMS, kv_dtype="int8")
    got = forced_logits(model, cache, prompt)
    assert rel_err(got, want) < 5e-2
    spec = cache.spec
    assert spec is not None and spec.quantized and cache.peak_kv_bytes() > 0
    _reset(cache)


def test_compacted_kernel_decode_matches_torch_path(model: Any, prompt: torch.Tensor) -> None:
    """snapkv at 0.5: per-head kept lengths and the hole, kernel vs the torch path."""
    runs = []
    for forced in (False, True):
        cache = paged(model, BEAMS, policy=make_policy("snapkv", budget=0.5))
        with force_reference(forced):
            runs.append(forced_logits(model, cache, prompt))
        table = cache.paged_layers[0].table
        assert table is not None and table.tail_start > 0
        _reset(cache)
    assert rel_err(runs[0], runs[1]) < 1e-3
