"""Ready-made ``metrics_callback`` sinks: TensorBoard, ``logging``, and a fan-out to several.

Every strategy calls its ``metrics_callback(record)`` once per completed sync with a
:class:`~lowcomm_kernels.runtime.metrics.SyncRecord` (a skipped sync included). The sinks here turn
those records into TensorBoard scalars or log lines::

    from lowcomm_kernels.runtime import LoggingSink, MultiSink, StreamingDiLoCo, TensorBoardSink

    rank = torch.distributed.get_rank()
    sink = MultiSink(
        LoggingSink(),                                          # every rank: one log line per sync
        TensorBoardSink("runs/tb/rank0") if rank == 0 else None,  # rank 0 only
    )
    with StreamingDiLoCo(model, opt, sync_every=100, num_fragments=4, metrics_callback=sink):
        for step, batch in enumerate(data, start=1):
            loss = model(batch).mean(); loss.backward(); opt.step(); opt.zero_grad()
            if rank == 0:
                sink.add_scalar("train/loss", loss.item(), step)
    sink.close()

Records are per worker: each rank measures its own waits and in-flight times. To log one rank
only, give the others ``None`` (``metrics_callback=None`` is valid, and :class:`MultiSink` skips
``None`` entries); to log every rank to TensorBoard, give each its own folder (``runs/tb/rank{r}``):
TensorBoard shows each folder of event files as a run.

Only ``torch`` and the standard library are imported here; ``TensorBoardSink`` imports
``torch.utils.tensorboard`` when it is constructed (``pip install 'lowcomm-kernels[tensorboard]'``).
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Callable, MutableMapping
from pathlib import Path
from typing import Any

from .metrics import SyncRecord

__all__ = ["LoggingSink", "MultiSink", "TensorBoardSink", "record_scalars"]

TENSORBOARD_HINT = "pip install 'lowcomm-kernels[tensorboard]'"
METRICS_LOGGER = "lowcomm_kernels.metrics"


def record_scalars(rec: SyncRecord) -> dict[str, float]:
    """The numeric fields of ``rec`` by name, as floats (booleans as 0/1), in field order;
    ``apply_step`` is left out: it is the step the record belongs to. ``reason`` (text) is left out."""
    if not isinstance(rec, SyncRecord):
        raise TypeError(f"record must be a SyncRecord, got {type(rec).__name__}")
    out: dict[str, float] = {}
    for f in dataclasses.fields(rec):
        v = getattr(rec, f.name)
        if f.name != "apply_step" and isinstance(v, (bool, int, float)):
            out[f.name] = float(v)
    return out


def _has_method(obj: Any, name: str) -> bool:
    return callable(getattr(obj, name, None))


class TensorBoardSink:
    """Writes every SyncRecord's numeric fields as TensorBoard scalars.

    Each record becomes one scalar per numeric field (see :func:`record_scalars`), tagged
    ``prefix + field`` (``lowcomm/exposed_s``, ``lowcomm/bytes``, ``lowcomm/fragment``, ...) at
    ``global_step = record.apply_step``, the inner step after which the sync was applied. All
    fragments share one series per field (``lowcomm/fragment`` tells them apart); two fragments
    applied after the same step give two points at that step. Values are stored as TensorBoard's
    float32 scalars.

    Parameters
    ----------
    log_dir_or_writer:
        A folder (``str`` or path; created if missing) for a new ``SummaryWriter`` that this sink
        owns and closes, or an existing writer (anything with ``add_scalar`` and ``flush``, e.g. a
        ``torch.utils.tensorboard.SummaryWriter``) that stays the caller's: :meth:`close` only
        flushes it.
    prefix:
        Prepended to each field name (default ``"lowcomm/"``).

    Raises ImportError (with the ``pip install`` line) when tensorboard is missing, TypeError or
    ValueError naming the argument for bad input.
    """

    def __init__(self, log_dir_or_writer: str | os.PathLike[str] | Any, prefix: str = "lowcomm/") -> None:
        if not isinstance(prefix, str):
            raise TypeError(f"prefix must be a str, got {type(prefix).__name__}")
        self.prefix = prefix
        if isinstance(log_dir_or_writer, (str, os.PathLike)):
            path = Path(log_dir_or_writer)
            if not str(log_dir_or_writer).strip():
                raise ValueError(f"log_dir_or_writer: needs a folder, got {log_dir_or_writer!r}")
            if path.exists() and not path.is_dir():
                raise ValueError(f"log_dir_or_writer: {str(path)!r} is an existing file, not a folder")
            writer_cls = _summary_writer()
            try:
                path.mkdir(parents=True, exist_ok=True)
            except OSError as exc:
                raise ValueError(
                    f"log_dir_or_writer: cannot create the folder {str(path)!r} ({exc.strerror or exc})"
                ) from None
            self.writer = writer_cls(log_dir=str(path))
            self.log_dir: str | None = str(path)
            self._owns_writer = True
        elif _has_method(log_dir_or_writer, "add_scalar") and _has_method(log_dir_or_writer, "flush"):
            self.writer = log_dir_or_writer
            self.log_dir = getattr(log_dir_or_writer, "log_dir", None)
            self._owns_writer = False
        else:
            raise TypeError(
                "log_dir_or_writer must be a folder (str or os.PathLike) or a SummaryWriter, got "
                f"{type(log_dir_or_writer).__name__}"
            )
        self._closed = False

    def __call__(self, record: SyncRecord) -> None:
        """Write ``record`` (the strategy's ``metrics_callback``)."""
        values = record_scalars(record)
        for name, value in values.items():
            self.writer.add_scalar(self.prefix + name, value, global_step=record.apply_step)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        """One scalar of the caller's own (a loss, a learning rate), written as ``tag`` unprefixed."""
        if not isinstance(tag, str) or not tag:
            raise ValueError(f"tag must be a non-empty str, got {tag!r}")
        self.writer.add_scalar(tag, float(value), global_step=int(step))

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        """Flush; close the writer if this sink created it. Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        if self._owns_writer:
            self.writer.close()
        else:
            self.writer.flush()

    def __enter__(self) -> TensorBoardSink:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"TensorBoardSink({self.log_dir!r}, prefix={self.prefix!r})"


def _summary_writer() -> Any:
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError as exc:
        raise ImportError(
            f"TensorBoardSink needs the tensorboard package, which is not installed: {TENSORBOARD_HINT}"
        ) from exc
    return SummaryWriter


class LoggingSink:
    """One ``logging`` line per SyncRecord, every field as ``name=value``::

        sync fragment=1 send_step=6 apply_step=8 bytes=10240 in_flight_s=0.0131 exposed_s=0 ...

    The record itself travels as ``extra={"sync_record": record}`` for handlers that want the fields.

    Parameters
    ----------
    logger:
        A ``logging.Logger`` or ``LoggerAdapter``, or a logger's name; default
        ``logging.getLogger("lowcomm_kernels.metrics")``. Where its lines go is the application's
        ``logging`` configuration (at INFO, Python's last-resort handler prints nothing: configure
        a handler, e.g. ``logging.basicConfig(level=logging.INFO)``).
    level:
        The level of each line, an int or a level name such as ``"DEBUG"`` (default INFO).
    """

    def __init__(
        self,
        logger: logging.Logger | logging.LoggerAdapter | str | None = None,
        level: int | str = logging.INFO,
    ) -> None:
        if logger is None:
            logger = logging.getLogger(METRICS_LOGGER)
        elif isinstance(logger, str):
            logger = logging.getLogger(logger)
        elif not isinstance(logger, (logging.Logger, logging.LoggerAdapter)):
            raise TypeError(
                f"logger must be a logging.Logger, a LoggerAdapter, a logger name or None, got "
                f"{type(logger).__name__}"
            )
        if isinstance(level, str):
            number = logging.getLevelName(level.upper())
            if not isinstance(number, int):
                raise ValueError(f"level must be a logging level or its name, got {level!r}")
            level = number
        elif isinstance(level, bool) or not isinstance(level, int) or level < 0:
            raise ValueError(f"level must be a logging level (an int >= 0) or its name, got {level!r}")
        self.logger = logger
        self.level = level

    def __call__(self, record: SyncRecord) -> None:
        if not isinstance(record, SyncRecord):
            raise TypeError(f"record must be a SyncRecord, got {type(record).__name__}")
        if not self.logger.isEnabledFor(self.level):
            return
        msg, target = "sync %s", self.logger
        kwargs: MutableMapping[str, Any] = {}
        # A LoggerAdapter's process() replaces ``extra`` with its own (before Python 3.13): apply
        # each adapter's process() here and add the record to what it returns.
        while isinstance(target, logging.LoggerAdapter):
            msg, kwargs = target.process(msg, kwargs)
            target = target.logger
        kwargs["extra"] = {**(kwargs.get("extra") or {}), "sync_record": record}
        target.log(self.level, msg, format_record(record), **kwargs)

    def flush(self) -> None:
        """Nothing is buffered here (the handlers flush themselves)."""

    def close(self) -> None:
        """Nothing to release (the logger is the application's)."""

    def __repr__(self) -> str:
        name = getattr(self.logger, "name", None) or getattr(
            getattr(self.logger, "logger", None), "name", "?"
        )
        return f"LoggingSink({name!r}, level={logging.getLevelName(self.level)})"


def format_record(rec: SyncRecord) -> str:
    """``name=value`` for every field of ``rec`` in field order (floats to 4 significant digits)."""
    parts = []
    for f in dataclasses.fields(rec):
        v = getattr(rec, f.name)
        parts.append(f"{f.name}={v:.4g}" if isinstance(v, float) else f"{f.name}={v}")
    return " ".join(parts)


class MultiSink:
    """Hands each record to several sinks in order; ``None`` entries are skipped, so a sink meant for
    one rank can be written inline (``TensorBoardSink(d) if rank == 0 else None``).

    :meth:`add_scalar`, :meth:`flush` and :meth:`close` go to every sink that has them. A sink that
    raises stops the fan-out there and the error propagates (into the strategy's step).
    """

    def __init__(self, *sinks: Callable[[SyncRecord], None] | None) -> None:
        for i, s in enumerate(sinks):
            if s is not None and not callable(s):
                raise TypeError(
                    f"sinks[{i}] must be callable (a metrics callback) or None, got {type(s).__name__}"
                )
        self.sinks: tuple[Callable[[SyncRecord], None], ...] = tuple(s for s in sinks if s is not None)

    def __call__(self, record: SyncRecord) -> None:
        for s in self.sinks:
            s(record)

    def add_scalar(self, tag: str, value: float, step: int) -> None:
        for s in self.sinks:
            if _has_method(s, "add_scalar"):
                s.add_scalar(tag, value, step)  # type: ignore[attr-defined]

    def flush(self) -> None:
        for s in self.sinks:
            if _has_method(s, "flush"):
                s.flush()  # type: ignore[attr-defined]

    def close(self) -> None:
        for s in self.sinks:
            if _has_method(s, "close"):
                s.close()  # type: ignore[attr-defined]

    def __enter__(self) -> MultiSink:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __len__(self) -> int:
        return len(self.sinks)

    def __repr__(self) -> str:
        return f"MultiSink({', '.join(map(repr, self.sinks))})"
