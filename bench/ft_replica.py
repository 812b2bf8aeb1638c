"""One fault-tolerant DiLoCo replica (one process), for bench/ft_recovery.py and the network-namespace
test: the same model, data, H and outer optimizer under either implementation.

    --impl lowcomm   lowcomm_kernels.runtime.DiLoCo(..., manager=, num_replicas=)
    --impl torchft   torchft.local_sgd.DiLoCo (one fragment: the whole model), driven as torchft's own
                     tests drive it: the Manager heals the model and inner optimizer, DiLoCo registers
                     its global copy and outer optimizer

Both: inner SGD (lr 0.05), outer Nesterov SGD (lr 0.7, momentum 0.9), sync every H inner steps, a
synchronous quorum, a 2-layer MLP regressing a fixed teacher; every replica starts from the same
model (seed) and draws its own batches. One JSON line per inner step goes to ``--out``: the step,
the training loss, the manager's committed step, the syncs attempted, the replicas in the last
quorum, a hash of the global copy, and the wall clock; the last line also holds the loss of the
model on a held-out set.

``--host`` is the address the other replicas reach this one at (its manager and its store): keep
``localhost`` on one machine, give the namespace's address when each replica has its own network.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from datetime import timedelta

import torch
from torch import nn
from torch.distributed import TCPStore

INNER_LR, OUTER_LR, OUTER_MOMENTUM = 0.05, 0.7, 0.9
DIM, HIDDEN, BATCH = 8, 32, 32


def make_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(DIM, HIDDEN), nn.Tanh(), nn.Linear(HIDDEN, 1))


def teacher(x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x @ torch.linspace(-1, 1, DIM)).unsqueeze(1)


def held_out(seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(1024, DIM, generator=torch.Generator().manual_seed(10_000 + seed))
    return x, teacher(x)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--impl", choices=("lowcomm", "torchft"), default="lowcomm")
    ap.add_argument("--lighthouse", required=True, help="the Lighthouse's address (http://host:port)")
    ap.add_argument("--replica", type=int, required=True, help="this replica's slot, 0 .. replicas-1")
    ap.add_argument("--replicas", type=int, default=3)
    ap.add_argument("--host", default="localhost", help="address the other replicas reach this one at")
    ap.add_argument("--steps", type=int, default=100, help="inner steps to run")
    ap.add_argument("--sync-every", type=int, default=5, help="H: inner steps between syncs")
    ap.add_argument("--seed", type=int, default=0, help="model and data seed")
    ap.add_argument("--out", required=True, help="JSON lines, appended")
    ap.add_argument("--step-sleep", type=float, default=0.0, help="seconds of sleep per inner step")
    ap.add_argument("--timeout", type=float, default=5.0, help="manager timeout (collectives, commit), s")
    ap.add_argument("--quorum-timeout", type=float, default=120.0, help="s")
    ap.add_argument("--ready-file", default="", help="touched once the replica is built, before training")
    ap.add_argument("--go-file", default="", help="wait for this file before training (a common start)")
    ap.add_argument("--hold-at", type=int, default=-1, help="after this step, wait for --hold-for to exist")
    ap.add_argument("--hold-for", default="")
    a = ap.parse_args(argv)
    for name in ("replicas", "steps", "sync_every"):
        if getattr(a, name) < 1:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    if a.hold_at >= 0 and not a.hold_for:
        raise SystemExit("--hold-at needs --hold-for (the file to wait for)")
    if not 0 <= a.replica < a.replicas:
        raise SystemExit(f"--replica must lie in 0 .. {a.replicas - 1}, got {a.replica}")
    for name in ("step_sleep", "timeout", "quorum_timeout"):
        if getattr(a, name) < 0:
            raise SystemExit(f"--{name.replace('_', '-')} must be >= 0, got {getattr(a, name)}")
    return a


def main(argv: list[str] | None = None) -> None:
    a = parse(argv)
    from torchft import Manager, ProcessGroupGloo

    model = make_model(a.seed)
    opt = torch.optim.SGD(model.parameters(), lr=INNER_LR)
    store = TCPStore(a.host, 0, is_master=True, wait_for_workers=False)

    def user_state() -> dict:
        return {"model": model.state_dict(), "optim": opt.state_dict()}

    def load_user_state(sd: dict) -> None:
        model.load_state_dict(sd["model"])
        opt.load_state_dict(sd["optim"])

    ours = a.impl == "lowcomm"
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=a.timeout)),
        min_replica_size=2,
        load_state_dict=None if ours else load_user_state,  # ours registers its own state
        state_dict=None if ours else user_state,
        replica_id=f"replica_{a.replica}",
        store_addr=a.host,
        store_port=store.port,
        hostname=a.host,
        rank=0,
        world_size=1,
        lighthouse_addr=a.lighthouse,
        use_async_quorum=False,
        timeout=timedelta(seconds=a.timeout),
        quorum_timeout=timedelta(seconds=a.quorum_timeout),
        connect_timeout=timedelta(seconds=10),
    )
    if ours:
        from lowcomm_kernels.runtime import DiLoCo
        from lowcomm_kernels.runtime.base import tensor_hash

        strat = DiLoCo(
            model, opt, sync_every=a.sync_every, outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM,
            manager=manager, num_replicas=a.replicas,
        )  # fmt: skip

        def step_index() -> int:
            return strat.step_count  # a healed replica jumps to the peers' step

        def global_hash() -> int:
            return tensor_hash(strat.g)

        def synced() -> int:
            return strat.transport.rounds
    else:
        from torchft.local_sgd import DiLoCo as TorchftDiLoCo

        from lowcomm_kernels.runtime.base import tensor_hash

        outer = torch.optim.SGD(model.parameters(), lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
        strat = TorchftDiLoCo(manager, [model], opt, outer, sync_every=a.sync_every)
        frag = strat._fragments[0]
        iterations = [0]

        def step_index() -> int:
            return iterations[0]

        def global_hash() -> int:
            return tensor_hash(torch.cat([t.reshape(-1) for t in frag.original_parameters.values()]))

        def synced() -> int:  # the fragment's local counter is reset by every sync, committed or not
            return iterations[0] // a.sync_every

    gen = torch.Generator().manual_seed(1000 * a.seed + 100 + a.replica)
    x_eval, y_eval = held_out(a.seed)
    participants, last_synced = 0, synced()
    if a.ready_file:
        open(a.ready_file, "w").close()
    while a.go_file and not os.path.exists(a.go_file):
        time.sleep(0.02)
    with open(a.out, "a") as f, strat:
        while step_index() < a.steps:
            x = torch.randn(BATCH, DIM, generator=gen)
            loss = nn.functional.mse_loss(model(x), teacher(x))
            opt.zero_grad()
            loss.backward()
            opt.step()
            if not ours:
                iterations[0] += 1
            if synced() != last_synced:  # a quorum ran in this step
                last_synced = synced()
                participants = manager.num_participants()
            rec = {
                "step": step_index(), "loss": loss.item(), "commits": manager.current_step(),
                "syncs": synced(), "participants": participants, "g": global_hash(), "pid": os.getpid(),
                "t": time.time(),
            }  # fmt: skip
            if step_index() >= a.steps:
                with torch.no_grad():
                    rec["eval_loss"] = nn.functional.mse_loss(model(x_eval), y_eval).item()
            f.write(json.dumps(rec) + "\n")
            f.flush()
            if step_index() == a.hold_at:  # e.g. until a restarted replica is up again
                while not os.path.exists(a.hold_for):
                    time.sleep(0.02)
            if a.step_sleep:
                time.sleep(a.step_sleep)
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
