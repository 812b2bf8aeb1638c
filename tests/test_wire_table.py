"""The wire formats have one table (``lowcomm_kernels/wire_formats.py``) and every other place reads
it: the ops' quantized formats, the narrow dense wire dtype of the checks, the runtime's names, the
C ABI's format codes. A list of format names written out again elsewhere in the package (a tuple,
list, set or dict literal with three or more of them) fails here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import torch

import lowcomm_kernels
from lowcomm_kernels import _checks, wire_formats
from lowcomm_kernels.ops import FORMATS
from lowcomm_kernels.runtime import schedule

ROOT = Path(lowcomm_kernels.__file__).resolve().parent
OWNER = ROOT / "wire_formats.py"
NAMES = set(wire_formats.BY_NAME)
#: literals that name formats without restating their rule: (file under the package, line's text)
ALLOWED = {
    # a choice of the formats a simulation compares by default (a sim-only format among them)
    ("sim/command.py", "DEFAULT_WIRES"),
}


def _named(node: ast.AST) -> int:
    elts = node.keys if isinstance(node, ast.Dict) else node.elts
    return sum(isinstance(e, ast.Constant) and e.value in NAMES for e in elts if e is not None)


def test_no_list_of_format_names_outside_the_table():
    found = []
    for path in sorted(ROOT.rglob("*.py")):
        if path == OWNER:
            continue
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, (ast.Tuple, ast.List, ast.Set, ast.Dict)) and _named(node) >= 3:
                rel = path.relative_to(ROOT).as_posix()
                text = lines[node.lineno - 1]
                if not any(rel == f and key in text for f, key in ALLOWED):
                    found.append(f"{rel}:{node.lineno}: {text.strip()}")
    assert not found, (
        "format names written out again; read lowcomm_kernels.wire_formats instead:\n" + "\n".join(found)
    )


def test_the_readers_agree_with_the_table():
    quantized = [s for s in wire_formats.TABLE if s.kind == "quantized"]
    assert list(FORMATS) == [s.name for s in quantized]
    for s in quantized:
        f = FORMATS[s.name]
        assert (f.bits, f.kind, f.qmax, f.exp_bits, f.man_bits, f.emin) == (
            s.bits,
            s.grid,
            s.qmax,
            s.exp_bits,
            s.man_bits,
            s.emin,
        )
    assert _checks.NARROW_WIRE_DTYPES == (torch.bfloat16,)
    assert schedule.WIRE_FORMATS == {
        "fp32": torch.float32,
        "bf16": torch.bfloat16,
        **{s.name: s.name for s in quantized},
    }
    assert schedule.SPARSE_WIRE_FORMATS == ("topk",)


def test_the_abi_format_codes_are_the_tables():
    abi = (ROOT.parent / "csrc" / "include" / "lowcomm" / "abi.h").read_text()
    codes = {m[0].lower(): int(m[1]) for m in re.findall(r"#define LC_Q_(\w+) (\d+)", abi)}
    assert codes == {s.name: s.abi for s in wire_formats.QUANTIZED}
