"""Sharded parameters: DTensors (FSDP2 ``fully_shard``, ``distribute_tensor(..., [Shard(0)])``).

Layout (HSDP's): parameters are sharded inside a region and replicated across regions. Each rank
holds one shard of every parameter; the ranks that hold the same shard in different regions form a
*replica group*, and that group is the strategy's ``process_group``. The strategy then works on
local shards only: its flat buffer holds this rank's local shard of each DTensor parameter, the
fragments are slices of it, and every all-reduce runs across the replicas of the same shard. Inside
a region FSDP does what it always does (all-gather for forward/backward, reduce-scatter of the
gradients); across regions only the strategy communicates, every H steps, instead of FSDP's HSDP
all-reduce every step. With R regions of S ranks, region-major (ranks r·S .. r·S+S−1 form region r):

    mesh = init_device_mesh(device, (R, S), mesh_dim_names=("replica", "shard"))
    for block in model.blocks: fully_shard(block, mesh=mesh["shard"])
    fully_shard(model, mesh=mesh["shard"])
    strategy = DiLoCo(model, opt, process_group=mesh["replica"].get_group(), sync_every=H)

(``region_groups(R)`` returns the same two groups for code that does not use a DeviceMesh.)

Views. A DTensor parameter's local shard is the tensor its ``_local_tensor`` holds; the strategy
swaps that tensor's ``.data`` for a view of the flat buffer, as it swaps ``param.data`` for a plain
parameter, so the Parameter object (and the inner optimizer's state keyed by it) stays the same.
FSDP2 keeps a second reference: each ``FSDPParam`` all-gathers from ``_sharded_param_data``, a
flat *padded* copy of the shard (dim 0 padded up to ceil(size/S) rows, so a rank may hold an empty
shard) of which ``_local_tensor`` is a view. So for an FSDP2 parameter the flat buffer holds the
padded shard, ``_sharded_param_data`` becomes that slice of it and ``_local_tensor`` a view of its
first rows; the padding rows stay zero on every replica (their pseudo-gradient is 0), and FSDP's
lazy initialisation (``reset_sharded_param``) sees the two share storage and keeps both. This
touches FSDP2 internals (``_get_fsdp_state``, ``_fsdp_param_group.fsdp_params``,
``_sharded_param_data``), written against torch 2.13; a torch without them fails at wrapping with
an error that says so, and a broken view is found at the next send (``ParameterViewError``).

Agreement: every replica must hold the same shard of each parameter, so each DTensor parameter's
placements, mesh shape, mesh coordinate and local shape are part of the cross-rank agreement:
ranks grouped wrongly (e.g. the whole world as ``process_group``) stop at construction with
``ConfigMismatchError`` naming the parameter.
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from torch import nn

_FSDP = "_lowcomm_fsdp_param"  # attribute on an FSDP2 sharded Parameter: its FSDPParam


def is_sharded(t: object) -> bool:
    # DTensor's module is not imported here: it costs each process ~0.6 s of CPU at start-up (every
    # rank imports this), and a DTensor cannot exist before something else has imported it
    dtensor = getattr(sys.modules.get("torch.distributed.tensor"), "DTensor", None)
    return dtensor is not None and isinstance(t, dtensor)


def local(t: torch.Tensor) -> torch.Tensor:
    """The local shard of a DTensor (the tensor itself otherwise). No communication."""
    return t._local_tensor if is_sharded(t) else t  # type: ignore[attr-defined]


def bind_fsdp(model: nn.Module) -> None:
    """Reshard every FSDP2 module of ``model`` (after a forward without backward the root keeps its
    unsharded parameters registered; the optimizer holds the sharded ones) and tag each sharded
    Parameter with its ``FSDPParam`` (see the module docstring). Call before planning fragments."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:
        return
    for m in model.modules():
        if not isinstance(m, FSDPModule):
            continue
        m.reshard()
        try:
            group = m._get_fsdp_state()._fsdp_param_group
            fsdp_params = [] if group is None else list(group.fsdp_params)
            for fp in fsdp_params:
                fp.sharded_param, fp._sharded_param_data, fp.padded_sharded_param_size  # noqa: B018
        except AttributeError as e:
            raise RuntimeError(
                f"model: this torch's FSDP2 ({torch.__version__}) does not have the internals the "
                f"strategy uses to view sharded parameters ({e}); see runtime/sharding.py"
            ) from e
        for fp in fsdp_params:
            if getattr(fp, "pin_memory", False):  # checked before any parameter is rewired
                raise ValueError(
                    "model: FSDP2 CPU offload into pinned memory (CPUOffloadPolicy(pin_memory=True)) "
                    "would copy each shard out of the strategy's unpinned buffer at its first forward, "
                    "and the strategy would stop seeing the parameters; use "
                    "CPUOffloadPolicy(pin_memory=False)"
                )
            setattr(fp.sharded_param, _FSDP, fp)


def _fsdp_param(p: torch.Tensor) -> Any:
    return getattr(p, _FSDP, None)


def buffer_numel(p: torch.Tensor) -> int:
    """Elements of the flat buffer that parameter ``p`` occupies: its numel, its local shard's for a
    DTensor, FSDP2's padded shard's for an FSDP2 parameter."""
    fp = _fsdp_param(p)
    if fp is not None:
        return fp._sharded_param_data.numel()
    return local(p).numel()


def attach(p: nn.Parameter, slot: torch.Tensor) -> None:
    """Copy ``p``'s (local) values into ``slot`` (a 1-D slice of the flat buffer of
    ``buffer_numel(p)`` elements) and make ``p`` a view of it (the Parameter object stays)."""
    fp = _fsdp_param(p)
    if fp is not None:
        lt = p._local_tensor  # type: ignore[attr-defined]
        padded = slot.view(fp.padded_sharded_param_size)
        dim = fp.fsdp_placement.dim
        rows = lt.size(dim) if lt.numel() > 0 else 0
        padded.zero_()
        padded.narrow(dim, 0, rows).copy_(lt)
        fp._sharded_param_data = slot  # what FSDP all-gathers from
        lt.data = padded.narrow(dim, 0, rows)  # what the optimizer steps
        return
    target = local(p)
    view = slot.view_as(target)
    view.copy_(target.data)
    target.data = view  # for a plain Parameter: param.data = view


def viewing(p: torch.Tensor) -> torch.Tensor:
    """The tensor that must view ``p``'s slot of the flat buffer (from its first element)."""
    fp = _fsdp_param(p)
    if fp is not None:
        return fp._sharded_param_data
    return local(p).data


def views_slot(d: torch.Tensor, flat: torch.Tensor, off: int) -> bool:
    """Does ``d`` start at element ``off`` of ``flat``? Empty tensors report data_ptr() 0, so
    for them the storage is compared instead."""
    if d.numel() == 0:
        return d.untyped_storage().data_ptr() == flat.untyped_storage().data_ptr()
    return d.data_ptr() == flat.data_ptr() + off * flat.element_size()


def extra_view_problem(p: torch.Tensor) -> str | None:
    """For an FSDP2 parameter: the shard the optimizer steps (``_local_tensor``) must share storage
    with the one FSDP all-gathers (``_sharded_param_data``); a sentence when it does not."""
    fp = _fsdp_param(p)
    if fp is None:
        return None
    a = p._local_tensor.untyped_storage().data_ptr()  # type: ignore[attr-defined]
    if a != fp._sharded_param_data.untyped_storage().data_ptr():
        return "its local shard and the shard FSDP all-gathers no longer share storage"
    return None


def sharding_fields(model: nn.Module) -> dict[str, Any]:
    """What the replicas of a shard must agree on: each DTensor parameter's placements, mesh shape,
    mesh coordinate (which shard) and local shape."""
    out: dict[str, Any] = {}
    for n, p in model.named_parameters():
        if is_sharded(p):
            mesh = p.device_mesh  # type: ignore[attr-defined]
            out[f"sharding of {n!r}"] = (
                [str(pl) for pl in p.placements],  # type: ignore[attr-defined]
                tuple(mesh.shape),
                tuple(mesh.get_coordinate() or ()),
                tuple(local(p).shape),
            )
    return out


def any_sharded(model: nn.Module) -> bool:
    return any(is_sharded(p) for p in model.parameters())


def check_sharded_cocodc(model: nn.Module, score: str, syncs_per_period: object, lam_mode: str) -> None:
    """CoCoDC on a sharded model only with the choices that read no per-shard values: its scores,
    its measured N and its normalised λ_eff come from this rank's shard, so replica groups of
    different shards would pick different fragments, periods or corrections for one model."""
    if not any_sharded(model):
        return
    for name, value, need in (
        ("score", score, "'round_robin'"),
        ("syncs_per_period", syncs_per_period, "an int"),
        ("lam_mode", lam_mode, "'absolute'"),
    ):
        ok = isinstance(value, int) if name == "syncs_per_period" else repr(value) == need
        if not ok:
            raise ValueError(
                f"{name}={value!r}: CoCoDC on a sharded model (DTensor parameters) needs {name}={need} "
                "(with score='round_robin', syncs_per_period=<int>, lam_mode='absolute'): the other "
                "choices read norms or timings of this rank's shard only, so the replicas of different "
                "shards would choose different fragments, periods or corrections for the same model"
            )


def refuse_sharded_checkpoint(model: nn.Module, what: str) -> None:
    """``save_checkpoint`` / ``load_checkpoint`` write the model and optimizer as plain tensors of
    one rank; a sharded model's belong in ``torch.distributed.checkpoint``."""
    if any_sharded(model):
        raise ValueError(
            f"{what}: the model has sharded (DTensor) parameters; save the model and the inner "
            "optimizer with torch.distributed.checkpoint and the strategy with strategy.state_dict() "
            "/ load_state_dict() (plain tensors: this rank's shard of g, u and the syncs in flight)"
        )
