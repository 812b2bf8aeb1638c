"""What the small tasks (``mlp``, ``logreg``) share: one spawn of the workers for many runs, the
losses of the worker-averaged and of each worker's own parameters, and refusing flags that do not
apply to a task."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from ...runtime.launch import launch
from ..args import FLAGS
from ..errors import UsageError

#: flags of the LM task that mean nothing to the small tasks (the model, its data, AdamW and its schedule)
LM_ONLY = (
    "data dim layers heads mlp_hidden seq_len eval_bytes final_eval_bytes warmup_steps weight_decay "
    "param_dtype grad_clip min_lr_frac"
).split()


def refuse_flags(args: argparse.Namespace, names: list[str], what: str) -> None:
    """A UsageError naming the first of ``names`` given on the command line, before any run."""
    for name in names:
        if getattr(args, name, None) not in (None, False):
            flag = FLAGS.get(name, "--" + name.replace("_", "-"))
            raise UsageError(f"{flag} does not apply to {what}")


@torch.no_grad()
def averaged_and_own(
    model: torch.nn.Module, loss: Callable[[torch.nn.Module], float], group: Any
) -> tuple[float, list[float]]:
    """(loss of the worker-averaged parameters, each worker's own parameters' loss in rank order).
    Collective over ``group``; the same numbers on every rank. The second is the model each worker
    actually holds: averaging only at evaluation hides how far apart the workers drifted (and LOSCAR
    never forms the average). ``model`` is left as it was."""
    world = dist.get_world_size(group)
    mine = torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone()
    own = torch.tensor([loss(model)], dtype=torch.float64)
    every = [torch.zeros_like(own) for _ in range(world)]
    avg = mine.clone()
    dist.all_reduce(avg, group=group)
    dist.all_gather(every, own, group=group)
    _copy_into(model, avg.div_(world))  # in place: a strategy's flat buffer stays the parameters' storage
    avg_loss = loss(model)
    _copy_into(model, mine)
    return avg_loss, [float(v) for v in every]


def _copy_into(model: torch.nn.Module, vec: torch.Tensor) -> None:
    offset = 0
    for p in model.parameters():
        p.copy_(vec[offset : offset + p.numel()].view_as(p))
        offset += p.numel()


def launch_jobs(body: Callable, args: tuple, n_jobs: int, workers: int, progress: bool, desc: str) -> Any:
    """``body(rank, world, *args)`` on ``workers`` ranks (one spawn for every job), with a progress
    bar of ``n_jobs`` runs that rank 0 advances by ``send(job_index)``; returns rank 0's value.
    Raises :class:`~lowcomm_kernels.runtime.launch.WorkerError`."""
    bar = None
    if progress:
        from tqdm import tqdm  # optional (the cli extra): only with a progress bar

        bar = tqdm(total=n_jobs, desc=desc, unit="run")

    def job_done(rank: int, job: int) -> None:
        if bar is not None:
            bar.update(1)

    try:
        per_rank = launch(body, workers, args, on_message=job_done)
    finally:
        if bar is not None:
            bar.close()
    return per_rank[0]
