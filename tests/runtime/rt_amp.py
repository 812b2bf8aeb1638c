"""Workers for test_amp: a torch.amp.GradScaler in the loop, inf gradients injected on one rank.

Loaded by file path on spawned gloo ranks (``spawn_local``), so imports are absolute.
"""

from __future__ import annotations

import torch

import lowcomm_kernels.runtime as rt
from lowcomm_kernels.runtime.base import tensor_hash
from tests.runtime.rt_common import batch, loss_fn, make_model, make_opt

CLASSES = {"diloco": rt.DiLoCo, "streaming": rt.StreamingDiLoCo, "cocodc": rt.CoCoDC, "loscar": rt.LOSCAR}


def _scaled_step(model, opt, scaler, rank: int, t: int, sc: dict) -> None:
    """One AMP-style iteration: scaled backward, inf injected where the scenario says, scaler.step
    (skips opt.step() when it finds inf), scaler.update()."""
    x, y = batch(rank, t, torch.float64)
    scaler.scale(loss_fn(model, x, y)).backward()
    if (rank, t) in sc["inf_at"]:
        with torch.no_grad():
            model.inp.weight.grad[0, 0] = float("inf")
    scaler.step(opt)
    scaler.update()
    opt.zero_grad()


def amp_run(rank: int, world: int, scenarios: list[dict]) -> dict:
    out = {}
    for sc in scenarios:
        model = make_model(torch.float64)
        # fused: the scaler always calls step() and the optimizer skips inside (its hook still runs)
        fused = sc.get("fused")
        opt = torch.optim.Adam(model.parameters(), lr=1e-3, fused=True) if fused else make_opt(model)
        scaler = torch.amp.GradScaler("cpu")
        records: list[tuple] = []
        holder: list = []

        def on_sync(rec, holder=holder, records=records):
            st = holder[0]
            if hasattr(st, "g"):  # dense: g, and this rank's x of the synced fragment (x = g if α = 0)
                p = rec.fragment
                agree = (tensor_hash(st.frags.slice(st.g, p)), tensor_hash(st.frags.x(p)))
            else:  # LOSCAR: the merged coordinates x[S] (all equal to the mean under overwrite, Q = 0)
                agree = (tensor_hash(st.last_idx), tensor_hash(st.frags.flat[st.last_idx]))
            records.append((rec.fragment, rec.round, rec.send_step, rec.apply_step, rec.skipped, agree))

        mode = sc.get("mode", "with")
        kw = dict(sc["kw"])
        if mode == "with":
            kw["grad_scaler"] = scaler
        elif mode == "other_scaler":
            kw["grad_scaler"] = torch.amp.GradScaler("cpu")
        elif mode == "given_on_rank0" and rank == 0:
            kw["grad_scaler"] = scaler
        err = None
        skipped_steps = []
        try:
            st = CLASSES[sc["cls"]](model, opt, metrics_callback=on_sync, **kw)
            holder.append(st)
            if mode == "manual":
                for t in range(1, sc["T"] + 1):
                    _scaled_step(model, opt, scaler, rank, t, sc)
                    st.step()  # once per iteration, stepped or skipped
            else:
                with st:
                    for t in range(1, sc["T"] + 1):
                        before = scaler.get_scale()
                        _scaled_step(model, opt, scaler, rank, t, sc)
                        if scaler.get_scale() < before:
                            skipped_steps.append(t)
            steps = st.step_count
        except Exception as e:
            err = f"{type(e).__name__}: {e}"
            steps = holder[0].step_count if holder else None
        out[sc["name"]] = {
            "records": records,
            "error": err,
            "steps": steps,
            "skipped_steps": skipped_steps,
            "scaler_step_wrapped": "step" in vars(scaler),
            "params": {k: v.detach().clone() for k, v in model.named_parameters()},
        }
    return out
