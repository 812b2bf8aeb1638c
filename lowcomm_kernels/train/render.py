"""``lowcomm report``: the tables (and plots) of finished runs, rendered again from their results.json.

A source is a run folder or its ``results.json``, written by ``lowcomm compare`` / ``train`` /
``profile`` (kind ``compare``), ``lowcomm compare --study NAME`` (kind ``study``: every study,
cocodc-paper, loscar-regimes and wire included), ``lowcomm compare --task logreg`` (kind
``logreg``), ``lowcomm simulate --json`` (kind ``simulate``) or ``python -m
lowcomm_kernels.train.simcheck`` (kind ``simcheck``: the simulator against real runs). Each renders
as the header and tables its command printed, made by the same functions (report.format_table; a
study by its own renderer, looked up by name in ``studies.STUDIES``; tasks.logreg.summarise,
sim.command.markdown, simcheck.table), under one provenance line:
revision, dirty files, date, load and command. With ``--plot``, also the plots the command drew
(the same plotting functions). Several compare sources (e.g. one per ``--seed``) also get a table of
mean ± std over them.

Docs stay honest with marked regions::

    <!-- report: lowcomm report docs/runs/compare-quick -->
    ... (replaced by the command's output)
    <!-- /report -->

(``lowcomm report --headline PATH`` in a marker: a study's few-line headline in place of its table;
``lowcomm report --paper NAME PATH...``: a paper's findings beside ours, read from several results
files, ``PAPERS``.)

``lowcomm report --update-docs`` re-renders every region of README.md, docs/results.md and
docs/simulator.md (paths in a marker are relative to the repository root); ``--check`` only says
which regions differ.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from ..sim.command import markdown
from . import paper_streaming, simcheck
from .errors import UsageError
from .extras import require
from .provenance import package_root
from .report import RunResult, auto_target, format_fault_table, format_table, plot_curves
from .studies import STUDIES, study_table
from .studykit import labels_of, runs_of
from .tasks import logreg

KINDS = ("compare", "study", "logreg", "simulate", "simcheck")
#: ``lowcomm report --paper NAME PATH...``: a paper's findings beside ours, rendered from the results
#: files given (each by its study name, "compare" for a `lowcomm compare` file)
PAPERS = {paper_streaming.NAME: paper_streaming.section}
# a region: the opening marker alone on its line, then anything, then the closing marker on its line
MARKER = re.compile(
    r"^<!-- report: (?P<cmd>[^\n]+?) -->\n(?P<body>.*?)^<!-- /report -->$", re.DOTALL | re.MULTILINE
)
DOCS = (
    "README.md",
    "docs/results.md",
    "docs/simulator.md",
    "docs/fault_tolerance.md",
)  # the files --update-docs rewrites by default


@dataclass
class Source:
    """One results.json: ``label`` is the path as the user gave it (it appears in the output)."""

    label: str
    path: Path
    kind: str
    data: dict
    prefix: str = ""  # of its plots' file names


def _kind(data: dict) -> str | None:
    if isinstance(data, dict) and isinstance(data.get("outcomes"), list):
        return "simcheck"
    if (
        isinstance(data, dict)
        and isinstance(data.get("rows"), list)
        and ("preset" in data or "workload" in data)
    ):
        return "simulate"
    if not isinstance(data, dict) or not isinstance(data.get("runs"), list):
        return None
    if "study" in data:
        return "study"
    if "speeds" in data and "config" in data:
        return "logreg"
    if "rows" in data and "target_val_loss" in data:
        return "compare"
    return None


def load(label: str, base: Path | None = None) -> Source:
    """The results of ``label`` (a run folder or a results.json; relative to ``base`` when given).
    UsageError naming the path when it is missing, not JSON, or not a results file of a known
    command."""
    path = Path(label) if base is None else base / label
    if path.is_dir():
        path = path / "results.json"
    if not path.is_file():
        raise UsageError(f"{path}: no such results file (give a run folder or its results.json)")
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise UsageError(f"{path}: not a valid results.json ({exc})") from None
    except OSError as exc:
        raise UsageError(f"{path}: cannot be read ({exc.strerror})") from None
    kind = _kind(data)
    if kind is None:
        keys = ", ".join(sorted(data)) if isinstance(data, dict) else type(data).__name__
        raise UsageError(
            f"{path}: not a results.json of lowcomm compare, train, profile, simulate, a study, the "
            f"logreg task or the simulator's check (found: {keys})"
        )
    if kind == "study" and data["study"] not in STUDIES:
        raise UsageError(
            f"{path}: study {data['study']!r} is none that lowcomm report knows ({', '.join(STUDIES)})"
        )
    empty = {"simulate": "rows", "simcheck": "outcomes"}.get(kind)
    if empty and not data[empty]:
        raise UsageError(f"{path}: holds no {empty}, so there is no table to render")
    if kind in ("compare", "study"):
        if not data["runs"]:
            raise UsageError(f"{path}: holds no runs, so there is no table to render")
        for i, run in enumerate(data["runs"]):
            try:
                RunResult.from_dict(run)
            except (TypeError, KeyError, AttributeError, ValueError) as exc:
                raise UsageError(f"{path}: a run in it is malformed: runs[{i}]: {exc}") from None
    return Source(label, path, kind, data)


def provenance_line(src: Source) -> str:
    """One line: where the numbers came from."""
    p = src.data.get("provenance")
    head = f"Source: `{src.label}`"
    if not isinstance(p, dict):
        return f"{head} · no provenance recorded (written before results files carried one)"
    parts = [head, _code(p), str(p.get("started_utc") or p.get("finished_utc") or "date unknown")]
    load, machine = p.get("load") or {}, p.get("machine") or {}
    a, b = load.get("loadavg_start"), load.get("loadavg_end")
    if a and b:
        cpus = machine.get("cpu_count")
        parts.append(f"load {a[0]:g} → {b[0]:g}" + (f" on {cpus} CPUs" if cpus else ""))
    if load.get("cpu_s") is not None and load.get("wall_s") is not None:
        parts.append(f"{load['cpu_s']:.0f} CPU s in {load['wall_s']:.0f} s")
    if p.get("command"):
        parts.append(f"command: `{p['command']}`")
    line = " · ".join(parts)
    made = _made_by(src.data)
    return f"{line}\n\n{made}" if made else line


def _code(p: dict) -> str:
    """The git revision a provenance record names, and whether the tree had uncommitted changes."""
    git = p.get("git") or {}
    rev = git.get("revision")
    if rev is None:
        return "revision unknown (not run from a git checkout)"
    if git.get("dirty"):
        n = git.get("modified_count") or 0
        return f"revision `{rev[:10]}` + uncommitted changes in {n} tracked file{'s' * (n != 1)}"
    return f"revision `{rev[:10]}` (clean)"


def _made_by(data: dict) -> str:
    """For a resumable study: the code that made its saved runs (the provenance above is that of
    the command that wrote results.json, which may only have read them back) and their CPU time."""
    sits = data.get("sittings")
    if not isinstance(sits, list) or not sits:
        return ""
    codes = []
    for s in sits:
        rev = s.get("revision")
        code = "unrecorded code" if rev is None else f"revision `{rev[:10]}`"
        if rev is not None:
            code += (
                " (clean)" if s.get("diff_sha256") is None else f" + changes (diff {s['diff_sha256'][:8]})"
            )
        if "machine" in s:  # recorded by parts since machines were recorded; older files say nothing
            code += f" on {s['machine'] or 'a machine not recorded'}"
        n = len(s.get("parts") or [])
        when = f", {s['first_utc']} → {s['last_utc']}" if s.get("first_utc") else ""
        codes.append(f"{code}: {n} saved part{'s' * (n != 1)}{when}")
    cpu = [r.get("extra", {}).get("cpu_s_all_ranks") for r in data.get("runs", [])]
    cpu_note = ""
    if cpu and all(isinstance(c, (int, float)) for c in cpu):
        cpu_note = f"; {len(cpu)} runs, {sum(cpu):,.0f} CPU s of all ranks"
    revisions = {(s.get("revision"), s.get("diff_sha256")) for s in sits}
    machines = {s.get("machine") for s in sits if s.get("machine")}
    mixed = " (more than one code: the runs mix code versions)" if len(revisions) > 1 else ""
    if len(machines) > 1:
        mixed += " (more than one machine: seeded runs are not bitwise comparable across them)"
    return "Runs made by " + "; ".join(codes) + mixed + cpu_note


def _compare(src: Source, plot_dir: Path | None) -> tuple[str, list[Path]]:
    results, target = runs_of(src.data), float(src.data["target_val_loss"])
    title = src.data.get("title", "lowcomm compare")
    body = (
        f"**{title}**\n\n"
        + (f"{src.data['corpus']}\n\n" if "corpus" in src.data else "")
        + format_table(results, target)
    )
    if any((r.extra or {}).get("faults") for r in results):  # a run with --faults: its second table
        body += "\n\n" + format_fault_table(results)
    plots = plot_curves(results, plot_dir, target, prefix=src.prefix + "_") if plot_dir else []
    return body, plots


def _study(src: Source, plot_dir: Path | None) -> tuple[str, list[Path]]:
    """A study's results.json, rendered by the study itself (``studies.STUDIES``)."""
    return STUDIES[src.data["study"]].render(src.data, plot_dir, src.prefix)


def _logreg(src: Source, plot_dir: Path | None) -> tuple[str, list[Path]]:
    d, runs = src.data, src.data["runs"]
    try:
        workers = int(d.get("workers") or len(d["speeds"]))
        seeds = int(d.get("seeds") or len({r["seed"] for r in runs}))
        header = logreg.logreg_header(d["config"], list(d["speeds"])[:workers], seeds)
        table = logreg.summarise(runs)
    except (TypeError, KeyError, ValueError) as exc:
        raise UsageError(f"{src.path}: a logreg run in it is malformed ({exc!r})") from None
    plots = []
    if plot_dir:
        plots.append(plot_dir / f"{src.prefix}_logreg_gap_vs_round.png")
        logreg.plot(runs, plots[-1])
    return f"**{header}**\n\n{table.rstrip()}", plots


def _simulate(src: Source, plot_dir: Path | None) -> tuple[str, list[Path]]:
    return markdown(src.data), []


def _simcheck(src: Source, plot_dir: Path | None) -> tuple[str, list[Path]]:
    return f"**{src.data['title']}**\n\n{simcheck.table(src.data['outcomes'])}", []


RENDERERS = {
    "compare": _compare,
    "study": _study,
    "logreg": _logreg,
    "simulate": _simulate,
    "simcheck": _simcheck,
}


def across_runs(sources: list[Source]) -> str:
    """Several compare sources (the same methods, e.g. one per seed): mean ± std over them, per
    method, as the studies tabulate seeds."""
    results = [r for s in sources for r in runs_of(s.data)]
    labels = labels_of(results)
    table = study_table("compare", labels, results, auto_target(results))
    return f"**mean ± std over the {len(sources)} compare runs above**\n\n{table}"


def headline(src: Source) -> str:
    """A study's few-line reading of its results (``Study.headline``) under its provenance line."""
    study = STUDIES.get(src.data.get("study")) if src.kind == "study" else None
    if study is None or study.headline is None:
        have = ", ".join(name for name, s in STUDIES.items() if s.headline is not None)
        raise UsageError(
            f"{src.path}: --headline reads a study that has one ({have}), not this {src.kind} file"
        )
    try:
        body = study.headline(src.data)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:
        raise UsageError(f"{src.path}: a study results file with a malformed field ({exc!r})") from None
    return f"{body}\n\n{provenance_line(src)}"


def paper_section(name: str, sources: list[Source]) -> str:
    """``--paper NAME``: the paper's findings beside ours from ``sources`` (``PAPERS``), and a line
    naming each file and the code that wrote it (the files' own regions carry their full provenance)."""
    if name not in PAPERS:
        raise UsageError(f"--paper {name!r}: no such paper section ({', '.join(PAPERS)})")
    keyed: dict[str, dict] = {}
    for src in sources:
        key = src.data["study"] if src.kind == "study" else src.kind
        if key in keyed:
            raise UsageError(f"--paper {name}: two results files of {key} given; give one")
        keyed[key] = src.data
    try:
        body = PAPERS[name](keyed)
    except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:  # a malformed field
        raise UsageError(f"--paper {name}: a results file with a malformed field ({exc})") from None
    files = "; ".join(
        f"`{src.label}` at {_code(p)}"
        if isinstance(p := src.data.get("provenance"), dict)
        else f"`{src.label}` (no provenance recorded)"
        for src in sources
    )
    return f"{body}\n\nSources: {files}\n"


def render(
    labels: list[str],
    plot_dir: Path | None = None,
    base: Path | None = None,
    headlines: bool = False,
    paper: str | None = None,
) -> tuple[str, list[Path]]:
    """Markdown for the sources ``labels`` (relative to ``base`` when given; every one loaded and
    checked before anything is drawn), and the plots written into ``plot_dir`` (none when None).
    ``headlines``: each source's headline only (a study that has one), no tables or plots.
    ``paper``: the named paper's findings beside ours from all the sources together (``PAPERS``)."""
    if not labels:
        raise UsageError("lowcomm report needs at least one run folder or results.json")
    if paper is not None and (headlines or plot_dir is not None):
        raise UsageError("--paper renders one table from all its files: it takes no --headline or --plot")
    sources = [load(label, base) for label in labels]
    if paper is not None:
        return paper_section(paper, sources), []
    if headlines:
        if plot_dir is not None:
            raise UsageError("--headline draws no plots: it takes no --plot")
        return "\n\n".join(headline(src) for src in sources) + "\n", []
    used: set[str] = set()
    for i, src in enumerate(sources):  # folders of the same name (a/run, b/run) get distinct plots
        stem = re.sub(r"[^\w.-]+", "_", src.path.parent.name or "run")
        src.prefix = stem if stem not in used else f"{stem}-{i + 1}"
        used.add(src.prefix)
    if plot_dir is not None:
        require("matplotlib", "cli", "lowcomm report --plot")
    parts = []
    for src in sources:  # every table first: a bad file stops the command before any plot is drawn
        try:
            body, _ = RENDERERS[src.kind](src, None)
        except (KeyError, IndexError, TypeError, ValueError, AttributeError) as exc:  # a malformed field
            raise UsageError(
                f"{src.path}: a {src.kind} results file with a malformed field ({exc!r})"
            ) from None
        parts.append(f"{body}\n\n{provenance_line(src)}")
    compares = [s for s in sources if s.kind == "compare"]
    if len(compares) > 1:
        parts.append(across_runs(compares))
    if plot_dir is None:
        return "\n\n".join(parts) + "\n", []
    plot_dir.mkdir(parents=True, exist_ok=True)
    plots = [p for src in sources for p in RENDERERS[src.kind](src, plot_dir)[1]]
    return "\n\n".join(parts) + "\n", plots


def _marker_args(cmd: str, where: str) -> tuple[list[str], bool, str | None]:
    """A marker's paths, whether it asks for headlines (``lowcomm report --headline PATH...``) and the
    paper it asks for (``lowcomm report --paper NAME PATH...``)."""
    try:
        words = shlex.split(cmd)
    except ValueError as exc:
        raise UsageError(f"{where}: cannot parse the marker's command {cmd!r} ({exc})") from None
    heads = words[2:3] == ["--headline"]
    paper = words[3] if words[2:3] == ["--paper"] and len(words) > 3 else None
    paths = words[3:] if heads else words[4:] if paper is not None else words[2:]
    if words[:2] != ["lowcomm", "report"] or not paths or any(w.startswith("-") for w in paths):
        raise UsageError(
            f"{where}: a marker reads '<!-- report: lowcomm report [--headline | --paper NAME] PATH... -->' "
            f"(paths only), got {cmd!r}"
        )
    return paths, heads, paper


def read_doc(doc: Path) -> str:
    """The markdown file ``doc``; UsageError naming it when it cannot be read or is not UTF-8."""
    try:
        return doc.read_text(encoding="utf-8")
    except UnicodeDecodeError as exc:
        raise UsageError(f"{doc}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise UsageError(f"{doc}: cannot be read ({exc.strerror or exc})") from None


def render_regions(doc: Path, root: Path) -> tuple[str, int]:
    """``doc``'s text with every marked region re-rendered (paths relative to ``root``), and the
    number of regions."""
    text = read_doc(doc)
    count = 0

    def sub(m: re.Match) -> str:
        nonlocal count
        count += 1
        line = text.count("\n", 0, m.start()) + 1
        paths, heads, paper = _marker_args(m["cmd"], f"{doc}:{line}")
        body, _ = render(paths, base=root, headlines=heads, paper=paper)
        return f"<!-- report: {m['cmd']} -->\n{body}<!-- /report -->"

    return MARKER.sub(sub, text), count


def repo_root(doc: Path) -> Path:
    """The nearest folder at or above ``doc`` holding pyproject.toml: where marker paths start."""
    for folder in [doc.resolve().parent, *doc.resolve().parents]:
        if (folder / "pyproject.toml").is_file():
            return folder
    return doc.resolve().parent


def update_docs(docs: list[Path], check: bool = False) -> list[Path]:
    """Re-render the marked regions of ``docs``; returns the files whose regions were out of date
    (rewritten unless ``check``). Every file is rendered before any is written."""
    for doc in docs:
        if not doc.is_file():
            raise UsageError(f"--update-docs: {doc} not found")
    new = {doc: render_regions(doc, repo_root(doc))[0] for doc in docs}
    stale = [doc for doc in docs if new[doc] != read_doc(doc)]
    if not check:
        for i, doc in enumerate(stale):
            try:
                doc.write_text(new[doc], encoding="utf-8")
            except OSError as exc:
                done = f"; updated before it: {', '.join(map(str, stale[:i]))}" if i else ""
                raise UsageError(f"--update-docs: cannot write {doc} ({exc.strerror or exc}){done}") from None
    return stale


def default_docs() -> list[Path]:
    root = package_root()
    return [root / d for d in DOCS if (root / d).is_file()]
