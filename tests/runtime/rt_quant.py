"""Workers for the quantized wire formats (test_quantized), run on spawned gloo ranks.

Loaded by file path, so imports are absolute. Results are plain Python / CPU tensors.
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
from torch import nn

import lowcomm_kernels.runtime as rt
from lowcomm_kernels.ops import quantize
from lowcomm_kernels.runtime.compression import QuantizedAllReduce, resolve_wire_format
from tests.runtime.rt_common import inner_step, make_model, make_opt


def payload(rank: int, n: int, seed: int) -> torch.Tensor:
    """Rank-dependent values spanning several magnitudes (some blocks tiny, one all zero)."""
    g = torch.Generator().manual_seed(1000 * seed + rank)
    v = torch.randn(n, generator=g, dtype=torch.float32)
    v *= torch.logspace(-3, 1, n, dtype=torch.float32)[torch.randperm(n, generator=g)]
    v[: min(n, 8)] = 0.0
    return v


def allreduce_cases(rank: int, world: int, cases: list[dict]) -> dict:
    """Each case: every rank quantizes its payload and averages it through QuantizedAllReduce."""
    transport = rt.Transport(dist.group.WORLD, device=torch.device("cpu"), timeout_s=30.0)
    out = {}
    for c in cases:
        wire = resolve_wire_format(c["fmt"], c["block"], torch.float32, torch.float32)
        qar = QuantizedAllReduce(transport, wire)
        if c.get("latency"):
            transport.wan = rt.WAN(c["latency"], 1e9)
        v = payload(rank, c["n"], c["seed"])
        codes, scales = quantize(v, c["fmt"], c["block"])
        control = torch.zeros(world, dtype=torch.float64)
        control[rank] = rank + 1.0
        h = qar.start(codes, scales, c["n"], control=control, name=c["name"], out_dtype=torch.float32)
        polled_early = h.poll()
        exposed = h.wait()
        out[c["name"]] = {
            "result": h.result.clone(),
            "control": h.host_values(),
            "wire_bytes": h.wire_bytes,
            "polled_early": polled_early,
            "exposed": exposed,
            "in_flight_s": h.in_flight_s,
        }
        transport.wan = None
        qar.close()
        out[c["name"]]["thread_stopped"] = not qar._thread.is_alive()
    return out


class Quadratic(nn.Module):
    """f_r(x) = ½ Σ_i a_i (x_i − b_{r,i})²: per-coordinate curvatures a_i spanning 1e-2..1 inside
    every block, so a 4-bit block quantizer rounds the slow coordinates' Δ to zero unless the error
    is fed back."""

    def __init__(self, d: int) -> None:
        super().__init__()
        self.x = nn.Parameter(torch.zeros(d, dtype=torch.float32))


def quadratic_runs(rank: int, world: int, variants: list[dict], d: int, T: int, H: int) -> dict:
    """DiLoCo on the quadratic for each variant; x after every sync (rank 0's view)."""
    g = torch.Generator().manual_seed(5)
    a = torch.logspace(-2, 0, d, dtype=torch.float32)[torch.randperm(d, generator=g)]
    b_all = torch.randn(world, d, generator=g, dtype=torch.float32)
    b = b_all[rank]
    out = {}
    for v in variants:
        model = Quadratic(d)
        opt = torch.optim.SGD(model.parameters(), lr=0.5)
        traj = []
        st = rt.DiLoCo(
            model, opt, sync_every=H, outer_lr=0.7, outer_momentum=0.5,
            metrics_callback=lambda rec, m=model, tr=traj: tr.append(m.x.detach().clone()), **v["kw"],
        )  # fmt: skip
        for _ in range(T):
            loss = 0.5 * (a * (model.x - b) ** 2).sum()
            loss.backward()
            opt.step()
            opt.zero_grad()
            st.step()
        st.close()
        out[v["name"]] = {
            "traj": torch.stack(traj),
            "bytes": st.metrics.bytes_sent,
            "residual_bytes": st.metrics.residual_bytes,
            "memory": st.memory_per_param(),
        }
    out["optimum"] = (a[None] * b_all).sum(0) / (a * world)
    return out


def bad_configs(rank: int, world: int) -> dict:
    """Every refused configuration of the wire format: the exception and its message."""
    out = {}
    cases = {
        "unknown_format": ("diloco", {"wire_dtype": "int3"}),
        "block_not_pow2": ("diloco", {"wire_dtype": "int8", "quant_block": 48}),
        "block_one": ("diloco", {"wire_dtype": "int4", "quant_block": 1}),
        "block_bool": ("diloco", {"wire_dtype": "int8", "quant_block": True}),
        "ef_dense_wire": ("diloco", {"wire_dtype": "bf16", "error_feedback": True}),
        "ef_not_bool": ("diloco", {"wire_dtype": "int8", "error_feedback": 1}),
        "ef_loscar": ("loscar", {"wire_dtype": "int8", "error_feedback": True}),
    }
    for name, (cls, kw) in cases.items():
        model = make_model(torch.float32)
        opt = make_opt(model)
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


def checkpoint_residual(rank: int, world: int, tmp: str) -> dict:
    """Streaming DiLoCo int4 + error feedback: a checkpoint holds the residual, a resumed run is
    bit-identical to the uninterrupted one, and a residual of the wrong dtype is refused."""

    def build():
        model = make_model(torch.float32)
        opt = make_opt(model)
        st = rt.StreamingDiLoCo(
            model,
            opt,
            sync_every=8,
            num_fragments=2,
            fragment_sync_delay=2,
            wire_dtype="int4",
            quant_block=16,
            error_feedback=True,
        )
        return model, opt, st

    path = os.path.join(tmp, f"rank{rank}.pt")
    model, opt, st = build()
    for t in range(1, 31):
        inner_step(model, opt, rank, t)
        st.step()
        if t == 13:
            st.save_checkpoint(path)
            saved_residual = st.residual.clone()
    full = {k: v.detach().clone() for k, v in model.named_parameters()}
    st.close()
    model, opt, st = build()
    st.load_checkpoint(path)
    restored = torch.equal(st.residual, saved_residual)
    for t in range(14, 31):
        inner_step(model, opt, rank, t)
        st.step()
    resumed = {k: v.detach().clone() for k, v in model.named_parameters()}
    st.close()
    sd = st.state_dict()
    sd["residual"] = sd["residual"].double()
    try:
        st._validate(sd)
        refused = None
    except rt.CheckpointError as e:
        refused = str(e)
    return {
        "full": full,
        "resumed": resumed,
        "restored": restored,
        "residual_nonzero": bool(saved_residual.abs().sum() > 0),
        "refused": refused,
    }


def after_uneven_subgroups(rank: int, world: int, wire: str) -> dict:
    """Rank 0 alone makes an extra group first (as a strategy on a subgroup would leave the ranks
    outside it one group short); then every rank wraps the same model in DiLoCo on a compressed wire
    over all ranks and syncs twice."""
    if rank == 0:
        dist.new_group([0], use_local_synchronization=True)
    model, opt = make_model(torch.float32), None
    opt = make_opt(model)
    st = rt.DiLoCo(model, opt, sync_every=2, outer_lr=0.7, outer_momentum=0.9, wire_dtype=wire, timeout_s=20)
    for step in range(1, 5):
        inner_step(model, opt, rank, step)
        st.step()
    st.finish()
    flat = torch.cat([p.detach().flatten() for p in model.parameters()])
    st.close()
    return {"params": flat, "syncs": st.metrics.num_syncs}
