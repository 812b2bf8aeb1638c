"""mask_indices: exactly k distinct sorted indices in [0, n), identical across backends, calls and
processes, and uniform (chi-square over many rounds, with a check that the test can fail)."""

from __future__ import annotations

import itertools
import json
import math
import os
import subprocess
import sys

import pytest
import torch

from lowcomm_kernels.ops import mask_indices, mask_indices_ref, mask_keys
from lowcomm_kernels.ops.mask_indices import mask_perm_ref

pytestmark = pytest.mark.op("mask_indices")

CASES = [
    (0, 0),
    (1, 0),
    (1, 1),
    (2, 1),
    (7, 3),
    (7, 7),
    (1000, 0),
    (1000, 1),
    (1000, 999),
    (1000, 1000),
    (1 << 20, 5),
    ((1 << 20) + 1, 4097),
    (1000003, 70001),
    (1 << 40, 1000),
]


@pytest.mark.parametrize(("n", "k"), CASES, ids=[f"n{n}-k{k}" for n, k in CASES])
def test_k_distinct_sorted_in_range_and_equal_to_ref(device, backend, n, k, rng):
    seed = int(torch.randint(0, 2**62, (), generator=rng))
    rnd = int(torch.randint(0, 2**31, (), generator=rng))
    idx = mask_indices(seed, rnd, n, k, device=device, backend=backend)
    assert idx.dtype == torch.int64 and idx.shape == (k,) and idx.device.type == device
    idx = idx.cpu()
    if k:
        assert int(idx[0]) >= 0 and int(idx[-1]) < n
        assert bool((idx[1:] > idx[:-1]).all()), "sorted and distinct"
    if k == n:
        assert torch.equal(idx, torch.arange(n))
    assert torch.equal(idx, mask_indices_ref(seed, rnd, n, k)), "every backend computes the ref's set"
    assert torch.equal(idx, mask_indices(seed, rnd, n, k, device=device, backend=backend).cpu()), (
        "same on a 2nd call"
    )


def test_rounds_and_seeds_give_different_sets(backend):
    sets = {
        tuple(mask_indices(s, r, 10000, 50, backend=backend).tolist()) for s in range(3) for r in range(20)
    }
    assert len(sets) == 60


def test_prefix_property(backend):
    """S(k) ⊂ S(k+1): the first k images of one permutation (so a larger density only adds indices)."""
    small = set(mask_indices(5, 9, 5000, 100, backend=backend).tolist())
    large = set(mask_indices(5, 9, 5000, 300, backend=backend).tolist())
    assert small < large


def test_seed_and_round_accept_tensors_and_large_values(backend):
    a = mask_indices(torch.tensor(2**63 - 1), torch.tensor(7), 100, 10, backend=backend)
    assert torch.equal(a, mask_indices(2**63 - 1, 7, 100, 10, backend=backend))


_CHILD = r"""
import json, sys
from lowcomm_kernels import _dispatch
from lowcomm_kernels.ops import mask_indices
args = json.loads(sys.argv[1])
out = {b: [mask_indices(*a, backend=b).tolist() for a in args] for b in json.loads(sys.argv[2])}
print(json.dumps(out))
"""


@pytest.mark.slow
def test_same_sets_in_another_process(tmp_path, backends_for):
    """No process state (hash seeds, RNG, thread count) enters the set: a fresh interpreter with a
    different PYTHONHASHSEED and one OpenMP thread computes the same indices on every backend."""
    backends = backends_for(("mask_indices",))
    args = [(0, 0, 1000, 17), (12345, 678, 1000003, 5000), (2**40, 3, 7, 7), (9, 9, 1 << 33, 64)]
    env = dict(os.environ, PYTHONHASHSEED="4321", OMP_NUM_THREADS="1")
    env.pop("TRITON_INTERPRET", None)
    res = subprocess.run(
        [sys.executable, "-c", _CHILD, json.dumps(args), json.dumps(backends)],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    child = json.loads(res.stdout.strip().splitlines()[-1])
    for b in backends:
        for a, theirs in zip(args, child[b], strict=True):
            assert theirs == mask_indices_ref(*a).tolist(), (b, a)


# ---- uniformity ---------------------------------------------------------------------------------

Z_1E6 = 4.7534  # one-sided standard normal quantile for p = 1e-6


def chi2_threshold(df: int, z: float = Z_1E6) -> float:
    """Upper quantile of χ²_df by the Wilson–Hilferty approximation (χ²/df)^(1/3) ≈ N(1 − 2/(9df),
    2/(9df)); accurate to a few % for df >= 10, and p = 1e-6 keeps a correct sampler from ever
    failing on the fixed seeds used here."""
    h = 2.0 / (9.0 * df)
    return df * (1.0 - h + z * math.sqrt(h)) ** 3


def marginal_chi2(sample, n: int, k: int, rounds: int) -> float:
    """χ² of the inclusion counts of each index over `rounds` k-subsets of [0, n).

    Each round's inclusion vector has Var = p(1−p) and Cov = −p(1−p)/(n−1) (p = k/n: sampling
    without replacement), i.e. covariance p(1−p)·n/(n−1)·(I − 11ᵀ/n); so
    X² = (n−1)/n · Σ (O − E)² / (R·p(1−p)) is χ² with n−1 degrees of freedom for a uniform sampler.
    """
    counts = torch.zeros(n, dtype=torch.float64)
    for r in range(rounds):
        counts.index_add_(0, sample(r), torch.ones(k, dtype=torch.float64))
    p = k / n
    expected = rounds * p
    return (n - 1) / n * float(((counts - expected) ** 2).sum()) / (rounds * p * (1 - p))


def subset_chi2(sample, n: int, k: int, rounds: int) -> tuple[float, int]:
    """Pearson χ² of which of the C(n, k) subsets each round drew: exactly multinomial."""
    index = {c: i for i, c in enumerate(itertools.combinations(range(n), k))}
    counts = torch.zeros(len(index), dtype=torch.float64)
    for r in range(rounds):
        counts[index[tuple(sample(r).tolist())]] += 1
    expected = rounds / len(index)
    return float(((counts - expected) ** 2).sum()) / expected, len(index) - 1


def mod_folded_sampler(seed: int, n: int, k: int):
    """A classic bug: fold the power-of-two permutation with `% n` instead of cycle walking.
    Values below 2^b − n get two chances, so the sample is biased towards them."""

    def sample(r: int) -> torch.Tensor:
        adds, muls, shift, bitmask = mask_keys(seed, r, n)
        perm = mask_perm_ref(bitmask + 1, bitmask + 1, (adds, muls, shift, bitmask)) % n
        picked = list(dict.fromkeys(perm.tolist()))[:k]
        return torch.tensor(sorted(picked), dtype=torch.int64)

    return sample


MARGINAL = [(37, 5, 2000), (64, 16, 800), (1000, 10, 1500)]


@pytest.mark.parametrize(("n", "k", "rounds"), MARGINAL, ids=[f"n{n}-k{k}" for n, k, _ in MARGINAL])
def test_marginal_uniformity(backend, n, k, rounds):
    stat = marginal_chi2(lambda r: mask_indices(20260517, r, n, k, backend=backend), n, k, rounds)
    assert stat < chi2_threshold(n - 1), (stat, chi2_threshold(n - 1))


def test_subset_uniformity(backend):
    """Every one of the C(10, 3) = 120 subsets is equally likely (3000 rounds, 25 expected each)."""
    stat, df = subset_chi2(lambda r: mask_indices(777, r, 10, 3, backend=backend), 10, 3, 3000)
    assert stat < chi2_threshold(df), (stat, chi2_threshold(df))


def test_chi2_tests_reject_a_biased_sampler():
    """The statistics above have power: the %-n folding bug fails both, by a wide margin."""
    n, k, rounds = MARGINAL[0]
    stat = marginal_chi2(mod_folded_sampler(20260517, n, k), n, k, rounds)
    assert stat > 3 * chi2_threshold(n - 1), stat
    stat, df = subset_chi2(mod_folded_sampler(777, 10, 3), 10, 3, 3000)
    assert stat > 2 * chi2_threshold(df), stat


def test_wilson_hilferty_threshold():
    """The approximation is within 1% of the exact quantile (and errs on the conservative side)."""
    stats = pytest.importorskip("scipy.stats")
    for df in (36, 63, 119, 999):
        exact = float(stats.chi2.isf(1e-6, df))
        assert exact <= chi2_threshold(df) < 1.01 * exact, df


# ---- bad input ---------------------------------------------------------------------------------

BAD = [
    ("k > n", (1, 2, 10, 11), ValueError, "k"),
    ("k < 0", (1, 2, 10, -1), ValueError, "k"),
    ("n < 0", (1, 2, -1, 0), ValueError, "n"),
    ("n huge", (1, 2, (1 << 62) + 1, 1), ValueError, "n"),
    ("seed < 0", (-1, 2, 10, 3), ValueError, "seed"),
    ("round < 0", (1, -2, 10, 3), ValueError, "round"),
    ("seed 2**64", (2**64, 2, 10, 3), ValueError, "seed"),
    ("seed 2**63", (2**63, 2, 10, 3), ValueError, "seed"),
    ("round 2**64", (1, 2**64, 10, 3), ValueError, "round"),
    ("seed float", (1.5, 2, 10, 3), TypeError, "seed"),
    ("round bool", (1, True, 10, 3), TypeError, "round"),
    ("n float", (1, 2, 10.0, 3), TypeError, "n"),
    ("k str", (1, 2, 10, "3"), TypeError, "k"),
    ("k float tensor", (1, 2, 10, torch.tensor(3.0)), TypeError, "k"),
]


@pytest.mark.parametrize(("what", "args", "exc", "arg"), BAD, ids=[b[0] for b in BAD])
def test_bad_input(backend, what, args, exc, arg, close):
    close.assert_rejected(lambda: mask_indices(*args, backend=backend), exc, arg)


@pytest.mark.parametrize("arg", ["seed", "round"])
def test_keys_beyond_int64_are_refused_with_the_range(arg):
    """seed = 2**64 once gave the set of seed 0 (keys were reduced mod 2**64). Keys are int64, as
    the registered op and a 0-d tensor carry them: the error names the argument and the range."""
    for bad in (2**63, 2**64, 2**64 + 5):
        kw = dict(seed=1, round=2, n=10, k=3) | {arg: bad}
        with pytest.raises(ValueError, match=rf"^{arg} must be in \[0, {2**63 - 1}\].*got {bad}$"):
            mask_indices(**kw)
    top = dict(seed=1, round=2) | {arg: 2**63 - 1}
    assert mask_indices(top["seed"], top["round"], 1000, 10).shape == (10,)


def test_bad_backend(close):
    close.assert_rejected(lambda: mask_indices(1, 2, 10, 3, backend="cuda"), ValueError, "backend")
    close.assert_rejected(lambda: mask_indices(1, 2, 10, 3, backend="fast"), ValueError, "backend")
