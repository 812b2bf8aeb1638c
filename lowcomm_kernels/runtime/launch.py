"""The one way this package starts worker processes on this machine: M ranks joined by gloo.

``launch(fn, world, args)`` starts ``world`` processes with the ``spawn`` start method. Each sets one
intra-op thread, joins a gloo process group over 127.0.0.1 on a free port and calls
``fn(rank, world, *args)``. The protocol, per rank over a pipe of its own (so a rank killed halfway
cannot block the others), pickled by value:

- progress: ``send(payload)`` inside a worker calls ``on_message(rank, payload)`` in the parent;
- result: ``fn``'s return value, once; ``launch`` returns them in rank order;
- error: ``fn`` raised; the parent gets its one-line summary and traceback. A rank that exits without
  either (killed, out of memory) or outlives ``timeout_s`` is a failure too, unless in ``allow_dead``
  (whose result is then None).

On a failure, ``launch`` stops every rank at once (``stop_on_failure``, what a training run wants:
the others would wait on it in collectives) or waits for the rest (what a test of failures wants,
to see each rank's error), then raises :class:`WorkerError`. A rank leaves with ``os._exit`` after
its report: a clean ``destroy_process_group()`` can block on peers that are still working (or dead).

``spawn_local("path/to/file.py:fn", world, args)`` names the target by file path, so it need not
be importable as a module (test files, benchmark scripts), and waits for every rank.

For real multi-node runs use ``torchrun`` instead (see README); this is the single-machine harness.
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import pickle
import socket
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

import torch.multiprocessing as mp

_to_parent: Connection | None = None  # set in each worker process


def free_port() -> int:
    """A TCP port that was free a moment ago (bind to port 0 on 127.0.0.1)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def send(payload: Any) -> None:
    """From inside a worker: hand ``payload`` to the parent's ``on_message(rank, payload)``."""
    if _to_parent is None:
        raise RuntimeError("send() works only inside a worker started by launch()")
    _to_parent.send_bytes(pickle.dumps(("message", payload)))


@dataclass
class RankFailure:
    rank: int
    summary: str  # one line: "ValueError: ...", "exited with code -9 without a result ...", "hung ..."
    traceback: str = ""


class WorkerError(RuntimeError):
    """Ranks failed. ``failures`` lists them in the order they were seen (``failures[0]`` is the
    first); the message has each one's summary and traceback, in rank order."""

    def __init__(self, failures: list[RankFailure]) -> None:
        self.failures = failures
        lines = [
            f"rank {f.rank}: {f.summary}" + (f"\n{f.traceback}" if f.traceback else "")
            for f in sorted(failures, key=lambda f: f.rank)
        ]
        super().__init__("worker failure(s):\n" + "\n".join(lines))


def _load(target: str) -> Callable[..., Any]:
    path, _, name = target.rpartition(":")
    spec = importlib.util.spec_from_file_location(f"_lowcomm_target_{abs(hash(path))}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return getattr(mod, name)


def _entry(
    rank: int,
    world: int,
    port: int,
    fn: Callable[..., Any] | str,
    args: tuple,
    conn: Connection,
    pg_timeout_s: float | None,
    env: dict[str, str],
) -> None:
    global _to_parent
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # M ranks share the cores: more intra-op threads only thrash
    _to_parent = conn
    try:
        timeout = {} if pg_timeout_s is None else {"timeout": datetime.timedelta(seconds=pg_timeout_s)}
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, **timeout
        )
        target = _load(fn) if isinstance(fn, str) else fn
        report = pickle.dumps(("result", target(rank, world, *args)))
    except BaseException as e:  # every failure goes to the parent, with its traceback
        report = pickle.dumps(("error", f"{type(e).__name__}: {e}", traceback.format_exc()))
    try:
        conn.send_bytes(report)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(0)


def launch(
    fn: Callable[..., Any] | str,
    world: int,
    args: Sequence[Any] = (),
    *,
    timeout_s: float | None = None,
    pg_timeout_s: float | None = None,
    allow_dead: Sequence[int] = (),
    env: dict[str, str] | None = None,
    on_message: Callable[[int, Any], None] | None = None,
    stop_on_failure: bool = True,
) -> list[Any]:
    """Run ``fn(rank, world, *args)`` on ``world`` gloo ranks; see the module docstring.

    fn: a picklable function, or ``"path/to/file.py:name"``. pg_timeout_s: the process group's
    timeout (None: torch's default). Returns the ranks' results; raises :class:`WorkerError`."""
    ctx = mp.get_context("spawn")
    port = free_port()
    procs, pipes = [], {}
    for rank in range(world):
        reader, writer = ctx.Pipe(duplex=False)
        p = ctx.Process(
            target=_entry,
            args=(rank, world, port, fn, tuple(args), writer, pg_timeout_s, dict(env or {})),
            daemon=False,
        )
        p.start()
        writer.close()  # the child holds the only writing end: end of file = the rank has exited
        procs.append(p)
        pipes[reader] = rank
    results: list[Any] = [None] * world
    failures: list[RankFailure] = []
    deadline = None if timeout_s is None else time.monotonic() + timeout_s
    try:
        while pipes and not (failures and stop_on_failure):
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                break
            for reader in wait(list(pipes), timeout=left):
                rank = pipes[reader]
                try:
                    kind, *body = pickle.loads(reader.recv_bytes())
                except (EOFError, OSError, pickle.UnpicklingError):  # exited without a report
                    del pipes[reader]
                    reader.close()
                    if rank not in allow_dead:
                        procs[rank].join(timeout=5)
                        code = procs[rank].exitcode
                        failures.append(
                            RankFailure(
                                rank, f"exited with code {code} without a result (killed? out of memory?)"
                            )
                        )
                    continue
                if kind == "message":
                    if on_message is not None:
                        on_message(rank, body[0])
                    continue
                del pipes[reader]  # a result or an error is a rank's last word
                reader.close()
                if kind == "result":
                    results[rank] = body[0]
                else:
                    failures.append(RankFailure(rank, body[0], body[1]))
        if not (failures and stop_on_failure):
            failures += [
                RankFailure(rank, f"hung: no result after {timeout_s:g} s (killed)")
                for rank in sorted(pipes.values())
                if rank not in allow_dead
            ]
    finally:
        for p in procs:  # ranks still running: stopped (a failure elsewhere, the timeout, Ctrl-C)
            if p.is_alive():
                p.kill()
        for p in procs:
            p.join()
        for reader in pipes:
            reader.close()
    if failures:
        raise WorkerError(failures)
    return results


def spawn_local(
    target: str,
    world: int,
    args: Sequence[Any] = (),
    *,
    timeout_s: float = 120.0,
    pg_timeout_s: float = 60.0,
    allow_dead: Sequence[int] = (),
    env: dict[str, str] | None = None,
) -> list[Any]:
    """Run ``target`` ("path/to/file.py:fn") on ``world`` gloo ranks and wait for every one of them.
    Returns the per-rank results; ranks in ``allow_dead`` may exit without one (their entry is None).
    Raises :class:`WorkerError` (a RuntimeError) with each failed rank's traceback."""
    return launch(
        target,
        world,
        args,
        timeout_s=timeout_s,
        pg_timeout_s=pg_timeout_s,
        allow_dead=allow_dead,
        env=env,
        stop_on_failure=False,
    )
