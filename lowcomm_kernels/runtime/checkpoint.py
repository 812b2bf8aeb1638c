"""Checkpoint files: atomic, checksummed, loaded with ``weights_only=True``, every tensor checked.

File layout (one file per rank)::

    b"LOWCOMM-CHECKPOINT\\n"                       magic
    {"format_version": 2, "payload_bytes": n, "sha256": "..."}\\n   one line of JSON
    <n bytes: torch.save of the state dict>

The SHA-256 covers every byte of the payload, so a flipped bit anywhere (tensor data included, which
``torch.load`` cannot notice) is refused before anything is loaded. Writing goes to a temporary file
in the same directory, flushed and fsynced, then ``os.replace``: a crash or a full disk leaves the
previous checkpoint byte-identical.

``expect_tensor`` is the one place that checks a loaded tensor's type, dtype and shape;
``check_optimizer_state`` checks an inner optimizer's state against its parameters.
"""

from __future__ import annotations

import hashlib
import io
import json
import math
import os
from typing import Any

import torch

MAGIC = b"LOWCOMM-CHECKPOINT\n"
FILE_VERSION = 2


class CheckpointError(ValueError):
    """A checkpoint that does not belong to this strategy (version, method, shape), fails its
    checksum, holds a tensor of the wrong dtype or shape, or is unreadable."""


def write_checkpoint(obj: dict[str, Any], path: str | os.PathLike) -> None:
    """Serialise ``obj`` to ``path`` atomically with a checksum (see the module docstring)."""
    path = os.fspath(path)
    buf = io.BytesIO()
    torch.save(obj, buf)
    payload = buf.getbuffer()
    header = (
        json.dumps(
            {
                "format_version": FILE_VERSION,
                "payload_bytes": len(payload),
                "sha256": hashlib.sha256(payload).hexdigest(),
            }
        ).encode()
        + b"\n"
    )
    tmp = f"{path}.tmp.{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            f.write(MAGIC)
            f.write(header)
            f.write(payload)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def read_checkpoint(path: str | os.PathLike) -> dict[str, Any]:
    """Read and verify a file written by ``write_checkpoint``; ``CheckpointError`` if it is not one,
    is truncated or fails its checksum. Tensors come back on the CPU."""
    path = os.fspath(path)
    with open(path, "rb") as f:  # FileNotFoundError passes through unchanged
        data = f.read()
    if not data.startswith(MAGIC):
        raise CheckpointError(
            f"{path!r} is not a lowcomm checkpoint (no header; files written before "
            f"format version {FILE_VERSION} carry no checksum and are not read)"
        )
    end = data.find(b"\n", len(MAGIC))
    try:
        header = json.loads(data[len(MAGIC) : end])
        version, size, digest = header["format_version"], int(header["payload_bytes"]), str(header["sha256"])
    except Exception as e:
        raise CheckpointError(f"{path!r}: unreadable checkpoint header ({type(e).__name__}: {e})") from e
    if version != FILE_VERSION:
        raise CheckpointError(
            f"{path!r}: checkpoint format version {version} is not supported "
            f"(this build reads version {FILE_VERSION})"
        )
    payload = memoryview(data)[end + 1 :]
    if len(payload) != size:
        raise CheckpointError(
            f"{path!r} is truncated or has trailing bytes: payload is "
            f"{len(payload)} bytes, "
            f"the header says {size}"
        )
    if hashlib.sha256(payload).hexdigest() != digest:
        raise CheckpointError(f"{path!r} fails its SHA-256 checksum: the file is corrupted")
    try:
        obj = torch.load(io.BytesIO(payload), map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(f"cannot read checkpoint {path!r}: {type(e).__name__}: {e}") from e
    if not isinstance(obj, dict):
        raise CheckpointError(f"{path!r} does not hold a checkpoint dictionary")
    return obj


def expect_tensor(name: str, value: object, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """``value`` if it is a tensor of exactly ``shape`` and ``dtype``; else CheckpointError naming it."""
    if not isinstance(value, torch.Tensor):
        raise CheckpointError(f"checkpoint entry {name} should be a tensor, got {type(value).__name__}")
    if tuple(value.shape) != tuple(shape) or value.dtype != dtype:
        raise CheckpointError(
            f"checkpoint entry {name} is {value.dtype} of shape {tuple(value.shape)}; "
            f"this strategy needs {dtype} of shape {tuple(shape)}"
        )
    return value


#: per-parameter state of torch.optim's optimizers that has its parameter's shape (Adam's moments,
#: SGD's momentum, RMSprop's and Adadelta's averages, Adagrad's sum, Rprop's, ASGD's and Adamax's);
#: an entry of another optimizer is held to the shape of this optimizer's own entry, where it has one
PARAM_SHAPED_STATE = frozenset(
    "exp_avg exp_avg_sq max_exp_avg_sq momentum_buffer square_avg acc_delta grad_avg sum prev "
    "step_size ax exp_inf".split()
)


def check_optimizer_state(sd: object, opt: torch.optim.Optimizer, names: dict[int, str]) -> None:
    """Everything ``opt.load_state_dict(sd)`` reads, checked before anything is loaded (a state
    entry of the wrong shape, or a negative or non-finite step, used to load and break the next
    step): the parameter groups and their sizes, the parameter of each state entry, every state
    tensor's shape (floating point: torch casts it to the parameter's dtype) and a finite step >= 0.
    ``names``: id(parameter) -> its name, for the messages. CheckpointError naming the entry."""
    if not (
        isinstance(sd, dict)
        and isinstance(sd.get("state"), dict)
        and isinstance(sd.get("param_groups"), list)
    ):
        raise CheckpointError(
            "checkpoint entry optimizer should be an optimizer state_dict (state, param_groups)"
        )
    groups, saved = opt.param_groups, sd["param_groups"]
    if len(saved) != len(groups):
        raise CheckpointError(
            f"checkpoint entry optimizer has {len(saved)} parameter groups but this inner optimizer has "
            f"{len(groups)}"
        )
    params: dict[Any, torch.Tensor] = {}
    for i, (group, s) in enumerate(zip(groups, saved, strict=True)):
        ids = s.get("params") if isinstance(s, dict) else None
        if not isinstance(ids, list) or len(ids) != len(group["params"]):
            held = len(ids) if isinstance(ids, list) else repr(ids)
            raise CheckpointError(
                f"checkpoint entry optimizer param_groups[{i}] holds {held} parameters but this inner "
                f"optimizer's group {i} holds {len(group['params'])}"
            )
        params.update(zip(ids, group["params"], strict=True))
    for pid, state in sd["state"].items():
        if pid not in params or not isinstance(state, dict):
            raise CheckpointError(
                f"checkpoint entry optimizer state[{pid!r}] should be a dict for a parameter listed in "
                "its param_groups"
            )
        p = params[pid]
        where = f"optimizer state of {names.get(id(p), f'parameter {pid!r}')}"
        mine = opt.state.get(p, {})
        for key, v in state.items():
            if key == "step":
                n = v.numel() if isinstance(v, torch.Tensor) else 1
                step = float(v) if n == 1 and isinstance(v, (torch.Tensor, int, float)) else math.nan
                if isinstance(v, bool) or not math.isfinite(step) or step < 0:
                    raise CheckpointError(
                        f"checkpoint entry {where}['step'] should be a finite number >= 0, got {v!r}"
                    )
                continue
            ref = mine.get(key)
            if isinstance(ref, torch.Tensor) and ref.dim() > 0:
                want = tuple(ref.shape)
            elif key in PARAM_SHAPED_STATE:
                want = tuple(p.shape)
            else:
                continue
            if v is None:  # an optimizer's "no buffer yet" (SGD's momentum_buffer)
                continue
            if (
                not isinstance(v, torch.Tensor)
                or tuple(v.shape) != want
                or (p.is_floating_point() and not v.is_floating_point())
            ):
                got = (
                    f"{v.dtype} of shape {tuple(v.shape)}"
                    if isinstance(v, torch.Tensor)
                    else type(v).__name__
                )
                raise CheckpointError(
                    f"checkpoint entry {where}[{key!r}] is {got}; the parameter needs a floating point "
                    f"tensor of shape {want}"
                )


def expect_int(name: str, value: object, lo: int, hi: int | None = None) -> int:
    """``value`` as an int in [lo, hi]; else CheckpointError naming it."""
    if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
        rng = f"[{lo}, {hi}]" if hi is not None else f">= {lo}"
        raise CheckpointError(f"checkpoint entry {name} should be an int {rng}, got {value!r}")
    return value
