"""A Hugging Face Llama trained with bf16 parameters against fp32, under the same lowcomm strategy.

    .venv/bin/python bench/hf_low_precision.py                      # DiLoCo, 200 steps, 2 ranks
    .venv/bin/python bench/hf_low_precision.py --method streaming --steps 300

Runs ``python/hf_trainer.py`` (``transformers.Trainer`` + ``LowCommCallback``, a small random
``LlamaForCausalLM`` over the package's byte-level corpus, nothing downloaded) twice under
``torchrun --nproc_per_node 2`` on gloo: once with fp32 parameters and once with the model cast to
bf16 (the strategy then keeps its outer state g, u in fp32 and merges into bf16 with
round-to-nearest-even; the inner AdamW works on the bf16 parameters as it would without lowcomm).
Same seed, data, schedule and learning rate. Writes ``hf_bf16_vs_fp32.png`` (validation and
training loss against optimizer steps) and ``hf_bf16_vs_fp32.json`` (both runs' Trainer log
histories) into ``--out``, and prints a Markdown table of the validation losses.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DTYPES = ("fp32", "bf16")


def run(dtype: str, a: argparse.Namespace, work: Path) -> dict:
    log = work / f"{dtype}.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc_per_node",
        "2",
        str(ROOT / "python" / "hf_trainer.py"),
        "--method",
        a.method,
        "--steps",
        str(a.steps),
        "--sync-every",
        str(a.sync_every),
        "--eval-every",
        str(a.eval_every),
        "--param-dtype",
        dtype,
        "--out",
        str(work / f"trainer-{dtype}"),
        "--log-json",
        str(log),
    ]
    print(f"[{dtype}] {' '.join(cmd[3:])}", flush=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=a.timeout_s)
    if done.returncode != 0:
        sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        raise SystemExit(f"the {dtype} run failed (exit {done.returncode})")
    print(next(line for line in done.stdout.splitlines() if line.startswith("done:")), flush=True)
    return json.loads(log.read_text())


def curves(result: dict, key: str) -> tuple[list[int], list[float]]:
    points = {e["step"]: e[key] for e in result["log"] if key in e}  # the final evaluate repeats a step
    return list(points), list(points.values())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--method", choices=("diloco", "streaming", "cocodc", "loscar"), default="diloco")
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--sync-every", type=int, default=20)
    p.add_argument("--eval-every", type=int, default=20)
    p.add_argument("--out", default=str(ROOT / "bench" / "figures"))
    p.add_argument("--timeout-s", type=float, default=1800)
    a = p.parse_args(argv)
    out = Path(a.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:  # the Trainer's output_dir and the runs' logs
        results = {dtype: run(dtype, a, Path(tmp)) for dtype in DTYPES}

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(10, 3.8))
    for dtype, style in zip(DTYPES, ("-", "--"), strict=True):
        for ax, key in zip(axes, ("eval_loss", "loss"), strict=True):
            steps, values = curves(results[dtype], key)
            ax.plot(steps, values, style, marker="o", ms=3, label=f"{dtype} parameters")
    for ax, title in zip(
        axes, ("validation loss", "training loss (Trainer log, mean over ranks)"), strict=True
    ):
        ax.set_xlabel("optimizer step")
        ax.set_title(title)
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(f"HF LlamaForCausalLM, {a.method}, H={a.sync_every}, 2 ranks (gloo)")
    fig.tight_layout()
    fig.savefig(out / "hf_bf16_vs_fp32.png", dpi=110)
    (out / "hf_bf16_vs_fp32.json").write_text(json.dumps({"args": vars(a), "runs": results}, indent=1))

    print("\n| step | val loss fp32 | val loss bf16 |\n|---|---|---|")
    s32, v32 = curves(results["fp32"], "eval_loss")
    s16, v16 = curves(results["bf16"], "eval_loss")
    for s, x, y in zip(s32, v32, v16, strict=True):
        print(f"| {s} | {x:.4f} | {y:.4f} |")
    print(f"\nwrote {out / 'hf_bf16_vs_fp32.png'} and {out / 'hf_bf16_vs_fp32.json'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
