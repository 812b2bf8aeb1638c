"""topk_encode / topk_decode_add_: the top-k sparse wire format with error feedback.

A flat pseudo-gradient Δ of n values is sent as, per chunk of ``chunk`` (C) consecutive values,
the k largest entries of the error-feedback buffer e, quantized to ``bits`` (b) bits with one fp32
scale per chunk. Chunk j covers [jC, min(n, (j+1)C)), of length L_j; it sends k_j = min(k, L_j)
entries (only the last chunk can be short). Every backend computes, bit for bit:

    e      ← e·β + Δ                               (e's dtype T, fp32 or fp64; two roundings)
    S_j    = the k_j indices of the largest |e_i| in the chunk, ties to the lower index,
             listed in ascending order
    s_j    = b = 1: fp32( (Σ_{i∈S_j} |e_i| in fp64, in ascending index order) / k_j )   (mean)
             b ≥ 2: fp32( max_{i∈S_j} |e_i| )                                          (max)
    m_i    = fp32(e_i) / s_j  (fp32 division; 0 when s_j = 0)
    c_i    = clamp(rint((m_i·Lq + Lq) · 0.5), 0, Lq)  with Lq = 2^b − 1, round half to even
    v_i    = ((2·c_i − Lq) · s_j) / Lq              (fp32: the value the receiver adds)
    e_i    ← e_i − T(v_i)   for i ∈ S_j             (what was sent leaves e; the rest stays)

So the 2^b levels are the odd multiples of s/Lq, without zero: b = 1 is the sign with the mean
|value| as its magnitude (the L2-best single magnitude for a sign), b = 2 the levels ±s/3, ±s with
the chunk's largest |value| on ±s (nothing clips), b = 4 fifteen steps of 2s/15 across [−s, s].

A chunk holding a non-finite e_i, or whose scale overflows fp32 (fp64 data), is not encoded:
its scale is NaN (so the receiver adds NaN and the sync's non-finite check fires), its indices
0..k_j−1 and codes 0, and e keeps the chunk's updated values. The op returns the count of
non-finite e_i plus the count of chunks whose finite values overflowed the scale.

Payload (uint8, ``TopKFormat.payload_bytes(n)``), three sections, every one counted on the wire:

    scales   4·nc bytes: the nc = ceil(n / C) fp32 scales, little-endian
    indices  per chunk, ceil(k_j·ib / 8) bytes: its k_j indices within the chunk (0..L_j−1),
             ib = ceil(log2 C) bits each
    values   per chunk, ceil(k_j·b / 8) bytes: the codes c_i in the same order, b bits each

Bits are packed LSB first: entry t of a chunk's section occupies bits [t·w, (t+1)·w), bit p of
the section in byte p // 8 at bit p % 8; a chunk's last byte is padded with zero bits, so chunks
start on byte boundaries and encode in parallel. At the defaults (C = 4096, k = 64, b = 2):
4 + 96 + 16 = 116 bytes per 4096 values, 0.2266 bits per value, 141× fewer bytes than fp32.

Decode + accumulate adds v_i into an fp32 / fp64 buffer at jC + index (``out_i ← out_i + T(v_i)``):
summing the payloads of M workers one after another in rank order gives every rank the same sum.
"""

from __future__ import annotations

import dataclasses

import torch

from .. import _checks, _dispatch
from ..profiling import nvtx_range
from ._common import LAUNCHERS, code, compiling, declare, launch, launcher, native, traced_call, triton

BITS = (1, 2, 4)  # the value widths the format has
MAX_CHUNK = 1 << 30  # indices fit 30 bits; the kernels key a chunk's entries by value and index


@dataclasses.dataclass(frozen=True)
class TopKFormat:
    """The top-k wire format's three knobs: ``k`` entries per chunk of ``chunk`` values, each
    quantized to ``bits`` bits. Checked at construction (ValueError / TypeError naming the knob)."""

    k: int = 64
    chunk: int = 4096
    bits: int = 2

    def __post_init__(self) -> None:
        check_format(self.k, self.chunk, self.bits)

    @property
    def index_bits(self) -> int:
        """ceil(log2 chunk): the bits of one index within a chunk."""
        return (self.chunk - 1).bit_length()

    def num_chunks(self, n: int) -> int:
        return -(-n // self.chunk)

    def sections(self, n: int) -> tuple[int, int, int, int, int, int]:
        """(chunks, entries of a full chunk, entries of the last chunk, index bytes of a full
        chunk, value bytes of a full chunk, payload bytes) for n values."""
        nc = self.num_chunks(n)
        if nc == 0:
            return 0, 0, 0, 0, 0, 0
        kf = min(self.k, self.chunk)
        kl = min(self.k, n - (nc - 1) * self.chunk)
        ibf, vbf = _nbytes(kf, self.index_bits), _nbytes(kf, self.bits)
        total = 4 * nc + (nc - 1) * (ibf + vbf) + _nbytes(kl, self.index_bits) + _nbytes(kl, self.bits)
        return nc, kf, kl, ibf, vbf, total

    def payload_bytes(self, n: int) -> int:
        """Bytes of one worker's payload for n values: scales, indices and values, padding included."""
        return self.sections(n)[5]

    def bits_per_value(self, n: int) -> float:
        """Payload bits per value of the buffer (8 · payload_bytes(n) / n)."""
        return 8.0 * self.payload_bytes(n) / n if n else 0.0


def _nbytes(count: int, width: int) -> int:
    return (count * width + 7) // 8


def check_format(k: object, chunk: object, bits: object, name=str) -> tuple[int, int, int]:
    """(k, chunk, bits) checked: chunk in [2, 2^30], 1 <= k <= chunk, bits in (1, 2, 4). `name`
    turns an argument name into the caller's words (``--topk-k`` on the CLI)."""
    chunk = _checks.integer(name("chunk"), chunk, lo=2, hi=MAX_CHUNK)
    k = _checks.integer(name("k"), k, lo=1, hi=chunk, why=f" ({name('chunk')} = {chunk})")
    if isinstance(bits, bool) or not isinstance(bits, int):
        raise TypeError(f"{name('bits')} must be an int, got {type(bits).__name__}")
    if bits not in BITS:
        raise ValueError(f"{name('bits')} must be one of {BITS}, got {bits}")
    return k, chunk, bits


# ---- the specification ------------------------------------------------------------------------


def _pack_bits(v: torch.Tensor, width: int) -> torch.Tensor:
    """(r, m) non-negative int64 < 2^width -> (r, ceil(m·width / 8)) uint8, LSB first."""
    r, m = v.shape
    bits = (v.unsqueeze(-1) >> torch.arange(width, device=v.device)) & 1
    bits = bits.reshape(r, m * width)
    pad = (-(m * width)) % 8
    bits = torch.nn.functional.pad(bits, (0, pad)).reshape(r, -1, 8)
    return (bits << torch.arange(8, device=v.device)).sum(-1).to(torch.uint8)


def _unpack_bits(b: torch.Tensor, width: int, m: int) -> torch.Tensor:
    """The inverse of _pack_bits: (r, nbytes) uint8 -> (r, m) int64."""
    r = b.shape[0]
    bits = ((b.to(torch.int64).unsqueeze(-1) >> torch.arange(8, device=b.device)) & 1).reshape(r, -1)[
        :, : m * width
    ]
    return (bits.reshape(r, m, width) << torch.arange(width, device=b.device)).sum(-1)


def _encode_rows(rows: torch.Tensor, k: int, bits: int) -> tuple[torch.Tensor, ...]:
    """One group of equal-length chunks (r, L), already updated: (idx, codes, scales, bad, count)
    and, in place, e minus what was sent."""
    lq = (1 << bits) - 1
    order = torch.sort(rows.abs(), dim=1, descending=True, stable=True).indices[:, :k]
    idx = order.sort(dim=1).values  # stable descending sort: equal |e| keep index order
    sel = rows.gather(1, idx)
    if bits == 1:  # the mean |value|: a sequential fp64 sum in ascending index order
        s = (torch.cumsum(sel.abs().to(torch.float64), dim=1)[:, -1] / k).to(torch.float32)
    else:
        s = sel.abs().amax(dim=1).to(torch.float32)
    finite = torch.isfinite(rows)
    nonfinite_rows = ~finite.all(dim=1)
    bad = nonfinite_rows | ~torch.isfinite(s)
    count = (~finite).sum() + (bad & ~nonfinite_rows).sum()
    s2 = s.unsqueeze(1)
    m = torch.where(
        s2 > 0, sel.to(torch.float32) / s2, torch.zeros((), dtype=torch.float32, device=rows.device)
    )
    c = torch.round((m * lq + lq) * 0.5).clamp(0, lq)
    v = ((2 * c - lq) * s2) / lq
    rows.scatter_(1, idx, torch.where(bad.unsqueeze(1), sel, sel - v.to(rows.dtype)))
    codes = torch.where(bad.unsqueeze(1), 0, c.to(torch.int64))
    idx = torch.where(bad.unsqueeze(1), torch.arange(k, device=rows.device).expand_as(idx), idx)
    s = torch.where(bad, torch.full_like(s, float("nan")), s)
    return idx, codes, s, count


def topk_encode_ref(
    delta: torch.Tensor, e: torch.Tensor, fmt: TopKFormat, beta: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """The specification of topk_encode: (payload, nonfinite count) of Δ = `delta`; e (contiguous,
    delta's dtype and numel) is updated in place (module docstring)."""
    n, C = e.numel(), fmt.chunk
    nc, kf, kl, _, _, total = fmt.sections(n)
    flat = e.view(-1)
    flat.mul_(beta).add_(delta.reshape(-1))
    if nc == 0:
        return torch.empty(0, dtype=torch.uint8, device=e.device), torch.zeros(
            (), dtype=torch.int64, device=e.device
        )
    full = n // C
    groups = []  # (rows, k) of the full chunks, then of a short last chunk
    if full:
        groups.append((flat[: full * C].view(full, C), kf))
    if full < nc:
        groups.append((flat[full * C :].view(1, n - full * C), kl))
    parts = [_encode_rows(rows, k, fmt.bits) for rows, k in groups]
    scales = torch.cat([p[2] for p in parts]).view(torch.uint8)
    idx_bytes = [_pack_bits(p[0], fmt.index_bits).reshape(-1) for p in parts]
    val_bytes = [_pack_bits(p[1], fmt.bits).reshape(-1) for p in parts]
    payload = torch.cat([scales, *idx_bytes, *val_bytes])
    assert payload.numel() == total
    return payload, sum(p[3] for p in parts)


def _decode_parts(payload: torch.Tensor, n: int, fmt: TopKFormat):
    """(positions, fp32 values) of every entry of a payload for n values."""
    C, lq = fmt.chunk, (1 << fmt.bits) - 1
    nc, kf, kl, ibf, vbf, _ = fmt.sections(n)
    scales = payload[: 4 * nc].clone().view(torch.float32)
    full_k = [kf] * (nc - 1) + [kl]
    ib_sizes = [ibf] * (nc - 1) + [_nbytes(kl, fmt.index_bits)]
    vb_sizes = [vbf] * (nc - 1) + [_nbytes(kl, fmt.bits)]
    pos, vals = [], []
    o_idx = 4 * nc
    o_val = o_idx + sum(ib_sizes)
    for j in range(nc):
        k = full_k[j]
        idx = _unpack_bits(payload[o_idx : o_idx + ib_sizes[j]].view(1, -1), fmt.index_bits, k)[0]
        c = _unpack_bits(payload[o_val : o_val + vb_sizes[j]].view(1, -1), fmt.bits, k)[0]
        o_idx, o_val = o_idx + ib_sizes[j], o_val + vb_sizes[j]
        length = min(C, n - j * C)
        if k and int(idx.max()) >= length:
            raise ValueError(f"payload holds index {int(idx.max())} in chunk {j} of {length} values")
        pos.append(idx + j * C)
        vals.append(((2 * c.to(torch.float32) - lq) * scales[j]) / lq)
    return torch.cat(pos), torch.cat(vals)


def topk_decode_add_ref(out: torch.Tensor, payload: torch.Tensor, fmt: TopKFormat) -> None:
    """The specification of topk_decode_add_: out (contiguous, n values) += the payload's values
    at their positions, each added in out's dtype."""
    n = out.numel()
    if n == 0:
        return
    pos, vals = _decode_parts(payload, n, fmt)
    flat = out.view(-1)
    flat[pos] = flat[pos] + vals.to(out.dtype)  # positions are distinct


def topk_decode_ref(payload: torch.Tensor, n: int, fmt: TopKFormat) -> torch.Tensor:
    """The dense fp32 values one payload stands for (zero where nothing was sent)."""
    out = torch.zeros(n, dtype=torch.float32, device=payload.device)
    topk_decode_add_ref(out, payload, fmt)
    return out


# ---- launchers ----------------------------------------------------------------------------------


@launcher("topk_encode", "ref")
def _(delta, e, payload, nonfinite, k, chunk, bits, beta):
    p, nf = topk_encode_ref(delta, e, TopKFormat(k, chunk, bits), beta)
    payload.copy_(p)
    nonfinite.copy_(nf)


@launcher("topk_decode_add", "ref")
def _(out, payload, k, chunk, bits):
    topk_decode_add_ref(out, payload, TopKFormat(k, chunk, bits))


triton("topk_encode", "topk", "launch_topk_encode")
triton("topk_decode_add", "topk", "launch_topk_decode_add")
_triton_encode = LAUNCHERS[("topk_encode", "triton")]


@launcher("topk_encode", "triton")
def _(delta, e, *rest):
    # The Triton kernel encodes fp32; fp64 data runs the specification in torch on its device.
    (_triton_encode if e.dtype == torch.float32 else LAUNCHERS[("topk_encode", "ref")])(delta, e, *rest)


native("topk_encode", "lc_topk_encode", dtype=("e", code), n=("e", torch.Tensor.numel))
native("topk_decode_add", "lc_topk_decode_add", dtype=("out", code), n=("out", torch.Tensor.numel))


# ---- implementations (the registered ops' bodies and the eager paths) ---------------------------


_PAYLOAD = _checks.Buffer("payload", (torch.uint8,), dim=1, numel=None)  # its size: _check_payload
#: topk_encode's arguments: delta, e and payload pairwise distinct.
ENCODE = _checks.Contract(
    "lc_topk_encode",
    _checks.Buffer("e", _checks.FLOAT_DTYPES),
    _checks.Buffer("delta", _checks.like("e")),
    dataclasses.replace(_PAYLOAD, shown="payload_out"),
    _checks.Real("beta", lo=0.0, hi=1.0),
    _checks.Flag("check_values"),
    internal=["nonfinite"],
)
#: topk_decode_add_'s arguments: out and payload distinct.
DECODE_ADD = _checks.Contract("lc_topk_decode_add", _checks.Buffer("out", _checks.FLOAT_DTYPES), _PAYLOAD)


def _check_payload(payload: torch.Tensor, fmt: TopKFormat, n: int, name: str = "payload") -> None:
    if payload.numel() != fmt.payload_bytes(n):
        raise ValueError(
            f"{name} has {payload.numel()} bytes; n = {n} values with k = {fmt.k}, chunk = {fmt.chunk}, "
            f"bits = {fmt.bits} take {fmt.payload_bytes(n)}"
        )


def _encode_impl(
    delta: torch.Tensor,
    e: torch.Tensor,
    payload: torch.Tensor,
    k: int,
    chunk: int,
    bits: int,
    beta: float,
    backend: str | None,
    check_values: bool = True,
) -> torch.Tensor:
    """Check, choose the backend, launch. Returns the 0-d int64 non-finite count."""
    fmt = TopKFormat(*check_format(k, chunk, bits))
    beta = ENCODE.check(e=e, delta=delta, payload=payload, beta=beta, check_values=check_values)["beta"]
    _check_payload(payload, fmt, e.numel(), "payload_out")
    if check_values:
        for name, t in (("delta", delta), ("e", e)):
            if not bool(torch.isfinite(t).all()):
                raise ValueError(f"{name} holds non-finite values; the top-k codec refuses them")
    b = _dispatch.resolve(backend, e.device, "lc_topk_encode")
    nonfinite = torch.zeros((), dtype=torch.int64, device=e.device)
    if e.numel():
        with nvtx_range("topk_encode"):
            launch("topk_encode", b, delta, e, payload, nonfinite, fmt.k, fmt.chunk, fmt.bits, beta)
    return nonfinite


def _decode_add_impl(
    out: torch.Tensor, payload: torch.Tensor, k: int, chunk: int, bits: int, backend: str | None
) -> None:
    fmt = TopKFormat(*check_format(k, chunk, bits))
    DECODE_ADD.check(out=out, payload=payload)
    _check_payload(payload, fmt, out.numel())
    b = _dispatch.resolve(backend, out.device, "lc_topk_decode_add")
    if out.numel():
        with nvtx_range("topk_decode_add"):
            launch("topk_decode_add", b, out, payload, fmt.k, fmt.chunk, fmt.bits)


_encode_op = torch.library.custom_op("lowcomm::topk_encode", _encode_impl, mutates_args=("e", "payload"))


@_encode_op.register_fake
def _(delta, e, payload, k, chunk, bits, beta, backend, check_values=True):
    ENCODE.same_device(e=e, delta=delta, payload=payload)  # see _common
    return e.new_empty((), dtype=torch.int64)


_decode_add_op = torch.library.custom_op("lowcomm::topk_decode_add_", _decode_add_impl, mutates_args=("out",))


@_decode_add_op.register_fake
def _(out, payload, k, chunk, bits, backend):
    DECODE_ADD.same_device(out=out, payload=payload)  # see _common


declare("topk_encode")
declare("topk_decode_add_")


@torch.no_grad()
def topk_encode(
    delta: torch.Tensor,
    e: torch.Tensor,
    *,
    k: int = 64,
    chunk: int = 4096,
    bits: int = 2,
    beta: float = 0.95,
    payload_out: torch.Tensor | None = None,
    backend: str | None = None,
    check_values: bool = True,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Encode Δ with error feedback into a top-k payload (module docstring), one pass over e.

    Args:
        delta: Δ, fp32 / fp64, any shape, contiguous, n values. Read only.
        e: the error-feedback buffer, delta's dtype and numel, contiguous. Updated: e·β + Δ minus
            the values sent.
        k, chunk, bits: entries per chunk (1 <= k <= chunk), values per chunk (2 .. 2^30), bits
            per value (1, 2 or 4).
        beta: e's decay, in [0, 1].
        payload_out: optional preallocated uint8 payload of ``TopKFormat.payload_bytes(n)``.
        backend: 'ref' | 'cpu' | 'cuda' (fp32, chunk <= 4096) | 'triton' (fp32, any chunk; fp64
            runs the reference on the device); default by device, see ``_dispatch``.
        check_values: True (the default) refuses a non-finite delta or e before anything is
            written (a host read); False (the runtime, which skips such a sync on every rank)
            encodes and reports them: the chunk's scale is NaN and the count is returned.
    Returns:
        (payload, nonfinite): the uint8 payload, and a new 0-d int64 count (module docstring).
    Raises:
        TypeError / ValueError naming the argument, before anything is written.
    """
    k, chunk, bits = check_format(k, chunk, bits)
    _checks.is_tensor("e", e)
    if payload_out is None:
        payload_out = torch.empty(
            TopKFormat(k, chunk, bits).payload_bytes(e.numel()), dtype=torch.uint8, device=e.device
        )
    args = (delta, e, payload_out, k, chunk, bits, beta, backend, check_values)
    nonfinite = traced_call("topk_encode", *args) if compiling() else _encode_impl(*args)
    return payload_out, nonfinite


@torch.no_grad()
def topk_decode_add_(
    out: torch.Tensor,
    payload: torch.Tensor,
    *,
    k: int = 64,
    chunk: int = 4096,
    bits: int = 2,
    backend: str | None = None,
) -> None:
    """Add a top-k payload's values into out, in place: out[jC + i] += value (module docstring).

    Args:
        out: fp32 / fp64, any shape, contiguous, the n values the payload was encoded from.
        payload: uint8 of ``TopKFormat(k, chunk, bits).payload_bytes(n)`` bytes. Read only.
        k, chunk, bits: the format it was encoded with.
        backend: as for ``topk_encode`` ('cuda': fp32 or fp64 out, chunk <= 4096).
    Raises:
        TypeError / ValueError naming the argument before anything is written; an index past its
        chunk (a corrupt payload) is refused (ValueError on 'ref', RuntimeError naming payload from
        the CPU kernel, which checks every index before it writes); the CUDA kernel skips it.
    """
    args = (out, payload, k, chunk, bits, backend)
    if compiling():
        traced_call("topk_decode_add_", *args)
    else:
        _decode_add_impl(*args)
