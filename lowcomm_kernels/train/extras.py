"""The optional packages the CLI uses, checked before any worker starts.

The package's core (ops and runtime) needs only torch and numpy. The CLI draws its plots with
matplotlib, its progress bars with tqdm and loads its small real data sets from scikit-learn (the
``cli`` extra), and ``--tensorboard`` writes event
files with tensorboard (the ``tensorboard`` extra). Each is imported where it is used; this module
turns a missing one into a :class:`UsageError` that gives the ``pip install`` line, so a run never
fails at its end for want of a plotting library.
"""

from __future__ import annotations

import argparse
import importlib

from .errors import UsageError

# command -> the optional modules it always needs (beyond tqdm for progress bars)
_PLOTS = {"compare": ("matplotlib",), "train": ("matplotlib",), "profile": ("matplotlib",)}
# the tasks and studies whose data sets come with scikit-learn (breast cancer, digits)
_SKLEARN_TASKS, _SKLEARN_STUDIES = ("logreg", "mlp"), ("loscar-regimes",)


def install_hint(extra: str) -> str:
    return f"pip install 'lowcomm-kernels[{extra}]'"


def require(module: str, extra: str, what: str, package: str | None = None) -> None:
    """Import ``module`` or raise UsageError: ``<what> needs <package>, which is not installed
    (<why>): pip install 'lowcomm-kernels[<extra>]'``; ``package`` defaults to the module's top name."""
    try:
        importlib.import_module(module)
    except ImportError as exc:
        name = package or module.split(".")[0]
        raise UsageError(
            f"{what} needs {name}, which is not installed ({exc}): {install_hint(extra)}"
        ) from None


def check_cli_extras(args: argparse.Namespace) -> None:
    """The optional packages this command will use: matplotlib for the plots and tqdm for the
    progress bars (unless --no-progress), the `cli` extra; tensorboard for --tensorboard."""
    command = args.command
    for module in _PLOTS.get(command, ()):
        require(module, "cli", f"lowcomm {command} (its plots)")
    if command in _PLOTS and not getattr(args, "no_progress", True):
        require("tqdm", "cli", f"lowcomm {command} (its progress bars; or pass --no-progress)")
    task, study = getattr(args, "task", None), getattr(args, "study", None)
    if task in _SKLEARN_TASKS or study in _SKLEARN_STUDIES:
        what = f"--task {task}" if task in _SKLEARN_TASKS else f"--study {study}"
        require("sklearn", "cli", f"{what} (its data set)", package="scikit-learn")
    if getattr(args, "tensorboard", None) is not None:
        require("torch.utils.tensorboard", "tensorboard", "--tensorboard", package="tensorboard")
