"""Model, data and inner-training step shared by the runtime workers and the float64 simulator.

Deliberately tiny (a few 8-wide Linear blocks) so a spawned 2-rank run of 40 steps takes well under
a second of compute; every test's time goes to process start-up.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import nn

from lowcomm_kernels.runtime.launch import free_port

IN, WIDTH, BLOCKS, BATCH = 4, 8, 4, 16


class TinyNet(nn.Module):
    """inp -> BLOCKS x (Linear, tanh) in a ModuleList -> out. The ModuleList is what the runtime's
    default layer-strided fragmenting finds."""

    def __init__(self, width: int = WIDTH, blocks: int = BLOCKS) -> None:
        super().__init__()
        self.inp = nn.Linear(IN, width)
        self.blocks = nn.ModuleList([nn.Linear(width, width) for _ in range(blocks)])
        self.out = nn.Linear(width, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.tanh(self.inp(x))
        for b in self.blocks:
            h = torch.tanh(b(h))
        return self.out(h)


def make_model(dtype: torch.dtype = torch.float64, width: int = WIDTH, blocks: int = BLOCKS) -> TinyNet:
    torch.manual_seed(0)  # identical initialisation everywhere
    return TinyNet(width, blocks).to(dtype)


def batch(rank: int, step: int, dtype: torch.dtype = torch.float64) -> tuple[torch.Tensor, torch.Tensor]:
    """Deterministic, rank-dependent (non-iid-ish) data for inner step `step` (1-based)."""
    g = torch.Generator().manual_seed(10_000 * rank + step)
    x = torch.randn(BATCH, IN, generator=g, dtype=torch.float64)
    y = torch.sin(x.sum(1, keepdim=True) + 0.3 * rank)
    return x.to(dtype), y.to(dtype)


def loss_fn(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return ((model(x) - y) ** 2).mean()


def inner_step(model: nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> float:
    """One inner step on rank's batch for `step`: forward, backward, opt.step(), zero_grad()."""
    dtype = next(model.parameters()).dtype
    x, y = batch(rank, step, dtype)
    loss = loss_fn(model, x, y)
    loss.backward()
    opt.step()
    opt.zero_grad()
    return float(loss.detach())


INNER_LR = 0.05
INNER_MOMENTUM = 0.5


def make_opt(model: nn.Module) -> torch.optim.Optimizer:
    return torch.optim.SGD(model.parameters(), lr=INNER_LR, momentum=INNER_MOMENTUM)


@contextlib.contextmanager
def one_rank_world() -> Iterator[dist.ProcessGroup]:
    """This process as a gloo world of one (on a free port), for strategies built in the test
    process; an existing default group is reused and left as it was. Destroyed on exit, since later
    tests in the process (the Hugging Face callback's) expect no default group."""
    owner = not dist.is_initialized()
    if owner:
        os.environ["MASTER_ADDR"], os.environ["MASTER_PORT"] = "127.0.0.1", str(free_port())
        dist.init_process_group("gloo", rank=0, world_size=1)
    try:
        yield dist.group.WORLD
    finally:
        if owner:
            dist.destroy_process_group()


@contextlib.contextmanager
def runtime_warnings() -> Iterator[list[str]]:
    """The messages of the runtime's warnings (logger "lowcomm_kernels") logged inside the block."""
    messages: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            messages.append(record.getMessage())

    handler = Collect(logging.WARNING)
    logger = logging.getLogger("lowcomm_kernels")
    logger.addHandler(handler)
    try:
        yield messages
    finally:
        logger.removeHandler(handler)
