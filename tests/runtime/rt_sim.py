"""Single-process float64 simulation of the four methods, written straight from docs/algorithms.md.

Independent of ``lowcomm_kernels.runtime``: M workers are M model copies in this process, the
all-reduce is a Python mean, and every rule is spelled out on plain tensors. The only shared
pieces are the tiny model/data (rt_common) and, for LOSCAR, the mask specification
``ops.mask_indices_ref`` (the op contract: S_r from (seed, r, d, k)).

Schedule conventions (the runtime documents the same): inner steps t = 1, 2, ...; after every
worker has done step t: apply the results due at t, then send what is due at t, then apply the
results due at t again (τ = 0 is blocking).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tests.runtime.rt_common import inner_step, make_model, make_opt


class Workers:
    """M model copies (identical init) with their inner optimizers, and fragment access."""

    def __init__(self, M: int, K: int, dtype=torch.float64, model_kw=None, data_ranks=None,
                 skip=None, outer_dtype=None) -> None:
        # outer_dtype: the dtype fragments are read in (get) and so the outer state's; a bf16 /
        # fp16 model with outer_dtype=float64 is the fp32-master rule in float64: x is widened
        # exactly on read and rounded to nearest even when a merge writes it back (put)
        self.outer_dtype = outer_dtype or dtype
        # skip: (worker, step) pairs whose inner step computes gradients but does not step (a
        # GradScaler that found inf/NaN): parameters and optimizer state unchanged
        self.skip = set(skip or ())
        self.models = [make_model(dtype, **(model_kw or {})) for _ in range(M)]
        self.opts = [make_opt(m) for m in self.models]
        # data_ranks[m]: the data ranks whose batches worker m averages (inner DP group of a region)
        self.data_ranks = data_ranks or [[m] for m in range(M)]
        self.frag_params = [partition(m, K) for m in self.models]
        self.M, self.K = M, K

    def step(self, m: int, t: int) -> None:
        ranks = self.data_ranks[m]
        if (m, t) in self.skip:
            self.opts[m].zero_grad()
            return
        if len(ranks) == 1:
            inner_step(self.models[m], self.opts[m], ranks[0], t)
            return
        # DDP averages the gradients of the region's ranks: grad of the mean of their losses.
        from tests.runtime.rt_common import batch, loss_fn
        dtype = next(self.models[m].parameters()).dtype
        loss = sum(loss_fn(self.models[m], *batch(r, t, dtype)) for r in ranks) / len(ranks)
        loss.backward()
        self.opts[m].step()
        self.opts[m].zero_grad()

    def get(self, m: int, p: int) -> torch.Tensor:
        return torch.cat([q.detach().reshape(-1) for q in self.frag_params[m][p]]).to(self.outer_dtype)

    def put(self, m: int, p: int, v: torch.Tensor) -> None:
        o = 0
        with torch.no_grad():
            for q in self.frag_params[m][p]:
                q.copy_(v[o:o + q.numel()].view_as(q))
                o += q.numel()

    def named(self, m: int) -> dict[str, torch.Tensor]:
        return {k: v.detach().clone() for k, v in self.models[m].named_parameters()}


def partition(model, K: int) -> list[list[torch.nn.Parameter]]:
    """Layer-strided: fragment p holds blocks p, p+K, ...; the other parameters go one by one to the
    fragment with the fewest elements (ties: lowest index). K = 1: everything in parameter order."""
    if K == 1:
        return [list(model.parameters())]
    frags = [[] for _ in range(K)]
    in_blocks = set()
    for i, blk in enumerate(model.blocks):
        frags[i % K].extend(blk.parameters())
        in_blocks.update(id(q) for q in blk.parameters())
    sizes = [sum(q.numel() for q in f) for f in frags]
    for q in model.parameters():
        if id(q) not in in_blocks:
            p = min(range(K), key=lambda i: (sizes[i], i))
            frags[p].append(q)
            sizes[p] += q.numel()
    return frags


@dataclass(frozen=True)
class SimWire:
    """A quantized wire format (ops.quantize): name, block, and error feedback on or off."""

    fmt: str
    block: int
    error_feedback: bool = False


def quantized_mean(wire: SimWire, deltas: list, residuals: list | None = None) -> torch.Tensor:
    """The mean of the workers' payloads as the quantized all-reduce defines it (ops.quantize refs):
    each worker quantizes its payload e_m (+ its residual r_m, then r_m <- e_m − dequant, except in
    blocks with a non-finite scale); the M dequantized payloads are added in fp32 in worker order,
    × 1/M, requantized (nearest even) and dequantized into the payload's dtype."""
    from lowcomm_kernels.ops import dequantize_ref, quantize_ref, reduce_quantized_ref
    n, dtype = deltas[0].numel(), deltas[0].dtype
    codes, scales = [], []
    for m, d in enumerate(deltas):
        e = d + residuals[m] if residuals is not None else d
        c, s = quantize_ref(e, wire.fmt, wire.block)
        if residuals is not None:
            bad = ~torch.isfinite(s.repeat_interleave(wire.block)[:n])
            deq = dequantize_ref(c, s, wire.fmt, wire.block, n, out_dtype=dtype)
            residuals[m] = torch.where(bad, residuals[m], e - deq)
        codes.append(c)
        scales.append(s)
    rc, rs = reduce_quantized_ref(torch.stack(codes), torch.stack(scales), wire.fmt, wire.block, n,
                                  scale=1.0 / len(deltas))
    return dequantize_ref(rc, rs, wire.fmt, wire.block, n, out_dtype=dtype)


def outer_sgd(g, u, dbar, lr, mu):
    """Nesterov outer step: u ← μu + Δ̄; g ← g − η(Δ̄ + μu)."""
    u = mu * u + dbar
    return g - lr * (dbar + mu * u), u


def simulate_dense(method: str, M: int, T: int, *, H: int, K: int = 1, tau: int = 0, outer_lr=0.7,
                   wire: SimWire | None = None,
                   outer_mu=0.9, alpha=0.0, lam=0.5, lam_mode="normalized", N: int | None = None,
                   dtype=torch.float64, data_ranks=None, inject_nan=None, model_kw=None,
                   round_robin: bool = False, skip=None, outer_dtype=None) -> dict:
    """DiLoCo ('diloco', K=1, τ=0), Streaming DiLoCo ('streaming'), CoCoDC ('cocodc', l2_global,
    fixed N). Returns per-worker named params, the chosen fragment sequence, skipped syncs."""
    W = Workers(M, K, dtype, model_kw, data_ranks, skip, outer_dtype)
    g = [W.get(0, p) for p in range(K)]
    u = [torch.zeros_like(v) for v in g]
    res = [[torch.zeros_like(v) for v in g] for _ in range(M)]  # error feedback, per worker
    pending = []
    last_send, prev_send, scores = [-1] * K, [0] * K, [0.0] * K
    sends, skipped = [], []
    cursor = [0]  # round robin: next fragment of the cycle

    def apply(pd):
        p = pd["p"]
        dbar = pd["dbar"]
        if not torch.isfinite(dbar).all():  # every worker skips: g, u unchanged, x_p <- g_p
            skipped.append((p, pd["send"]))
            for r in res:  # every worker clears its residual of a skipped sync
                r[p] = torch.zeros_like(r[p])
            for m in range(M):
                W.put(m, p, g[p])
            return
        g[p], u[p] = outer_sgd(g[p], u[p], dbar, outer_lr, outer_mu)
        for m in range(M):
            x = W.get(m, p)
            if method == "cocodc":
                v = x - pd["xsent"][m]
                D = g[p] - pd["xsent"][m]
                corr = v * v * D
                lam_eff = lam
                if lam_mode == "normalized":
                    den = corr.norm()
                    lam_eff = 0.0 if den == 0 else lam * v.norm() / den
                W.put(m, p, g[p] + v - lam_eff * corr)
            else:
                W.put(m, p, alpha * x + (1 - alpha) * g[p])
        if method == "cocodc":
            scores[p] = float(dbar.norm()) / max(1, pd["send"] - pd["prev"])

    def send(p, t, reason):
        xs = [W.get(m, p) for m in range(M)]
        if wire is None:
            dbar = sum(g[p] - x for x in xs) / M
        else:
            mine = [r[p] for r in res] if wire.error_feedback else None
            dbar = quantized_mean(wire, [g[p] - x for x in xs], mine)
            for m in range(M if mine is not None else 0):
                res[m][p] = mine[m]
        pending.append({"p": p, "send": t, "apply": t + tau, "dbar": dbar, "xsent": xs,
                        "prev": max(last_send[p], 0)})
        prev_send[p] = max(last_send[p], 0)
        last_send[p] = t
        cursor[0] = (p + 1) % K
        sends.append((p, t, reason))

    def due(t):
        while pending and pending[0]["apply"] <= t:
            apply(pending.pop(0))

    for t in range(1, T + 1):
        for m in range(M):
            W.step(m, t)
            if inject_nan is not None and (m, t) == inject_nan:
                with torch.no_grad():
                    W.frag_params[m][0][0].view(-1)[0] = float("nan")
        due(t)
        if method == "diloco":
            if t % H == 0:
                send(0, t, "schedule")
        elif method == "streaming":
            for p in range(K):
                if t % H == (p * H) // K:
                    send(p, t, "schedule")
        elif method == "cocodc":
            s = (t - 1) % H + 1
            if (s * N) // H > ((s - 1) * N) // H:
                busy = {pd["p"] for pd in pending}
                free = [p for p in range(K) if p not in busy]
                stale = [p for p in free if last_send[p] >= 0 and t - last_send[p] >= H]
                never = [p for p in free if last_send[p] < 0]
                if stale:
                    send(min(stale, key=lambda p: (last_send[p], p)), t, "stale")
                elif round_robin and free:
                    order = [(cursor[0] + i) % K for i in range(K)]
                    send(next(p for p in order if p in free), t, "round_robin")
                elif never:
                    send(never[0], t, "never_sent")
                elif free:
                    best = max(scores[p] for p in free)
                    send(min(p for p in free if scores[p] == best), t, "score")
        due(t)
    return {"params": [W.named(m) for m in range(M)], "sends": sends, "skipped": skipped,
            "g": [v.clone() for v in g]}


def simulate_loscar(M: int, rounds: int, *, density: float, local_steps, overlap_steps, merge: str,
                    wire: SimWire | None = None,
                    seed: int, dtype=torch.float64, skip=None, outer_dtype=None) -> dict:
    """LOSCAR-SGD with per-worker N_i, Q_i; every worker runs `rounds` full rounds."""
    from lowcomm_kernels.ops import mask_indices_ref
    W = Workers(M, 1, dtype, skip=skip, outer_dtype=outer_dtype)
    d = W.get(0, 0).numel()
    k = max(1, math.ceil(density * d))
    steps = [0] * M
    masks = []
    for r in range(rounds):
        S = mask_indices_ref(seed, r, d, k)
        masks.append(S)
        ys = []
        for m in range(M):
            for _ in range(local_steps[m]):
                steps[m] += 1
                W.step(m, steps[m])
            ys.append(W.get(m, 0)[S].clone())
        mbar = sum(ys) / M if wire is None else quantized_mean(wire, ys)
        for m in range(M):
            for _ in range(overlap_steps[m]):
                steps[m] += 1
                W.step(m, steps[m])
            z = W.get(m, 0)
            if merge == "delay_corrected":
                z[S] = mbar + (z[S] - ys[m])
            else:
                z[S] = mbar
            W.put(m, 0, z)
    return {"params": [W.named(m) for m in range(M)], "masks": masks, "k": k, "d": d}
