"""A user's own script, as the exit tests run it: ``python rt_exit.py RANK WORLD PORT CASE [WIRE]``.

The process group is the user's (a plain ``init_process_group("gloo")`` with torch's default timeout
of 30 minutes) and the script ends as a user's would: by returning from the module or by an
exception. Cases:

- ``stuck_peer``: rank 1 stops answering after its first sync (it sleeps); rank 0 goes on, raises
  ``SyncError`` after ``timeout_s`` and must then be able to exit.
- ``no_finish``: a ``strategy.step()`` loop that ends with a sync in flight and never calls
  ``finish()``; every rank must exit cleanly.
- ``late_peer``: rank 1 joins an all-reduce 0.2 s late, on a tensor whose only Python reference it
  drops at once, and returns: gloo completes the all-reduce while its interpreter is ending.
  Before the runtime held such tensors until gloo let go of them, about one such exit in ten
  aborted ("terminate called without an active exception").
"""

from __future__ import annotations

import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import lowcomm_kernels.runtime as rt  # noqa: E402
from lowcomm_kernels.runtime.transport import start_collective  # noqa: E402
from tests.runtime.rt_common import inner_step, make_model  # noqa: E402


def main() -> None:
    rank, world, port, case = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
    wire = sys.argv[5] if len(sys.argv) > 5 else "fp32"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    if case == "late_peer":
        time.sleep(0.2 * rank)
        t = torch.ones(1 << 16)
        start_collective(lambda: dist.all_reduce(t, async_op=True), [t], 30.0)
        print("done", flush=True)
        return
    model = make_model(torch.float32)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    strategy = rt.StreamingDiLoCo(
        model, opt, sync_every=4, num_fragments=2, fragment_sync_delay=1, wire_dtype=wire, timeout_s=3.0
    )
    steps = 14 if case == "no_finish" else 40  # no_finish: step 14 sends a fragment, due at 15
    for t in range(1, steps + 1):
        if case == "stuck_peer" and rank == 1 and t == 5:
            print("stuck", flush=True)
            time.sleep(600)
        inner_step(model, opt, rank, t)
        strategy.step()
    print(f"done {strategy.metrics.num_syncs}", flush=True)


if __name__ == "__main__":
    main()
