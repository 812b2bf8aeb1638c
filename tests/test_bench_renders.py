"""The benchmark tables of docs/results.md (and the overlap section of bench/RESULTS.md) are what
their scripts' ``--render`` prints from the committed results files under bench/figures/, block for
block, and those files were written by a run from a clean checkout that recorded its provenance:
no table can be edited by hand, or drift from its file, without this failing.

- bench/eval_cost.py: the cost of one evaluation (the time budget of the main command);
- bench/bench_overlap.py: exposed communication per strategy, emulated and real compute;
- bench/low_precision.py: the memory and the loss of bf16 parameters.

Nothing is run: the scripts are imported and render the committed files.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs" / "results.md"
RESULTS_MD = ROOT / "bench" / "RESULTS.md"
# script -> its results file
FILES = {
    "eval_cost": "bench/figures/eval_cost.json",
    "bench_overlap": "bench/figures/overlap.json",
    "low_precision": "bench/figures/low_precision.json",
}


def _module(name: str):
    spec = importlib.util.spec_from_file_location(f"_rendered_{name}", ROOT / "bench" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _result(name: str) -> dict:
    return json.loads((ROOT / FILES[name]).read_text())


def _blocks(name: str, mod, result: dict) -> list[str]:
    """What the docs quote, each block contiguous: the docs may put prose between blocks."""
    if name == "eval_cost":
        return [mod.render_markdown(result)]
    if name == "bench_overlap":
        return mod.render_blocks(result)
    return list(mod.render_parts(result).values())


def _provenances(name: str, result: dict) -> list[dict]:
    if name == "low_precision":  # a provenance per part: each part can be run alone
        return [result[part]["provenance"] for part in ("memory", "loss")]
    return [result["provenance"]]


@pytest.mark.parametrize("name", list(FILES))
def test_the_results_file_came_from_a_clean_run(name):
    """Revision, a clean tree (or only this results file changed), load, CPU time, wall-clock and
    the command, all recorded by the run itself."""
    mod = _module(name)
    for prov in _provenances(name, _result(name)):
        git = prov["git"]
        assert git["revision"], f"{FILES[name]}: not run from a git checkout"
        assert git["dirty"] is False or git["modified"] == [FILES[name]], (FILES[name], git)
        load = prov["load"]
        for key in ("loadavg_start", "loadavg_end", "cpu_s", "wall_s"):
            assert load[key] is not None, (FILES[name], key)
        assert prov["started_utc"] and prov["machine"]["cpu_count"]
        assert prov["command"].startswith(mod.PROG), prov["command"]
        assert "--out" not in prov["command"], "a run that wrote elsewhere is not the committed file's"


@pytest.mark.parametrize("name", list(FILES))
def test_the_docs_show_what_render_prints(name, capsys):
    """docs/results.md holds every block of ``--render``'s output verbatim (a table with a number
    changed, a row dropped or a Source line edited is not there), and ``--render`` prints exactly
    those blocks."""
    mod = _module(name)
    result = _result(name)
    blocks = _blocks(name, mod, result)
    docs = DOCS.read_text()
    for block in blocks:
        if block not in docs:
            lines = [ln for ln in block.splitlines() if ln and ln not in docs]
            pytest.fail(
                f"docs/results.md does not show this block of `{mod.PROG} --render` as printed"
                + (f"; lines not found: {lines[:3]}" if lines else " (its lines are there, not together)")
            )
        assert docs.count(block) == 1, f"a block of {FILES[name]} is shown twice"
    mod.main(["--render"])
    assert capsys.readouterr().out == "\n\n".join(blocks) + "\n"


def test_bench_results_md_shows_the_same_overlap_tables():
    """bench/RESULTS.md's overlap section is bench_overlap's ``--render`` output, whole (as
    bench/render_results.py includes it)."""
    mod = _module("bench_overlap")
    text = RESULTS_MD.read_text()
    begin, end = "<!-- overlap:begin -->\n", "\n<!-- overlap:end -->"
    section = text[text.index(begin) + len(begin) : text.index(end)]
    assert section == mod.render_markdown(_result("bench_overlap"))
    rr = _module("render_results")
    assert rr.include("overlap", "")[1] == section
