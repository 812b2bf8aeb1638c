"""Workers for test_refusals: configurations every rank must refuse at construction, by name, before
anything changes. Loaded by file path, so imports are absolute. Results are plain Python."""

from __future__ import annotations

import torch

import lowcomm_kernels.runtime as rt
from tests.runtime.rt_common import make_model, make_opt


def meta_models(rank: int, world: int) -> dict:
    """A model wholly on the meta device, and a CPU model with a frozen meta parameter."""
    out = {}
    for name in ("all_meta", "frozen_meta"):
        if name == "all_meta":
            with torch.device("meta"):
                model = make_model(torch.float32)
        else:
            model = make_model(torch.float32)
            model.blocks[0].requires_grad_(False)
            model.blocks[0].to("meta")
        before = {n: (p.is_meta, p.data_ptr()) for n, p in model.named_parameters()}
        try:
            rt.DiLoCo(model, make_opt(model), sync_every=2).close()
            out[name] = None
        except Exception as e:  # noqa: BLE001 (the test reads the type and message)
            out[name] = f"{type(e).__name__}: {e}"
        now = {n: (p.is_meta, p.data_ptr()) for n, p in model.named_parameters()}
        out[name + "_unchanged"] = now == before
    return out
