"""``import rlep_megatron`` (and every module in it) must not pull optional heavy packages."""
import subprocess
import sys

import pytest

pytestmark = pytest.mark.unit

PROBE = """
import importlib, pkgutil, sys, time
start = time.time()
import rlep_megatron
package_seconds = time.time() - start
for info in pkgutil.walk_packages(rlep_megatron.__path__, "rlep_megatron."):
    importlib.import_module(info.name)
heavy = [m for m in ("vllm", "transformer_engine", "ray", "megatron") if m in sys.modules]
print(repr((heavy, package_seconds)))
"""


def test_package_import_is_light():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True,
                         check=True).stdout.strip().splitlines()[-1]
    heavy, package_seconds = eval(out)
    assert heavy == [], f"imported at import time: {heavy}"
    # the package alone: a few hundredths of a second; importing megatron-core or vLLM by
    # mistake takes several seconds (margin for a machine under twice its load)
    assert package_seconds < 2.5, package_seconds


PURE_PACKAGES = ("algo", "reward", "replay", "data")


def test_pure_packages_do_not_touch_distributed_state():
    """algo/, reward/, replay/, data/ are pure (no process groups in pure logic): no
    torch.distributed, no Megatron."""
    import os
    import re

    import rlep_megatron

    root = os.path.dirname(rlep_megatron.__file__)
    for package in PURE_PACKAGES:
        for name in os.listdir(os.path.join(root, package)):
            if name.endswith(".py"):
                source = open(os.path.join(root, package, name)).read()
                uses = re.findall(r"torch\.distributed\.\w|import torch\.distributed|"
                                  r"from torch\.distributed|import megatron|from megatron\b",
                                  source)
                assert not uses, f"{package}/{name}: {uses}"


def test_no_import_cycle_between_subpackages():
    """Every import inside the package (module level or in a function) seen as an edge between
    its subpackages (``models``, ``checkpoint``, ``actor``, ...); the graph has no cycle, so
    each layer builds only on the ones below it."""
    import ast
    import os

    import rlep_megatron

    root = os.path.dirname(rlep_megatron.__file__)
    edges: dict[str, set[str]] = {}
    for directory, _, files in os.walk(root):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = os.path.join(directory, name)
            rel = os.path.relpath(path, root).split(os.sep)
            source = rel[0] if len(rel) > 1 else rel[0][:-3]
            for node in ast.walk(ast.parse(open(path).read())):
                if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith(
                        "rlep_megatron"):
                    parts = node.module.split(".")
                    targets = [parts[1]] if len(parts) > 1 else [a.name for a in node.names]
                    for target in targets:
                        if target != source:
                            edges.setdefault(source, set()).add(target)

    def cycle_from(start, node, path):
        for nxt in sorted(edges.get(node, ())):
            if nxt == start:
                return path + [nxt]
            if nxt not in path:
                found = cycle_from(start, nxt, path + [nxt])
                if found:
                    return found
        return None

    for start in sorted(edges):
        assert cycle_from(start, start, [start]) is None, cycle_from(start, start, [start])


def module_imports() -> dict[str, set[str]]:
    """Every module of the package -> the modules of the package it imports, at module level
    or inside a function (``from P import name`` counts as an import of the module ``P.name``
    when there is one, else of ``P``), and the packages Python runs first to import them
    (``import a.b.c`` runs ``a.b``'s ``__init__``), except the importing module's own parent
    packages, which have run already."""
    import ast
    import os

    import rlep_megatron

    root = os.path.dirname(os.path.dirname(rlep_megatron.__file__))
    modules = {}
    for directory, _, files in os.walk(os.path.join(root, "rlep_megatron")):
        for name in files:
            if name.endswith(".py"):
                parts = os.path.relpath(os.path.join(directory, name), root)[:-3].split(os.sep)
                modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = \
                    os.path.join(directory, name)
    graph: dict[str, set[str]] = {}
    for module, path in modules.items():
        targets = graph.setdefault(module, set())
        for node in ast.walk(ast.parse(open(path).read())):
            if isinstance(node, ast.Import):
                targets.update(a.name for a in node.names if a.name in modules)
            elif isinstance(node, ast.ImportFrom):
                assert node.level == 0, f"{module}: relative import"
                if node.module in modules:
                    targets.update(f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in
                                   modules else node.module for a in node.names)
        own_parents = {module.rsplit(".", i)[0] for i in range(1, module.count(".") + 1)}
        for target in list(targets):
            for i in range(1, target.count(".")):
                parent = target.rsplit(".", i)[0]
                if parent not in own_parents:
                    targets.add(parent)
        targets.discard(module)
    return graph


def test_no_module_imports_one_that_imports_it_back():
    """No cycle among the package's modules, however indirect (the subpackage test above
    allows cycles inside one subpackage; this one does not)."""
    graph = module_imports()
    assert "rlep_megatron.checkpoint.dist" in graph["rlep_megatron.checkpoint.resume"]
    state: dict[str, str] = {}

    def visit(module, path):
        state[module] = "open"
        for target in sorted(graph[module]):
            if state.get(target) == "open":
                raise AssertionError("import cycle: " + " -> ".join(
                    path[path.index(target):] + [target]))
            if target not in state:
                visit(target, path + [target])
        state[module] = "done"

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])


def test_the_cli_module_imports_no_torch():
    """``spawn`` children (the reward scorer's worker processes, up to 16 per rank in the GPU
    recipes) import the parent's main module again: ``rlep_megatron.cli`` must not pull torch
    (about 2 s of CPU and a few hundred MB per process)."""
    probe = ("import sys, rlep_megatron.cli; "
             "print([m for m in ('torch', 'numpy', 'megatron', 'vllm') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         check=True).stdout.strip().splitlines()[-1]
    assert out == "[]", out


def package_trees(root: str):
    """``(path relative to root, parsed module)`` of every Python file under ``root``."""
    import ast
    import os

    for directory, _, files in os.walk(root):
        for name in sorted(files):
            if name.endswith(".py"):
                path = os.path.join(directory, name)
                yield os.path.relpath(path, root), ast.parse(open(path).read())


def underscored_uses(root: str) -> list[str]:
    """Every place in the package under ``root`` that reaches into another of its modules'
    underscored names: ``from rlep_megatron.m import _x``, or ``m._x`` with ``m`` a module of
    the package imported by name."""
    import ast
    import os

    def is_module(dotted: str) -> bool:
        path = os.path.join(os.path.dirname(root), *dotted.split("."))
        return os.path.isdir(path) or os.path.isfile(path + ".py")

    found = []
    for rel, tree in package_trees(root):
        modules = set()  # local names bound to the package's modules
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
                    "rlep_megatron"):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        found.append(f"{rel}:{node.lineno} "
                                     f"imports {node.module}.{alias.name}")
                    elif is_module(f"{node.module}.{alias.name}"):
                        modules.add(alias.asname or alias.name)
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    if alias.name.startswith("rlep_megatron.") and alias.asname:
                        modules.add(alias.asname)
        for node in ast.walk(tree):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name)
                    and node.value.id in modules and node.attr.startswith("_")
                    and not node.attr.startswith("__")):
                found.append(f"{rel}:{node.lineno} "
                             f"{node.value.id}.{node.attr}")
    return found


def test_no_module_reaches_into_another_modules_private_names(tmp_path):
    """What a module offers the others has a public name; its underscored names are its own
    (the shims' patches of megatron-core, vLLM and torch internals are not checked here).
    The check finds both forms in a package made to have them."""
    import os

    import rlep_megatron

    assert underscored_uses(os.path.dirname(rlep_megatron.__file__)) == []
    package = tmp_path / "rlep_megatron"
    (package / "sub").mkdir(parents=True)
    (package / "sub" / "a.py").write_text("_X = 1\n")
    (package / "b.py").write_text("from rlep_megatron.sub import a\n"
                                  "from rlep_megatron.sub.a import _X\n"
                                  "print(a._X, _X)\n")
    assert len(underscored_uses(str(package))) == 2
