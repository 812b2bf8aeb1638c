"""The provenance record every results.json carries: the code's git revision, the command, versions,
the machine and its load. A real run of the CLI is checked in test_render.py (it renders from one)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from importlib import metadata
from pathlib import Path

import pytest
import torch

from lowcomm_kernels.train import provenance

pytestmark = pytest.mark.skipif(shutil.which("git") is None, reason="needs the git command")


def _git(repo: Path, *args: str) -> str:
    env = dict(
        os.environ,
        GIT_AUTHOR_NAME="t",
        GIT_AUTHOR_EMAIL="t@example.com",
        GIT_COMMITTER_NAME="t",
        GIT_COMMITTER_EMAIL="t@example.com",
    )
    return subprocess.run(
        ["git", "-C", str(repo), *args], check=True, capture_output=True, text=True, env=env
    ).stdout.strip()


@pytest.fixture
def repo(tmp_path: Path) -> Path:
    root = tmp_path / "checkout"
    root.mkdir()
    _git(root, "init", "-q")
    for name in ("a.txt", "b.txt"):
        (root / name).write_text(name)
    _git(root, "add", "a.txt", "b.txt")
    _git(root, "commit", "-q", "-m", "first")
    return root


def test_git_revision_and_dirty_files_of_a_checkout(repo: Path):
    clean = provenance.git_info(repo)
    assert clean == {
        "revision": _git(repo, "rev-parse", "HEAD"),
        "dirty": False,
        "modified": [],
        "modified_count": 0,
        "diff_sha256": None,
    }
    (repo / "b.txt").write_text("changed")
    (repo / "untracked.txt").write_text("not part of the code")
    dirty = provenance.git_info(repo)
    assert dirty["dirty"] is True and dirty["modified"] == ["b.txt"] and dirty["modified_count"] == 1
    assert provenance.git_info(repo)["diff_sha256"] == dirty["diff_sha256"]  # same changes, same digest
    (repo / "b.txt").write_text("changed again")
    assert (
        len(dirty["diff_sha256"]) == 64 and provenance.git_info(repo)["diff_sha256"] != dirty["diff_sha256"]
    )
    _git(repo, "commit", "-q", "-am", "second")
    assert provenance.git_info(repo)["revision"] == _git(repo, "rev-parse", "HEAD") != clean["revision"]


def test_modified_list_is_short_and_the_count_complete(repo: Path):
    names = [f"f{i:02d}.txt" for i in range(provenance.MAX_MODIFIED + 5)]
    for n in names:
        (repo / n).write_text("x")
    _git(repo, "add", *names)
    _git(repo, "commit", "-q", "-m", "many")
    for n in names:
        (repo / n).write_text("y")
    info = provenance.git_info(repo)
    assert info["modified_count"] == len(names) and len(info["modified"]) == provenance.MAX_MODIFIED


def test_outside_a_checkout_every_git_field_is_null_and_nothing_is_printed(tmp_path: Path, capfd):
    plain = tmp_path / "not-a-repo"
    plain.mkdir()
    record = provenance.collect(repo=plain)
    assert set(record["git"]) == {"revision", "dirty", "modified", "modified_count", "diff_sha256"}
    assert set(record["git"].values()) == {None}
    assert capfd.readouterr() == ("", "")


def test_a_folder_inside_a_checkout_is_not_that_checkout(repo: Path):
    """A package installed in a virtual environment that lives inside some other clone must not
    report that clone's revision."""
    inner = repo / ".venv" / "lib"
    inner.mkdir(parents=True)
    assert provenance.git_info(inner)["revision"] is None


def test_without_the_git_program_the_fields_are_null(repo: Path, monkeypatch, capfd):
    monkeypatch.setenv("PATH", str(repo))  # no git on it
    assert provenance.git_info(repo)["revision"] is None
    assert capfd.readouterr() == ("", "")


def test_record_fields_versions_machine_and_load():
    start = provenance.start(["compare", "--quick", "--out", "a b"])
    sum(i * i for i in range(300_000))  # some CPU time between start and collect
    time.sleep(0.01)
    rec = provenance.collect(start)
    assert rec["argv"] == ["lowcomm", "compare", "--quick", "--out", "a b"]
    assert rec["command"] == "lowcomm compare --quick --out 'a b'"
    v = rec["versions"]
    assert v["python"] == "{}.{}.{}".format(*sys.version_info[:3])
    assert v["torch"] == metadata.version("torch") and v["numpy"] == metadata.version("numpy")
    assert set(v) == {"python", *provenance.LIBRARIES}
    assert rec["package_version"] == metadata.version("lowcomm-kernels")
    m = rec["machine"]
    assert m["cpu_count"] == os.cpu_count() and m["cpus_usable"] >= 1
    if Path("/proc/cpuinfo").is_file():
        assert m["cpu_model"]
        assert set(m["cpu_flags"]) <= set(provenance.ISA_FLAGS)
    assert m["torch_cpu_capability"] == torch.backends.cpu.get_cpu_capability()
    load = rec["load"]
    assert len(load["loadavg_start"]) == 3 and len(load["loadavg_end"]) == 3
    assert load["cpu_s"] > 0 and load["wall_s"] >= 0.01
    assert rec["started_utc"] <= rec["finished_utc"]


def test_without_a_marked_start_the_start_fields_are_unknown(monkeypatch):
    monkeypatch.setattr(provenance, "_SESSION", None)
    rec = provenance.collect()
    assert rec["started_utc"] is None and rec["finished_utc"]
    assert rec["load"]["loadavg_start"] is None and rec["load"]["cpu_s"] is None
    assert rec["load"]["wall_s"] is None and len(rec["load"]["loadavg_end"]) == 3


def test_package_checkout_revision_is_recorded():
    """Run from this source checkout, the record names its HEAD."""
    root = provenance.package_root()
    if not (root / ".git").exists():
        pytest.skip("the package is not running from a git checkout")
    assert provenance.collect()["git"]["revision"] == _git(root, "rev-parse", "HEAD")
