"""The README and docs/ tell the truth about the code: the README's code examples (and the longer
ops example of docs/api.md) run as written, the README stays a short guide whose test command is
the one CI runs, docs/cli.md lists exactly the flags of every ``lowcomm`` command, and
docs/design.md's layer map names every room of the package (a front door that lies is worse than
none). Relative links are checked by tests/test_self_contained.py."""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
from pathlib import Path

import pytest

import lowcomm_kernels
from lowcomm_kernels.cli import build_parser

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
DOCS = ROOT / "docs"
README_MAX_LINES = 150
TEST_COMMAND = (  # verbatim in the README and in .ci/run
    "python3 -m venv .venv && .venv/bin/pip install -q torch==2.13.0 -e '.[dev]'"
    " && .venv/bin/python -m pytest -q"
)
SHARED = "Flags shared by compare, train and profile"  # docs/cli.md's section of the run flags
SHARED_USERS = ("compare", "train", "profile")
REGENERATE = ".venv/bin/python tests/test_readme.py --write-cli-doc"


def _python_blocks(md: Path = README) -> list[str]:
    return re.findall(r"```python\n(.*?)```", md.read_text(encoding="utf-8"), flags=re.S)


def _block(marker: str, md: Path = README) -> str:
    matches = [b for b in _python_blocks(md) if marker in b]
    assert len(matches) == 1, (
        f"expected one {md.name} python block containing {marker!r}, found {len(matches)}"
    )
    return matches[0]


@pytest.mark.parametrize("md", [README, DOCS / "api.md"], ids=["README", "docs/api.md"])
def test_ops_example_runs(md: Path):
    out = subprocess.run([sys.executable, "-c", _block("from lowcomm_kernels import ops", md)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith("tensor(["), out.stdout


@pytest.mark.slow
def test_wrapping_example_runs_under_torchrun(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_block("StreamingDiLoCo"))
    logs = tmp_path / "logs"  # one stdout file per rank: the two ranks' prints would interleave on one pipe
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                          f"--log-dir={logs}", "--redirects=1", str(script)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    texts = [p.read_text() for p in sorted(logs.rglob("stdout.log"))]
    lines = sorted(line.split() for text in texts for line in text.splitlines() if line.strip())
    assert [ln[0] for ln in lines] == ["0", "1"], texts
    for _, syncs, sent in lines:  # rank, number of syncs, bytes sent: both ranks synced the same
        assert int(syncs) > 0 and int(sent) > 0
    assert lines[0][1:] == lines[1][1:]


def test_the_readme_is_a_short_guide_with_the_test_command_ci_runs():
    lines = README.read_text(encoding="utf-8").splitlines()
    assert len(lines) <= README_MAX_LINES, (
        f"README.md has {len(lines)} lines (at most {README_MAX_LINES}): move detail to docs/ and link it"
    )
    assert TEST_COMMAND in lines, "the README's test command changed: it must stay verbatim (.ci/run runs it)"
    ci = ROOT / ".ci" / "run"
    if ci.is_file():
        assert TEST_COMMAND in ci.read_text().splitlines(), ".ci/run no longer runs the README's test command"


# --- docs/cli.md lists exactly the parser's flags -------------------------------------------------

def _subparsers() -> dict[str, argparse.ArgumentParser]:
    action = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction))
    return dict(action.choices)


def _flags(parser: argparse.ArgumentParser) -> set[str]:
    return {s for a in parser._actions for s in a.option_strings}


def _cli_sections() -> dict[str, str]:
    """docs/cli.md's ``## `lowcomm NAME` `` sections (and the shared one) -> their ```text blocks."""
    text = (DOCS / "cli.md").read_text(encoding="utf-8")
    sections = re.split(r"^## ", text, flags=re.M)[1:]
    out = {}
    for sec in sections:
        title, _, body = sec.partition("\n")
        m = re.fullmatch(r"`lowcomm (\w+)`", title.strip())
        name = m.group(1) if m else title.strip()
        out[name] = "\n".join(re.findall(r"```text\n(.*?)```", body, flags=re.S))
    return out


def _doc_flags(text: str) -> set[str]:
    return set(re.findall(r"(?<![\w-])(--?[a-zA-Z][\w-]*)", text))


def cli_help_blocks() -> list[str]:
    """docs/cli.md's ```text blocks, in order, from the parser at width 100: the top level, then
    compare, train and profile with their own options, the run flags they share, report, bench and
    simulate in full."""
    import os

    os.environ["COLUMNS"] = "100"
    parsers = _subparsers()

    def fmt(sp: argparse.ArgumentParser, shared: bool | None) -> str:
        f = sp._get_formatter()
        if shared is not True:
            f.add_usage(sp.usage, sp._actions, sp._mutually_exclusive_groups)
            f.add_text(sp.description)
        for g in sp._action_groups:
            own = g.title in ("options", "positional arguments")
            if not g._group_actions or (shared is True and own) or (shared is False and not own):
                continue
            f.start_section(g.title)
            f.add_text(g.description)
            f.add_arguments(g._group_actions)
            f.end_section()
        return f.format_help()

    blocks = [build_parser().format_help()]
    blocks += [fmt(parsers[n], False) for n in SHARED_USERS]
    blocks.append(fmt(parsers["compare"], True))
    blocks += [fmt(parsers[n], None) for n in ("report", "bench", "simulate")]
    return blocks


def write_cli_doc() -> None:
    """Rewrite the help blocks of docs/cli.md from the parser (the prose around them stays)."""
    path = DOCS / "cli.md"
    text = path.read_text(encoding="utf-8")
    found = list(re.finditer(r"```text\n(.*?)```", text, flags=re.S))
    blocks = cli_help_blocks()
    assert len(found) == len(blocks), f"docs/cli.md has {len(found)} text blocks, expected {len(blocks)}"
    for m, block in reversed(list(zip(found, blocks, strict=True))):
        text = text[: m.start()] + "```text\n" + block + "```" + text[m.end() :]
    path.write_text(text, encoding="utf-8")


def test_cli_doc_lists_every_flag_of_every_command():
    sections = _cli_sections()
    parsers = _subparsers()
    assert SHARED in sections, f"docs/cli.md has no section '## {SHARED}'"
    shared = _doc_flags(sections[SHARED])
    for name, parser in parsers.items():
        assert name in sections, f"docs/cli.md has no section '## `lowcomm {name}`'"
        own = _doc_flags(sections[name])
        documented = own | shared if name in SHARED_USERS else own
        missing = _flags(parser) - documented
        assert not missing, (
            f"docs/cli.md does not list these flags of `lowcomm {name}`: {sorted(missing)} "
            f"(regenerate its help blocks: {REGENERATE})"
        )
        stale = own - _flags(parser)
        assert not stale, (
            f"docs/cli.md lists flags `lowcomm {name}` does not have: {sorted(stale)} ({REGENERATE})"
        )
    union = set().union(*(_flags(parsers[n]) for n in SHARED_USERS))
    assert shared <= union, f"docs/cli.md's shared flags that no command has: {sorted(shared - union)}"


# --- docs/design.md's layer map names every room ----------------------------------------------------

def test_design_layer_map_names_every_room_of_the_package():
    text = (DOCS / "design.md").read_text(encoding="utf-8")
    layers = text[text.index("## Layers\n") : text.index("\n## ", text.index("## Layers\n") + 1)]
    pkg = Path(lowcomm_kernels.__file__).resolve().parent
    rooms = sorted(
        p.name + "/" if p.is_dir() else p.name
        for p in pkg.iterdir()
        if (p.is_dir() and (p / "__init__.py").is_file()) or (p.suffix == ".py" and p.name != "__init__.py")
    )
    missing = [r for r in rooms if r not in layers]
    assert not missing, f"docs/design.md's layer map does not name: {missing}"
    for sub in (r for r in rooms if r.endswith("/")):  # and every module of each sub-package
        modules = sorted(p.stem for p in (pkg / sub).glob("*.py") if p.stem != "__init__")
        absent = [m for m in modules if not re.search(rf"(?<![\w.]){re.escape(m)}(?![\w])", layers)]
        assert not absent, f"docs/design.md's layer map does not name these modules of {sub}: {absent}"


if __name__ == "__main__":  # .venv/bin/python tests/test_readme.py --write-cli-doc
    if sys.argv[1:] != ["--write-cli-doc"]:
        sys.exit("usage: tests/test_readme.py --write-cli-doc")
    write_cli_doc()
