"""Compile the Triton kernels for real GPU targets, without a GPU, exactly as the launchers launch them.

    python tools/aot_check.py [--arch 80 90] [--quick] [--jobs N] [-k TEXT]

A maintenance tool of the source tree (not part of the installed package): it imports the kernels of
``lowcomm_kernels.triton_kernels`` from the checkout it sits in, or from the installed package.

The interpreter tests run the kernels' Python semantics; they cannot see what only the compiler
checks (types of loop bounds, scalar annotations, bitcasts, 64-bit atomics, ``while`` on a
reduction). ``triton.compile`` with an explicit ``GPUTarget`` runs the whole pipeline (TTIR ->
TTGIR -> LLVM -> PTX -> cubin with the ptxas Triton ships) on a CPU-only machine, so this catches
those errors before a GPU ever sees the code.

What is compiled is not written out by hand: each case calls a real ``launch_*`` function on
stand-in CPU tensors (``_launch.compiling_for`` gives them a GPU's geometry), with the kernels
replaced by recorders, and each recorded launch is specialised by Triton's own argument binder,
as ``JITFunction.run`` would specialise it on a GPU: the pointer alignments (16-byte or not), the
integer kinds (int32 or int64, divisible by 16 or not, == 1), the constexprs, warps and options.
Identical specialisations are compiled once.

The full mode covers every variant the launchers can launch on the targets: each op's flags and
dtype pairings, sizes n ∈ {1, int32, int32 divisible by 16, int64, int64 divisible by 16}, and
three alignment patterns -- all 16-byte aligned; the runtime's (parameter fragments are views at
any element offset, the buffers the ops allocate are aligned); all unaligned (a user's views).
(Alignment is decided per pointer, so these three are what the runtime and its users produce,
not every combination; each pointer's aligned and unaligned code is compiled.) The reductions'
programs per segment and their finishing kernels run over every power-of-two block they can
take. ``--quick`` (CI) compiles one variant per kernel and dtype pairing, spread so that every
alignment pattern, size kind and DiLoCo's default merge (momentum, Nesterov, α = β = λ = 0) is
among them, and each bf16 / fp16 parameter pairing, and each quantized wire format's pack (error
feedback with stochastic rounding, plain, quantize), dequantize and reduction: about 140
compilations. The full mode is about 5700 (~35 min on two cores; ``--jobs``, ``-k`` to pick cases,
e.g. ``-k quantiz`` for the 2400 of the quantized formats: every format x dtype pairing x mode at
every size and alignment with the default block, and blocks 2 and 4096 at one).

For each compiled variant it prints the registers per thread (from the cubin) and the number of
128-bit global loads/stores in the PTX (the elementwise kernels vectorise fully on aligned data),
and it checks what the PTX must contain (``_ptx_violations``). Must run without TRITON_INTERPRET (it
is removed here before the kernel modules are imported).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import functools
import importlib
import itertools
import multiprocessing
import os
import re
import struct
import sys
import time
from collections.abc import Callable, Iterator
from typing import Any

if __package__ in (None, ""):  # run as a script: the checkout's package first
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

PACKAGE = "lowcomm_kernels.triton_kernels"
MODULES = ("pack", "outer_merge", "mask_indices", "sparse", "fragment_norms", "quantize", "topk")
SMS = {80: 108, 90: 132}  # A100, H100/H200: the programs per SM of the reductions scale with it
#: n (or k) of each size kind: how Triton specialises an integer argument
SIZES = {"n=1": 1, "i32": 4099, "i32/16": 65536, "i64": 2**31 + 3, "i64/16": 2**31 + 16}
ALIGNS = ("aligned", "runtime", "unaligned")
#: programs of a two-stage reduction: every next_power_of_2 block of its finishing kernel, with a
#: count that is and one that is not divisible by 16 where the block allows it
PROGRAM_COUNTS = (2, 3, 5, 9, 16, 17, 32, 33, 48, 65, 80, 129, 144, 257, 272, 513, 528)


# ---- stand-in tensors and recorded launches --------------------------------------------------


def _tensor(n: int, dtype: Any, role: str, align: str) -> Any:
    """n elements of `dtype` on the CPU, without n elements of memory (stride 0 beyond one).

    role: "view" (the caller's data, a fragment view at any offset), "out" (a buffer the caller
    may pass, an op-allocated one in the runtime) or "fresh" (always allocated by an op or
    launcher). Unaligned (off a 16-byte boundary by one element) in the `align` patterns where
    that role can be."""
    import torch

    unaligned = (role == "view" and align != "aligned") or (role == "out" and align == "unaligned")
    base = torch.empty(2, dtype=dtype)
    one = base[1:2] if unaligned else base[0:1]
    assert (one.data_ptr() % 16 == 0) != unaligned
    return one.expand(n) if n != 1 else one


@dataclasses.dataclass
class Launch:
    label: str
    kernel: Any  # the JITFunction
    args: tuple
    kwargs: dict


class _Recorder:
    """Stands in for a kernel: ``kernel[grid](*args, **kwargs)`` records the launch."""

    def __init__(self, kernel: Any, name: str, sink: list[tuple[Any, str, tuple, dict]]):
        self.kernel, self.name, self.sink = kernel, name, sink

    def __getitem__(self, grid: object) -> Callable[..., None]:
        return lambda *args, **kwargs: self.sink.append((self.kernel, self.name, args, kwargs))


@contextlib.contextmanager
def _recording(sink: list, arch: int) -> Iterator[None]:
    from triton.runtime.jit import JITFunction

    _launch = importlib.import_module(f"{PACKAGE}._launch")
    mods = [importlib.import_module(f"{PACKAGE}.{m}") for m in MODULES]
    saved = []
    for mod in mods:
        for name, obj in list(vars(mod).items()):
            if isinstance(obj, JITFunction) and name.endswith("_kernel"):
                saved.append((mod, name, obj))
                setattr(mod, name, _Recorder(obj, name, sink))
    try:
        with _launch.compiling_for(_launch.GpuTarget(SMS.get(arch, 132), (arch // 10, arch % 10))):
            yield
    finally:
        for mod, name, obj in saved:
            setattr(mod, name, obj)


# ---- the cases: launcher calls ---------------------------------------------------------------


def _cases(quick: bool) -> Iterator[tuple[str, Callable[[], None]]]:
    """(label, call) for every launcher call to record (see the module docstring)."""
    import torch

    # From sys.modules (as _recording patches them), not the package's attributes, which may still
    # point at modules imported earlier under the interpreter.
    pack, outer_merge, mask_indices, sparse, fragment_norms, quantize, topk = (
        importlib.import_module(f"{PACKAGE}.{m}") for m in MODULES
    )
    f32, f64, bf16 = torch.float32, torch.float64, torch.bfloat16
    name = {f32: "fp32", f64: "fp64", bf16: "bf16"}
    pairs = [(f32, f32), (f32, bf16), (f64, f64), (f64, bf16)]  # (data, wire/avg)

    def full_or(quick_list: list, *axes: Any) -> list:
        return quick_list if quick else list(itertools.product(*axes))

    def scatter_merge(x_dt, avg_dt, sent_dt, k: int, align: str) -> None:
        idx = _tensor(k, torch.int64, "out", align)
        x, avg, sent = (
            _tensor(k, x_dt, "view", align),
            _tensor(k, avg_dt, "out", align),
            _tensor(k, sent_dt, "out", align),
        )
        sparse.launch_sparse_scatter_merge(x, idx, avg, sent, 0.7)

    # pack(g, x, delta, snapshot, nonfinite)
    for (dt, wire), snap, size, align in full_or(
        [
            ((f32, f32), True, "i32", "aligned"),
            ((f32, bf16), False, "i32", "runtime"),
            ((f64, f64), True, "i64/16", "unaligned"),
            ((f64, bf16), True, "n=1", "aligned"),
        ],
        pairs,
        [True, False],
        SIZES,
        ALIGNS,
    ):
        n = SIZES[size]

        def call(dt=dt, wire=wire, snap=snap, n=n, align=align):
            pack.launch_pack(
                _tensor(n, dt, "view", align),
                _tensor(n, dt, "view", align),
                _tensor(n, wire, "out", align),
                _tensor(n, dt, "out", align) if snap else None,
                _tensor(1, torch.int64, "fresh", align)[0],
            )

        yield f"pack {name[dt]}->{name[wire]} snapshot={snap} {size} {align}", call

    # outer_merge(g, u, delta_avg, x, x_sent, lr, momentum, nesterov, alpha, beta, lam, lam_sums)
    diloco = (0.9, True, 0.0, 0.0, 0.0, False)  # momentum, nesterov, alpha, beta, lam, lam on device
    merge_modes = [
        (mom, nest, alpha, beta, lam, lam_dev)
        for mom, nest in [(0.9, True), (0.9, False), (0.0, False)]
        for alpha in (0.0, 0.5)
        for beta, lam, lam_dev in [(0.0, 0.0, False), (1.0, 0.0, False), (1.0, 0.3, True)]
    ]
    for (dt, avg), mode, size, align in full_or(
        [
            ((f32, f32), diloco, "i32", "runtime"),
            ((f32, bf16), diloco, "i32", "aligned"),
            ((f64, f64), diloco, "i64", "runtime"),
            ((f64, bf16), diloco, "n=1", "aligned"),
            ((f32, f32), (0.9, True, 0.25, 1.0, 0.3, True), "i32/16", "unaligned"),
            ((f64, bf16), (0.9, True, 0.5, 1.0, 0.0, False), "i32", "aligned"),
            ((f32, bf16), (0.9, False, 0.0, 1.0, 0.3, True), "i64/16", "runtime"),
            ((f64, f64), (0.0, False, 0.5, 0.0, 0.0, False), "i32", "aligned"),
        ],
        pairs,
        merge_modes,
        SIZES,
        ALIGNS,
    ):
        mom, nest, alpha, beta, lam, lam_dev = mode
        n = SIZES[size]

        def call(dt=dt, avg=avg, mode=mode, n=n, align=align):
            mom, nest, alpha, beta, lam, lam_dev = mode
            g, u, x = (_tensor(n, dt, "view", align) for _ in range(3))
            wire, sent = _tensor(n, avg, "out", align), _tensor(n, dt, "out", align)
            sums = _tensor(2, f64, "fresh", align).contiguous() if lam_dev else None
            outer_merge.launch_outer_merge(g, u, wire, x, sent, 0.7, mom, nest, alpha, beta, lam, sums)

        flags = f"momentum={mom} nesterov={nest and mom != 0} alpha={alpha} beta={beta} lam={lam}"
        yield f"outer_merge {name[dt]} avg={name[avg]} {flags} lam_sums={lam_dev} {size} {align}", call

    # taylor_norms(g, u, delta_avg, x, x_sent, lr, momentum, nesterov, out, programs=)
    for (dt, avg), (mom, nest), size, align in full_or(
        [
            ((f32, f32), (0.9, True), "i32", "runtime"),
            ((f32, bf16), (0.9, True), "n=1", "aligned"),
            ((f64, f64), (0.9, False), "i64/16", "unaligned"),
            ((f64, bf16), (0.0, False), "i32/16", "aligned"),
        ],
        pairs,
        [(0.9, True), (0.9, False), (0.0, False)],
        SIZES,
        ALIGNS,
    ):
        n = SIZES[size]

        def call(dt=dt, avg=avg, mom=mom, nest=nest, n=n, align=align, programs=None):
            g, u, x = (_tensor(n, dt, "view", align) for _ in range(3))
            wire, sent = _tensor(n, avg, "out", align), _tensor(n, dt, "out", align)
            sums = _tensor(2, f64, "fresh", align).contiguous()
            outer_merge.launch_taylor_norms(g, u, wire, x, sent, 0.7, mom, nest, sums, programs=programs)

        yield f"taylor_norms {name[dt]} avg={name[avg]} momentum={mom} nesterov={nest} {size} {align}", call
    if not quick:
        for p in PROGRAM_COUNTS:

            def call(p=p):
                t = [_tensor(SIZES["i64/16"], f32, "fresh", "aligned") for _ in range(5)]
                outer_merge.launch_taylor_norms(
                    *t, 0.7, 0.9, True, _tensor(2, f64, "fresh", "aligned").contiguous(), programs=p
                )

            yield f"taylor_norms programs={p}", call

    # sparse_gather(x, idx, out), sparse_scatter_merge(x, idx, avg, sent, beta)
    for dt, size, align in full_or(
        [(f32, "i32", "runtime"), (f64, "i64", "aligned")], [f32, f64], SIZES, ALIGNS
    ):
        k = SIZES[size]

        def call(dt=dt, k=k, align=align):
            sparse.launch_sparse_gather(
                _tensor(k, dt, "view", align),
                _tensor(k, torch.int64, "out", align),
                _tensor(k, dt, "out", align),
            )

        yield f"sparse_gather {name[dt]} k={size} {align}", call
    for (dt, avg), size, align in full_or(
        [
            ((f32, f32), "i32", "runtime"),
            ((f32, bf16), "i32/16", "aligned"),
            ((f64, f64), "n=1", "unaligned"),
            ((f64, bf16), "i64", "aligned"),
        ],
        pairs,
        SIZES,
        ALIGNS,
    ):
        k = SIZES[size]

        yield (
            f"sparse_scatter_merge {name[dt]} avg={name[avg]} k={size} {align}",
            functools.partial(scatter_merge, dt, avg, dt, k, align),
        )

    # fragment_norms(buf, offsets, ord, out, programs=): P = 1 (one launch), else two
    for dt, ord_, programs, align in full_or(
        [
            (f32, 2, 1, "aligned"),
            (f32, 1, 17, "runtime"),
            (f64, 2, 528, "unaligned"),
            (f64, 1, None, "runtime"),
        ],
        [f32, f64],
        [1, 2],
        [1, 17, 48, None],
        ALIGNS,
    ):

        def call(dt=dt, ord_=ord_, programs=programs, align=align):
            buf = _tensor(SIZES["i64/16"], dt, "view", align)
            offsets = _tensor(5, torch.int64, "out", align)
            fragment_norms.launch_fragment_norms(
                buf, offsets, ord_, _tensor(4, f64, "fresh", align).contiguous(), programs=programs
            )

        yield f"fragment_norms {name[dt]} ord={ord_} programs={programs or 'default'} {align}", call
    if not quick:
        for p, ord_ in itertools.product(PROGRAM_COUNTS, [1, 2]):

            def call(p=p, ord_=ord_):
                buf = _tensor(SIZES["i64/16"], f32, "fresh", "aligned")
                offsets = _tensor(5, torch.int64, "fresh", "aligned")
                out = _tensor(4, f64, "fresh", "aligned")
                fragment_norms.launch_fragment_norms(buf, offsets, ord_, out, programs=p)

            yield f"fragment_norms ord={ord_} programs={p}", call

    # mask_perm(n, k, adds, muls, shift, bitmask, out): out is always the op's own allocation. The
    # round keys are not specialised (any values give the same variant); shift and bitmask are
    # mask_keys' for n (ops.mask_indices, a layer above, is not imported here).
    for n_size, k_size in full_or([("i64/16", "i32")], SIZES, SIZES):
        n, k = SIZES[n_size], min(SIZES[k_size], SIZES[n_size])
        bits = max(1, (n - 1).bit_length())
        keys = ([5, 16, 1, 0], [3, 17, 1, 33], max(1, (bits + 1) // 2), (1 << bits) - 1)

        def call(n=n, k=k, keys=keys):
            mask_indices.launch_mask_perm(n, k, *keys, _tensor(k, torch.int64, "fresh", "aligned"))

        yield f"mask_perm n={n_size} k={k_size}", call

    # bf16 / fp16 parameters x beside their float32 master (g, u, x_sent, snapshot, sent): every
    # kernel that reads or writes x, each wire dtype, the merge's main modes, sizes and alignments
    # (quick: each (x, wire) pairing once, the merge's Taylor mode, one unaligned int64 view)
    f16 = torch.float16
    low = {bf16: "bf16", f16: "fp16"}
    wires = (f32, bf16)
    taylor = (0.9, True, 0.25, 1.0, 0.3, True)
    modes = [diloco, taylor, (0.0, False, 0.5, 0.0, 0.0, False)]
    at = [("i32", "runtime"), ("i64/16", "unaligned")]
    for xdt, wire, (size, align) in full_or(
        [(x, w, at[0]) for x in low for w in wires] + [(bf16, bf16, at[1])], low, wires, at
    ):
        n = SIZES[size]

        def call(xdt=xdt, wire=wire, n=n, align=align):
            pack.launch_pack(
                _tensor(n, f32, "view", align),
                _tensor(n, xdt, "view", align),
                _tensor(n, wire, "out", align),
                _tensor(n, f32, "out", align),
                _tensor(1, torch.int64, "fresh", align)[0],
            )

        yield f"pack x={low[xdt]} wire={name[wire]} {size} {align}", call
    for xdt, wire, mode, (size, align) in full_or(
        [(x, w, diloco, at[0]) for x in low for w in wires]
        + [(x, bf16, taylor, at[0]) for x in low]
        + [(f16, f32, diloco, at[1])],
        low,
        wires,
        modes,
        at,
    ):
        n = SIZES[size]

        def call(xdt=xdt, wire=wire, mode=mode, n=n, align=align):
            mom, nest, alpha, beta, lam, lam_dev = mode
            g, u, sent = (_tensor(n, f32, "view", align) for _ in range(3))
            x, avg = _tensor(n, xdt, "view", align), _tensor(n, wire, "out", align)
            sums = _tensor(2, f64, "fresh", align).contiguous() if lam_dev else None
            outer_merge.launch_outer_merge(g, u, avg, x, sent, 0.7, mom, nest, alpha, beta, lam, sums)

        yield f"outer_merge x={low[xdt]} avg={name[wire]} mode={mode} {size} {align}", call
    for xdt, wire, (size, align) in full_or([(x, bf16, at[0]) for x in low], low, wires, at):
        n = SIZES[size]

        def call(xdt=xdt, wire=wire, n=n, align=align):
            g, u, sent = (_tensor(n, f32, "view", align) for _ in range(3))
            x, avg = _tensor(n, xdt, "view", align), _tensor(n, wire, "out", align)
            sums = _tensor(2, f64, "fresh", align).contiguous()
            outer_merge.launch_taylor_norms(g, u, avg, x, sent, 0.7, 0.9, True, sums)

        yield f"taylor_norms x={low[xdt]} avg={name[wire]} {size} {align}", call
    for xdt, wire, (size, align) in full_or([(x, f32, at[0]) for x in low], low, wires, at):
        k = SIZES[size]

        yield (
            f"sparse_scatter_merge x={low[xdt]} avg={name[wire]} k={size} {align}",
            functools.partial(scatter_merge, xdt, wire, f32, k, align),
        )
    for xdt in low:

        def call(xdt=xdt):
            k = SIZES["i32"]
            sparse.launch_sparse_gather(
                _tensor(k, xdt, "view", "runtime"),
                _tensor(k, torch.int64, "out", "runtime"),
                _tensor(k, xdt, "out", "runtime"),
            )

        yield f"sparse_gather x={low[xdt]}", call

        def call(xdt=xdt):
            buf = _tensor(SIZES["i64/16"], xdt, "view", "runtime")
            offsets = _tensor(5, torch.int64, "out", "runtime")
            out = _tensor(4, f64, "fresh", "runtime").contiguous()
            fragment_norms.launch_fragment_norms(buf, offsets, 2, out)

        yield f"fragment_norms x={low[xdt]}", call

    yield from _quantize_cases(quantize, quick, name)
    yield from _topk_cases(topk, quick)


#: (k, chunk, bits) of the top-k launches: the defaults, 1 bit (the fp64 sum), a chunk that is not a
#: power of two, k = chunk, the smallest format, and a chunk over several tiles (the tiled path)
TOPK_FORMATS = ((64, 4096, 2), (64, 4096, 1), (256, 1000, 4), (4096, 4096, 4), (1, 2, 1), (16, 100000, 2))


def _topk_cases(topk: Any, quick: bool) -> Iterator[tuple[str, Callable]]:
    """topk_encode (fp32 delta and e: fragment views; the payload: an op's or a caller's buffer)
    and topk_decode_add (into fp32 and fp64)."""
    import torch

    def payload_bytes(n: int, k: int, chunk: int, bits: int) -> int:
        kf, kl, nc, val0, ibf, vbf, ib = topk._geometry(k, chunk, bits, n)
        return val0 + (nc - 1) * vbf + (kl * bits + 7) // 8

    cases = (
        [(f, list(SIZES)[i % 5], ALIGNS[i % 3]) for i, f in enumerate(TOPK_FORMATS)]
        if quick
        else list(itertools.product(TOPK_FORMATS, SIZES, ALIGNS))
    )
    for (k, chunk, bits), size, align in cases:
        n = SIZES[size]

        def call(k=k, chunk=chunk, bits=bits, n=n, align=align):
            topk.launch_topk_encode(
                _tensor(n, torch.float32, "view", align),
                _tensor(n, torch.float32, "view", align),
                _tensor(payload_bytes(n, k, chunk, bits), torch.uint8, "out", align),
                _tensor(1, torch.int64, "fresh", align)[0],
                k,
                chunk,
                bits,
                0.95,
            )

        yield f"topk_encode k={k} chunk={chunk} bits={bits} n={size} {align}", call
        for odt in (torch.float32, torch.float64):

            def call(k=k, chunk=chunk, bits=bits, n=n, align=align, odt=odt):
                topk.launch_topk_decode_add(
                    _tensor(n, odt, "view", align),
                    _tensor(payload_bytes(n, k, chunk, bits), torch.uint8, "out", align),
                    k,
                    chunk,
                    bits,
                )

            yield f"topk_decode_add k={k} chunk={chunk} bits={bits} out={odt} n={size} {align}", call


#: The quantized formats as the Triton launchers receive them: (BITS, IS_FLOAT, M, EMIN, QMAX), the
#: constants ops/quantize.py forms from the same table (lowcomm_kernels.wire_formats).
QFORMATS = {
    s.name: (s.bits, s.grid == "float", s.man_bits, s.emin, s.qmax)
    for s in importlib.import_module("lowcomm_kernels.wire_formats").QUANTIZED
}
QBLOCKS = (2, 128, 4096)  # the smallest block, the runtime's default, one tile's worth
SR_KEY = -0x3C6EF372FE94F82B  # a signed 64-bit stochastic-rounding key (a key of 0: no rounding stream)


def _quantize_cases(quantize: Any, quick_mode: bool, name: dict) -> Iterator[tuple[str, Callable]]:
    """pack_quantized (pack with residual / snapshot / stochastic rounding, or quantize of v),
    dequantize and reduce_quantized, for every format. Codes and scales are buffers the op
    allocates or a caller's ("out"); g, x, residual and snapshot are fragment views."""
    import torch

    f32, f64, bf16, f16 = torch.float32, torch.float64, torch.bfloat16, torch.float16

    def consts(fmt: str) -> dict:
        bits, is_float, m, emin, qmax = QFORMATS[fmt]
        return dict(BITS=bits, IS_FLOAT=is_float, M=m, EMIN=emin, QMAX=qmax, SUB_POW=float(2.0 ** (m - emin)))

    def table(fmt: str, align: str) -> Any:
        return _tensor(1 << QFORMATS[fmt][0], f32, "fresh", align).contiguous()

    def payload(fmt: str, n: int) -> int:
        return n if QFORMATS[fmt][0] == 8 else (n + 1) // 2

    def full_blocks(quick: list, *axes: Any) -> list:
        """Quick: `quick`. Full: every size and alignment at the default block, and the other
        blocks (a constexpr: a compile each) at one size and alignment, over `axes`."""
        if quick_mode:
            return quick
        default = [(*a, 128, size, al) for a in itertools.product(*axes) for size in SIZES for al in ALIGNS]
        return default + [
            (*a, b, "i32", "runtime") for a in itertools.product(*axes) for b in QBLOCKS if b != 128
        ]

    # mode: "ef" (x, residual, snapshot, stochastic rounding), "pack" (x only, to nearest even),
    # "quantize" (v alone). (g, x) dtypes: a master and its parameters (bf16 / fp16 beside fp32).
    pairs = [(f32, f32), (f32, bf16), (f32, f16), (f64, f64)]
    modes = ("ef", "pack", "quantize")
    fmts = list(QFORMATS)
    quick = [
        (f, pairs[i % 4], modes[i % 3], 128, list(SIZES)[i % 5], ALIGNS[i % 3]) for i, f in enumerate(fmts)
    ]
    quick += [
        ("int8", (f64, f64), "ef", 2, "i32", "runtime"),  # other blocks: at one size and alignment
        ("int4", (f32, bf16), "quantize", 4096, "i32", "runtime"),
    ]
    for fmt, (dt, xdt), mode, block, size, align in full_blocks(quick, fmts, pairs, modes):
        n = SIZES[size]

        def call(fmt=fmt, dt=dt, xdt=xdt, mode=mode, block=block, n=n, align=align):
            ef = mode == "ef"
            v = _tensor(n, xdt if mode == "quantize" else dt, "view", align)
            quantize.launch_pack_quantized(
                v,
                None if mode == "quantize" else _tensor(n, xdt, "view", align),
                _tensor(n, dt, "view", align) if ef else None,
                _tensor(n, dt, "out", align) if ef else None,
                _tensor(payload(fmt, n), torch.uint8, "out", align),
                _tensor(-(-n // block), f32, "out", align),
                _tensor(1, torch.int64, "fresh", align)[0],
                table(fmt, align),
                consts(fmt),
                block,
                ef,
                SR_KEY if ef else 0,
            )

        dts = f"{name.get(dt, 'fp16')}/{name.get(xdt, 'fp16')}"
        yield f"pack_quantized {fmt} {mode} {dts} block={block} n={size} {align}", call

    # dequantize(codes, scales, out) into every parameter dtype; reduce_quantized over M rows
    outs = (f32, f64, bf16, f16)
    quick = [(f, outs[i % 4], 128, list(SIZES)[i % 5], ALIGNS[i % 3]) for i, f in enumerate(fmts)]
    quick += [("fp8_e4m3", bf16, 4096, "i32", "runtime")]
    for fmt, odt, block, size, align in full_blocks(quick, fmts, outs):
        n = SIZES[size]

        def call(fmt=fmt, odt=odt, block=block, n=n, align=align):
            quantize.launch_dequantize(
                _tensor(payload(fmt, n), torch.uint8, "out", align),
                _tensor(-(-n // block), f32, "out", align),
                _tensor(n, odt, "view", align),
                table(fmt, align),
                consts(fmt),
                block,
            )

        yield f"dequantize {fmt} out={name.get(odt, 'fp16')} block={block} n={size} {align}", call
    quick = [(f, 128, list(SIZES)[(i + 1) % 5], ALIGNS[(i + 1) % 3]) for i, f in enumerate(fmts)]
    quick += [("int4", 2, "i32", "runtime")]
    for fmt, block, size, align in full_blocks(quick, fmts):
        n = SIZES[size]

        def call(fmt=fmt, block=block, n=n, align=align):
            m, nb = 3, -(-n // block)
            quantize.launch_reduce_quantized(
                _tensor(1, torch.uint8, "out", align).expand(m, payload(fmt, n)),
                _tensor(1, f32, "out", align).expand(m, nb),
                _tensor(payload(fmt, n), torch.uint8, "fresh", align),
                _tensor(nb, f32, "fresh", align),
                table(fmt, align),
                consts(fmt),
                block,
                n,
                1.0 / m,
            )

        yield f"reduce_quantized {fmt} block={block} n={size} {align}", call


# ---- specialise like JITFunction.run, compile like triton.compile ----------------------------


@dataclasses.dataclass
class Variant:
    arch: int
    module: str
    kernel: str
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict
    named_constexprs: dict
    labels: list[str]


def _specialise(arch: int, kernel: Any, args: tuple, kwargs: dict) -> tuple[dict, dict, dict, dict]:
    """(signature, constexprs, attrs, options) of a launch, as ``JITFunction.run`` computes them."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    kwargs = dict(kwargs)
    kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
    for knob in ("instrumentation_mode", "fpsan_homomorphic_casts"):  # what run() adds, where it exists
        if hasattr(knobs.compilation, knob):
            kwargs[knob] = getattr(knobs.compilation, knob)
    backend = make_backend(GPUTarget("cuda", arch, 32))
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound_args, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(
        backend, kwargs, bound_args, specialization, options
    )
    return signature, constexprs, attrs, dict(options.__dict__)


def _variants(arches: list[int], quick: bool, select: str | None) -> tuple[list[Variant], int]:
    """The distinct compilations behind every recorded launch, and the number of launches."""
    variants: dict[str, Variant] = {}
    launches = 0
    for arch in arches:
        for label, call in _cases(quick):
            if select and select not in label:
                continue
            sink: list = []
            with _recording(sink, arch):
                call()
            for kernel, name, args, kwargs in sink:
                launches += 1
                sig, constexprs, attrs, options = _specialise(arch, kernel, args, kwargs)
                key = repr(
                    (
                        arch,
                        name,
                        sig,
                        sorted(constexprs.items()),
                        sorted(attrs.items()),
                        sorted(options.items()),
                    )
                )
                names = {kernel.arg_names[path[0]]: v for path, v in constexprs.items() if len(path) == 1}
                module = kernel.fn.__module__
                v = variants.setdefault(
                    key, Variant(arch, module, name, sig, constexprs, attrs, options, names, [])
                )
                v.labels.append(
                    label if name.endswith(label.split()[0] + "_kernel") else f"{name} of {label}"
                )
    return list(variants.values()), launches


def _compile(v: Variant) -> tuple[str, str]:
    """('ok' | 'FAIL', line) for one variant."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    kernel = getattr(importlib.import_module(v.module), v.kernel)
    label = v.labels[0] + (f" (+{len(v.labels) - 1} launches)" if len(v.labels) > 1 else "")
    t0 = time.perf_counter()
    try:
        src = ASTSource(kernel, v.signature, v.constexprs, v.attrs)
        compiled = triton.compile(src, target=GPUTarget("cuda", v.arch, 32), options=v.options)
    except Exception as e:  # report every failing variant, then fail
        first = str(e).splitlines()[0] if str(e) else ""
        return "FAIL", f"sm_{v.arch} FAIL {label}: {type(e).__name__}: {first}"
    bad = _ptx_violations(v.named_constexprs, compiled.asm["ptx"])
    if bad:
        return "FAIL", f"sm_{v.arch} FAIL {label}: {bad}"
    ld, st = _wide_accesses(compiled.asm["ptx"])
    regs, size = _registers(compiled.asm["cubin"]), len(compiled.asm["cubin"])
    took = time.perf_counter() - t0
    return (
        "ok",
        f"sm_{v.arch} ok   {label}: {took:.2f} s, regs {regs}, 128-bit ld/st {ld}/{st}, cubin {size} B",
    )


def _ptx_violations(constexprs: dict[str, object], ptx: str) -> str:
    """What a variant's PTX must (not) contain, beyond compiling: a pack with HW_BF16 rounds to
    bf16 with cvt.rn.bf16.f32 (or its x2 form), the instruction torch's __float2bfloat16 is, and
    never straight from fp64 (cvt.rn.bf16.f64 rounds once where torch rounds twice). '' if none."""
    if constexprs.get("HW_BF16"):
        if not re.search(r"\bcvt\.rn\.bf16(x2)?\.f32\b", ptx):
            return "HW_BF16 but no cvt.rn.bf16.f32 in the PTX: Triton lowers the bf16 cast differently"
        if re.search(r"\bcvt\.rn\.bf16(x2)?\.f64\b", ptx):
            return "cvt.rn.bf16.f64 in the PTX: fp64 -> bf16 in one rounding, torch rounds through fp32"
    return ""


def _wide_accesses(ptx: str) -> tuple[int, int]:
    """(128-bit global loads, 128-bit global stores) in the PTX: v4 of 32-bit or v2 of 64-bit."""
    lines = [ln.strip() for ln in ptx.splitlines()]
    wide = (".v4.b32", ".v4.f32", ".v4.u32", ".v2.b64", ".v2.f64", ".v2.u64")
    loads = sum(1 for ln in lines if ln.startswith("ld.global") and any(w in ln for w in wide))
    stores = sum(1 for ln in lines if ln.startswith("st.global") and any(w in ln for w in wide))
    return loads, stores


def _registers(cubin: bytes) -> int | None:
    """Registers per thread of the (one) kernel in a cubin, what ``cuobjdump -res-usage`` prints as
    REG: the EIATTR_REGCOUNT attribute (0x2F; format EIFMT_SVAL, payload (symbol, count)) of the
    ELF section ``.nv.info``. None when absent."""
    shoff = struct.unpack_from("<Q", cubin, 0x28)[0]
    shentsize, shnum, shstrndx = struct.unpack_from("<HHH", cubin, 0x3A)

    def header(i: int) -> tuple[int, ...]:
        # sh_name, sh_type, sh_flags, sh_addr, sh_offset, sh_size, sh_link, sh_info, ...
        return struct.unpack_from("<IIQQQQIIQQ", cubin, shoff + i * shentsize)

    strtab = header(shstrndx)[4]
    for i in range(shnum):
        name_at, _, _, _, offset, size, *_ = header(i)
        name = cubin[strtab + name_at : cubin.index(b"\0", strtab + name_at)]
        if name != b".nv.info":
            continue
        pos = offset
        while pos < offset + size:
            fmt, attr = cubin[pos], cubin[pos + 1]
            if fmt == 0x04:  # EIFMT_SVAL: u16 payload size, then the payload
                payload = struct.unpack_from("<H", cubin, pos + 2)[0]
                if attr == 0x2F:
                    return struct.unpack_from("<II", cubin, pos + 4)[1]
                pos += 4 + payload
            else:  # EIFMT_NVAL / BVAL / HVAL: 4 bytes in all
                pos += 4
    return None


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, nargs="+", default=[80, 90], help="compute capabilities")
    parser.add_argument("--quick", action="store_true", help="one variant per kernel and dtype pairing")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="compiler processes")
    parser.add_argument("-k", dest="select", help="only the cases whose label contains this text")
    args = parser.parse_args(argv)
    # Imported earlier (perhaps under the interpreter)? Drop them so the kernels are decorated afresh.
    stale = [m for m in sys.modules if m.startswith(f"{PACKAGE}.")]
    for m in stale:
        del sys.modules[m]
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "0")  # the launches pass enable_fp_fusion=False

    start = time.perf_counter()
    variants, launches = _variants(args.arch, args.quick, args.select)
    took = time.perf_counter() - start
    print(f"{launches} launches recorded: {len(variants)} distinct variants to compile ({took:.1f} s)")
    if args.jobs > 1 and len(variants) > 1:
        with multiprocessing.get_context("fork").Pool(args.jobs) as pool:
            results = pool.imap(_compile, variants)
            failures = _report(results)
    else:
        failures = _report(map(_compile, variants))
    took = time.perf_counter() - start
    print(f"{len(variants) - failures} variants compiled, {failures} failed, {took:.1f} s")
    return 1 if failures or not variants else 0


def _report(results: Iterator[tuple[str, str]]) -> int:
    failures = 0
    for status, line in results:
        print(line, flush=True)
        failures += status != "ok"
    return failures


if __name__ == "__main__":
    sys.exit(main())
