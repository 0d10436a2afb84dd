"""Reading a JSON file whose every failure is a ConfigError naming the key, the value and the fix.

Used by the DeepSpeed config reader, the planner's readings and its Hugging Face config.json reader.
Imports nothing of fp4offload but the errors, so any module may use it.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from fp4offload.errors import ConfigError


def read_json(path: Path, key: str, value: str, *, readable: str, valid: str,
              detail: str = "not valid JSON: {exc}", top: str | None = None) -> Any:
    """The parsed JSON document at ``path``.

    Raises ConfigError(key, value, ...) expecting ``readable`` when the file cannot be read (the OSError as
    the hint), ``valid`` when it is not JSON (the hint is ``detail`` formatted with the JSONDecodeError as
    ``exc``), and, when ``top`` is given, ``top`` when the document is not a JSON object.
    """
    try:
        doc = json.loads(path.read_text())
    except OSError as exc:
        raise ConfigError(key, value, readable, str(exc)) from None
    except json.JSONDecodeError as exc:
        raise ConfigError(key, value, valid, detail.format(exc=exc)) from None
    if top is not None and not isinstance(doc, dict):
        raise ConfigError(key, value, top)
    return doc
