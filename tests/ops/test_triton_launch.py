"""How the Triton launchers launch, checked on the CPU without running a kernel: the device and
stream a launch goes to, read from the launchers' source and from the helpers' logic."""

from __future__ import annotations

import ast
import contextlib
import importlib
import importlib.util
import os
import pathlib
import sys
import types

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed: the Triton backend cannot be tested")

from lowcomm_kernels.triton_kernels import _launch  # noqa: E402

KERNEL_DIR = pathlib.Path(_launch.__file__).parent
LAUNCHER_MODULES = sorted(p for p in KERNEL_DIR.glob("*.py") if p.name not in ("__init__.py", "_launch.py"))


# ---- on_device: the launch runs on the tensors' device ---------------------------------------


def test_on_device_is_a_no_op_for_cpu_tensors(monkeypatch):
    """Under the interpreter (CPU tensors) there is no CUDA device to enter."""
    monkeypatch.setattr(torch.cuda, "device", _fail_if_called)
    ctx = _launch.on_device(torch.ones(3))
    assert isinstance(ctx, contextlib.nullcontext)
    with ctx:
        pass


def _fail_if_called(*args, **kwargs):
    raise AssertionError("torch.cuda.device must not be entered for a CPU tensor")


@pytest.mark.parametrize("index", [0, 1, 3])
def test_on_device_enters_the_tensors_device(monkeypatch, index):
    """A tensor on cuda:<index> makes cuda:<index> current for the launch (whatever is current
    outside), so Triton takes that device's current stream. Checked with a stand-in tensor and a
    recording torch.cuda.device: only the logic is tested here, not CUDA."""
    entered: list[torch.device] = []
    exited: list[torch.device] = []

    class Recording:
        def __init__(self, device):
            self.device = device

        def __enter__(self):
            entered.append(self.device)

        def __exit__(self, *exc):
            exited.append(self.device)
            return False

    monkeypatch.setattr(torch.cuda, "device", Recording)
    stand_in = types.SimpleNamespace(device=torch.device("cuda", index))
    with _launch.on_device(stand_in):
        assert entered == [torch.device("cuda", index)] and not exited
    assert exited == entered


# ---- every launch in the kernel modules is inside `with on_device(...)` ---------------------


def _launches(tree: ast.AST, kernel_suffix: str = "_kernel") -> list[tuple[ast.Call, list[ast.AST]]]:
    """Every ``<name>_kernel[grid](...)`` call in `tree`, with its chain of ancestors, and every
    ``launch_elementwise(<name>_kernel, ...)`` (whose own launch is checked below)."""
    found = []

    def walk(node: ast.AST, parents: list[ast.AST]) -> None:
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Subscript)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id.endswith(kernel_suffix)
        ):
            found.append((node, parents))
        elif (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Name)
            and node.func.id == "launch_elementwise"
            and node.args
            and isinstance(node.args[0], ast.Name)
            and node.args[0].id.endswith("_kernel")
        ):
            found.append((node, parents))
        for child in ast.iter_child_nodes(node):
            walk(child, [*parents, node])

    walk(tree, [])
    return found


def _shared_launch(call: ast.Call) -> bool:
    """``launch_elementwise(...)``: on the device by construction (tested on its own below)."""
    return isinstance(call.func, ast.Name) and call.func.id == "launch_elementwise"


def _inside_on_device(parents: list[ast.AST]) -> bool:
    for p in parents:
        if isinstance(p, ast.With):
            for item in p.items:
                e = item.context_expr
                if isinstance(e, ast.Call) and isinstance(e.func, ast.Name) and e.func.id == "on_device":
                    return True
    return False


def test_launcher_modules_found():
    names = {p.stem for p in LAUNCHER_MODULES}
    assert {"pack", "outer_merge", "mask_indices", "sparse", "fragment_norms"} <= names


@pytest.mark.parametrize("path", LAUNCHER_MODULES, ids=lambda p: p.stem)
def test_every_launch_runs_on_the_tensors_device(path):
    """Static check of the source: each kernel launch sits inside ``with on_device(...)``, and
    every ``launch_*`` function launches something (so the check cannot pass vacuously)."""
    tree = ast.parse(path.read_text(), filename=str(path))
    launches = _launches(tree)
    assert launches, f"{path.name}: no kernel launch found"
    outside = [
        f"line {call.lineno}: {ast.unparse(call.func)}"
        for call, parents in launches
        if not (_shared_launch(call) or _inside_on_device(parents))
    ]
    assert not outside, f"{path.name}: launches outside `with on_device(...)`: {outside}"
    launchers = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("launch_")]
    assert launchers, f"{path.name}: no launch_* function"
    for fn in launchers:
        assert _launches(fn), f"{path.name}: {fn.name} launches no kernel"


def test_launch_elementwise_runs_on_the_tensors_device():
    """The shared launcher that the modules above call launches its kernel inside on_device."""
    tree = ast.parse(pathlib.Path(_launch.__file__).read_text())
    (fn,) = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "launch_elementwise"]
    launches = _launches(fn, kernel_suffix="kernel")
    assert len(launches) == 1 and _inside_on_device(launches[0][1])


# ---- which bf16 rounding a launch uses: torch's choice on that device -------------------------


def test_hardware_bf16_never_on_the_interpreter(monkeypatch):
    monkeypatch.setattr(_launch, "capability", _fail_if_called)
    assert not _launch.hardware_bf16(torch.ones(2))


@pytest.mark.parametrize(("cap", "hw"), [((7, 0), False), ((7, 5), False), ((8, 0), True), ((9, 0), True)])
def test_hardware_bf16_from_sm_80(monkeypatch, cap, hw):
    """c10::BFloat16 uses __float2bfloat16 (cvt.rn.bf16.f32) in device code for sm_80+, its own
    round_to_nearest_even before: the launcher follows the capability of the data's device."""
    asked: list[int] = []
    monkeypatch.setattr(_launch, "capability", lambda index: asked.append(index) or cap)
    stand_in = types.SimpleNamespace(device=torch.device("cuda", 2))
    assert _launch.hardware_bf16(stand_in) is hw
    assert asked == [2]


# ---- what a launch compiles: mask_perm's per-round keys do not start a new compilation ------


def test_mask_perm_compiles_once_for_every_round():
    """The kernel's compile key (Triton's specialisation of the arguments) is the same for the
    keys of any round: divisibility by 16 or a key equal to 1 would otherwise pick a new variant,
    compiled in the middle of a sync."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    from lowcomm_kernels.ops import mask_keys

    # From sys.modules, not the package attribute: the interpreter tests leave an interpreted
    # module there and drop it from sys.modules, so this imports the kernels afresh.
    kernel = importlib.import_module("lowcomm_kernels.triton_kernels.mask_indices")._mask_perm_kernel
    if not hasattr(kernel, "params"):
        pytest.skip("TRITON_INTERPRET is set: the kernels are interpreted, nothing is compiled")
    bind = create_function_from_signature(
        kernel.signature, kernel.params, make_backend(GPUTarget("cuda", 90, 32))
    )
    out = torch.empty(8, dtype=torch.int64)
    n, k = 1 << 20, 8
    keys = [mask_keys(7, r, n) for r in range(200)]
    assert any(a % 16 == 0 for adds, *_ in keys for a in adds), "no key divisible by 16 drawn"
    specs = set()
    for adds, muls, shift, bitmask in [*keys, ([16, 32, 1, 0], [1, 17, 33, 1], keys[0][2], keys[0][3])]:
        _, spec, _ = bind(out, n, k, *adds, *muls, shift, bitmask, BLOCK=_launch.GPU_BLOCK)
        specs.add(repr(spec))
    assert len(specs) == 1, f"{len(specs)} compile variants over the rounds"


# ---- aot_check compiles what the launchers launch ------------------------------------------


@pytest.fixture(scope="module")
def aot():
    """aot_check, recording launches of the compiled-mode kernel modules (no compilation here)."""
    if os.environ.get("TRITON_INTERPRET", "") not in ("", "0"):
        pytest.skip("TRITON_INTERPRET is set: the kernels are interpreted, nothing is compiled")
    path = pathlib.Path(__file__).resolve().parents[2] / "tools" / "aot_check.py"
    spec = importlib.util.spec_from_file_location("aot_check", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


def _aligned(v) -> set[str]:
    names = list(v.signature)
    return {names[path[0]] for path, a in v.attrs.items() if ["tt.divisibility", 16] in a}


def _pointers(v) -> set[str]:
    return {name for name, ty in v.signature.items() if ty.startswith("*")}


ELEMENTWISE = {  # kernel -> its size argument
    "_pack_kernel": "n",
    "_outer_merge_kernel": "n",
    "_taylor_norms_kernel": "n",
    "_sparse_gather_kernel": "k",
    "_sparse_scatter_merge_kernel": "k",
}


def test_quick_aot_covers_every_kernel_the_default_merge_alignments_and_int32(aot):
    variants, _ = aot._variants([90], True, None)
    by_kernel: dict[str, list] = {}
    for v in variants:
        by_kernel.setdefault(v.kernel, []).append(v)
    jitted = {
        name
        for m in aot.MODULES
        for name in vars(importlib.import_module(f"lowcomm_kernels.triton_kernels.{m}"))
        if name.endswith("_kernel") and name.startswith("_")
    }
    assert jitted <= set(by_kernel), f"never compiled: {jitted - set(by_kernel)}"
    merge = [v.named_constexprs for v in by_kernel["_outer_merge_kernel"]]
    diloco = dict(HAS_MOMENTUM=True, NESTEROV=True, HAS_SENT=False, HAS_ALPHA=False, LAM_ON_DEVICE=False)
    assert any(all(c[k] == want for k, want in diloco.items()) for c in merge), "DiLoCo's default merge"
    for kernel in (*ELEMENTWISE, "_fragment_norms_kernel"):
        vs = by_kernel[kernel]
        assert any(_aligned(v) == _pointers(v) for v in vs), f"{kernel}: no all-aligned variant"
        assert any(not (_aligned(v) & {"g_ptr", "x_ptr", "buf_ptr"}) for v in vs), (
            f"{kernel}: no unaligned view"
        )
    for kernel, size in ELEMENTWISE.items():
        assert any(v.signature[size] == "i32" for v in by_kernel[kernel]), f"{kernel}: no int32 {size}"


def test_full_aot_covers_every_reachable_variant(aot):
    """The full mode holds the quick one, every flag combination the launchers can pass, and for
    each size argument every kind Triton specialises it to: == 1 (a constexpr), int32 and int64,
    divisible by 16 and not."""
    full, _ = aot._variants([90], False, None)
    quick, _ = aot._variants([90], True, None)

    def key(v):
        return repr((v.kernel, v.signature, sorted(v.constexprs.items()), sorted(v.attrs.items()), v.options))

    assert {key(v) for v in quick} <= {key(v) for v in full}
    flags = {
        tuple(
            v.named_constexprs[k]
            for k in ("HAS_MOMENTUM", "NESTEROV", "HAS_SENT", "HAS_ALPHA", "LAM_ON_DEVICE")
        )
        for v in full
        if v.kernel == "_outer_merge_kernel"
    }
    reachable = {
        (mom, nest, sent, alpha, lam)
        for mom in (True, False)
        for nest in ((True, False) if mom else (False,))
        for sent in (True, False)
        for alpha in (True, False)
        for lam in ((True, False) if sent else (False,))
    }
    assert flags == reachable
    for kernel, size in ELEMENTWISE.items():
        vs = [v for v in full if v.kernel == kernel]
        index = list(vs[0].signature).index(size)
        kinds = {(v.signature[size], ["tt.divisibility", 16] in v.attrs.get((index,), [])) for v in vs}
        assert kinds == {
            ("constexpr", False),
            ("i32", False),
            ("i32", True),
            ("i64", False),
            ("i64", True),
        }, kernel
