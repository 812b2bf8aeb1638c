"""`lowcomm report`: tables rendered from results.json files of real runs, bad input named by path,
and the docs' marked regions in sync with the committed result files."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest

from lowcomm_kernels.cli import main
from lowcomm_kernels.train import provenance, render
from lowcomm_kernels.train.report import RunResult, format_table
from tests.train.test_cli import PNG, TINY

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def compare_run(tmp_path_factory) -> tuple[Path, str]:
    """A real two-method compare run (2 ranks, a few steps) and the table it printed."""
    out = tmp_path_factory.mktemp("report") / "compare"
    argv = ["compare", "--methods", "diloco,streaming", *TINY, "--out", str(out)]
    assert main(argv) == 0
    return out, (out / "table.md").read_text()


@pytest.fixture(scope="module")
def study_run(tmp_path_factory) -> Path:
    """A tiny end-to-end study run (2 ranks); the study's own checks and the report's read it."""
    out = tmp_path_factory.mktemp("report") / "study"
    # Streaming at 2K syncs per H halves H: tau = 1 < (8 // 2) // K = 2; CoCoDC's N = 2K = 4 <= H / tau = 8
    argv = ["compare", "--study", "matched", "--seeds", "2", *TINY, "--sync-every", "8", "--out", str(out)]
    assert main(argv) == 0
    return out


@pytest.mark.slow
def test_tiny_matched_study_writes_table_and_plot(study_run):
    out = study_run
    table = (out / "matched.md").read_text()
    assert "Command: `lowcomm compare --study matched --seeds 2`" in table
    assert "Streaming DiLoCo, 2 syncs/H" in table and "CoCoDC adaptive, 4 syncs/H" in table
    assert "CoCoDC round-robin, 4 syncs/H" in table
    assert " ± " in table
    assert (out / "matched.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    doc = json.loads((out / "results.json").read_text())
    seeds = {(r["name"], r["config"]["seed"]) for r in doc["runs"]}
    assert len(seeds) == len(doc["runs"])  # each configuration ran with 2 distinct seeds
    rr = [r for r in doc["runs"] if "round-robin" in r["name"]]
    assert len(rr) == 2
    for r in rr:  # cyclic order: applied syncs spread evenly over the K = 2 fragments
        counts = r["extra"]["syncs_per_fragment"]
        assert set(counts) == {"0", "1"} and abs(counts["0"] - counts["1"]) <= 1


@pytest.mark.slow
def test_real_run_records_its_provenance(compare_run):
    out, _ = compare_run
    p = json.loads((out / "results.json").read_text())["provenance"]
    assert p["argv"][:3] == ["lowcomm", "compare", "--methods"] and p["argv"][-1] == str(out)
    assert p["command"].startswith("lowcomm compare --methods diloco,streaming --workers 2")
    root = provenance.package_root()
    if (root / ".git").exists() and shutil.which("git"):
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True)
        assert p["git"]["revision"] == head.stdout.strip()
    assert p["versions"]["torch"] and p["machine"]["cpu_count"] >= 1
    # the workers are child processes: their CPU time is counted once they are waited for
    assert p["load"]["cpu_s"] > 0 and p["load"]["wall_s"] > 0 and len(p["load"]["loadavg_end"]) == 3


@pytest.mark.slow
def test_report_renders_the_table_the_command_printed(compare_run, capsys):
    out, printed = compare_run
    doc = json.loads((out / "results.json").read_text())
    assert main(["report", str(out)]) == 0
    text = capsys.readouterr().out
    table = format_table([RunResult.from_dict(r) for r in doc["runs"]], doc["target_val_loss"])
    assert table in printed and table in text  # the very table of table.md
    assert text.startswith(f"**{doc['title']}**")
    rev = doc["provenance"]["git"]["revision"]
    line = next(ln for ln in text.splitlines() if ln.startswith("Source: "))
    assert f"`{out}`" in line and (rev is None or rev[:10] in line)
    assert "command: `lowcomm compare --methods diloco,streaming" in line
    assert main(["report", str(out / "results.json")]) == 0  # the file itself works too
    assert capsys.readouterr().out == text.replace(f"`{out}`", f"`{out / 'results.json'}`")


@pytest.mark.slow
def test_report_writes_markdown_and_plots(compare_run, tmp_path, capsys):
    out, _ = compare_run
    md = tmp_path / "rep" / "report.md"
    # the same folder name twice: the second source's plots must not overwrite the first's
    assert main(["report", str(out), str(out / "results.json"), "--out", str(md), "--plot"]) == 0
    text = md.read_text()
    pngs = sorted(md.parent.glob("*.png"))
    kinds = ("bytes", "steps", "wallclock")
    assert [p.name for p in pngs] == [f"compare{s}_val_loss_vs_{k}.png" for s in ("-2", "") for k in kinds]
    for p in pngs:
        assert p.read_bytes()[:8] == PNG and f"]({p.name})" in text


@pytest.mark.slow
def test_several_compare_runs_are_aggregated_mean_std(compare_run, capsys):
    out, _ = compare_run
    doc = json.loads((out / "results.json").read_text())
    assert main(["report", str(out), str(out / "results.json")]) == 0
    text = capsys.readouterr().out
    tail = text.split("**mean ± std over the 2 compare runs above**", 1)[1]
    for run in doc["runs"]:  # the same run twice: each method has 2 values, equal, so std 0
        assert f"| {run['name']} | 2 | {run['final_loss']:.4f} ± 0.0000 |" in tail


@pytest.mark.slow
def test_report_of_a_study_is_its_table(study_run, capsys):
    assert main(["report", str(study_run)]) == 0
    text = capsys.readouterr().out
    printed = (study_run / "matched.md").read_text()
    table = printed.split("\n\n", 2)[2].strip()  # after the header line and the command line
    assert table in text and " ± " in table
    assert text.startswith("**" + printed.split("\n", 1)[0].removeprefix("# ") + "**")  # the same header
    assert "Command: `lowcomm compare --study matched --seeds 2`" in text
    # the code that made the saved runs, beside the provenance of the command that assembled them
    doc = json.loads((study_run / "results.json").read_text())
    (sitting,) = doc["sittings"]
    assert f"Runs made by revision `{sitting['revision'][:10]}`" in text
    assert f"{len(sitting['parts'])} saved parts" in text and f"{len(doc['runs'])} runs" in text


def test_runs_made_by_several_codes_are_flagged():
    sits = [
        {
            "revision": "a" * 40,
            "diff_sha256": None,
            "parts": ["000.json"],
            "first_utc": "t0",
            "last_utc": "t1",
        },
        {"revision": "b" * 40, "diff_sha256": "c" * 64, "parts": ["001.json"], "first_utc": None},
        {"revision": None, "diff_sha256": None, "parts": ["002.json"], "first_utc": None},
    ]
    line = render._made_by({"sittings": sits, "runs": [{"extra": {"cpu_s_all_ranks": 2.0}}, {"extra": {}}]})
    assert line.startswith("Runs made by revision `aaaaaaaaaa` (clean): 1 saved part, t0 → t1; ")
    assert "revision `bbbbbbbbbb` + changes (diff cccccccc): 1 saved part;" in line
    assert "unrecorded code: 1 saved part" in line and "mix code versions" in line
    assert "CPU s" not in line  # a run without its CPU time: no total is claimed
    assert render._made_by({"runs": []}) == ""


def test_runs_made_on_several_machines_are_flagged():
    """Parts that recorded their machine name it; one code on two machines is one code, two
    machines (another CPU rounds the last bits of some kernels differently)."""
    rev = "a" * 40
    sits = [
        {"revision": rev, "diff_sha256": None, "machine": "AMD EPYC (AVX512)", "parts": ["000.json"]},
        {"revision": rev, "diff_sha256": None, "machine": "Intel Xeon (AVX512)", "parts": ["001.json"]},
        {"revision": rev, "diff_sha256": None, "machine": None, "parts": ["002.json"]},
    ]
    line = render._made_by({"sittings": sits, "runs": []})
    assert "revision `aaaaaaaaaa` (clean) on AMD EPYC (AVX512): 1 saved part" in line
    assert "on Intel Xeon (AVX512): 1 saved part" in line and "on a machine not recorded" in line
    assert "more than one machine" in line and "mix code versions" not in line
    assert "more than one machine" not in render._made_by({"sittings": sits[:1] + sits[2:], "runs": []})


def _rc_err(argv: list[str], capsys) -> tuple[int, str]:
    rc = main(argv)
    return rc, capsys.readouterr().err


def test_missing_corrupt_and_unknown_inputs_are_named(tmp_path: Path, capsys):
    md = tmp_path / "out.md"
    missing = tmp_path / "nope"
    rc, err = _rc_err(["report", str(missing), "--out", str(md)], capsys)
    assert rc == 2 and f"{missing}: no such results file" in err
    empty_dir = tmp_path / "empty"
    empty_dir.mkdir()
    rc, err = _rc_err(["report", str(empty_dir)], capsys)
    assert rc == 2 and f"{empty_dir / 'results.json'}: no such results file" in err
    corrupt = tmp_path / "corrupt.json"
    corrupt.write_text('{"title": "x", "runs": [')
    rc, err = _rc_err(["report", str(corrupt), "--out", str(md)], capsys)
    assert rc == 2 and str(corrupt) in err and "not a valid results.json" in err
    unknown = tmp_path / "unknown.json"
    unknown.write_text(json.dumps({"benchmarks": []}))
    rc, err = _rc_err(["report", str(unknown)], capsys)
    assert rc == 2 and str(unknown) in err and "found: benchmarks" in err
    bad_run = tmp_path / "bad_run.json"
    bad_run.write_text(json.dumps({"rows": [], "target_val_loss": 1.0, "runs": [{"name": "x"}]}))
    rc, err = _rc_err(["report", str(bad_run)], capsys)
    assert rc == 2 and str(bad_run) in err and "malformed" in err
    unknown_study = tmp_path / "study.json"
    unknown_study.write_text(json.dumps({"study": "nonesuch", "target_val_loss": 1.0, "runs": []}))
    rc, err = _rc_err(["report", str(unknown_study)], capsys)
    assert rc == 2 and str(unknown_study) in err and "'nonesuch' is none that lowcomm report knows" in err
    no_rows = tmp_path / "sim.json"
    no_rows.write_text(json.dumps({"preset": "streaming-diloco-paper", "rows": []}))
    rc, err = _rc_err(["report", str(no_rows)], capsys)
    assert rc == 2 and str(no_rows) in err and "holds no rows" in err
    bad_rows = tmp_path / "sim_bad.json"
    bad_rows.write_text(json.dumps({"workload": {}, "rows": [{"at": {}}]}))
    rc, err = _rc_err(["report", str(bad_rows)], capsys)
    assert rc == 2 and str(bad_rows) in err and "malformed" in err
    no_outcomes = tmp_path / "check.json"
    no_outcomes.write_text(json.dumps({"title": "t", "outcomes": []}))
    rc, err = _rc_err(["report", str(no_outcomes)], capsys)
    assert rc == 2 and "holds no outcomes" in err
    assert not md.exists()  # nothing written when any source is bad
    rc, err = _rc_err(["report"], capsys)
    assert rc == 2 and "at least one run" in err
    rc, err = _rc_err(["report", str(corrupt), "--plot"], capsys)
    assert rc == 2 and "--plot needs --out" in err
    rc, err = _rc_err(["report", "--check"], capsys)
    assert rc == 2 and "--check goes with --update-docs" in err


@pytest.mark.slow
def test_a_truncated_real_file_is_named(compare_run, tmp_path, capsys):
    out, _ = compare_run
    cut = tmp_path / "cut.json"
    text = (out / "results.json").read_text()
    cut.write_text(text[: len(text) // 2])
    rc, err = _rc_err(["report", str(out), str(cut)], capsys)
    assert rc == 2 and str(cut) in err and capsys.readouterr().out == ""
    doc = json.loads(text)
    doc["target_val_loss"] = "low"
    bad = tmp_path / "bad_target.json"
    bad.write_text(json.dumps(doc))
    md = tmp_path / "plots" / "r.md"
    rc, err = _rc_err(["report", str(out), str(bad), "--out", str(md), "--plot"], capsys)
    assert rc == 2 and f"{bad}: a compare results file with a malformed field" in err
    assert not md.parent.exists()  # the good source's plots were not drawn either


@pytest.mark.slow
def test_update_docs_rewrites_a_stale_region_and_check_finds_it(compare_run, tmp_path, capsys):
    out, _ = compare_run
    (tmp_path / "pyproject.toml").write_text("")  # marks the root the marker paths start from
    shutil.copytree(out, tmp_path / "runs" / "tiny")
    doc = tmp_path / "docs" / "page.md"
    doc.parent.mkdir()
    doc.write_text(
        "intro\n\n<!-- report: lowcomm report runs/tiny -->\nstale numbers\n<!-- /report -->\n\nend\n"
    )
    assert main(["report", "--update-docs", "--check", str(doc)]) == 1
    assert "stale numbers" in doc.read_text()  # --check writes nothing
    assert main(["report", "--update-docs", str(doc)]) == 0
    new = doc.read_text()
    rendered, _ = render.render(["runs/tiny"], base=tmp_path)
    assert new == f"intro\n\n<!-- report: lowcomm report runs/tiny -->\n{rendered}<!-- /report -->\n\nend\n"
    assert "Source: `runs/tiny`" in new
    capsys.readouterr()
    assert main(["report", "--update-docs", "--check", str(doc)]) == 0
    assert capsys.readouterr().out == f"all 1 marked regions up to date: {doc}\n"
    doc.write_text(
        new.replace("<!-- report: lowcomm report runs/tiny -->", "<!-- report: lowcomm report -x -->")
    )
    rc, err = _rc_err(["report", "--update-docs", str(doc)], capsys)
    assert rc == 2 and f"{doc}:3" in err


def test_the_docs_match_what_lowcomm_report_renders_from_the_committed_results():
    """Every marked region of README.md, docs/results.md and docs/simulator.md is exactly `lowcomm
    report` over the committed result files; edit the files, never the tables (`lowcomm report
    --update-docs`)."""
    docs = [ROOT / d for d in render.DOCS]
    regions = sum(render.render_regions(d, ROOT)[1] for d in docs)
    assert regions >= 2, "the results tables are expected to be rendered regions"
    assert render.update_docs(docs, check=True) == [], "run: lowcomm report --update-docs"
