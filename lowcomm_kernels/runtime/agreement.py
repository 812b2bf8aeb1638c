"""Joining the group: every rank checks that it runs the same job, then starts from rank 0's state.

A strategy's collectives pair up only if every rank wraps the same model with the same method and
schedule. When they do not, gloo either averages pseudo-gradients of different steps without a
word or aborts the process (SIGABRT on a size mismatch). So before the first collective that
depends on the configuration, every rank describes what must match as named fields (method, every
schedule knob, the wire format, each parameter's name/shape/dtype and fragment, each frozen
parameter and buffer) and the group compares them:

1. all-gather one 64-bit digest of the description (fixed size, so it pairs up whatever differs);
2. only if the digests differ, all-gather the descriptions themselves and raise
   ``ConfigMismatchError`` on EVERY rank, naming the first field that differs and each rank's value.

Collectives pair up by the order in which each rank issues them, not by which model they belong to:
two strategies over models of the same structure, built in another order on another rank, pass the
comparison above and then average model A on one rank with model B on the other. So every rank also
counts the strategies it joined over the group before (an agreed field), and ``check_pairing``
all-gathers a fingerprint of each one's initial trainable values (a sample of the flat buffer, taken
before rank 0's values are broadcast): when two ranks start this strategy from different values, each
from the values the other gave an earlier strategy, the strategies were built in another order, and
every rank raises ``ConfigMismatchError``. Ranks that start from different random values
(different seeds) leave nothing to compare; building strategies in the same order on every rank is
then the user's part (documented).

Then ``broadcast_module_state`` makes every rank start from group-rank 0's values of the trainable
parameters (the flat buffer) and of the frozen parameters and buffers, as DDP does.
"""

from __future__ import annotations

import datetime
import hashlib
import itertools
import pickle
import weakref
from typing import Any

import torch
from torch import nn

from .sharding import local
from .transport import SyncError, Transport


class ConfigMismatchError(ValueError):
    """Ranks of one group were given different configurations or models; names the first difference."""


def _digest(fields: dict[str, Any]) -> int:
    return (
        int.from_bytes(hashlib.blake2b(repr(list(fields.items())).encode(), digest_size=8).digest(), "little")
        >> 1
    )


def _gather_bytes(transport: Transport, data: bytes, name: str) -> list[bytes]:
    """All-gather variable-length byte strings (lengths first, then padded payloads)."""
    dev = transport.device
    n = torch.tensor([len(data)], dtype=torch.int64, device=dev)
    sizes = [int(s.item()) for s in transport.blocking_all_gather(n, name=name)]
    buf = torch.zeros(max(sizes), dtype=torch.uint8, device=dev)
    buf[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8).to(dev)
    outs = transport.blocking_all_gather(buf, name=name)
    return [bytes(o[:s].cpu().numpy().tobytes()) for o, s in zip(outs, sizes, strict=True)]


def first_difference(described: list[dict[str, Any]]) -> str | None:
    """The first field (in rank 0's order, then any other rank's) whose value differs between ranks,
    as a sentence with each rank's value; None when all agree."""
    keys: list[str] = []
    for d in described:
        keys.extend(k for k in d if k not in keys)
    missing = "<absent>"
    for k in keys:
        vals = [d.get(k, missing) for d in described]
        if any(v != vals[0] for v in vals[1:]):
            shown = ", ".join(f"rank {r}: {v!r}" for r, v in enumerate(vals[:8]))
            more = f", ... ({len(vals)} ranks)" if len(vals) > 8 else ""
            return f"{k} ({shown}{more})"
    return None


def agree(transport: Transport, fields: dict[str, Any], what: str) -> None:
    """Raise ``ConfigMismatchError`` on every rank unless ``fields`` is identical on all of them.
    Values must be plain Python data (compared with ``==``, shown with ``repr``)."""
    if transport.world == 1:
        return
    name = f"agreement on the {what} configuration"
    mine = torch.tensor([_digest(fields)], dtype=torch.int64, device=transport.device)
    digests = [int(d.item()) for d in transport.blocking_all_gather(mine, name=name)]
    if all(d == digests[0] for d in digests):
        return
    described = [pickle.loads(b) for b in _gather_bytes(transport, pickle.dumps(fields), name)]
    diff = first_difference(described) or "the configuration (digests differ, fields compare equal)"
    raise ConfigMismatchError(
        f"ranks of the {what} process group were given different configurations; "
        f"the first difference is {diff}. Every rank must wrap the same model "
        "with the same method, schedule and wire format."
    )


# per process group: a fingerprint of the initial values of each strategy this process joined over it,
# in the order it joined them (a weak key: a destroyed group takes its list with it)
_joined: weakref.WeakKeyDictionary[Any, list[int]] = weakref.WeakKeyDictionary()
_SAMPLE = 4096  # about this many elements of the flat buffer make its fingerprint


def joined_before(transport: Transport) -> int:
    """How many strategies this process joined over the transport's group before (agreed: ranks that
    built a different number of them cannot pair their collectives)."""
    return len(_joined.get(transport.group, ()))


def value_fingerprint(flat: torch.Tensor) -> int:
    """63-bit hash of an evenly strided sample of ``flat``: cheap for any model size, and random
    initial values of two models never share a sample."""
    sample = flat.detach()[:: max(1, flat.numel() // _SAMPLE)].contiguous().cpu()
    data = sample.view(torch.uint8).numpy().tobytes()
    return int.from_bytes(hashlib.blake2b(data, digest_size=8).digest(), "little") >> 1


def check_pairing(transport: Transport, flat: torch.Tensor, what: str) -> None:
    """After ``agree`` and before the broadcast: raise ``ConfigMismatchError`` on every rank when the
    strategies this process joined over the group were built in another order on another rank (see
    the module docstring); otherwise record this one."""
    if transport.world == 1:
        return
    history = _joined.setdefault(transport.group, [])
    k = len(history)  # agreed in the fields: the same on every rank
    mine = torch.tensor([*history, value_fingerprint(flat)], dtype=torch.int64, device=transport.device)
    name = f"agreement on the order of the {what} strategies"
    table = [[int(v) for v in t.tolist()] for t in transport.blocking_all_gather(mine, name=name)]
    now = [row[k] for row in table]
    for r, s in itertools.combinations(range(len(table)), 2):
        # a swap: each rank's values now are the other's of an earlier strategy (one direction alone
        # is also a run that reseeds each rank differently from strategy to strategy)
        if now[r] != now[s] and now[r] in table[s][:k] and now[s] in table[r][:k]:
            i, j = table[s].index(now[r]), table[r].index(now[s])
            raise ConfigMismatchError(
                f"ranks built their strategies over this process group in different orders: rank {r}'s "
                f"strategy #{k} (counting from 0; this {what}) starts from the values of rank {s}'s "
                f"strategy #{i}, and rank {s}'s from those of rank {r}'s strategy #{j}. Collectives pair "
                "up in the order they are issued, so one model would be averaged with another; build "
                "the strategies in the same order on every rank"
            )
    history.append(now[transport.rank])


def module_fields(model: nn.Module, names: list[list[str]]) -> dict[str, Any]:
    """What must match about the model: trainable parameters with their fragment, frozen parameters
    and buffers, each as (shape, dtype)."""
    out: dict[str, Any] = {}
    frag = {n: f for f, grp in enumerate(names) for n in grp}
    for n, p in model.named_parameters():
        if n in frag:
            out[f"parameter {n!r}"] = (tuple(p.shape), str(p.dtype), f"fragment {frag[n]}")
        else:
            out[f"frozen parameter {n!r}"] = (tuple(p.shape), str(p.dtype))
    for n, b in model.named_buffers():
        out[f"buffer {n!r}"] = (tuple(b.shape), str(b.dtype))
    return out


def broadcast_module_state(
    transport: Transport, flat: torch.Tensor, model: nn.Module, trainable: set[int]
) -> None:
    """Every rank takes group-rank 0's flat parameter buffer, frozen parameters and buffers."""
    if transport.world == 1:
        return
    extra = [local(p.data) for p in model.parameters() if id(p) not in trainable]  # DTensor: its shard
    extra += [b for b in model.buffers()]
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in extra:
        if t.numel() > 0:
            by_dtype.setdefault(t.dtype, []).append(t)
    _broadcast(transport, flat, 0, "the parameters")
    for dtype, ts in by_dtype.items():  # one broadcast per dtype; bool travels as uint8
        packed = torch.cat([t.detach().reshape(-1).to(flat.device) for t in ts])
        wire = packed.view(torch.uint8) if dtype == torch.bool else packed
        _broadcast(transport, wire, 0, f"the frozen parameters and buffers ({dtype})")
        _unpack_into(packed, ts)


def broadcast_buffers(transport: Transport, model: nn.Module, src: int, take: bool) -> None:
    """Group-rank ``src``'s floating buffers to every rank; only ranks with ``take`` keep them (the
    others receive into scratch). Collective: every rank calls it at the same point."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for b in model.buffers():
        if b.is_floating_point() and b.numel() > 0:
            by_dtype.setdefault(b.dtype, []).append(b)
    for dtype, ts in by_dtype.items():
        packed = torch.cat([t.detach().reshape(-1).to(transport.device) for t in ts])
        _broadcast(transport, packed, src, f"the buffers ({dtype}) of rank {src}")
        if take:
            _unpack_into(packed, ts)


@torch.no_grad()
def _unpack_into(packed: torch.Tensor, ts: list[torch.Tensor]) -> None:
    """Copy consecutive slices of the flat `packed` back into the tensors it was concatenated from."""
    off = 0
    for t in ts:
        t.copy_(packed[off : off + t.numel()].view_as(t))
        off += t.numel()


def _broadcast(transport: Transport, t: torch.Tensor, src: int, what: str) -> None:
    """Broadcast from group rank ``src``, bounded by the transport's timeout."""
    work = transport.start_broadcast(t, src)
    try:
        ok = work.wait(timeout=datetime.timedelta(seconds=transport.timeout_s))
    except Exception as e:
        raise SyncError(f"initial broadcast of {what} from rank {src} failed: {e}") from e
    if ok is False:
        raise SyncError(
            f"initial broadcast of {what} from rank {src} did not complete within {transport.timeout_s} s"
        )
