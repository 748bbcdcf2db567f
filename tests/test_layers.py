"""The tree is DESIGN.md's diagram: one folder per layer, and a folder imports only the folders below it.

Read from the source (every import statement, those inside functions too), so
a deferred import cannot hide a reach upwards. ``errors.py`` imports nothing of
the package and every layer may raise from it; the face (``__init__.py``) only
names what the layers define.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path
from typing import TypeGuard

PACKAGE = Path(__file__).resolve().parents[1] / "gear_torchrl"
# Bottom to top: a module may import its own folder and the folders before it.
LAYERS = ("kernels", "store", "selection", "distributed", "adapters")
SHARED = "gear_torchrl.errors"


def _imports(path: Path, *, top_level_only: bool = False, type_checking: bool = False) -> set[str]:
    """Modules of the package (and others) that ``path`` imports: ``from gear_torchrl import x`` counts as ``x``.

    ``top_level_only``: the module-level statements (not the imports deferred into functions), and with
    ``type_checking`` those under ``if TYPE_CHECKING:`` too (what a type checker follows)."""
    tree = ast.parse(path.read_text())
    nodes = list(ast.walk(tree))
    if top_level_only:
        nodes = [*tree.body, *(n for block in tree.body if type_checking and _checks_types(block) for n in block.body)]
    names: set[str] = set()
    for node in nodes:
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module)
            names |= {
                f"{node.module}.{alias.name}"
                for alias in node.names
                if _module_file(f"{node.module}.{alias.name}") is not None
            }
    return names


def _checks_types(node: ast.stmt) -> TypeGuard[ast.If]:
    """Whether ``node`` is ``if TYPE_CHECKING:`` (imports only a type checker follows)."""
    return isinstance(node, ast.If) and isinstance(node.test, ast.Name) and node.test.id == "TYPE_CHECKING"


def _module_file(name: str) -> Path | None:
    if name.split(".")[0] != "gear_torchrl":
        return None
    rel = Path(*name.split(".")[1:])
    for candidate in (PACKAGE / rel.with_suffix(".py"), PACKAGE / rel / "__init__.py"):
        if candidate.exists():
            return candidate
    return None


def _module_name(path: Path) -> str:
    return ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__")


def _layer(name: str) -> str | None:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in LAYERS else None


def test_the_package_is_the_layers_and_nothing_else():
    folders = {p.name for p in PACKAGE.iterdir() if p.is_dir() and p.name != "__pycache__"}
    files = {p.name for p in PACKAGE.glob("*.py")}
    assert folders == set(LAYERS), (
        f"folders that are not a layer of DESIGN.md (or layers missing): {folders ^ set(LAYERS)}"
    )
    assert files == {"__init__.py", "errors.py"}, f"modules outside every layer: {files - {'__init__.py', 'errors.py'}}"


def test_each_folder_imports_only_the_folders_below_it():
    checked = 0
    for rank, layer in enumerate(LAYERS):
        allowed = set(LAYERS[: rank + 1])
        for path in (PACKAGE / layer).rglob("*.py"):
            checked += 1
            where = path.relative_to(PACKAGE.parent)
            for name in _imports(path):
                if name.split(".")[0] == "torchrl":
                    assert layer == "adapters", f"{where} imports {name}: torchrl belongs to the adapters alone"
                if name.split(".")[0] != "gear_torchrl" or name == SHARED:
                    continue
                assert _layer(name) in allowed, f"{where} ({layer}) imports {name}, above its layer"
    assert checked > 70, f"the walk found only {checked} modules"


def test_the_extensions_kernels_include_nothing_of_its_network_part():
    """csrc/ in two parts: the kernels (csrc/kernels/) know tensors only; the network owner and receiver
    (csrc/net/) may use them. Each part binds itself (its bindings.cpp); csrc/module.cpp binds both."""
    csrc = PACKAGE.parent / "csrc"
    kernels = [f for f in (csrc / "kernels").rglob("*") if f.suffix in {".h", ".cpp", ".cu", ".cuh"}]
    assert len(kernels) > 15
    for path in kernels:
        for line in path.read_text().splitlines():
            if line.startswith("#include"):
                assert "net/" not in line, f"{path.relative_to(csrc)} includes {line.split()[1]}, of the network part"
    assert {p.name for p in csrc.iterdir()} == {"kernels", "net", "module.cpp"}


def test_errors_and_the_face_import_no_layer_at_run_time():
    assert not {n for n in _imports(PACKAGE / "errors.py") if n.startswith("gear_torchrl")}
    face = _imports(PACKAGE / "__init__.py", top_level_only=True)
    assert not {n for n in face if n.startswith("gear_torchrl")}, "the face loads its names lazily"


# No cycle at all, type-only imports included: a shard's visibility part knows it as its ring (store/ring.py), which
# the shard is built on, not as the shard (issue 49). A new cycle fails here.
KNOWN_CYCLES: list[set[str]] = []


def test_no_import_cycle_between_modules():
    """Every module's imports at its top level, those only a type checker follows included, followed to the end:
    no module reaches itself but those of ``KNOWN_CYCLES``."""
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        graph[_module_name(path)] = {
            _module_name(f)
            for n in _imports(path, top_level_only=True, type_checking=True)
            if (f := _module_file(n)) is not None
        } - {_module_name(path)}
    assert len(graph) > 80
    assert _cycles(graph) == KNOWN_CYCLES


def _cycles(graph: dict[str, set[str]]) -> list[set[str]]:
    """The groups of modules that reach each other (strongly connected components of more than one)."""
    reaches = {name: _reached(graph, name) for name in graph}
    groups: list[set[str]] = []
    for name in sorted(graph):
        group = {other for other in reaches[name] if name in reaches[other]} | {name}
        if len(group) > 1 and group not in groups:
            groups.append(group)
    return groups


def _reached(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = list(graph[start])
    while todo:
        name = todo.pop()
        if name not in seen:
            seen.add(name)
            todo.extend(graph.get(name, ()))
    return seen


def test_importing_every_layer_below_the_adapters_loads_no_torchrl():
    modules = sorted(
        _module_name(p) for layer in LAYERS[:-1] for p in (PACKAGE / layer).rglob("*.py") if p.name != "rdma.py"
    )  # rdma needs pyverbs, and imports nothing of ours above it
    code = (
        "import importlib, sys\n"
        f"for m in {modules!r}: importlib.import_module(m)\n"
        "bad = sorted(m for m in sys.modules\n"
        "             if m.split('.')[0] == 'torchrl' or m.startswith('gear_torchrl.adapters'))\n"
        "print(bad)\nsys.exit(1 if bad else 0)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert len(modules) > 50


def test_every_public_name_is_importable_from_the_face():
    import gear_torchrl
    import gear_torchrl.errors as errors

    for name in gear_torchrl.__all__:
        assert getattr(gear_torchrl, name) is not None
    for name in errors.__all__:
        assert getattr(gear_torchrl, name) is getattr(errors, name), f"{name} is not the one in errors.py"


def test_tutorials_and_the_quick_start_use_public_names_only():
    root = PACKAGE.parent
    scripts = sorted((root / "tutorials").glob("*.py")) + [root / "quickstart.py"]
    assert len(scripts) > 5
    for script in scripts:
        inner = {n for n in _imports(script) if n.startswith("gear_torchrl.")}
        assert not inner, f"{script.name} imports {sorted(inner)}: tutorials use names from `gear_torchrl` alone"
