"""The op contract restated for the property tests (test_properties*.py): which arguments a call
violates (predicted independently of the ops' own checks), and the outcome check: a documented
ValueError/TypeError naming a violated argument with no byte of any buffer written, or success when
nothing was violated. Plus the shared hypothesis strategies and settings."""

from __future__ import annotations

import math
import re

import torch
from hypothesis import HealthCheck, event, settings
from hypothesis import strategies as st

SETTINGS = settings(
    max_examples=150,
    derandomize=True,
    database=None,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
FLOATS = (torch.float32, torch.float64)
PARAMS = (*FLOATS, torch.bfloat16, torch.float16)  # what x may be (bf16 / fp16 with a float32 master)
NAN, INF = float("nan"), float("inf")


# ---- the contract, restated -----------------------------------------------------------------


def tensor_violations(name, t, dtypes, *, dim=None):
    if not isinstance(t, torch.Tensor):
        return [(name, TypeError)]
    v = []
    if t.dtype not in dtypes:
        v.append((name, TypeError))
    if dim is not None and t.dim() != dim:
        v.append((name, ValueError))
    if not t.is_contiguous():
        v.append((name, ValueError))
    return v


def extent(t: torch.Tensor) -> tuple[int, int]:
    last = sum((s - 1) * st_ for s, st_ in zip(t.shape, t.stride(), strict=True))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def overlaps(a, b) -> bool:
    if not (isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)) or a.numel() == 0 or b.numel() == 0:
        return False
    (a0, a1), (b0, b1) = extent(a), extent(b)
    return a0 < b1 and b0 < a1


def alias_violations(named: dict) -> list:
    items = [(k, t) for k, t in named.items() if isinstance(t, torch.Tensor)]
    out = []
    for i, (an, a) in enumerate(items):
        for bn, b in items[i + 1 :]:
            if overlaps(a, b):
                out += [(an, ValueError), (bn, ValueError)]
    return out


def scalar_violations(name, value, lo=None, hi=None, hi_open=False):
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return [(name, TypeError)]
    v = float(value)
    if (
        not math.isfinite(v)
        or (lo is not None and v < lo)
        or (hi is not None and (v > hi or (hi_open and v == hi)))
    ):
        return [(name, ValueError)]
    return []


def storage_bytes(t: torch.Tensor) -> torch.Tensor:
    return torch.empty(0, dtype=torch.uint8).set_(t.untyped_storage()).clone()


def outcome(call, violations, buffers):
    """Run `call`; on a documented error check the name and that nothing was written and return
    None; on success check that nothing was predicted invalid and return the result."""
    live = [b for b in buffers if isinstance(b, torch.Tensor)]
    before = [storage_bytes(b) for b in live]
    try:
        result = call()
    except (ValueError, TypeError) as e:
        msg = str(e)
        event(f"rejected: {type(e).__name__} {msg.split()[0]}")
        assert violations, f"a valid call raised {type(e).__name__}: {msg}"
        assert any(
            isinstance(e, exc) and re.match(rf"{re.escape(name)}\b", msg) for name, exc in violations
        ), f"{type(e).__name__}({msg!r}) does not name one of the violations {violations}"
        for b, bb in zip(live, before, strict=True):
            assert torch.equal(storage_bytes(b), bb), f"a rejected call wrote a buffer ({msg})"
        return None
    assert not violations, f"accepted invalid input, expected one of {violations}"
    event("valid: matched the ref")
    return ("ok", result)


# ---- the bf16 wire: torch's rounding, and the NaN each backend claims ---------------------------


def bf16_nan_claim(backend: str, device: torch.device | str) -> int | str | None:
    """The bits a backend claims to write for a NaN on the bf16 wire: one pattern (an int) for
    every NaN, "torch" (whatever torch's own conversion writes on that device, element for
    element), or None (only NaN-ness is claimed).

    torch itself writes 0x7FFF on CUDA sm_80+ (c10 uses cvt.rn.bf16.f32 there) and 0x7FC0 on older
    GPUs; on the CPU its vectorised conversion writes 0xFFFF and its scalar loop tails 0x7FC0, so
    no single pattern is "torch's" there and the ref claims none."""
    if torch.device(device).type == "cuda":
        # triton: the hardware's cvt (sm_80+) or c10's formula, as torch picks; cuda: csrc's
        # __float2bfloat16_rn, torch's on sm_80+
        return {"triton": "torch", "ref": "torch", "cuda": "torch"}.get(backend)
    # triton: the interpreter, c10's round_to_nearest_even; cpu: csrc's host LC_BF16_NAN
    return {"triton": 0x7FC0, "cpu": 0xFFFF}.get(backend)


def nan_payloads(dtype: torch.dtype) -> torch.Tensor:
    """NaNs of `dtype` with different signs and payloads: quiet, negative, signalling, all ones."""
    if dtype == torch.float64:
        bits = [0x7FF8000000000000, -0x0008000000000000, 0x7FF0000000000001, 0x7FFFFFFFFFFFFFFF]
        return torch.tensor(bits, dtype=torch.int64).view(torch.float64)
    bits = [0x7FC00000, -0x00400000, 0x7F800001, 0x7FFFFFFF]  # -0x00400000 is 0xFFC00000
    return torch.tensor(bits, dtype=torch.int32).view(torch.float32).to(dtype)


def assert_bf16_wire(actual: torch.Tensor, expected: torch.Tensor, backend: str, msg: str = "") -> None:
    """`actual` (bf16) is torch's conversion `expected` bit for bit wherever that is not NaN, NaN
    exactly where it is NaN, and every NaN has the bits `backend` claims (``bf16_nan_claim``)."""
    assert actual.dtype == expected.dtype == torch.bfloat16, f"{msg}: {actual.dtype}, {expected.dtype}"
    a = actual.reshape(-1).clone(memory_format=torch.contiguous_format).view(torch.int16)
    e = expected.reshape(-1).clone(memory_format=torch.contiguous_format).view(torch.int16)
    nan = torch.isnan(expected.reshape(-1))
    assert torch.equal(torch.isnan(actual.reshape(-1)), nan), f"{msg}: NaN in other places than torch's"
    assert torch.equal(a[~nan], e[~nan]), f"{msg}: not torch's round-to-nearest-even"
    claim = bf16_nan_claim(backend, actual.device)
    if claim == "torch":
        assert torch.equal(a[nan], e[nan]), f"{msg}: NaN bits differ from torch's on {actual.device}"
    elif claim is not None:
        found = sorted({v & 0xFFFF for v in a[nan].tolist()})
        assert found in ([], [claim]), (
            f"{msg}: {backend} on {actual.device} claims NaN = {claim:#06x}, wrote {[hex(v) for v in found]}"
        )


# ---- strategies ---------------------------------------------------------------------------------


def data(
    seed: int, n: int, dtype: torch.dtype, layout: str = "contiguous", scale: float = 1.0
) -> torch.Tensor:
    """n values of `dtype`: "contiguous"; "offset", a contiguous view at storage offset 1 (misaligned
    for SIMD); "strided", a stride-2 view; "transposed", a transposed 2-D view (the last two are
    non-contiguous once n >= 2, resp. n >= 4 and even)."""
    gen = torch.Generator().manual_seed(seed)
    if dtype in (torch.int64, torch.int32):
        base = torch.randint(-5, 5, (2 * n,), generator=gen, dtype=dtype)
    else:
        base = (scale * torch.randn(2 * n, generator=gen, dtype=torch.float64)).to(dtype)
    if layout == "strided":
        return base[::2]
    if layout == "offset":
        return base[1 : n + 1]
    if layout == "transposed" and n % 2 == 0:
        return base[:n].view(2, n // 2).t()
    return base[:n].clone()


def scalar(lo: float, hi: float, *, bad: tuple = ()) -> st.SearchStrategy:
    return st.one_of(
        st.floats(lo, hi),
        st.floats(lo, hi),
        st.sampled_from([lo, hi, NAN, INF, -INF, *bad]),
        st.sampled_from([int(lo), "0.5", None, True]),
    )


sizes = st.one_of(st.sampled_from([0, 1, 2, 7]), st.integers(0, 300))
float_dtype = st.sampled_from(FLOATS)
any_dtype = st.sampled_from(
    [torch.float32, torch.float64, torch.float32, torch.float64, torch.bfloat16, torch.float16, torch.int64]
)
layouts = st.sampled_from(["contiguous"] * 4 + ["offset"] * 2 + ["strided", "transposed"])
seeds = st.integers(0, 2**31)
#: what every indexed-op property test draws first: a size, a data seed, a dtype and a layout
DATA = dict(n=sizes, seed=seeds, dtype=any_dtype, layout=layouts)


def contiguous_layout(layout: str) -> bool:
    return layout in ("contiguous", "offset")


def cleaned(clean: bool, value, good, bad_when=None):
    """In a `clean` example every knob takes a valid value, so about half the examples exercise the
    numerical path; otherwise the drawn (possibly invalid) value stands."""
    if not clean:
        return value
    if bad_when is None:
        return good
    return good if bad_when(value) else value


def close_enough(a, b, dtype, scale=8.0, extra_rtol=0.0):
    eps = torch.finfo(dtype).eps
    rtol = 8 * eps + extra_rtol
    torch.testing.assert_close(a, b, rtol=rtol, atol=scale * rtol, equal_nan=True)
