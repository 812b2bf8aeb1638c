"""Flat fragments: the model's parameters regrouped into K contiguous buffers.

All trainable parameters move into ONE flat buffer ``x`` of the parameters' dtype (fp32, fp64, or
bf16 / fp16, whose outer state the strategies keep in a float32 master: ``master_dtype``), ordered
fragment by fragment, so fragment p is the contiguous slice ``x[offsets[p]:offsets[p+1]]``
and every fused op runs as one launch per fragment (or one launch for all, as ``fragment_norms``).

Each module parameter becomes a view of that buffer by swapping ``param.data``: the Parameter
objects stay the same objects, so an inner optimizer built before or after wrapping keeps its
param references and its state (both keyed by the Parameter). Gradients are untouched (they stay
separate tensors), which is what DDP's gradient buckets need.

Default split (as Streaming DiLoCo does): layer-strided over the model's blocks. The blocks are the
children of the largest ``nn.ModuleList`` (by parameter count); fragment p holds blocks p, p+K,
p+2K, ... . Parameters outside the blocks (embeddings, head, final norm) go, one by one in
registration order, to the fragment with the fewest elements so far (ties: lowest index). Without
a ModuleList, each parameter is a block. ``fragments=`` may instead be a list (one entry per
fragment, each a module or a list of modules) or a callable ``model -> list``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Union

import torch
from torch import nn

from .._checks import PARAM_DTYPES, master_dtype
from .sharding import attach, bind_fsdp, buffer_numel, extra_view_problem, viewing, views_slot

FragmentSpec = Union[None, Sequence[object], Callable[[nn.Module], Sequence[object]]]  # noqa: UP007 (runtime alias)


def find_blocks(model: nn.Module) -> list[nn.Module] | None:
    """Children of the largest ``nn.ModuleList`` by trainable-parameter count, or None."""
    best, best_n = None, 0
    for m in model.modules():
        if isinstance(m, nn.ModuleList) and len(m) > 0:
            n = sum(p.numel() for p in m.parameters() if p.requires_grad)
            if n > best_n:
                best, best_n = m, n
    return list(best) if best is not None else None


def _params_of(entry: object, where: str) -> list[nn.Parameter]:
    if isinstance(entry, nn.Parameter):
        return [entry]
    if isinstance(entry, nn.Module):
        return [p for p in entry.parameters() if p.requires_grad]
    if isinstance(entry, (list, tuple)):
        out: list[nn.Parameter] = []
        for i, e in enumerate(entry):
            out.extend(_params_of(e, f"{where}[{i}]"))
        return out
    raise TypeError(
        f"fragments{where} must be a module, a Parameter or a list of them, got {type(entry).__name__}"
    )


def plan_fragments(
    model: nn.Module, num_fragments: int, fragments: FragmentSpec = None
) -> list[list[nn.Parameter]]:
    """Which trainable parameters go to which fragment (each parameter exactly once)."""
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ValueError("model has no trainable parameters (requires_grad=True); nothing to synchronise")
    if callable(fragments) and not isinstance(fragments, nn.Module):
        fragments = fragments(model)
    groups: list[list[nn.Parameter]]
    if fragments is not None:
        if not isinstance(fragments, (list, tuple)):
            raise TypeError(f"fragments must be None, a list or a callable, got {type(fragments).__name__}")
        if len(fragments) != num_fragments:
            raise ValueError(f"fragments lists {len(fragments)} entries but num_fragments={num_fragments}")
        groups = [_params_of(e, f"[{i}]") for i, e in enumerate(fragments)]
    else:
        blocks = find_blocks(model) if num_fragments > 1 else None
        units: list[list[nn.Parameter]]
        if blocks is not None:
            units = [[p for p in b.parameters() if p.requires_grad] for b in blocks]
            units = [u for u in units if u]
            what = f"{len(units)} blocks (children of the largest nn.ModuleList)"
        else:
            units = [[p] for p in params]
            what = f"{len(units)} trainable parameters (no nn.ModuleList of blocks found)"
        if num_fragments > len(units):
            raise ValueError(
                f"num_fragments={num_fragments} is larger than the model's {what}; "
                "use fewer fragments or pass fragments="
            )
        groups = [[] for _ in range(num_fragments)]
        for i, unit in enumerate(units):
            groups[i % num_fragments].extend(unit)
    seen: dict[int, int] = {}
    for f, grp in enumerate(groups):
        for p in grp:
            if id(p) in seen and seen[id(p)] != f:
                raise ValueError(
                    f"a parameter of shape {tuple(p.shape)} is listed in fragments {seen[id(p)]} and {f}"
                )
            seen[id(p)] = f
    groups = [list({id(p): p for p in grp}.values()) for grp in groups]
    sizes = [sum(p.numel() for p in grp) for grp in groups]
    for p in params:  # leftovers: balance by element count, deterministic on every rank
        if id(p) not in seen:
            f = min(range(num_fragments), key=lambda i: (sizes[i], i))
            groups[f].append(p)
            sizes[f] += p.numel()
            seen[id(p)] = f
    for f, grp in enumerate(groups):
        if not grp:
            raise ValueError(f"fragment {f} holds no parameters; use fewer fragments")
    return groups


def _refuse_meta(model: nn.Module) -> None:
    """A meta tensor holds no values to broadcast, pack or check (2 ranks failed in the join on
    Tensor.item(), one rank trained until its first sync): refused before anything changes."""
    for kind, named in (("parameter", model.named_parameters()), ("buffer", model.named_buffers())):
        for n, t in named:
            if t.is_meta:
                raise ValueError(
                    f"model: {kind} {n!r} is on the meta device and holds no values to synchronise; "
                    "materialise the model first (e.g. model.to_empty(device=...), then initialise or "
                    "load its weights) and wrap it after"
                )


class FlatFragments:
    """The K fragments of a model as slices of one flat buffer (see the module docstring).

    Attributes:
        flat: (n,) contiguous buffer, the model's parameter dtype; the parameters are views of it.
        dtype: the parameters' dtype; master_dtype: the dtype of the outer state that goes with
            them (g, u, snapshots): float32 for bf16 / fp16 parameters, else ``dtype``.
        offsets: (K+1,) int64 on flat's device, fragment p = flat[offsets[p]:offsets[p+1]].
        bounds: the same offsets as Python ints.
        params: per fragment, the Parameters in buffer order.
        names: per fragment, their qualified names in the model (``model.get_parameter(name)``).
    """

    def __init__(self, model: nn.Module, num_fragments: int, fragments: FragmentSpec = None) -> None:
        bind_fsdp(model)  # FSDP2: resharded, each parameter tagged with the padded shard it all-gathers
        groups = plan_fragments(model, num_fragments, fragments)
        in_model = {id(p) for p in model.parameters()}
        for f, grp in enumerate(groups):
            for p in grp:
                if id(p) not in in_model:
                    raise ValueError(
                        f"fragments[{f}] lists a parameter of shape {tuple(p.shape)} that is "
                        "not "
                        "a parameter of the model"
                    )
        devices = {p.device for grp in groups for p in grp}
        if len(devices) != 1:
            raise ValueError(
                f"model parameters are on mixed devices {sorted(map(str, devices))}; "
                "move the model to one device before wrapping"
            )
        _refuse_meta(model)
        dtypes = {p.dtype for grp in groups for p in grp}
        if len(dtypes) != 1 or next(iter(dtypes)) not in PARAM_DTYPES:
            raise TypeError(
                "trainable parameters must all have one dtype of "
                f"{', '.join(str(d).replace('torch.', '') for d in PARAM_DTYPES)}, got "
                f"{sorted(str(d) for d in dtypes)}; convert the model (e.g. model.to(torch.bfloat16)) "
                "before wrapping it"
            )
        self.device = next(iter(devices))
        self.dtype = next(iter(dtypes))
        self.master_dtype = master_dtype(self.dtype)
        self.params = groups
        bounds = [0]
        for grp in groups:
            bounds.append(bounds[-1] + sum(buffer_numel(p) for p in grp))
        self.bounds = bounds
        self.flat = torch.empty(bounds[-1], dtype=self.dtype, device=self.device)
        off = 0
        with torch.no_grad():
            for grp in groups:
                for p in grp:
                    # same Parameter object: optimizer refs and state stay valid; a DTensor's local
                    # shard views the buffer instead (runtime/sharding.py)
                    attach(p, self.flat[off : off + buffer_numel(p)])
                    off += buffer_numel(p)
        self.offsets = torch.tensor(bounds, dtype=torch.int64, device=self.device)
        qual = {id(p): n for n, p in model.named_parameters()}
        self.names = [[qual[id(p)] for p in grp] for grp in groups]
        self.shapes = [[viewing(p).shape for p in grp] for grp in groups]  # as wrapped: a view keeps these

    @property
    def num_fragments(self) -> int:
        return len(self.params)

    @property
    def numel(self) -> int:
        return self.bounds[-1]

    def sizes(self) -> list[int]:
        return [self.bounds[i + 1] - self.bounds[i] for i in range(self.num_fragments)]

    def tensor_bounds(self, p: int) -> list[int]:
        """Offsets of fragment p's parameter tensors inside the fragment: [0, n_0, n_0 + n_1, ..,
        size_p] (tensor i is ``slice(buf, p)[b[i]:b[i+1]]``; a sharded tensor counts its local shard)."""
        bounds = [0]
        for prm in self.params[p]:
            bounds.append(bounds[-1] + buffer_numel(prm))
        return bounds

    def slice(self, buf: torch.Tensor, p: int) -> torch.Tensor:
        """Fragment p of any buffer laid out like ``flat`` (g, u, ...): a contiguous view."""
        return buf[self.bounds[p] : self.bounds[p + 1]]

    def x(self, p: int) -> torch.Tensor:
        return self.slice(self.flat, p)

    def broken_view(self, model: nn.Module) -> str | None:
        """None while every parameter still is the wrapped Parameter object and views the flat
        buffer; otherwise a sentence naming the first one that does not (``model.to()``,
        ``model.double()``, ``param.data = ...`` or ``load_state_dict(assign=True)`` after wrapping).
        A pointer comparison per parameter: cheap enough to run at every sync."""
        off = 0
        for f, grp in enumerate(self.params):
            for i, p in enumerate(grp):
                name = self.names[f][i]
                try:
                    current = model.get_parameter(name)
                except AttributeError:
                    current = None
                if current is not p:
                    return (
                        f"parameter {name!r} (fragment {f}) was replaced by another Parameter object "
                        "after wrapping (e.g. by load_state_dict(assign=True)); the strategy and the "
                        "inner optimizer still hold the old one"
                    )
                d = viewing(p)
                if (
                    not views_slot(d, self.flat, off)
                    or extra_view_problem(p) is not None
                    or d.dtype != self.flat.dtype
                    or d.device != self.flat.device
                    or d.shape != self.shapes[f][i]
                    or not d.is_contiguous()
                ):
                    return (
                        f"parameter {name!r} (fragment {f}) no longer views the strategy's flat buffer "
                        f"(it is now {d.dtype} on {d.device}): param.data was reassigned after wrapping "
                        "(by model.to(), model.double(), p.data = ... or the like)"
                    )
                off += buffer_numel(p)
        return None

    def check_views(self, model: nn.Module) -> None:
        """Raise RuntimeError naming the first parameter that no longer views the flat buffer."""
        msg = self.broken_view(model)
        if msg is not None:
            raise RuntimeError(msg)
