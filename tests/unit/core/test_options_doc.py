"""The options reference (docs/configuration.md) is complete and generated from the code.

Every connector option needs a line in its class's ``Attributes:`` docstring section
(:func:`lmcompact.options_doc.option_docs` raises otherwise), and the committed page must
equal what ``scripts/gen_options_doc.py`` generates now.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

from connectors.vllm.config import ConnectorConfig, ReleaseOptions, StoreOptions
from lmcompact.options import boolean, integer, option
from lmcompact.options_doc import (
    UndocumentedOptionError,
    attribute_docs,
    documented_constants,
    first_sentence,
    markdown,
    markdown_table,
    option_docs,
)

ROOT = Path(__file__).resolve().parents[3]
GROUPS = {"store": ("object", "`{}`", "an object"), "release": ("object", "`null`", "an object")}


@pytest.mark.parametrize("cls", [ConnectorConfig, StoreOptions, ReleaseOptions])
def test_every_connector_option_has_type_default_rule_and_meaning(cls: type) -> None:
    docs = option_docs(cls, groups=GROUPS)  # raises on a field without a doc line
    assert [doc.name for doc in docs] == [f.name for f in dataclasses.fields(cls)]
    for doc in docs:
        assert doc.type and doc.default and doc.allowed, doc
        assert doc.meaning.endswith((".", ")")), doc.meaning
        assert doc.details.startswith(doc.meaning.rstrip(".")), doc.name


@dataclass(frozen=True)
class _HalfDocumented:
    """Options of a test.

    Attributes:
        depth: how deep, documented over
            two lines.
    """

    depth: int = option(1, integer(1))
    verbose: bool = option(False, boolean())


def test_a_field_without_a_doc_line_is_refused_by_name() -> None:
    with pytest.raises(UndocumentedOptionError, match=r"\['verbose'\]"):
        option_docs(_HalfDocumented)


def test_attribute_docs_join_continuation_lines_and_stop_at_the_section_end() -> None:
    assert attribute_docs(_HalfDocumented) == {"depth": "how deep, documented over two lines."}
    assert attribute_docs(ReleaseOptions)["sink_blocks"] == "leading blocks never dropped, >= 1."


def test_meaning_is_the_first_sentence_outside_brackets_and_code() -> None:
    text = "a list (e.g. one. two) of `a. b` names. Then more."
    assert first_sentence(text) == "a list (e.g. one. two) of `a. b` names."
    assert first_sentence("no full stop") == "no full stop"


def test_markdown_speaks_json_and_links_docs_paths() -> None:
    text = "``x`` is None by :class:`Foo` (``docs/eval/RESULTS.md``)."
    assert markdown(text) == "`x` is null by `Foo` ([`docs/eval/RESULTS.md`](eval/RESULTS.md))."


def test_table_rows_link_details_when_the_docstring_says_more() -> None:
    table = markdown_table(option_docs(ReleaseOptions, "release."))
    row = next(line for line in table.splitlines() if line.startswith("| `release.prefill`"))
    assert '`"auto"`' in row and "[more](#releaseprefill)" in row


def test_documented_constants_pair_values_with_the_docstring_after_them(tmp_path: Path) -> None:
    source = tmp_path / "consts.py"
    source.write_text(
        'FACTOR = 1.8\n"""How much more the ``store`` keeps."""\n'
        "PLAIN = 3\n"
        'NAMES: tuple[str, ...] = ("a", "b")\n"""The names,\n    over two lines."""\n'
    )
    spec = importlib.util.spec_from_file_location("consts", source)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    assert documented_constants(module) == {
        "FACTOR": (1.8, "How much more the `store` keeps."),
        "NAMES": (("a", "b"), "The names, over two lines."),
    }


def test_configuration_page_is_generated_from_the_current_options() -> None:
    done = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_options_doc.py"), "--check"],
        capture_output=True,
        text=True,
        env=dict(os.environ, PYTHONPATH=str(ROOT)),
        cwd=ROOT,
        timeout=120,
        check=False,
    )
    assert done.returncode == 0, done.stdout[-4000:] + done.stderr[-2000:]
