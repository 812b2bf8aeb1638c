"""Plumbing shared by the op modules: the table of launchers, and the two ways a public op runs.

Launchers
    ``LAUNCHERS[(kernel, backend)]`` is the function that runs one kernel ("pack", "outer_merge",
    "taylor_norms", ...) on one backend, on arguments already checked, writing into buffers the
    op allocated. Each op module fills the table with ``launcher`` (the ``ref`` launcher, a few
    lines of torch), ``native`` (``cpu`` and ``cuda`` at once: the csrc entry point and how to
    lay out its C arguments) and ``triton`` (imported when a launch runs, so importing the package
    never imports Triton); ``launch`` is the only reader. A new backend is one entry per kernel
    (and its availability rule in ``_dispatch``); a new wire dtype is an entry in
    ``_checks.NARROW_WIRE_DTYPES`` and ``_native.DTYPE_CODE``, the kernels doing the rest.

Eager
    The public function calls the op's implementation directly, the same function the registered
    ``torch.ops.lowcomm.*`` op runs as its body (checks, backend choice, launch). Going through the
    dispatcher would add more than the rest of a small call costs (a 16-element ``ops.pack`` on a
    2-core machine: about 100 µs more on top of 70–150 µs), and the per-fragment ops run once per
    fragment per sync.

Under ``torch.compile``
    The public function is traced and calls the registered op through ``traced_call``. The op's
    body then checks everything at run time, on the real data: aliasing, index ranges and scalar
    values cannot be checked on the fake tensors of a trace, and a symbolic float cannot be
    compared while tracing. A bad call therefore raises the same ValueError/TypeError as in eager,
    from the compiled code, before anything is written. While tracing, only the kind of each
    argument is checked (tensor, real number, bool, ...): a wrong kind would otherwise fail inside
    the tracer with a message that does not start with the argument's name.

    The fake kernels (what a trace, or a call on meta tensors, runs instead of the body) check one
    thing: that every tensor is on one device. Metadata is all they have, and a meta tensor mixed
    with real ones would otherwise reach the compiled code and fail there without naming an
    argument.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import inspect
from collections.abc import Callable

import torch

from .. import _native

#: (kernel, backend) -> launcher; filled by the op modules at import (see the module docstring).
LAUNCHERS: dict[tuple[str, str], Callable[..., None]] = {}


def launcher(kernel: str, backend: str) -> Callable[[Callable[..., None]], Callable[..., None]]:
    """Decorator: the function runs `kernel` on `backend`."""

    def register(fn: Callable[..., None]) -> Callable[..., None]:
        LAUNCHERS[(kernel, backend)] = fn
        return fn

    return register


#: How ``native`` fills a C parameter that is not the launcher argument of its name: the name of
#: another launcher argument, or (argument name or names, function of their values).
Rule = str | tuple[str | tuple[str, ...], Callable[..., object]]


def c_layout(kernel: str, entry: str, rules: dict[str, Rule]) -> Callable[[tuple], list]:
    """The function from `kernel`'s launcher arguments (named as its ``ref`` launcher names them)
    to the C arguments of `entry`, in ``_native.ABI``'s order: each parameter the launcher
    argument of its name, unless `rules` has one for it. A parameter neither covers, or a rule
    for no parameter, is a TypeError here, at import."""
    names = tuple(inspect.signature(LAUNCHERS[(kernel, "ref")]).parameters)
    params = [p for p, _ in _native.ABI[entry]]
    if set(rules) - set(params):
        raise TypeError(f"{entry}: rules for no parameter: {sorted(set(rules) - set(params))}")

    def index(name: str) -> int:
        if name not in names:
            raise TypeError(f"{entry}: {kernel}'s launcher has no argument {name!r} (it has {names})")
        return names.index(name)

    plan: list[tuple[int | tuple[int, ...], Callable[..., object] | None]] = []
    for p in params:
        rule = rules.get(p, p)
        if isinstance(rule, str):
            plan.append((index(rule), None))
        elif isinstance(rule[0], str):
            plan.append((index(rule[0]), rule[1]))
        else:
            plan.append((tuple(index(n) for n in rule[0]), rule[1]))

    def layout(args: tuple) -> list:
        return [
            args[i] if f is None else f(args[i]) if type(i) is int else f(*[args[j] for j in i])
            for i, f in plan
        ]

    return layout


def native(kernel: str, entry: str, **rules: Rule) -> None:
    """`kernel` on ``cpu`` calls ``<entry>`` of liblowcomm_cpu, on ``cuda`` ``lc_cuda_<...>`` of
    liblowcomm_cuda on the current stream of the data's device (the first tensor argument's), both
    with the C arguments ``c_layout`` makes of the launcher arguments (``_native.ABI[entry]``: the
    parameters of csrc/include/lowcomm/abi.h, by name), a tensor (or None for NULL) wherever the
    ABI takes a pointer. `rules`: how the parameters that are not a launcher argument of their
    name are made (dtype codes, element counts, ...)."""
    c_args = c_layout(kernel, entry, rules)
    pointer_at = tuple(i for i, t in enumerate(_native.SIGNATURES[entry]) if t is ctypes.c_void_p)
    cuda_entry = entry.replace("lc_", "lc_cuda_", 1)

    def c_call(lib: ctypes.CDLL | None, name: str, args: tuple, *extra: object) -> None:
        assert lib is not None, f"dispatch chose a backend without the library that has {name}"
        layout = c_args(args)  # held until the call returns: mask_perm builds its round-key tensors
        c = list(layout)
        for i in pointer_at:
            if c[i] is not None:
                c[i] = c[i].data_ptr()
        _native.check(getattr(lib, name)(*c, *extra), name)

    def cpu(*args: object) -> None:
        c_call(_native.cpu_lib(), entry, args)

    def cuda(*args: object) -> None:
        device = next(a.device for a in args if isinstance(a, torch.Tensor))
        c_call(_native.cuda_lib(), cuda_entry, args, _native.stream_ptr(device))

    LAUNCHERS[(kernel, "cpu")] = cpu
    LAUNCHERS[(kernel, "cuda")] = cuda


def triton(kernel: str, module: str, function: str) -> None:
    """`kernel` on ``triton`` calls ``lowcomm_kernels.triton_kernels.<module>.<function>`` with the
    launcher arguments. Imported at each call (a dictionary lookup once imported): Triton decides
    at import whether a kernel is interpreted, and a test may re-import the modules."""

    def run(*args: object) -> None:
        getattr(importlib.import_module(f"lowcomm_kernels.triton_kernels.{module}"), function)(*args)

    LAUNCHERS[(kernel, "triton")] = run


def launch(kernel: str, backend: str, *args: object) -> None:
    """Run `kernel` on `backend` (a name ``_dispatch.resolve`` returned)."""
    try:
        fn = LAUNCHERS[(kernel, backend)]
    except KeyError:
        raise ValueError(f"backend {backend!r} has no launcher for {kernel}") from None
    fn(*args)


def code(t: torch.Tensor) -> int:
    """The ABI's dtype code of `t`."""
    return _native.DTYPE_CODE[t.dtype]


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


# ---- host-value refusals under torch.compile ------------------------------------------------------


@torch.library.custom_op("lowcomm::refuse", mutates_args=())
def _refuse(message: str) -> torch.Tensor:
    """Raise, when the compiled code runs, the ValueError a public function's host-value check
    raised while torch.compile traced it (``refusing``)."""
    raise ValueError(message)


@_refuse.register_fake
def _(message):
    return torch.empty(0)


torch.fx.node.has_side_effect(torch.ops.lowcomm.refuse.default)  # never dropped as unused


def refusing(outputs: int) -> Callable[[Callable[..., object]], Callable[..., object]]:
    """A public function whose host values (formats, block sizes, seeds, counts: Python objects known
    while tracing) are checked in Python: under torch.compile those checks run while dynamo traces
    it, and their ValueError would reach the user wrapped in dynamo's own error (``Unsupported:
    Observed exception`` with fullgraph=True). Here it becomes a lowcomm::refuse op in the graph,
    which raises the same ValueError when the compiled code runs. `outputs`: how many tensors the
    function returns (0: a single tensor), so that tracing goes on with placeholders."""

    def wrap(fn: Callable[..., object]) -> Callable[..., object]:
        @functools.wraps(fn)
        def public(*args: object, **kwargs: object) -> object:
            if not compiling():
                return fn(*args, **kwargs)
            try:
                return fn(*args, **kwargs)
            except ValueError as e:
                r = torch.ops.lowcomm.refuse(str(e))
                return r if outputs == 0 else (r,) * outputs

        return public

    return wrap
