"""The package's layers point one way: a module imports only from its own layer or the ones below.

From the top:

    cli  >  train, integrations, sim  >  runtime  >  ops  >
        triton_kernels, _native, _checks, _dispatch, _config, profiling, wire_formats

- ``cli`` (``lowcomm_kernels/cli.py``) builds the parser and dispatches to ``train``.
- ``train`` (the CLI's harness) uses the ``runtime``'s strategies and launcher.
- ``sim`` (``lowcomm simulate``: the discrete-event simulator) reads the ``runtime``'s schedule
  rules and wire formats, so the simulated methods are the ones the runtime runs; it imports nothing
  of ``train`` (a room of its own: numpy, no workers).
- ``integrations`` (callbacks for other libraries, e.g. the Hugging Face Trainer) wrap the
  ``runtime``'s strategies, at ``train``'s rank.
- ``runtime`` (strategies, transport, launcher) uses the fused ``ops``.
- ``ops`` call the kernels and the helpers of the bottom layer, which import only among themselves.
  ``wire_formats`` (the one table of the wire formats, tests/test_wire_table.py) is of that layer,
  so everything above, and the kernels' helpers, can read it.
- the package's own ``__init__`` (it imports ``ops``, and lazily the runtime's strategies) counts as
  ``runtime``: ``ops`` and below must not import from it.

Every module of the package is parsed (no import is executed): absolute and relative imports, at
module level and inside functions, ``from X import name`` counting as an import of ``X.name`` when
that is a module of the package.
"""

from __future__ import annotations

import ast
import graphlib
from pathlib import Path

import pytest

import lowcomm_kernels

PACKAGE = "lowcomm_kernels"
ROOT = Path(lowcomm_kernels.__file__).resolve().parent
LAYERS = {  # first name under the package -> rank (higher imports lower)
    "cli": 4,
    "train": 3,
    "integrations": 3,
    "sim": 3,
    "runtime": 2,
    "": 2,  # the package's __init__
    "ops": 1,
    "triton_kernels": 0,
    "_native": 0,
    "_checks": 0,
    "_dispatch": 0,
    "_config": 0,
    "profiling": 0,
    "wire_formats": 0,
}
NAMES = {4: "cli", 3: "train", 2: "runtime", 1: "ops", 0: "kernels and helpers"}


def module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def layer(module: str) -> int:
    rest = module[len(PACKAGE) + 1 :] if module != PACKAGE else ""
    first = rest.split(".")[0]
    assert first in LAYERS, f"{module}: no layer for {first!r}; add it to LAYERS and the docstring"
    return LAYERS[first]


def imports(module: str, path: Path) -> list[tuple[int, str]]:
    """(line, imported module of this package) for every import in the file."""
    is_package = path.name == "__init__.py"
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = module.split(".")
                base = base if is_package else base[:-1]
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for a in node.names:
                sub = f"{source}.{a.name}"
                found.append((node.lineno, sub if sub in MODULES else source))
    return [(line, m) for line, m in found if m == PACKAGE or m.startswith(PACKAGE + ".")]


def test_the_walk_sees_every_layer_and_resolves_relative_imports():
    assert {layer(m) for m in MODULES} == set(NAMES)
    found = {m for _, m in imports(f"{PACKAGE}.train.commands", MODULES[f"{PACKAGE}.train.commands"])}
    assert f"{PACKAGE}.train.args" in found  # from .args import ...
    assert f"{PACKAGE}.train.render" in found  # from . import render
    found = {m for _, m in imports(f"{PACKAGE}.train.tasks.lm", MODULES[f"{PACKAGE}.train.tasks.lm"])}
    assert f"{PACKAGE}.train.args" in found  # in a sub-package: from ..args import ...
    assert f"{PACKAGE}.runtime.launch" in found  # from ...runtime.launch import ...
    found = {m for _, m in imports(f"{PACKAGE}.train.faults", MODULES[f"{PACKAGE}.train.faults"])}
    assert f"{PACKAGE}.train.worker" in found  # an import over several lines
    found = {m for _, m in imports(f"{PACKAGE}.runtime.cocodc", MODULES[f"{PACKAGE}.runtime.cocodc"])}
    assert f"{PACKAGE}.ops" in found  # from .. import ops


@pytest.mark.parametrize("module", sorted(MODULES))
def test_no_module_imports_from_a_layer_above_it(module: str):
    own = layer(module)
    upward = [
        f"line {line}: {target} ({NAMES[layer(target)]})"
        for line, target in imports(module, MODULES[module])
        if layer(target) > own
    ]
    assert not upward, f"{module} ({NAMES[own]}) imports from a layer above it: " + "; ".join(upward)


def test_the_simulator_is_a_room_of_its_own():
    """sim reads the runtime's rules (schedule, wire formats) and nothing of the CLI's harness."""
    for module in (m for m in MODULES if m.startswith(f"{PACKAGE}.sim")):
        for line, target in imports(module, MODULES[module]):
            first = target[len(PACKAGE) + 1 :].split(".")[0]
            assert first in ("sim", "runtime"), f"{module} line {line} imports {target}"
            if first == "runtime":
                wire_modules = ("schedule", "compression", "topk_wire")  # the rules and the wire formats
                assert target in tuple(f"{PACKAGE}.runtime.{m}" for m in wire_modules), (
                    f"{module} line {line}: the simulator reads only the runtime's schedule rules and "
                    f"wire formats, got {target}"
                )


def _circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm): each holds an
    import circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph[v]):
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

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


TRAIN = sorted(m for m in MODULES if m.startswith(f"{PACKAGE}.train"))


def test_the_circle_finder_finds_a_circle():
    assert _circles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert _circles({"a": {"b"}, "b": set()}) == []


def test_no_import_circle_inside_train():
    """train's modules import one another without a circle, imports inside functions counted: a
    function-local import hides a circle, it does not remove it (a piece both sides need belongs in
    a module below both)."""
    graph = {m: {t for _, t in imports(m, MODULES[m]) if t in TRAIN and t != m} for m in TRAIN}
    circles = _circles(graph)
    assert not circles, "import circles inside train: " + "; ".join(" <-> ".join(c) for c in circles)


def test_train_imports_its_own_modules_at_module_level():
    """No module of train imports another of train inside a function (that is how circles were
    hidden); function-local imports are left to optional or heavy packages (matplotlib, tqdm,
    scikit-learn, scipy, torchft), each with a comment saying why."""
    local = []
    for m in TRAIN:
        path = MODULES[m]
        tree = ast.parse(path.read_text())
        top = {(n.lineno, n.col_offset) for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))}
        nested = {
            n.lineno
            for n in ast.walk(tree)
            if isinstance(n, (ast.Import, ast.ImportFrom)) and (n.lineno, n.col_offset) not in top
        }
        local += [f"{m} line {line}: {t}" for line, t in imports(m, path) if line in nested and t in TRAIN]
    assert not local, "function-local imports of train's own modules: " + "; ".join(local)


#: the functions of train/ that may call ``backward()`` outside the one training loop: logistic
#: regression's optimum f* (L-BFGS to convergence, the reference the runs are measured against) and
#: the LOSCAR study's one-process re-implementation of LOSCAR (the cross-check of the harness's runs)
NOT_TRAINING_LOOPS = {
    "lowcomm_kernels.train.tasks.logreg.optimum.closure",
    "lowcomm_kernels.train.study_loscar.reference_run",
}


def backward_calls(module: str) -> list[tuple[str, int]]:
    """(qualified name of the enclosing function, line) of every ``.backward(`` call in ``module``."""
    found = []

    def visit(node: ast.AST, where: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = where
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{where}.{child.name}"
            if (
                isinstance(child, ast.Call)
                and isinstance(child.func, ast.Attribute)
                and child.func.attr == "backward"
            ):
                found.append((where, child.lineno))
            visit(child, name)

    visit(ast.parse(MODULES[module].read_text()), module)
    return found


def test_one_training_loop_in_train():
    """Every task (LM, digits MLP, logistic regression) and the fault-injection replicas train
    through ``train.loop.TrainLoop``: no other function of train/ runs a backward pass, except the
    two that are not training loops of the harness (NOT_TRAINING_LOOPS)."""
    loop = f"{PACKAGE}.train.loop"
    assert backward_calls(loop), "the walk finds the loop's own backward()"
    others = [
        f"{where} line {line}"
        for m in TRAIN
        if m != loop
        for where, line in backward_calls(m)
        if where not in NOT_TRAINING_LOOPS
    ]
    assert not others, "training loops outside train/loop.py: " + "; ".join(others)
    exempt = {where for m in TRAIN for where, _ in backward_calls(m)}
    assert NOT_TRAINING_LOOPS <= exempt, f"stale exemptions: {NOT_TRAINING_LOOPS - exempt}"


def test_lowcomm_report_finds_a_study_by_its_name_not_by_branches():
    """``lowcomm report`` and the commands look a study up in ``studies.STUDIES`` (each study's
    configurations, command and renderer); none of them compares a name with a study's."""
    from lowcomm_kernels.train.studies import STUDIES

    names = set(STUDIES)

    def study_names(node: ast.AST) -> set[str]:
        return {n.value for n in ast.walk(node) if isinstance(n, ast.Constant) and n.value in names}

    branches = []
    for module in ("render", "report", "commands", "studies"):
        path = MODULES[f"{PACKAGE}.train.{module}"]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Compare) and study_names(node):
                branches.append(f"{path.name} line {node.lineno}: {sorted(study_names(node))}")
    assert not branches, "branches on a study's name: " + "; ".join(branches)


# ----- membership: the strategies and the torchft module (runtime.membership, runtime.ft) -------------
FT = f"{PACKAGE}.runtime.ft"
MEMBERSHIP = f"{PACKAGE}.runtime.membership"
STRATEGY_MODULES = [f"{PACKAGE}.runtime.{m}" for m in ("base", "dense", "cocodc", "loscar", "eager")]
RUNTIME = sorted(m for m in MODULES if m.startswith(f"{PACKAGE}.runtime"))


def test_only_the_membership_imports_the_torchft_module():
    """A strategy is given its membership and never asks which kind it is; ``membership_for`` is the
    one place that turns ``manager=`` into the torchft membership (lazily: torchft is optional)."""
    assert set(STRATEGY_MODULES) <= set(MODULES)
    found = [
        f"{module} line {line}"
        for module, path in MODULES.items()
        for line, target in imports(module, path)
        if target == FT and module != MEMBERSHIP
    ]
    assert not found, f"{FT} imported outside {MEMBERSHIP}: " + "; ".join(found)


def test_the_torchft_module_uses_only_public_hooks_of_a_strategy():
    """Healing calls a strategy's public hooks (``Strategy.heal_state`` and the ones next to it)
    only, so renaming a strategy's internals cannot silently break it: ft.py imports no strategy
    module (no class to test with isinstance), asks nothing of a strategy by isinstance, hasattr or
    getattr, and reads no ``_private`` attribute of one."""
    path = MODULES[FT]
    assert not [t for _, t in imports(FT, path) if t in STRATEGY_MODULES]
    tree = ast.parse(path.read_text())
    names = {"strategy"}  # every function of ft.py names the strategy it is given so
    assert any(isinstance(n, ast.arg) and n.arg in names for n in ast.walk(tree))
    bad = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in names:
            if node.attr.startswith("_"):
                bad.append(f"line {node.lineno}: strategy.{node.attr}")
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.args:
            first = node.args[0]
            asks = node.func.id in ("isinstance", "hasattr", "getattr", "setattr", "type", "vars")
            if asks and isinstance(first, ast.Name) and first.id in names:
                bad.append(f"line {node.lineno}: {node.func.id}(strategy, ...)")
    assert not bad, "ft.py reaches into a strategy: " + "; ".join(bad)


def _type_checking_lines(path: Path) -> set[int]:
    """Lines inside ``if TYPE_CHECKING:`` blocks: imports for annotations only, never executed."""
    lines: set[int] = set()
    for node in ast.walk(ast.parse(path.read_text())):
        test = node.test if isinstance(node, ast.If) else None
        name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else ""
        if name == "TYPE_CHECKING":
            for inner in node.body:
                lines |= set(range(inner.lineno, (inner.end_lineno or inner.lineno) + 1))
    return lines


def test_no_import_circle_inside_the_runtime():
    """The runtime's modules import one another without a circle, imports inside functions counted
    (a lazy import hides a circle, it does not remove it); imports for annotations only are not."""
    graph = {}
    for m in RUNTIME:
        skip = _type_checking_lines(MODULES[m])
        graph[m] = {t for line, t in imports(m, MODULES[m]) if t in RUNTIME and t != m and line not in skip}
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        raise AssertionError("import circle inside the runtime: " + " -> ".join(e.args[1])) from None


OPS = sorted(m for m in MODULES if m == f"{PACKAGE}.ops" or m.startswith(f"{PACKAGE}.ops."))


def test_no_import_circle_inside_ops():
    """ops' modules (their ``__init__`` included) import one another without a circle, imports
    inside functions counted: the merges with a quantized average live beside their dense ops and
    import the quantize modules, which import neither of them."""
    import graphlib

    graph = {m: {t for _, t in imports(m, MODULES[m]) if t in OPS and t != m} for m in OPS}
    assert f"{PACKAGE}.ops.quantize" in graph[f"{PACKAGE}.ops.outer_merge"]  # the walk sees ops' imports
    try:
        graphlib.TopologicalSorter(graph).prepare()
    except graphlib.CycleError as e:
        raise AssertionError("import circle inside ops: " + " -> ".join(e.args[1])) from None
