"""`lowcomm report` of the two studies with tables of their own, cocodc-paper and loscar-regimes:
the committed loscar-regimes results render as the markdown its run wrote, each study's command and
`lowcomm report` print the same header and tables (the study's runs replaced by synthetic ones, so
that the whole command runs in seconds), plots are drawn, markers are kept up to date, and a file
that is not a complete results.json of the study is refused by name."""

from __future__ import annotations

import json
import math
import shutil
import zlib
from pathlib import Path

import pytest

from lowcomm_kernels.cli import main
from lowcomm_kernels.train import render, studykit
from lowcomm_kernels.train import study_loscar as sl
from lowcomm_kernels.train.report import EvalPoint, RunResult
from tests.train.test_cli import PNG

ROOT = Path(__file__).resolve().parents[2]
LOSCAR_DATA = ROOT / "docs" / "data" / "loscar-regimes"
COCODC_DATA = ROOT / "docs" / "data" / "cocodc-paper"


def _expected(md: str) -> str:
    """What `lowcomm report` prints for a study's .md: the header in bold instead of a heading,
    then the command line and the tables, then (not included here) the provenance line."""
    head, rest = md.split("\n\n", 1)
    assert head.startswith("# study `")
    return f"**{head.removeprefix('# ')}**\n\n{rest.rstrip()}\n\nSource: "


def _noise(name: str) -> float:
    """A fixed number in [0, 1) per run name (not Python's salted hash)."""
    return zlib.crc32(name.encode()) / 2**32


def _fake(spec, speed: float = 1.0) -> RunResult:
    """A synthetic run of ``spec``: a loss curve that falls with the ticks, shifted per run name."""
    ticks = list(range(0, spec.steps + 1, spec.eval_every))
    if ticks[-1] != spec.steps:
        ticks.append(spec.steps)
    u = _noise(spec.label)
    points, syncs_at = [], []
    for i, t in enumerate(ticks):
        own = [2.3 * math.exp(-3 * speed * (1 + u + 0.1 * w) * t / spec.steps) for w in range(spec.workers)]
        loss = sum(own) / len(own)
        points.append(EvalPoint(t, 0.01 * t, 100.0 * i, 0.0, loss, own, 0.9 * loss))
        syncs_at.append(i)
    extra = {
        "own_acc": [1 - p.val_loss / 3 for p in points],
        "avg_acc": [1 - p.val_loss / 3.5 for p in points],
        "syncs_at": syncs_at,
        "time_model": {"step_time_s": 0.01, "speeds": [1.0] * spec.workers},
    }
    if spec.method == "cocodc":
        extra["syncs_per_period"] = [4] * max(1, spec.steps // spec.sync_every)
    return RunResult(
        spec.label,
        spec.method,
        spec.to_dict(),
        points,
        bytes_sent=100.0 * (len(points) - 1),
        syncs=len(points) - 1,
        num_params=4810,
        extra=extra,
    )


def test_the_committed_loscar_regimes_results_render_as_their_markdown():
    body, plots = render.render(["docs/data/loscar-regimes"], base=ROOT)
    assert plots == []
    md = (LOSCAR_DATA / "loscar-regimes.md").read_text()
    assert body.startswith(_expected(md))
    # the numbers come from results.json, e.g. LOSCAR's own-model loss on the contiguous split at the
    # time budget: its rounds take a little more than R step times (the sync's bytes), so its last
    # evaluation within 1024 step times is the one at tick 1008
    runs = json.loads((LOSCAR_DATA / "results.json").read_text())["runs"]
    key = "loscar p=0.25 N=14 Q=2 tau=2 outer_lr=0.7 speeds=1 split=contiguous seed="
    own = [p["val_loss"] for r in runs if r["name"].startswith(key) for p in r["points"] if p["step"] == 1008]
    assert len(own) == 5 and f"| 1008 ± 0 | {sum(own) / 5:.3f} ± " in body


def test_the_committed_cocodc_paper_results_render_as_their_markdown():
    body, plots = render.render(["docs/data/cocodc-paper"], base=ROOT)
    assert plots == []
    # the run printed its table; the paper's effects beside ours were added to the renderer after it
    # and follow the table, before the provenance line
    printed = _expected((COCODC_DATA / "cocodc-paper.md").read_text()).removesuffix("Source: ")
    assert body.startswith(printed)
    after = body[len(printed) :]
    assert after.startswith("**The paper's headline effects beside ours**") and "\n\nSource: " in after
    assert "| CoCoDC vs Streaming DiLoCo | steps to target | -21.0% |" in after
    # both losses come from results.json: the own models' mean and the averaged model, 5 seeds each
    runs = [
        r
        for r in json.loads((COCODC_DATA / "results.json").read_text())["runs"]
        if r["name"] == "CoCoDC lambda=1"
    ]
    own = [r["final_eval"]["val_loss"] for r in runs]
    avg = [r["final_eval"]["val_loss_avg_model"] for r in runs]
    assert len(own) == 5 and f"| CoCoDC lambda=1 | 5 | {sum(own) / 5:.4f} ± " in body
    assert f" | {sum(avg) / 5:.4f} ± " in body and "Runs made by revision" in body


@pytest.fixture(scope="module")
def loscar_quick(tmp_path_factory) -> Path:
    """`lowcomm compare --study loscar-regimes --quick`, every run synthetic (the runner's own code
    writes the .md, the plot and results.json)."""
    out = tmp_path_factory.mktemp("studies") / "loscar"
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(sl, "run_mlp_specs", lambda specs, cfg=None, progress=True: [_fake(s) for s in specs])
        argv = ["compare", "--study", "loscar-regimes", "--quick", "--no-progress", "--out", str(out)]
        assert main(argv) == 0
    return out


@pytest.fixture(scope="module")
def cocodc_quick(tmp_path_factory) -> Path:
    """`lowcomm compare --study cocodc-paper --quick`, every run synthetic."""
    out = tmp_path_factory.mktemp("studies") / "cocodc"

    def fake_run_specs(specs, corpus, progress=True, timeout_s=3600.0):
        return [_fake(s, speed=1 + _noise(s.label + str(s.seed))) for s in specs]

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(studykit, "run_specs", fake_run_specs)  # the studies' runner
        argv = ["compare", "--study", "cocodc-paper", "--quick", "--no-progress", "--out", str(out)]
        assert main(argv) == 0
    return out


@pytest.mark.slow
@pytest.mark.parametrize("study", ["loscar-regimes", "cocodc-paper"])
def test_report_prints_what_the_study_command_wrote(study, loscar_quick, cocodc_quick, tmp_path):
    out = loscar_quick if study == "loscar-regimes" else cocodc_quick
    md = (out / f"{study}.md").read_text()
    body, _ = render.render([str(out)])
    assert body.startswith(_expected(md))
    assert "±" in md and ("(2/2)" in md or "| 2/2 |" in md)  # runs reached the target: numbers, not n/a
    body_plot, plots = render.render([str(out)], plot_dir=tmp_path)
    assert body_plot == body and [p.name for p in plots] == [f"{out.name}_{study}.png"]
    assert plots[0].read_bytes()[:8] == PNG


@pytest.mark.slow
def test_the_loscar_runner_stores_what_the_report_needs(loscar_quick):
    data = json.loads((loscar_quick / "results.json").read_text())
    assert data["seeds"] == [0, 1] and data["outer_lrs"] == list(sl.OUTER_LRS["quick"])
    assert data["tune_seeds"] == list(sl.TUNE_SEEDS) and data["mlp"]["hidden"] == 64
    assert [len(s["parts"]) for s in data["sittings"]] == [len(sl.METHODS)]  # one code, every part
    assert [len(s["parts"]) for s in data["tuning_sittings"]] == [1]
    # a file written before those fields were stored reads the same from its runs
    old = {k: v for k, v in data.items() if k not in ("seeds", "outer_lrs", "tune_seeds", "mlp")}
    a, b = sl.from_results(data), sl.from_results(old)
    assert (a.header(), a.tables()) == (b.header(), b.tables())


@pytest.mark.slow
def test_update_docs_renders_study_markers(loscar_quick, cocodc_quick, tmp_path, capsys):
    (tmp_path / "pyproject.toml").write_text("")
    shutil.copytree(LOSCAR_DATA, tmp_path / "data" / "loscar")
    shutil.copytree(cocodc_quick, tmp_path / "data" / "cocodc")
    doc = tmp_path / "page.md"
    regions = [
        f"<!-- report: lowcomm report data/{n} -->\nold\n<!-- /report -->\n" for n in ("loscar", "cocodc")
    ]
    doc.write_text("# page\n\n" + "\ntext\n\n".join(regions))
    assert main(["report", "--update-docs", "--check", str(doc)]) == 1
    assert main(["report", "--update-docs", str(doc)]) == 0
    text = doc.read_text()
    for name in ("loscar", "cocodc"):
        rendered, _ = render.render([f"data/{name}"], base=tmp_path)
        assert f"<!-- report: lowcomm report data/{name} -->\n{rendered}<!-- /report -->" in text
    capsys.readouterr()
    assert main(["report", "--update-docs", "--check", str(doc)]) == 0
    assert "all 2 marked regions up to date" in capsys.readouterr().out


def _report_error(path: Path, capsys) -> str:
    assert main(["report", str(path)]) == 2
    return capsys.readouterr().err


def test_an_incomplete_or_malformed_loscar_file_is_refused_by_name(tmp_path, capsys):
    loscar = json.loads((LOSCAR_DATA / "results.json").read_text())
    missing_run = tmp_path / "missing_run.json"
    gone = loscar["runs"][0]["name"]
    missing_run.write_text(json.dumps({**loscar, "runs": loscar["runs"][1:]}))
    err = _report_error(missing_run, capsys)
    assert str(missing_run) in err and "malformed" in err and gone.rsplit(" seed=", 1)[0] in err

    bad_run = tmp_path / "bad_run.json"
    bad_run.write_text(json.dumps({**loscar, "runs": [{"name": "x"}]}))
    err = _report_error(bad_run, capsys)
    assert str(bad_run) in err and "a run in it is malformed" in err

    no_outer_lr = tmp_path / "no_outer_lr.json"
    no_outer_lr.write_text(json.dumps({k: v for k, v in loscar.items() if k != "outer_lr"}))
    err = _report_error(no_outer_lr, capsys)
    assert str(no_outer_lr) in err and "malformed" in err and "outer_lr" in err

    unknown = tmp_path / "unknown.json"
    unknown.write_text(json.dumps({"study": "nonesuch", "runs": []}))
    err = _report_error(unknown, capsys)
    assert str(unknown) in err and "'nonesuch' is none that lowcomm report knows" in err
    assert capsys.readouterr().out == ""


@pytest.mark.slow
def test_a_malformed_cocodc_file_is_refused_by_name(cocodc_quick, tmp_path, capsys):
    cocodc = json.loads((cocodc_quick / "results.json").read_text())
    no_seeds = tmp_path / "no_seeds.json"
    no_seeds.write_text(json.dumps({k: v for k, v in cocodc.items() if k != "seeds"}))
    err = _report_error(no_seeds, capsys)
    assert str(no_seeds) in err and "malformed" in err and "seeds" in err

    bad_base = tmp_path / "bad_base.json"
    bad_base.write_text(json.dumps({**cocodc, "base": "paper"}))
    err = _report_error(bad_base, capsys)
    assert str(bad_base) in err and "malformed" in err
    assert capsys.readouterr().out == ""
