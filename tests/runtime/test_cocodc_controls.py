"""CoCoDC's controls of the Taylor term, its per-tensor λ normalization and the l1_local score, each
against a float64 computation written out here (not the code under test)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from lowcomm_kernels.ops.outer_merge import outer_merge_control_ref, outer_merge_ref
from lowcomm_kernels.runtime import CoCoDC
from lowcomm_kernels.runtime.dense import Pending

from .rt_common import one_rank_world

LR, MU = 0.7, 0.9


@pytest.fixture(scope="module")
def group():
    with one_rank_world() as g:
        yield g


def _tensors(n: int, seed: int = 0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    r = {k: torch.randn(n, generator=gen, dtype=torch.float64) for k in ("g", "u", "delta", "x_sent")}
    r["x"] = r["x_sent"] + 0.3 * torch.randn(n, generator=gen, dtype=torch.float64)  # local progress v
    return r


def _hand(t: dict[str, torch.Tensor], bounds: list[int], lam: float, normalized: bool, sign: float = -1.0):
    """Outer Nesterov step, then x = g_new + v + sign·λ_i·v⊙v⊙D per segment [bounds[i], bounds[i+1])."""
    u = MU * t["u"] + t["delta"]
    g = t["g"] - LR * (t["delta"] + MU * u)
    v, D = t["x"] - t["x_sent"], g - t["x_sent"]
    x = torch.empty_like(g)
    for a, b in zip(bounds[:-1], bounds[1:], strict=True):
        c = v[a:b] * v[a:b] * D[a:b]
        lam_i = lam * float(v[a:b].norm() / c.norm()) if normalized else lam
        x[a:b] = g[a:b] + v[a:b] + sign * lam_i * c
    return g, u, x


def _merge_args(t: dict[str, torch.Tensor]) -> tuple:
    return tuple(t[k].clone() for k in ("g", "u", "delta", "x", "x_sent"))


@pytest.mark.parametrize("mode", ["absolute", "normalized"])
def test_flip_reverses_only_the_correction(mode):
    t = _tensors(50)
    g, u, d, x, xs = _merge_args(t)
    outer_merge_control_ref(
        g, u, d, x, xs, lr=LR, momentum=MU, beta=1.0, lam=0.5, lam_mode=mode, control="flip"
    )
    g_h, u_h, x_h = _hand(t, [0, 50], 0.5, mode == "normalized", sign=+1.0)
    torch.testing.assert_close(g, g_h, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(u, u_h, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(x, x_h, rtol=1e-12, atol=1e-12)
    _, _, x_minus = _hand(t, [0, 50], 0.5, mode == "normalized", sign=-1.0)
    assert (x - x_minus).abs().max() > 1e-3  # the sign matters at this size


def test_random_direction_has_the_corrections_norm():
    t = _tensors(64, seed=1)
    r = torch.randn(64, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    g, u, d, x, xs = _merge_args(t)
    outer_merge_control_ref(
        g, u, d, x, xs, lr=LR, momentum=MU, beta=1.0, lam=0.5, lam_mode="normalized",
        control="random", direction=r,
    )  # fmt: skip
    g_h, _, x_taylor = _hand(t, [0, 64], 0.5, True)
    first_order = g_h + (t["x"] - t["x_sent"])
    corr_norm = float((first_order - x_taylor).norm())  # ‖λ_eff·v⊙v⊙D‖, here λ·‖v‖
    assert abs(corr_norm - 0.5 * float((t["x"] - t["x_sent"]).norm())) < 1e-12
    want = first_order - corr_norm * r / r.norm()
    torch.testing.assert_close(x, want, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(g, g_h, rtol=1e-13, atol=1e-13)


def test_control_none_is_the_spec_bit_for_bit_and_bad_input_is_named():
    t = _tensors(33, seed=2)
    a, b = _merge_args(t), _merge_args(t)
    kw = {"lr": LR, "momentum": MU, "beta": 1.0, "lam": 0.5, "lam_mode": "normalized"}
    outer_merge_control_ref(*a, **kw, control="none")
    outer_merge_ref(*b, **kw)
    for p, q in zip(a, b, strict=True):
        assert torch.equal(p, q)
    with pytest.raises(ValueError, match="control"):
        outer_merge_control_ref(*_merge_args(t), **kw, control="sideways")
    with pytest.raises(ValueError, match="direction"):
        outer_merge_control_ref(*_merge_args(t), **kw, control="random", direction=torch.zeros(3))


def _cocodc(group, **kw) -> CoCoDC:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(3, 4), nn.Tanh(), nn.Linear(4, 2)).double()  # tensors 12, 4, 8, 2
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    base = {"sync_every": 8, "num_fragments": 1, "fragment_sync_delay": 1, "syncs_per_period": 2}
    return CoCoDC(model, opt, outer_lr=LR, outer_momentum=MU, process_group=group, **{**base, **kw})


def _pending(t: dict[str, torch.Tensor], send_step: int = 3) -> Pending:
    return Pending(0, send_step, send_step + 1, t["delta"], t["x_sent"].clone(), torch.zeros(1), None)


def test_per_tensor_normalization_matches_a_hand_computation(group):
    st = _cocodc(group, lam=0.5, lam_mode="normalized_tensor")
    n = st.frags.sizes()[0]
    bounds = st.frags.tensor_bounds(0)
    assert bounds == [0, 12, 16, 24, 26] and n == 26
    t = _tensors(n, seed=3)
    g, u, x = t["g"].clone(), t["u"].clone(), t["x"].clone()
    st._merge(_pending(t), g, u, t["delta"].clone(), x)
    g_h, u_h, x_h = _hand(t, bounds, 0.5, True)
    torch.testing.assert_close(g, g_h, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(u, u_h, rtol=1e-13, atol=1e-13)
    torch.testing.assert_close(x, x_h, rtol=1e-12, atol=1e-12)
    _, _, x_frag = _hand(t, [0, n], 0.5, True)  # one scale for the whole fragment: not the same merge
    assert (x_h - x_frag).abs().max() > 1e-4


def test_random_control_draws_the_same_direction_for_the_same_seed_fragment_and_step(group):
    t = _tensors(26, seed=4)

    def run(seed: int, step: int) -> torch.Tensor:
        st = _cocodc(group, lam=0.5, taylor_control="random", control_seed=seed)
        x = t["x"].clone()
        st._merge(_pending(t, step), t["g"].clone(), t["u"].clone(), t["delta"].clone(), x)
        return x

    a = run(5, 3)
    assert torch.equal(a, run(5, 3))
    assert not torch.equal(a, run(6, 3))
    assert not torch.equal(a, run(5, 4))
    # the flip control through the strategy is the hand merge with +λ
    st = _cocodc(group, lam=0.5, taylor_control="flip")
    x = t["x"].clone()
    st._merge(_pending(t), t["g"].clone(), t["u"].clone(), t["delta"].clone(), x)
    torch.testing.assert_close(x, _hand(t, [0, 26], 0.5, True, sign=+1.0)[2], rtol=1e-12, atol=1e-12)


def test_bad_control_choices_are_named(group):
    with pytest.raises(ValueError, match="taylor_control"):
        _cocodc(group, taylor_control="reverse")
    with pytest.raises(ValueError, match="lam_mode"):
        _cocodc(group, lam_mode="per_tensor")
    with pytest.raises(ValueError, match="timing"):
        _cocodc(group, timing="emulated")  # no link model to emulate
    with pytest.raises(ValueError, match="step_time_s"):
        _cocodc(group, step_time_s=0.0)


def test_l1_local_score_is_the_mean_absolute_change_per_step(group):
    torch.manual_seed(0)
    model = nn.Sequential(
        nn.Linear(4, 4), nn.Linear(4, 1)
    ).double()  # fragments: weights 16 + 4, biases 4 + 1
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    st = CoCoDC(
        model, opt, sync_every=8, num_fragments=2, fragment_sync_delay=1, syncs_per_period=2,
        score="l1_local", process_group=group,
    )  # fmt: skip
    sizes = st.frags.sizes()
    assert sizes == [20, 5]
    diff = torch.linspace(-1.0, 2.0, 25, dtype=torch.float64)
    st.g.copy_(st.frags.flat + diff)
    # fragment 0 is being sent at t = 10 (the schedule moved its last send from 3 to 10);
    # fragment 1 was never sent
    st.prev_send, st.last_send = [3, 0], [10, -1]
    _, norms = st._control_extras(0, 10)
    want = [diff[:20].abs().sum() / (7 * 20), diff[20:].abs().sum() / (10 * 5)]
    torch.testing.assert_close(norms, torch.stack(want), rtol=1e-12, atol=0.0)
