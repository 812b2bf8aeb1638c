"""Workers for test_sharding: 4 gloo ranks = 2 regions x 2 shards, FSDP2 ``fully_shard`` inside a
region, the strategy across regions over the replica group.

Loaded by file path on spawned ranks (``spawn_local``), so imports are absolute.
"""

from __future__ import annotations

import io
import os
import tempfile

import torch
import torch.distributed as dist

import lowcomm_kernels.runtime as rt
from lowcomm_kernels.runtime.base import tensor_hash
from tests.runtime.rt_common import batch, loss_fn, make_model, make_opt

CLASSES = {"diloco": rt.DiLoCo, "streaming": rt.StreamingDiLoCo, "cocodc": rt.CoCoDC, "loscar": rt.LOSCAR}


def _sharded_model(mesh, rank: int, sc: dict):
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import Shard

    kw = {}
    if sc.get("shard_dim1_in_region1") and rank >= 2:  # region 1 shards matrices by columns
        kw["shard_placement_fn"] = lambda p: Shard(1) if p.dim() == 2 else None
    model = make_model(torch.float64)
    for b in model.blocks:
        fully_shard(b, mesh=mesh, **kw)
    fully_shard(model.out, mesh=mesh, **kw)  # (1, 8) over 2 shards: rank 1 of a region holds no rows
    fully_shard(model, mesh=mesh, **kw)
    return model


def _dtensor_model(mesh):
    """distribute_tensor without FSDP (tensor-parallel style): Shard(0) everywhere but the output
    layer, which is replicated (a (1, 8) Shard(0) weight gets a Shard(1) gradient, which DTensor's
    in-place SGD update cannot take)."""
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    model = make_model(torch.float64)
    for mod in model.modules():
        for n, p in list(mod.named_parameters(recurse=False)):
            pl = [Replicate()] if mod is model.out else [Shard(0)]
            setattr(mod, n, torch.nn.Parameter(distribute_tensor(p.detach(), mesh, pl)))
    return model


def _loss(model, rank: int, t: int, dtensor: bool):
    if not dtensor:
        return loss_fn(model, *batch(rank, t, torch.float64))
    from torch.distributed.tensor import DTensor, Replicate

    # tensor-parallel: both ranks of a region compute on the region's batch (its first rank's)
    x, y = batch(rank - rank % 2, t, torch.float64)
    out = model(DTensor.from_local(x, model.inp.weight.device_mesh, [Replicate()]))
    return ((out.full_tensor() - y) ** 2).mean()


def sharded_run(rank: int, world: int, scenarios: list[dict]) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replica", "shard"))
    out = {}
    for sc in scenarios:
        dtensor = bool(sc.get("dtensor"))
        model = _dtensor_model(mesh["shard"]) if dtensor else _sharded_model(mesh["shard"], rank, sc)
        opt = make_opt(model)
        if sc.get("forward_first"):  # FSDP's lazy initialisation runs before the strategy wraps
            with torch.no_grad():
                model(batch(rank, 0, torch.float64)[0])
        group = dist.group.WORLD if sc.get("world_group") else mesh["replica"].get_group()
        records = []
        holder = []

        def on_sync(rec, holder=holder, records=records):
            st = holder[0]
            p = rec.fragment
            x = st.frags.x(p) if p >= 0 else st.frags.flat
            g = tensor_hash(st.frags.slice(st.g, p)) if hasattr(st, "g") else None
            records.append((p, rec.send_step, rec.apply_step, rec.skipped, g, tensor_hash(x)))

        err = None
        try:
            st = CLASSES[sc["cls"]](model, opt, process_group=group, metrics_callback=on_sync, **sc["kw"])
            holder.append(st)
            with st:
                for t in range(1, sc["T"] + 1):
                    _loss(model, rank, t, dtensor).backward()
                    opt.step()
                    opt.zero_grad()
            view_problem = st.frags.broken_view(model)
            sizes = st.frags.sizes()
            buf = io.BytesIO()  # the strategy's own state: plain tensors, loadable with weights_only
            torch.save(st.state_dict(), buf)
            buf.seek(0)
            st.load_state_dict(torch.load(buf, weights_only=True))
            try:
                st.save_checkpoint(os.path.join(tempfile.gettempdir(), f"never_written_{os.getpid()}.pt"))
                ckpt = "written"
            except ValueError as e:
                ckpt = str(e)
        except Exception as e:
            err = f"{type(e).__name__}: {e}"
            view_problem, sizes, ckpt = None, None, None
        full = None
        if err is None:  # collective over the shard mesh: every rank of the region calls it
            full = {n: p.full_tensor().detach().clone() for n, p in model.named_parameters()}
        out[sc["name"]] = {"error": err, "records": records, "full": full, "view_problem": view_problem,
                           "sizes": sizes, "checkpoint": ckpt}
    return out
