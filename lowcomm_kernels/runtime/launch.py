"""Run a function on M local worker processes joined by a gloo process group (tests, benchmarks).

``spawn_local("path/to/file.py:fn", world=2, args=(...,))`` starts ``world`` processes with the
``spawn`` start method; each sets one intra-op thread, initialises gloo over 127.0.0.1 on a free
port, calls ``fn(rank, world, *args)`` and returns its (picklable) result through a file. The target
is named by file path so it need not be importable as a module (test files, scripts).
Returns the per-rank results; raises ``RuntimeError`` with each failed rank's traceback. A rank may
also be expected to die (``allow_dead``), as in the dead-peer tests.

For real multi-node runs use ``torchrun`` instead (see README); this is the single-machine harness.
"""

from __future__ import annotations

import datetime
import importlib.util
import os
import pickle
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Sequence
from typing import Any

import torch.multiprocessing as mp


def free_port() -> int:
    """A TCP port that was free a moment ago (bind to port 0 on 127.0.0.1)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _load(target: str):
    path, _, name = target.rpartition(":")
    spec = importlib.util.spec_from_file_location(f"_lowcomm_target_{abs(hash(path))}", path)
    if spec is None or spec.loader is None:
        raise ImportError(f"cannot load {path}")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return getattr(mod, name)


def _entry(rank: int, world: int, port: int, target: str, args: tuple, out_dir: str, pg_timeout_s: float,
           env: dict[str, str]) -> None:
    os.environ.update(env)
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    out = os.path.join(out_dir, f"rank{rank}.pkl")
    try:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                timeout=datetime.timedelta(seconds=pg_timeout_s))
        result = _load(target)(rank, world, *args)
        payload = ("ok", result)
    except BaseException as e:  # report every failure to the parent, with its traceback
        payload = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    with open(out + ".tmp", "wb") as f:
        pickle.dump(payload, f)
    os.replace(out + ".tmp", out)
    # Leave at once: a clean destroy_process_group() can block on peers that are still working (or
    # dead), and the parent only needs the result file.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn_local(target: str, world: int, args: Sequence[Any] = (), *, timeout_s: float = 120.0,
                pg_timeout_s: float = 60.0, allow_dead: Sequence[int] = (),
                env: dict[str, str] | None = None) -> list[Any]:
    """Run ``target(rank, world, *args)`` on ``world`` gloo ranks; see the module docstring.
    Ranks in ``allow_dead`` may exit without a result (their entry is None)."""
    ctx = mp.get_context("spawn")
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="lowcomm_spawn_") as out_dir:
        procs = [ctx.Process(target=_entry, args=(r, world, port, target, tuple(args), out_dir, pg_timeout_s,
                                                  dict(env or {})), daemon=False) for r in range(world)]
        for p in procs:
            p.start()
        deadline = time.monotonic() + timeout_s
        for p in procs:
            p.join(max(0.0, deadline - time.monotonic()))
        hung = [r for r, p in enumerate(procs) if p.is_alive()]
        for r in hung:
            procs[r].kill()
            procs[r].join()
        results: list[Any] = []
        errors = []
        for r in range(world):
            path = os.path.join(out_dir, f"rank{r}.pkl")
            if not os.path.exists(path):
                if r in allow_dead:
                    results.append(None)
                    continue
                why = "hung (killed after timeout)" if r in hung else f"exit code {procs[r].exitcode}"
                errors.append(f"rank {r}: no result ({why})")
                results.append(None)
                continue
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                errors.append(f"rank {r}: {value}")
            results.append(value if status == "ok" else None)
        if errors:
            raise RuntimeError("worker failure(s):\n" + "\n".join(errors))
        return results
