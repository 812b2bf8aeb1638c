"""The core (``lowcomm_kernels``, ``.ops``, ``.runtime``) imports only torch, numpy and the standard
library: the CLI's packages (matplotlib, tqdm: the ``cli`` extra), tensorboard and transformers are
optional and imported where they are used.

Each check runs in a fresh interpreter, since this test process has long imported everything.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from importlib import metadata
from typing import Any

OPTIONAL = ("matplotlib", "tqdm", "tensorboard", "transformers")
CORE = """
import lowcomm_kernels, lowcomm_kernels.ops, lowcomm_kernels.runtime
from lowcomm_kernels import DiLoCo, LoggingSink, MultiSink, TensorBoardSink  # the lazy exports
from lowcomm_kernels.runtime import sinks
"""


def _run(code: str) -> Any:
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=180)
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _requirement_closure(roots: tuple[str, ...]) -> set[str]:
    """The distributions ``roots`` need, transitively (requirements behind an extra left out)."""
    seen: set[str] = set()
    todo = list(roots)
    while todo:
        name = re.sub(r"[-_.]+", "-", todo.pop()).lower()
        if name in seen:
            continue
        seen.add(name)
        try:
            reqs = metadata.requires(name) or []
        except metadata.PackageNotFoundError:
            continue
        todo += [re.split(r"[\s;<>=!~\[(]", r, maxsplit=1)[0] for r in reqs if "extra ==" not in r]
    return seen


def test_core_adds_only_stdlib_and_torch_or_numpy_dependencies():
    """What importing the core adds to what ``import torch, numpy`` already loaded: standard-library
    modules, the package itself, and modules of torch's own requirements (torch imports sympy
    lazily, e.g. when ops are registered)."""
    got = _run(
        "import json, sys\nimport torch, numpy\nbase = set(sys.modules)\n"
        + CORE
        + "print(json.dumps({'new': sorted({m.split('.')[0] for m in set(sys.modules) - base}), "
        f"'optional': [m for m in {OPTIONAL!r} if m in set(sys.modules) - base]}}))"
    )
    assert got["optional"] == []
    allowed = _requirement_closure(("torch", "numpy"))
    owners = metadata.packages_distributions()
    foreign = {}
    for mod in got["new"]:
        if mod in sys.stdlib_module_names or mod == "lowcomm_kernels":
            continue
        dists = {re.sub(r"[-_.]+", "-", d).lower() for d in owners.get(mod, ["<no distribution>"])}
        if not dists <= allowed:
            foreign[mod] = sorted(dists)
    assert foreign == {}, (
        f"the core imported modules outside torch, numpy and the standard library: {foreign}"
    )


def test_core_imports_without_the_optional_packages():
    """With matplotlib, tqdm, tensorboard and transformers unimportable (as if not installed), the
    core imports and its sinks that need nothing optional work; none of them was imported."""
    block = f"import sys\nfor name in {OPTIONAL!r}:\n    sys.modules[name] = None\n"
    got = _run(
        block
        + CORE
        + "import json, logging\n"
        + "LoggingSink(); MultiSink(None, LoggingSink())\n"
        + f"print(json.dumps([m for m in {OPTIONAL!r} if sys.modules.get(m) is not None]))"
    )
    assert got == []
