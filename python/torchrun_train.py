"""Train the byte-level LM with a lowcomm strategy under ``torchrun`` (one process per region).

Single node, 2 workers on CPU:

    torchrun --standalone --nproc_per_node 2 python/torchrun_train.py --method cocodc --steps 100

Several nodes (run on each node; node 0's address as the rendezvous endpoint):

    torchrun --nnodes 2 --nproc_per_node 1 --rdzv_backend c10d --rdzv_endpoint HOST0:29500 \\
        python/torchrun_train.py --method streaming --steps 1000

On GPUs the script uses NCCL and one GPU per local rank; on CPUs gloo. The emulated WAN
(``--latency-ms``/``--bandwidth-mbps``) is for single-machine experiments; leave it off (0) on a
real cross-region link.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="lowcomm strategy under torchrun")
    p.add_argument("--method", choices=("diloco", "streaming", "cocodc", "loscar"), default="streaming")
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--sync-every", type=int, default=20)
    p.add_argument("--delay", type=int, default=2)
    p.add_argument("--latency-ms", type=float, default=20.0, help="emulated WAN latency (0: no emulation)")
    p.add_argument("--bandwidth-mbps", type=float, default=100.0)
    a = p.parse_args(argv)
    if "RANK" not in os.environ:
        print("error: run me under torchrun (RANK/WORLD_SIZE are not set)", file=sys.stderr)
        return 2

    cuda = torch.cuda.is_available()
    if cuda:
        torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
    else:
        torch.set_num_threads(1)
    dist.init_process_group("nccl" if cuda else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    device = torch.device("cuda") if cuda else torch.device("cpu")

    import lowcomm_kernels as lk
    from lowcomm_kernels.train.corpus import load_corpus, sample_batch, worker_shard
    from lowcomm_kernels.train.model import ModelConfig, TinyLlama

    corpus = load_corpus(None, max_train_bytes=1_000_000, max_val_bytes=100_000)
    shard = worker_shard(corpus.train, rank, world)
    torch.manual_seed(0)
    cfg = ModelConfig()
    model = TinyLlama(cfg).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    wan = lk.WAN(a.latency_ms / 1e3, a.bandwidth_mbps * 1e6 / 8) if a.latency_ms > 0 else None
    common = dict(wan=wan)
    if a.method == "diloco":
        strategy = lk.DiLoCo(model, opt, sync_every=a.sync_every, **common)
    elif a.method == "streaming":
        strategy = lk.StreamingDiLoCo(
            model, opt, sync_every=a.sync_every, num_fragments=4, fragment_sync_delay=a.delay, **common
        )
    elif a.method == "cocodc":
        strategy = lk.CoCoDC(
            model, opt, sync_every=a.sync_every, num_fragments=4, fragment_sync_delay=a.delay, **common
        )
    else:
        strategy = lk.LOSCAR(
            model,
            opt,
            density=0.25,
            local_steps=max(1, a.sync_every // 4 - a.delay),
            overlap_steps=a.delay,
            **common,
        )
    gen = torch.Generator().manual_seed(rank)
    t0 = time.perf_counter()
    with strategy:
        for step in range(1, a.steps + 1):
            x, y = sample_batch(shard, 8, cfg.seq_len, gen)
            loss = model.loss(x.to(device), y.to(device))
            loss.backward()
            opt.step()
            opt.zero_grad()
            if rank == 0 and (step % max(1, a.steps // 5) == 0 or step == a.steps):
                print(f"step {step}: train loss {loss.item():.3f}", flush=True)
    m = strategy.metrics
    if rank == 0:
        print(
            f"done: {a.method} on {world} ranks, {time.perf_counter() - t0:.1f} s, {m.num_syncs} syncs, "
            f"{m.bytes_sent / 1e6:.2f} MB sent per worker, exposed comm {m.exposed_comm_s:.2f} s "
            f"({100 * m.exposed_fraction():.0f}%)",
            flush=True,
        )
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
