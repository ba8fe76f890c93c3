"""MkDocs hook: ``<!-- fields: package.module.Class -->`` in a page becomes the table of that dataclass's fields
(name, default, help), read from the code, so every default is stated once: where it is defined."""

from __future__ import annotations

import dataclasses
import importlib
import re
import warnings
from typing import Any

_MARKER = re.compile(r"<!-- fields: ([\w.]+)(?: flags)? -->")


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return f"`{f.default!r}`"
    if f.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
        return f"`{f.default_factory()!r}`"  # type: ignore[misc]
    return "required"


def fields_table(path: str, flags: bool = False) -> str:
    """The Markdown table of the fields a dataclass declares itself (not those of PEFT's ``PeftConfig``)."""
    module, _, name = path.rpartition(".")
    with warnings.catch_warnings():  # torch's own deprecation notices at import, not the site's
        warnings.simplefilter("ignore", DeprecationWarning)
        cls = getattr(importlib.import_module(module), name)
    own = set()
    for klass in cls.__mro__:
        if klass.__module__.startswith("poet_hf"):
            own |= set(getattr(klass, "__annotations__", {}))
    rows = ["| " + ("flag" if flags else "field") + " | default | meaning |", "|---|---|---|"]
    for f in dataclasses.fields(cls):
        if f.name not in own or f.name.startswith("_"):
            continue
        name = f"`--{f.name}`" if flags else f"`{f.name}`"
        meaning = " ".join(str(f.metadata.get("help", "")).split()).replace("|", "\\|")
        rows.append(f"| {name} | {_default(f)} | {meaning} |")
    return "\n".join(rows)


def on_page_markdown(markdown: str, **kwargs: Any) -> str:
    return _MARKER.sub(lambda m: fields_table(m.group(1), flags=m.group(0).endswith(" flags -->")), markdown)
