"""Plumbing shared by the op modules: calling the csrc ABI, and the two ways a public op runs.

Eager: the public function calls the op's implementation directly, the same function the
registered ``torch.ops.lowcomm.*`` op runs as its body (checks, backend choice, launch). Going
through the dispatcher would add ~20 µs to a call that otherwise costs a few, and the per-fragment
ops run once per fragment per sync.

Under ``torch.compile`` the public function is traced and calls the registered op through
``traced_call``. The op's body then checks everything at run time, on the real data: aliasing,
index ranges and scalar values cannot be checked on the fake tensors of a trace, and a symbolic
float cannot be compared while tracing. A bad call therefore raises the same ValueError/TypeError
as in eager, from the compiled code, before anything is written. While tracing, only the kind of
each argument is checked (tensor, real number, bool, ...): a wrong kind would otherwise fail inside
the tracer with a message that does not start with the argument's name.

The fake kernels (what a trace, or a call on meta tensors, runs instead of the body) check one
thing: that every tensor is on one device. Metadata is all they have, and a meta tensor mixed with
real ones would otherwise reach the compiled code and fail there without naming an argument.
"""

from __future__ import annotations

import torch

from .. import _native


def compiling() -> bool:
    return torch.compiler.is_compiling()


# schema type -> (accepted Python types, how the error message words it)
_KINDS: dict[str, tuple[tuple[type, ...], str]] = {
    "Tensor": ((torch.Tensor,), "a torch.Tensor"),
    "Optional[Tensor]": ((torch.Tensor, type(None)), "a torch.Tensor or None"),
    "float": ((int, float), "a real number"),
    "int": ((int,), "an int"),
    "bool": ((bool,), "a bool"),
    "str": ((str,), "a str"),
    "Optional[str]": ((str, type(None)), "a str or None"),
    "Device": ((torch.device,), "a torch.device"),
}

#: op name -> ((argument name, accepted types, wording), ...), read from the schema at import
#: (dynamo cannot iterate a schema while tracing).
ARG_KINDS: dict[str, tuple[tuple[str, tuple[type, ...], str], ...]] = {}


def declare(name: str) -> None:
    """Record the argument kinds of the registered op ``lowcomm::<name>`` for ``traced_call``."""
    schema = getattr(torch.ops.lowcomm, name).default._schema
    ARG_KINDS[name] = tuple((a.name, *_KINDS[str(a.type)]) for a in schema.arguments)


def traced_call(name: str, *args: object) -> object:
    """``torch.ops.lowcomm.<name>(*args)`` from a public function that torch.compile is tracing:
    each argument's kind is checked here (a TypeError naming it); the op's body checks the rest
    when the compiled code runs."""
    for i, (arg, types, wording) in enumerate(ARG_KINDS[name]):  # (zip's strict= does not trace)
        value = args[i]
        if not isinstance(value, types) or (isinstance(value, bool) and bool not in types):
            raise TypeError(f"{arg} must be {wording}, got {type(value).__name__}")
    return getattr(torch.ops.lowcomm, name)(*args)


def cpu_call(name: str, *args: object) -> None:
    lib = _native.cpu_lib()
    assert lib is not None, "dispatch chose 'cpu' without the native library"
    _native.check(getattr(lib, name)(*args), name)


def cuda_call(name: str, device: torch.device, *args: object) -> None:
    lib = _native.cuda_lib()
    assert lib is not None, "dispatch chose 'cuda' without liblowcomm_cuda"
    cuda_name = name.replace("lc_", "lc_cuda_", 1)
    _native.check(getattr(lib, cuda_name)(*args, _native.stream_ptr(device)), cuda_name)


def code(t: torch.Tensor) -> int:
    return _native.DTYPE_CODE[t.dtype]


def ptr(t: torch.Tensor | None) -> int | None:
    return _native.ptr(t)
