"""The package import graph: no cycle between packages, the engines and the scheduler never import an
exporter, and every type on the stats bus comes from the one stats package.

Granularity of "package" (a node of the graph), for every ``import`` and ``from ... import`` in
every module under ``kvmeter/`` (module level and inside functions alike, ``TYPE_CHECKING`` blocks
included — a dependency is a dependency):

* each top-level folder is one node with its subpackages folded in: ``kvmeter.collectors``,
  ``kvmeter.exporters``, ``kvmeter.ledger``, ``kvmeter.dashboards``, ``kvmeter.stats``;
* ``kvmeter.serving`` is a folder of parts, so each of its subpackages is one node, its own
  subpackages folded in: ``kvmeter.serving.engines``, ``kvmeter.serving.scheduler``,
  ``kvmeter.serving.gateway``, ``kvmeter.serving.quota``, ``kvmeter.serving.tenancy``,
  ``kvmeter.serving.simulator``, ``kvmeter.serving.replay``, ...; the modules directly in
  ``serving/`` (the composition root: ``runtime``, ``config``, ``serve_cmd``, ``demo``) are the node
  ``kvmeter.serving``;
* each module directly in ``kvmeter/`` is its own node (``kvmeter.bus``, ``kvmeter.clock``,
  ``kvmeter.cli``...).

An edge A → B means a module of A imports a module of B. Importing a package's ``__init__`` counts
as importing that package.
"""

from __future__ import annotations

import ast
import itertools
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ROOT = REPO / "kvmeter"


def _modules() -> dict[str, tuple[Path, bool]]:
    """Dotted module name → (file, is a package ``__init__``), following the folder links."""
    mods: dict[str, tuple[Path, bool]] = {}
    for folder, _, files in os.walk(ROOT, followlinks=True):
        for name in files:
            if not name.endswith(".py"):
                continue
            path = Path(folder) / name
            parts = list(path.relative_to(REPO).with_suffix("").parts)
            is_pkg = parts[-1] == "__init__"
            if is_pkg:
                parts = parts[:-1]
            mods[".".join(parts)] = (path, is_pkg)
    return mods


MODULES = _modules()
PACKAGES = {name for name, (_, is_pkg) in MODULES.items() if is_pkg}


def node(module: str) -> str:
    """The graph node (package) ``module`` belongs to (see the module docstring)."""
    parts = module.split(".")
    if len(parts) >= 3 and parts[1] == "serving" and ".".join(parts[:3]) in PACKAGES:
        return ".".join(parts[:3])
    if len(parts) >= 2 and ".".join(parts[:2]) in PACKAGES and parts[1] != "serving":
        return ".".join(parts[:2])
    if parts[:2] == ["kvmeter", "serving"]:
        return "kvmeter.serving"
    return module


def _resolve(name: str) -> str | None:
    """The longest prefix of ``name`` that is a kvmeter module (``from m import Class`` → m)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def imports(module: str) -> list[tuple[str, int]]:
    """``(imported kvmeter module, line)`` for every import statement of ``module``."""
    path, is_pkg = MODULES[module]
    package = module if is_pkg else module.rpartition(".")[0]
    found = []
    for n in ast.walk(ast.parse(path.read_text(), str(path))):
        targets: list[str] = []
        if isinstance(n, ast.Import):
            targets = [a.name for a in n.names]
        elif isinstance(n, ast.ImportFrom):
            if n.level:
                base = package.split(".")[:len(package.split(".")) - (n.level - 1)]
                stem = ".".join(base + ([n.module] if n.module else []))
            else:
                stem = n.module or ""
            targets = [f"{stem}.{a.name}" for a in n.names] + [stem]
        for t in targets:
            resolved = _resolve(t) if t.startswith("kvmeter") else None
            if resolved is not None:
                found.append((resolved, n.lineno))
    return found


def package_graph() -> dict[str, dict[str, list[str]]]:
    """node → imported node → ``["module:line imports module", ...]`` (the evidence of each edge)."""
    graph: dict[str, dict[str, list[str]]] = defaultdict(lambda: defaultdict(list))
    for module in MODULES:
        a = node(module)
        for target, line in imports(module):
            b = node(target)
            if a != b:
                graph[a][b].append(f"{module}:{line} imports {target}")
    return graph


def _cycle(graph: dict[str, dict[str, list[str]]]) -> list[str] | None:
    """One cycle of the graph as a node path (first == last), or None."""
    state: dict[str, int] = {}  # 1 on the stack, 2 done
    stack: list[str] = []

    def visit(v: str) -> list[str] | None:
        state[v] = 1
        stack.append(v)
        for w in sorted(graph.get(v, {})):
            if state.get(w) == 1:
                return stack[stack.index(w):] + [w]
            if w not in state:
                found = visit(w)
                if found:
                    return found
        stack.pop()
        state[v] = 2
        return None

    for v in sorted(graph):
        if v not in state:
            found = visit(v)
            if found:
                return found
    return None


def test_the_graph_sees_every_package():
    nodes = {node(m) for m in MODULES}
    for expected in ("kvmeter.serving.engines", "kvmeter.serving.scheduler", "kvmeter.serving.gateway",
                     "kvmeter.serving.simulator", "kvmeter.ledger", "kvmeter.exporters", "kvmeter.collectors",
                     "kvmeter.dashboards", "kvmeter.stats", "kvmeter.serving", "kvmeter.bus"):
        assert expected in nodes, expected
    graph = package_graph()
    # the composition root knows every part: the graph has the edges it must have
    assert {"kvmeter.serving.engines", "kvmeter.serving.scheduler", "kvmeter.exporters",
            "kvmeter.ledger"} <= set(graph["kvmeter.serving"])


def test_no_import_cycle_between_packages():
    graph = package_graph()
    cycle = _cycle(graph)
    if cycle:
        evidence = [f"  {a} → {b}: {graph[a][b][0]}" for a, b in itertools.pairwise(cycle)]
        pytest.fail("import cycle " + " → ".join(cycle) + "\n" + "\n".join(evidence))


def test_the_cycle_check_finds_a_cycle():
    """The check is not vacuous: a graph with a back edge is reported."""
    graph = {"a": {"b": ["a.x imports b.y"]}, "b": {"c": ["..."]}, "c": {"a": ["..."]}, "d": {"a": ["..."]}}
    assert _cycle(graph) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b": ["..."]}, "b": {}}) is None


@pytest.mark.parametrize("package", ["kvmeter.serving.engines", "kvmeter.serving.scheduler",
                                     "kvmeter.serving.simulator"])
def test_engines_and_scheduler_never_import_an_exporter(package):
    offending = [f"{m}:{line} imports {t}" for m in MODULES if node(m) == package
                 for t, line in imports(m) if node(t) == "kvmeter.exporters"]
    assert not offending, offending


#: The value types the stats carry besides their own: leaf modules of kvmeter's core.
STATS_VALUE_TYPES = ("kvmeter.attribution", "kvmeter.tokens")


def test_the_stats_package_imports_nothing_of_kvmeter_but_itself_and_its_value_types():
    """Plain dataclasses: nothing in kvmeter.stats imports a producer or an exporter — only the
    stats package itself and the value types it carries (the attribution and the token counts),
    which import nothing of kvmeter at all."""
    for m in MODULES:
        if node(m) == "kvmeter.stats":
            assert all(node(t) == "kvmeter.stats" or t in STATS_VALUE_TYPES for t, _ in imports(m)), m
    for m in STATS_VALUE_TYPES:
        assert imports(m) == [], m


def _bus_types() -> list[tuple[str, int, str, str | None]]:
    """``(module, line, type name, module it is imported from)`` for every class handed to
    ``subscribe(Type, ...)`` or published as ``publish(Type(...))`` (``_publish`` included)."""
    out = []
    for module, (path, _) in MODULES.items():
        tree = ast.parse(path.read_text(), str(path))
        origin: dict[str, str] = {}
        for n in ast.walk(tree):
            if isinstance(n, ast.ImportFrom) and n.module and not n.level:
                for a in n.names:
                    origin[a.asname or a.name] = n.module
        for n in ast.walk(tree):
            if not (isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.args):
                continue
            arg = n.args[0]
            if n.func.attr == "subscribe" and isinstance(arg, ast.Name):
                name = arg.id
            elif n.func.attr in ("publish", "_publish") and isinstance(arg, ast.Call) \
                    and isinstance(arg.func, ast.Name) and arg.func.id[:1].isupper():
                name = arg.func.id
            else:
                continue
            out.append((module, n.lineno, name, origin.get(name)))
    return out


def test_every_type_on_the_bus_comes_from_kvmeter_stats():
    import kvmeter.stats

    found = _bus_types()
    assert len(found) > 30  # the engines, gateway, quota, tenancy, scheduler, ledger, GPU, exporters
    for module, line, name, origin in found:
        if module.startswith("kvmeter.stats"):
            continue
        assert origin is not None and origin.startswith("kvmeter.stats"), \
            f"{module}:{line}: {name} on the bus is not imported from kvmeter.stats"
        assert name in kvmeter.stats.__all__, f"{module}:{line}: {name} is not in kvmeter.stats.__all__"


@pytest.mark.slow
def test_every_module_imports():
    """Import every kvmeter module in a fresh interpreter (the Streamlit scripts ``dashboards/app.py``
    and ``dashboards/page_scripts/*`` excepted: they draw a page when run)."""
    code = ("import importlib, sys\n"
            "failed = []\n"
            "for name in sys.argv[1:]:\n"
            "    try:\n"
            "        importlib.import_module(name)\n"
            "    except Exception as exc:\n"
            "        failed.append(f'{name}: {exc!r}')\n"
            "print('\\n'.join(failed))\n"
            "sys.exit(1 if failed else 0)\n")
    names = sorted(m for m in MODULES
                   if m != "kvmeter.dashboards.app" and not m.startswith("kvmeter.dashboards.page_scripts"))
    proc = subprocess.run([sys.executable, "-c", code, *names], capture_output=True, text=True, timeout=600,
                          env={**os.environ,
                               "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))})
    assert proc.returncode == 0, proc.stdout + proc.stderr[-2000:]
