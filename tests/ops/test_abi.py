"""_native's ctypes declarations against the C header they restate (csrc/include/lowcomm/abi.h):
the same entry points, argument for argument, the same return type, and the loaded library bound
with them. A mismatch there would pass garbage through ctypes without any error. Also: a failed
call's error names the entry point and the argument at fault."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest

from lowcomm_kernels import _native

HEADER = Path(__file__).resolve().parents[2] / "csrc" / "include" / "lowcomm" / "abi.h"
C_SCALARS = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "double": ctypes.c_double}
# C-string entry points (identity, last error): declared in _native.STRINGS, not SIGNATURES
STRING_ENTRIES = {n.replace("lc_", p, 1) for n in _native.STRINGS for p in ("lc_", "lc_cuda_")}


def _ctype(decl: str):
    """The ctypes type of one C parameter or return type: any pointer is a void pointer."""
    decl = decl.replace("const", " ").strip()
    if "*" in decl:
        return ctypes.c_void_p
    return C_SCALARS[decl.split()[0]]


def header_declarations(strings: bool = False) -> dict[str, tuple[object, list]]:
    """name -> (return ctype, [parameter ctypes]) of every LOWCOMM_EXPORT kernel entry point in
    abi.h (strings=True: of the C-string entry points instead)."""
    text = re.sub(r"//[^\n]*", "", HEADER.read_text())
    out = {}
    declaration = r"LOWCOMM_EXPORT\s+([\w\s\*]+?)\s*\b(lc_\w+)\s*\(([^)]*)\)\s*;"
    for ret, name, params in re.findall(declaration, text):
        if (name in STRING_ENTRIES) != strings:
            continue
        out[name] = (_ctype(ret), [_ctype(p) for p in params.split(",") if p.strip() not in ("", "void")])
    return out


def test_the_parser_reads_the_header():
    decls = header_declarations()
    assert decls["lc_pack"] == (ctypes.c_int, [ctypes.c_int, ctypes.c_int] + [ctypes.c_void_p] * 4
                                + [ctypes.c_int64, ctypes.c_void_p])


def test_signatures_match_the_header():
    decls = header_declarations()
    expected = {}
    for name, argtypes in _native.SIGNATURES.items():
        expected[name] = (_native.RESTYPE, list(argtypes))
        expected[name.replace("lc_", "lc_cuda_", 1)] = (_native.RESTYPE, list(argtypes) + _native.CUDA_EXTRA)
    assert sorted(expected) == sorted(decls), "entry points declared in one place only"
    for name, (restype, argtypes) in decls.items():
        assert expected[name] == (restype, argtypes), f"{name}: _native {expected[name]} vs abi.h"


def test_parameter_names_match_the_header():
    """_native.ABI names every parameter as abi.h does: the launchers fill them by those names."""
    text = re.sub(r"//[^\n]*", "", HEADER.read_text())
    declaration = r"LOWCOMM_EXPORT\s+[\w\s\*]+?\s*\b(lc_\w+)\s*\(([^)]*)\)\s*;"
    names = {
        name: [re.findall(r"\w+", p)[-1] for p in params.split(",") if p.strip() not in ("", "void")]
        for name, params in re.findall(declaration, text)
    }
    for name, params in _native.ABI.items():
        assert [p for p, _ in params] == names[name], name
        assert [p for p, _ in params] + ["stream"] == names[name.replace("lc_", "lc_cuda_", 1)], name


def test_every_native_launcher_fills_every_parameter():
    """ops._common.native builds each entry's C arguments by name at import (so importing the ops
    checked every op's layout); a rule for no parameter, or a parameter with neither a launcher
    argument nor a rule, fails there."""
    from lowcomm_kernels.ops import _common

    with pytest.raises(TypeError, match="rules for no parameter"):
        _common.c_layout("pack", "lc_pack", {"nope": "g"})
    with pytest.raises(TypeError, match="has no argument 'wire_dtype'"):
        _common.c_layout("pack", "lc_pack", {"dtype": ("x", int)})


def test_both_libraries_check_their_arguments_with_the_shared_header():
    """The C argument checks are written once (csrc/include/lowcomm/args.h): each is called by the
    CPU and the CUDA library alike, and neither defines a check of its own under an old name."""
    csrc = HEADER.parents[2]
    checks = re.findall(r"inline int (\w+)\(const char\* op", (HEADER.parent / "args.h").read_text())
    cpu = "".join(p.read_text() for p in sorted((csrc / "cpu").glob("*.cpp")))
    cuda = "".join(p.read_text() for p in sorted((csrc / "cuda").glob("*.cu")))
    assert {"pack", "merge", "fmt_block", "sparse_gather"} <= set(checks)
    for name in checks:
        if name in ("negative", "fmt_block"):  # helpers of the others
            continue
        calls = (cpu.count(f"args::{name}("), cuda.count(f"args::{name}("))
        assert calls[0] >= 1 and calls[0] == calls[1], f"args::{name}: {calls} calls (CPU, CUDA)"
    assert not re.search(r"int check_(merge_args|fmt_block)\(", cpu + cuda), "a backend defines its own check"


def test_dtype_codes_match_the_header():
    defines = dict(re.findall(r"#define\s+(LC_\w+)\s+(\d+)", HEADER.read_text()))
    names = {"float32": "LC_F32", "float64": "LC_F64", "bfloat16": "LC_BF16", "float16": "LC_F16"}
    assert {str(dt).removeprefix("torch."): code for dt, code in _native.DTYPE_CODE.items()} == {
        dt: int(defines[macro]) for dt, macro in names.items()}
    assert set(_native.ERRORS) == {int(defines[m]) for m in ("LC_EBADTYPE", "LC_EARG", "LC_ECUDA")}
    assert int(defines["LC_OK"]) == 0


def test_string_entries_match_the_header():
    decls = header_declarations(strings=True)
    assert sorted(decls) == sorted(STRING_ENTRIES)
    for name, (restype, argtypes) in decls.items():
        assert (restype, argtypes) == (ctypes.c_void_p, []), f"{name}: expected const char* {name}(void)"


def test_the_loaded_library_is_bound_with_them():
    lib = _native.cpu_lib()
    if lib is None:
        pytest.skip("the native CPU library is not built")
    for name, argtypes in _native.SIGNATURES.items():
        fn = getattr(lib, name)
        assert list(fn.argtypes) == argtypes and fn.restype is _native.RESTYPE, name
    for name in _native.STRINGS:
        assert getattr(lib, name).restype is ctypes.c_char_p, name
    assert lib.lc_version().startswith(b"lowcomm_cpu ")


def _cpu_lib():
    lib = _native.cpu_lib()
    if lib is None:
        pytest.skip("the native CPU library is not built")
    return lib


# (entry point, C arguments, the code, what the message must contain after "<entry point>: ")
_buf = ctypes.create_string_buffer(64)
_P = ctypes.addressof(_buf)
_OFFSETS = (ctypes.c_int64 * 3)(0, 8, 4)
FAILURES = [
    ("lc_pack", (0, 0, _P, _P, _P, None, -3, _P), 2, "n = -3 is negative"),
    ("lc_pack", (0, 0, _P, _P, _P, None, 4, None), 2, "nonfinite is NULL"),
    ("lc_pack", (0, 0, None, _P, _P, None, 4, _P), 2, "g is NULL"),
    ("lc_pack", (0, 1, _P, _P, _P, None, 4, _P), 1, "dtype = 0 (f32) with wire_dtype = 1 (f64)"),
    ("lc_pack", (7, 7, _P, _P, _P, None, 4, _P), 1, "dtype = 7 (unknown) with wire_dtype = 7"),
    ("lc_outer_merge", (1, 1, _P, _P, _P, _P, None, 2, 0.5, 0.9, 1, 0.0, 1.0, 0.0, None), 2,
     "x_sent is NULL"),
    ("lc_outer_merge", (1, 1, _P, None, _P, _P, None, 2, 0.5, 0.9, 1, 0.0, 0.0, 0.0, None), 2,
     "u is NULL while momentum = 0.9"),
    ("lc_outer_merge", (1, 0, _P, _P, _P, _P, None, 2, 0.5, 0.0, 1, 0.0, 0.0, 0.0, None), 1,
     "with avg_dtype = 0 (f32)"),
    ("lc_taylor_norms", (0, 0, _P, _P, _P, _P, _P, 2, 0.5, 0.0, 1, None), 2, "out2 is NULL"),
    ("lc_fragment_norms", (0, _P, _OFFSETS, 2, 2, _P), 2, "offsets[2] = 4 < offsets[1] = 8"),
    ("lc_fragment_norms", (0, _P, _OFFSETS, 1, 3, _P), 2, "ord = 3 is not 1 or 2"),
    ("lc_fragment_norms", (4, _P, _OFFSETS, 1, 2, _P), 1, "dtype = 4 (unknown) is not supported"),
    ("lc_pack", (3, 1, _P, _P, _P, None, 4, _P), 1, "dtype = 3 (f16) with wire_dtype = 1 (f64)"),
    ("lc_outer_merge", (2, 3, _P, _P, _P, _P, None, 2, 0.5, 0.0, 1, 0.0, 0.0, 0.0, None), 1,
     "dtype = 2 (bf16) with avg_dtype = 3 (f16)"),
    ("lc_sparse_gather", (0, _P, None, 3, _P), 2, "idx is NULL"),
    ("lc_sparse_scatter_merge", (0, 0, _P, _P, -1, _P, _P, 1.0), 2, "k = -1 is negative"),
    ("lc_mask_perm", (10, 11, _P, _P, 3, 15, _P), 2, "k = 11 is not in [0, n = 10]"),
    ("lc_mask_perm", (100, 5, _P, _P, 3, 15, _P), 2, "n - 1 = 99 exceeds bitmask = 15"),
    ("lc_copy_nt", (None, _P, 8), 2, "dst is NULL"),
]


@pytest.mark.parametrize(("name", "args", "code", "text"), FAILURES,
                         ids=[f"{f[0]}-{f[3][:24]}" for f in FAILURES])
def test_a_failed_call_names_the_entry_point_and_the_argument(name, args, code, text):
    lib = _cpu_lib()
    assert getattr(lib, name)(*args) == code
    message = _native.last_error(name)
    assert message.startswith(f"{name}: ") and text in message, message
    with pytest.raises(RuntimeError) as info:
        _native.check(code, name)
    assert str(info.value).startswith(f"{name}: ") and text in str(info.value)
    assert f"code {code}: {_native.ERRORS[code]}" in str(info.value)
