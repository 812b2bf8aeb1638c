"""Workers for the top-k sparse wire format (test_topk_wire), run on spawned gloo ranks.

Loaded by file path, so imports are absolute. Results are plain Python / CPU tensors.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch import nn

import lowcomm_kernels.runtime as rt
from lowcomm_kernels.ops import TopKFormat, topk_encode
from lowcomm_kernels.runtime.topk_wire import TopKAllGather, TopKWire


def payload_values(rank: int, n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * seed + rank)
    return torch.randn(n, generator=g, dtype=torch.float64) * torch.logspace(-2, 1, n, dtype=torch.float64)


def allgather_cases(rank: int, world: int, cases: list[dict]) -> dict:
    """Each case: every rank encodes its values and sums every rank's payload through TopKAllGather."""
    transport = rt.Transport(dist.group.WORLD, device=torch.device("cpu"), timeout_s=30.0)
    out = {}
    for c in cases:
        f = TopKFormat(c["k"], c["chunk"], c["bits"])
        wire = TopKWire(f, 0.9, torch.float64, world)
        tag = TopKAllGather(transport, wire)
        e = torch.zeros(c["n"], dtype=torch.float64)
        p, _ = topk_encode(
            payload_values(rank, c["n"], c["seed"]), e, k=f.k, chunk=f.chunk, bits=f.bits, beta=0.9
        )
        control = torch.zeros(world, dtype=torch.float64)
        control[rank] = rank + 1.0
        h = tag.start(p, c["n"], control=control, name=c["name"], out_dtype=torch.float64)
        h.wait()
        out[c["name"]] = {"result": h.result.clone(), "control": h.host_values(), "wire_bytes": h.wire_bytes}
        tag.close()
    return out


class Quadratic(nn.Module):
    """f_r(x) = ½ Σ_i a_i (x_i − b_{r,i})² over two tensors (two fragments for Streaming DiLoCo)."""

    def __init__(self, d1: int, d2: int) -> None:
        super().__init__()
        self.x1 = nn.Parameter(torch.zeros(d1, dtype=torch.float64))
        self.x2 = nn.Parameter(torch.zeros(d2, dtype=torch.float64))


def problem(world: int, d: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(11)
    a = torch.logspace(-2, 0, d, dtype=torch.float64)[torch.randperm(d, generator=g)]
    return a, torch.randn(world, d, generator=g, dtype=torch.float64)


def quadratic_runs(rank: int, world: int, variants: list[dict], d1: int, d2: int, T: int, lr: float) -> dict:
    """Each variant: a strategy with wire_dtype='topk' on the quadratic; every parameter after every
    step and the bytes of every sync."""
    a, b_all = problem(world, d1 + d2)
    b = b_all[rank]
    out = {}
    for v in variants:
        model = Quadratic(d1, d2)
        opt = torch.optim.SGD(model.parameters(), lr=lr)
        records = []
        cls = {"diloco": rt.DiLoCo, "streaming": rt.StreamingDiLoCo, "cocodc": rt.CoCoDC}[v["cls"]]
        st = cls(model, opt, wire_dtype="topk", metrics_callback=records.append, **v["kw"])
        traj = []
        for _ in range(T):
            x = torch.cat([model.x1, model.x2])
            loss = 0.5 * (a * (x - b) ** 2).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            st.step()
            traj.append(torch.cat([model.x1, model.x2]).detach().clone())
        st.finish()
        st.close()
        out[v["name"]] = {
            "traj": torch.stack(traj),
            "g": st.g.clone(),
            "bytes": [r.bytes for r in records],
            "fragments": [getattr(r, "fragment", None) for r in records],
            "bytes_sent": st.metrics.bytes_sent,
        }
    return out


def bad_configs(rank: int, world: int) -> dict:
    """Every refused top-k configuration: the exception and its message."""
    out = {}
    cases = {
        "k_past_chunk": ("diloco", {"wire_dtype": "topk", "topk_k": 33, "topk_chunk": 32}),
        "bits_3": ("diloco", {"wire_dtype": "topk", "topk_bits": 3}),
        "beta_past_1": ("diloco", {"wire_dtype": "topk", "ef_beta": 1.5}),
        "chunk_1": ("diloco", {"wire_dtype": "topk", "topk_chunk": 1}),
        "loscar": ("loscar", {"wire_dtype": "topk"}),
    }
    for name, (cls, kw) in cases.items():
        model = Quadratic(8, 8)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        try:
            if cls == "loscar":
                st = rt.LOSCAR(model, opt, density=0.5, local_steps=2, overlap_steps=1, **kw)
            else:
                st = rt.DiLoCo(model, opt, sync_every=2, **kw)
            st.close()
            out[name] = None
        except Exception as e:  # noqa: BLE001 (the test reads the type and message)
            out[name] = f"{type(e).__name__}: {e}"
    return out
