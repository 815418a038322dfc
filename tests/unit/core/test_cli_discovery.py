"""CLI discovery: a command whose module needs a missing package does not break the others."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from lmcompact.cli import discover_commands


def test_unimportable_command_becomes_a_stub(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    pkg = tmp_path / "fakecli"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "good.py").write_text(
        "NAME = 'good'\nHELP = 'works'\ndef add_arguments(p): pass\ndef run(a): return 0\n"
    )
    (pkg / "needs_missing.py").write_text("import lmcompact_no_such_package\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    try:
        commands = {m.NAME: m for m in discover_commands("fakecli")}
        assert set(commands) == {"good", "needs-missing"}
        assert commands["good"].run(None) == 0
        with pytest.raises(SystemExit, match="lmcompact_no_such_package"):
            commands["needs-missing"].run(None)
    finally:
        for name in [n for n in sys.modules if n.startswith("fakecli")]:
            del sys.modules[name]
