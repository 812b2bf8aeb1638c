"""Each top-level folder does its own job, and no other's:

- ``tests/``: the tests, the GPU ones included (``tests/gpu``, every module marked ``gpu``);
- ``bench/``: timing scripts only: nothing there imports ``tests`` or reads a file under ``tests/``
  (a check of correctness belongs in tests/, with the tolerances of tests/conftest.py);
- ``tools/``: maintenance scripts of the source tree (``tools/aot_check.py``), outside the wheel;
- ``lowcomm_kernels/``: the package a user installs; no maintenance script ships in it (a module
  runnable as a script is the CLI, or a study entry point named in ``SCRIPTS``).

Sources are parsed, not imported.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
BENCH = sorted((ROOT / "bench").rglob("*.py"))
GPU_TESTS = sorted((ROOT / "tests" / "gpu").glob("test_*.py"))
TOOLS = sorted((ROOT / "tools").glob("*.py"))
PACKAGE = ROOT / "lowcomm_kernels"
#: modules of the package with a ``__main__`` block: the CLI, and the studies' own entry points
#: (``python -m lowcomm_kernels.train.<study>``, documented in docs/results.md)
SCRIPTS = {"cli.py", "train/simcheck.py", "train/study_loscar.py"}
# a string that is a path into tests/ ("tests", "tests/ops/x.py", "../tests/..."), not prose about it
TESTS_PATH = re.compile(r"^(\.\./|\./)?tests(/[\w.\-]*)*$")


def _docstrings(tree: ast.AST) -> set[int]:
    ids = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            body = node.body
            if body and isinstance(body[0], ast.Expr) and isinstance(body[0].value, ast.Constant):
                ids.add(id(body[0].value))
    return ids


def _reaches_into_tests(path: Path) -> list[str]:
    tree = ast.parse(path.read_text(), str(path))
    docs = _docstrings(tree)
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [
                f"line {node.lineno}: import {a.name}" for a in node.names if a.name.split(".")[0] == "tests"
            ]
        elif (
            isinstance(node, ast.ImportFrom)
            and not node.level
            and (node.module or "").split(".")[0] == "tests"
        ):
            found.append(f"line {node.lineno}: from {node.module} import ...")
        elif (
            isinstance(node, ast.Constant)
            and isinstance(node.value, str)
            and id(node) not in docs
            and TESTS_PATH.match(node.value)
        ):
            found.append(f"line {node.lineno}: the path {node.value!r}")
    return found


@pytest.mark.parametrize("path", BENCH, ids=[p.name for p in BENCH])
def test_bench_neither_imports_tests_nor_reads_their_files(path: Path):
    found = _reaches_into_tests(path)
    assert not found, (
        f"{path.relative_to(ROOT)} reaches into tests/ ({'; '.join(found)}): a correctness check "
        "belongs in tests/ (tests/gpu for the GPU), bench/ only times"
    )


def test_the_rule_sees_an_import_and_a_path(tmp_path: Path):
    probe = tmp_path / "probe.py"
    probe.write_text(
        '"""Checked by tests/gpu/test_ops.py (prose: fine)."""\n'
        "from tests.runtime.rt_sim import simulate_dense\n"
        'spec = ROOT / "tests" / "ops" / "test_registration.py"\n'
        'open("tests/gpu/x.json")\n'
    )
    found = sorted(_reaches_into_tests(probe))
    assert found == [
        "line 2: from tests.runtime.rt_sim import ...",
        "line 3: the path 'tests'",
        "line 4: the path 'tests/gpu/x.json'",
    ]


def test_gpu_tests_exist_and_every_module_is_marked_gpu():
    assert GPU_TESTS, "tests/gpu holds the GPU tests"
    for path in GPU_TESTS:
        tree = ast.parse(path.read_text(), str(path))
        marks = [
            ast.unparse(node.value)
            for node in tree.body
            if isinstance(node, ast.Assign)
            and any(getattr(t, "id", "") == "pytestmark" for t in node.targets)
        ]
        assert any("pytest.mark.gpu" in m for m in marks), (
            f"{path.relative_to(ROOT)}: no module-level `pytestmark = pytest.mark.gpu` (without it the "
            "tests run, and fail, where there is no GPU)"
        )


def test_no_maintenance_script_in_the_package():
    modules = {p.relative_to(PACKAGE).as_posix(): p for p in PACKAGE.rglob("*.py")}
    for tool in TOOLS:
        same = [m for m in modules if Path(m).name == tool.name]
        assert not same, f"tools/{tool.name} is a maintenance script; the package has {same} too"
    runnable = {
        m for m, p in modules.items() if re.search(r"^if __name__ == .__main__.:", p.read_text(), re.M)
    }
    assert runnable <= SCRIPTS, (
        f"{sorted(runnable - SCRIPTS)} run as scripts: a maintenance script goes to tools/ (outside the "
        "wheel), a user-facing command into the CLI"
    )


def test_only_the_package_is_in_the_wheel():
    tomllib = pytest.importorskip("tomllib")
    conf = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert conf["tool"]["scikit-build"]["wheel"]["packages"] == ["lowcomm_kernels"]
    assert (ROOT / "tools" / "aot_check.py").exists() and not (
        PACKAGE / "triton_kernels" / "aot_check.py"
    ).exists()
