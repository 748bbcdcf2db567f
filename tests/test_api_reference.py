"""docs/api.md is what scripts/api_reference.py writes from today's docstrings."""

from __future__ import annotations

import importlib.util
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "api_reference.py"


def _generator():
    spec = importlib.util.spec_from_file_location("api_reference", SCRIPT)
    assert spec is not None and spec.loader is not None, SCRIPT
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_api_reference_is_up_to_date():
    generator = _generator()
    assert generator.API_MD.read_text() == generator.render(), (
        "docs/api.md is out of date with the docstrings: run .venv/bin/python scripts/api_reference.py"
    )
