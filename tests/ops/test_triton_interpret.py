"""The Triton kernels on CPU, through Triton's interpreter (TRITON_INTERPRET=1), against the refs.

Every launcher is exercised through its public op with ``backend="triton"`` on fresh random
fp32 inputs of sizes 0, 1, 7 and 1000003, and compared with the op's ``*_ref`` using the
tolerance table of ``tests/conftest.py``:

* pack's delta is one IEEE subtraction on both sides: bit-identical; the bf16 wire value is
  bit-identical to torch's conversion (the kernel rounds to nearest-even by hand, so this holds
  under the interpreter too, whose own bf16 cast truncates);
* outer_merge's outputs are a few O(1) roundings from the inputs: "elementwise" (8·eps); with
  normalized λ formed on the device from taylor_norms' sums, bit-identical to λ_eff formed on the
  host from the same sums;
* mask_perm is integer arithmetic: bit-identical;
* gather is a copy (bit-identical); the scatter-merge is two roundings: "elementwise";
* fragment_norms and taylor_norms are fp64 sums of n terms: "reduction" (eps_out + 8·√n·eps_64),
  and fragment_norms must repeat bit for bit.

Only fp32 is compared where Python-float scalars enter the kernel: the interpreter turns them into
fp32 constants, so fp64 data would see fp32-rounded λ, β, … (on a GPU they are fp64 arguments).
bf16 arithmetic in the interpreter is unreliable; bf16 enters only as a load widened to fp32
(exact) and as pack's hand-rounded store, both checked bit for bit.

TRITON_INTERPRET is set only while this module runs, by its `kernels` fixture (see there why not
at import).

The interpreter costs per program, so the launchers use up to 65536 elements per program on
CPU tensors; the whole file runs in well under a minute on 2 cores.
"""

from __future__ import annotations

import importlib
import itertools
import os
import sys

import pytest
import torch

pytest.importorskip("triton", reason="Triton is not installed: the Triton backend cannot be tested")

from lowcomm_kernels import _dispatch
from lowcomm_kernels.ops import (
    fragment_norms,
    fragment_norms_ref,
    mask_indices,
    mask_indices_ref,
    mask_keys,
    outer_merge_,
    outer_merge_ref,
    pack,
    pack_ref,
    sparse_gather,
    sparse_scatter_merge_,
    sparse_scatter_merge_ref,
    taylor_norms_ref,
)
from lowcomm_kernels.ops.mask_indices import mask_perm_ref
from lowcomm_kernels.ops.outer_merge import lam_effective

from ._contract import assert_bf16_wire, nan_payloads

SIZES = [0, 1, 7, 1000003]
BIG = SIZES[-1]
F32 = torch.float32
BF16 = torch.bfloat16
# numpy, which evaluates the kernels, warns on inf - inf and on fp64 -> fp32 overflow: the tests
# below create those on purpose.
numpy_overflow_ok = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")


def _grid(sizes, *axes, big_only=None):
    """Every combination of `axes` for the small sizes; for BIG only the `big_only` combinations
    (the interpreter takes ~0.3 s per op call at 1M elements, so the large size covers the memory
    paths while the small ones cover every combination)."""
    combos = list(itertools.product(*axes))
    out = [(n, *c) for n in sizes if n != BIG for c in combos]
    out += [(BIG, *c) for c in (big_only if big_only is not None else combos)]
    return out


def _id(v: object) -> str | None:
    return {F32: "f32", BF16: "bf16", torch.float64: "f64"}.get(v) if isinstance(v, torch.dtype) else None


KERNEL_MODULES = ("_launch", "pack", "outer_merge", "mask_indices", "sparse", "fragment_norms")


def _jitted(mod) -> dict:
    from triton.runtime.jit import KernelInterface

    return {k: v for k, v in vars(mod).items() if isinstance(v, KernelInterface)}


def _forget_kernel_modules() -> None:
    """Drop the kernel modules from sys.modules: the next import decorates their kernels anew (the
    ops import the launchers inside each call, so they pick up the new modules)."""
    for name in KERNEL_MODULES:
        sys.modules.pop(f"lowcomm_kernels.triton_kernels.{name}", None)


@pytest.fixture(scope="module", autouse=True)
def kernels():
    """The kernel modules, decorated under the interpreter, for this module only.

    TRITON_INTERPRET is set here rather than at import: Triton reads it when a kernel is
    *decorated*, and `import triton` has already happened by then anyway (conftest imports
    lowcomm_kernels -> torch.library -> torch._dynamo, which probes for Triton), so setting it at
    the top of this file would not reach triton.language; what matters is that our kernel modules
    are decorated with it set (they use only builtins, see ``_launch.block_sum``). Set at import,
    it would also leak into the collection of later test files (``_dispatch`` would offer
    backend="triton" on CPU there). Teardown restores the variable and drops the interpreted
    modules, so a later import decorates them for whatever mode is then current."""
    from triton.runtime.interpreter import InterpretedFunction

    saved = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        _forget_kernel_modules()  # imported earlier without the variable: compiled-mode kernels
        mods = {
            name: importlib.import_module(f"lowcomm_kernels.triton_kernels.{name}") for name in KERNEL_MODULES
        }
        for name, mod in mods.items():
            funcs = _jitted(mod)
            assert name == "_launch" or any(k.endswith("_kernel") for k in funcs), f"{name}: no _<op>_kernel"
            assert all(isinstance(f, InterpretedFunction) for f in funcs.values()), f"{name}: not interpreted"
        assert _dispatch.resolve("triton", torch.device("cpu")) == "triton"
        yield mods
    finally:
        _forget_kernel_modules()
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved


def _randn(n: int, rng: torch.Generator, scale: float = 1.0) -> torch.Tensor:
    return torch.randn(n, generator=rng, dtype=F32) * scale


def _same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


# ---- pack -----------------------------------------------------------------------------------------


@pytest.mark.parametrize("n", SIZES)
def test_pack_matches_ref(n, rng):
    g, x = _randn(n, rng), _randn(n, rng)
    g0, x0 = g.clone(), x.clone()
    delta, snap, nonfinite = pack(g, x, backend="triton")
    ref_delta, ref_snap, ref_nf = pack_ref(g0, x0)
    assert _same_bits(delta, ref_delta), "g - x is one IEEE subtraction: bit-identical"
    assert _same_bits(snap, ref_snap)
    assert nonfinite.dtype == torch.int64 and nonfinite.dim() == 0 and int(nonfinite) == int(ref_nf) == 0
    assert _same_bits(g, g0) and _same_bits(x, x0), "inputs are read-only"
    delta2, snap2, _ = pack(g, x, snapshot_out=False, backend="triton")
    assert snap2 is None and _same_bits(delta2, ref_delta)


@numpy_overflow_ok
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
@pytest.mark.parametrize("n", [1, 7, BIG])
def test_pack_bf16_wire_is_torchs_rounding(n, dtype, rng):
    """No scalar enters pack, so fp64 is exact under the interpreter too; the fp64 case checks
    the rounding through fp32 that torch does (1 + 2^-8 + 2^-30 -> 1, not 1 + 2^-7). NaN bits
    are compared too: the interpreter path claims 0x7FC0 for every NaN."""
    # Magnitudes from 1e-40 (bf16 subnormals) to 3e38 (near bf16's max), plus crafted ties.
    mag = torch.logspace(-40, 38.4, n, dtype=torch.float64)[torch.randperm(n, generator=rng)]
    g = (torch.randn(n, generator=rng, dtype=torch.float64) * mag).to(dtype)
    x = torch.zeros(n, dtype=dtype) if n < 7 else (g * 2.0**-9).to(dtype)
    if n >= 7:
        special = [1.0 + 2.0**-8, 1.0 + 3 * 2.0**-8, -(1.0 + 2.0**-8), 3e38, 3.4e38, -3.4e38, float("nan")]
        if dtype == torch.float64:
            special[:2] = [1.0 + 2.0**-8 + 2.0**-30, 1e39]
        g[:7] = torch.tensor(special, dtype=dtype)
        x[:7] = 0.0
    if n == BIG:  # NaNs of every sign and payload, and inf - inf
        g[7:11], x[7:11] = nan_payloads(dtype), 1.0
        g[11], x[11] = float("inf"), float("inf")
    delta, _, nonfinite = pack(g, x, wire_dtype=BF16, snapshot_out=False, backend="triton")
    expected = (g - x).to(BF16)
    # torch's bits except NaNs, and every NaN 0x7FC0, c10's scalar rounding (torch's own CPU
    # conversion writes 0xFFFF or 0x7FC0 depending on where the element falls in its loop).
    assert_bf16_wire(delta, expected, "triton", msg=f"{dtype}")
    assert int(nonfinite) == int((~torch.isfinite(expected)).sum()) == int(pack_ref(g, x, wire_dtype=BF16)[2])
    if n >= 7:
        assert int(nonfinite) >= 3  # 3.4e38 and -3.4e38 overflow the bf16 wire, plus the NaN


@numpy_overflow_ok
def test_pack_counts_nonfinite(rng):
    n = 200003  # several programs, so the per-program atomic adds are exercised
    g, x = _randn(n, rng), _randn(n, rng)
    picks = torch.randperm(n, generator=rng)[:54]
    g[picks[:10]] = float("nan")
    g[picks[10:20]] = float("inf")
    x[picks[20:30]] = float("-inf")
    g[picks[30:40]] = float("inf")
    x[picks[30:40]] = float("inf")  # inf - inf = nan
    g[picks[40:50]] = 3e38
    x[picks[40:50]] = -3e38  # finite operands, the fp32 difference overflows
    g[picks[50:54]] = nan_payloads(F32)
    delta, snap, nonfinite = pack(g, x, backend="triton")
    ref_delta, _, ref_nonfinite = pack_ref(g, x)
    assert int(nonfinite) == 54 == int(ref_nonfinite) == int((~torch.isfinite(delta)).sum())
    assert _same_bits(delta, ref_delta), "one IEEE subtraction on the same CPU: the same bits, NaNs included"
    assert _same_bits(snap, x)


# ---- outer_merge -------------------------------------------------------------------------------

MERGE_MODES = {
    "nesterov-overwrite": dict(lr=0.7, momentum=0.9, nesterov=True),
    "heavyball-mix": dict(lr=0.7, momentum=0.9, nesterov=False, alpha=0.5),
    "sgd-delaycorrected": dict(lr=1.0, momentum=0.0, beta=1.0),
    "taylor-absolute": dict(lr=0.7, momentum=0.9, beta=1.0, lam=0.5, alpha=0.25),
    "taylor-normalized": dict(lr=0.7, momentum=0.9, beta=1.0, lam=0.5, lam_mode="normalized"),
}


def _merge_inputs(n: int, rng: torch.Generator, avg_dtype: torch.dtype):
    g = _randn(n, rng)
    x_sent = g + _randn(n, rng, 0.3)  # a worker's snapshot near g
    x = x_sent + _randn(n, rng, 0.3)  # its progress during the overlap: v = O(0.3), D = O(1)
    u = _randn(n, rng, 0.1)
    avg = _randn(n, rng, 0.3).to(avg_dtype)  # bf16: loaded and widened (exact) by the kernel
    return g, u, avg, x, x_sent


@pytest.mark.parametrize(
    "n,mode,avg_dtype",
    _grid(
        SIZES,
        list(MERGE_MODES),
        [F32, BF16],
        big_only=[(m, F32) for m in MERGE_MODES]
        + [("nesterov-overwrite", BF16), ("taylor-normalized", BF16)],
    ),
    ids=_id,
)
def test_outer_merge_matches_ref(n, mode, avg_dtype, rng, close):
    kw = MERGE_MODES[mode]
    got = _merge_inputs(n, rng, avg_dtype)
    want = [t.clone() for t in got]
    sent_arg = got[4] if kw.get("beta", 0.0) or kw.get("lam", 0.0) else None
    outer_merge_(*got[:4], sent_arg, backend="triton", **kw)
    outer_merge_ref(*want[:4], want[4] if sent_arg is not None else None, **kw)
    for name, a, b in zip(("g", "u", "delta_avg", "x", "x_sent"), got, want, strict=True):
        if name in ("delta_avg", "x_sent") or (name == "u" and kw["momentum"] == 0.0):
            assert _same_bits(a, b), f"{name} must not be written"
        else:
            close.assert_close(a, b, "elementwise", msg=f"{name} ({mode})")


@pytest.mark.parametrize("avg_dtype", [F32, BF16], ids=_id)
@pytest.mark.parametrize("mode", [m for m in MERGE_MODES if "normalized" not in m])
def test_elementwise_kernels_round_like_torch(mode, avg_dtype, rng):
    """Stronger than the tolerance above, and what the kernels are built for: with contraction
    off and torch's two FMAs (add with alpha) spelled out, outer_merge and the scatter-merge round
    op for op as the reference does, so fp32 results are bit-identical (as the csrc CPU kernels
    are). If a torch release changes how it rounds SGD, this test is the one that says so.
    (Normalized λ is excluded: its λ_eff comes from a reduction summed in another order.)"""
    n = 70001  # two programs: a full block and a masked tail
    kw = MERGE_MODES[mode]
    got = _merge_inputs(n, rng, avg_dtype)
    want = [t.clone() for t in got]
    sent = kw.get("beta", 0.0) or kw.get("lam", 0.0)
    outer_merge_(*got[:4], got[4] if sent else None, backend="triton", **kw)
    outer_merge_ref(*want[:4], want[4] if sent else None, **kw)
    for i, name in ((0, "g"), (1, "u"), (3, "x")):
        a, b = got[i], want[i]
        assert _same_bits(a, b), f"{name}: {int((a != b).sum())} of {n} differ from the reference ({mode})"
    idx = 2 * torch.arange(n // 2) + torch.randint(0, 2, (n // 2,), generator=rng)
    avg, sent_k = _randn(n // 2, rng).to(avg_dtype), _randn(n // 2, rng)
    x, x_ref = got[3].clone(), got[3].clone()
    sparse_scatter_merge_(x, idx, avg, sent_k, beta=0.7, backend="triton")
    sparse_scatter_merge_ref(x_ref, idx, avg, sent_k, beta=0.7)
    assert _same_bits(x, x_ref), "scatter-merge differs from the reference"


@pytest.mark.parametrize("nesterov", [True, False])
@pytest.mark.parametrize("momentum", [0.0, 0.9])
@pytest.mark.parametrize("n", SIZES)
def test_taylor_norms_matches_ref(n, momentum, nesterov, rng, close, kernels):
    """Every term is formed exactly as the reference forms it (g_new rounds op for op like torch,
    then v and D widen to fp64), so only the summation order differs: a "reduction" tolerance.
    Also the GPU's split over several programs plus the ordered finishing sum (forced here with
    programs=3): it adds into `out` and repeats bit for bit."""
    g, u, avg, x, x_sent = _merge_inputs(n, rng, F32)
    before = [t.clone() for t in (g, u, avg, x, x_sent)]
    launch = kernels["outer_merge"].launch_taylor_norms
    out = torch.zeros(2, dtype=torch.float64)
    launch(g, u, avg, x, x_sent, 0.7, momentum, nesterov, out)
    ref = taylor_norms_ref(g, u, avg, x, x_sent, lr=0.7, momentum=momentum, nesterov=nesterov)
    close.assert_close(out, ref, "reduction", n=n, msg="[sum v^2, sum (v*v*D)^2]")
    for a, b in zip((g, u, avg, x, x_sent), before, strict=True):
        assert _same_bits(a, b), "taylor_norms writes nothing but out"
    if n > 1:
        split, again = torch.zeros(2, dtype=torch.float64), torch.zeros(2, dtype=torch.float64)
        launch(g, u, avg, x, x_sent, 0.7, momentum, nesterov, split, programs=3)
        launch(g, u, avg, x, x_sent, 0.7, momentum, nesterov, again, programs=3)
        assert _same_bits(split, again), "taylor_norms must repeat bit for bit"
        close.assert_close(split, ref, "reduction", n=n, msg="programs=3")
        added = torch.tensor([0.5, 0.25], dtype=torch.float64)
        expected = added + split  # the kernel adds its sum into out: one fp64 addition
        launch(g, u, avg, x, x_sent, 0.7, momentum, nesterov, added, programs=3)
        assert _same_bits(added, expected), "taylor_norms must add into out"


LAM_SUM_MODES = {
    "taylor": dict(lr=0.7, momentum=0.9, nesterov=True, alpha=0.0, beta=1.0, lam=0.5),
    "taylor-mix": dict(lr=0.7, momentum=0.9, nesterov=False, alpha=0.25, beta=1.0, lam=0.5),
    "lam-only": dict(lr=1.0, momentum=0.0, nesterov=True, alpha=0.0, beta=0.0, lam=0.5),
}


@pytest.mark.parametrize("mode", list(LAM_SUM_MODES))
@pytest.mark.parametrize("n", [1, 7, 70001])
def test_outer_merge_normalizes_lam_on_the_device(n, mode, rng, close, kernels):
    """launch_outer_merge(..., lam, lam_sums) forms λ_eff from the device sums itself: bit for
    bit what the host path (lam_effective(λ, sums) read back, then an absolute-λ launch) gives
    from the same sums, and within the elementwise tolerance of the reference (whose sums come
    in another order)."""
    kw = LAM_SUM_MODES[mode]
    mod = kernels["outer_merge"]
    scalars = (kw["lr"], kw["momentum"], kw["nesterov"], kw["alpha"], kw["beta"])
    inputs = _merge_inputs(n, rng, F32)
    sums = torch.zeros(2, dtype=torch.float64)
    mod.launch_taylor_norms(*inputs, *scalars[:3], sums)
    on_device = [t.clone() for t in inputs]
    mod.launch_outer_merge(*on_device, *scalars, kw["lam"], sums)
    host = [t.clone() for t in inputs]
    mod.launch_outer_merge(*host, *scalars, lam_effective(kw["lam"], sums))
    for name, a, b in zip(("g", "u", "delta_avg", "x", "x_sent"), on_device, host, strict=True):
        assert _same_bits(a, b), f"{name}: λ_eff on the device differs from the host's ({mode})"
    want = [t.clone() for t in inputs]
    outer_merge_ref(*want, **kw, lam_mode="normalized")
    for i, name in ((0, "g"), (1, "u"), (3, "x")):
        close.assert_close(on_device[i], want[i], "elementwise", msg=f"{name} ({mode})")


def test_outer_merge_lam_sums_zero_correction(rng, kernels):
    """s1 = Σ(v⊙v⊙D)² = 0 gives λ_eff = 0; with β = 0 the reference then leaves the v terms out
    entirely, so a −0 in g_new reaches x as −0 (g + 0·v would make it +0, and +0 + 0·x stays +0).
    λ = 0 ignores the sums."""
    n = 33
    mod = kernels["outer_merge"]
    g = torch.full((n,), -0.0)
    u = torch.zeros(n)
    avg = torch.zeros(n)  # g_new = g − η·0 = −0
    x = -1.0 - _randn(n, rng).abs()  # x < 0, so the α-mix adds 0·x = −0, which keeps a −0 target
    x_sent = x - 1.0  # v = 1 > 0: g + 0·v would be +0
    sums = torch.tensor([float(n), 0.0], dtype=torch.float64)
    got = [t.clone() for t in (g, u, avg, x, x_sent)]
    mod.launch_outer_merge(*got, 0.5, 0.9, True, 0.0, 0.0, 0.5, sums)
    want = [t.clone() for t in (g, u, avg, x, x_sent)]
    outer_merge_ref(*want[:4], None, lr=0.5, momentum=0.9, nesterov=True)  # λ = β = 0
    assert _same_bits(got[3], want[3]) and bool(torch.signbit(got[3]).all()), "x must be g_new = −0"
    assert _same_bits(got[0], want[0])
    zero_lam = [t.clone() for t in (g, u, avg, x, x_sent)]
    mod.launch_outer_merge(
        *zero_lam, 0.5, 0.9, True, 0.0, 0.0, 0.0, torch.full((2,), float("nan"), dtype=torch.float64)
    )
    assert _same_bits(zero_lam[3], want[3]), "λ = 0: the sums are not read"


def test_outer_merge_rejects_bad_lam_sums(kernels):
    g, u, avg, x, s = (torch.randn(8) for _ in range(5))
    for bad in (
        torch.zeros(2),
        torch.zeros(3, dtype=torch.float64),
        torch.zeros(1, 2, 1, dtype=torch.float64)[0, :1],
    ):
        with pytest.raises(ValueError, match="lam_sums"):
            kernels["outer_merge"].launch_outer_merge(g, u, avg, x, s, 0.7, 0.9, True, 0.0, 1.0, 0.5, bad)


# ---- mask_indices ------------------------------------------------------------------------------

MASK_CASES = [
    (0, 0),
    (1, 0),
    (1, 1),
    (7, 7),
    (7, 3),
    (BIG, BIG),
    (BIG, 1000),
    (2**31 + 11, 5000),
    (2**40 + 5, 1000),
    (2**62, 100),
]


@pytest.mark.parametrize("n,k", MASK_CASES, ids=[f"n{n}-k{k}" for n, k in MASK_CASES])
def test_mask_perm_bit_identical(n, k, rng, kernels):
    seed, rnd = (int(v) for v in torch.randint(0, 2**62, (2,), generator=rng))
    keys = mask_keys(seed, rnd, n)
    out = torch.full((k,), -1, dtype=torch.int64)
    kernels["mask_indices"].launch_mask_perm(n, k, *keys, out)
    ref = mask_perm_ref(n, k, keys)
    first_bad = (out != ref).nonzero()[:1].tolist()
    assert torch.equal(out, ref), f"seed={seed} round={rnd}: first mismatch at {first_bad}"
    got = mask_indices(seed, rnd, n, k, backend="triton")
    # mask_indices_ref is sort(mask_perm_ref): reuse `ref` at 1M (the ref's walk takes seconds).
    assert torch.equal(got, torch.sort(ref).values if k == BIG else mask_indices_ref(seed, rnd, n, k))
    if k == n:
        assert torch.equal(got, torch.arange(n)), "k = n must give a permutation of [0, n)"


# ---- sparse gather / scatter-merge ------------------------------------------------------------


@pytest.mark.parametrize("k", SIZES)
def test_sparse_gather_matches_ref(k, rng):
    n = max(2 * k, 1)
    x = _randn(n, rng)
    idx = torch.randint(0, n, (k,), generator=rng)  # duplicates allowed for a gather
    out = torch.full((k,), 7.0)
    got = sparse_gather(x, idx, out=out, backend="triton")
    assert got is out and _same_bits(got, x[idx])


@pytest.mark.parametrize(
    "k,beta,avg_dtype",
    _grid(SIZES, [0.0, 1.0, 0.7], [F32, BF16], big_only=[(1.0, F32), (0.7, BF16)]),
    ids=_id,
)
def test_sparse_scatter_merge_matches_ref(k, beta, avg_dtype, rng, close):
    n = max(2 * k, 1)
    x = _randn(n, rng)
    # Strictly increasing and random: one of each pair (2j, 2j+1) (randperm + sort costs ~1 s here).
    idx = 2 * torch.arange(k) + torch.randint(0, 2, (k,), generator=rng)
    avg, sent = _randn(k, rng).to(avg_dtype), _randn(k, rng)
    want = x.clone()
    sparse_scatter_merge_ref(want, idx, avg, sent, beta=beta)
    sparse_scatter_merge_(x, idx, avg, sent, beta=beta, backend="triton")
    close.assert_close(x[idx], want[idx], "elementwise", msg="merged entries")
    untouched = torch.ones(n, dtype=torch.bool)
    untouched[idx] = False
    assert _same_bits(x[untouched], want[untouched]), "entries outside idx must not change"


def test_sparse_ops_unchecked_match_checked(rng):
    """check_values=False (the runtime's call) launches the same kernels on the same data."""
    n, k = 70001, 5001
    x = _randn(n, rng)
    idx = mask_indices(3, 4, n, k)
    assert _same_bits(
        sparse_gather(x, idx, backend="triton", check_values=False), sparse_gather(x, idx, backend="triton")
    )
    avg, sent = _randn(k, rng), _randn(k, rng)
    a, b = x.clone(), x.clone()
    sparse_scatter_merge_(a, idx, avg, sent, beta=0.7, backend="triton", check_values=False)
    sparse_scatter_merge_(b, idx, avg, sent, beta=0.7, backend="triton")
    assert _same_bits(a, b)
    offsets = torch.tensor([0, 10, 10, 40000, n])
    assert _same_bits(
        fragment_norms(x, offsets, backend="triton", check_values=False),
        fragment_norms(x, offsets, backend="triton"),
    )


# ---- fragment_norms ----------------------------------------------------------------------------


def _offsets(n: int, rng: torch.Generator) -> torch.Tensor:
    """Random cut points, plus an empty leading/middle/trailing segment and the whole buffer."""
    cuts = torch.sort(torch.randint(0, n + 1, (5,), generator=rng)).values
    return torch.cat([torch.tensor([0, 0]), cuts, cuts[-1:], torch.tensor([n, n])])


@pytest.mark.parametrize("ord", [1, 2])
@pytest.mark.parametrize("n", SIZES)
def test_fragment_norms_matches_ref_and_repeats(n, ord, rng, close, kernels):
    buf = _randn(n, rng, 3.0)
    offsets = _offsets(n, rng)
    got = fragment_norms(buf, offsets, ord=ord, backend="triton")
    ref = fragment_norms_ref(buf, offsets, ord=ord)
    seg = int((offsets[1:] - offsets[:-1]).max())
    close.assert_close(got, ref, "reduction", n=seg, msg=f"ord {ord}")
    again = fragment_norms(buf, offsets, ord=ord, backend="triton")
    assert _same_bits(got, again), "fragment_norms must be bit-identical from call to call"
    # The launcher's own float64 output, before the cast to buf's dtype, against fp64 sums.
    raw = torch.full((offsets.numel() - 1,), -1.0, dtype=torch.float64)
    kernels["fragment_norms"].launch_fragment_norms(buf, offsets, ord, raw)
    ref64 = torch.stack(
        [
            torch.linalg.vector_norm(buf[a:b].double(), ord=ord)
            for a, b in zip(offsets[:-1].tolist(), offsets[1:].tolist(), strict=True)
        ]
    )
    close.assert_close(raw, ref64, "reduction", n=seg, msg=f"ord {ord}, float64")
    raw2 = torch.empty_like(raw)
    kernels["fragment_norms"].launch_fragment_norms(buf, offsets, ord, raw2)
    assert _same_bits(raw, raw2)


@pytest.mark.parametrize("ord", [1, 2])
def test_fragment_norms_two_stage(ord, rng, close, kernels):
    """The GPU's split of each segment over P programs plus the ordered finishing sum (P > 1 is
    chosen only on a GPU), forced here: same norms within the reduction tolerance, bit-identical
    from call to call for a fixed P."""
    n = BIG
    buf = _randn(n, rng, 3.0)
    offsets = _offsets(n, rng)
    seg = int((offsets[1:] - offsets[:-1]).max())
    launch = kernels["fragment_norms"].launch_fragment_norms
    one = torch.empty(offsets.numel() - 1, dtype=torch.float64)
    launch(buf, offsets, ord, one, programs=1)
    for P in (2, 3):
        split, again = torch.full_like(one, -1.0), torch.full_like(one, -1.0)
        launch(buf, offsets, ord, split, programs=P)
        launch(buf, offsets, ord, again, programs=P)
        assert _same_bits(split, again), f"P={P}: not repeatable"
        close.assert_close(split, one, "reduction", n=seg, msg=f"P={P} vs P=1, ord {ord}")


def test_fragment_norms_no_segments():
    buf = torch.ones(5)
    assert fragment_norms(buf, torch.tensor([3]), backend="triton").shape == (0,)


# ---- the registered ops with backend="triton": schema, fake and AOT-dispatch checks -----------


def _opcheck_cases():
    g, x, u, avg, xs = (torch.randn(100, dtype=F32) for _ in range(5))
    idx = torch.arange(0, 100, 3)
    yield "pack", torch.ops.lowcomm.pack.default, (g, x, torch.empty(100), torch.empty(100), "triton")
    yield (
        "outer_merge_",
        torch.ops.lowcomm.outer_merge_.default,
        (g.clone(), u.clone(), avg, x.clone(), xs, 0.7, 0.9, True, 0.5, 1.0, 0.5, "normalized", "triton"),
    )
    yield (
        "mask_indices",
        torch.ops.lowcomm.mask_indices.default,
        (1, 2, 1000, 100, torch.device("cpu"), "triton"),
    )
    yield "sparse_gather", torch.ops.lowcomm.sparse_gather.default, (x, idx, torch.empty(34), "triton")
    yield (
        "sparse_scatter_merge_",
        torch.ops.lowcomm.sparse_scatter_merge_.default,
        (x.clone(), idx, torch.randn(34), torch.randn(34), 0.7, "triton"),
    )
    yield (
        "fragment_norms",
        torch.ops.lowcomm.fragment_norms.default,
        (g, torch.tensor([0, 10, 10, 100]), 2, "triton"),
    )


@pytest.mark.parametrize("case", list(_opcheck_cases()), ids=lambda c: c[0])
def test_opcheck_with_triton_backend(case):
    """The ops launch the Triton kernels directly from a custom_op body (a triton_op fails opcheck
    on CPU under the interpreter); opcheck runs them for real under the interpreter."""
    _, op, args = case
    torch.library.opcheck(op, args)


# ---- launchers: n == 0 is a no-op, nothing allocated or written ------------------------------


def test_launchers_accept_empty(kernels):
    e = torch.empty(0)
    nf = torch.zeros((), dtype=torch.int64)
    kernels["pack"].launch_pack(e, e.clone(), e.clone(), None, nf)
    assert int(nf) == 0
    kernels["outer_merge"].launch_outer_merge(
        e, e.clone(), e.clone(), e.clone(), None, 1.0, 0.9, True, 0.0, 0.0, 0.0
    )
    out = torch.zeros(2, dtype=torch.float64)
    kernels["outer_merge"].launch_taylor_norms(
        e, e.clone(), e.clone(), e.clone(), e.clone(), 1.0, 0.9, True, out
    )
    assert torch.equal(out, torch.zeros(2, dtype=torch.float64))
    kernels["outer_merge"].launch_outer_merge(
        e, e.clone(), e.clone(), e.clone(), e.clone(), 1.0, 0.9, True, 0.0, 1.0, 0.5, out
    )
    kernels["mask_indices"].launch_mask_perm(5, 0, *mask_keys(1, 2, 5), torch.empty(0, dtype=torch.int64))
    idx = torch.empty(0, dtype=torch.int64)
    kernels["sparse"].launch_sparse_gather(torch.ones(3), idx, e)
    x = torch.ones(3)
    kernels["sparse"].launch_sparse_scatter_merge(x, idx, e, e.clone(), 1.0)
    assert torch.equal(x, torch.ones(3))
    norms = torch.full((2,), -1.0, dtype=torch.float64)
    kernels["fragment_norms"].launch_fragment_norms(e, torch.zeros(3, dtype=torch.int64), 2, norms)
    assert torch.equal(norms, torch.zeros(2, dtype=torch.float64)), "empty segments have norm 0"
