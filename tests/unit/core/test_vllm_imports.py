"""Where vLLM may be imported, read from every module's import statements.

* ``connectors/vllm/patches/`` holds every touch of vLLM internals: only there may a module
  import a vLLM module beyond the public connector API;
* everywhere else (the connector, the apps, examples, scripts) only the public API: the
  connector base module and the types its method signatures name, ``vllm.config``, and the
  ``vllm`` entry points (``LLM``, ``SamplingParams``);
* ``lmcompact/`` is the engine-agnostic core: outside the apps that drive engines (``bench``,
  ``eval``, ``cli``) it imports neither vLLM nor the connectors, not even lazily.

Imports inside functions count the same as top-level ones.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
PATCHES = ROOT / "connectors" / "vllm" / "patches"
APPS = ("bench", "eval", "cli")

PUBLIC_MODULES = frozenset(
    {
        "vllm.config",
        "vllm.distributed.kv_transfer.kv_connector.v1.base",
        # the connector API's stats types (get_kv_connector_stats, build_prom_metrics)
        "vllm.distributed.kv_transfer.kv_connector.v1.metrics",
        # types named by the base class's method signatures
        "vllm.v1.core.sched.output",
        "vllm.v1.request",
        "vllm.v1.kv_cache_interface",
        "vllm.v1.core.kv_cache_manager",
        "vllm.v1.outputs",
        "vllm.forward_context",
        "vllm.attention.backends.abstract",
        # the target of vLLM's own ``vllm`` console script (the lmcompact-vllm launcher)
        "vllm.entrypoints.cli.main",
        # vLLM v1's custom logits-processor API (``LLM(logits_processors=[...])``, documented
        # by vLLM as an extension point): the eval's forced tokens (forced_tokens.py)
        "vllm.v1.sample.logits_processor",
    }
)
"""vLLM modules any file may import."""

PUBLIC_NAMES = frozenset({"LLM", "SamplingParams"})
"""Names any file may import from the ``vllm`` package itself."""


def imported(path: Path) -> list[tuple[int, str, list[str]]]:
    """``(line, module, names)`` of every import in ``path`` (names: ``from`` imports)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    found: list[tuple[int, str, list[str]]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name, []) for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module, [alias.name for alias in node.names]))
    return found


def is_vllm(module: str) -> bool:
    return module == "vllm" or module.startswith("vllm.")


def public_vllm(module: str, names: list[str]) -> bool:
    if module == "vllm":
        return bool(names) and set(names) <= PUBLIC_NAMES
    return module in PUBLIC_MODULES


def python_files(*folders: str) -> list[Path]:
    return sorted(p for folder in folders for p in (ROOT / folder).rglob("*.py"))


def vllm_import_problems(path: Path) -> list[str]:
    """What ``path`` imports that the rules above forbid it."""
    rel = path.relative_to(ROOT)
    in_patches = PATCHES in path.parents
    in_core = rel.parts[0] == "lmcompact" and (len(rel.parts) < 3 or rel.parts[1] not in APPS)
    problems = []
    for line, module, names in imported(path):
        engine = is_vllm(module) or module == "connectors" or module.startswith("connectors.")
        if in_core and engine:
            problems.append(f"{rel}:{line} the core imports {module}")
        elif is_vllm(module) and not in_patches and not public_vllm(module, names):
            shown = f"{module} ({', '.join(names)})" if names else module
            problems.append(f"{rel}:{line} imports vLLM internal {shown} outside patches/")
    return problems


def test_vllm_internals_only_in_patches_and_core_engine_free() -> None:
    files = python_files("lmcompact", "connectors", "examples", "scripts")
    assert len(files) > 100  # the walk reached the tree
    assert any(PATCHES in f.parents for f in files)
    problems = [p for f in files for p in vllm_import_problems(f)]
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize(
    ("folder", "source", "expected"),
    [
        ("lmcompact/compaction", "import vllm\n", "the core imports vllm"),
        ("lmcompact/hf", "def f():\n    from connectors.vllm import offline\n", "the core"),
        ("lmcompact/bench", "from vllm.v1.core.block_pool import BlockPool\n", "internal"),
        ("connectors/vllm", "from vllm import envs\n", "internal vllm (envs)"),
        ("lmcompact/bench", "from vllm import LLM, SamplingParams\n", None),
        ("connectors/vllm", "from vllm.config import KVTransferConfig\n", None),
        ("connectors/vllm/patches", "from vllm import _custom_ops\n", None),
        ("lmcompact/cli", "from connectors.vllm import offline\n", None),
    ],
)
def test_rules_catch_what_they_should(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, folder: str, source: str, expected: str | None
) -> None:
    """The checker itself, on small files placed where the rules differ."""
    fake_root = tmp_path
    target = fake_root / folder / "probe.py"
    target.parent.mkdir(parents=True)
    target.write_text(source)
    monkeypatch.setattr(__import__(__name__, fromlist=["ROOT"]), "ROOT", fake_root)
    monkeypatch.setattr(
        __import__(__name__, fromlist=["PATCHES"]),
        "PATCHES",
        fake_root / "connectors" / "vllm" / "patches",
    )
    problems = vllm_import_problems(target)
    if expected is None:
        assert problems == []
    else:
        assert len(problems) == 1 and expected in problems[0], problems
