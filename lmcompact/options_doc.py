"""Markdown reference of option dataclasses (:mod:`lmcompact.options`), read from the code.

For every field of a dataclass made with :func:`lmcompact.options.option`, the reference
gives its name, a JSON type, its default, its rule's allowed values and the meaning from
the class's Google-style ``Attributes:`` docstring section. A field without a doc line
raises :class:`UndocumentedOptionError`, so an option cannot ship unexplained.

Engine-agnostic: it reads dataclass fields and docstrings only; which classes make up a
reference page is the caller's choice (``scripts/gen_options_doc.py`` for the connector).
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import json
import re
from dataclasses import dataclass
from types import ModuleType
from typing import Any

_ATTRIBUTE = re.compile(r"^(\w+)(?:\s*\([^)]*\))?:\s*(.*)$")
_ROLE = re.compile(r":(?:class|mod|func|meth|data|attr):`~?([^`]+)`")
_PYTHON_WORDS = re.compile(r"\b(?:None|True|False)\b")
_JSON_WORDS = {"None": "null", "True": "true", "False": "false"}
_DOCS_PATH = re.compile(r"`?\bdocs/([\w./-]+?\.(?:md|json|png))`?")
_JSON_TYPES = {
    "int": "integer",
    "float": "number",
    "str": "string",
    "bool": "boolean",
    "tuple[str, ...]": "list of strings",
    "Mapping[str, Any]": "object",
}


class UndocumentedOptionError(ValueError):
    """A dataclass field has no line in its class's ``Attributes:`` docstring section."""


@dataclass(frozen=True)
class OptionDoc:
    """One option as the reference shows it.

    Attributes:
        name: the key as a user writes it, with its group (``store.chunk_size``).
        type: the JSON type (``integer or null``).
        default: the default as Markdown: JSON in a code span, or a phrase for a group.
        allowed: what the option's rule accepts, in words.
        meaning: the docstring's first sentence (Markdown).
        details: the docstring's whole text (Markdown).
    """

    name: str
    type: str
    default: str
    allowed: str
    meaning: str
    details: str


def attribute_docs(cls: type) -> dict[str, str]:
    """The ``Attributes:`` section of ``cls``'s docstring: field name -> its text, unwrapped.

    Google style: a line ``name: text`` indented one level below ``Attributes:``, its
    continuation lines indented deeper; the section ends at a line indented no deeper than
    the heading (or the docstring's end).
    """
    doc = inspect.getdoc(cls) or ""
    lines = doc.splitlines()
    try:
        start = next(i for i, line in enumerate(lines) if line.strip() == "Attributes:")
    except StopIteration:
        return {}
    heading_indent = _indent(lines[start])
    docs: dict[str, list[str]] = {}
    entry_indent: int | None = None
    current: list[str] | None = None
    for line in lines[start + 1 :]:
        if not line.strip():
            continue
        indent = _indent(line)
        if indent <= heading_indent:
            break
        if entry_indent is None:
            entry_indent = indent
        match = _ATTRIBUTE.match(line.strip()) if indent == entry_indent else None
        if match:
            current = docs.setdefault(match.group(1), [])
            current.append(match.group(2))
        elif current is not None:
            current.append(line.strip())
    return {name: " ".join(part for part in parts if part) for name, parts in docs.items()}


def option_docs(
    cls: type, prefix: str = "", groups: dict[str, tuple[str, str, str]] | None = None
) -> list[OptionDoc]:
    """Every field of the option dataclass ``cls``, in declaration order.

    Args:
        cls: a dataclass whose fields were made by :func:`lmcompact.options.option`.
        prefix: prepended to each name (``"store."``).
        groups: fields without a rule (nested groups): name -> (type, default, allowed)
            in Markdown; any other field without a rule is an error.

    Raises:
        UndocumentedOptionError: fields without a doc line (all of them named).
    """
    texts = attribute_docs(cls)
    groups = groups or {}
    fields = dataclasses.fields(cls)  # type: ignore[arg-type]
    missing = [f.name for f in fields if not texts.get(f.name, "").strip()]
    if missing:
        raise UndocumentedOptionError(
            f"{cls.__name__} fields without a line in its 'Attributes:' docstring section: "
            f"{missing}"
        )
    docs = []
    for field in fields:
        details = markdown(texts[field.name])
        if "rule" in field.metadata:
            type_words = json_type(str(field.type))
            default = f"`{json_default(field)}`"
            allowed = field.metadata["rule"].allowed
        elif field.name in groups:
            type_words, default, allowed = groups[field.name]
        else:
            raise ValueError(f"{cls.__name__}.{field.name} has no rule and is not a group")
        docs.append(
            OptionDoc(
                name=prefix + field.name,
                type=type_words,
                default=default,
                allowed=allowed,
                meaning=first_sentence(details),
                details=details,
            )
        )
    return docs


def documented_constants(module: ModuleType) -> dict[str, tuple[Any, str]]:
    """Module-level names with an attribute docstring (a string right after the assignment):
    name -> (its value now, the docstring as Markdown)."""
    found: dict[str, tuple[Any, str]] = {}
    body = ast.parse(inspect.getsource(module)).body
    for node, after in itertools.pairwise(body):
        target: ast.expr | None = None
        if isinstance(node, ast.AnnAssign):
            target = node.target
        elif isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        docstring = after.value if isinstance(after, ast.Expr) else None
        doc = docstring.value if isinstance(docstring, ast.Constant) else None
        if isinstance(target, ast.Name) and isinstance(doc, str) and hasattr(module, target.id):
            text = " ".join(inspect.cleandoc(doc).split())
            found[target.id] = (getattr(module, target.id), markdown(text))
    return found


def constants_table(constants: dict[str, tuple[Any, str]]) -> str:
    """A Markdown table: name | value (JSON) | meaning."""
    rows = ["| name | value | meaning |", "|---|---|---|"]
    for name, (value, doc) in constants.items():
        shown = list(value) if isinstance(value, tuple) else value
        rows.append(f"| `{name}` | `{json.dumps(shown)}` | {_cell(doc)} |")
    return "\n".join(rows) + "\n"


def markdown_table(docs: list[OptionDoc], link_details: bool = True) -> str:
    """A Markdown table: option | type | default | allowed | meaning.

    ``link_details``: an option whose docstring says more than its first sentence links to
    its heading made by :func:`markdown_details`.
    """
    rows = ["| option | type | default | allowed | meaning |", "|---|---|---|---|---|"]
    for doc in docs:
        meaning = doc.meaning
        if link_details and doc.details != doc.meaning:
            meaning += f" [more](#{slug(doc.name)})"
        cells = [f"`{doc.name}`", doc.type, doc.default, doc.allowed, meaning]
        rows.append("| " + " | ".join(_cell(cell) for cell in cells) + " |")
    return "\n".join(rows) + "\n"


def markdown_details(docs: list[OptionDoc], level: int = 3) -> str:
    """A heading per option whose docstring says more than its first sentence, with it all."""
    parts = []
    for doc in docs:
        if doc.details == doc.meaning:
            continue
        parts.append(f"{'#' * level} {doc.name}\n\n{doc.details}\n")
    return "\n".join(parts)


def slug(name: str) -> str:
    """The anchor of an option's details heading, as both mkdocs (its ``toc`` extension) and
    GitHub make it: punctuation dropped (``store.compact_on`` -> ``storecompact_on``)."""
    return re.sub(r"[^\w-]", "", name.lower())


def json_type(annotation: str) -> str:
    """A Python annotation in JSON words (``int | None`` -> ``integer or null``)."""
    parts = [part.strip() for part in annotation.split("|")]
    words = ["null" if part == "None" else _JSON_TYPES.get(part, part) for part in parts if part]
    return " or ".join(words)


def json_default(field: dataclasses.Field[Any]) -> str:
    """A field's default as the JSON a user would write."""
    if field.default_factory is not dataclasses.MISSING:
        value = field.default_factory()
    else:
        value = field.default
    if isinstance(value, tuple):
        value = list(value)
    return json.dumps(value)


def markdown(text: str) -> str:
    """A docstring's text for a JSON user, in Markdown: reST ``x`` and :role:`x` as `x`,
    Python's None / True / False as null / true / false, ``docs/`` paths as links relative
    to a page in ``docs/``, the first letter capitalized."""
    text = _ROLE.sub(lambda m: f"`{m.group(1)}`", text).replace("``", "`")
    text = _PYTHON_WORDS.sub(lambda m: _JSON_WORDS[m.group(0)], text)
    text = _DOCS_PATH.sub(lambda m: f"[`docs/{m.group(1)}`]({m.group(1)})", text)
    return text[:1].upper() + text[1:]


def first_sentence(text: str) -> str:
    """The text up to its first full stop outside brackets and code spans."""
    depth, code = 0, False
    for index, char in enumerate(text):
        if char == "`":
            code = not code
        elif code:
            continue
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth = max(0, depth - 1)
        elif (
            char == "."
            and depth == 0
            and text[index + 1 : index + 2] in (" ", "")
            and not text[:index].endswith(("e.g", "i.e"))
        ):
            return text[: index + 1]
    return text


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())
