"""Workers for test_wan_bounds: the emulated WAN on 2 gloo ranks against the strategy's timeout_s.

Loaded by file path, so imports are absolute. Results are plain Python.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist

import lowcomm_kernels.runtime as rt
from tests.runtime.rt_common import make_model, make_opt


def wan_bounds(rank: int, world: int) -> dict:
    """Strategies on links where one sync outlasts timeout_s (refused at construction, parameters
    untouched), then bare Transport waits on such links (a SyncError at once, not a sleep)."""
    out: dict = {}
    links = {"latency": rt.WAN(1e9, 1e9), "bandwidth": rt.WAN(0.0, 1e-12 * 1e6 / 8)}
    # what a first construction pays once (imports, the native library, groups) is paid here, on a
    # fast link, so that the clock below measures the refusal and not a loaded machine's start-up
    t0 = time.perf_counter()
    model = make_model(torch.float32)
    rt.DiLoCo(model, make_opt(model), sync_every=2, timeout_s=5.0).close()
    model = make_model(torch.float32)
    rt.LOSCAR(model, make_opt(model), density=0.5, local_steps=2, overlap_steps=1, timeout_s=5.0).close()
    out["warm_up_s"] = time.perf_counter() - t0
    for name, wan in links.items():
        for cls, kw in (("diloco", {"sync_every": 2}),
                        ("loscar", {"density": 0.5, "local_steps": 2, "overlap_steps": 1})):
            model = make_model(torch.float32)
            before = {k: v.detach().clone() for k, v in model.state_dict().items()}
            # both ranks start the clock together: on a loaded machine one rank may reach the first
            # case seconds after the other, and the construction's agreement waits for it
            dist.barrier()
            t0 = time.perf_counter()
            try:
                st = getattr(rt, {"diloco": "DiLoCo", "loscar": "LOSCAR"}[cls])(
                    model, make_opt(model), wan=wan, timeout_s=5.0, **kw
                )
                st.close()
                err = None
            except Exception as e:  # noqa: BLE001 (the test reads the type and message)
                err = f"{type(e).__name__}: {e}"
            same = all(torch.equal(v, model.state_dict()[k]) for k, v in before.items())
            out[f"{cls}_{name}"] = {"error": err, "s": time.perf_counter() - t0, "unchanged": same}
    # LOSCAR sends k = 1 of the model's values: a link too slow for the whole model carries it
    model = make_model(torch.float32)
    n = sum(p.numel() for p in model.parameters())
    slow = rt.WAN(0.0, 4.0 * n / 5.0 / 2)  # the whole model in 2 x 5 s, one value in far less
    st = rt.LOSCAR(model, make_opt(model), density=1.0 / n, local_steps=2, overlap_steps=1, wan=slow,
                   timeout_s=5.0)
    st.close()
    out["loscar_small_payload_accepted"] = True
    for name, wan in links.items():
        tr = rt.Transport(dist.group.WORLD, device=torch.device("cpu"), wan=wan, timeout_s=5.0)
        h = tr.all_reduce([torch.ones(1000)], name=f"sync on the {name} link")
        t0 = time.perf_counter()
        try:
            h.wait()
            err = None
        except Exception as e:  # noqa: BLE001
            err = f"{type(e).__name__}: {e}"
        out[f"wait_{name}"] = {"error": err, "s": time.perf_counter() - t0}
    return out
