"""What reusing the wire buffers saves on the CPU: a sync's pack into the buffers an earlier sync left,
against a pack into new ones (what every send did before).

    OMP_WAIT_POLICY=ACTIVE .venv/bin/python bench/send_buffers.py [--numel 33554432] [--syncs 8]

One gloo rank, a model of ``--numel`` fp32 parameters in 4 equal tensors, Streaming DiLoCo with
K = 4 fragments (so each fragment is a quarter of the model), fp32 / int8 wires. For each wire the
two variants alternate sync by sync in one process (``fresh`` replaces the strategy's buffer pool
by one that never keeps anything), and the table gives the median ``pack_s`` of the syncs (the
pack: Δ or codes + scales, the snapshot, the non-finite count) with its ratio. Why it matters: a
new buffer of many megabytes is a new mapping, and its first write faults in every 4 KiB page.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

import torch
import torch.distributed as dist

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lowcomm_kernels.runtime as rt  # noqa: E402
from lowcomm_kernels.runtime.launch import free_port  # noqa: E402

H, K = 8, 4  # a fragment sent every 2 steps


def _strategy(numel: int, wire: str, fresh: bool) -> tuple[torch.nn.Module, rt.StreamingDiLoCo]:
    model = torch.nn.ParameterList(torch.nn.Parameter(torch.zeros(numel // K)) for _ in range(K))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    st = rt.StreamingDiLoCo(
        model, opt, num_fragments=K, sync_every=H, fragment_sync_delay=1, outer_lr=0.7, outer_momentum=0.9,
        wire_dtype=None if wire == "fp32" else wire,
    )  # fmt: skip
    if fresh:
        st._take_buffers = lambda n: ({}, {})  # type: ignore[method-assign]
    return model, st


def measure(numel: int, syncs: int) -> str:
    rows = [
        f"{numel:,} fp32 parameters, K = {K} fragments of {numel // K:,}; median pack time of {syncs} syncs "
        f"per variant, alternating in one process ({torch.get_num_threads()} threads)",
        "",
        "| wire | reused buffers | new buffers per send | new / reused |",
        "| --- | --- | --- | --- |",
    ]
    for wire in ("fp32", "int8"):
        runs = {fresh: _strategy(numel, wire, fresh) for fresh in (False, True)}
        times: dict[bool, list[float]] = {False: [], True: []}
        for _ in range((syncs + 1) * H // K):  # a send every H / K steps
            for model, st in runs.values():
                with torch.no_grad():
                    for p in model.parameters():
                        p.add_(1e-3)  # local progress: a non-zero Δ
                st.step()
        for fresh, (_, st) in runs.items():
            st.finish()
            times[fresh] = [r.pack_s for r in st.metrics.syncs][1:]  # the first send allocates either way
            st.close()
        reused, new = statistics.median(times[False]), statistics.median(times[True])
        rows.append(f"| {wire} | {reused * 1e3:.1f} ms | {new * 1e3:.1f} ms | {new / reused:.2f}x |")
        print(rows[-1], flush=True)
    return "\n".join(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--numel", type=int, default=32 << 20)
    ap.add_argument("--syncs", type=int, default=8)
    args = ap.parse_args()
    os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(free_port())
    dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        print(measure(args.numel, args.syncs))
    finally:
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
