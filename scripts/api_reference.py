"""Write docs/api.md, the API reference, from the docstrings of gear_torchrl's public names.

The public names are those ``gear_torchrl/__init__.py`` exports (``__all__``).
For each: its signature and the first paragraph of its docstring; for a class,
the same for the public methods and properties it defines itself (what it
inherits from TorchRL is documented there). ``tests/test_api_reference.py``
fails when docs/api.md differs from what this writes, so the reference cannot
drift from the code.

    .venv/bin/python scripts/api_reference.py            # rewrite docs/api.md
    .venv/bin/python scripts/api_reference.py --check    # exit 1 if docs/api.md is out of date
"""

from __future__ import annotations

import argparse
import inspect
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
API_MD = ROOT / "docs" / "api.md"
HEADER = """# API reference

Generated from the docstrings by `scripts/api_reference.py`; do not edit by hand
(`.venv/bin/python scripts/api_reference.py` rewrites it, and a test checks it is
current). Every name here imports from `gear_torchrl`. Methods of TorchRL's
`Storage` and `Sampler` contracts that these classes implement are documented by
TorchRL; listed here is what gear_torchrl adds.
"""


class _Text(str):
    """An annotation as written in the source (``from __future__ import annotations``), shown without quotes."""

    def __repr__(self) -> str:
        return str(self)


def render() -> str:
    """The whole of docs/api.md."""
    import gear_torchrl

    sections = [HEADER]
    for name in gear_torchrl.__all__:
        sections.append(_entry(name, getattr(gear_torchrl, name)))
    return "\n".join(sections)


def _entry(name: str, obj: Any) -> str:
    if inspect.isclass(obj) and issubclass(obj, BaseException):
        bases = ", ".join(b.__name__ for b in obj.__bases__)
        return f"## {name}\n\nAn exception ({bases}): {_summary(obj)}\n"
    lines = [f"## {name}", "", "```python", f"{name}{_signature(obj)}", "```", "", _summary(obj)]
    if inspect.isclass(obj):
        members = _own_members(obj)
        if members:
            lines.append("")
            lines += [f"- `{label}`: {text}" for label, text in members]
    return "\n".join(lines) + "\n"


def _own_members(cls: type) -> list[tuple[str, str]]:
    """Public methods and properties defined by ``cls`` itself that say what they do."""
    found = []
    for attr, value in cls.__dict__.items():
        if attr.startswith("_"):
            continue
        if isinstance(value, property):
            label, func = attr, value.fget
        elif isinstance(value, (staticmethod, classmethod)):
            signature = _signature(value.__func__, drop_first=isinstance(value, classmethod))
            label, func = f"{attr}{signature}", value.__func__
        elif inspect.isfunction(value):
            label, func = f"{attr}{_signature(value, drop_first=True)}", value
        else:
            continue
        if func is not None and func.__doc__:  # its own docstring, not one it overrides
            found.append((label, _summary(func)))
    return found


def _signature(obj: Any, drop_first: bool = False) -> str:
    cls = obj if inspect.isclass(obj) else None
    if cls is not None:  # its __init__: TorchRL's samplers have a metaclass whose __call__ hides it
        obj, drop_first = cls.__init__, True
    try:
        signature = inspect.signature(obj)
    except (TypeError, ValueError):
        return "(...)"
    params = list(signature.parameters.values())
    if drop_first and params:
        params = params[1:]
    params = [p.replace(annotation=_Text(p.annotation)) if isinstance(p.annotation, str) else p for p in params]
    returns = signature.return_annotation
    if isinstance(returns, str):
        returns = _Text(returns)
    if cls is not None:
        returns = inspect.Signature.empty
    return str(signature.replace(parameters=params, return_annotation=returns))


def _summary(obj: Any) -> str:
    """The first paragraph of ``obj``'s own docstring (not one inherited), on one line."""
    doc = inspect.cleandoc(obj.__doc__) if obj.__doc__ else "(no docstring)"
    return " ".join(doc.split("\n\n", 1)[0].split())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 if docs/api.md differs, write nothing")
    args = parser.parse_args()
    text = render()
    if args.check:
        if not API_MD.exists() or API_MD.read_text() != text:
            sys.exit(f"{API_MD} is out of date: run .venv/bin/python scripts/api_reference.py")
        return
    API_MD.write_text(text)
    print(f"wrote {API_MD} ({len(text.splitlines())} lines)")


if __name__ == "__main__":
    main()
