"""How the Triton launchers launch, checked on the CPU without running a kernel: the device and
stream a launch goes to, read from the launchers' source and from the helpers' logic."""

from __future__ import annotations

import ast
import contextlib
import importlib
import pathlib
import types

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed: the Triton backend cannot be tested")

from lowcomm_kernels.triton_kernels import _launch  # noqa: E402

KERNEL_DIR = pathlib.Path(_launch.__file__).parent
LAUNCHER_MODULES = sorted(
    p for p in KERNEL_DIR.glob("*.py") if p.name not in ("__init__.py", "_launch.py", "aot_check.py")
)


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


def _launches(tree: ast.AST) -> list[tuple[ast.Call, list[ast.AST]]]:
    """Every ``<name>_kernel[grid](...)`` call in `tree`, with its chain of ancestors."""
    found = []

    def walk(node: ast.AST, parents: list[ast.AST]) -> None:
        if (
            isinstance(node, ast.Call)
            and isinstance(node.func, ast.Subscript)
            and isinstance(node.func.value, ast.Name)
            and node.func.value.id.endswith("_kernel")
        ):
            found.append((node, parents))
        for child in ast.iter_child_nodes(node):
            walk(child, [*parents, node])

    walk(tree, [])
    return found


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
        f"line {call.lineno}: {call.func.value.id}"
        for call, parents in launches
        if not _inside_on_device(parents)
    ]
    assert not outside, f"{path.name}: launches outside `with on_device(...)`: {outside}"
    launchers = [n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name.startswith("launch_")]
    assert launchers, f"{path.name}: no launch_* function"
    for fn in launchers:
        assert _launches(fn), f"{path.name}: {fn.name} launches no kernel"


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
