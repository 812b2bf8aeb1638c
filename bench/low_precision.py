"""bf16 parameters with a float32 outer master: the memory it costs, and what it does to the loss.

    .venv/bin/python bench/low_precision.py memory          # bytes per parameter, measured
    .venv/bin/python bench/low_precision.py loss            # TinyLlama, Streaming DiLoCo, 2 ranks

``memory`` wraps the project's TinyLlama (``lowcomm_kernels/train/model.py``, default shape) in
fp32 and in bf16 with each strategy on one gloo rank, trains it for two sync periods on random
bytes, and prints ``strategy.memory_per_param()`` (measured from the buffers the strategy holds)
at its peak over the steps, beside the inner AdamW state (measured from ``optimizer.state``).

``loss`` trains the same model on 2 gloo ranks, Streaming DiLoCo, on the default byte-level corpus
(the Python standard library's source), with fp32 parameters and with bf16 parameters (fp32 master
g, u), identical seeds, data and schedule; every ``--eval-every`` steps it prints the training loss
(mean of the last steps, rank 0) and the validation loss of each rank's parameters (evaluated in
float32, so the comparison is of the parameters, not of bf16 arithmetic in the evaluation).

With no part named, both run. Each part writes its section of ``--out`` (default
bench/figures/low_precision.json, the other section kept) with its own provenance (revision as the
command found the checkout, load, CPU time, wall-clock, command), and prints its table.
``--render [PATH]`` runs nothing and prints both tables of a results file as docs/results.md shows
them (tests/test_bench_renders.py checks that the docs quote them verbatim):

    .venv/bin/python bench/low_precision.py --render
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import torch

if __package__ in (None, ""):  # run as a script: make the repository importable
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import lowcomm_kernels.runtime as rt  # noqa: E402
from lowcomm_kernels.runtime.launch import spawn_local  # noqa: E402
from lowcomm_kernels.train import provenance  # noqa: E402
from lowcomm_kernels.train.corpus import eval_batches, load_corpus, sample_batch, worker_shard  # noqa: E402
from lowcomm_kernels.train.model import ModelConfig, TinyLlama  # noqa: E402

HERE = os.path.abspath(__file__)
ROOT = Path(HERE).parent.parent
LABEL = "bench/figures/low_precision.json"
PROG = ".venv/bin/python bench/low_precision.py"
PARTS = ("memory", "loss")
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
H = 20  # sync period of the memory runs
STRATEGIES: dict[str, tuple[type, dict[str, Any]]] = {
    "DiLoCo": (rt.DiLoCo, {"sync_every": H}),
    "Streaming DiLoCo (K=4, tau=2)": (
        rt.StreamingDiLoCo,
        {"sync_every": H, "num_fragments": 4, "fragment_sync_delay": 2},
    ),
    "Streaming DiLoCo, bf16 wire": (
        rt.StreamingDiLoCo,
        {"sync_every": H, "num_fragments": 4, "fragment_sync_delay": 2, "wire_dtype": torch.bfloat16},
    ),
    "CoCoDC (K=4, tau=2)": (
        rt.CoCoDC,
        {"sync_every": H, "num_fragments": 4, "fragment_sync_delay": 2, "syncs_per_period": 4},
    ),
    "LOSCAR (density 0.1)": (rt.LOSCAR, {"density": 0.1, "local_steps": H // 2, "overlap_steps": 2}),
}


def _adamw(model: torch.nn.Module, lr: float) -> torch.optim.Optimizer:
    return torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.1)


def _state_bytes(opt: torch.optim.Optimizer) -> int:
    """Bytes of the inner optimizer's per-parameter tensors (each storage once)."""
    seen: dict[int, int] = {}
    for st in opt.state.values():
        for v in st.values():
            if isinstance(v, torch.Tensor) and v.numel() > 1:
                seen[v.untyped_storage().data_ptr()] = v.untyped_storage().nbytes()
    return sum(seen.values())


def memory_rank(rank: int, world: int, dtype: str, name: str) -> dict[str, float]:
    """One strategy on one rank: the peak of each memory_per_param() field over 2 sync periods."""
    torch.manual_seed(0)
    model = TinyLlama(ModelConfig()).to(DTYPES[dtype])
    opt = _adamw(model, 1e-3)
    cls, kw = STRATEGIES[name]
    st = cls(model, opt, **kw)
    gen = torch.Generator().manual_seed(rank)
    peak: dict[str, float] = {}
    n = st.frags.numel
    for _ in range(2 * H):
        x = torch.randint(0, 256, (4, 33), generator=gen)
        model.loss(x[:, :-1], x[:, 1:]).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        st.step()
        for k, v in st.memory_per_param().items():
            peak[k] = max(peak.get(k, 0.0), v)
    peak["adamw_state"] = _state_bytes(opt) / n
    peak["numel"] = n
    return peak


def memory_run() -> dict:
    """Every (model dtype, strategy) on one rank: the peaks of memory_per_param() and AdamW's state."""
    rows = []
    for dtype in DTYPES:
        for name in STRATEGIES:
            m = spawn_local(f"{HERE}:memory_rank", 1, (dtype, name), timeout_s=300)[0]
            rows.append({"dtype": dtype, "strategy": name, **m})
    cfg = ModelConfig()
    return {
        "config": {"dim": cfg.dim, "n_layers": cfg.n_layers, "sync_every": H, "steps": 2 * H},
        "rows": rows,
    }


def memory_markdown(part: dict) -> str:
    c = part["config"]
    lines = [
        f"TinyLlama (dim {c['dim']}, {c['n_layers']} layers, {int(part['rows'][0]['numel']):,} parameters), "
        f"bytes per parameter, peak over {c['steps']} steps (H = {c['sync_every']}), one rank:",
        "",
        "| model params | strategy | params B/param | outer state (g, u) | in flight, peak | "
        "kept for later sends, peak | extra over plain training, peak | inner AdamW state |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for m in part["rows"]:
        lines.append(
            f"| {m['dtype']} | {m['strategy']} | {m['params']:.2f} | {m['outer_state']:.2f} | "
            f"{m['in_flight']:.2f} | {m['spare']:.2f} | {m['extra']:.2f} | {m['adamw_state']:.2f} |"
        )
    return "\n".join(lines)


def loss_rank(rank: int, world: int, dtype: str, steps: int, eval_every: int, seed: int) -> list[dict]:
    """Streaming DiLoCo on the byte corpus; rank 0's mean training loss and every rank's val loss."""
    import torch.distributed as dist

    cfg = ModelConfig()
    corpus = load_corpus(None)
    shard = worker_shard(corpus.train, rank, world)
    batches = eval_batches(corpus.val, 8, 8, cfg.seq_len)
    torch.manual_seed(seed)
    model = TinyLlama(cfg).to(DTYPES[dtype])
    torch.manual_seed(seed)
    evaluator = TinyLlama(cfg)  # float32: evaluates the parameters, not bf16 arithmetic
    lr, warmup = 3e-3, 30
    opt = _adamw(model, lr)
    sched = torch.optim.lr_scheduler.LambdaLR(
        opt,
        lambda s: (
            (s + 1) / warmup
            if s < warmup
            else 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(1.0, (s - warmup) / max(1, steps - warmup))))
        ),
    )
    st = rt.StreamingDiLoCo(model, opt, sync_every=50, num_fragments=2, fragment_sync_delay=5)
    gen = torch.Generator().manual_seed(seed * 1_000_003 + rank)
    out, window = [], []
    with st:
        for step in range(1, steps + 1):
            x, y = sample_batch(shard, 8, cfg.seq_len, gen)
            loss = model.loss(x, y)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            sched.step()
            window.append(float(loss.detach()))
            if step % eval_every == 0 or step == steps:
                with torch.no_grad():
                    for p, q in zip(evaluator.parameters(), model.parameters(), strict=True):
                        p.copy_(q)
                    val = sum(float(evaluator.loss(bx, by)) for bx, by in batches) / len(batches)
                vals = [None] * world
                dist.all_gather_object(vals, val)
                out.append({"step": step, "train": sum(window) / len(window), "val": vals})
                window = []
    return out


def loss_run(steps: int, eval_every: int, seed: int) -> dict:
    """fp32 then bf16 parameters, 2 ranks each: every eval step's training and validation losses."""
    per = {
        d: spawn_local(f"{HERE}:loss_rank", 2, (d, steps, eval_every, seed), timeout_s=3600)[0]
        for d in DTYPES
    }
    return {"config": {"steps": steps, "eval_every": eval_every, "seed": seed}, "rows": per}


def loss_markdown(part: dict) -> str:
    c = part["config"]
    lines = [
        f"{c['steps']} steps, seed {c['seed']}, every {c['eval_every']} steps: training loss (rank 0, "
        "mean since the last row) and validation loss of each rank's parameters:",
        "",
        "| step | fp32 train | fp32 val (rank 0 / 1) | bf16 train | bf16 val (rank 0 / 1) |",
        "| --- | --- | --- | --- | --- |",
    ]
    for a, b in zip(part["rows"]["fp32"], part["rows"]["bf16"], strict=True):
        lines.append(
            f"| {a['step']} | {a['train']:.3f} | {a['val'][0]:.3f} / {a['val'][1]:.3f} | "
            f"{b['train']:.3f} | {b['val'][0]:.3f} / {b['val'][1]:.3f} |"
        )
    return "\n".join(lines)


def source_line(part: dict) -> str:
    """Where a part's figures come from, as ``lowcomm report`` writes it under its tables."""
    from lowcomm_kernels.train import render

    return render.provenance_line(render.Source(LABEL, Path(LABEL), "low_precision", part))


def render_parts(result: dict) -> dict[str, str]:
    """Each part's table and source line (markdown), as docs/results.md shows them."""
    make = {"memory": memory_markdown, "loss": loss_markdown}
    return {k: make[k](result[k]) + "\n\n" + source_line(result[k]) for k in PARTS if k in result}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("parts", nargs="*", metavar="PART", help="memory, loss or both (default: both)")
    ap.add_argument("--steps", type=int, default=600, help="loss: steps per run (default 600)")
    ap.add_argument("--eval-every", type=int, default=100, help="loss: steps between rows (default 100)")
    ap.add_argument("--seed", type=int, default=0, help="loss: seed (default 0)")
    provenance.results_file_flags(ap, ROOT / LABEL, "the tables")
    args = ap.parse_args(argv)
    if args.render is not None:
        print("\n\n".join(render_parts(json.loads(args.render.read_text())).values()))
        return
    bad = [x for x in args.parts if x not in PARTS]
    if bad:
        ap.error(f"unknown part(s) {bad}; choose from {', '.join(PARTS)}")
    if args.steps < 1 or args.eval_every < 1:
        ap.error("--steps and --eval-every must be >= 1")
    parts = args.parts or list(PARTS)
    argv = sys.argv[1:] if argv is None else argv
    git = provenance.git_info(ROOT)  # the checkout as the command found it, before the file is written
    result = json.loads(args.out.read_text()) if args.out.exists() else {}
    for what in PARTS:
        if what not in parts:
            continue
        started = provenance.start(argv, prog=PROG)  # each part: its own load, CPU time and wall-clock
        part = memory_run() if what == "memory" else loss_run(args.steps, args.eval_every, args.seed)
        part["provenance"] = {**provenance.collect(started, repo=ROOT), "git": git}
        result[what] = part
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(render_parts(result)[what] + "\n", flush=True)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
