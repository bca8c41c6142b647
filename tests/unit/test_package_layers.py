"""Issue 26: the package's folders are its layers, ``numerics <- ops <- tensor <- linear <- nn <- config <-
checkpoint <- integration <- cli``, and the imports follow them.

- import-linter's contracts in ``setup.cfg`` (layers, no cycle among the modules of any package, DeepSpeed only
  above the nn layer) hold;
- the whole import graph (grimp, the graph import-linter builds: module-level and function-level imports) has no
  cycle at all;
- no module imports a private name (``_x``) of another module.
"""

import ast
import importlib
import os
import pathlib
import re
import shutil
import subprocess
import sys

import grimp
import pytest

import ds_fpquant

PACKAGE = pathlib.Path(ds_fpquant.__file__).parent
REPO = PACKAGE.parent
LAYERS = ("numerics", "ops", "tensor", "linear", "nn", "config", "checkpoint", "integration", "cli")


def _graph():
    """The package's import graph without the root package: ``ds_fpquant.op_builder`` is the top-level
    ``op_builder/`` folder (setup.py maps it in), outside the graph, so grimp records its imports as imports of
    ``ds_fpquant``; no module imports the root package itself (checked below)."""
    return grimp.build_graph("ds_fpquant", include_external_packages=False, cache_dir=None)


ROOT = "ds_fpquant"


def _cycles(graph):
    """The strongly connected components of more than one module (Tarjan), each sorted."""
    index, low, stack, on_stack, found = {}, {}, [], set(), []
    counter = [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on_stack.add(v)
        for w in graph.find_modules_directly_imported_by(v) - {ROOT}:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(graph.modules - {ROOT}):
        if module not in index:
            visit(module)
    return found


def test_the_import_contracts_hold():
    if not (REPO / "setup.cfg").is_file():
        pytest.skip("an installed copy without setup.cfg: the contracts are checked from the source tree")
    lint = shutil.which("lint-imports", path=os.path.dirname(sys.executable)) or shutil.which("lint-imports")
    assert lint, "import-linter is a test dependency (setup.cfg [test])"
    proc = subprocess.run([lint, "--no-cache", str(REPO / "setup.cfg")], cwd=REPO, capture_output=True,
                          text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "0 broken" in proc.stdout and "kept" in proc.stdout, proc.stdout


def test_the_import_graph_has_no_cycle():
    graph = _graph()
    assert len(graph.modules) > 30  # the graph really holds the package
    assert _cycles(graph) == []


def test_the_cycle_finder_finds_a_function_level_cycle():
    """The check above can fail: an import inside a function that closes a loop is a cycle."""
    graph = _graph()
    graph.add_import(importer="ds_fpquant.numerics.formats", imported="ds_fpquant.tensor.quantize")
    assert any({"ds_fpquant.numerics.formats", "ds_fpquant.tensor.quantize"} <= set(c) for c in _cycles(graph))


def test_every_module_is_in_a_layer():
    top = {p.stem if p.is_file() else p.name for p in PACKAGE.iterdir()
           if (p.suffix == ".py" or (p / "__init__.py").is_file()) and p.name != "__pycache__"}
    assert top - set(LAYERS) == {"__init__", "__main__", "version"}


def _private_imports():
    for path in sorted(PACKAGE.rglob("*.py")):
        tree = ast.parse(path.read_text(), str(path))
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.level or (node.module or "").startswith("ds_fpquant")):
                for alias in node.names:
                    if alias.name.startswith("_") and not alias.name.startswith("__"):
                        yield f"{path.relative_to(REPO)}:{node.lineno}: {node.module}.{alias.name}"


def test_no_module_imports_a_private_name_of_another():
    assert list(_private_imports()) == []


def test_no_module_imports_the_root_package():
    """The root package is the public facade; the layers import each other's modules, never it."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names if a.name == "ds_fpquant"]
            elif isinstance(node, ast.ImportFrom) and node.module == "ds_fpquant" and not node.level:
                names = [a.name for a in node.names if not (PACKAGE / a.name).is_dir() and a.name != "op_builder"]
            found += [f"{path.relative_to(REPO)}:{node.lineno}: {n}" for n in names]
    assert found == []


def _resolves(name: str) -> bool:
    parts = name.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        try:
            for part in parts[i:]:
                obj = getattr(obj, part)
        except AttributeError:
            return False
        return True
    return False


def test_docstring_references_name_modules_that_exist():
    """``:mod:`` / ``:func:`` / ``:class:`` / ``:data:`` references to ``ds_fpquant.*`` in the package name real
    objects (a moved module leaves no stale path behind)."""
    refs = set()
    for path in sorted(PACKAGE.rglob("*.py")):
        refs |= {m.group(1) for m in re.finditer(r":(?:mod|func|class|data|meth):`~?(ds_fpquant\.[\w.]+)`", path.read_text())}
    assert len(refs) > 10
    assert sorted(r for r in refs if not _resolves(r)) == []
