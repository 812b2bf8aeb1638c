"""Topology: an outer group across regions, an optional inner data-parallel group in each region.

Ranks are laid out region-major: with R regions of D ranks each (world = R·D), region r holds global
ranks r·D .. r·D + D − 1. The user's DDP runs over the inner group (the D ranks of a region, which
therefore hold identical x); the strategy syncs over the outer group, which joins the ranks with
the same DP index across regions: {i, D + i, 2D + i, ...}. Every outer group sees identical inputs
(DDP keeps the replicas of a region identical), so g stays identical on all ranks.

Works under ``torchrun`` single- or multi-node (``--nnodes=R --nproc-per-node=D`` puts one region on
each node with exactly this layout).
"""

from __future__ import annotations

import torch.distributed as dist


def region_groups(num_regions: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(inner_dp_group, outer_group) of this rank. Collective: call on every rank, same arguments."""
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("region_groups: torch.distributed is not initialised")
    if isinstance(num_regions, bool) or not isinstance(num_regions, int) or num_regions < 1:
        raise ValueError(f"num_regions must be an int >= 1, got {num_regions!r}")
    world, rank = dist.get_world_size(), dist.get_rank()
    if world % num_regions:
        raise ValueError(f"world size {world} is not divisible by num_regions={num_regions}")
    D = world // num_regions
    inner = outer = None
    for r in range(num_regions):  # every rank must create every group, in the same order
        g = dist.new_group(list(range(r * D, (r + 1) * D)))
        if rank // D == r:
            inner = g
    for i in range(D):
        g = dist.new_group([r * D + i for r in range(num_regions)])
        if rank % D == i:
            outer = g
    assert inner is not None and outer is not None
    return inner, outer
