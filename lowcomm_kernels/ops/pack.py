"""pack: the send side of a dense fragment sync, in one pass over memory.

    delta    = g - x          written in the wire dtype (fp32, fp64 or bf16, round-to-nearest-even)
    snapshot = x              (x_sent, kept for the delay-corrected merge; optional; g's dtype)

x may be bf16 / fp16 with its float32 master g: g − x is then formed in float32 from x widened
exactly (docs/algorithms.md, "Low-precision parameters").
    nonfinite = #{i : delta[i] is not finite}   (of the value written, 0-d int64)

Reads g, x; writes delta (+ snapshot). Bytes: n*(2*s + s_wire [+ s]) for element size s.
"""

from __future__ import annotations

import torch

from .. import _checks, _dispatch
from ..profiling import nvtx_range
from ._common import code, compiling, declare, launch, launcher, native, traced_call, triton


def pack_ref(
    g: torch.Tensor, x: torch.Tensor, *, wire_dtype: torch.dtype | None = None, snapshot: bool = True
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The specification, in plain torch (float64-capable): (delta, snapshot or None, nonfinite),
    all newly allocated; delta has g's shape, the snapshot is a contiguous copy of x in g's dtype.
    A bf16 / fp16 x (with its float32 master g) is widened exactly: torch's type promotion forms
    g − x in float32, rounded once to the wire dtype."""
    # Flat, like every op: g and x need only the same number of elements.
    delta = (g.reshape(-1) - x.reshape(-1)).to(wire_dtype or g.dtype).reshape(g.shape)
    nonfinite = (~torch.isfinite(delta)).sum(dtype=torch.int64)
    snap = x.to(g.dtype, memory_format=torch.contiguous_format, copy=True) if snapshot else None
    return delta, snap, nonfinite


# ---- launchers (n >= 1, checked arguments): fill delta (and snapshot), and leave the non-finite
# count in `nonfinite`, a zeroed 0-d int64 (the Triton kernel adds into it).


@launcher("pack", "ref")
def _(g, x, delta, snapshot, nonfinite):
    d, _, nf = pack_ref(g, x, wire_dtype=delta.dtype, snapshot=False)  # temporaries: the spec as written
    delta.view(-1).copy_(d.view(-1))
    if snapshot is not None:
        snapshot.view(-1).copy_(x.view(-1))
    nonfinite.copy_(nf)


# dtype: the parameters' (x's); g's is implied (abi.h)
native("pack", "lc_pack", dtype=("x", code), wire_dtype=("delta", code), n=("g", torch.Tensor.numel))
triton("pack", "pack", "launch_pack")


#: pack's arguments: g and x may alias each other (delta = 0); the outputs alias nothing.
CONTRACT = _checks.Contract(
    "lc_pack",
    _checks.Buffer("g", _checks.FLOAT_DTYPES),
    _checks.Buffer("x", _checks.PARAM_DTYPES, params_of="g"),
    _checks.Buffer("delta", _checks.wire_of("g"), shown="delta_out"),
    _checks.Buffer("snapshot", _checks.like("g"), shown="snapshot_out", optional=True),
    may_alias=[("g", "x")],
    internal=["nonfinite"],
)


def _pack_impl(
    g: torch.Tensor, x: torch.Tensor, delta: torch.Tensor, snapshot: torch.Tensor | None, backend: str | None
) -> torch.Tensor:
    """Check, choose the backend, launch: the registered op's body, and the eager path of pack.
    Returns the 0-d int64 non-finite count (the one tensor allocated here)."""
    CONTRACT.check(g=g, x=x, delta=delta, snapshot=snapshot)
    b = _dispatch.resolve(backend, g.device, "lc_pack")
    nonfinite = torch.zeros((), dtype=torch.int64, device=g.device)
    if g.numel():
        with nvtx_range("pack"):
            launch("pack", b, g, x, delta, snapshot, nonfinite)
    return nonfinite


_pack_op = torch.library.custom_op("lowcomm::pack", _pack_impl, mutates_args=("delta", "snapshot"))


@_pack_op.register_fake
def _(g, x, delta, snapshot, backend):
    CONTRACT.same_device(g=g, x=x, delta=delta, snapshot=snapshot)  # see _common
    return g.new_empty((), dtype=torch.int64)


declare("pack")


@torch.no_grad()  # optimizer-style updates: parameters that require grad are fine
def pack(
    g: torch.Tensor,
    x: torch.Tensor,
    *,
    wire_dtype: torch.dtype | None = None,
    delta_out: torch.Tensor | None = None,
    snapshot_out: torch.Tensor | None | bool = None,
    backend: str | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """Pseudo-gradient and snapshot of one fragment, fused: ``delta = g − x`` rounded once to the wire
    dtype, ``snapshot = x``, and the count of non-finite values written to delta.

    Args:
        g: global parameters, fp32/fp64, any shape, contiguous. Read only.
        x: local parameters, same numel/device as g, contiguous: g's dtype (then it may alias g), or
            bf16 / fp16 with a float32 g (its master copy). Read only.
        wire_dtype: dtype of delta (g.dtype, or bfloat16). Defaults to delta_out's dtype or g.dtype.
        delta_out: optional preallocated delta (same numel as g, wire dtype, contiguous); must not
            alias g, x or the snapshot. Written.
        snapshot_out: a preallocated snapshot buffer (same numel as x, g's dtype, contiguous, aliasing
            nothing; written), None to allocate one, or False to skip it.
        backend: 'ref' | 'cpu' | 'triton' | 'cuda' (default by device, see ``_dispatch``).
    Returns:
        (delta, snapshot or None, nonfinite): delta_out (or a new tensor of g's shape), the snapshot
        buffer, and nonfinite, a new 0-d int64 tensor on g's device.
    Raises:
        TypeError / ValueError naming the argument, before anything is written.
    """
    # What the outputs are made from is checked here, in eager and compiled calls alike; the rest
    # in _check, on the real data (see _common).
    _checks.is_tensor("g", g)
    _checks.is_tensor("x", x)
    if wire_dtype is None:
        wire_dtype = delta_out.dtype if isinstance(delta_out, torch.Tensor) else g.dtype
    if wire_dtype not in _checks.wire_dtypes(g.dtype):
        narrow = " or ".join(str(d) for d in _checks.NARROW_WIRE_DTYPES)
        raise TypeError(f"wire_dtype must be g's dtype ({g.dtype}) or {narrow}, got {wire_dtype}")
    if delta_out is None:
        delta_out = torch.empty(g.shape, dtype=wire_dtype, device=g.device)
    elif _checks.is_tensor("delta_out", delta_out).dtype != wire_dtype:
        raise TypeError(f"delta_out has dtype {delta_out.dtype}; expected the wire dtype {wire_dtype}")
    if snapshot_out is False:
        snapshot = None
    elif snapshot_out is None or snapshot_out is True:
        # contiguous, whatever x's strides; the master's dtype (float32 for a bf16 / fp16 x)
        snapshot = torch.empty(x.shape, dtype=_checks.master_dtype(x.dtype), device=x.device)
    else:
        snapshot = _checks.is_tensor("snapshot_out", snapshot_out)
    if compiling():
        nonfinite = traced_call("pack", g, x, delta_out, snapshot, backend)
    else:
        nonfinite = _pack_impl(g, x, delta_out, snapshot, backend)
    return delta_out, snapshot, nonfinite
