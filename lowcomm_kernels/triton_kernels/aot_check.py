"""Compile every Triton kernel variant for real GPU targets, without a GPU.

    python -m lowcomm_kernels.triton_kernels.aot_check [--arch 80 90] [--quick]

The interpreter tests run the kernels' Python semantics; they cannot see what only the compiler
checks (types of loop bounds, scalar annotations, bitcasts, 64-bit atomics, ``while`` on a
reduction). ``triton.compile`` with an explicit ``GPUTarget`` runs the whole pipeline (TTIR ->
TTGIR -> LLVM -> PTX -> cubin with the ptxas Triton ships) on a CPU-only machine, so this catches
those errors before a GPU ever sees the code. For each variant it prints the number of 128-bit
global loads/stores in the PTX (the elementwise kernels should be fully vectorised).

Must run without TRITON_INTERPRET (it is removed here before the kernel modules are imported).
"""

from __future__ import annotations

import argparse
import itertools
import os
import re
import struct
import sys
import time
from collections.abc import Iterator
from typing import Any

F32, F64, BF16 = "fp32", "fp64", "bf16"


def _variants(quick: bool) -> Iterator[tuple[str, Any, dict[str, str], dict[str, object]]]:
    """(label, kernel, signature, constexprs) for every specialisation the launchers can produce
    (`quick`: one per kernel and dtype pairing, enough to catch type errors)."""
    from . import _launch, fragment_norms, mask_indices, outer_merge, pack, sparse

    block = _launch.GPU_BLOCK
    dtypes = [F32, F64]
    for dt, wire, snap in itertools.product(dtypes, ["same", BF16], [True, False]):
        if quick and not snap:
            continue
        w = dt if wire == "same" else BF16
        wmax = {F32: 3.4028234663852886e38, F64: 1.7976931348623157e308, BF16: 3.3895313892515355e38}[w]
        yield (
            f"pack {dt}->{w} snapshot={snap}",
            pack._pack_kernel,
            {
                "g_ptr": f"*{dt}",
                "x_ptr": f"*{dt}",
                "delta_ptr": f"*{w}",
                "snapshot_ptr": f"*{dt}",
                "nonfinite_ptr": "*i64",
                "n": "i64",
            },
            # every target here is sm_80+: a bf16 wire is rounded by the hardware's cvt (see pack)
            {"HAS_SNAPSHOT": snap, "WIRE_MAX": wmax, "HW_BF16": w == BF16, "BLOCK": block},
        )
    flags = list(itertools.product([True, False], repeat=4))
    for dt, avg in itertools.product(dtypes, ["same", BF16]):
        a = dt if avg == "same" else BF16
        ptrs = {
            "g_ptr": f"*{dt}",
            "u_ptr": f"*{dt}",
            "avg_ptr": f"*{a}",
            "x_ptr": f"*{dt}",
            "sent_ptr": f"*{dt}",
        }
        merge_flags = [(*f, lam_dev) for f in flags for lam_dev in (False, True) if f[2] or not lam_dev]
        for mom, nest, sent, alpha, lam_dev in merge_flags[:2] if quick else merge_flags:
            if not mom and not nest:
                continue  # nesterov is irrelevant without momentum: the launcher passes it as given
            yield (
                f"outer_merge {dt} avg={a} momentum={mom} nesterov={nest} sent={sent} alpha={alpha} "
                f"lam_on_device={lam_dev}",
                outer_merge._outer_merge_kernel,
                {
                    **ptrs,
                    "lam_sums_ptr": "*fp64" if lam_dev else f"*{dt}",
                    "n": "i64",
                    "lr": "fp64",
                    "momentum": "fp64",
                    "alpha": "fp64",
                    "one_minus_alpha": "fp64",
                    "beta": "fp64",
                    "lam": "fp64",
                },
                {
                    "HAS_MOMENTUM": mom,
                    "NESTEROV": nest,
                    "HAS_SENT": sent,
                    "HAS_ALPHA": alpha,
                    "LAM_ON_DEVICE": lam_dev,
                    "BLOCK": block,
                },
            )
        for (mom, nest), final in itertools.product(
            [(True, True)] if quick else [(True, True), (True, False), (False, True)], [True, False]
        ):
            yield (
                f"taylor_norms {dt} avg={a} momentum={mom} nesterov={nest} final={final}",
                outer_merge._taylor_norms_kernel,
                {**ptrs, "dst_ptr": "*fp64", "n": "i64", "lr": "fp64", "momentum": "fp64", "NPROG": "i32"},
                {
                    "HAS_MOMENTUM": mom,
                    "NESTEROV": nest,
                    "FINAL": final,
                    "BLOCK": outer_merge.TAYLOR_GPU_BLOCK,
                },
            )
    keys = ("n", "k", "a0", "a1", "a2", "a3", "c0", "c1", "c2", "c3", "shift", "bitmask")
    yield (
        "mask_perm",
        mask_indices._mask_perm_kernel,
        {"out_ptr": "*i64", **{k: "i64" for k in keys}},
        {"BLOCK": block},
    )
    for dt in dtypes:
        yield (
            f"sparse_gather {dt}",
            sparse._sparse_gather_kernel,
            {"x_ptr": f"*{dt}", "idx_ptr": "*i64", "out_ptr": f"*{dt}", "k": "i64"},
            {"BLOCK": block},
        )
        for avg in ["same", BF16]:
            a = dt if avg == "same" else BF16
            yield (
                f"sparse_scatter_merge {dt} avg={a}",
                sparse._sparse_scatter_merge_kernel,
                {
                    "x_ptr": f"*{dt}",
                    "idx_ptr": "*i64",
                    "avg_ptr": f"*{a}",
                    "sent_ptr": f"*{dt}",
                    "k": "i64",
                    "beta": "fp64",
                },
                {"BLOCK": block},
            )
        for ord_, final in itertools.product([1, 2], [True, False]):
            if quick and ord_ == 1:
                continue
            yield (
                f"fragment_norms {dt} ord={ord_} final={final}",
                fragment_norms._fragment_norms_kernel,
                {"buf_ptr": f"*{dt}", "offsets_ptr": "*i64", "out_ptr": "*fp64", "P": "i32"},
                {"ORD": ord_, "FINAL": final, "BLOCK": block},
            )
    yield (
        "taylor_norms_finish",
        outer_merge._taylor_norms_finish_kernel,
        {"partial_ptr": "*fp64", "out_ptr": "*fp64", "NPROG": "i32"},
        {"P_BLOCK": 1024},
    )
    for ord_ in [1, 2]:
        yield (
            f"fragment_norms_finish ord={ord_}",
            fragment_norms._fragment_norms_finish_kernel,
            {"partial_ptr": "*fp64", "out_ptr": "*fp64", "P": "i32"},
            {"ORD": ord_, "P_BLOCK": 512},
        )


def _wide_accesses(ptx: str) -> tuple[int, int]:
    """(128-bit global loads, 128-bit global stores) in the PTX: v4 of 32-bit or v2 of 64-bit."""
    lines = [ln.strip() for ln in ptx.splitlines()]
    wide = (".v4.b32", ".v4.f32", ".v4.u32", ".v2.b64", ".v2.f64", ".v2.u64")
    loads = sum(1 for ln in lines if ln.startswith("ld.global") and any(w in ln for w in wide))
    stores = sum(1 for ln in lines if ln.startswith("st.global") and any(w in ln for w in wide))
    return loads, stores


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
    args = parser.parse_args(argv)
    # Imported earlier (perhaps under the interpreter)? Drop them so the kernels are decorated afresh.
    stale = [m for m in sys.modules if m.startswith("lowcomm_kernels.triton_kernels.") and m != __name__]
    for m in stale:
        del sys.modules[m]
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "0")  # the launches pass enable_fp_fusion=False
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    failures = 0
    start = time.perf_counter()
    count = 0
    for arch in args.arch:
        target = GPUTarget("cuda", arch, 32)
        for label, kernel, signature, constexprs in _variants(args.quick):
            sig = {**signature, **{k: "constexpr" for k in constexprs}}
            t0 = time.perf_counter()
            # Pointers carry tt.divisibility=16, as Triton specialises them for torch's aligned
            # allocations at launch; n does not (the worst case: an odd-sized fragment).
            names = list(kernel.arg_names)
            attrs = {
                (names.index(k),): [["tt.divisibility", 16]]
                for k, v in signature.items()
                if v.startswith("*")
            }
            try:
                compiled = triton.compile(
                    ASTSource(kernel, sig, constexprs, attrs),
                    target=target,
                    options={"num_warps": 4, "enable_fp_fusion": False},
                )
            except Exception as e:  # report every failing variant, then fail
                failures += 1
                first = str(e).splitlines()[0] if str(e) else ""
                print(f"sm_{arch} FAIL {label}: {type(e).__name__}: {first}")
                continue
            bad = _ptx_violations(constexprs, compiled.asm["ptx"])
            if bad:
                failures += 1
                print(f"sm_{arch} FAIL {label}: {bad}")
                continue
            count += 1
            ld, st = _wide_accesses(compiled.asm["ptx"])
            print(
                f"sm_{arch} ok   {label}: {time.perf_counter() - t0:.2f} s, 128-bit ld/st {ld}/{st}, "
                f"regs {_registers(compiled.asm['cubin'])}, cubin {len(compiled.asm['cubin'])} B"
            )
    print(f"{count} variants compiled, {failures} failed, {time.perf_counter() - start:.1f} s")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
