"""The op contracts (``_checks.Contract``): each op's arguments are declared once, and that one
declaration agrees with the C entry point's pointer parameters (``_native.ABI``, checked against
abi.h in test_abi.py) and with the registered op's schema; plus the contract's own checks on
small cases (what the property tests exercise at scale through the ops)."""

from __future__ import annotations

import ctypes
import importlib
import pkgutil

import pytest
import torch

import lowcomm_kernels.ops as ops_pkg
from lowcomm_kernels import _checks, _native

# Entry points without a contract of their own: mask_perm's arguments are ints (mask_indices checks
# them), copy_nt is the benchmarks' memcpy, taylor_norms runs only inside outer_merge_, on the
# arguments outer_merge_'s contract checked.
NO_CONTRACT = {"lc_mask_perm", "lc_copy_nt", "lc_taylor_norms"}


def _contracts() -> dict[str, _checks.Contract]:
    found = {}
    for m in pkgutil.iter_modules(ops_pkg.__path__):
        mod = importlib.import_module(f"lowcomm_kernels.ops.{m.name}")
        for name, value in vars(mod).items():
            if isinstance(value, _checks.Contract):
                found[f"{m.name}.{name}"] = value
    return found


def _schemas() -> dict[str, list]:
    """Registered lowcomm op -> its schema's arguments."""
    out = {}
    for name in dir(torch.ops.lowcomm):
        packet = getattr(torch.ops.lowcomm, name)
        if hasattr(packet, "default"):
            out[name] = list(packet.default._schema.arguments)
    return out


def _tensors(args) -> set[str]:
    return {a.name for a in args if "Tensor" in str(a.type)}


CONTRACTS = _contracts()


def test_every_op_module_declares_its_contracts():
    assert len(CONTRACTS) >= 13, sorted(CONTRACTS)


@pytest.mark.parametrize("where", sorted(CONTRACTS))
def test_a_contract_names_its_entry_points_pointers(where):
    """Its buffers and the op's internal pointers are exactly the entry point's pointer parameters."""
    c = CONTRACTS[where]
    pointers = [p for p, t in _native.ABI[c.entry] if t is ctypes.c_void_p]
    names = [b.name for b in c.buffers]
    assert len(set(names)) == len(names), f"{where}: a buffer declared twice"
    assert not set(names) & set(c.internal), f"{where}: a buffer also declared internal"
    assert sorted(names + list(c.internal)) == sorted(pointers), f"{where} vs {c.entry}{pointers}"


@pytest.mark.parametrize("where", sorted(CONTRACTS))
def test_a_contract_is_its_registered_ops_arguments(where):
    """A registered op takes the contract's buffers (and, as None, only internal pointers besides),
    its optional buffers as optional tensors, and its scalars as floats and bools."""
    c = CONTRACTS[where]
    names = {b.name for b in c.buffers}
    matches = {
        op: args for op, args in _schemas().items() if names <= _tensors(args) <= names | set(c.internal)
    }
    assert matches, f"{where}: no registered op takes the tensors {sorted(names)}"
    for op, args in matches.items():
        kinds = {a.name: str(a.type) for a in args}
        for b in c.buffers:
            assert not b.optional or kinds[b.name] == "Optional[Tensor]", f"{op}.{b.name}"
        for a in c.args:
            if isinstance(a, _checks.Real):
                assert kinds.get(a.name) == "float", f"{op}.{a.name}"
            elif isinstance(a, _checks.Flag):
                assert kinds.get(a.name) == "bool", f"{op}.{a.name}"


def test_every_entry_point_and_op_has_a_contract():
    entries = {c.entry for c in CONTRACTS.values()}
    assert entries == set(_native.ABI) - NO_CONTRACT
    covered = {
        op
        for op, args in _schemas().items()
        for c in CONTRACTS.values()
        if {b.name for b in c.buffers} <= _tensors(args) <= {b.name for b in c.buffers} | set(c.internal)
    }
    assert covered == {op for op, args in _schemas().items() if _tensors(args)}


# ---- the contract's own checks ------------------------------------------------------------------

DEMO = _checks.Contract(
    "lc_pack",
    _checks.Buffer("g", _checks.FLOAT_DTYPES),
    _checks.Buffer("x", _checks.PARAM_DTYPES, params_of="g"),
    _checks.Buffer("delta", _checks.wire_of("g"), shown="delta_out"),
    _checks.Buffer("snapshot", _checks.like("g"), optional=True),
    _checks.Real("lr", lo=0.0),
    _checks.Flag("flag"),
    may_alias=[("g", "x")],
    internal=["nonfinite"],
)


def _ok(**kw):
    args = dict(g=torch.zeros(4), x=torch.zeros(4), delta=torch.zeros(4), snapshot=None, lr=1, flag=True)
    return {**args, **kw}


def test_good_arguments_pass_and_the_scalars_come_back_converted():
    assert DEMO.check(**_ok()) == {"lr": 1.0, "flag": True}
    g = torch.zeros(4)
    DEMO.check(**_ok(g=g, x=g))  # a declared may-alias pair
    DEMO.check(**_ok(x=torch.zeros(4, dtype=torch.bfloat16), delta=torch.zeros(4, dtype=torch.bfloat16)))


@pytest.mark.parametrize(
    "bad, exc, text",
    [
        (dict(g=torch.zeros(4, dtype=torch.int32)), TypeError, "^g has dtype int32; expected one of float32"),
        (dict(x=torch.zeros(4, dtype=torch.float64)), TypeError, "^x has dtype torch.float64 but g has"),
        (dict(delta=torch.zeros(5)), ValueError, "^delta_out has 5 elements"),
        (dict(delta=torch.zeros(8)[::2]), ValueError, "^delta_out must be contiguous"),
        (dict(snapshot=torch.zeros(4, dtype=torch.float64)), TypeError, "^snapshot has dtype float64"),
        (dict(snapshot=torch.zeros(4, device="meta")), ValueError, "^snapshot is a meta tensor"),
        (dict(delta=None), TypeError, "^delta_out must be a torch.Tensor"),
        (dict(lr=-1.0), ValueError, "^lr must be >= 0.0"),
        (dict(lr=float("nan")), ValueError, "^lr must be finite"),
        (dict(flag=1), TypeError, "^flag must be a bool"),
    ],
)
def test_a_bad_argument_is_named(bad, exc, text):
    with pytest.raises(exc, match=text):
        DEMO.check(**_ok(**bad))


def test_overlap_names_the_later_buffer_first_and_only_declared_pairs_may_alias():
    buf = torch.zeros(8)
    with pytest.raises(ValueError, match="^delta_out and g share memory"):
        DEMO.check(**_ok(g=buf[:4], delta=buf[2:6]))
    with pytest.raises(ValueError, match="^snapshot and x share memory"):
        DEMO.check(**_ok(x=buf[4:], snapshot=buf[4:]))
    DEMO.check(**_ok(g=buf[:4], delta=buf[4:]))  # adjacent is not overlapping


def test_the_fake_kernels_check_is_one_device():
    DEMO.same_device(g=torch.zeros(2), x=torch.zeros(2), delta=torch.zeros(2), snapshot=None)
    with pytest.raises(ValueError, match="^delta_out is on meta but g is on cpu"):
        DEMO.same_device(
            g=torch.zeros(2), x=torch.zeros(2), delta=torch.zeros(2, device="meta"), snapshot=None
        )


def test_a_malformed_contract_or_call_is_refused():
    with pytest.raises(TypeError, match="refers to no buffer"):
        _checks.Contract("lc_pack", _checks.Buffer("x", _checks.PARAM_DTYPES, params_of="g"))
    with pytest.raises(TypeError, match="may_alias names no buffer"):
        _checks.Contract("lc_pack", _checks.Buffer("g", _checks.FLOAT_DTYPES), may_alias=[("g", "h")])
    with pytest.raises(TypeError, match="cannot be optional"):
        _checks.Contract("lc_pack", _checks.Buffer("g", _checks.FLOAT_DTYPES, optional=True))
    with pytest.raises(TypeError, match="refers to an optional buffer"):
        _checks.Contract(
            "lc_pack",
            _checks.Buffer("g", _checks.FLOAT_DTYPES),
            _checks.Buffer("s", _checks.FLOAT_DTYPES, optional=True),
            _checks.Buffer("d", _checks.FLOAT_DTYPES, numel="s"),
        )
    with pytest.raises(TypeError, match="refers to an optional buffer"):  # a dtype rule too
        _checks.Contract(
            "lc_pack",
            _checks.Buffer("g", _checks.FLOAT_DTYPES),
            _checks.Buffer("s", _checks.FLOAT_DTYPES, optional=True),
            _checks.Buffer("d", _checks.like("s")),
        )
    with pytest.raises(TypeError, match="refers to a buffer declared after it"):
        _checks.Contract(
            "lc_pack",
            _checks.Buffer("g", _checks.FLOAT_DTYPES),
            _checks.Buffer("d", _checks.like("s")),
            _checks.Buffer("s", _checks.FLOAT_DTYPES),
        )
    with pytest.raises(TypeError, match="declared twice"):
        _checks.Contract("lc_pack", _checks.Buffer("g", _checks.FLOAT_DTYPES), _checks.Real("g"))
    with pytest.raises(TypeError, match="the contract's arguments are"):
        DEMO.check(g=torch.zeros(4))


def test_errors_use_the_public_functions_names():
    from lowcomm_kernels.ops import dequantize, quantize, topk_encode

    with pytest.raises(ValueError, match="^payload_out has 3 bytes"):
        topk_encode(
            torch.zeros(64), torch.zeros(64), k=4, chunk=32, payload_out=torch.zeros(3, dtype=torch.uint8)
        )
    codes, scales = quantize(torch.zeros(8), "int8", 4)
    with pytest.raises(ValueError, match="^codes is a meta tensor"):  # not the out it would make there
        dequantize(codes.to("meta"), scales.to("meta"), "int8", 4, 8)


def test_pack_quantized_takes_x_aliasing_g_as_documented():
    """x may alias g (both are only read): e = 0, so every code and the residual are zero."""
    from lowcomm_kernels.ops import pack_quantized

    g = torch.randn(64, dtype=torch.float32)
    residual = torch.zeros(64)
    codes, scales, _, nonfinite = pack_quantized(g, g, "int8", 32, residual=residual, snapshot_out=False)
    assert not codes.any() and int(nonfinite) == 0 and not residual.any()
    with pytest.raises(ValueError, match="^residual and g share memory"):
        pack_quantized(g, g.clone(), "int8", 32, residual=g)
