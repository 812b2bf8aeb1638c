"""Workers for test_outer_overflow: every rank sends a finite Δ but the sum or the outer step
overflows. Loaded by file path, so imports are absolute. Results are plain Python / CPU tensors."""

from __future__ import annotations

import logging

import torch

import lowcomm_kernels.runtime as rt
from tests.runtime.rt_common import inner_step, make_model, make_opt

H, T, AT = 4, 16, 8  # syncs every H steps; before the send at step AT, x is pushed to g − huge


def overflow_run(rank: int, world: int, cls: str, kw: dict, huge: float) -> dict:
    """Train T steps with ``huge`` subtracted from every parameter right before the send at step AT
    (Δ = g − x = +huge on every rank, finite); g, u and x around that sync, warnings, metrics."""
    model = make_model(torch.float32)
    opt = make_opt(model)
    make = {"diloco": rt.DiLoCo, "streaming": rt.StreamingDiLoCo}[cls]
    st = make(model, opt, sync_every=H, **kw)
    warnings: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda rec: warnings.append(rec.getMessage())
    st.log.logger.addHandler(handler)
    out: dict = {"error": None}
    try:
        for t in range(1, T + 1):
            inner_step(model, opt, rank, t)
            if t == AT:
                out["g_before"], out["u_before"] = st.g.clone(), st.u.clone()
                with torch.no_grad():
                    st.frags.flat.sub_(huge)
            st.step()
            if t == AT + st.tau:
                out["g_after"], out["u_after"] = st.g.clone(), st.u.clone()
                out["x_after"] = st.frags.flat.clone()
        st.finish()
    except Exception as e:  # noqa: BLE001 (the test reads the type and message)
        out["error"] = f"{type(e).__name__}: {e}"
    out.update(
        g_final=st.g.clone(), finite=bool(torch.isfinite(st.g).all() and torch.isfinite(st.frags.flat).all()),
        skipped=[(r.send_step, r.skipped) for r in st.metrics.syncs], warnings=warnings,
    )  # fmt: skip
    st.close()
    return out
