"""The tiny LLaMA-style model: shapes, causality, rotary embeddings, size."""

from __future__ import annotations

import pytest
import torch

from lowcomm_kernels.train.model import (
    ModelConfig,
    RMSNorm,
    TinyLlama,
    apply_rotary,
    num_parameters,
    parameter_count,
    rotary_tables,
)


def test_default_size_is_a_few_hundred_thousand_parameters():
    n = num_parameters(TinyLlama(ModelConfig()))
    assert 100_000 < n < 1_000_000


@pytest.mark.parametrize("cfg", [ModelConfig(), ModelConfig(dim=32, n_layers=2, n_heads=2, mlp_hidden=7)])
def test_parameter_count_is_the_built_models(cfg):
    assert parameter_count(cfg) == num_parameters(TinyLlama(cfg))


def test_forward_shape_and_causality():
    torch.manual_seed(0)
    m = TinyLlama(ModelConfig(dim=32, n_layers=2, n_heads=2, mlp_hidden=64, seq_len=16))
    x = torch.randint(0, 256, (2, 16))
    logits = m(x)
    assert logits.shape == (2, 16, 256) and logits.dtype == torch.float32
    x2 = x.clone()
    x2[:, 10] = (x2[:, 10] + 1) % 256  # change a later byte: earlier positions must not see it
    logits2 = m(x2)
    torch.testing.assert_close(logits[:, :10], logits2[:, :10])
    assert not torch.allclose(logits[:, 10:], logits2[:, 10:])


def test_rotary_is_a_rotation_and_relative():
    cos, sin = rotary_tables(8, 4, 10000.0)
    q = torch.randn(1, 1, 8, 4, dtype=torch.float32)
    rq = apply_rotary(q, cos, sin)
    torch.testing.assert_close(rq.norm(dim=-1), q.norm(dim=-1))
    # <R_s q, R_t k> depends only on t - s: same vectors at every position
    k = torch.randn(4)
    qs, ks = q[0, 0, 0].expand(1, 1, 8, 4), k.expand(1, 1, 8, 4)
    rqs, rks = apply_rotary(qs, cos, sin)[0, 0], apply_rotary(ks, cos, sin)[0, 0]
    torch.testing.assert_close(rqs[1] @ rks[3], rqs[4] @ rks[6], rtol=1e-5, atol=1e-5)


def test_rmsnorm_normalises():
    x = torch.randn(3, 16) * 7
    y = RMSNorm(16)(x)
    torch.testing.assert_close(y.pow(2).mean(-1), torch.ones(3), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kw", [dict(dim=30), dict(n_heads=3), dict(seq_len=0)])
def test_bad_config_names_the_field(kw):
    with pytest.raises(ValueError, match="ModelConfig"):
        ModelConfig(**kw)


def test_loss_decreases_when_overfitting_one_batch():
    torch.manual_seed(0)
    m = TinyLlama(ModelConfig(dim=32, n_layers=2, n_heads=2, mlp_hidden=64, seq_len=16))
    opt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    x = torch.randint(0, 256, (4, 17))
    first = None
    for _ in range(30):
        loss = m.loss(x[:, :-1], x[:, 1:])
        first = first if first is not None else float(loss)
        loss.backward()
        opt.step()
        opt.zero_grad()
    assert float(loss) < 0.5 * first
