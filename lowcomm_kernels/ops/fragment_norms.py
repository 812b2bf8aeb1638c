"""fragment_norms: one norm per segment of a flat buffer, in one launch.

    out[i] = ‖buf[offsets[i] : offsets[i+1]]‖_ord,   ord ∈ {1, 2}

Used to rank fragments (CoCoDC's R_p = ‖Δ̄_p‖₂ / I_p, or the L1 score of the reference code).
Accumulates in float64 in a fixed order (fixed-size blocks, partials summed in block order), so
the result is bit-identical from call to call whatever the thread count. Output dtype = buf's.
Reads buf once: n*s bytes.
"""

from __future__ import annotations

import torch

from .. import _checks, _dispatch
from ..profiling import nvtx_range
from ._common import code, compiling, declare, launch, launcher, native, traced_call, triton

ORDS = (1, 2)


_BLOCK = 8192  # the fixed reduction order: per-block sums, then the block sums in order


def _fixed_order_sum(v: torch.Tensor) -> torch.Tensor:
    """Σ v in float64 in an order that depends only on len(v), not on the thread count (torch's own
    reductions split by threads: ord-1 vector_norm differs between 1 and 2 threads)."""
    blocks = torch.nn.functional.pad(v, (0, -v.numel() % _BLOCK)).view(-1, _BLOCK).sum(dim=1)
    return blocks.cumsum(0)[-1] if blocks.numel() else v.new_zeros(())


def _norms_f64(buf: torch.Tensor, offsets: torch.Tensor, ord: int) -> torch.Tensor:
    """The K norms in float64, before the one rounding to buf's dtype."""
    flat = buf.reshape(-1).double()
    bounds = offsets.tolist()
    seg = [flat[a:b] for a, b in zip(bounds[:-1], bounds[1:], strict=False)]
    norms = [_fixed_order_sum(s.abs()) if ord == 1 else _fixed_order_sum(s * s).sqrt() for s in seg]
    return torch.stack(norms) if norms else flat.new_empty(0)


def fragment_norms_ref(buf: torch.Tensor, offsets: torch.Tensor, *, ord: int = 2) -> torch.Tensor:
    """The specification of fragment_norms, in plain torch: a new (K,) tensor of buf's dtype."""
    return _norms_f64(buf, offsets, ord).to(buf.dtype)


# ---- launchers (K >= 1, checked arguments): the K norms in float64 into `acc` (K,) ----------------


@launcher("fragment_norms", "ref")
def _(buf, offsets, ord, acc):
    acc.copy_(_norms_f64(buf, offsets, ord))


native(
    "fragment_norms",
    "lc_fragment_norms",
    dtype=("buf", code),
    nseg=("offsets", lambda offsets: offsets.numel() - 1),
    out="acc",
)
triton("fragment_norms", "fragment_norms", "launch_fragment_norms")


#: fragment_norms' arguments (offsets' entries are checked with check_values; out: the op's own).
CONTRACT = _checks.Contract(
    "lc_fragment_norms",
    _checks.Buffer("buf", _checks.PARAM_DTYPES),
    _checks.Buffer("offsets", (torch.int64,), dim=1, numel=None),
    _checks.Flag("check_values"),
    may_alias=[("buf", "offsets")],
    internal=["out"],
)


def _norms_impl(
    buf: torch.Tensor, offsets: torch.Tensor, ord: int, backend: str | None, check_values: bool = True
) -> torch.Tensor:
    """Check, choose the backend, launch: the registered op's body, and the eager path of
    fragment_norms."""
    CONTRACT.check(buf=buf, offsets=offsets, check_values=check_values)
    if isinstance(ord, bool) or not isinstance(ord, int):
        raise TypeError(f"ord must be the int 1 or 2, got {type(ord).__name__} {ord!r}")
    if ord not in ORDS:
        raise ValueError(f"ord must be 1 or 2, got {ord!r}")
    if offsets.numel() == 0:
        raise ValueError("offsets must hold at least one entry (K+1 boundaries for K segments)")
    b = _dispatch.resolve(backend, buf.device, "lc_fragment_norms")
    if check_values:  # reads offsets on the host
        if offsets.numel() > 1 and not bool((offsets[1:] >= offsets[:-1]).all()):
            raise ValueError("offsets must be non-decreasing")
        lo, hi = (int(v) for v in torch.aminmax(offsets))
        if lo < 0 or hi > buf.numel():
            raise ValueError(f"offsets must lie in [0, {buf.numel()}] (buf.numel()), got min {lo}, max {hi}")
    nseg = offsets.numel() - 1
    out = torch.empty(nseg, dtype=buf.dtype, device=buf.device)
    if nseg:
        with nvtx_range("fragment_norms"):
            acc = torch.empty(nseg, dtype=torch.float64, device=buf.device)
            launch("fragment_norms", b, buf, offsets, ord, acc)
            out.copy_(acc)  # the one rounding to buf's dtype
    return out


_norms_op = torch.library.custom_op("lowcomm::fragment_norms", _norms_impl, mutates_args=())


@_norms_op.register_fake
def _(buf, offsets, ord, backend, check_values=True):
    CONTRACT.same_device(buf=buf, offsets=offsets)  # see _common
    return buf.new_empty(max(offsets.numel() - 1, 0))


declare("fragment_norms")


@torch.no_grad()  # optimizer-style updates: parameters that require grad are fine
def fragment_norms(
    buf: torch.Tensor,
    offsets: torch.Tensor,
    *,
    ord: int = 2,
    backend: str | None = None,
    check_values: bool = True,
) -> torch.Tensor:
    """One norm per segment of a flat buffer, in one pass:

        out[i] = ‖buf.flatten()[offsets[i] : offsets[i+1]]‖_ord,   i < K

    accumulated in float64 in a fixed order (bit-identical from call to call, whatever the thread
    count), rounded once to buf's dtype. An empty segment has norm 0.

    Args:
        buf: fp32/fp64, any shape, contiguous. Read only.
        offsets: (K+1,) int64 on buf's device, contiguous, non-decreasing, entries in
            [0, buf.numel()]. Read only.
        ord: the int 1 or 2.
        backend: 'ref' | 'cpu' | 'triton' | 'cuda' (default by device, see ``_dispatch``).
        check_values: True (the default) checks offsets' entries (non-decreasing, in range),
            which reads them on the host: on a GPU the call waits for every kernel queued before
            it. False skips that one check (dtype, device and shape are still checked) for a
            caller that built offsets itself, e.g. a fragment table; a bad entry is then
            undefined behaviour (a bad memory access on a GPU). The ``ref`` backend reads
            offsets on the host either way.
    Returns:
        A new (K,) tensor of buf's dtype.
    Raises:
        TypeError / ValueError naming the argument.
    """
    if compiling():
        return traced_call("fragment_norms", buf, offsets, ord, backend, check_values)
    return _norms_impl(buf, offsets, ord, backend, check_values)
