"""The studies' statistics (train.stats) on numbers worked out by hand or by the textbook."""

from __future__ import annotations

import math

import pytest

from lowcomm_kernels.train import stats


def test_paired_on_known_numbers():
    p = stats.paired([1.0, 2.0, 3.0, 4.0, None], [0.0, 0.0, 0.0, 0.0, 7.0])  # the None pair is dropped
    assert (p.n, p.df) == (4, 3)
    assert p.mean == pytest.approx(2.5)
    assert p.std == pytest.approx(math.sqrt(5 / 3))
    assert p.t == pytest.approx(2.5 / (math.sqrt(5 / 3) / 2))  # 3.8730
    assert p.p == pytest.approx(0.030466, abs=2e-6)  # two-sided, Student's t with 3 df
    half = 3.182446 * math.sqrt(5 / 3) / 2  # t_{0.975, 3} · s/√n
    assert (p.ci_low, p.ci_high) == (pytest.approx(2.5 - half, abs=1e-5), pytest.approx(2.5 + half, abs=1e-5))
    assert p.sign_p == pytest.approx(2 / 16)  # 4 of 4 positive: 2 · (1/2)^4
    assert p.detectable == pytest.approx((3.182446 + 0.978472) * math.sqrt(5 / 3) / 2, abs=1e-5)


def test_paired_matches_scipy_and_the_two_pair_textbook_case():
    scipy_stats = pytest.importorskip("scipy.stats")
    a, b = [3.1, 2.9, 3.4, 3.0], [3.0, 3.0, 3.2, 2.8]
    ref = scipy_stats.ttest_rel(a, b)
    q = stats.paired(a, b)
    assert q.t == pytest.approx(ref.statistic) and q.p == pytest.approx(ref.pvalue)
    d = stats.paired_diffs([0.1, 0.3, 0.2])
    assert d.p == pytest.approx(1 - d.t / (d.t * d.t + 2) ** 0.5)  # Student's t with 2 degrees of freedom


def test_degenerate_cases():
    same = stats.paired([1.0, 2.0], [1.0, 2.0])
    assert same.t == 0.0 and same.p == pytest.approx(1.0) and same.sign_p is None
    const = stats.paired_diffs([0.5, 0.5, 0.5])
    assert math.isinf(const.t) and const.p is None
    one = stats.paired([1.0], [0.0])
    assert one.n == 1 and math.isnan(one.t) and one.ci_low is None
    assert stats.paired([None], [1.0]).n == 0
    assert stats.paired_diffs([]).cell() == "n/a"


def test_sign_test_is_the_exact_binomial():
    assert stats.sign_test([1, 2, 3, 4, 5]) == pytest.approx(2 / 32)  # the floor with 5 pairs: 0.0625
    assert stats.sign_test([1, -1]) == 1.0
    assert stats.sign_test([1, 1, 1, -1, 0]) == pytest.approx(2 * 5 / 16)  # zeros dropped: 1 of 4
    assert stats.sign_test([0, 0]) is None


def test_holm_on_a_worked_example():
    # sorted 0.01, 0.02, 0.03, 0.5 over m = 4: 0.04, max(0.04, 0.06), max(0.06, 0.06), max(0.06, 0.5)
    assert stats.holm([0.03, 0.01, 0.5, 0.02]) == pytest.approx([0.06, 0.04, 0.5, 0.06])
    assert stats.holm([0.4, None, 0.4]) == [pytest.approx(0.8), None, pytest.approx(0.8)]
    assert stats.holm([0.9, 0.8]) == pytest.approx([1.0, 1.0])  # capped at 1
    fam = stats.holm_family({"a": stats.paired_diffs([1, 2, 3]), "b": stats.paired_diffs([0.1, -0.2, 0.05])})
    assert fam["a"].p_holm == pytest.approx(min(1.0, 2 * fam["a"].p))
    assert "Holm p=" in fam["a"].cell()


def test_pairs_to_detect_is_the_first_n_whose_detectable_effect_reaches_the_goal():
    from scipy import stats as st

    from lowcomm_kernels.train.stats import pairs_to_detect

    def detectable(n: int, s: float) -> float:
        return (st.t.ppf(0.975, n - 1) + st.t.ppf(0.8, n - 1)) * s / math.sqrt(n)

    for s in (0.003, 0.0128, 0.0226):
        n = pairs_to_detect(s, 0.01)
        assert detectable(n, s) <= 0.01 and (n == 2 or detectable(n - 1, s) > 0.01)
    assert pairs_to_detect(0.0, 0.01) == 2
    assert pairs_to_detect(1.0, 0.01, most=100) is None  # would need about 80,000
    assert pairs_to_detect(math.nan, 0.01) is None
