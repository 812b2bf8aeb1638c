"""The paper-vs-ours table: relative effects per seed, and the verdict read from the interval."""

import math

import pytest

from lowcomm_kernels.train import paper_vs_ours, stats
from lowcomm_kernels.train.study_cocodc import PAPER_TABLE, REFERENCE, paper_claims


def _p(lo: float, hi: float, n: int = 5) -> stats.Paired:
    return stats.Paired(n, (lo + hi) / 2, 0.1, 1.0, n - 1, 0.5, lo, hi, None, None)


def test_relative_is_the_per_seed_ratio_and_drops_missing_pairs():
    r = paper_vs_ours.relative([110.0, None, 90.0, 100.0], [100.0, 100.0, 100.0, None])
    assert r.n == 2 and r.mean == pytest.approx(0.0)
    r = paper_vs_ours.relative([2.0, 3.0, 4.5], [1.0, 2.0, 3.0])
    assert r.mean == pytest.approx((1.0 + 0.5 + 0.5) / 3)
    assert paper_vs_ours.relative([1.0], [0.0]).n == 0  # a zero reference has no ratio


@pytest.mark.parametrize(
    "lo, hi, paper, expected",
    [
        (-0.3, -0.1, -0.2, "reproduces"),
        (-0.3, -0.25, -0.2, "same direction, larger"),
        (-0.15, -0.05, -0.2, "same direction, smaller"),
        (-0.3, 0.1, -0.2, "not resolved"),
        (-0.1, 0.1, -0.2, "paper's effect excluded"),
        (0.05, 0.4, -0.2, "opposite direction"),
        (-0.4, -0.05, 0.1, "opposite direction"),
        (0.05, 0.4, 0.1, "reproduces"),
        (0.05, 0.4, None, "separated from 0"),
        (-0.05, 0.4, None, "not separated from 0"),
    ],
)
def test_verdict_reads_the_interval_against_zero_and_the_paper(lo, hi, paper, expected):
    assert paper_vs_ours.verdict(_p(lo, hi), paper) == expected


@pytest.mark.parametrize(
    "lo, hi, direction, expected",
    [
        (-0.3, -0.1, -1, "same direction"),
        (0.1, 0.3, -1, "opposite direction"),
        (-0.3, 0.1, -1, "not separated from 0"),
        (0.1, 0.3, 1, "same direction"),
    ],
)
def test_a_claim_without_a_number_is_read_by_its_direction(lo, hi, direction, expected):
    assert paper_vs_ours.verdict(_p(lo, hi), None, direction) == expected
    claim = paper_vs_ours.Claim("A vs B", "final loss", None, "a figure", "A", "B", direction)
    row = paper_vs_ours.table([claim], {("A vs B", "final loss"): _p(lo, hi)}, "paper").splitlines()[2]
    assert ("| lower |" if direction < 0 else "| higher |") in row and row.endswith(f"| {expected} |")


def test_verdict_needs_an_interval():
    one = stats.paired_diffs([0.3])
    assert paper_vs_ours.verdict(one, -0.2) == "too few seeds"


def test_cocodc_claims_are_the_papers_ratios_on_the_studys_labels():
    labels = ["DiLoCo", "Streaming DiLoCo, 4 syncs/H", "Streaming DiLoCo, 8 syncs/H", REFERENCE]
    claims = {(c.what, c.metric): c for c in paper_claims(labels)}
    c = claims["CoCoDC vs Streaming DiLoCo", "steps to target"]
    assert c.paper == pytest.approx(10_292 / 13_021 - 1) and c.paper == pytest.approx(-0.2096, abs=1e-4)
    assert (c.method, c.baseline) == (REFERENCE, "Streaming DiLoCo, 4 syncs/H")  # the paper's pairing
    c = claims["CoCoDC vs DiLoCo", "final loss"]
    assert c.paper == pytest.approx(
        math.log(PAPER_TABLE["CoCoDC"][1]) / math.log(PAPER_TABLE["DiLoCo"][1]) - 1
    )
    matched = claims["CoCoDC vs Streaming DiLoCo at 8 syncs/H", "final loss"]
    assert matched.paper is None and matched.baseline == "Streaming DiLoCo, 8 syncs/H"


def test_table_renders_every_claim_with_its_verdict():
    claims = [
        paper_vs_ours.Claim("A vs B", "final loss", -0.01, "1 vs 2", "A", "B"),
        paper_vs_ours.Claim("A vs C", "steps to target", None, "not run", "A", "C"),
    ]
    ours = {
        ("A vs B", "final loss"): _p(-0.02, -0.005),
        ("A vs C", "steps to target"): stats.paired_diffs([]),
    }
    md = paper_vs_ours.table(claims, ours, "paper").splitlines()
    assert len(md) == 4
    assert "-1.0%" in md[2] and "[-2.0%, -0.5%]" in md[2] and md[2].endswith("| reproduces |")
    assert "not measured" in md[3] and "n/a" in md[3] and md[3].endswith("| too few seeds |")
