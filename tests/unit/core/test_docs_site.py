"""The README stays short and its links resolve; the docs site builds strict and its home
page links every page.

The strict build is also a step of ``scripts/bootstrap.sh test``; here it runs into a
temporary folder so that the index can be read.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]
README = ROOT / "README.md"
MAX_README_LINES = 200
LINK = re.compile(r"\]\(([^)#\s]+)(?:#[^)]*)?\)")


def test_readme_is_short_and_opens_with_the_two_commands() -> None:
    lines = README.read_text().splitlines()
    assert len(lines) <= MAX_README_LINES, f"README.md has {len(lines)} lines"
    head = "\n".join(lines[:12])
    assert "scripts/bootstrap.sh demo" in head and "scripts/bootstrap.sh test" in head


def test_readme_links_point_at_files_in_the_checkout() -> None:
    targets = [t for t in LINK.findall(README.read_text()) if "://" not in t]
    assert targets, "the README links its docs pages"
    missing = [t for t in targets if not (ROOT / t).exists()]
    assert not missing, f"README links to missing files: {missing}"


def test_site_builds_strict_and_its_index_links_every_page(tmp_path: Path) -> None:
    pytest.importorskip("mkdocs", reason="mkdocs comes with the dev extra")
    pytest.importorskip("material", reason="mkdocs-material comes with the dev extra")
    site = tmp_path / "site"
    done = subprocess.run(
        [sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(site)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        env=dict(os.environ, NO_MKDOCS_2_WARNING="1"),
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    index = (site / "index.html").read_text()
    pages = sorted(
        str(page.parent.relative_to(site)) + "/"
        for page in site.rglob("index.html")
        if page.parent != site
    )
    assert len(pages) >= 15, pages
    unlinked = [page for page in pages if f'href="{page}"' not in index]
    assert not unlinked, f"pages the site's home page does not link: {unlinked}"


def test_policies_page_has_a_row_for_every_built_in_policy() -> None:
    from lmcompact.policies.registry import _BUILTIN

    page = (ROOT / "docs" / "policies.md").read_text()
    keeps = page.split("## What each keeps", 1)[1].split("\n## ", 1)[0]
    rows = set(re.findall(r"^\| `(\w+)` \|", keeps, flags=re.MULTILINE))
    missing = sorted(set(_BUILTIN) - rows)
    assert not missing, (
        f"docs/policies.md has no row for {missing} in 'What each keeps, and the paper' "
        "(what it keeps, what it reads, its paper); add it to 'Where each runs' too"
    )
