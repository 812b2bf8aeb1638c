"""The sync path reads no device value on the host except through the two pinned, event-ordered
mirrors (``Handle.host_values`` and ``host.DeviceToHost``): on a GPU every such read would stall the
host until the compute stream drains, which makes the exposed-communication metric and CoCoDC's
measured T_c / T_s (so its N) wrong. This walks the runtime's source and fails on any
``.item() / .tolist() / .cpu() / .numpy()`` call outside the functions listed here, each of which
runs off the per-step path (checkpoints, the consistency guard, recovery after a skipped sync,
construction) or is one of the mirrors itself."""

from __future__ import annotations

import ast
from pathlib import Path

import lowcomm_kernels.runtime as rt

READS = {"item", "tolist", "cpu", "numpy"}
CONVERSIONS = {"float", "int", "bool"}
PYTHON_CALLS = {"len", "sum", "max", "min", "abs", "round", "getattr", "str", "repr", "range"}


def _plain_python(node: ast.AST) -> bool:
    """float(len(x)), int(q["step"]), ...: conversions of plain Python values, not of tensors."""
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
        return node.func.id in PYTHON_CALLS
    if isinstance(node, ast.Subscript):  # a dict or list entry (checkpoint fields, host lists)
        return isinstance(node.slice, ast.Constant) or isinstance(node.value, ast.Name)
    return False


ALLOWED = {  # (module, function) -> why a host read is fine there
    ("host", "values"): "the mirror: pinned memory filled before its event",
    ("transport", "host_values"): "the mirror of the control vector",
    ("base", "tensor_hash"): "consistency guard and agreement (construction / every guard_every syncs)",
    ("base", "check_consistency"): "consistency guard, opt-in every guard_every syncs",
    ("base", "_poisoned"): "only after a skipped sync (recovery)",
    ("base", "nonfinite_tensors"): "only when every tensor is on the CPU, where a read waits for no stream",
    ("base", "save_checkpoint"): "checkpoint",
    ("dense", "_state"): "checkpoint",
    ("dense", "_load_state"): "checkpoint restore",
    ("dense", "_guard_values"): "consistency guard",
    ("dense", "_step_failed"): "only when the host-side bound of _step_fits cannot vouch that the "
    "outer step stays finite (values near the dtype's limit): then every rank must read it to skip alike",
    ("loscar", "_state"): "checkpoint",
    ("loscar", "_load_state"): "checkpoint restore",
    ("agreement", "_gather_bytes"): "construction",
    ("agreement", "agree"): "construction",
    ("agreement", "value_fingerprint"): "construction (the pairing check of strategies built per rank)",
    ("agreement", "check_pairing"): "construction",
    ("eager", "state"): "checkpoint",
    ("eager", "after_send"): "eager's own outer step at the send checks that this rank's share, g and u "
    "are finite before it applies them (one read of three norms per sync, after the send's own "
    "control values were read; the delayed average has no other check on this rank)",
    ("launch", "*"): "the local process launcher (tests, benchmarks)",
    ("topology", "*"): "construction of process groups",
    ("compression", "_job_finished"): "bool() of Event.query(), a host flag: no device value is read",
    ("compression", "_even_group_counts"): "construction (the ranks agree on their process-group count "
    "before the wire's own group is made)",
    ("ft", "all_reduce"): "a torchft round blocks by design (it waits for its collectives and "
    "should_commit), so reading its control vector waits for nothing more",
    ("ft", "join"): "the first quorum round, at the first step",
    ("ft", "finish_heal"): "should_commit() of a heal round (a host flag, torchft blocks by design)",
    ("dcp", "_resize"): "checkpoint restore with another number of ranks or replicas",
    ("loscar", "heal_state"): "the state a healthy peer sends for a heal (torchft, inside a quorum)",
    ("ft", "_header"): "a replica's ranks agree over a gloo group of CPU tensors: the header is host "
    "memory, and the ranks must read it to take group rank 0's decision",
    ("ft", "agree_state"): "group rank 0's state after a heal, a CPU byte tensor over the replica's "
    "gloo group (only after a quorum that healed a rank)",
}


def _reads(path: Path) -> list[tuple[str, int, str]]:
    tree = ast.parse(path.read_text())
    out = []

    def visit(node: ast.AST, func: str) -> None:
        for child in ast.iter_child_nodes(node):
            name = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else func
            if (
                isinstance(child, ast.Call)
                and isinstance(child.func, ast.Attribute)
                and child.func.attr in READS
            ):
                out.append((name, child.lineno, child.func.attr))
            # float(t[0]), bool(t.all()), int(x.sum()): a conversion of a computed value reads it
            if (
                isinstance(child, ast.Call)
                and isinstance(child.func, ast.Name)
                and child.func.id in CONVERSIONS
                and len(child.args) == 1
                and isinstance(child.args[0], (ast.Call, ast.Subscript))
                and not _plain_python(child.args[0])
            ):
                out.append((name, child.lineno, child.func.id))
            visit(child, name)

    visit(tree, "<module>")
    return out


def test_no_host_reads_of_device_values_in_the_sync_path():
    root = Path(rt.__file__).parent
    bad = []
    for path in sorted(root.glob("*.py")):
        mod = path.stem
        for func, line, attr in _reads(path):
            if (mod, func) not in ALLOWED and (mod, "*") not in ALLOWED:
                bad.append(f"runtime/{path.name}:{line} .{attr}() in {func}()")
    assert not bad, "host reads of device values on the sync path:\n" + "\n".join(bad)


def test_the_check_sees_reads():  # the walker itself finds a read where there is one
    import tempfile

    with tempfile.NamedTemporaryFile("w", suffix=".py", delete=False) as f:
        f.write("def apply(x):\n    return x.cpu().tolist(), float(x.sum()), bool(x.isfinite().all())\n")
    found = {(fn, attr) for fn, _, attr in _reads(Path(f.name))}
    assert found == {("apply", "cpu"), ("apply", "tolist"), ("apply", "float"), ("apply", "bool")}


def test_event_wait_is_bounded_by_the_timeout():
    """On CUDA, Handle.wait polls the collective's completion event with this, so a dead peer is a
    SyncError after timeout_s instead of a kill by NCCL's watchdog."""
    import time

    from lowcomm_kernels.runtime.transport import wait_until

    t0 = time.perf_counter()
    assert wait_until(lambda: False, 0.05) is False
    assert 0.05 <= time.perf_counter() - t0 < 1.0
    calls = iter(range(1000))
    assert wait_until(lambda: next(calls) >= 50, 5.0) is True
