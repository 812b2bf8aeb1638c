"""``--faults``: the main job (``lowcomm train`` / ``lowcomm compare``) through a lost and a returning worker.

The schedule is a comma list of events, each ``kill:W@S`` or ``return:W@S``::

    --faults "kill:2@200,return:2@260"

- ``kill:W@S``: worker W is SIGKILLed right after its optimizer step S (it stops there and the
  parent kills it, so the step is exact);
- ``return:W@S``: a fresh process for worker W is started once worker 0 has reached step S and the
  kill happened; the live workers wait at step S until the new process is up, then train on; it
  joins the quorum at its first optimizer step and is healed from a healthy peer at the next sync.

Rules (each broken one is a :class:`UsageError` naming ``--faults``, before any process starts):
W in 1 .. --workers - 1 (worker 0 stays alive: it reports), a kill only of a live worker and a return
only of a killed one, steps increasing per worker, a kill at 1 .. --steps - 1, a return after the kill
with ``S + --sync-every <= --steps`` (it heals at a sync), and at least two workers alive at every step
(a quorum needs two).

With ``--faults`` the workers run as torchft replicas (``runtime.ft``): one process per replica, a
``LighthouseServer`` in the parent, each strategy built with ``manager=``; there is no fixed gloo
group. So there is no emulated WAN (``--latency-ms`` / ``--bandwidth-mbps`` do not apply), no quantized
wire format, and the data-parallel baseline ``dp`` is refused (it needs an all-reduce per step over a
fixed group). Evaluation: each live replica evaluates its own parameters on the validation batches
(there is no fixed group to average over); the run's curve is worker 0's, the lowest-numbered live
replica at every step, and every replica's own curve is kept in results.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import re
import sys
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta
from multiprocessing.connection import wait
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp
from torch.distributed import TCPStore

from ..runtime.base import tensor_hash
from . import presets, provenance
from .args import out_dir, parse_methods
from .corpus import eval_set, sample_batch, worker_shard
from .errors import UsageError
from .extras import require
from .loop import TrainLoop, every
from .model import TinyLlama, num_parameters
from .report import (
    EvalPoint,
    RunResult,
    auto_target,
    comparison_rows,
    format_fault_table,
    format_table,
    plot_curves,
    write_json,
)
from .runner import _Progress
from .spec import METHODS, PARAM_DTYPES, WIRE_DTYPE_NAMES
from .strategies import CommTotals, build_strategy
from .tasks.lm import build_specs, load_checked_corpus
from .timeline import draw, load_intervals
from .worker import (
    _flat_float32,
    _profiler,
    _windows_loss_sum,
    eval_batch_windows,
    lr_schedule,
    slim_trace,
)

FLAG = "--faults"
SYNTAX = "comma list of kill:W@S and return:W@S (worker W, step S), e.g. kill:2@200,return:2@260"
_EVENT = re.compile(r"^(kill|return):(\d+)@(\d+)$")
REPORTER = 0  # the replica whose curve is the run's (the schedule never kills it)
# torchft's timeouts for the CLI's replicas (seconds); see docs/fault_tolerance.md
COLLECTIVE_TIMEOUT_S = 10.0
QUORUM_TIMEOUT_S = 300.0
JOIN_TIMEOUT_MS = 30000
HEARTBEAT_TIMEOUT_MS = 1000
HOLD_TIMEOUT_S = 300.0  # the live workers wait this long at a return step for the new process


@dataclass(frozen=True)
class Fault:
    kind: str  # "kill" or "return"
    worker: int
    step: int

    def __str__(self) -> str:
        return f"{self.kind}:{self.worker}@{self.step}"


@dataclass(frozen=True)
class FaultSchedule:
    events: tuple[Fault, ...]

    def __str__(self) -> str:
        return ",".join(str(e) for e in self.events)

    def kills(self) -> list[Fault]:
        return [e for e in self.events if e.kind == "kill"]

    def returns(self) -> list[Fault]:
        return [e for e in self.events if e.kind == "return"]


NO_FAULTS = FaultSchedule(())


def parse_faults(
    text: str, *, workers: int, steps: int, sync_every: int, sync_flag: str = "--sync-every"
) -> FaultSchedule:
    """The schedule of ``--faults text`` for a run of ``workers`` workers and ``steps`` steps with a
    sync every ``sync_every`` steps (the flag that sets it: ``sync_flag``), or a UsageError naming the
    flag and the bad event."""
    if not text or not text.strip():
        raise UsageError(f"{FLAG} needs at least one event: {SYNTAX}")
    events = []
    for part in text.split(","):
        item = part.strip()
        m = _EVENT.match(item)
        if m is None:
            raise UsageError(f"{FLAG}: cannot read {item!r}: {SYNTAX}")
        events.append(Fault(m[1], int(m[2]), int(m[3])))
    for e in events:
        if e.worker == REPORTER:
            raise UsageError(
                f"{FLAG}: {e}: worker 0 stays alive (it evaluates and reports the run); "
                f"choose a worker in 1 .. {workers - 1}"
            )
        if not 0 < e.worker < workers:
            raise UsageError(f"{FLAG}: {e}: no worker {e.worker} with --workers {workers}")
        if e.kind == "kill" and not 1 <= e.step < steps:
            raise UsageError(f"{FLAG}: {e}: a kill step must lie in 1 .. {steps - 1} (--steps {steps})")
        if e.kind == "return" and e.step + sync_every > steps:
            raise UsageError(
                f"{FLAG}: {e}: a returning worker heals at a sync, so the return step plus "
                f"{sync_flag} {sync_every} must not pass --steps {steps}"
            )
    by_worker: dict[int, list[Fault]] = {}
    for e in events:
        by_worker.setdefault(e.worker, []).append(e)
    for w, evs in by_worker.items():
        evs.sort(key=lambda e: (e.step, e.kind != "kill"))
        alive = True
        for prev, e in zip([None, *evs], evs, strict=False):
            if prev is not None and prev.step == e.step:
                raise UsageError(f"{FLAG}: {prev} and {e}: two events of worker {w} at one step")
            if e.kind == "kill" and not alive:
                raise UsageError(f"{FLAG}: {e}: worker {w} is already dead (killed at step {prev.step})")
            if e.kind == "return" and alive:
                what = "was never killed" if prev is None else f"is alive again since step {prev.step}"
                raise UsageError(f"{FLAG}: {e}: worker {w} {what}; a return needs an earlier kill")
            alive = e.kind == "return"
    # at least two live workers at every step (a quorum needs two); a return counts from its step
    dead = 0
    for e in sorted(events, key=lambda e: (e.step, e.kind == "kill")):
        dead += 1 if e.kind == "kill" else -1
        if workers - dead < 2:
            raise UsageError(
                f"{FLAG}: {e} leaves {workers - dead} live worker(s) of {workers}; "
                "a quorum needs at least two"
            )
    return FaultSchedule(tuple(sorted(events, key=lambda e: (e.step, e.worker))))


def check_fault_spec(spec: Any) -> None:
    """What a TrainSpec may not use with --faults, as a UsageError naming the flags."""
    if spec.method == "dp":
        raise UsageError(
            f"{FLAG}: the data-parallel baseline (dp) needs a fixed process group for its all-reduce per "
            "step; choose --methods/--method among diloco, streaming, cocodc, loscar"
        )
    if spec.method == "loscar" and spec.density == 0:
        raise UsageError(
            f"{FLAG}: LOSCAR at --density 0 never communicates: there is no quorum to lose a worker from"
        )
    if spec.method == "loscar" and spec.worker_speeds and spec.speed_model == "steps":
        raise UsageError(
            f"{FLAG}: --speed-model steps (a slow LOSCAR worker idling on some ticks) is not supported "
            "with faults, whose replicas step on every tick; use --speed-model sleep"
        )
    if spec.final_eval_bytes:
        raise UsageError(
            f"{FLAG}: --final-eval-bytes is not supported with faults (each replica evaluates its own "
            "model on --eval-bytes at every evaluation); use --eval-bytes"
        )
    if spec.wire_dtype not in ("fp32", "bf16") and spec.wire_dtype in WIRE_DTYPE_NAMES:
        raise UsageError(
            f"{FLAG}: --wire-dtype {spec.wire_dtype}: a quantized wire format uses a process group of its "
            "own and cannot run under torchft; use fp32 or bf16"
        )


def add_fault_flags(p: argparse.ArgumentParser, *, baseline: bool) -> None:
    """``--faults`` (and ``--fault-free``) for train and compare."""
    g = p.add_argument_group("faults (torchft replicas)")
    g.add_argument(
        FLAG,
        metavar="SCHEDULE",
        help=f"run the workers as torchft replicas and inject faults: {SYNTAX}. Worker W is SIGKILLed "
        "after its step S; a returning worker restarts when worker 0 reaches S and heals from a peer "
        "at the next sync. Worker 0 is never killed; two workers stay alive; no emulated WAN, no dp",
    )
    if baseline:
        g.add_argument(
            "--fault-free",
            action="store_true",
            help="with --faults: also run each method without the faults (the same replicas, no kill) "
            "and compare the final losses; one more run of the same length per method",
        )


# ----- one replica process ------------------------------------------------------------------------


def _replica(
    conn: Any,
    index: int,
    incarnation: int,
    spec: Any,
    train: Any,
    val: Any,
    lighthouse: str,
    kill_step: int | None,
    holds: list[tuple[int, Any]],
    log_path: str | None,
) -> None:
    """A replica's process: the same model, data shard, optimizer and strategy as the fixed-group
    worker, under a torchft Manager. Messages to the parent go over ``conn``; torchft's log and any
    other output go to ``log_path``. ``holds``: (step, event) pairs: wait at the step until the event
    is set (step 0: before the first step, until every replica of the start is up)."""
    if log_path is not None:
        fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    try:
        _replica_loop(conn, index, incarnation, spec, train, val, lighthouse, kill_step, holds)
        code = 0
    except BaseException as e:
        try:
            conn.send(("error", index, f"{type(e).__name__}: {e}", traceback.format_exc()))
        except OSError:
            pass
        code = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # the manager's threads would keep a clean exit waiting on peers


def _replica_loop(
    conn: Any,
    index: int,
    incarnation: int,
    spec: Any,
    train: Any,
    val: Any,
    lighthouse: str,
    kill_step: int | None,
    holds: list[tuple[int, Any]],
) -> None:
    from torchft import Manager, ProcessGroupGloo  # optional (the ft extra); reads RUST_LOG when imported

    torch.set_num_threads(1)
    torch.manual_seed(spec.seed)  # the same initial model on every replica
    model = TinyLlama(spec.model).to(PARAM_DTYPES[spec.param_dtype])
    eval_model = TinyLlama(spec.model)
    optimizer = torch.optim.AdamW(  # foreach, as the fixed-group runs' (bitwise the same, faster)
        model.parameters(), lr=spec.lr, betas=(0.9, 0.95), weight_decay=spec.weight_decay, foreach=True
    )
    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S)),
        min_replica_size=2,
        load_state_dict=None,
        state_dict=None,
        replica_id=f"lowcomm_{index}",
        store_addr="localhost",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=lighthouse,
        use_async_quorum=False,
        timeout=timedelta(seconds=COLLECTIVE_TIMEOUT_S),
        quorum_timeout=timedelta(seconds=QUORUM_TIMEOUT_S),
        connect_timeout=timedelta(seconds=30),
    )
    strategy = build_strategy(spec, model, optimizer, None, manager=manager)
    tr = strategy.transport
    shard = worker_shard(train, index, spec.workers, getattr(spec, "split", "contiguous"))
    windows = eval_set(val, spec.model.seq_len, spec.eval_bytes)  # the fixed-group runs' windows
    eval_batches = windows.batches(range(windows.n_windows), eval_batch_windows(windows.seq_len))
    # a returning replica draws other batches than its first life did
    gen = torch.Generator().manual_seed(spec.seed * 1_000_003 + index + 7919 * incarnation)
    result = RunResult(spec.label, spec.method, spec.to_dict(), num_params=num_parameters(model))
    result.val_loss_basis = f"worker {index}'s own model"  # no fixed group to average over
    result.eval_bytes_scored = windows.scored_bytes
    seen = {"rounds": 0, "committed": 0, "failed": 0}

    @torch.no_grad()
    def evaluate(step: int) -> None:
        elapsed = loop.elapsed()
        torch.nn.utils.vector_to_parameters(_flat_float32(model), eval_model.parameters())
        loss = _windows_loss_sum(eval_model, eval_batches) / windows.scored_bytes
        m = CommTotals.read(strategy)
        result.points.append(
            EvalPoint(step, elapsed, m.bytes_sent, m.exposed_s, loss, val_loss_workers=[loss])
        )
        conn.send(("eval", index, step, loss, _state_hash(strategy)))

    held = [0.0]  # seconds waited at return steps for the new process (in the training wall-clock)

    def hold(step: int) -> None:
        for at, ev in holds:
            if step >= at and not ev.is_set():
                t0 = time.perf_counter()
                if not ev.wait(HOLD_TIMEOUT_S):
                    raise RuntimeError(f"waited {HOLD_TIMEOUT_S:.0f} s at step {step} for the other workers")
                if step > 0:
                    held[0] += time.perf_counter() - t0

    healed_sent = [incarnation == 0]

    def after_step(step: int, loss: torch.Tensor) -> None:
        """Tell the parent what the step did: the heal, the rounds committed or failed, the loss."""
        if not healed_sent[0] and tr.joined:
            healed_sent[0] = True
            conn.send(("healed", index, tr.healed_at))
        if tr.rounds > seen["rounds"]:
            committed = tr.participants[seen["committed"] :]
            failed = tr.failed_rounds - seen["failed"]
            seen.update(rounds=tr.rounds, committed=len(tr.participants), failed=tr.failed_rounds)
            quorum = int(manager.num_participants())
            conn.send(("rounds", index, step, committed, failed, quorum, time.time()))
        conn.send(("step", index, step, float(loss)))

    def after_tick(step: int, evaluated: bool) -> None:
        if kill_step is not None and step >= kill_step:
            conn.send(("kill-me", index, step))
            while True:  # the parent SIGKILLs this process now
                time.sleep(1.0)
        hold(step)

    loop = TrainLoop(
        model,
        optimizer,
        lambda: model.loss(*sample_batch(shard, spec.batch_size, spec.model.seq_len, gen)),
        spec.steps,
        evaluate,
        every(spec.eval_every, spec.steps),
        evaluate_first=incarnation == 0,  # a returning replica's step 0 was evaluated in its first life
        grad_clip=spec.grad_clip,
        lr_at=lr_schedule(spec),
        speed=spec.step_stretch(index),
        link_wait_s=lambda: float(strategy.metrics.exposed_comm_s),
        position=lambda tick: strategy.step_count,  # a healed replica jumps ahead to the peers' step
        after_step=after_step,
        after_tick=after_tick,
    )
    conn.send(("ready", index, incarnation))
    hold(0)
    with _profiler(spec) as prof, strategy:  # the profiler: `lowcomm profile --faults`
        loop.run()
    m = CommTotals.read(strategy)
    result.train_wall_s = loop.train_wall_s
    result.bytes_sent, result.exposed_s, result.syncs = m.bytes_sent, m.exposed_s, m.syncs
    result.extra = dict(m.extra, eval_s=loop.eval_s, waited_for_returns_s=held[0])
    if prof is not None:  # a returned worker's trace is trace_rank<W>_back<n>.json
        name = f"rank{index}" + (f"_back{incarnation}" if incarnation else "")
        trace = str(Path(spec.profile_dir) / f"trace_{name}.json")
        prof.export_chrome_trace(trace)
        slim_trace(trace)
        records = [dataclasses.asdict(r) for r in strategy.metrics.syncs]
        (Path(spec.profile_dir) / f"syncs_{name}.json").write_text(json.dumps(records))
    conn.send(("done", index, result.to_dict(), _state_hash(strategy)))
    manager.shutdown(wait=False)


def _state_hash(strategy: Any) -> int:
    """The hash of the global state g that every replica holds after a sync (the dense methods); for
    LOSCAR, which keeps no global copy, of this replica's own parameters."""
    g = getattr(strategy, "g", None)
    return tensor_hash(g if g is not None else strategy.frags.flat)


# ----- the parent: lighthouse, replicas, the schedule ---------------------------------------------


class FaultRunError(RuntimeError):
    def __init__(self, worker: int, summary: str, detail: str = "") -> None:
        super().__init__(f"worker {worker}: {summary}")
        self.worker, self.summary, self.detail = worker, summary, detail


def run_with_faults(
    spec: Any,
    corpus: Any,
    schedule: FaultSchedule,
    *,
    on_progress: Any = None,
    idle_timeout_s: float = 600.0,
    log_dir: Path | None = None,
) -> Any:
    """Run ``spec`` as ``spec.workers`` torchft replicas through ``schedule``; return worker 0's
    RunResult with ``extra["faults"]``: the events, every round worker 0 saw (step, committed,
    replicas contributing, quorum size), the per-replica curves (step, own loss, hash of g: see
    :func:`_state_hash`) and the final hashes.
    ``on_progress(step, val_loss | None)`` follows worker 0; each replica's output (torchft's log)
    goes to ``log_dir/worker<i>.log`` (appended; discarded without ``log_dir``). Raises
    :class:`FaultRunError` when a replica fails or nothing happens for ``idle_timeout_s``."""
    from torchft._torchft import LighthouseServer  # optional (the ft extra); reads RUST_LOG when imported

    ctx = mp.get_context("spawn")
    train, val = corpus.train.share_memory_(), corpus.val.share_memory_()
    lh = LighthouseServer(
        bind="[::]:0",
        min_replicas=2,
        join_timeout_ms=JOIN_TIMEOUT_MS,
        heartbeat_timeout_ms=HEARTBEAT_TIMEOUT_MS,
    )
    returns = schedule.returns()
    hold_events = [ctx.Event() for _ in returns]
    go = ctx.Event()  # set once every replica of the start is up: they join the first quorum together
    up: set[int] = set()
    procs: dict[int, Any] = {}  # worker -> its current process
    conns: dict[Any, tuple[int, Any]] = {}  # pipe -> (worker, process)
    sigkilled: set[int] = set()  # pids the schedule killed (their pipes end without a result)
    incarnations = dict.fromkeys(range(spec.workers), 0)
    t0 = time.time()

    def start(i: int, kill_step: int | None, own: int | None) -> None:
        r, w = ctx.Pipe(duplex=False)
        holds = [(0, go)]
        holds += [
            (f.step, ev) for k, (f, ev) in enumerate(zip(returns, hold_events, strict=True)) if k != own
        ]
        log = None if log_dir is None else str(log_dir / f"worker{i}.log")
        args = (w, i, incarnations[i], spec, train, val, lh.address(), kill_step, holds, log)
        p = ctx.Process(target=_replica, args=args, daemon=True)
        p.start()
        w.close()
        procs[i], conns[r] = p, (i, p)

    def next_kill(i: int, after: int) -> int | None:
        return next((f.step for f in schedule.kills() if f.worker == i and f.step > after), None)

    events: list[dict] = []
    rounds: list[dict] = []
    curves: dict[str, list] = {str(i): [] for i in range(spec.workers)}
    final_hash: dict[str, int] = {}
    result: RunResult | None = None
    killed: dict[int, float] = {}  # worker -> time of its kill (dead now)
    returned: set[int] = set()  # indices into `returns` already started
    step0 = 0
    try:
        for i in range(spec.workers):
            start(i, next_kill(i, 0), None)
        last_msg = time.time()
        while conns:
            ready = wait(list(conns), timeout=1.0)
            if not ready and time.time() - last_msg > idle_timeout_s:
                raise FaultRunError(REPORTER, f"no worker made progress for {idle_timeout_s:.0f} s (hung)")
            for c in ready:
                i, p = conns[c]
                try:
                    msg = c.recv()
                except (EOFError, OSError):
                    del conns[c]
                    p.join(timeout=30)
                    if p.pid not in sigkilled and p.exitcode != 0:
                        raise FaultRunError(i, f"exited with code {p.exitcode} without a result") from None
                    continue
                last_msg = time.time()
                kind = msg[0]
                if kind == "error":
                    raise FaultRunError(i, msg[2], msg[3])
                if kind == "step" and i == REPORTER:
                    step0 = msg[2]
                    if on_progress is not None:
                        on_progress(step0, None)
                elif kind == "eval":
                    curves[str(i)].append([msg[2], msg[3], msg[4]])
                    if i == REPORTER and on_progress is not None:
                        on_progress(msg[2], msg[3])
                elif kind == "rounds" and i == REPORTER:
                    _, _, step, committed, failed, quorum, t = msg
                    for n in committed:
                        rounds.append(dict(step=step, committed=True, replicas=n, quorum=quorum, t_s=t - t0))
                    for _ in range(failed):
                        rounds.append(dict(step=step, committed=False, replicas=0, quorum=quorum, t_s=t - t0))
                elif kind == "kill-me":
                    p.kill()  # SIGKILL
                    p.join(timeout=30)
                    sigkilled.add(p.pid)
                    killed[i] = time.time()
                    events.append(
                        dict(kind="kill", worker=i, step=msg[2], reporter_step=step0, t_s=killed[i] - t0)
                    )
                elif kind == "healed":
                    ev = next(e for e in reversed(events) if e["kind"] == "return" and e["worker"] == i)
                    ev["healed_at"] = msg[2]  # None: joined without a heal
                elif kind == "ready":
                    up.add(i)
                    if len(up) == spec.workers:
                        go.set()
                    own = next(
                        (k for k in returned if returns[k].worker == i and not hold_events[k].is_set()), None
                    )
                    if own is not None:
                        hold_events[own].set()
                elif kind == "done":
                    final_hash[str(i)] = msg[3]
                    if i == REPORTER:
                        result = RunResult.from_dict(msg[2])
            for k, f in enumerate(returns):  # start a returning worker once its kill happened
                if k in returned or f.worker not in killed or step0 < f.step:
                    continue
                returned.add(k)
                del killed[f.worker]
                incarnations[f.worker] += 1
                events.append(
                    dict(
                        kind="return", worker=f.worker, step=f.step, reporter_step=step0, t_s=time.time() - t0
                    )
                )
                start(f.worker, next_kill(f.worker, f.step), k)
    finally:
        for proc in procs.values():
            if proc.is_alive():
                proc.kill()
            proc.join(timeout=30)
        lh.shutdown()
    if result is None:
        raise FaultRunError(REPORTER, "finished without a result")
    own = {int(w): {c[0]: c[1] for c in curve} for w, curve in curves.items()}
    for p in result.points:  # the live workers' own losses at each of worker 0's evaluations
        p.val_loss_workers = [own[w][p.step] for w in sorted(own) if p.step in own[w]]
    committed = [r for r in rounds if r["committed"]]
    kill_to_commit = []
    for e in events:
        if e["kind"] == "kill":
            after = [r for r in committed if r["t_s"] > e["t_s"]]
            e["to_next_commit_s"] = after[0]["t_s"] - e["t_s"] if after else None
            kill_to_commit.append(e["to_next_commit_s"])
    result.extra["faults"] = dict(
        schedule=str(schedule),
        reported_by=REPORTER,
        events=events,
        syncs=rounds,
        syncs_committed=len(committed),
        syncs_failed=len(rounds) - len(committed),
        kill_to_next_commit_s=kill_to_commit,
        replica_curves=curves,
        final_g_hash=final_hash,
    )
    return result


# ----- the command --------------------------------------------------------------------------------


def _round_gap(spec: Any) -> tuple[int, str]:
    """The steps between two rounds of ``spec``'s method and the flag(s) that set them."""
    if spec.method == "loscar":
        return spec.resolved_local_steps() + spec.resolved_overlap_steps(), "--local-steps + --overlap-steps"
    return spec.sync_every, "--sync-every"


def fault_methods(args: argparse.Namespace, command: str) -> list[str]:
    if command == "train":
        return [args.method]
    if args.methods == ",".join(METHODS):  # compare's default: every method that runs under torchft
        return [m for m in METHODS if m != "dp"]
    return parse_methods(args.methods)


def run_faults_command(args: argparse.Namespace, command: str) -> int:
    """``lowcomm train|compare --faults``: validate, run each method (and its fault-free twin with
    --fault-free), write results.json, table.md, the curves and the fault plot, print the tables."""
    if getattr(args, "tensorboard", None) is not None:
        raise UsageError(f"--tensorboard is not supported with {FLAG}")
    # torchft's own log (the Lighthouse's quorum lines) at warnings unless the user set RUST_LOG; it is
    # read when torchft is first imported. Each replica's full output goes to out/logs-<method>/.
    os.environ.setdefault("RUST_LOG", "warn")
    require("torchft", "ft", FLAG)
    quick = command == "compare" and args.quick
    specs = build_specs(args, fault_methods(args, command), presets.LM["quick" if quick else "default"])
    for spec in specs:
        check_fault_spec(spec)
    s0 = specs[0]
    # a returning worker heals at the next round: the longest gap between rounds of any method
    gap, flag = max(_round_gap(s) for s in specs)
    schedule = parse_faults(args.faults, workers=s0.workers, steps=s0.steps, sync_every=gap, sync_flag=flag)
    corpus = load_checked_corpus(args.data, specs)
    out = out_dir(args, f"{command}-faults")
    baseline = bool(getattr(args, "fault_free", False))
    runs: list[tuple[Any, FaultSchedule]] = []
    for spec in specs:
        runs.append((spec, schedule))
        if baseline:
            runs.append((spec, NO_FAULTS))
    labels = [s.label + ("" if sch.events else " (fault-free)") for s, sch in runs]
    bars = _Progress([s for s, _ in runs], not args.no_progress)
    t_all = time.perf_counter()
    results = []
    try:
        for k, (spec, sch) in enumerate(runs):
            try:
                logs = out / f"logs-{spec.method}{'' if sch.events else '-fault-free'}"
                logs.mkdir(exist_ok=True)
                res = run_with_faults(
                    spec, corpus, sch, on_progress=lambda s, v, k=k: bars.update(k, s, v), log_dir=logs
                )
            except FaultRunError as exc:
                bars.close()
                if exc.detail:
                    (out / "error.txt").write_text(exc.detail)
                where = f" (traceback in {out / 'error.txt'})" if exc.detail else ""
                print(f"error: {FLAG} run of {labels[k]} failed: {exc}{where}", file=sys.stderr)
                return 1
            res.name = labels[k]
            results.append(res)
    finally:
        bars.close()
    elapsed = time.perf_counter() - t_all
    for res in results:  # the faulty run's final loss against its fault-free twin
        if "faults" in res.extra and res.extra["faults"]["events"]:
            twin = next((r for r in results if r.name == res.name + " (fault-free)"), None)
            res.extra["faults"]["fault_free_final_loss"] = twin.final_loss if twin else None
    tgt = args.target if args.target is not None else auto_target(results)
    title = f"lowcomm {command} --faults {schedule}: {s0.workers} workers, {s0.steps} steps"
    table, ftable = format_table(results, tgt), format_fault_table(results)
    write_json(
        out / "results.json",
        {
            "title": title,
            "corpus": corpus.describe(),
            "faults": str(schedule),
            "target_val_loss": tgt,
            "rows": comparison_rows(results, tgt),
            "runs": [r.to_dict() for r in results],
            "elapsed_s": elapsed,
            "provenance": provenance.collect(),
        },
    )
    (out / "table.md").write_text(f"# {title}\n\n{corpus.describe()}\n\n{table}\n\n{ftable}\n")
    plots = plot_curves(results, out, tgt)
    plots.append(plot_faults(results, out / "val_loss_faults.png", title))
    print(f"\n{title} — {corpus.describe()}\n")
    print(table)
    print()
    print(ftable)
    print(
        f"\nwall-clock of the whole command: {elapsed:.0f} s; "
        f"wrote {out / 'results.json'}, {out / 'table.md'}, " + ", ".join(p.name for p in plots)
    )
    return 0


def run_faults_profile(args: argparse.Namespace) -> int:
    """``lowcomm profile --faults``: the profile preset's run as torchft replicas through the schedule,
    one Chrome trace per replica process (a returned worker's is ``trace_rank<W>_back<n>.json``; a
    killed process leaves none) and ``timeline.png`` with the quorum and heal ranges."""
    os.environ.setdefault("RUST_LOG", "warn")
    require("torchft", "ft", FLAG)
    specs = build_specs(args, [args.method], presets.LM["profile"])
    check_fault_spec(specs[0])
    gap, flag = _round_gap(specs[0])
    schedule = parse_faults(
        args.faults, workers=specs[0].workers, steps=specs[0].steps, sync_every=gap, sync_flag=flag
    )
    corpus = load_checked_corpus(args.data, specs)
    out = out_dir(args, f"profile-{args.method}-faults")
    spec = specs[0].with_(profile_dir=str(out.resolve()))
    (out / "logs").mkdir(exist_ok=True)
    bars = _Progress([spec], not args.no_progress)
    t0 = time.perf_counter()
    try:
        run_with_faults(
            spec, corpus, schedule, on_progress=lambda s, v: bars.update(0, s, v), log_dir=out / "logs"
        )
    except FaultRunError as exc:
        bars.close()
        print(f"error: {FLAG} profile run failed: {exc} (replica logs in {out / 'logs'})", file=sys.stderr)
        return 1
    finally:
        bars.close()
    traces = sorted(out.glob("trace_rank*.json"))
    names = [t.stem.removeprefix("trace_") for t in traces]
    per = [load_intervals(t, t.with_name(f"syncs_{n}.json")) for t, n in zip(traces, names, strict=True)]
    title = f"{spec.label} --faults {schedule}: {spec.workers} torchft replicas, H={spec.sync_every}"
    draw(per, out / "timeline.png", title, labels=names)
    for n, spans in zip(names, per, strict=True):
        print(f"{n}: " + ", ".join(f"{k} {len(v)}" for k, v in spans.items()))
    print(f"wrote {out / 'timeline.png'} and Chrome traces {', '.join(t.name for t in traces)} "
          f"({time.perf_counter() - t0:.0f} s)")  # fmt: skip
    return 0


def event_marks(faults: dict) -> list[tuple[int, str, str]]:
    """(step, label, kind) of each event of a run's ``extra["faults"]``, as the fault plot draws them:
    a kill at its step, a return at the step it was healed at."""
    marks = []
    for e in faults.get("events", []):
        w = e["worker"]
        if e["kind"] == "kill":
            marks.append((e["step"], f"worker {w} killed", "kill"))
        elif e.get("healed_at") is not None:
            marks.append((e["healed_at"], f"worker {w} back, healed at step {e['healed_at']}", "return"))
        else:
            marks.append((e["step"], f"worker {w} back at step {e['step']}, not healed", "return"))
    return marks


def plot_faults(results: list[Any], path: Path, title: str) -> Path:
    """Validation loss vs step of every run (worker 0's parameters; fault-free twins dashed; the
    other replicas' own curves thin), with a vertical line per kill and per return."""
    import matplotlib  # optional (the cli extra): only when a plot is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4.8))
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    marked: set[tuple] = set()
    later: list[float] = []
    for r in results:
        f = r.extra.get("faults") or {}
        faulty = bool(f.get("events"))
        base = r.name.removesuffix(" (fault-free)")
        color = colors[[x.name.removesuffix(" (fault-free)") for x in results].index(base) % len(colors)]
        pts = r.points
        ax.plot(
            [p.step for p in pts],
            [p.val_loss for p in pts],
            color=color,
            ls="-" if faulty else "--",
            marker="." if faulty else None,
            label=f"{r.name}, worker {f.get('reported_by', REPORTER)}" if faulty else r.name,
        )
        later += [p.val_loss for p in pts[1:] if math.isfinite(p.val_loss)]
        if not faulty:
            continue
        for w, curve in f["replica_curves"].items():
            if int(w) == f["reported_by"] or not curve:
                continue
            kills = [e["step"] for e in f["events"] if e["kind"] == "kill" and e["worker"] == int(w)]
            xs: list[float] = []
            ys: list[float] = []
            for c in curve:  # no line across the time the worker was dead
                if xs and any(xs[-1] <= k < c[0] for k in kills):
                    xs.append(math.nan)
                    ys.append(math.nan)
                xs.append(c[0])
                ys.append(c[1])
            ax.plot(xs, ys, color=color, lw=0.8, alpha=0.6, ls=":", label=f"{r.name}, worker {w}")
        for x, text, kind in event_marks(f):
            if (x, text) in marked:
                continue
            marked.add((x, text))
            c = "red" if kind == "kill" else "green"
            ax.axvline(x, color=c, ls="-.", lw=1)
            ax.text(
                x, 0.98, text, rotation=90, va="top", ha="right", fontsize=8, color=c,
                transform=ax.get_xaxis_transform(), bbox=dict(facecolor="white", alpha=0.8, lw=0, pad=1),
            )  # fmt: skip
    if later:
        lo, hi = min(later), max(later)
        ax.set_ylim(lo - 0.05 * (hi - lo + 1e-9), hi + 0.05 * (hi - lo + 1e-9))
    ax.set_xlabel("inner steps")
    ax.set_ylabel("validation loss (nats/byte)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
