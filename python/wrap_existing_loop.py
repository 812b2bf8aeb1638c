"""Drop Streaming DiLoCo into a plain PyTorch training loop of an existing model class.

The loop below is an ordinary one (forward, backward, ``optimizer.step()``, ``zero_grad()``); the
only change is ``with strategy:`` around it. The model is Hugging Face's ``LlamaForCausalLM`` built
from a small config when ``transformers`` is installed; otherwise (transformers is not a
dependency) the package's own tiny LLaMA-style model, and the Hugging Face part is skipped with a
message. Runs ``--workers`` gloo processes on this machine (the package's launcher), each with an
emulated WAN.

    python python/wrap_existing_loop.py --workers 2 --steps 30
    python python/wrap_existing_loop.py --model hf   # needs transformers: pip install 'lowcomm-kernels[hf]'
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

from lowcomm_kernels.runtime.launch import launch

SEQ, VOCAB = 32, 256


def hf_available() -> bool:
    try:
        import transformers  # noqa: F401
    except ImportError:
        return False
    return True


def build_model(kind: str) -> torch.nn.Module:
    """An existing model class, untouched: HF LlamaForCausalLM or the package's TinyLlama."""
    if kind == "hf":
        from transformers import LlamaConfig, LlamaForCausalLM

        cfg = LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=64,
            intermediate_size=172,
            num_hidden_layers=4,
            num_attention_heads=4,
            num_key_value_heads=4,
            max_position_embeddings=SEQ,
        )
        return LlamaForCausalLM(cfg)
    from lowcomm_kernels.train.model import ModelConfig, TinyLlama

    return TinyLlama(ModelConfig(dim=64, n_layers=4, n_heads=4, seq_len=SEQ))


def loss_of(model: torch.nn.Module, kind: str, x: torch.Tensor) -> torch.Tensor:
    if kind == "hf":
        return model(input_ids=x, labels=x).loss  # HF shifts labels itself
    return model.loss(x[:, :-1], x[:, 1:])


def worker(rank: int, world: int, kind: str, steps: int) -> tuple | None:
    # launch() started this process and joined the gloo group, as torchrun + init_process_group() would.
    from lowcomm_kernels import WAN, StreamingDiLoCo

    torch.manual_seed(0)
    model = build_model(kind)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    # ---- the one addition to the user's code ----
    strategy = StreamingDiLoCo(
        model,
        optimizer,
        sync_every=10,
        num_fragments=2,
        fragment_sync_delay=2,
        wan=WAN(latency_s=0.02, bandwidth_bytes_per_s=125e6),
    )
    # A learnable toy stream: bytes of a repeated sentence, different offsets per rank.
    text = torch.tensor(list(b"the quick brown fox jumps over the lazy dog. " * 200), dtype=torch.long)
    gen = torch.Generator().manual_seed(rank)
    losses = []
    with strategy:
        for _ in range(steps):
            starts = torch.randint(0, text.numel() - SEQ - 1, (8,), generator=gen)
            x = torch.stack([text[s : s + SEQ] for s in starts])
            loss = loss_of(model, kind, x)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            losses.append(loss.item())
    m = strategy.metrics
    return (losses[0], losses[-1], m.num_syncs, m.bytes_sent, m.exposed_comm_s) if rank == 0 else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--model", choices=("auto", "hf", "tiny"), default="auto")
    a = p.parse_args(argv)
    kind = a.model
    if kind in ("auto", "hf") and not hf_available():
        print(
            "transformers is not installed: skipping the Hugging Face LlamaForCausalLM part; "
            "using lowcomm's TinyLlama instead",
            file=sys.stderr,
        )
        if kind == "hf":
            return 0
        kind = "tiny"
    elif kind == "auto":
        kind = "hf"
    first, last, syncs, nbytes, exposed = launch(worker, a.workers, (kind, a.steps))[0]
    print(
        f"model={kind} workers={a.workers} steps={a.steps}: loss {first:.3f} -> {last:.3f}, "
        f"{syncs} fragment syncs, {nbytes / 1e6:.2f} MB sent per worker, exposed comm {exposed:.2f} s"
    )
    return 0


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    sys.exit(main())
