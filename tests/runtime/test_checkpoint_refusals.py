"""load_checkpoint checks everything before it changes anything: the inner optimizer's state against
the parameters (shapes, a finite step >= 0), its parameter groups, LOSCAR's seed and density, the rank
that wrote the file; after a refused load the model, the inner optimizer and the strategy are
bit-identical to before."""

from __future__ import annotations

import math

import pytest
import torch

import lowcomm_kernels.runtime as rt
from lowcomm_kernels.runtime.checkpoint import read_checkpoint, write_checkpoint
from tests.runtime.rt_common import inner_step, make_model, one_rank_world


def _build(cls: str, steps: int, seed: int = 0, density: float = 0.5):
    model = make_model(torch.float64)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    if cls == "loscar":
        st = rt.LOSCAR(model, opt, density=density, local_steps=2, overlap_steps=1, seed=seed)
    else:
        st = rt.StreamingDiLoCo(model, opt, sync_every=4, num_fragments=2, fragment_sync_delay=1)
    for t in range(1, steps + 1):
        inner_step(model, opt, 0, t)
        st.step()
    return model, opt, st


def _flat(obj, prefix="") -> dict:
    """Every leaf of nested dicts / lists, tensors cloned, by path."""
    if isinstance(obj, dict):
        return {k: v for key, val in obj.items() for k, v in _flat(val, f"{prefix}/{key}").items()}
    if isinstance(obj, (list, tuple)):
        return {k: v for i, val in enumerate(obj) for k, v in _flat(val, f"{prefix}/{i}").items()}
    return {prefix: obj.detach().clone() if isinstance(obj, torch.Tensor) else obj}


def _snapshot(model, opt, st) -> dict:
    return {
        **_flat(model.state_dict(), "model"),
        **_flat(opt.state_dict(), "optimizer"),
        **_flat(st.state_dict(), "strategy"),
        "flat": st.frags.flat.detach().clone(),
    }


def _bit_identical(a: dict, b: dict) -> None:
    assert a.keys() == b.keys()
    for k in a:
        x, y = a[k], b[k]
        if isinstance(x, torch.Tensor):
            assert x.dtype == y.dtype and x.shape == y.shape and torch.equal(x, y), k
        else:
            assert x == y or (isinstance(x, float) and math.isnan(x) and math.isnan(y)), k


def _first_state(o: dict) -> dict:
    return o["optimizer"]["state"][0]


def _two_groups(o: dict) -> None:
    g = o["optimizer"]["param_groups"][0]
    o["optimizer"]["param_groups"] = [{**g, "params": g["params"][:2]}, {**g, "params": g["params"][2:]}]


# case -> (strategy, mutation of the saved checkpoint, words of the CheckpointError)
CASES = {
    "exp_avg_one_element": (
        "streaming", lambda o: _first_state(o).__setitem__("exp_avg", torch.zeros(1, dtype=torch.float64)),
        "optimizer state of inp.weight['exp_avg'] is torch.float64 of shape (1,)"),
    "exp_avg_sq_integer": (
        "streaming", lambda o: _first_state(o).__setitem__("exp_avg_sq", torch.zeros(8, 4).long()),
        "['exp_avg_sq'] is torch.int64 of shape (8, 4); the parameter needs a floating point tensor"),
    "step_negative": (
        "streaming", lambda o: _first_state(o).__setitem__("step", torch.tensor(-3.0)),
        "optimizer state of inp.weight['step'] should be a finite number >= 0"),
    "step_nan": (
        "streaming", lambda o: _first_state(o).__setitem__("step", torch.tensor(float("nan"))),
        "['step'] should be a finite number >= 0"),
    "state_of_no_parameter": (
        "streaming", lambda o: o["optimizer"]["state"].__setitem__(99, {"step": torch.tensor(1.0)}),
        "optimizer state[99] should be a dict for a parameter listed in its param_groups"),
    "two_param_groups": (
        "streaming", _two_groups, "optimizer has 2 parameter groups but this inner optimizer has 1"),
    "group_size": (
        "streaming", lambda o: o["optimizer"]["param_groups"][0]["params"].pop(),
        "optimizer param_groups[0] holds 11 parameters but this inner optimizer's group 0 holds 12"),
    # a per-rank file loaded by another rank of the group (here: written by rank 1, loaded by rank 0)
    "another_ranks_file": (
        "streaming", lambda o: o.__setitem__("rank", 1), "checkpoint was written by rank 1 but this is rank 0"
    ),
    "another_ranks_file_loscar": (
        "loscar", lambda o: o.__setitem__("rank", 1), "checkpoint was written by rank 1 but this is rank 0"
    ),
    "loscar_other_seed": ("loscar", {"seed": 7}, "checkpoint has seed=7, k="),
    "loscar_other_density": (
        "loscar", {"density": 0.25}, "has seed=0, k=85 but this LOSCAR has seed=0, k=169 (density=0.5)"),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_refused_load_changes_nothing(tmp_path, case):
    cls, change, words = CASES[case]
    with one_rank_world():
        path = str(tmp_path / "ckpt.pt")
        if callable(change):  # a checkpoint of this configuration, one entry made wrong
            model, opt, st = _build(cls, 5)
            st.save_checkpoint(path)
            st.close()
            obj = read_checkpoint(path)
            change(obj)
            write_checkpoint(obj, path)
        else:  # a good checkpoint of another configuration
            model, opt, st = _build(cls, 5, **change)
            st.save_checkpoint(path)
            st.close()
        model, opt, st = _build(cls, 7)  # another point of training than the checkpoint's
        before = _snapshot(model, opt, st)
        with pytest.raises(rt.CheckpointError) as err:
            st.load_checkpoint(path)
        assert words in str(err.value), str(err.value)
        _bit_identical(before, _snapshot(model, opt, st))
        st.close()


def test_a_broken_parameter_view_is_refused_before_the_model_loads(tmp_path):
    """The model loads into the flat buffer's views: a view broken since wrapping used to be found
    after the model had been loaded."""
    with one_rank_world():
        path = str(tmp_path / "ckpt.pt")
        model, opt, st = _build("streaming", 5)
        st.save_checkpoint(path)
        st.close()
        model, opt, st = _build("streaming", 7)
        model.out.bias.data = model.out.bias.data.clone()  # no longer a view of the flat buffer
        before = _snapshot(model, opt, st)
        with pytest.raises(RuntimeError, match="out.bias"):
            st.load_checkpoint(path)
        _bit_identical(before, _snapshot(model, opt, st))
        st.close()


def test_a_good_checkpoint_still_loads(tmp_path):
    with one_rank_world():
        path = str(tmp_path / "ckpt.pt")
        model, opt, st = _build("streaming", 5)
        st.save_checkpoint(path)
        saved = _snapshot(model, opt, st)
        st.close()
        assert read_checkpoint(path)["rank"] == 0  # the file says which rank wrote it
        model, opt, st = _build("streaming", 7)
        st.load_checkpoint(path)
        _bit_identical(saved, _snapshot(model, opt, st))
        st.close()


def _run(make, steps: int):
    model = make_model(torch.float64)
    opt = torch.optim.SGD(model.parameters(), lr=1e-2)
    st = make(model, opt)
    for t in range(1, steps + 1):
        inner_step(model, opt, 0, t)
        st.step()
    return model, opt, st


SCHEDULES = {
    # name: (saved with, resumed with, saved at, refused): a sync in flight at the save lands after the
    # resumed schedule sends its fragment again (before: RuntimeError 'fragment ... is already in
    # flight (schedule bug)' at that send, mid-run)
    "streaming tau 3, H 8 -> H 4": (
        lambda m, o: rt.StreamingDiLoCo(m, o, sync_every=8, num_fragments=2, fragment_sync_delay=3),
        lambda m, o: rt.StreamingDiLoCo(m, o, sync_every=4, num_fragments=2, fragment_sync_delay=1),
        5,
        "fragment 1's sync sent at step 4 lands at step 7, after this strategy sends again at step 6",
    ),
    "diloco eager, H 4 -> H 2, saved at 5": (
        lambda m, o: rt.DiLoCo(m, o, sync_every=4, eager=True),
        lambda m, o: rt.DiLoCo(m, o, sync_every=2, eager=True),
        5,
        "fragment 0's sync sent at step 4 lands at step 8, after this strategy sends again at step 6",
    ),
    "diloco eager, H 4 -> H 2, saved at 6": (  # lands at 8, the resumed run's next send: fine
        lambda m, o: rt.DiLoCo(m, o, sync_every=4, eager=True),
        lambda m, o: rt.DiLoCo(m, o, sync_every=2, eager=True),
        6,
        None,
    ),
}


@pytest.mark.parametrize("name", list(SCHEDULES))
def test_a_sync_in_flight_that_another_schedule_would_send_over_is_refused(tmp_path, name):
    saved_with, resumed_with, at, words = SCHEDULES[name]
    with one_rank_world():
        path = str(tmp_path / "ckpt.pt")
        model, opt, st = _run(saved_with, at)
        assert st.pending
        st.save_checkpoint(path)
        st.close()
        model, opt, st = _run(resumed_with, 3)
        if words is None:
            st.load_checkpoint(path)
            for t in range(at + 1, at + 9):
                inner_step(model, opt, 0, t)
                st.step()
            st.finish()
        else:
            before = _snapshot(model, opt, st)
            with pytest.raises(rt.CheckpointError) as err:
                st.load_checkpoint(path)
            assert words in str(err.value), str(err.value)
            _bit_identical(before, _snapshot(model, opt, st))
        st.close()
