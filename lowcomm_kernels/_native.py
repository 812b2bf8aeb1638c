"""Loads the torch-free csrc libraries (``liblowcomm_cpu``, ``liblowcomm_cuda``) through ctypes.

The C ABI (csrc/include/lowcomm/abi.h is the source of truth) takes raw pointers, element counts
and scalars; dtypes travel as small integer codes (``DTYPE_CODE``). Every entry point returns an
int: 0 on success, else one of ``ERRORS``, and then the library's ``lc_last_error`` /
``lc_cuda_last_error`` says which entry point failed and why (the argument and its value, or the
CUDA call and its error); ``check`` raises with that line. The CUDA entry points carry the same
arguments plus a trailing ``cudaStream_t``; their scalar inputs and outputs are device pointers.
``SIGNATURES``, ``RESTYPE``, ``CUDA_EXTRA`` and ``STRINGS`` restate the header's declarations for
ctypes (a test compares them with it).

When the CPU library is missing (a source checkout that was never built, a platform without a
compiler), the package still imports and every op runs on the ``ref`` backend: one warning says so.
"""

from __future__ import annotations

import ctypes
import functools
import importlib.util
import os
import warnings

import torch

from . import _config

# LC_F32, LC_F64, LC_BF16, LC_F16. A kernel's `dtype` argument is the parameters' (x's) dtype: the
# outer state of bf16 / fp16 parameters is float32 (abi.h).
DTYPE_CODE = {torch.float32: 0, torch.float64: 1, torch.bfloat16: 2, torch.float16: 3}
ERRORS = {1: "unsupported dtype combination", 2: "bad argument", 3: "CUDA error"}

_c_int, _c_i64, _c_dbl, _vp = ctypes.c_int, ctypes.c_int64, ctypes.c_double, ctypes.c_void_p
# One letter each in SIGNATURES, so every entry point's argument list reads on one line.
I, N, D, P = _c_int, _c_i64, _c_dbl, _vp  # noqa: E741 (int, int64_t, double, pointer)

# Every entry point returns RESTYPE, and the CUDA variants (``lc_cuda_<name>``) append CUDA_EXTRA.
RESTYPE = _c_int
CUDA_EXTRA = [_vp]  # cudaStream_t
_TYPES = {"I": I, "N": N, "D": D, "P": P}


def _params(spec: str) -> tuple[tuple[str, type], ...]:
    """'I dtype, P g, N n' -> (("dtype", c_int), ("g", c_void_p), ("n", c_int64))."""
    return tuple((name, _TYPES[kind]) for kind, name in (p.split() for p in spec.split(",")))


#: The op contract's C side, once: name -> (parameter name, ctype) in abi.h's order and with its
#: names (a test compares both with the header). ``SIGNATURES`` (the ctypes argtypes) and each
#: op's C arguments (``ops._common.native`` fills a parameter from the launcher argument of its
#: name, or from the op's rule for it) come from here. NULL-able pointers and arrays as noted.
ABI: dict[str, tuple[tuple[str, type], ...]] = {
    # snapshot|NULL
    "lc_pack": _params("I dtype, I wire_dtype, P g, P x, P delta, P snapshot, N n, P nonfinite"),
    # x_sent|NULL iff beta == lam == 0; lam_sums|NULL (double[2] of lc_taylor_norms: lam is then
    # normalized by the kernel)
    "lc_outer_merge": _params(
        "I dtype, I avg_dtype, P g, P u, P delta_avg, P x, P x_sent, N n, D lr, D momentum, I nesterov, "
        "D alpha, D beta, D lam, P lam_sums"
    ),
    # out2: double[2]
    "lc_taylor_norms": _params(
        "I dtype, I avg_dtype, P g, P u, P delta_avg, P x, P x_sent, N n, D lr, D momentum, I nesterov, "
        "P out2"
    ),
    # adds, muls: int64[4]; out: int64[k]
    "lc_mask_perm": _params("N n, N k, P adds, P muls, I shift, N bitmask, P out"),
    "lc_sparse_gather": _params("I dtype, P x, P idx, N k, P out"),
    "lc_sparse_scatter_merge": _params("I dtype, I avg_dtype, P x, P idx, N k, P avg, P sent, D beta"),
    # offsets: int64[nseg + 1]; out: double[nseg]
    "lc_fragment_norms": _params("I dtype, P buf, P offsets, N nseg, I ord, P out"),
    # memcpy with non-temporal stores (the benchmarks' roofline row)
    "lc_copy_nt": _params("P dst, P src, N nbytes"),
    # x|NULL, residual|NULL, snapshot|NULL, nonfinite|NULL
    "lc_pack_quantized": _params(
        "I dtype, I fmt, P g, P x, P residual, P snapshot, N n, N block, I sr, N key, P codes, P scales, "
        "P nonfinite"
    ),
    "lc_dequantize": _params("I fmt, P codes, P scales, N n, N block, I out_dtype, P out"),
    # codes: m x payload; scales: m x nscales
    "lc_reduce_quantized": _params(
        "I fmt, P codes, P scales, N m, N n, N block, D scale, P out_codes, P out_scales"
    ),
    # x_sent|NULL, lam_sums|NULL
    "lc_outer_merge_quantized": _params(
        "I dtype, I fmt, P g, P u, P codes, P scales, N block, P x, P x_sent, N n, D lr, D momentum, "
        "I nesterov, D alpha, D beta, D lam, P lam_sums"
    ),
    "lc_sparse_scatter_merge_quantized": _params(
        "I dtype, I fmt, P x, P idx, N k, P codes, P scales, N block, P sent, D beta"
    ),
    "lc_topk_encode": _params(
        "I dtype, P delta, P e, N n, N k, N chunk, I bits, D beta, P payload, P nonfinite"
    ),
    "lc_topk_decode_add": _params("I dtype, P payload, N n, N k, N chunk, I bits, P out"),
}
#: name -> argtypes
SIGNATURES: dict[str, list] = {name: [t for _, t in params] for name, params in ABI.items()}
#: entry points without arguments that return a C string (not kernels; the CUDA library's are
#: lc_cuda_<name>): the library's identity, and the calling thread's last failure message.
STRINGS = ("lc_version", "lc_last_error")


def _locate(libname: str) -> str | None:
    """Path of an installed library. find_spec triggers scikit-build-core's rebuild in an
    editable install and returns the right path in a normal one (docs/design.md, "The build")."""
    try:
        spec = importlib.util.find_spec(f"lowcomm_kernels.{libname}")
    except (ImportError, ValueError):
        spec = None
    if spec is not None and spec.origin and os.path.exists(spec.origin):
        return spec.origin
    here = os.path.dirname(os.path.abspath(__file__))
    for name in os.listdir(here):
        if name.startswith(libname) and name.endswith(".so"):
            return os.path.join(here, name)
    return None


def _bind(lib: ctypes.CDLL, prefix: str, extra: list) -> ctypes.CDLL:
    for name, argtypes in SIGNATURES.items():
        full = name.replace("lc_", prefix, 1)
        if not hasattr(lib, full):
            continue  # the CUDA library implements only the ops where it pays
        fn = getattr(lib, full)
        fn.argtypes = argtypes + extra
        fn.restype = RESTYPE
    for name in STRINGS:
        full = name.replace("lc_", prefix, 1)
        if hasattr(lib, full):
            fn = getattr(lib, full)
            fn.argtypes = []
            fn.restype = ctypes.c_char_p
    return lib


@functools.lru_cache(maxsize=1)
def cpu_lib() -> ctypes.CDLL | None:
    if _config.native_disabled():
        return None
    path = _config.native_library_path() or _locate("liblowcomm_cpu")
    if path is None:
        warnings.warn(
            "lowcomm_kernels: the native CPU library (liblowcomm_cpu) was not found, so every "
            "op runs on the slow 'ref' backend. Reinstall with `pip install .` to build it.",
            RuntimeWarning,
            stacklevel=2,
        )
        return None
    return _load(path, "lc_", [], "ops run on the 'ref' backend")


@functools.lru_cache(maxsize=1)
def cuda_lib() -> ctypes.CDLL | None:
    if _config.native_disabled() or not torch.cuda.is_available():
        return None
    path = _locate("liblowcomm_cuda")
    if path is None:
        return None  # optional: built only with LOWCOMM_WITH_CUDA=ON
    return _load(path, "lc_cuda_", CUDA_EXTRA, "the 'cuda' backend is off")


def _load(path: str, prefix: str, extra: list, fallback: str) -> ctypes.CDLL | None:
    """The library at `path` with its entry points typed; None (and a warning) when it won't load."""
    try:
        lib = ctypes.CDLL(path)
    except OSError as exc:
        warnings.warn(
            f"lowcomm_kernels: could not load {path} ({exc}); {fallback}.", RuntimeWarning, stacklevel=3
        )
        return None
    return _bind(lib, prefix, extra)


def cuda_has(name: str) -> bool:
    lib = cuda_lib()
    return lib is not None and hasattr(lib, name.replace("lc_", "lc_cuda_", 1))


def last_error(name: str) -> str:
    """The calling thread's last failure message of the library that holds entry point `name`
    ("" when that library or its ``lc_last_error`` is missing)."""
    lib = cuda_lib() if name.startswith("lc_cuda_") else cpu_lib()
    getter = getattr(lib, "lc_cuda_last_error" if name.startswith("lc_cuda_") else "lc_last_error", None)
    if getter is None:
        return ""
    return (getter() or b"").decode("utf-8", "replace")


def check(rc: int, name: str) -> None:
    """Raise RuntimeError if entry point `name` returned a non-zero code: the library's message
    (the entry point, then the argument or the CUDA call and error), then the code's meaning."""
    if rc != 0:
        what = ERRORS.get(rc, "unknown code")
        detail = last_error(name)
        if detail.startswith(f"{name}:"):
            raise RuntimeError(f"{detail} (code {rc}: {what})")
        raise RuntimeError(f"native {name} failed with code {rc} ({what})")


def stream_ptr(device: torch.device) -> int:
    return torch.cuda.current_stream(device).cuda_stream
