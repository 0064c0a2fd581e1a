"""The one ``KEY=VALUE`` grammar of ttr's command lines.

``ttr train`` reads ``--section.key=VALUE`` (``--model.overrides.hidden_size=64``) and ``ttr eval``
reads ``--set KEY=VALUE`` / ``--variant MIXER:KEY=VALUE,...`` (TTRConfig fields); both parse VALUE
here: as a TOML value when it is one (``64``, ``3e-4``, ``true``, ``"text"``, ``[1, 2]``,
``{hidden_size = 64}``), else as JSON (``null``, ``{"hidden_size": 64}``), else as the bare string
(``cosine``). It sits at the top of the package, importing nothing from ttr, because ``train`` and
``eval`` may not import each other.
"""

from __future__ import annotations

import json
import sys
from typing import Any

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - Python 3.10
    import tomli as tomllib


def parse_value(text: str) -> Any:
    """VALUE as TOML, else JSON, else the string itself."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        pass
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return text


def parse_assignment(text: str) -> tuple[str, Any]:
    """``"KEY=VALUE"`` -> ``(KEY, parsed VALUE)``; ValueError without ``=`` or with an empty KEY."""
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise ValueError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), parse_value(value)
