"""Errors the CLI reports as one line (kept in a module of its own so that `python -m
lowcomm_kernels.cli` and the console script raise and catch the same class)."""

from __future__ import annotations


class UsageError(Exception):
    """Bad command-line input: printed as one line on stderr, exit code 2."""
