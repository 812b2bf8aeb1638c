"""Triton mask_perm: the first k images of mask_indices' keyed permutation π of [0, n).

With b = max(1, ⌈log2 n⌉), m = 2^b − 1 (``bitmask``) and s = ⌈b/2⌉ (``shift``), one application
of the bijection P of [0, 2^b) is four rounds of

    x <- (x + a_j) & m ;  x <- (x · c_j) & m  (c_j odd) ;  x <- x ^ (x >> s)

and π(i) = the first of P(i), P(P(i)), … that is < n (cycle walking). Every index is computed
independently, so this is one elementwise launch. Bit-identical to ``mask_perm_ref``: int64
products wrap mod 2^64 on every backend and only their low b <= 62 bits are kept; all values stay
non-negative, so ``>>`` is a logical shift.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ._launch import block_sum, launch_elementwise

ROUNDS = 4


@triton.jit
def _round(x, a, c, shift, bitmask):
    """One round: add, odd-multiply, xorshift, all mod 2^b."""
    x = (x + a) & bitmask
    x = (x * c) & bitmask
    return x ^ (x >> shift)


@triton.jit
def _permute_once(x, a0, a1, a2, a3, c0, c1, c2, c3, shift, bitmask):
    """P(x): the four rounds."""
    x = _round(x, a0, c0, shift, bitmask)
    x = _round(x, a1, c1, shift, bitmask)
    x = _round(x, a2, c2, shift, bitmask)
    return _round(x, a3, c3, shift, bitmask)


#: The round keys change every round (they come from (seed, round)). Triton specialises an int
#: argument on "divisible by 16" (and on "== 1"), so a kernel that took them specialised would be
#: compiled again whenever a new pattern turned up, a JIT stall of a second or so in the middle of
#: a training sync, up to 2^4 · 2 patterns per (n, k). Not specialised, one compilation serves
#: every round.
PER_ROUND = ("a0", "a1", "a2", "a3", "c0", "c1", "c2", "c3")


@triton.jit(do_not_specialize=PER_ROUND)
def _mask_perm_kernel(
    out_ptr,
    n: tl.int64,
    k: tl.int64,
    a0: tl.int64,
    a1: tl.int64,
    a2: tl.int64,
    a3: tl.int64,
    c0: tl.int64,
    c1: tl.int64,
    c2: tl.int64,
    c3: tl.int64,
    shift: tl.int64,
    bitmask: tl.int64,
    BLOCK: tl.constexpr,
):
    """out[i] = π(i) for i < k (int64): P applied to i, then re-applied while the value is >= n.

    The block walks until its last lane lands in [0, n); finished lanes keep their value
    (a walk takes < 2 steps on average since 2^b < 2n)."""
    i = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = i < k
    x = _permute_once(i, a0, a1, a2, a3, c0, c1, c2, c3, shift, bitmask)
    walking = mask & (x >= n)
    while block_sum(walking.to(tl.int32)) > 0:
        x = tl.where(walking, _permute_once(x, a0, a1, a2, a3, c0, c1, c2, c3, shift, bitmask), x)
        walking = mask & (x >= n)
    tl.store(out_ptr + i, x, mask=mask)


def launch_mask_perm(
    n: int, k: int, adds: list[int], muls: list[int], shift: int, bitmask: int, out: torch.Tensor
) -> None:
    """Write π(0), …, π(k−1) (unsorted) into `out`, a contiguous int64 tensor of k elements.

    adds, muls: the ROUNDS round keys from ``mask_keys`` (each in [0, bitmask], muls odd);
    shift, bitmask: as in ``mask_keys``; 0 <= k <= n <= 2^62. Allocates nothing; k == 0 is a no-op.
    """
    if len(adds) != ROUNDS or len(muls) != ROUNDS:
        raise ValueError(f"adds and muls must hold {ROUNDS} round keys each, got {len(adds)} and {len(muls)}")
    a = [int(v) for v in adds]
    c = [int(v) for v in muls]
    launch_elementwise(_mask_perm_kernel, out, k, out, int(n), int(k), *a, *c, int(shift), int(bitmask))
