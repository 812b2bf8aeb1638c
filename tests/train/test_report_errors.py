"""`lowcomm report` refuses what it cannot render honestly, as one line naming the file and the field
(exit code 2): a results.json whose runs hold values of the wrong type or no runs at all (they used
to render into a table with exit code 0), a --out it cannot write and a doc that is not UTF-8 (they
used to end in a traceback)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lowcomm_kernels.cli import main
from lowcomm_kernels.train.report import EvalPoint, RunResult


def _results() -> dict:
    points = [EvalPoint(0, 0.0, 0.0, 0.0, 3.0, [3.0, 3.0], 3.0, True), EvalPoint(8, 1.5, 4e3, 0.2, 2.5)]
    run = RunResult("DiLoCo", "diloco", {"method": "diloco"}, points, 1.5, 4e3, 0.2, 2, 1000)
    return {"title": "t", "target_val_loss": 2.6, "rows": [], "runs": [run.to_dict()]}


def _one_error(capsys) -> str:
    captured = capsys.readouterr()
    assert "Traceback" not in captured.err and captured.out == ""
    lines = captured.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), captured.err
    return lines[0]


def test_a_well_formed_file_renders(tmp_path: Path, capsys):
    path = tmp_path / "results.json"
    path.write_text(json.dumps(_results()))
    assert main(["report", str(path)]) == 0
    assert "| DiLoCo |" in capsys.readouterr().out


def _run0(d: dict) -> dict:
    return d["runs"][0]


MALFORMED = {  # case -> (change, words of the error)
    "syncs_text": (lambda d: _run0(d).__setitem__("syncs", "many"), "runs[0]: syncs should be int"),
    "step_text": (lambda d: _run0(d)["points"][1].__setitem__("step", "ten"), "points[1].step should be int"),
    "loss_bool": (lambda d: _run0(d)["points"][0].__setitem__("val_loss", True), "val_loss should be float"),
    "workers_text": (
        lambda d: _run0(d)["points"][0].__setitem__("val_loss_workers", "abc"),
        "points[0].val_loss_workers should be list[float], got 'abc'",
    ),
    "config_list": (lambda d: _run0(d).__setitem__("config", [1, 2]), "runs[0]: config should be dict"),
    "final_eval": (
        lambda d: _run0(d).__setitem__("final_eval", {"val_loss": 2.4}),
        "final_eval should hold eval_bytes_scored (int) and val_loss",
    ),
    "no_runs": (lambda d: d.__setitem__("runs", []), "holds no runs"),
}


@pytest.mark.parametrize("case", sorted(MALFORMED))
def test_a_malformed_run_is_refused_by_name(tmp_path: Path, capsys, case):
    change, words = MALFORMED[case]
    d = _results()
    change(d)
    path = tmp_path / "results.json"
    path.write_text(json.dumps(d))
    out = tmp_path / "report.md"
    assert main(["report", str(path), "--out", str(out)]) == 2
    line = _one_error(capsys)
    assert line.startswith(f"error: {path}: ") and words in line, line
    assert not out.exists()


def test_an_unwritable_out_is_named(tmp_path: Path, capsys):
    path = tmp_path / "results.json"
    path.write_text(json.dumps(_results()))
    (tmp_path / "a_file").write_text("")
    out = tmp_path / "a_file" / "report.md"  # a folder that is a file: no permission bits involved
    assert main(["report", str(path), "--out", str(out)]) == 2
    assert _one_error(capsys).startswith(f"error: --out {out}: cannot write there (")


def test_a_doc_that_is_not_utf8_is_named(tmp_path: Path, capsys):
    doc = tmp_path / "page.md"
    doc.write_bytes("caf\xe9\n".encode("latin-1"))
    assert main(["report", "--update-docs", str(doc)]) == 2
    assert _one_error(capsys).startswith(f"error: {doc}: not UTF-8 text (")


def test_a_doc_that_cannot_be_written_is_named(tmp_path: Path, capsys, monkeypatch):
    (tmp_path / "pyproject.toml").write_text("")  # the root marker paths start from
    (tmp_path / "results.json").write_text(json.dumps(_results()))
    doc = tmp_path / "page.md"
    doc.write_text("<!-- report: lowcomm report results.json -->\nstale\n<!-- /report -->\n")

    def read_only(self, *args, **kwargs):
        raise PermissionError(13, "Permission denied", str(self))

    monkeypatch.setattr(Path, "write_text", read_only)  # a read-only checkout, whoever runs the test
    assert main(["report", "--update-docs", str(doc)]) == 2
    assert _one_error(capsys) == f"error: --update-docs: cannot write {doc} (Permission denied)"
