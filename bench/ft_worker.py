"""One fault-tolerant replica for bench/ft_recovery.py and tests/runtime/test_ft.py (run as a script,
one process each).

Trains a small regression model with DiLoCo, Streaming DiLoCo, CoCoDC or LOSCAR under a torchft
Manager and appends one JSON line per step to ``--out``: step, loss, a hash of g (LOSCAR, which has no
g: a hash of the coordinates x[S] it just merged, at the steps where a round's merge was applied), a
hash of the parameters, and the rounds that did not commit.
"""

import argparse
import faulthandler
import json
import os
import signal
import sys
import time
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed import TCPStore
from torch.nn.parallel import DistributedDataParallel as DDP
from torchft import Manager, ProcessGroupGloo

from lowcomm_kernels.runtime import LOSCAR, CoCoDC, DiLoCo, StreamingDiLoCo
from lowcomm_kernels.runtime.base import tensor_hash


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lighthouse", required=True)
    ap.add_argument("--replica", type=int, required=True)
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--method", default="diloco")
    ap.add_argument("--out", required=True)
    ap.add_argument("--step-sleep", type=float, default=0.0)
    ap.add_argument("--fail-commit-at", type=int, default=-1, help="report an error in this round")
    ap.add_argument("--ready-file", default="", help="touched just before the training loop")
    ap.add_argument("--hold-at", type=int, default=-1, help="after this step, wait for --hold-for")
    ap.add_argument("--hold-for", default="")
    ap.add_argument(
        "--die-at",
        type=int,
        default=-1,
        help="SIGKILL this process right after recording this step: a crash at a known step (a kill "
        "sent from outside lands wherever the replica has got to by then, which on a loaded machine "
        "can be dozens of steps later)",
    )
    ap.add_argument(
        "--start-gate",
        default="",
        help="with the Manager up (heartbeating), touch GATE.<replica>_<group rank> and wait for GATE "
        "before the first step: replicas started together all join the first quorum",
    )
    ap.add_argument("--group-size", type=int, default=1, help="ranks in this replica (inner DDP)")
    ap.add_argument("--group-rank", type=int, default=0)
    ap.add_argument("--group-port", type=int, default=0, help="the replica's store (group rank 0 hosts it)")
    ap.add_argument(
        "--group-port-file",
        default="",
        help="instead of --group-port: group rank 0 hosts the store on a port the OS picks and writes it "
        "to this file, the other ranks read it (no race for a port chosen in advance)",
    )
    ap.add_argument(
        "--skew",
        action="store_true",
        help="group rank > 0 computes its own CoCoDC decisions differently and receives a different "
        "heal state (as from another healthy replica): only the replica's agreement keeps it identical",
    )
    a = ap.parse_args()
    # SIGUSR1 prints every thread's stack to the log: the tests ask a replica that hangs where it is
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    torch.manual_seed(0)  # the same initial model; each replica has its own data
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    host = a.group_rank == 0
    port = a.group_port
    if a.group_port_file and not host:  # wait for group rank 0 to publish its store's port
        t_end = time.time() + 120
        while not os.path.exists(a.group_port_file) and time.time() < t_end:
            time.sleep(0.05)
        port = int(open(a.group_port_file).read())
    store = TCPStore(
        "localhost", port, is_master=host, wait_for_workers=False, timeout=timedelta(seconds=120)
    )
    if a.group_port_file and host:
        with open(a.group_port_file + ".tmp", "w") as f:
            f.write(str(store.port))
        os.replace(a.group_port_file + ".tmp", a.group_port_file)
    fwd = model
    if a.group_size > 1:  # the replica is a data-parallel group: DDP over its ranks, on its own store
        dist.init_process_group(
            "gloo", store=dist.PrefixStore("inner_dp", store), rank=a.group_rank, world_size=a.group_size
        )
        fwd = DDP(model)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=5)),
        min_replica_size=2,
        load_state_dict=None,
        state_dict=None,
        replica_id=f"replica_{a.replica}",
        store_addr="localhost",
        store_port=store.port,
        rank=a.group_rank,
        world_size=a.group_size,
        lighthouse_addr=a.lighthouse,
        use_async_quorum=False,
        timeout=timedelta(seconds=5),
        quorum_timeout=timedelta(seconds=180),
        connect_timeout=timedelta(seconds=10),
    )
    common = dict(outer_lr=0.7, outer_momentum=0.9, manager=manager, num_replicas=a.replicas)
    if a.method == "diloco":
        strat = DiLoCo(model, opt, sync_every=5, **common)
    elif a.method == "cocodc":
        strat = CoCoDC(model, opt, sync_every=6, num_fragments=2, fragment_sync_delay=1, **common)
    elif a.method == "loscar":  # overwrite: right after a merge x[S] is the average, equal everywhere
        common = dict(manager=manager, num_replicas=a.replicas)
        strat = LOSCAR(model, opt, density=0.25, local_steps=4, overlap_steps=2, merge="overwrite", **common)
    else:
        strat = StreamingDiLoCo(model, opt, sync_every=6, num_fragments=2, fragment_sync_delay=1, **common)
    if a.fail_commit_at >= 0:  # a replica that reports an error in one round: nobody may apply it
        start_quorum = manager.start_quorum

        def failing_quorum(*args, **kw):
            start_quorum(*args, **kw)  # (a new quorum clears the manager's error: report it after)
            if strat.transport.rounds == a.fail_commit_at:
                manager.report_error(RuntimeError("injected commit failure"))

        manager.start_quorum = failing_quorum
    if a.skew and a.group_rank > 0:
        _skew(strat, manager)
    gen = torch.Generator().manual_seed(100 + 10 * a.replica + a.group_rank)
    w_true = torch.linspace(-1, 1, 8)
    if a.ready_file:
        open(a.ready_file, "w").close()
    if a.start_gate:
        open(f"{a.start_gate}.{a.replica}_{a.group_rank}", "w").close()
        while not os.path.exists(a.start_gate):
            time.sleep(0.05)
    with open(a.out, "a") as f, strat:
        while strat.step_count < a.steps:  # the step, not the iteration: a healed replica jumps ahead
            x = torch.randn(32, 8, generator=gen)
            y = torch.tanh(x @ w_true).unsqueeze(1)
            loss = nn.functional.mse_loss(fwd(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            tr = strat.transport
            if isinstance(strat, LOSCAR):  # the merged x[S] when a round was merged at this step
                last = strat.metrics.syncs[-1] if strat.metrics.syncs else None
                merged = last is not None and last.apply_step == strat.step_count and not last.skipped
                g = tensor_hash(strat.frags.flat[strat.last_idx]) if merged else None
            else:
                g = tensor_hash(strat.g)
            rec = {
                "step": strat.step_count, "loss": loss.item(), "g": g, "x": tensor_hash(strat.frags.flat),
                "round": getattr(strat, "round", None), "healed_at": tr.healed_at,
                "failed": tr.failed_rounds, "rounds": tr.rounds, "pid": os.getpid(),
                "participants": tr.participants[-1] if tr.participants else 0,
                "skipped": strat.metrics.num_skipped,
                "applied": getattr(strat, "applied_count", strat.metrics.num_syncs),
                "round_s": tr.round_s[-1] if tr.round_s else 0.0, "t": time.time(),
                "N": getattr(strat, "N", None), "n_history": getattr(strat, "n_history", None),
                "last_send": getattr(strat, "last_send", None),
            }  # fmt: skip
            f.write(json.dumps(rec) + "\n")
            f.flush()
            if 0 <= a.die_at <= strat.step_count:
                # the replica's ranks die together, each with its step done: group rank 0 hosts the
                # ManagerServer whose answers the other ranks may still be reading
                if dist.is_initialized():
                    dist.barrier()
                os.kill(os.getpid(), signal.SIGKILL)
            if strat.step_count == a.hold_at:
                while not os.path.exists(a.hold_for):
                    time.sleep(0.05)
            if a.step_sleep:
                time.sleep(a.step_sleep)
    # every replica stops at the same step: apply what is still in flight (a collective), so no
    # rank exits with a sync its peers are still completing
    strat.finish()
    # group rank 0 hosts the replica's ManagerServer: shutting it down while another rank still waits
    # for the answer to its last should_commit gave that rank a gRPC "transport error" (seen in CI)
    if dist.is_initialized():
        dist.barrier()
    manager.shutdown(wait=False)
    if dist.is_initialized():
        dist.destroy_process_group()
    # End without the interpreter's teardown. Freeing the DDP reducer frees its gloo process group,
    # whose destructor (torch 2.13) joins the group's worker threads while holding the GIL; a worker
    # thread still freeing a finished all-reduce needs the GIL to drop a Python reference it holds:
    # the process hangs at exit (seen about 1 run in 10 on a loaded machine). Everything this
    # replica writes is flushed and closed above.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _skew(strat, manager) -> None:
    """What a multi-rank replica's ranks could see differently without the replica's agreement:
    CoCoDC's N and choice from per-process timings and scores (here: N = its maximum, the last free
    fragment), and a heal state from another healthy replica than group rank 0's (here: the
    parameters, or g, shifted by 1)."""
    if isinstance(strat, CoCoDC):
        strat._period_n = lambda: strat.n_max
        choose = strat.choose

        def last_free(t):
            choice = choose(t)
            if choice is None:
                return None
            busy = {pd.fragment for pd in strat.pending}
            return max(p for p in range(strat.K) if p not in busy), "score"

        strat.choose = last_free
    load = manager._load_state_dict_fns["lowcomm"]

    def other_source(sd):
        state = dict(sd["strategy"])
        key = "x" if "x" in state else "g"
        state[key] = state[key] + 1.0
        return load(dict(sd, strategy=state))

    manager._load_state_dict_fns["lowcomm"] = other_source


if __name__ == "__main__":
    try:
        main()
    except BaseException:  # when it failed, to line its log up with the other replicas'
        print(f"[{time.strftime('%H:%M:%S')}] replica worker failed:", file=sys.stderr, flush=True)
        raise
