"""Imports run one way, no module reaches into another's private names, and nothing imports in a circle.

Every module under ``src/stabletrain`` is parsed with ``ast`` (nothing is imported). Every
import counts: at module level, inside functions, and under ``if TYPE_CHECKING:``. A module
may import modules of its own rank or a lower one, never a higher one:

====  ============================================================  ==================================================
rank  modules                                                       why there
====  ============================================================  ==================================================
0     ``stabletrain`` (the package root)                            ``__version__`` and the lazy public names; it
                                                                    imports nothing, so anyone may import it
1     ``errors``                                                    the exceptions every layer raises
2     ``utils.*``, ``distributed.*``                                text, tree, dist, imports, io, rng, sync; FSDP2
                                                                    norms and shards: no knowledge of training
3     ``config``                                                    the settings
4     ``runfiles.*``, ``data.*``                                    a run's folder (checkpoints, metrics history,
                                                                    commands) and datasets: read by every job
5     ``tasks.*``, ``loggers.*``                                    models and metric sinks, built from settings
6     ``events``                                                    the callback protocol
7     ``debug`` (package), ``debug.grad_norm``, ``debug.op_trace``,  explain: the tools' building blocks
      ``debug.advice``, ``debug.optimizer_damage``
8     ``debug.nan_capture``, ``debug.underflow_overflow``,           explain: the tools (format, monitor, callback)
      ``debug.trends``, ``debug.mechanisms``,
      ``debug.remedies``
9     ``debug.replay``, ``debug.optimizer_step``                    explain: reads captures, reruns steps
10    ``debug.diagnose``                                            explain: replays, searches, explains
11    ``safety.*``                                                  protect: the guard, checkpoint health,
                                                                    interrupts, self-healing, stop messages; they
                                                                    call the explaining tools, never the loop
12    ``training.*``                                                train: the loop, its setup, state and checks
13    ``reporting``, ``integrations.*``                             wire the three into a run's report or another
                                                                    framework's loop
14    ``cli.*``                                                     argparse only here; nothing imports it
15    ``__main__``                                                  ``python -m stabletrain``
====  ============================================================  ==================================================

So the jobs run ``debug`` (explain) -> ``safety`` (protect) -> ``training`` (train), with a run's files
(``runfiles``) and ``errors`` below all three and ``reporting``/``integrations``/``cli`` above them.
Modules of one rank may import each other, as long as no circle forms. A package split into
submodules keeps its rank (the table matches the longest dotted prefix). Only the modules named
in :data:`ROOT_MODULES` may sit at the package root.

The rules:

* (a) **direction**: no import of a module of higher rank; a module missing from the table fails too;
* (b) **privacy**: no ``from stabletrain.x import _name``, no ``import stabletrain.x._name``, and no
  ``module._name`` attribute read through an imported stabletrain module: a name another module
  needs is made public where it belongs;
* (c) **no circle** among the imports, function-level and ``TYPE_CHECKING`` ones included.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator, Optional

import pytest

SRC = Path(__file__).resolve().parents[1] / "src"
ROOT = "stabletrain"

#: Dotted prefix (without "stabletrain.") -> rank; see the module docstring.
RANKS: dict[str, int] = {
    "": 0,
    "errors": 1,
    "utils": 2,
    "distributed": 2,  # sharding helpers (FSDP2 norms, shards): torch and errors only, like utils
    "config": 3,
    "runfiles": 4,  # a run's folder: checkpoints, metrics history, pasteable commands
    "data": 4,
    "tasks": 5,
    "loggers": 5,
    "events": 6,
    # explain
    "debug": 7,
    "debug.grad_norm": 7,
    "debug.op_trace": 7,
    "debug.advice": 7,
    "debug.optimizer_damage": 7,  # why an optimizer step made values non-finite
    "debug.nan_capture": 8,
    "debug.underflow_overflow": 8,
    "debug.trends": 8,
    "debug.mechanisms": 8,  # the mechanism signals (monitor, callback)
    "debug.remedies": 8,  # candidate remedies planned, measured and ranked; the runner is reporting's
    "debug.replay": 9,
    "debug.optimizer_step": 9,  # replays a captured optimizer step (diagnose calls it)
    "debug.diagnose": 10,
    # protect
    "safety": 11,
    # train
    "training": 12,
    # wire the three into a run's report or another framework
    "reporting": 13,
    "integrations": 13,
    "cli": 14,
    "__main__": 15,
}

#: The three jobs and what sits beside them, in the order imports may run (each may import the
#: ones before it, never one after it): explain < protect < train < report / integrate.
PACKAGE_ORDER: list[tuple[str, ...]] = [("debug",), ("safety",), ("training",), ("reporting", "integrations")]

#: The only modules allowed at the package root: each is genuinely used by every job.
ROOT_MODULES = {
    "__init__": "the public API, imported lazily",
    "__main__": "python -m stabletrain",
    "errors": "the exceptions every layer raises",
    "events": "the callback protocol the loop fires and every tool attaches to",
}


def discover(src: Path = SRC) -> dict[str, Path]:
    """Dotted module name -> file, for every module of the package (``__init__`` is the package)."""
    modules = {}
    for path in sorted((src / ROOT).rglob("*.py")):
        parts = list(path.relative_to(src).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        modules[".".join(parts)] = path
    return modules


MODULES = discover()


def rank_of(module: str) -> Optional[int]:
    """The rank of the longest prefix of ``module`` in :data:`RANKS`; None when none matches."""
    parts = module.split(".")[1:]  # without "stabletrain"
    if not parts:
        return RANKS[""]
    for n in range(len(parts), 0, -1):  # the root's rank is its own, not a default
        key = ".".join(parts[:n])
        if key in RANKS:
            return RANKS[key]
    return None


@dataclass(frozen=True)
class Import:
    """One import statement's target, resolved to a module of the package."""

    line: int
    target: str  # the module imported (or the module holding the imported name)
    names: tuple[str, ...]  # the name taken (``from x import a``: ("a",)); () for ``import x``
    text: str  # the statement as written


@dataclass(frozen=True)
class Violation:
    file: str
    line: int
    rule: str
    detail: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: [{self.rule}] {self.detail}"


def _resolve(name: str, known: set[str]) -> Optional[str]:
    """The longest prefix of ``name`` that is a known module (``name`` itself when it is one)."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        candidate = ".".join(parts[:n])
        if candidate in known:
            return candidate
    return None


def _package_of(module: str, is_package: bool) -> str:
    return module if is_package else module.rpartition(".")[0]


def imports_of(module: str, source: str, known: set[str], is_package: bool = False) -> Iterator[Import]:
    """Every import of a package module in ``source`` (module level, functions, TYPE_CHECKING)."""
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            for alias in node.names:
                target = _resolve(alias.name, known)
                if target is not None:
                    yield Import(node.lineno, target, (), f"import {alias.name}")
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = _package_of(module, is_package).split(".")
                base = base[: len(base) - (node.level - 1)]
                full = ".".join(base + ([node.module] if node.module else []))
            else:
                full = node.module or ""
            if full != ROOT and not full.startswith(ROOT + "."):
                continue
            text = f"from {'.' * node.level}{node.module or ''} import {', '.join(a.name for a in node.names)}"
            for alias in node.names:
                # ``from pkg import submodule`` imports the submodule; ``from pkg import name``, pkg.
                sub = f"{full}.{alias.name}"
                target = sub if sub in known else _resolve(full, known)
                if target is not None:
                    yield Import(node.lineno, target, (alias.name,), text)


def _is_private(name: str) -> bool:
    return name.startswith("_") and not (name.startswith("__") and name.endswith("__"))


def _module_aliases(tree: ast.AST, known: set[str]) -> dict[str, str]:
    """Local names bound to package modules: ``import stabletrain.x as m``, ``from stabletrain import x``."""
    aliases: dict[str, str] = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name.split(".")[0] == ROOT:
                    aliases[alias.asname or alias.name.split(".")[0]] = alias.name if alias.asname else ROOT
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            for alias in node.names:
                if f"{node.module}.{alias.name}" in known:
                    aliases[alias.asname or alias.name] = f"{node.module}.{alias.name}"
    return aliases


def check_module(
    module: str, source: str, known: set[str], file: str = "", is_package: bool = False
) -> list[Violation]:
    """Rules (a) and (b) for one module's ``source``."""
    file = file or module
    found = []
    mine = rank_of(module)
    if mine is None:
        return [Violation(file, 1, "direction", f"{module} has no rank: add it to RANKS in tests/test_layers.py")]
    for imp in imports_of(module, source, known, is_package):
        theirs = rank_of(imp.target)
        if imp.target != module and (theirs is None or theirs > mine):
            found.append(Violation(
                file, imp.line, "direction",
                f"`{imp.text}`: {module} (rank {mine}) imports {imp.target} (rank {theirs}), a higher layer; "
                "imports run utils -> runfiles -> debug (explain) -> safety (protect) -> training -> cli (see RANKS)",
            ))
        dotted = imp.text.split()[1]
        for name in (n for n in (*dotted.split("."), *imp.names) if _is_private(n)):
            found.append(Violation(
                file, imp.line, "private",
                f"`{imp.text}` takes the private name {name} from another module; make it public where it belongs",
            ))
    tree = ast.parse(source)
    aliases = _module_aliases(tree, known)
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and _is_private(node.attr):
            chain, value = [node.attr], node.value
            while isinstance(value, ast.Attribute):
                chain.append(value.attr)
                value = value.value
            if isinstance(value, ast.Name) and value.id in aliases:
                path = ".".join([aliases[value.id], *reversed(chain)])
                found.append(Violation(
                    file, node.lineno, "private",
                    f"`{value.id}.{'.'.join(reversed(chain))}` reads a private name of {aliases[value.id]} ({path})",
                ))
    return sorted(set(found), key=lambda v: (v.line, v.rule, v.detail))  # one per statement and rule


def import_graph(sources: dict[str, tuple[str, bool]], known: set[str]) -> dict[str, dict[str, int]]:
    """module -> {imported module: line} over ``sources`` (module -> (source, is_package))."""
    graph: dict[str, dict[str, int]] = {}
    for module, (source, is_package) in sources.items():
        edges = graph.setdefault(module, {})
        for imp in imports_of(module, source, known, is_package):
            if imp.target != module:
                edges.setdefault(imp.target, imp.line)
    return graph


def find_cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """One circle per strongly connected component that has one (Tarjan), as module lists."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
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
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return [_cycle_in(sorted(c), graph) for c in components]


def _cycle_in(component: list[str], graph: dict[str, dict[str, int]]) -> list[str]:
    """A shortest circle through the component's first module, by breadth-first search."""
    members = set(component)
    start = component[0]
    paths = {start: [start]}
    queue = [start]
    while queue:
        v = queue.pop(0)
        for w in sorted(graph.get(v, {})):
            if w == start:
                return paths[v] + [start]
            if w in members and w not in paths:
                paths[w] = paths[v] + [w]
                queue.append(w)
    return component


def _read(module: str) -> tuple[str, bool]:
    path = MODULES[module]
    return path.read_text(encoding="utf-8"), path.name == "__init__.py"


def _file(module: str) -> str:
    return str(MODULES[module].relative_to(SRC.parent))


# ------------------------------------------------------------------------------------ the package


@pytest.mark.parametrize("module", sorted(MODULES))
def test_imports_follow_the_layers_and_stay_public(module):
    source, is_package = _read(module)
    found = check_module(module, source, set(MODULES), _file(module), is_package)
    assert not found, "\n".join(map(str, found))


def test_no_import_circle():
    graph = import_graph({m: _read(m) for m in MODULES}, set(MODULES))
    cycles = find_cycles(graph)
    lines = []
    for cycle in cycles:
        steps = [f"{_file(a)}:{graph[a][b]} imports {b}" for a, b in zip(cycle, cycle[1:])]
        lines.append("[circle] " + " -> ".join(cycle) + "\n    " + "\n    ".join(steps))
    assert not cycles, "\n".join(lines)


def test_every_module_is_in_the_table_and_the_table_is_used():
    assert all(rank_of(m) is not None for m in MODULES)
    prefixes = {".".join(m.split(".")[1:]) for m in MODULES}
    # "integrations" is reserved for the integration modules on their way in.
    unused = [
        k for k in RANKS
        if k and k != "integrations" and not any(p == k or p.startswith(k + ".") for p in prefixes)
    ]
    assert not unused, f"RANKS names modules that do not exist: {unused}"


def test_the_package_root_holds_only_the_cross_cutting_modules():
    at_root = {p.stem for p in (SRC / ROOT).glob("*.py")}
    assert at_root <= set(ROOT_MODULES), (
        f"modules at src/stabletrain/ that belong in a package (training, safety, debug, runfiles, ...): "
        f"{sorted(at_root - set(ROOT_MODULES))}"
    )


def package_order_violations(graph: dict[str, dict[str, int]]) -> list[str]:
    """Imports from a job's package to one later in :data:`PACKAGE_ORDER` (explain -> protect -> train -> report)."""
    place = {pkg: i for i, group in enumerate(PACKAGE_ORDER) for pkg in group}

    def position(module: str) -> Optional[int]:
        parts = module.split(".")
        return place.get(parts[1]) if len(parts) > 1 else None

    found = []
    for module, edges in graph.items():
        mine = position(module)
        if mine is None:
            continue
        for target, line in edges.items():
            theirs = position(target)
            if theirs is not None and theirs > mine:
                found.append(f"{module}:{line} imports {target}")
    return sorted(found)


def test_the_three_jobs_import_one_way():
    graph = import_graph({m: _read(m) for m in MODULES}, set(MODULES))
    assert package_order_violations(graph) == []
    jobs = {m.split(".")[1] for m in MODULES if m.count(".") >= 1}
    assert {"training", "safety", "debug", "runfiles"} <= jobs


def test_an_upward_import_between_jobs_is_found():
    sources = {
        "stabletrain.debug.diagnose": ("from stabletrain.safety.guard import GuardFailure\n", True),
        "stabletrain.safety.guard": ("def f():\n    from stabletrain.training.loop import Trainer\n", False),
        "stabletrain.training.loop": ("from stabletrain.safety.guard import StepGuard\n", False),
    }
    known = set(sources)
    assert package_order_violations(import_graph(sources, known)) == [
        "stabletrain.debug.diagnose:1 imports stabletrain.safety.guard",
        "stabletrain.safety.guard:2 imports stabletrain.training.loop",
    ]


# ------------------------------------------------------------------ the checker on planted faults

KNOWN = {
    "stabletrain", "stabletrain.errors", "stabletrain.utils", "stabletrain.utils.text", "stabletrain.debug",
    "stabletrain.debug.nan_capture", "stabletrain.debug.replay", "stabletrain.debug.diagnose",
    "stabletrain.debug.diagnose.run", "stabletrain.debug.diagnose.render", "stabletrain.training.loop", "stabletrain.cli",
}


def test_an_import_against_the_direction_is_found_with_file_line_and_rule():
    source = "import math\n\nfrom stabletrain.debug.replay import load_nan_capture\n"
    (v,) = check_module("stabletrain.utils.text", source, KNOWN, "src/stabletrain/utils/text.py")
    assert (v.file, v.line, v.rule) == ("src/stabletrain/utils/text.py", 3, "direction")
    assert str(v).startswith("src/stabletrain/utils/text.py:3: [direction] `from stabletrain.debug.replay import")
    assert "(rank 2) imports stabletrain.debug.replay (rank 9)" in str(v)


def test_imports_in_functions_and_under_type_checking_count():
    source = (
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from stabletrain.training.loop import Trainer\n"
        "def f():\n"
        "    import stabletrain.cli\n"
        "    from stabletrain.debug import diagnose\n"
    )
    found = check_module("stabletrain.debug.nan_capture", source, KNOWN)
    assert [(v.line, v.rule) for v in found] == [(3, "direction"), (5, "direction"), (6, "direction")]
    two = check_module("stabletrain.utils.text", "from stabletrain.training.loop import Trainer, train\n", KNOWN)
    assert len(two) == 1, "one violation per statement"
    assert "imports stabletrain.debug.diagnose (rank 10)" in str(found[2]), "a submodule taken from its package"


def test_imports_downwards_and_of_the_package_root_pass():
    source = "import stabletrain\nfrom stabletrain.utils.text import fmt_number\nfrom stabletrain import errors\n"
    assert check_module("stabletrain.debug.replay", source, KNOWN) == []


def test_private_names_across_modules_are_found():
    source = (
        "from stabletrain.debug.replay import _bitwise_equal, load_nan_capture\n"
        "import stabletrain.debug.replay as r\n"
        "import stabletrain\n"
        "r._microbatch_size(1)\n"
        "stabletrain.debug.nan_capture._default_any_rank\n"
        "self._fine = r.public\n"
        "from stabletrain.debug import _helpers\n"
    )
    found = check_module("stabletrain.debug.diagnose", source, KNOWN | {"stabletrain.debug._helpers"})
    assert [(v.line, v.rule) for v in found] == [(1, "private"), (4, "private"), (5, "private"), (7, "private")]
    assert "_bitwise_equal" in str(found[0]) and "stabletrain.debug.replay._microbatch_size" in str(found[1])


def test_relative_imports_are_resolved():
    source = "from ..replay import load_nan_capture\nfrom . import render\nfrom ...cli import main\n"
    found = check_module("stabletrain.debug.diagnose.run", source, KNOWN)
    assert [(v.line, v.rule) for v in found] == [(3, "direction")]
    assert "imports stabletrain.cli (rank 14)" in str(found[0])


def test_a_module_without_a_rank_fails():
    (v,) = check_module("stabletrain.newthing", "", KNOWN | {"stabletrain.newthing"})
    assert v.rule == "direction" and "has no rank" in v.detail


def test_a_circle_is_found_also_through_a_function_level_import():
    sources = {
        "stabletrain.debug.replay": ("from stabletrain.debug.nan_capture import FORMAT\n", False),
        "stabletrain.debug.nan_capture": ("def f():\n    from stabletrain.debug import diagnose\n", False),
        "stabletrain.debug.diagnose": ("import stabletrain.debug.replay\n", True),
        "stabletrain.utils.text": ("import math\n", False),
    }
    graph = import_graph(sources, KNOWN)
    assert find_cycles(graph) == [
        ["stabletrain.debug.diagnose", "stabletrain.debug.replay", "stabletrain.debug.nan_capture",
         "stabletrain.debug.diagnose"]
    ]
    assert graph["stabletrain.debug.nan_capture"] == {"stabletrain.debug.diagnose": 2}
    del sources["stabletrain.debug.nan_capture"]
    assert find_cycles(import_graph(sources, KNOWN)) == []
