"""Where a result came from: the one function that writes the ``provenance`` of every results.json.

A results file records the code (git revision of the package's checkout, whether it had changes and
which tracked files), the command line, the versions of the package and of the libraries it runs
on, the machine, and how loaded the machine was while the command ran (load average at the start
and at the end, CPU seconds of this process and of the worker processes it waited for). On this
project's shared machines the load decides the wall-clock columns, so a table without it cannot be
read.

Every field that cannot be known is ``None`` (no git, not a checkout, no ``/proc/cpuinfo``, a
library not installed); collecting never fails and never prints.

Usage: :func:`begin` at the start of a command (the CLI's dispatch calls it), :func:`collect` when
the results are written.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import os
import platform
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path

from .. import __version__

# Libraries whose versions decide the numbers (None when not installed). Read from the installed
# distributions' metadata, so nothing is imported.
LIBRARIES = ("torch", "numpy", "torchft", "triton")
MAX_MODIFIED = 20  # modified tracked files listed by name; the count is always complete
GIT_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class Start:
    """What is measured when a command starts."""

    utc: str
    loadavg: list[float] | None
    cpu_s: float  # this process + waited-for children, user + system
    argv: list[str] = field(default_factory=lambda: list(sys.argv))
    wall: float = field(default_factory=time.perf_counter)


def _loadavg() -> list[float] | None:
    try:
        return [round(v, 2) for v in os.getloadavg()]
    except (OSError, AttributeError):  # not on every platform
        return None


def usable_cores() -> int | None:
    """Cores this process may run on: its affinity mask (None where there is none)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        return None


def available_memory_bytes() -> int | None:
    """``MemAvailable`` of ``/proc/meminfo`` (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _cpu_s() -> float:
    t = os.times()
    return t.user + t.system + t.children_user + t.children_system


def _utc() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def start(argv: list[str] | None = None, prog: str = "lowcomm") -> Start:
    """A snapshot taken now. ``argv``: the command's arguments after the program name ``prog`` when
    they are not ``sys.argv`` (``lowcomm_kernels.cli.main(argv)`` called from Python)."""
    line = list(sys.argv) if argv is None else [prog, *argv]
    return Start(utc=_utc(), loadavg=_loadavg(), cpu_s=_cpu_s(), argv=line)


_SESSION: Start | None = None


def begin(argv: list[str] | None = None, prog: str = "lowcomm") -> Start:
    """Mark the start of this command (command line, load average, CPU time, wall clock);
    :func:`collect` measures from here. Calling it again restarts the measurement."""
    global _SESSION
    _SESSION = start(argv, prog)
    return _SESSION


def _command_line(argv: list[str]) -> str | None:
    """The command as a user would type it again: the console script's path shortened to its name."""
    if not argv:
        return None
    prog = Path(argv[0]).name
    if prog in ("lowcomm", "cli.py"):
        return shlex.join(["lowcomm", *argv[1:]])
    if " " in argv[0]:  # a program given in words, e.g. 'python -m lowcomm_kernels.train.simcheck'
        return " ".join([argv[0], shlex.join(argv[1:])]).strip()
    return shlex.join(argv)


def package_root() -> Path:
    """The folder above the ``lowcomm_kernels`` package: a source checkout's root when installed
    editable or run from a clone, site-packages otherwise."""
    return Path(__file__).resolve().parents[2]


def _git(repo: Path, *args: str) -> str | None:
    env = dict(os.environ, GIT_OPTIONAL_LOCKS="0", LC_ALL="C")  # read-only: never take index.lock
    try:
        proc = subprocess.run(
            ["git", "-C", str(repo), *args],
            capture_output=True,
            text=True,
            timeout=GIT_TIMEOUT_S,
            env=env,
            stdin=subprocess.DEVNULL,
        )
    except (OSError, subprocess.SubprocessError):  # no git binary, a hung filesystem
        return None
    return proc.stdout if proc.returncode == 0 else None


def git_info(repo: Path | None = None) -> dict:
    """{revision, dirty, modified (at most MAX_MODIFIED names), modified_count, diff_sha256 (of the
    uncommitted changes to tracked files)} of ``repo`` (default: the package's checkout). All None
    when ``repo`` is not the top of a git work tree: a package installed in a virtual environment
    that sits inside some other checkout is not that checkout's code."""
    repo = (repo or package_root()).resolve()
    none = dict.fromkeys(("revision", "dirty", "modified", "modified_count", "diff_sha256"))
    top = _git(repo, "rev-parse", "--show-toplevel")
    if top is None or Path(top.strip()).resolve() != repo:
        return none
    rev = _git(repo, "rev-parse", "HEAD")
    status = _git(repo, "status", "--porcelain", "--untracked-files=no")
    if rev is None or status is None:  # a repository with no commit yet
        return none
    modified = [line[3:] for line in status.splitlines() if line.strip()]
    diff = _git(repo, "diff", "HEAD", "--no-ext-diff", "--no-color") if modified else None
    return {
        "revision": rev.strip(),
        "dirty": bool(modified),
        "modified": modified[:MAX_MODIFIED],
        "modified_count": len(modified),
        # two runs with the same revision and digest ran the same code
        "diff_sha256": hashlib.sha256(diff.encode()).hexdigest() if diff is not None else None,
    }


def library_versions() -> dict[str, str | None]:
    out: dict[str, str | None] = {"python": platform.python_version()}
    for name in LIBRARIES:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = None
    return out


def package_version() -> str | None:
    try:
        return metadata.version("lowcomm-kernels")
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return __version__


def _cpuinfo_field(*keys: str) -> str | None:
    """The value of the first ``/proc/cpuinfo`` line named one of `keys` (None without the file)."""
    try:
        text = Path("/proc/cpuinfo").read_text(errors="replace")
    except OSError:
        return None
    for line in text.splitlines():
        key, _, value = line.partition(":")
        if key.strip() in keys:
            return value.strip()
    return None


def cpu_model() -> str | None:
    return _cpuinfo_field("model name", "Model", "cpu model") or platform.processor() or None


# The vector extensions that decide which kernels torch and its BLAS run, hence the last bits of
# every float32 result: the same seeded run on an AVX2 and on an AVX-512 machine trains apart
# (by chaos over thousands of steps, up to the seed noise), so a results file names them.
ISA_FLAGS = ("avx", "avx2", "fma", "avx512f", "avx512bw", "avx512_bf16", "amx_tile", "asimd", "sve")


def cpu_flags() -> list[str] | None:
    """The :data:`ISA_FLAGS` this CPU reports (None without ``/proc/cpuinfo``)."""
    value = _cpuinfo_field("flags", "Features")
    if value is None:
        return None
    have = set(value.split())
    return [f for f in ISA_FLAGS if f in have]


def torch_cpu_capability() -> str | None:
    """The vector level torch's own CPU kernels dispatch to (``AVX512``, ``AVX2``, ``DEFAULT``…;
    the ``ATEN_CPU_CAPABILITY`` environment variable lowers it)."""
    try:
        import torch  # kept local: provenance also describes machines without torch

        return str(torch.backends.cpu.get_cpu_capability())
    except Exception:  # an old torch, or none: unknown, never an error
        return None


def machine() -> dict:
    usable = usable_cores()
    return {
        "platform": platform.platform(),
        "arch": platform.machine(),
        "cpu_count": os.cpu_count(),
        "cpus_usable": usable,
        "cpu_model": cpu_model(),
        "cpu_flags": cpu_flags(),
        "torch_cpu_capability": torch_cpu_capability(),
    }


def collect(since: Start | None = None, *, repo: Path | None = None) -> dict:
    """The ``provenance`` record of a results file, measured from ``since`` (default: the
    :func:`begin` of this command; without either the start fields are None). ``repo``: the
    checkout to describe (default: the package's own)."""
    first = since or _SESSION
    argv = first.argv if first is not None else list(sys.argv)
    return {
        "git": git_info(repo),
        "argv": argv,
        "command": _command_line(argv),
        "package_version": package_version(),
        "versions": library_versions(),
        "machine": machine(),
        # no start was marked (a Python caller that never went through the CLI): the start fields
        # are unknown, not zero
        "started_utc": first.utc if first else None,
        "finished_utc": _utc(),
        "load": {
            "loadavg_start": first.loadavg if first else None,
            "loadavg_end": _loadavg(),
            "cpu_s": round(_cpu_s() - first.cpu_s, 3) if first else None,
            "wall_s": round(time.perf_counter() - first.wall, 3) if first else None,
        },
    }


def results_file_flags(ap, default: Path, what: str) -> None:
    """A benchmark script's two flags for its results file: ``--out FILE`` (where a run writes its
    results and their provenance, default `default`) and ``--render [FILE]`` (run nothing: print
    `what` from that file, by default `default`)."""
    ap.add_argument("--out", type=Path, default=default, help=f"results file (default {default})")
    ap.add_argument(
        "--render",
        type=Path,
        nargs="?",
        const=default,
        default=None,
        help=f"run nothing: print {what} of this results file (default {default})",
    )
