"""Train a Hugging Face model with ``transformers.Trainer`` under a lowcomm strategy: one callback.

The model is a small random ``LlamaForCausalLM`` over bytes (nothing is downloaded); the data is
the package's built-in byte-level corpus (the Python standard library's source). Each rank trains
its own replica on its own shard (the Trainer shards the data loader) and the strategy
synchronises the replicas; ``sync_every`` and the other schedule knobs count optimizer steps.

    pip install 'lowcomm-kernels[hf]'
    torchrun --standalone --nproc_per_node 2 python/hf_trainer.py --method diloco --steps 60
    torchrun --standalone --nproc_per_node 2 python/hf_trainer.py --method streaming --grad-accum 2

On CPUs the ranks talk over gloo; the emulated WAN (``--latency-ms``/``--bandwidth-mbps``) is for
single-machine experiments (0: off).
"""

from __future__ import annotations

import argparse
import os
import sys

import torch
import torch.distributed as dist

SEQ = 64


def strategy_kwargs(a: argparse.Namespace) -> dict:
    import lowcomm_kernels as lk

    wan = lk.WAN(a.latency_ms / 1e3, a.bandwidth_mbps * 1e6 / 8) if a.latency_ms > 0 else None
    if a.method == "diloco":
        return {"sync_every": a.sync_every, "wan": wan}
    if a.method in ("streaming", "cocodc"):
        return {"sync_every": a.sync_every, "num_fragments": 2, "fragment_sync_delay": a.delay, "wan": wan}
    return {
        "density": 0.25,
        "local_steps": max(1, a.sync_every - a.delay),
        "overlap_steps": a.delay,
        "wan": wan,
    }


class Windows(torch.utils.data.Dataset):
    """``n`` fixed windows of ``SEQ`` bytes (window i starts at a position drawn once from seed 0)."""

    def __init__(self, data: torch.Tensor, n: int) -> None:
        gen = torch.Generator().manual_seed(0)
        self.data = data
        self.starts = torch.randint(0, data.numel() - SEQ, (n,), generator=gen)

    def __len__(self) -> int:
        return len(self.starts)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = self.data[self.starts[i] : self.starts[i] + SEQ].long()
        return {"input_ids": x, "labels": x}  # LlamaForCausalLM shifts the labels itself


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Hugging Face Trainer + a lowcomm strategy under torchrun")
    p.add_argument("--method", choices=("diloco", "streaming", "cocodc", "loscar"), default="diloco")
    p.add_argument("--steps", type=int, default=60, help="optimizer steps (max_steps)")
    p.add_argument("--sync-every", type=int, default=10)
    p.add_argument("--delay", type=int, default=1, help="fragment_sync_delay / LOSCAR overlap_steps")
    p.add_argument("--grad-accum", type=int, default=1, help="gradient_accumulation_steps")
    p.add_argument("--batch-size", type=int, default=8, help="per-device batch size")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--latency-ms", type=float, default=0.0, help="emulated WAN latency (0: no emulation)")
    p.add_argument("--bandwidth-mbps", type=float, default=100.0)
    p.add_argument("--out", default="hf_trainer_out", help="Trainer output_dir (checkpoints)")
    p.add_argument("--save-steps", type=int, default=0, help="checkpoint every N steps (0: never)")
    p.add_argument("--param-dtype", choices=("fp32", "bf16"), default="fp32", help="the model's parameters")
    p.add_argument("--eval-every", type=int, default=0, help="validation every N steps (0: only at the ends)")
    p.add_argument("--log-json", help="rank 0 writes the Trainer's log history (losses by step) here")
    a = p.parse_args(argv)
    if "RANK" not in os.environ:
        print("error: run me under torchrun (RANK/WORLD_SIZE are not set)", file=sys.stderr)
        return 2
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # a config-built model: nothing to download
    torch.set_num_threads(1)

    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    from lowcomm_kernels.integrations.huggingface import LowCommCallback
    from lowcomm_kernels.train.corpus import load_corpus

    corpus = load_corpus(None, max_train_bytes=1_000_000, max_val_bytes=100_000)
    # one epoch = max_steps: every rank draws batch-size x grad-accum windows per optimizer step
    world = int(os.environ["WORLD_SIZE"])
    train = Windows(corpus.train, a.batch_size * a.grad_accum * max(1, a.steps) * world)
    val = Windows(corpus.val, 64)
    torch.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=SEQ,
    )
    model = LlamaForCausalLM(cfg).to({"fp32": torch.float32, "bf16": torch.bfloat16}[a.param_dtype])
    cuda = torch.cuda.is_available()
    args = TrainingArguments(
        output_dir=a.out,
        max_steps=a.steps,
        per_device_train_batch_size=a.batch_size,
        per_device_eval_batch_size=16,
        gradient_accumulation_steps=a.grad_accum,
        learning_rate=a.lr,
        use_cpu=not cuda,
        ddp_backend="nccl" if cuda else "gloo",
        logging_steps=max(1, a.steps // 5),
        eval_strategy="steps" if a.eval_every else "no",
        eval_steps=a.eval_every or None,
        save_strategy="steps" if a.save_steps else "no",
        save_steps=a.save_steps or 500,
        report_to=[],
        disable_tqdm=True,
    )
    # ---- the one addition: a lowcomm strategy instead of DDP ----
    callback = LowCommCallback(a.method, **strategy_kwargs(a))
    trainer = Trainer(model=model, args=args, train_dataset=train, eval_dataset=val, callbacks=[callback])
    before = trainer.evaluate()["eval_loss"]
    trainer.train()
    after = trainer.evaluate()["eval_loss"]  # the mean over ranks of each replica's validation loss
    strategy = callback.strategy
    assert strategy is not None
    m = strategy.metrics
    if int(os.environ["RANK"]) == 0:
        print(
            f"done: {a.method} on {strategy.world} ranks, {strategy.step_count} optimizer steps, "
            f"{m.num_syncs} syncs, {m.bytes_sent / 1e6:.2f} MB sent per worker, "
            f"exposed comm {m.exposed_comm_s:.2f} s; val loss {before:.3f} -> {after:.3f}",
            flush=True,
        )
        if a.log_json:
            import json

            with open(a.log_json, "w") as f:
                json.dump(
                    {"args": vars(a), "before": before, "after": after, "log": trainer.state.log_history}, f
                )
    # the Trainer made the process group and never destroys it: a gloo group left to interpreter
    # shutdown can abort the process ("terminate called without an active exception") after all went well
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
