"""The one place where ``LOWCOMM_*`` environment knobs are read.

Every public entry point also takes the knob as an argument; the environment only supplies the
default. Read lazily (at call time) so tests can monkeypatch the environment.
"""

from __future__ import annotations

import os

BACKENDS = ("ref", "cpu", "triton", "cuda")


def backend_override() -> str | None:
    """``LOWCOMM_BACKEND=ref|cpu|triton|cuda`` forces a backend for every op call."""
    value = os.environ.get("LOWCOMM_BACKEND", "").strip().lower()
    if not value:
        return None
    if value not in BACKENDS:
        raise ValueError(f"LOWCOMM_BACKEND={value!r} is not one of {BACKENDS}")
    return value


def native_library_path() -> str | None:
    """``LOWCOMM_NATIVE_LIB=/path/liblowcomm_cpu.so`` loads a specific build (development)."""
    return os.environ.get("LOWCOMM_NATIVE_LIB") or None


def native_disabled() -> bool:
    """``LOWCOMM_NO_NATIVE=1`` skips loading the csrc library (tests the fallback path)."""
    return os.environ.get("LOWCOMM_NO_NATIVE", "") not in ("", "0")


def nvtx_enabled() -> bool:
    """``LOWCOMM_NVTX=0`` turns NVTX ranges off even when the ``nvtx`` package is present."""
    return os.environ.get("LOWCOMM_NVTX", "1") not in ("0", "false", "False")
