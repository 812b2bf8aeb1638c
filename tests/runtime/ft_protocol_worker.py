"""One torchft replica for tests/runtime/test_ft_protocol.py (run as a script, one process each).

Trains a small regression model with ``Averaging``, a toy strategy that knows nothing of torchft:
it implements the base class's subclass interface and the public heal hooks (``heal_state``,
``load_heal_state``, ``replay``, ``restart_from_shared``), and runs under ``manager=`` all the same.
Appends one JSON line per step to ``--out``.
"""

import argparse
import json
import os
import time
from datetime import timedelta
from typing import Any

import torch
from torch import nn
from torch.distributed import TCPStore
from torchft import Manager, ProcessGroupGloo

from lowcomm_kernels.runtime import Strategy
from lowcomm_kernels.runtime.base import tensor_hash
from lowcomm_kernels.runtime.checkpoint import CheckpointError, expect_int, expect_tensor


class Averaging(Strategy):
    """Every ``sync_every`` steps, blocking: every replica's parameters ← the average over the
    replicas present. ``avg``, the last average, is the state the replicas share."""

    method = "toy_averaging"

    def __init__(self, model, inner_optimizer, *, sync_every: int, **common: Any) -> None:
        super().__init__(model, inner_optimizer, num_fragments=1, **common)
        self.H = sync_every
        self._join_group()
        self.avg = self.frags.flat.detach().clone()
        self.merged = 0
        self.served = 0  # heal states this replica sent to another
        self.loaded = 0  # heal states this replica took

    def _sync(self, t: int) -> None:
        x = self.frags.flat
        payload = x.detach().clone()
        nonfinite = (~torch.isfinite(payload)).sum().to(torch.float64)
        control = self._control(nonfinite, t, [])
        handle = self.transport.all_reduce([payload, control], name=f"average at step {t}", host=control)
        handle.wait()
        if self._sync_outcome(handle.host_values(), f"average at step {t}"):
            return  # skipped on every replica: each keeps its own parameters
        self.avg.copy_(payload / self.world)  # the transport scaled the sum to world / present
        x.copy_(self.avg)
        self.merged += 1

    # the base class's subclass interface
    def _advance(self, t: int) -> None:
        if t % self.H == 0:
            self._sync(t)

    def _drain(self) -> None:
        pass  # blocking: nothing in flight

    def _finish(self) -> None:
        pass

    def _config_fields(self) -> dict[str, Any]:
        return {"sync_every": self.H}

    def _state(self) -> dict[str, Any]:
        return {"avg": self.avg.clone(), "merged": self.merged}

    def _validate_state(self, sd: dict[str, Any]) -> None:
        expect_tensor("avg", sd.get("avg"), (self.frags.numel,), self.frags.dtype)
        expect_int("merged", sd.get("merged"), 0)

    def _load_state(self, sd: dict[str, Any]) -> None:
        self.avg.copy_(sd["avg"])
        self.merged = int(sd["merged"])

    def _guard_values(self) -> list[tuple[str, int]]:
        return [("the last average", tensor_hash(self.avg))]

    # the public heal hooks
    def heal_state(self) -> dict[str, Any]:
        self.served += 1
        return {"step": self.step_count, "avg": self.avg.clone(), "merged": self.merged}

    def load_heal_state(self, sd: dict[str, Any]) -> str:
        if not isinstance(sd, dict):
            raise CheckpointError("heal state should be a dict")
        self._validate_state(sd)
        self._load_state(sd)
        with torch.no_grad():
            self.frags.flat.copy_(self.avg)
        self.step_count = expect_int("step", sd.get("step"), 0)
        self.loaded += 1
        return "the peers' last average"

    def replay(self, t: int) -> None:
        # peers serve a heal from inside a quorum: at their first step or at a sync
        if t % self.H == 0:
            with torch.no_grad():
                self._sync(t)

    def restart_from_shared(self) -> None:
        with torch.no_grad():
            self.frags.flat.copy_(self.avg)
        self.clear_inner_state()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--lighthouse", required=True)
    ap.add_argument("--replica", type=int, required=True)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--out", required=True)
    ap.add_argument("--freeze-at", type=int, default=-1, help="after this step, wait until killed")
    a = ap.parse_args()
    torch.manual_seed(0)  # the same initial model; each replica has its own data
    model = nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 1))
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    store = TCPStore("localhost", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=120))
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=5)),
        min_replica_size=2,
        load_state_dict=None,
        state_dict=None,
        replica_id=f"replica_{a.replica}",
        store_addr="localhost",
        store_port=store.port,
        rank=0,
        world_size=1,
        lighthouse_addr=a.lighthouse,
        use_async_quorum=False,
        timeout=timedelta(seconds=5),
        quorum_timeout=timedelta(seconds=180),
        connect_timeout=timedelta(seconds=10),
    )
    strat = Averaging(model, opt, sync_every=5, manager=manager, num_replicas=2)
    gen = torch.Generator().manual_seed(100 + a.replica)
    w_true = torch.linspace(-1, 1, 8)
    with open(a.out, "a") as f, strat:
        while strat.step_count < a.steps:  # the step, not the iteration: a healed replica jumps ahead
            x = torch.randn(32, 8, generator=gen)
            y = torch.tanh(x @ w_true).unsqueeze(1)
            loss = nn.functional.mse_loss(model(x), y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            tr = strat.transport
            rec = {
                "step": strat.step_count, "loss": loss.item(), "avg": tensor_hash(strat.avg),
                "x": tensor_hash(strat.frags.flat), "merged": strat.merged, "healed_at": tr.healed_at,
                "participants": tr.participants[-1] if tr.participants else 0,
                "failed": tr.failed_rounds, "served": strat.served, "loaded": strat.loaded,
                "pid": os.getpid(),
            }  # fmt: skip
            f.write(json.dumps(rec) + "\n")
            f.flush()
            while strat.step_count == a.freeze_at:  # the test kills it here, mid-run
                time.sleep(0.05)
    strat.finish()
    manager.shutdown(wait=False)


if __name__ == "__main__":
    main()
