"""The drop-in wrapper shared by every strategy: hooking, timing, metrics, checkpoints, guard.

A strategy wraps ``(model, inner_optimizer)``. The user's loop stays untouched::

    with StreamingDiLoCo(model, opt, sync_every=100, num_fragments=4, fragment_sync_delay=5):
        for batch in data:
            model(batch).mean().backward(); opt.step(); opt.zero_grad()

Entering the context registers ``inner_optimizer.register_step_post_hook``; after every inner
step the strategy polls its in-flight collectives, applies the results that are due, and sends the
fragments that are due (``_advance``, defined by each strategy). Loops that prefer it call
``strategy.step()`` after ``opt.step()`` instead (not both). Leaving the context drains in-flight
collectives (their results stay pending and are applied at their scheduled step if training goes on).

Subclasses implement ``_advance(t)``, ``_drain()``, ``_state()`` / ``_load_state()`` and
``_guard_values()``; everything else lives here.
"""

from __future__ import annotations

import abc
import hashlib
import math
import os
import time
import warnings
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..profiling import nvtx_range
from .fragments import FlatFragments, FragmentSpec
from .metrics import RuntimeMetrics, SyncRecord
from .transport import WAN, Transport

FORMAT_VERSION = 1
NONFINITE_MODES = ("skip", "raise")


class CheckpointError(ValueError):
    """A checkpoint that does not belong to this strategy (version, method, shape) or is unreadable."""


class ConsistencyError(RuntimeError):
    """Ranks disagree on state that must be identical (g, schedule); names the first differing fragment."""


def resolve_group(process_group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("process_group: torch.distributed is not initialised; call "
                         "dist.init_process_group(...) first (a group of size 1 is fine for one worker)")
    group = process_group if process_group is not None else dist.group.WORLD
    if group is None or dist.get_rank(group) < 0:
        raise ValueError("process_group: this rank is not a member of the given process group")
    return group


def check_int(name: str, value: object, lo: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    if value < lo:
        raise ValueError(f"{name} must be >= {lo}, got {value}")
    return value


def check_float(name: str, value: object, lo: float, hi: float | None = None, *,
                lo_open: bool = False, hi_open: bool = False) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise TypeError(f"{name} must be a finite real number, got {value!r}")
    v = float(value)
    if v < lo or (lo_open and v == lo) or (hi is not None and (v > hi or (hi_open and v == hi))):
        lo_s = f"{'(' if lo_open else '['}{lo}"
        hi_s = f"{hi}{')' if hi_open else ']'}" if hi is not None else "inf)"
        raise ValueError(f"{name} must lie in {lo_s}, {hi_s}, got {v}")
    return v


def tensor_hash(t: torch.Tensor) -> int:
    """63-bit hash of a tensor's bytes (identical bytes on every rank -> identical hash)."""
    data = t.detach().contiguous().cpu().view(torch.uint8).numpy().tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


class Strategy(abc.ABC):
    """Base class: see the module docstring. ``method`` names the algorithm in checkpoints."""

    method = "base"

    def __init__(self, model: nn.Module, inner_optimizer: torch.optim.Optimizer, *, num_fragments: int,
                 fragments: FragmentSpec = None, process_group: dist.ProcessGroup | None = None,
                 wan: WAN | None = None, wire_dtype: torch.dtype | None = None,
                 on_nonfinite: str = "skip", timeout_s: float = 300.0, outer_device: str = "model",
                 metrics_callback: Callable[[SyncRecord], None] | None = None, guard_every: int = 0) -> None:
        if not isinstance(model, nn.Module):
            raise TypeError(f"model must be a torch.nn.Module, got {type(model).__name__}")
        if not isinstance(inner_optimizer, torch.optim.Optimizer):
            raise TypeError("inner_optimizer must be a torch.optim.Optimizer, got "
                            f"{type(inner_optimizer).__name__}")
        if on_nonfinite not in NONFINITE_MODES:
            raise ValueError(f"on_nonfinite must be one of {NONFINITE_MODES}, got {on_nonfinite!r}")
        if outer_device not in ("model", "cpu"):
            raise ValueError(f"outer_device must be 'model' or 'cpu', got {outer_device!r}")
        if metrics_callback is not None and not callable(metrics_callback):
            raise TypeError("metrics_callback must be callable or None")
        self.guard_every = check_int("guard_every", guard_every, 0)
        check_int("num_fragments", num_fragments, 1)
        self.group = resolve_group(process_group)
        self.model = model
        self.inner_optimizer = inner_optimizer
        self.frags = FlatFragments(model, num_fragments, fragments)
        dtype = self.frags.dtype
        if wire_dtype is None:
            wire_dtype = dtype
        if wire_dtype not in (dtype, torch.bfloat16):
            raise TypeError(f"wire_dtype must be {dtype} (the parameters' dtype) or torch.bfloat16, "
                            f"got {wire_dtype}")
        self.wire_dtype = wire_dtype
        self.on_nonfinite = on_nonfinite
        self.device = self.frags.device
        # g and u may live on the CPU (pinned) to save accelerator memory; ops then run on the CPU.
        self.outer_dev = torch.device("cpu") if outer_device == "cpu" else self.device
        self.transport = Transport(self.group, device=self.device, wan=wan, timeout_s=timeout_s)
        self.world = self.transport.world
        self.rank = self.transport.rank
        self.metrics = RuntimeMetrics()
        self.metrics_callback = metrics_callback
        self.step_count = 0
        self._hook: Any = None  # torch.utils.hooks.RemovableHandle while active
        self._compute_range: Any = None  # open lowcomm/compute range between two hooks
        self._last_end = time.perf_counter()
        self._applied_since_guard = 0

    # ----- buffers -------------------------------------------------------------------------------
    def _outer_buffer(self) -> torch.Tensor:
        """A zeroed buffer laid out like the flat parameters, on the outer device (pinned CPU if the
        model is on a GPU)."""
        pin = self.outer_dev.type == "cpu" and self.device.type == "cuda"
        buf = torch.zeros(self.frags.numel, dtype=self.frags.dtype, device=self.outer_dev, pin_memory=pin)
        return buf

    # ----- the user-facing loop API --------------------------------------------------------------
    def __enter__(self) -> Strategy:
        if self._hook is not None:
            raise RuntimeError("this strategy is already active (nested `with`?)")
        self._last_end = time.perf_counter()
        self._hook = self.inner_optimizer.register_step_post_hook(lambda opt, args, kwargs: self._on_step())
        self._open_compute_range()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self._close_compute_range()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        if exc_type is None:
            self.drain()

    def step(self) -> None:
        """Call once after each ``inner_optimizer.step()`` when not using ``with strategy:``."""
        if self._hook is not None:
            raise RuntimeError("strategy.step() called inside `with strategy:`; the optimizer hook "
                               "already advances the strategy (use one or the other)")
        self._on_step()

    def _open_compute_range(self) -> None:
        # lowcomm/compute spans the user's code between two hooks (forward, backward, inner step).
        self._close_compute_range()
        self._compute_range = nvtx_range("compute")
        self._compute_range.__enter__()

    def _close_compute_range(self) -> None:
        cm = getattr(self, "_compute_range", None)
        self._compute_range = None
        if cm is not None:
            cm.__exit__(None, None, None)

    def _on_step(self) -> None:
        t0 = time.perf_counter()
        self._close_compute_range()
        compute = t0 - self._last_end
        self.step_count += 1
        self.metrics.steps = self.step_count
        self.metrics.compute_s += compute
        self.metrics.step_compute_s.append(compute)
        with torch.no_grad():
            exposed_before = self.metrics.exposed_comm_s
            self._advance(self.step_count)
            if self.guard_every and self._applied_since_guard >= self.guard_every:
                self._applied_since_guard = 0
                self.check_consistency()
        t1 = time.perf_counter()
        self.metrics.overhead_s += max(0.0, (t1 - t0) - (self.metrics.exposed_comm_s - exposed_before))
        self._last_end = t1
        self._open_compute_range()

    def _record(self, rec: SyncRecord) -> None:
        m = self.metrics
        m.syncs.append(rec)
        m.num_syncs += 1
        m.num_skipped += int(rec.skipped)
        m.bytes_sent += rec.bytes
        m.exposed_comm_s += rec.exposed_s
        self._applied_since_guard += 1
        if self.metrics_callback is not None:
            self.metrics_callback(rec)

    def _nonfinite(self, count: float, what: str) -> bool:
        """Handle a sync whose combined non-finite count is ``count`` (identical on every rank)."""
        if count <= 0:
            return False
        msg = (f"{what}: {int(count)} non-finite pseudo-gradient entries summed over the "
               f"{self.world} ranks; every rank skips this sync (g and u unchanged)")
        if self.on_nonfinite == "raise":
            raise FloatingPointError(msg)
        warnings.warn(msg, RuntimeWarning, stacklevel=3)
        return True

    # ----- subclass interface --------------------------------------------------------------------
    @abc.abstractmethod
    def _advance(self, t: int) -> None:
        """Defined by each strategy."""

    @abc.abstractmethod
    def _drain(self) -> None:
        """Defined by each strategy."""

    @abc.abstractmethod
    def _state(self) -> dict[str, Any]:
        """Defined by each strategy."""

    @abc.abstractmethod
    def _load_state(self, sd: dict[str, Any]) -> None:
        """Defined by each strategy."""

    @abc.abstractmethod
    def _guard_values(self) -> list[tuple[str, int]]:
        """Defined by each strategy."""

    def finish(self) -> None:
        """End of training: wait for and apply every in-flight sync NOW (earlier than scheduled), so
        the parameters include the last results. Collective; call on every rank at the same step."""
        with torch.no_grad():
            self._finish()

    @abc.abstractmethod
    def _finish(self) -> None:
        """Defined by each strategy."""

    def drain(self) -> None:
        """Wait for every in-flight collective. Results stay pending and are applied at their
        scheduled step, so draining never changes the trajectory."""
        with torch.no_grad():
            self._drain()

    # ----- consistency guard ---------------------------------------------------------------------
    def check_consistency(self) -> None:
        """All-gather a hash of each piece of shared state; raise ConsistencyError naming the first
        piece (fragment of g, or schedule state) that differs between ranks. Collective: every rank
        of the group must call it at the same point (``guard_every=`` does this for you)."""
        named = self._guard_values()
        mine = torch.tensor([h for _, h in named], dtype=torch.int64)
        if self.device.type == "cuda":
            mine = mine.to(self.device)
        outs = self.transport.blocking_all_gather(mine, name=f"consistency guard at step {self.step_count}")
        table = torch.stack([o.cpu() for o in outs])  # (world, pieces)
        for j, (what, _) in enumerate(named):
            col = table[:, j]
            if not bool((col == col[0]).all()):
                raise ConsistencyError(f"ranks disagree on {what} at step {self.step_count} "
                                       f"(hashes by rank: {col.tolist()})")

    # ----- checkpoints ---------------------------------------------------------------------------
    def shape(self) -> dict[str, Any]:
        """What a checkpoint must match to be loaded into this strategy."""
        return {"method": self.method, "fragments": self.frags.num_fragments, "world_size": self.world,
                "param_count": self.frags.numel, "fragment_sizes": self.frags.sizes()}

    def state_dict(self) -> dict[str, Any]:
        """g, u, pending results and schedule state (drains in-flight collectives first). Tensors
        are CPU clones; everything is loadable with ``torch.load(weights_only=True)``."""
        self.drain()
        return {"format_version": FORMAT_VERSION, "shape": self.shape(), "step": self.step_count,
                **self._state()}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self._check_shape(sd)
        self.drain()
        with torch.no_grad():
            self._load_state(sd)
        self.step_count = int(sd["step"])
        self.metrics.steps = self.step_count

    def _check_shape(self, sd: object) -> None:
        if not isinstance(sd, dict) or "format_version" not in sd or "shape" not in sd:
            raise CheckpointError("not a lowcomm strategy state (missing format_version / shape)")
        if sd["format_version"] != FORMAT_VERSION:
            raise CheckpointError(f"checkpoint format version {sd['format_version']} is not supported "
                                  f"(this build reads version {FORMAT_VERSION})")
        mine, theirs = self.shape(), sd["shape"]
        for key in mine:
            if theirs.get(key) != mine[key]:
                raise CheckpointError(f"checkpoint {key} is {theirs.get(key)!r} but this strategy has "
                                      f"{mine[key]!r}; a checkpoint loads only into the same method, "
                                      "fragments, world size and model")

    def save_checkpoint(self, path: str | os.PathLike) -> None:
        """Write strategy + model + inner-optimizer state of THIS rank to ``path`` atomically
        (temporary file in the same directory, then ``os.replace``). One file per rank."""
        path = os.fspath(path)
        obj = {"format_version": FORMAT_VERSION, "shape": self.shape(), "strategy": self.state_dict(),
               "model": {k: v.detach().cpu().clone() for k, v in self.model.state_dict().items()},
               "optimizer": self.inner_optimizer.state_dict()}
        tmp = f"{path}.tmp.{os.getpid()}"
        try:
            torch.save(obj, tmp)
            os.replace(tmp, path)
        finally:
            if os.path.exists(tmp):
                os.remove(tmp)

    def load_checkpoint(self, path: str | os.PathLike) -> None:
        """Restore what ``save_checkpoint`` wrote (``weights_only=True``); clear error on mismatch."""
        try:
            obj = torch.load(os.fspath(path), map_location="cpu", weights_only=True)
        except FileNotFoundError:
            raise
        except Exception as e:
            raise CheckpointError(f"cannot read checkpoint {os.fspath(path)!r}: "
                                  f"{type(e).__name__}: {e}") from e
        self._check_shape(obj)
        self._check_shape(obj.get("strategy"))
        with torch.no_grad():
            self.model.load_state_dict(obj["model"])  # copies into the flat views, in place
        self.frags.check_views()
        self.inner_optimizer.load_state_dict(obj["optimizer"])
        self.load_state_dict(obj["strategy"])


def nvtx(name: str):
    """Shorthand so strategy code reads ``with nvtx("pack"):``."""
    return nvtx_range(name)
