"""Input validation shared by every op. Each check names the offending argument and runs
before anything is written, so a rejected call leaves every buffer untouched.

Each op declares its tensor and scalar arguments once, in a ``Contract`` (dtype rules, sizes,
optional buffers, which pairs may share memory), keyed by name to its C entry point's pointer
parameters; the op's body checks a call with it, and the few checks a contract cannot say (index
entries, a format's wire sizes) after it.

Most checks need real data (pointers, index values, concrete scalars), so they run in eager calls
and in the body of each registered op, never on the fake tensors of a torch.compile trace; the
fake kernels use only ``Contract.same_device`` (see ``ops._common``).

Metadata checks (dtype, device, shape, strides, aliasing: pointers, not data) cost no device
access. Value checks of device data (``index_values``, fragment_norms' offsets) read the data
on the host, which on a GPU waits for every queued kernel: the ops that have them take
``check_values=False`` for internal callers that produced the values themselves."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from dataclasses import dataclass

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


def index_values(name: str, idx: torch.Tensor, *, n: int, strictly_increasing: bool) -> None:
    """Every entry of the (checked: 1-D int64) index list in [0, n); with `strictly_increasing`,
    sorted and unique. Reads idx on the host: a device synchronisation on a GPU, which is why the
    ops that take an index list check its entries only when their ``check_values`` is True."""
    if not idx.numel():
        return
    if strictly_increasing:
        if idx.numel() > 1 and not bool((idx[1:] > idx[:-1]).all()):
            raise ValueError(
                f"{name} must be strictly increasing (sorted, no duplicates), as mask_indices returns it"
            )
        lo, hi = int(idx[0]), int(idx[-1])  # sorted: the ends are the extremes (one pass, not three)
    else:
        lo, hi = (int(v) for v in torch.aminmax(idx))
    if lo < 0 or hi >= n:
        raise ValueError(f"{name} has entries outside [0, {n}): min {lo}, max {hi}")


# ---- an op's arguments, declared once ---------------------------------------------------------------


@dataclass(frozen=True)
class Relative:
    """A dtype rule relative to another buffer, declared (and so checked) before this one: the
    dtypes `rule` makes of that buffer's dtype."""

    ref: str
    rule: Callable[[torch.dtype], tuple[torch.dtype, ...]]

    def __call__(self, seen: dict[str, torch.Tensor]) -> tuple[torch.dtype, ...]:
        return self.rule(seen[self.ref].dtype)


#: A buffer's dtype rule: the dtypes it may have, or ones relative to another buffer.
DtypeRule = tuple[torch.dtype, ...] | Relative
_FIRST = "<the first buffer>"


def like(ref: str) -> Relative:
    """The dtype of buffer `ref`."""
    return Relative(ref, lambda d: (d,))


def master_of(ref: str) -> Relative:
    """The outer state's dtype for parameters like `ref` (``master_dtype``)."""
    return Relative(ref, lambda d: (master_dtype(d),))


def wire_of(ref: str) -> Relative:
    """What a wire buffer may hold for data like `ref`: the master dtype or a narrow wire dtype."""
    return Relative(ref, lambda d: wire_dtypes(master_dtype(d)))


@dataclass(frozen=True)
class Buffer:
    """One tensor argument of an op. `name`: the op's (its schema's and abi.h's) name for it;
    `shown`: the name its errors use when the public function calls it otherwise. `numel`: the
    buffer whose element count it has (default the contract's first buffer), or None when the op
    checks its size itself (index lists, wire codes). `params_of`: it holds parameters whose outer
    state is that buffer (``params_of``)."""

    name: str
    dtypes: DtypeRule
    shown: str = ""
    optional: bool = False
    numel: str | None = _FIRST
    dim: int | None = None
    params_of: str | None = None

    @property
    def label(self) -> str:
        return self.shown or self.name


@dataclass(frozen=True)
class Real:
    """A finite real-number argument in a range (``scalar``)."""

    name: str
    lo: float | None = None
    hi: float | None = None
    hi_open: bool = False


@dataclass(frozen=True)
class Flag:
    """A bool argument (``flag``)."""

    name: str


class Contract:
    """The tensor and scalar arguments of one op, written once: what its body checks (in the
    declared order, before anything is written: dtype, dimensions, contiguity, device, size, then
    that no two buffers overlap except the `may_alias` pairs), what its fake kernel checks (one
    device), and, by name, the pointer parameters of its C entry point ``entry`` in
    ``_native.ABI`` (less `internal`: outputs the op allocates itself, or pointers it passes as
    NULL). A test holds each contract to abi.h and to the registered op's schema. Checks a
    contract cannot say (index entries, wire sizes of a format, a buffer required by a scalar's
    value) stay with the op, after ``check``."""

    def __init__(
        self,
        entry: str,
        *args: Buffer | Real | Flag,
        may_alias: Iterable[tuple[str, str]] = (),
        internal: Iterable[str] = (),
    ) -> None:
        self.entry = entry
        self.args = args
        self.buffers = tuple(a for a in args if isinstance(a, Buffer))
        self.may_alias = {frozenset(p) for p in may_alias}
        self.internal = tuple(internal)
        self._names = frozenset(a.name for a in args)
        if len(self._names) != len(args):
            raise TypeError(f"{entry}: an argument is declared twice")
        self._labels = {b.name: b.label for b in self.buffers}
        first = self.buffers[0]
        if first.optional:
            raise TypeError(
                f"{entry}: the first buffer ({first.name}) is the reference; it cannot be optional"
            )
        optional = {b.name for b in self.buffers if b.optional}
        before: set[str] = set()  # a buffer's rules refer only to buffers checked before it, never a None
        for b in self.buffers:
            refs = {b.numel, b.params_of} - {None, _FIRST}
            if isinstance(b.dtypes, Relative):
                refs.add(b.dtypes.ref)
            if refs - set(self._labels):
                raise TypeError(f"{entry}: {b.name} refers to no buffer {sorted(refs - set(self._labels))}")
            if refs - before:
                raise TypeError(
                    f"{entry}: {b.name} refers to a buffer declared after it {sorted(refs - before)}"
                )
            if refs & optional:
                raise TypeError(f"{entry}: {b.name} refers to an optional buffer {sorted(refs & optional)}")
            before.add(b.name)
        if any(set(p) - set(self._labels) for p in self.may_alias):
            raise TypeError(f"{entry}: may_alias names no buffer")
        # the size reference of each buffer, resolved once (checks run once per fragment per sync)
        self._numel_ref = {}
        for b in self.buffers:
            ref = first.name if b.numel == _FIRST else b.numel
            if ref is not None and ref != b.name:
                self._numel_ref[b.name] = ref

    def check(self, **values: object) -> dict[str, float | bool]:
        """Check one call's arguments (every declared one, by name; a missing optional buffer is
        None). Returns the scalars, as floats and bools."""
        if values.keys() != self._names:
            raise TypeError(f"{self.entry}: the contract's arguments are {[a.name for a in self.args]}")
        labels = self._labels
        first = self.buffers[0].name
        seen: dict[str, torch.Tensor] = {}
        scalars: dict[str, float | bool] = {}
        for a in self.args:
            v = values[a.name]
            if isinstance(a, Real):
                scalars[a.name] = scalar(a.name, v, lo=a.lo, hi=a.hi, hi_open=a.hi_open)
            elif isinstance(a, Flag):
                scalars[a.name] = flag(a.name, v)
            elif v is not None or not a.optional:
                dtypes = a.dtypes(seen) if isinstance(a.dtypes, Relative) else a.dtypes
                t = tensor(a.label, v, dtypes=dtypes, dim=a.dim)
                if a.params_of:
                    params_of(a.label, t, labels[a.params_of], seen[a.params_of])
                if seen and t.device != seen[first].device:
                    same_device(labels[first], seen[first], **{a.label: t})
                ref = self._numel_ref.get(a.name)
                if ref is not None and t.numel() != seen[ref].numel():
                    same_numel(labels[ref], seen[ref], **{a.label: t})
                seen[a.name] = t
        self._no_overlap(seen)
        return scalars

    def same_device(self, **tensors: torch.Tensor | None) -> None:
        """The fake kernel's one check (see ``ops._common``): every buffer on one device."""
        first = self.buffers[0]
        same_device(first.label, tensors[first.name], **{b.label: tensors[b.name] for b in self.buffers[1:]})

    def _no_overlap(self, seen: dict[str, torch.Tensor]) -> None:
        # each buffer against those declared before it; the error names it first
        spans = [(n, t.device, *_span(t)) for n, t in seen.items() if t.numel()]
        for i, (bn, bd, b0, b1) in enumerate(spans):
            for an, ad, a0, a1 in spans[:i]:
                if a0 < b1 and b0 < a1 and ad == bd and frozenset((an, bn)) not in self.may_alias:
                    b_name, a_name = self._labels[bn], self._labels[an]
                    raise ValueError(f"{b_name} and {a_name} share memory; they must be distinct buffers")
