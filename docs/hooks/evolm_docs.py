"""MkDocs hook of the EvoLM documentation (``hooks:`` in mkdocs.yml).

- The settings page is generated from the config classes at build time: every marker
  ``<!-- settings-table: ESConfig -->`` in a page becomes a table of that class's fields (type,
  default, constraints, help text), so the page cannot drift from ``evolm_lib/config.py``. A field
  without a help text stops the build, naming the field.
- ``figures/`` at the repository root is published under ``figures/`` in the site, so the pages show
  the same figure files as the README, without a second copy in ``docs/``.

A field's help text is its pydantic ``description`` or, as ``config.py`` writes them today, the
string literal right under the field (an attribute docstring, read from the source as pydantic's
``use_attribute_docstrings`` would).
"""
from __future__ import annotations

import ast
import inspect
import re
import sys
import textwrap
import typing
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
MARKER = re.compile(r"<!--\s*settings-table:\s*(\w+)\s*-->")
SETTINGS_CLASSES = ("CommonConfig", "ESConfig", "GRPOConfig")
ANCHOR_PREFIX = {"CommonConfig": "common", "ESConfig": "es", "GRPOConfig": "grpo"}


class MissingHelpText(ValueError):
    """A settings field has neither a ``description`` nor a docstring under it."""


# --- help texts ------------------------------------------------------------------------------------

def attribute_docstrings(cls: type) -> dict[str, str]:
    """The string literals written right under each annotated field in ``cls``'s own body."""
    source = textwrap.dedent(inspect.getsource(cls))
    body = ast.parse(source).body[0].body
    found = {}
    for statement, following in zip(body, body[1:]):
        if (isinstance(statement, ast.AnnAssign) and isinstance(statement.target, ast.Name)
                and isinstance(following, ast.Expr) and isinstance(following.value, ast.Constant)
                and isinstance(following.value.value, str)):
            found[statement.target.id] = inspect.cleandoc(following.value.value)
    return found


def help_text(cls: type, name: str) -> str:
    """A field's help text: its ``description``, else the docstring under it in the nearest class
    of the MRO that declares it; empty when there is none."""
    description = cls.model_fields[name].description
    if description:
        return inspect.cleandoc(description)
    for owner in cls.__mro__:
        if name in owner.__dict__.get("__annotations__", {}):
            return attribute_docstrings(owner).get(name, "")
    return ""


def fields_without_help(cls: type) -> list[str]:
    """Names of ``cls``'s fields that have no help text."""
    return [name for name in cls.model_fields if not help_text(cls, name).strip()]


def check_help_texts(classes) -> None:
    """Raise MissingHelpText naming every field of ``classes`` without a help text."""
    missing = [f"{cls.__name__}.{name}" for cls in classes for name in fields_without_help(cls)]
    if missing:
        raise MissingHelpText(
            "settings without a help text: " + ", ".join(missing) + " (write a docstring line under the "
            "field in evolm_lib/config.py, or Field(description=...)); the settings page is built from them")


# --- one table per class ---------------------------------------------------------------------------

def own_fields(cls: type) -> list[str]:
    """Fields declared (or redeclared, with another default or help text) in ``cls``'s own body, in order."""
    own = cls.__dict__.get("__annotations__", {})
    return [name for name in cls.model_fields if name in own]


def type_text(annotation: Any) -> str:
    """A field's type in words: ``"a"`` or ``"b"`` for a Literal, "X or None", "list of str"."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Literal:
        return " or ".join(f'`"{value}"`' if isinstance(value, str) else f"`{value!r}`" for value in args)
    if origin is typing.Union:
        inner = [a for a in args if a is not type(None)]
        text = " or ".join(type_text(a) for a in inner)
        return f"{text} or None" if len(inner) < len(args) else text
    if origin in (tuple, list):
        return f"list of {type_text(args[0])}" if args else "list"
    if origin is dict:
        return "mapping"
    return getattr(annotation, "__name__", str(annotation))


def constraint_text(field) -> str:
    """The field's bounds, e.g. ``> 0, <= 1``."""
    signs = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}
    parts = []
    for item in field.metadata:
        for attribute, sign in signs.items():
            value = getattr(item, attribute, None)
            if value is not None:
                parts.append(f"{sign} {value}")
    return ", ".join(parts)


def default_text(field) -> str:
    """The default as Python writes it (a string in double quotes, a tuple as its comma-separated items)."""
    value = field.get_default(call_default_factory=True)
    if isinstance(value, tuple):
        return ", ".join(f"`{item}`" for item in value) if value else "`()`"
    if isinstance(value, str):
        return f'`"{value}"`'  # quoted as the Literal types are
    return f"`{value!r}`"


def cell(text: str) -> str:
    """Text safe inside a Markdown table cell (one line, pipes and stars escaped)."""
    return " ".join(text.split()).replace("|", "\\|").replace("*", "\\*")


def settings_table(cls: type, names: list[str] | None = None) -> str:
    """A Markdown table of ``cls``'s fields (default: the ones its own body declares)."""
    prefix = ANCHOR_PREFIX.get(cls.__name__, cls.__name__.lower())
    rows = ["| setting | type | default | allowed | what it does |", "| --- | --- | --- | --- | --- |"]
    for name in names if names is not None else own_fields(cls):
        field = cls.model_fields[name]
        text = help_text(cls, name)
        if not text.strip():
            raise MissingHelpText(f"{cls.__name__}.{name}: no help text (a docstring line under the field, or Field(description=...))")
        rows.append(f'| <span id="{prefix}-{name}"></span>`{name}` | {cell(type_text(field.annotation))} '
                    f"| {cell(default_text(field))} | {cell(constraint_text(field))} | {cell(text)} |")
    return "\n".join(rows)


def settings_classes() -> dict[str, type]:
    """The config classes the settings page documents, imported from this checkout's evolm_lib."""
    if str(ROOT) not in sys.path:
        sys.path.insert(0, str(ROOT))
    from evolm_lib import config

    return {name: getattr(config, name) for name in SETTINGS_CLASSES}


def expand_markers(markdown: str, classes: dict[str, type]) -> str:
    """Replace every ``<!-- settings-table: Name -->`` marker by that class's table."""

    def table(match: re.Match) -> str:
        name = match.group(1)
        if name not in classes:
            raise KeyError(f"settings-table marker names {name!r}; known: {', '.join(classes)}")
        return settings_table(classes[name])

    return MARKER.sub(table, markdown)


# --- MkDocs events ---------------------------------------------------------------------------------

def on_page_markdown(markdown: str, page, config, files, **kwargs) -> str:
    """Expand the settings markers; a field without help text aborts the build."""
    if not MARKER.search(markdown):
        return markdown
    from mkdocs.exceptions import PluginError

    classes = settings_classes()
    try:
        check_help_texts(classes.values())
        return expand_markers(markdown, classes)
    except (MissingHelpText, KeyError) as error:
        raise PluginError(f"{page.file.src_uri}: {error}") from None


def on_files(files, config, **kwargs):
    """Publish the repository's figures/ under figures/ in the site."""
    from mkdocs.structure.files import File

    figures = ROOT / "figures"
    for path in sorted(figures.rglob("*")):
        if path.is_file() and path.suffix.lower() in {".png", ".svg", ".jpg", ".pdf", ".csv", ".json"}:
            files.append(File(path.relative_to(ROOT).as_posix(), src_dir=str(ROOT), dest_dir=config["site_dir"],
                              use_directory_urls=config["use_directory_urls"]))
    return files
