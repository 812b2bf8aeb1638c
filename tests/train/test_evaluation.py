"""The harness's evaluation on 2 gloo ranks: each worker's own model and the worker-averaged model,
checked against a direct float64 computation of the same losses on the same validation bytes."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from lowcomm_kernels.runtime.launch import launch
from lowcomm_kernels.train.corpus import eval_set
from lowcomm_kernels.train.model import ModelConfig, TinyLlama

CFG = ModelConfig(dim=16, n_layers=1, n_heads=2, mlp_hidden=24, seq_len=8)
TEXT = torch.randint(0, 256, (1000,), generator=torch.Generator().manual_seed(7), dtype=torch.int64).to(
    torch.uint8
)
EVAL_BYTES = 8 * 61  # 61 windows: an odd count, so the ranks' shares of the averaged model differ


def _model(seed: int, cfg: ModelConfig = CFG) -> TinyLlama:
    """A model far from the near-uniform initial one (weights x 10), so models differ in loss."""
    torch.manual_seed(seed)
    model = TinyLlama(cfg)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(10.0)
    return model


#: the same parameter shapes as CFG (so the same bytes from the same seed), another function
CFG_4_HEADS = ModelConfig(dim=16, n_layers=1, n_heads=4, mlp_hidden=24, seq_len=8)


def _rank_body(rank: int, world: int, cases: list[tuple[list[int], int]]) -> list[dict]:
    """Evaluate, for each case (seeds, n_heads), rank r's model made from seed seeds[r]."""
    import dataclasses

    import torch.distributed as dist

    from lowcomm_kernels.train import worker
    from lowcomm_kernels.train.worker import evaluate

    group = dist.new_group(backend="gloo")
    out = []
    for seeds, n_heads in cases:
        cfg = dataclasses.replace(CFG, n_heads=n_heads)
        windows = eval_set(TEXT, CFG.seq_len, EVAL_BYTES)
        res = evaluate(_model(seeds[rank], cfg), TinyLlama(cfg), windows, group, rank, world)
        out.append(
            {
                "workers": res.workers,
                "avg_model": res.avg_model,
                "agree": res.agree,
                "scored_models": len(worker._AGREED_LOSSES),
            }
        )
    dist.destroy_process_group(group)
    return out


@pytest.fixture(scope="module")
def two_ranks() -> list[dict]:
    """Case 0: the ranks hold different models (seeds 3, 11); cases 1 and 2: the same one (seed 5);
    case 3: seed 5's parameters read with 4 heads instead of 2."""
    cases = [([3, 11], 2), ([5, 5], 2), ([5, 5], 2), ([5, 5], 4)]
    results = launch(f"{__file__}:_rank_body", 2, (cases,), timeout_s=300)
    assert results[0] == results[1]  # every rank returns the same numbers
    return results[0]


def _direct_loss(params: torch.Tensor, cfg: ModelConfig = CFG) -> float:
    """Mean next-byte cross-entropy of ``params`` (flat, float64) over 61 windows of 8 targets spread
    evenly over the text: window i starts at floor(i (L - 1 - T) / 60)."""
    model = TinyLlama(cfg).double()
    torch.nn.utils.vector_to_parameters(params, model.parameters())
    n, T = EVAL_BYTES // CFG.seq_len, CFG.seq_len
    text = TEXT.long()
    starts = [i * (TEXT.numel() - 1 - T) // (n - 1) for i in range(n)]
    x = torch.stack([text[s : s + T] for s in starts])
    y = torch.stack([text[s + 1 : s + T + 1] for s in starts])
    with torch.no_grad():
        logits = model(x)
    return float(F.cross_entropy(logits.reshape(-1, 256), y.reshape(-1)))


def _flat64(model: TinyLlama) -> torch.Tensor:
    return torch.nn.utils.parameters_to_vector(model.parameters()).detach().double()


def test_own_and_averaged_losses_equal_a_float64_computation_on_two_ranks(two_ranks):
    got = two_ranks[0]
    p0, p1 = _flat64(_model(3)), _flat64(_model(11))
    want_workers = [_direct_loss(p0), _direct_loss(p1)]
    want_avg = _direct_loss((p0 + p1) / 2)
    assert not got["agree"]
    # float32 forward against float64: a few ulps of float32 per logit, averaged over 488 targets
    for g, w in zip(got["workers"], want_workers, strict=True):
        assert math.isclose(g, w, rel_tol=1e-5), (g, w)
    assert math.isclose(got["avg_model"], want_avg, rel_tol=1e-5), (got["avg_model"], want_avg)
    # the three models really differ, so the check above cannot pass by mixing them up
    assert min(abs(want_workers[0] - want_workers[1]), abs(want_avg - want_workers[0])) > 1e-3


def test_identical_workers_are_scored_once_and_every_value_is_that_models_loss(two_ranks):
    got = two_ranks[1]
    want = _direct_loss(_flat64(_model(5)))
    assert got["agree"] and got["workers"][0] == got["workers"][1] == got["avg_model"]
    assert math.isclose(got["avg_model"], want, rel_tol=1e-5), (got["avg_model"], want)


def test_a_model_every_rank_held_is_scored_once_per_process(two_ranks):
    """The initial model of every run of a launch: the second evaluation is the first's number."""
    assert [c["scored_models"] for c in two_ranks] == [0, 1, 1, 2]
    assert two_ranks[2]["avg_model"] == two_ranks[1]["avg_model"] and two_ranks[2]["agree"]


def test_the_same_bytes_in_another_model_shape_are_scored_again(two_ranks):
    got, want = two_ranks[3]["avg_model"], _direct_loss(_flat64(_model(5, CFG_4_HEADS)), CFG_4_HEADS)
    assert math.isclose(got, want, rel_tol=1e-5), (got, want)
    assert abs(got - two_ranks[1]["avg_model"]) > 1e-3  # 4 heads: another function of the same bytes
