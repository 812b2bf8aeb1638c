"""mask_indices: LOSCAR's shared random coordinate subset S_r, with no RNG state and no traffic.

S = sorted{ π(0), …, π(k−1) } where π is a keyed bijection of [0, n) derived from (seed, round):
every worker computes the same k distinct indices from the same four integers, each index
independently (so it is parallel), on any backend and machine.

π: with b = max(1, ⌈log2 n⌉) and m = 2^b − 1, a bijection P of [0, 2^b) made of four rounds of
    x <- (x + a_j) & m;  x <- (x · c_j) & m   (c_j odd);  x <- x ^ (x >> s)   (s = ⌈b/2⌉)
(each step is invertible mod 2^b), restricted to [0, n) by cycle walking: π(i) = P(i), P(P(i)), …
until the value is < n. Since 2^b < 2n, a walk takes < 2 steps on average. The round keys come
from splitmix64 over (seed, round), computed exactly in Python integers.
"""

from __future__ import annotations

import torch

from .. import _checks, _dispatch
from ..profiling import nvtx_range
from ._common import compiling, declare, launch, launcher, native, refusing, traced_call, triton

ROUNDS = 4
_M64 = (1 << 64) - 1


def _splitmix64(z: int) -> int:
    z = (z + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def mask_keys(seed: int, round: int, n: int) -> tuple[list[int], list[int], int, int]:
    """(adds, muls, shift, bitmask) of the permutation for (seed, round) over [0, n)."""
    bits = max(1, (n - 1).bit_length())
    bitmask = (1 << bits) - 1
    s = _splitmix64(_splitmix64(seed & _M64) ^ (round & _M64))
    adds, muls = [], []
    for _ in range(ROUNDS):
        s = _splitmix64(s)
        adds.append(s & bitmask)
        s = _splitmix64(s)
        muls.append((s & bitmask) | 1)
    return adds, muls, max(1, (bits + 1) // 2), bitmask


def _permute_once(
    x: torch.Tensor, adds: list[int], muls: list[int], shift: int, bitmask: int
) -> torch.Tensor:
    for a, c in zip(adds, muls, strict=False):
        x = (x + a) & bitmask
        x = (x * c) & bitmask  # int64 products wrap mod 2^64; the low b bits are exact
        x = x ^ (x >> shift)
    return x


def mask_perm_ref(
    n: int, k: int, keys: tuple[list[int], list[int], int, int], device: torch.device | str | None = None
) -> torch.Tensor:
    """π(0..k−1), unsorted, in plain torch."""
    adds, muls, shift, bitmask = keys
    x = _permute_once(torch.arange(k, dtype=torch.int64, device=device), adds, muls, shift, bitmask)
    out_of_range = x >= n
    while bool(out_of_range.any()):
        x = torch.where(out_of_range, _permute_once(x, adds, muls, shift, bitmask), x)
        out_of_range = x >= n
    return x


def mask_indices_ref(
    seed: int, round: int, n: int, k: int, *, device: torch.device | str | None = None
) -> torch.Tensor:
    """The specification: sorted π(0..k−1) for the permutation keyed by (seed, round)."""
    return torch.sort(mask_perm_ref(n, k, mask_keys(seed, round, n), device)).values


# ---- launchers (k >= 1): out[i] = π(i) for i < k, the permutation given by its keys ----------------


@launcher("mask_perm", "ref")
def _(n, k, adds, muls, shift, bitmask, out):
    out.copy_(mask_perm_ref(n, k, (adds, muls, shift, bitmask), out.device))


def keys_on(values: list[int], device: torch.device) -> torch.Tensor:
    """The round keys as an int64 tensor on `device`, for the native ABI (which takes them by
    pointer), built without a host-to-device copy: ``torch.tensor(values, device=cuda)`` copies
    from pageable memory, which makes the host wait for the device's stream (a full sync in
    every LOSCAR round). A fill is a kernel launch with the value as its argument, queued like
    any other. (The Triton launcher takes the keys as kernel scalar arguments: no tensor at all.)"""
    if device.type == "cpu":
        return torch.tensor(values, dtype=torch.int64)
    keys = torch.empty(len(values), dtype=torch.int64, device=device)
    for i, v in enumerate(values):
        keys[i].fill_(v)
    return keys


native(
    "mask_perm",
    "lc_mask_perm",
    adds=(("adds", "out"), lambda adds, out: keys_on(adds, out.device)),
    muls=(("muls", "out"), lambda muls, out: keys_on(muls, out.device)),
)
triton("mask_perm", "mask_indices", "launch_mask_perm")


_KEY = " (a non-negative int64: the registered op and a 0-d tensor carry it as one)"


def check_key(name: str, value: object) -> int:
    """A seed or round of the mask stream: an int in [0, 2**63) (LOSCAR checks its seed with it at
    construction)."""
    return _checks.integer(name, value, lo=0, hi=(1 << 63) - 1, why=_KEY)


def _check_ints(seed: object, round: object, n: object, k: object) -> tuple[int, int, int, int]:
    seed, round = check_key("seed", seed), check_key("round", round)
    n = _checks.integer("n", n, lo=0, hi=(1 << 62))
    k = _checks.integer("k", k, lo=0)
    if k > n:
        raise ValueError(f"k must be <= n, got k={int(k)} > n={int(n)}")
    return seed, round, n, k


def _mask_indices_impl(
    seed: int, round: int, n: int, k: int, device: torch.device, backend: str | None
) -> torch.Tensor:
    """Check, choose the backend, launch: the registered op's body, and the eager path of mask_indices."""
    seed, round, n, k = _check_ints(seed, round, n, k)
    if device.type == "meta":
        raise ValueError("device is meta: meta tensors hold no data, so there are no indices to compute")
    b = _dispatch.resolve(backend, device, "lc_mask_perm")
    with nvtx_range("mask_indices"):
        out = torch.empty(k, dtype=torch.int64, device=device)
        if k:
            launch("mask_perm", b, n, k, *mask_keys(seed, round, n), out)
        return torch.sort(out).values


_mask_indices_op = torch.library.custom_op("lowcomm::mask_indices", _mask_indices_impl, mutates_args=())


@_mask_indices_op.register_fake
def _(seed, round, n, k, device, backend):
    return torch.empty(k, dtype=torch.int64, device=device)


declare("mask_indices")


@refusing(0)
def mask_indices(
    seed: int,
    round: int,
    n: int,
    k: int,
    *,
    device: torch.device | str | None = None,
    backend: str | None = None,
) -> torch.Tensor:
    """LOSCAR's coordinate subset for one round: the same k indices on every worker, from the same
    four integers, without communication or RNG state:

        S = sorted{ π(0), …, π(k−1) },   π the bijection of [0, n) keyed by (seed, round)

    (the module docstring defines π). S(k) ⊂ S(k+1). Over rounds every index is drawn with
    probability k/n, and every k-subset equally often (chi-square tests check both).

    Args:
        seed: int (or 0-d int64 tensor) in [0, 2**63), shared by the workers.
        round: int (or 0-d int64 tensor) in [0, 2**63), e.g. the sync counter.
        n: the number of coordinates, an int in [0, 2**62].
        k: how many to pick, an int in [0, n].
        device: where the result lives (default CPU); not the meta device.
        backend: 'ref' | 'cpu' | 'triton' | 'cuda' (default by device, see ``_dispatch``).
    Returns:
        A new (k,) int64 tensor on `device`: strictly increasing, entries in [0, n), identical on
        every backend and machine for the same (seed, round, n, k).
    Raises:
        TypeError / ValueError naming the argument.
    """
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if compiling():
        # Host integers, known while tracing: checked here (a k < 0 would fail in the fake kernel,
        # a seed >= 2**63 in the op's int64 schema), and again by the op's body.
        return traced_call("mask_indices", *_check_ints(seed, round, n, k), dev, backend)
    return _mask_indices_impl(seed, round, n, k, dev, backend)
