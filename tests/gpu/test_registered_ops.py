"""The registered ops on the GPU: ``torch.library.opcheck`` and one ``torch.compile`` against eager.

Part of bench/gpu_correctness.py's stage of bench/gpu_check.sh (imported from there). The CPU suite
runs tests/ops/test_registration.py on CPU tensors only; this runs the same checks on the device:

* opcheck (schema, fake tensors, autograd registration, AOT dispatch with dynamic shapes) of every
  ``torch.ops.lowcomm`` op, per backend and dtype, on the samples of tests/ops/test_registration.py
  (loaded by path) moved to the device;
* (mode "full") one ``torch.compile(fullgraph=True)`` over a function that calls every op, against
  the same function in eager, outputs and in-place updates compared.

Each check is skipped, not started, when it would not fit before the caller's deadline.
"""

from __future__ import annotations

import importlib.util
import time
import traceback
from collections.abc import Callable
from pathlib import Path

import torch

from lowcomm_kernels import ops as lk

ROOT = Path(__file__).resolve().parent.parent
OPS = ("pack", "outer_merge_", "mask_indices", "sparse_gather", "sparse_scatter_merge_", "fragment_norms")


def all_ops(g, u, x, x_sent, delta_avg, buf, offsets):
    """tests/ops/test_registration.py's ``_all_ops``, with the mask made on the data's device."""
    delta, snap, nonfinite = lk.pack(g, x)
    lk.outer_merge_(g, u, delta_avg, x, x_sent, lr=0.7, momentum=0.9, alpha=0.1, beta=1.0, lam=0.2)
    idx = lk.mask_indices(7, 3, x.numel(), 64, device=x.device)
    y = lk.sparse_gather(x, idx)
    lk.sparse_scatter_merge_(x, idx, y * 0.5, y + 1.0, beta=1.0)
    return delta, snap, nonfinite, idx, y, lk.fragment_norms(buf, offsets, ord=2)


def compiled_matches_eager(dev: torch.device) -> None:
    gen = torch.Generator().manual_seed(1)
    n = 4099
    inputs = [torch.randn(n, generator=gen) for _ in range(4)] + [0.1 * torch.randn(n, generator=gen),
                                                                 torch.randn(n, generator=gen),
                                                                 torch.tensor([0, 1000, 1000, 4099])]
    eager_in = [t.to(dev, copy=True) for t in inputs]
    comp_in = [t.to(dev, copy=True) for t in inputs]
    want = all_ops(*eager_in)
    torch._dynamo.reset()
    got = torch.compile(all_ops, fullgraph=True)(*comp_in)
    names = ["delta", "snapshot", "nonfinite", "idx", "y", "norms", "g", "u", "x"]
    for name, a, e in zip(names, [*got, *comp_in[:3]], [*want, *eager_in[:3]], strict=True):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5, msg=lambda m, k=name: f"{k}: {m}")


def registration(dev: torch.device, backends: list[str], mode: str, deadline: float) -> list[dict]:
    """Rows (backend, op, case, status, detail, seconds) in gpu_correctness.py's format."""
    rows: list[dict] = []

    def attempt(backend: str, op: str, case: str, fn: Callable[[], None], need_s: float) -> None:
        t0 = time.perf_counter()
        status, detail = "skip", "time budget"
        if t0 + need_s <= deadline:
            try:
                fn()
                status, detail = "pass", ""
            except Exception as exc:
                where = traceback.format_exc().splitlines()[-3].strip()
                status, detail = "FAIL", f"{type(exc).__name__}: {' '.join(str(exc).split())} @ {where}"
        rows.append(dict(backend=backend, op=op, case=case, status=status, detail=detail[:600],
                         seconds=round(time.perf_counter() - t0, 3)))

    try:
        spec = importlib.util.spec_from_file_location("lc_test_registration",
                                                      ROOT / "tests" / "ops" / "test_registration.py")
        tests = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(tests)
    except Exception as exc:  # e.g. pytest missing: say so instead of failing the stage
        return [dict(backend="-", op="opcheck", case="import", status="skip", detail=str(exc)[:300],
                     seconds=0)]

    def moved(a):
        return a.to(dev) if isinstance(a, torch.Tensor) else (dev if isinstance(a, torch.device) else a)

    for b in backends:
        for dt in (torch.float32, torch.float64):
            for op in OPS:
                def check(op=op, b=b, dt=dt) -> None:
                    for args in tests._samples(op, b, dt):
                        torch.library.opcheck(getattr(torch.ops.lowcomm, op).default, tuple(map(moved, args)))
                attempt(b, "opcheck", f"{op} {str(dt)[6:]}", check, 2.0)
    if mode == "full":
        attempt("default", "compile", "fullgraph, all ops", lambda: compiled_matches_eager(dev), 25.0)
    return rows
