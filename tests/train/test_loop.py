"""The one training loop (train/loop.py) on its own: one process, no strategy, a linear model."""

from __future__ import annotations

import time

import pytest
import torch

from lowcomm_kernels.train.loop import TrainLoop, every, stretch_s


def _loop(steps: int = 10, **kw) -> tuple[TrainLoop, dict]:
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    log: dict = {"evals": [], "steps": [], "ticks": [], "lrs": []}
    x, y = torch.randn(8, 3), torch.randn(8, 1)

    def batch_loss() -> torch.Tensor:
        log["lrs"].append(opt.param_groups[0]["lr"])
        return torch.nn.functional.mse_loss(model(x), y)

    loop = TrainLoop(
        model,
        opt,
        batch_loss,
        steps,
        log["evals"].append,
        kw.pop("eval_at", every(4, steps)),
        after_step=lambda t, loss: log["steps"].append(t),
        after_tick=lambda t, evaluated: log["ticks"].append((t, evaluated)),
        **kw,
    )
    return loop, log


def test_it_steps_every_tick_and_evaluates_at_0_every_n_and_the_last():
    loop, log = _loop(10)
    loop.run()
    assert log["steps"] == list(range(1, 11))
    assert log["evals"] == [0, 4, 8, 10]
    assert log["ticks"] == [(t, t in (4, 8, 10)) for t in range(1, 11)]
    assert loop.train_wall_s == pytest.approx(loop.t_end - loop.t_start - loop.eval_s)


def test_an_evaluation_sees_the_training_seconds_so_far():
    seen = []
    loop, _ = _loop(4, eval_at=every(2, 4))
    loop.evaluate = lambda t: (seen.append((loop.elapsed(), loop.eval_s)), time.sleep(0.02))
    loop.run()
    assert [round(e, 6) for _, e in seen][0] == 0.0 and seen[0][0] < 0.02  # at tick 0: nothing yet
    for (elapsed, _), (later, _) in zip(seen, seen[1:], strict=False):
        assert later >= elapsed  # training time only grows, evaluations left out
    assert seen[-1][1] >= 0.04  # the two evaluations before the last are counted as evaluation


def test_it_trains_the_model_as_the_plain_loop_does():
    loop, _ = _loop(10)
    loop.run()
    torch.manual_seed(0)
    model = torch.nn.Linear(3, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(8, 3), torch.randn(8, 1)
    for _ in range(10):
        torch.nn.functional.mse_loss(model(x), y).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    for a, b in zip(loop.model.parameters(), model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_a_skipped_tick_steps_not_but_still_evaluates():
    """A worker that sits ticks out (a slower LOSCAR worker) still joins every evaluation: they are
    collective, so every rank evaluates at the same ticks."""
    loop, log = _loop(8, steps_on=lambda t: t % 2 == 0, eval_at=every(3, 8))
    loop.run()
    assert log["steps"] == [2, 4, 6, 8]
    assert log["evals"] == [0, 3, 6, 8]  # tick 3 was sat out, and evaluated
    assert [t for t, _ in log["ticks"]] == [2, 4, 6, 8]  # after_tick only after a step


def test_the_learning_rate_of_each_step_comes_from_the_ticks_before_it():
    """lr_at(t) sets the rate of the step after t ticks, skipped ticks counted (as a scheduler that
    steps every tick would)."""
    loop, log = _loop(6, lr_at=lambda t: 1.0 + t, steps_on=lambda t: t != 3)
    loop.run()
    assert log["lrs"] == [1.0, 2.0, 4.0, 5.0, 6.0]


def test_a_replica_that_heals_jumps_to_its_peers_step():
    """position: the tick after a step (a torchft replica's strategy step count, which a heal moves
    ahead); the loop continues from there and evaluates where that lands."""
    jumps = {1: 5}
    loop, log = _loop(
        8,
        position=lambda t: jumps.get(t, t),
        evaluate_first=False,
        eval_at=every(4, 8),
        lr_at=lambda t: 1.0 + t,
    )
    loop.run()
    assert log["steps"] == [5, 6, 7, 8]
    assert log["evals"] == [8]  # no evaluation at 0 (a returning replica's was in its first life)
    assert log["lrs"] == [1.0, 6.0, 7.0, 8.0]  # after the jump, the rate of the peers' step


def test_the_lm_schedule_equals_torchs_lambdalr_bit_for_bit():
    """worker.lr_schedule sets the rate before each step; it equals what a LambdaLR stepped once per
    tick gives (base_lr x the same factor), warm-up and cosine, for every step."""
    import math

    from lowcomm_kernels.train.spec import TrainSpec
    from lowcomm_kernels.train.worker import lr_schedule

    for lr, warmup, steps, floor in ((3e-3, 40, 2000, 0.1), (1e-3, 7, 53, 0.01), (0.7, 1, 2, 0.5)):
        spec = TrainSpec(lr=lr, warmup_steps=warmup, steps=steps, min_lr_frac=floor)
        opt = torch.optim.SGD([torch.zeros(1, requires_grad=True)], lr=lr)

        def factor(t: int, warmup=warmup, steps=steps, floor=floor) -> float:
            if t < warmup:
                return (t + 1) / warmup
            progress = min(1.0, (t - warmup) / max(1, steps - warmup))
            return floor + (1 - floor) * 0.5 * (1 + math.cos(math.pi * progress))

        sched = torch.optim.lr_scheduler.LambdaLR(opt, factor)
        ours = lr_schedule(spec)
        for t in range(steps):
            assert ours(t) == opt.param_groups[0]["lr"], (lr, warmup, steps, t)
            opt.step()
            sched.step()


def test_evaluation_time_is_not_training_time():
    loop, _ = _loop(4, eval_at=every(2, 4))
    slow_evals = loop.evaluate
    loop.evaluate = lambda t: (time.sleep(0.05), slow_evals(t))
    loop.run()
    assert loop.eval_s >= 0.15  # at 0, 2 and 4
    assert loop.train_wall_s < loop.t_end - loop.t_start - 0.14


def test_a_slower_worker_is_stretched_and_its_link_wait_is_not():
    assert stretch_s(3.0, 0.31, 0.30) == pytest.approx(0.02)
    assert stretch_s(2.0, 0.1, 0.2) == 0.0  # never negative

    def timed(link_wait: bool) -> float:
        waited = [0.0]
        loop, _ = _loop(3, speed=3.0, link_wait_s=lambda: waited[0])
        inner = loop.batch_loss

        def batch_loss() -> torch.Tensor:  # 50 ms in each step, on the link or computing
            time.sleep(0.05)
            waited[0] += 0.05 if link_wait else 0.0
            return inner()

        loop.batch_loss = batch_loss
        loop.run()
        return loop.train_wall_s

    assert timed(link_wait=False) >= 3 * 3 * 0.05  # 3 steps, each stretched to 3x its 50 ms
    # the link's wait is not stretched: about 3 x 50 ms (a margin for a loaded machine's sleeps)
    assert timed(link_wait=True) < 3 * 3 * 0.05 - 0.1


def test_a_data_parallel_gradient_sync_runs_between_backward_and_step():
    seen = []

    class Sync:
        def sync_grads(self) -> None:
            seen.append(all(p.grad is not None for p in loop.model.parameters()))
            for p in loop.model.parameters():
                p.grad.zero_()  # an "average" of zeros: the step must then change nothing

    loop, _ = _loop(3, grad_sync=Sync())
    before = [p.detach().clone() for p in loop.model.parameters()]
    loop.run()
    assert seen == [True] * 3
    for a, b in zip(before, loop.model.parameters(), strict=True):
        assert torch.equal(a, b)


def test_gradients_are_clipped_before_the_step():
    loop, _ = _loop(1, grad_clip=1e-3)
    before = [p.detach().clone() for p in loop.model.parameters()]
    loop.run()
    moved = torch.cat(
        [(p.detach() - b).reshape(-1) for p, b in zip(loop.model.parameters(), before, strict=True)]
    )
    assert float(moved.norm()) == pytest.approx(0.1 * 1e-3, rel=1e-4)  # lr x the clipped norm
