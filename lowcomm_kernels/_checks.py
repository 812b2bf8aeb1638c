"""Input validation shared by every op. Each check names the offending argument and runs
before anything is written, so a rejected call leaves every buffer untouched.

Most checks need real data (pointers, index values, concrete scalars), so they run in eager calls
and in the body of each registered op, never on the fake tensors of a torch.compile trace; the
fake kernels use only ``same_device`` (see ``ops._common``).

Metadata checks (dtype, device, shape, strides, aliasing: pointers, not data) cost no device
access. Value checks of device data (``index``'s entries, fragment_norms' offsets) read the data
on the host, which on a GPU waits for every queued kernel: the ops that have them take
``check_values=False`` for internal callers that produced the values themselves."""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from . import wire_formats

FLOAT_DTYPES = (torch.float32, torch.float64)
#: Parameter dtypes stored below the compute precision. Their outer state (g, u, snapshots: the
#: master copy) is float32, the ops compute in float32 and round x to nearest even once on write.
LOW_PRECISION_DTYPES = (torch.bfloat16, torch.float16)
#: Every dtype the parameters x may have.
PARAM_DTYPES = FLOAT_DTYPES + LOW_PRECISION_DTYPES
#: What a buffer that crosses the network (pack's delta, outer_merge_'s delta_avg, the scatter's
#: avg) may hold besides the data's own dtype: the narrow dense formats of ``wire_formats.TABLE``.
#: Another one is a row there, a dtype code in ``_native.DTYPE_CODE``, and the kernels' support.
NARROW_WIRE_DTYPES = wire_formats.NARROW_DTYPES


def wire_dtypes(dtype: torch.dtype) -> tuple[torch.dtype, ...]:
    """The dtypes a wire buffer may have for data of `dtype`."""
    return (dtype, *NARROW_WIRE_DTYPES)


def master_dtype(param_dtype: torch.dtype) -> torch.dtype:
    """The dtype of the outer state (g, u, snapshots) and of the arithmetic for parameters of
    `param_dtype`: float32 for bf16 / fp16 parameters, the parameters' own dtype otherwise."""
    return torch.float32 if param_dtype in LOW_PRECISION_DTYPES else param_dtype


def params_of(x_name: str, x: torch.Tensor, g_name: str, g: torch.Tensor) -> None:
    """x (parameters) goes with g (their outer state): x has g's dtype, or is bf16 / fp16 with a
    float32 g (``master_dtype``). Otherwise a TypeError naming x."""
    if x.dtype == g.dtype or (x.dtype in LOW_PRECISION_DTYPES and g.dtype == master_dtype(x.dtype)):
        return
    low = " or ".join(str(d) for d in LOW_PRECISION_DTYPES)
    also = f" ({low} parameters need a float32 {g_name})" if x.dtype in LOW_PRECISION_DTYPES else ""
    raise TypeError(f"{x_name} has dtype {x.dtype} but {g_name} has {g.dtype}; expected {g.dtype}{also}")


def is_tensor(name: str, t: object) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return t


def tensor(
    name: str,
    t: object,
    *,
    dtypes: Iterable[torch.dtype] | None = None,
    contiguous: bool = True,
    dim: int | None = None,
) -> torch.Tensor:
    is_tensor(name, t)
    if dtypes is not None:
        dtypes = tuple(dtypes)
        if t.dtype not in dtypes:
            names = ", ".join(str(d).replace("torch.", "") for d in dtypes)
            raise TypeError(f"{name} has dtype {str(t.dtype).replace('torch.', '')}; expected one of {names}")
    if dim is not None and t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-dimensional, got shape {tuple(t.shape)}")
    if contiguous and not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous (got strides {t.stride()}); call .contiguous() first")
    if t.device.type == "meta":
        raise ValueError(
            f"{name} is a meta tensor: meta tensors have no data, so the op cannot read or "
            "write it; pass a tensor on a real device"
        )
    return t


def same_device(ref_name: str, ref: torch.Tensor, **others: torch.Tensor | None) -> None:
    for name, t in others.items():
        if t is not None and t.device != ref.device:
            raise ValueError(f"{name} is on {t.device} but {ref_name} is on {ref.device}")


def same_numel(ref_name: str, ref: torch.Tensor, **others: torch.Tensor | None) -> None:
    for name, t in others.items():
        if t is not None and t.numel() != ref.numel():
            raise ValueError(
                f"{name} has {t.numel()} elements (shape {tuple(t.shape)}) but {ref_name} has "
                f"{ref.numel()} (shape {tuple(ref.shape)})"
            )


def same_dtype(ref_name: str, ref: torch.Tensor, **others: torch.Tensor | None) -> None:
    for name, t in others.items():
        if t is not None and t.dtype != ref.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but {ref_name} has {ref.dtype}")


def _span(t: torch.Tensor) -> tuple[int, int]:
    if t.numel() == 0:
        return (0, 0)
    start = t.data_ptr()
    return start, start + t.numel() * t.element_size()


def overlaps(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.device != b.device or a.numel() == 0 or b.numel() == 0:
        return False
    a0, a1 = _span(a)
    b0, b1 = _span(b)
    return a0 < b1 and b0 < a1


def no_alias(pairs: Iterable[tuple[str, torch.Tensor | None, str, torch.Tensor | None]]) -> None:
    """Reject any pair of (name, tensor) whose memory overlaps."""
    for an, a, bn, b in pairs:
        if a is not None and b is not None and overlaps(a, b):
            raise ValueError(f"{an} and {bn} share memory; they must be distinct buffers")


def distinct(named: dict[str, torch.Tensor | None]) -> None:
    items = [(n, t) for n, t in named.items() if t is not None]
    no_alias((an, a, bn, b) for i, (an, a) in enumerate(items) for bn, b in items[i + 1 :])


def flag(name: str, value: object) -> bool:
    if not isinstance(value, bool):
        raise TypeError(f"{name} must be a bool, got {type(value).__name__}")
    return value


def scalar(
    name: str,
    value: object,
    *,
    lo: float | None = None,
    hi: float | None = None,
    lo_open: bool = False,
    hi_open: bool = False,
) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise TypeError(f"{name} must be a real number, got {type(value).__name__}")
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {v}")
    if lo is not None and (v < lo or (lo_open and v == lo)):
        raise ValueError(f"{name} must be {'>' if lo_open else '>='} {lo}, got {v}")
    if hi is not None and (v > hi or (hi_open and v == hi)):
        raise ValueError(f"{name} must be {'<' if hi_open else '<='} {hi}, got {v}")
    return v


def integer(name: str, value: object, *, lo: int | None = None, hi: int | None = None, why: str = "") -> int:
    """An int (or a 1-element integer tensor) in [lo, hi]; `why` explains the range in the error."""
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, torch.Tensor) and value.numel() == 1 and not value.is_floating_point():
            value = int(value.item())
        else:
            raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if (lo is not None and value < lo) or (hi is not None and value > hi):
        bound = (
            f"in [{lo}, {hi}]"
            if lo is not None and hi is not None
            else (f">= {lo}" if lo is not None else f"<= {hi}")
        )
        # int(): a symbolic int (torch.compile) cannot be formatted while tracing
        raise ValueError(f"{name} must be {bound}{why}, got {int(value)}")
    return int(value)


def index(
    name: str,
    idx: object,
    *,
    n: int,
    device: torch.device,
    strictly_increasing: bool,
    check_values: bool = True,
) -> torch.Tensor:
    """idx: 1-D contiguous int64 on `device`, every entry in [0, n); optionally sorted and unique.

    The entries are checked only with `check_values` (it reads idx on the host: a device
    synchronisation on a GPU); the metadata always."""
    t = tensor(name, idx, dtypes=(torch.int64,), dim=1)
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but the data is on {device}")
    if check_values and t.numel():
        if strictly_increasing:
            if t.numel() > 1 and not bool((t[1:] > t[:-1]).all()):
                raise ValueError(
                    f"{name} must be strictly increasing (sorted, no duplicates), as mask_indices returns it"
                )
            lo, hi = int(t[0]), int(t[-1])  # sorted: the ends are the extremes (one pass, not three)
        else:
            lo, hi = (int(v) for v in torch.aminmax(t))
        if lo < 0 or hi >= n:
            raise ValueError(f"{name} has entries outside [0, {n}): min {lo}, max {hi}")
    return t
