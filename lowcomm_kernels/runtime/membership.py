"""Who a strategy syncs with: a fixed process group, or replicas that come and go (torchft).

A strategy is given a ``Membership`` and asks it for its transport, for the agreement at
construction and for what happens around each step; it never asks which kind it was given. Two
kinds exist:

- ``FixedGroup``: one process group for the strategy's life. The ranks agree on the configuration
  and model at construction and start from rank 0's state (``agreement``); collectives outside a
  sync (the consistency guard, broadcasts that restart a poisoned rank) are possible.
- the torchft membership (``runtime.ft``): no fixed group. Every sync is a torchft round, a replica
  joins at its first step and heals from a healthy peer through the strategy's public heal hooks
  (``Strategy.heal_state`` and the others next to it).

``membership_for`` turns the user's arguments (``process_group=`` / ``wan=`` or ``manager=`` /
``num_replicas=``) into one of them. It is the only place that imports ``runtime.ft``, lazily, so
torchft stays optional and no strategy module depends on it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

import torch
import torch.distributed as dist

from .agreement import agree, broadcast_module_state, check_pairing, joined_before
from .transport import WAN, Transport

if TYPE_CHECKING:
    from .base import Strategy


class Membership(Protocol):
    """What a strategy asks of the replicas it syncs with (see the module docstring)."""

    #: one process group for the strategy's whole life: collectives outside a sync (restarting a
    #: poisoned rank from a peer, the consistency guard, the compressed wires' own groups) exist
    fixed_group: bool

    def transport(self, *, device: torch.device, timeout_s: float) -> Transport:
        """The transport every sync of the strategy goes through."""
        ...

    def join(self, strategy: Strategy, fields: dict[str, Any]) -> None:
        """At the end of construction, before any other collective: agree on ``fields`` (the
        configuration and model that must match) and take the starting state, or register the
        strategy's heal hooks where replicas agree and heal later."""
        ...

    def before_step(self, strategy: Strategy) -> None:
        """At every step hook, before the strategy advances (the torchft membership joins its first
        quorum here)."""
        ...

    def finish_heal(self, strategy: Strategy, step: int) -> None:
        """The transport raised ``HealedInRound``: the strategy now holds the peers' state as of
        ``step``; finish that step as the peers run it."""
        ...


def resolve_group(process_group: dist.ProcessGroup | None) -> dist.ProcessGroup:
    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError(
            "process_group: torch.distributed is not initialised; call "
            "dist.init_process_group(...) first (a group of size 1 is fine for one worker)"
        )
    group = process_group if process_group is not None else dist.group.WORLD
    if group is None or dist.get_rank(group) < 0:
        raise ValueError("process_group: this rank is not a member of the given process group")
    return group


class FixedGroup:
    """Every rank of one process group, for the strategy's whole life."""

    fixed_group = True

    def __init__(self, process_group: dist.ProcessGroup | None, wan: WAN | None) -> None:
        self.group = resolve_group(process_group)
        self.wan = wan

    def transport(self, *, device: torch.device, timeout_s: float) -> Transport:
        return Transport(self.group, device=device, wan=self.wan, timeout_s=timeout_s)

    def join(self, strategy: Strategy, fields: dict[str, Any]) -> None:
        """Agree with every rank, then start from rank 0's parameters, frozen parameters and buffers
        (``agreement``)."""
        tr, flat = strategy.transport, strategy.frags.flat
        fields = dict(fields)
        fields["strategies this process built over this process group before"] = joined_before(tr)
        agree(tr, fields, strategy.method)
        check_pairing(tr, flat, strategy.method)
        trainable = {id(p) for grp in strategy.frags.params for p in grp}
        broadcast_module_state(tr, flat, strategy.model, trainable)

    def before_step(self, strategy: Strategy) -> None:
        pass

    def finish_heal(self, strategy: Strategy, step: int) -> None:  # pragma: no cover - never raised here
        raise AssertionError("a fixed group's transport does not heal")


def membership_for(
    *, process_group: dist.ProcessGroup | None, wan: WAN | None, manager: Any, num_replicas: int | None
) -> Membership:
    """The user's arguments as a membership: ``manager=`` (with ``num_replicas=``) for torchft,
    otherwise the fixed ``process_group`` (default: the world)."""
    if manager is None and num_replicas is None:
        return FixedGroup(process_group, wan)
    from .ft import TorchFTMembership  # torchft is optional: imported only when asked for

    return TorchFTMembership(manager, num_replicas, process_group=process_group, wan=wan)
