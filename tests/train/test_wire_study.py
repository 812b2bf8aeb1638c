"""`lowcomm compare --study wire`: its configurations, and the saving and reuse of finished runs."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lowcomm_kernels.ops import FORMATS
from lowcomm_kernels.train.corpus import load_corpus
from lowcomm_kernels.train.model import ModelConfig
from lowcomm_kernels.train.spec import TrainSpec
from lowcomm_kernels.train.studies import STUDIES, run_resumable

BASE = TrainSpec(steps=300, sync_every=50, num_fragments=4, fragment_sync_delay=5)


def test_wire_study_runs_every_format_with_and_without_error_feedback():
    configs = STUDIES["wire"](BASE)
    for method in ("streaming", "cocodc"):
        mine = [(label, s) for label, s in configs if s.method == method]
        dense = {s.wire_dtype for _, s in mine if not s.error_feedback}
        with_ef = {s.wire_dtype for _, s in mine if s.error_feedback}
        assert dense == {"fp32", "bf16", *FORMATS} and with_ef == set(FORMATS)
        assert len({label for label, _ in mine}) == len(mine) == 2 + 2 * len(FORMATS)
    cocodc = [s for _, s in configs if s.method == "cocodc"]
    assert {s.syncs_per_period for s in cocodc} == {BASE.num_fragments}  # as many syncs as streaming


@pytest.mark.slow
def test_finished_runs_are_saved_and_reused(tmp_path: Path, capsys):
    tiny = TrainSpec(
        method="streaming",
        workers=2,
        steps=6,
        batch_size=2,
        sync_every=4,
        num_fragments=2,
        fragment_sync_delay=1,
        eval_every=3,
        eval_bytes=256,
        warmup_steps=1,
        latency_s=0.001,
        wire_dtype="int4",
        quant_block=16,
        error_feedback=True,
        name="int4+EF",
        model=ModelConfig(dim=16, n_layers=2, n_heads=2, mlp_hidden=32, seq_len=16),
    )
    corpus = load_corpus(None, max_train_bytes=200_000, max_val_bytes=50_000)
    first = run_resumable([("int4+EF", [tiny])], corpus, tmp_path, progress=False)
    saved = tmp_path / "000.json"
    stamp = saved.stat().st_mtime_ns
    again = run_resumable([("int4+EF", [tiny])], corpus, tmp_path, progress=False)
    assert "reusing int4+EF (1 runs)" in capsys.readouterr().out
    assert saved.stat().st_mtime_ns == stamp  # read back, not run again
    assert [r.to_dict() for r in again] == [r.to_dict() for r in first] and first[0].bytes_sent > 0


def test_each_saved_part_records_the_code_that_made_it(tmp_path: Path, capsys, monkeypatch):
    """A study finished in several sittings: every part file says which code made it, sittings()
    lists the distinct codes, and reusing a part made by other code prints a warning."""
    from lowcomm_kernels.train import studykit
    from lowcomm_kernels.train.report import RunResult

    def fake_run(specs):
        return [RunResult(s.label, s.method, s.to_dict()) for s in specs]

    cfgs = [("a", [TrainSpec(name="a")]), ("b", [TrainSpec(name="b", seed=1)])]
    code = {"revision": "1" * 40, "dirty": False, "diff_sha256": None}
    monkeypatch.setattr(studykit, "_made_by", lambda: {**code, "utc": "2026-01-01T00:00:00Z", "load": [1.0]})
    studykit.run_resumable(cfgs[:1], None, tmp_path, progress=False, run=fake_run)
    made = json.loads((tmp_path / "000.json").read_text())["made_by"]
    assert made["revision"] == "1" * 40 and made["load"] == [1.0]
    code = {"revision": "2" * 40, "dirty": True, "diff_sha256": "f" * 64}  # a later sitting, edited tree
    monkeypatch.setattr(studykit, "_made_by", lambda: {**code, "utc": "2026-01-02T00:00:00Z", "load": None})
    studykit.run_resumable(cfgs, None, tmp_path, progress=False, run=fake_run)
    out = capsys.readouterr().out
    assert "reusing a (1 runs)" in out
    assert "warning: made by revision 1111111111; this checkout is revision 2222222222 + uncommitted" in out
    parts = studykit.sittings(tmp_path)
    assert [(p["revision"][:1], p["parts"]) for p in parts] == [("1", ["000.json"]), ("2", ["001.json"])]
    assert parts[1]["diff_sha256"] == "f" * 64 and parts[1]["first_utc"] == "2026-01-02T00:00:00Z"
    # a part written before parts recorded their code reads as "not recorded", with no error
    doc = json.loads((tmp_path / "000.json").read_text())
    del doc["made_by"]
    (tmp_path / "000.json").write_text(json.dumps(doc))
    studykit.run_resumable(cfgs[:1], None, tmp_path, progress=False, run=fake_run)
    assert "made by code not recorded" in capsys.readouterr().out
    assert studykit.sittings(tmp_path)[0]["revision"] is None


def test_each_saved_part_records_the_machine_that_made_it(tmp_path: Path, monkeypatch):
    """made_by names the CPU and torch's CPU capability; sittings() separates one code's parts by
    machine, and a part without the record reads as machine None."""
    from lowcomm_kernels.train import provenance, studykit
    from lowcomm_kernels.train.report import RunResult

    fake = lambda specs: [RunResult(s.label, s.method, s.to_dict()) for s in specs]  # noqa: E731
    cfgs = [(name, [TrainSpec(name=name, seed=i)]) for i, name in enumerate("abc")]
    studykit.run_resumable(cfgs[:1], None, tmp_path, progress=False, run=fake)
    made = json.loads((tmp_path / "000.json").read_text())["made_by"]
    assert made["machine"] == {
        "cpu_model": provenance.cpu_model(),
        "torch_cpu_capability": provenance.torch_cpu_capability(),
    }
    monkeypatch.setattr(studykit, "cpu_model", lambda: "Other CPU")
    studykit.run_resumable(cfgs[:2], None, tmp_path, progress=False, run=fake)
    doc = json.loads((tmp_path / "000.json").read_text())
    studykit.run_resumable(cfgs, None, tmp_path, progress=False, run=fake)
    third = json.loads((tmp_path / "002.json").read_text())
    del third["made_by"]["machine"]
    (tmp_path / "002.json").write_text(json.dumps(third))
    machines = {tuple(p["parts"]): p["machine"] for p in studykit.sittings(tmp_path)}
    cpu, cap = provenance.cpu_model(), provenance.torch_cpu_capability()
    assert machines[("000.json",)] == f"{cpu or 'unknown CPU'} ({cap or 'capability unknown'})"
    assert doc["made_by"]["machine"]["cpu_model"] == cpu  # the part made here was reused, not remade
    assert machines[("001.json",)].startswith("Other CPU (") and machines[("002.json",)] is None


def test_a_part_whose_checkout_changed_while_it_ran_says_so(tmp_path: Path, capsys, monkeypatch):
    """The code is recorded at launch (the workers import what is on disk then); a commit landing
    while the part runs is recorded too, warned about, and sittings() counts the part under both.
    Files beyond the study's configurations (an earlier, longer list) are not counted."""
    from lowcomm_kernels.train import studykit
    from lowcomm_kernels.train.report import RunResult

    codes = iter("12")

    def made_by():
        rev = next(codes, "2") * 40
        return {
            "revision": rev,
            "dirty": False,
            "diff_sha256": None,
            "utc": "2026-01-01T00:00:00Z",
            "load": None,
        }

    monkeypatch.setattr(studykit, "_made_by", made_by)
    fake = lambda specs: [RunResult(s.label, s.method, s.to_dict()) for s in specs]  # noqa: E731
    studykit.run_resumable([("a", [TrainSpec(name="a")])], None, tmp_path, progress=False, run=fake)
    doc = json.loads((tmp_path / "000.json").read_text())
    assert doc["made_by"]["revision"] == "1" * 40 and doc["code_changed_during_run"]["revision"] == "2" * 40
    assert "the checkout changed while a ran: revision 2222222222" in capsys.readouterr().out
    assert sorted(p["revision"][:1] for p in studykit.sittings(tmp_path, 1)) == ["1", "2"]
    (tmp_path / "001.json").write_text(json.dumps({"made_by": {"revision": "3" * 40}}))  # not a config
    assert len(studykit.sittings(tmp_path, 1)) == 2 and len(studykit.sittings(tmp_path)) == 3


def test_every_lm_study_declares_its_contrasts_and_renders_them_with_holm():
    """Each LM study's declared contrasts name configurations it runs; the contrast table pairs the
    final losses by seed (not by position), adjusts over the study's family, and a contrast one side
    of which did not run is left out."""
    from lowcomm_kernels.train import stats
    from lowcomm_kernels.train.report import EvalPoint, RunResult
    from lowcomm_kernels.train.studies import (
        _against_first,
        contrast_table,
        matched_contrasts,
        overlap_contrasts,
        wire_contrasts,
    )

    for name, declare in (
        ("matched", matched_contrasts),
        ("lambda", _against_first),
        ("gamma", _against_first),
        ("overlap", overlap_contrasts),
        ("wire", wire_contrasts),
    ):
        labels = [label for label, _ in STUDIES[name](BASE)]
        pairs = declare(labels)
        assert pairs and all(a in labels and b in labels and a != b for _, a, b in pairs), name
    assert [n for n, _, _ in matched_contrasts([lb for lb, _ in STUDIES["matched"](BASE)])] == [
        "delay compensation",
        "adaptive selection",
    ]

    def run(label, seed, loss):
        return RunResult(label, "cocodc", {"seed": seed}, [EvalPoint(10, 1.0, 0.0, 0.0, loss)])

    a, b, c = "Streaming DiLoCo fp32", "Streaming DiLoCo int8", "Streaming DiLoCo int4"
    results = [run(a, s, 2.0 + 0.1 * s) for s in (2, 0, 1)]  # out of seed order
    results += [run(b, s, 2.0 + 0.1 * s + d) for s, d in ((0, 0.010), (1, 0.012), (2, 0.011))]
    results += [run(c, 5, 9.0)]  # no seed in common with fp32: its contrast has no pairs
    text = contrast_table(wire_contrasts([a, b, c]), results)
    want = stats.holm_family({"x": stats.paired_diffs([0.010, 0.012, 0.011])})["x"]
    assert f"| Streaming DiLoCo: int8 vs fp32 | {b} − {a} | 3 | {want.cell()} |" in text
    assert "Holm over these 1" in text and "int4" not in text
    assert contrast_table([], results) == ""
