"""The package import graph, built from the modules' own import statements, has no cycle.

Every ``import`` counts, those inside functions too: a lazy import only hides a circle from
the interpreter, not from a reader who has to know which module depends on which. The layers
point one way as well: compression/ is pure tensor math, protocol/ knows bytes and schemas,
node/ stands on both, and bench/ drives node/ from outside (node/ never imports bench/).
"""

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("node", "protocol", "compression", "bench")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def import_graph() -> dict[str, set[str]]:
    """module -> the project's modules it imports (``from pkg import mod`` resolves to pkg.mod)."""
    files = {_module_name(p): p for pkg in PACKAGES for p in (ROOT / pkg).rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for name, path in files.items():
        deps: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" for a in node.names] + [node.module]
            else:
                continue
            for t in targets:
                # the longest prefix that is one of our modules: a.b.c -> a.b when c is a name in a.b
                while t and t not in files:
                    t = t.rpartition(".")[0]
                if t and t != name and t not in PACKAGES:
                    deps.add(t)
        graph[name] = deps
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components with more than one module (Tarjan), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_cycle_finder_finds_a_planted_cycle():
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert cycles(graph) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_the_graph_sees_imports_inside_functions():
    graph = import_graph()
    assert "node.join" in graph["node.cli"]  # cli.main imports it lazily
    assert "node.runtime" in graph["node.join"]


def test_no_import_cycle():
    found = cycles(import_graph())
    assert not found, "import cycles: " + "; ".join(" <-> ".join(c) for c in found)


# The layers: node -> protocol -> compression, and bench drives node from outside. Each package may
# not import the packages named here, whatever the module (one that does not exist yet included).
MAY_NOT_IMPORT = {
    "compression": {"protocol", "node", "bench"},
    "protocol": {"node", "bench"},
    "node": {"bench"},
}


def imported_names(source: str, module: str) -> list[tuple[int, str]]:
    """(line, absolute dotted name) of every import in ``source``, those inside functions too.

    Relative imports are resolved against ``module``; ``importlib.import_module("x")`` and
    ``__import__("x")`` with a literal name count as well. Nothing is executed."""
    is_pkg = module.endswith(".__init__")
    package = module.removesuffix(".__init__").split(".")
    if not is_pkg:
        package = package[:-1]
    out = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[: len(package) - (node.level - 1)] if node.level > 1 else package
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            out.append((node.lineno, name))
        elif (
            isinstance(node, ast.Call)
            and node.args
            and isinstance(node.args[0], ast.Constant)
            and isinstance(node.args[0].value, str)
            and (
                (isinstance(node.func, ast.Name) and node.func.id in ("__import__", "import_module"))
                or (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
            )
        ):
            out.append((node.lineno, node.args[0].value))
    return out


def layer_violations(sources: dict[str, str]) -> list[str]:
    """``path:line: a -> b`` for every import against MAY_NOT_IMPORT; ``sources``: repo path -> text."""
    bad = []
    for path, text in sorted(sources.items()):
        top = path.split("/")[0]
        module = path.removesuffix(".py").replace("/", ".")
        for line, name in imported_names(text, module):
            if name.split(".")[0] in MAY_NOT_IMPORT.get(top, ()):
                bad.append(f"{path}:{line}: {top} -> {name}")
    return bad


def layer_sources() -> dict[str, str]:
    return {
        str(p.relative_to(ROOT)): p.read_text()
        for pkg in MAY_NOT_IMPORT
        for p in sorted((ROOT / pkg).rglob("*.py"))
    }


def test_a_planted_layer_import_is_found():
    sources = layer_sources()
    planted = {
        "node/model/loading.py": "def f():\n    from bench.emulated import load_emulated\n",
        "node/x.py": "import bench\n",
        "node/y.py": "from bench import harness\n",
        "node/z.py": "import importlib\nimportlib.import_module('bench.harness')\n",
        "protocol/frames.py": "from node.stage import compute\n",
        "protocol/w.py": "import bench.harness\n",
        "compression/codec.py": "import protocol.frames\n",
        "compression/v.py": "from node.model import loading\n",
        "compression/u.py": "from bench import nat\n",
    }
    found = layer_violations({**sources, **planted})
    assert found == [
        "compression/codec.py:1: compression -> protocol.frames",
        "compression/u.py:1: compression -> bench",
        "compression/v.py:1: compression -> node.model",
        "node/model/loading.py:2: node -> bench.emulated",
        "node/x.py:1: node -> bench",
        "node/y.py:1: node -> bench",
        "node/z.py:2: node -> bench.harness",
        "protocol/frames.py:1: protocol -> node.stage",
        "protocol/w.py:1: protocol -> bench.harness",
    ], found
    # what the layers allow: node -> protocol -> compression, relative imports within a package
    allowed = {
        "node/a.py": "import protocol.frames\nfrom compression import codec\n",
        "protocol/b.py": "from compression.codec import LinkCodec\nfrom . import frames\n",
        "compression/c/d.py": "from .. import codec\n",
    }
    assert layer_violations(allowed) == []


def test_layers_point_one_way():
    """compression/ imports no protocol, node or bench; protocol/ no node or bench; node/ no bench."""
    found = layer_violations(layer_sources())
    assert not found, "imports against the layers: " + "; ".join(found)


# The rooms of node/ and which rooms each may import (docs/ARCHITECTURE.md draws the same picture).
# Bottom up: net (libp2p streams, hivemind's process loops) knows no other room; model (weights,
# data, evaluation) neither; swarm (membership, routing, weights over the swarm, export) stands on
# both; stage (the walk of one microbatch) on those three; dp (what replicas do with a step's
# gradients) runs on a stage's context and gate. The composition (join, runtime, lifecycle) and the
# entry points (cli, argv) sit on top; local (the one-machine launcher) uses argv to build its nodes'
# command lines. config and stop_signal are leaves every room may use.
LEAVES = {"node.config", "node.stop_signal", "node"}
MAY_USE = {
    "net": set(),
    "model": set(),
    "swarm": {"net", "model"},
    "stage": {"net", "model", "swarm"},
    "dp": {"net", "model", "swarm", "stage"},
    "local": {"net", "model", "swarm", "stage", "argv"},
    # the dashboard reads what the others publish; only the top level (a node's --dashboard, the CLI) uses it
    "watch": {"net", "model", "swarm", "stage"},
}


def room(module: str) -> str | None:
    """node.<room>.x -> <room>; node.x (top level) -> x; anything outside node/ -> None."""
    parts = module.split(".")
    if parts[0] != "node" or len(parts) == 1:
        return None
    return parts[1]


def reverse_imports(graph: dict[str, set[str]]) -> list[str]:
    """Every import from one room of node/ into a room it may not use."""
    bad = []
    for mod, deps in graph.items():
        src = room(mod)
        if src not in MAY_USE:
            continue  # the top level (entry points, composition) may use every room
        for d in sorted(deps):
            dst = room(d)
            if d in LEAVES or dst is None or dst == src:
                continue
            if dst not in MAY_USE[src]:
                bad.append(f"{mod} -> {d}")
    return bad


def test_rooms_are_the_packages_on_disk():
    rooms = {p.name for p in (ROOT / "node").iterdir() if (p / "__init__.py").exists()}
    assert rooms == set(MAY_USE), rooms


def test_a_planted_reverse_import_is_found():
    graph = import_graph()
    assert reverse_imports(graph) == []
    planted = {**graph, "node.model.loading": graph["node.model.loading"] | {"node.stage.context"}}
    assert reverse_imports(planted) == ["node.model.loading -> node.stage.context"]
    planted = {**graph, "node.stage.step": graph["node.stage.step"] | {"node.dp.tied"}}
    assert reverse_imports(planted) == ["node.stage.step -> node.dp.tied"]
    planted = {**graph, "node.net.rpc": graph["node.net.rpc"] | {"node.lifecycle"}}
    assert reverse_imports(planted) == ["node.net.rpc -> node.lifecycle"]


def test_rooms_point_one_way():
    found = reverse_imports(import_graph())
    assert not found, "imports against the rooms' direction: " + "; ".join(found)


def test_compression_imports_no_model_library():
    """compression/ is tensor math: the model surgery that needs transformers lives in node/."""
    for path in sorted((ROOT / "compression").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            names = (
                [a.name for a in node.names]
                if isinstance(node, ast.Import)
                else [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else []
            )
            bad = [n for n in names if n.split(".")[0] in ("transformers", "hivemind", "node")]
            assert not bad, f"{path.relative_to(ROOT)} imports {bad}"
