"""A tiny byte-level LLaMA-style language model for the CLI's experiments.

The architecture follows LLaMA at toy scale: pre-norm blocks with RMSNorm, causal self-attention
with rotary position embeddings (RoPE) and a SwiGLU MLP, untied embedding and output head.
Vocabulary is the 256 byte values, so no tokenizer is needed. Defaults give ~0.2M parameters,
small enough that four workers train it on two CPU cores in about a minute per method.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .errors import SpecError

VOCAB_SIZE = 256  # byte-level


@dataclass(frozen=True)
class ModelConfig:
    """Shape of :class:`TinyLlama`. ``dim`` must be divisible by ``n_heads`` with an even head size."""

    dim: int = 64
    n_layers: int = 4
    n_heads: int = 4
    mlp_hidden: int = 172  # ~ 8/3 * dim, as LLaMA's SwiGLU sizing
    seq_len: int = 64
    rope_base: float = 10000.0

    def __post_init__(self) -> None:
        """Raise :class:`SpecError` naming the bad field as ``<ModelConfig.field>``."""
        for name in ("dim", "n_layers", "n_heads", "mlp_hidden", "seq_len"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise SpecError(f"<ModelConfig.{name}> must be a positive int, got {value!r}")
        if self.dim % self.n_heads != 0 or (self.dim // self.n_heads) % 2 != 0:
            raise SpecError(
                f"<ModelConfig.dim> ({self.dim}) must be divisible by <ModelConfig.n_heads> "
                f"({self.n_heads}) with an even head size (rotary embeddings rotate pairs)"
            )

    def to_dict(self) -> dict:
        return asdict(self)


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight over the last dimension (Zhang & Sennrich 2019)."""

    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotary_tables(seq_len: int, head_dim: int, base: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin tables of shape (seq_len, head_dim // 2): angle[t, i] = t * base^(-2i / head_dim)."""
    inv_freq = base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate consecutive pairs (x[2i], x[2i+1]) of x (B, H, T, D) by the angle of position t."""
    x1, x2 = x[..., 0::2], x[..., 1::2]
    out = torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1)
    return out.flatten(-2)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.n_heads = cfg.n_heads
        self.head_dim = cfg.dim // cfg.n_heads
        self.wqkv = nn.Linear(cfg.dim, 3 * cfg.dim, bias=False)
        self.wo = nn.Linear(cfg.dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.wqkv(x).view(b, t, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        # q and k rotated in one call: the same elementwise arithmetic in half the ops, which are what a
        # small model's step costs
        q, k = apply_rotary(qkv[:2], cos[:t], sin[:t]).unbind(0)
        v = qkv[2]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, d))


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x) (Shazeer 2020), LLaMA's MLP."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.mlp_hidden, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.mlp_hidden, bias=False)
        self.w2 = nn.Linear(cfg.mlp_hidden, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.attn_norm = RMSNorm(cfg.dim)
        self.attn = Attention(cfg)
        self.mlp_norm = RMSNorm(cfg.dim)
        self.mlp = SwiGLU(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.mlp(self.mlp_norm(x))


class TinyLlama(nn.Module):
    """Byte-level causal LM. forward(idx (B, T) int64 in [0, 256)) -> logits (B, T, 256) float32.

    ``self.blocks`` is an ``nn.ModuleList`` so the runtime's default layer-strided fragmenting
    (Streaming DiLoCo) finds one unit per transformer block.
    """

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Embedding(VOCAB_SIZE, cfg.dim)
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.norm = RMSNorm(cfg.dim)
        self.head = nn.Linear(cfg.dim, VOCAB_SIZE, bias=False)
        cos, sin = rotary_tables(cfg.seq_len, cfg.dim // cfg.n_heads, cfg.rope_base)
        # Buffers, not parameters: they never travel over the wire and are not trained.
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.apply(self._init_weights)
        # GPT-2 style scaled init of the residual projections keeps the residual stream's
        # variance independent of depth.
        for block in self.blocks:
            assert isinstance(block, Block)
            for w in (block.attn.wo.weight, block.mlp.w2.weight):
                nn.init.normal_(w, std=0.02 / math.sqrt(2 * cfg.n_layers))

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, (nn.Linear, nn.Embedding)):
            nn.init.normal_(module.weight, std=0.02)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        if idx.dim() != 2:
            raise ValueError(f"idx must have shape (B, T), got {tuple(idx.shape)}")
        if idx.shape[1] > self.cfg.seq_len:
            raise ValueError(f"idx has T={idx.shape[1]} > seq_len={self.cfg.seq_len}")
        x = self.embed(idx)
        for block in self.blocks:
            x = block(x, self.rope_cos, self.rope_sin)
        return self.head(self.norm(x))

    def loss(self, idx: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        """Mean next-byte cross-entropy in nats; idx, targets (B, T) int64."""
        logits = self(idx)
        return F.cross_entropy(logits.reshape(-1, VOCAB_SIZE), targets.reshape(-1))


def num_parameters(model: nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


def parameter_count(cfg: ModelConfig) -> int:
    """``num_parameters(TinyLlama(cfg))`` without building it (a spec's checks run in every process
    that makes one): embedding and head, and per block two norms, qkv + output and SwiGLU's three
    matrices; tests/train/test_model.py holds it to the built model."""
    d, h = cfg.dim, cfg.mlp_hidden
    return 2 * VOCAB_SIZE * d + d + cfg.n_layers * (2 * d + 4 * d * d + 3 * d * h)
