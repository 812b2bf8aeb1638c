"""_native's ctypes declarations against the C header they restate (csrc/include/lowcomm/abi.h):
the same entry points, argument for argument, the same return type, and the loaded library bound
with them. A mismatch there would pass garbage through ctypes without any error."""

from __future__ import annotations

import ctypes
import re
from pathlib import Path

import pytest

from lowcomm_kernels import _native

HEADER = Path(__file__).resolve().parents[2] / "csrc" / "include" / "lowcomm" / "abi.h"
C_SCALARS = {"int": ctypes.c_int, "int64_t": ctypes.c_int64, "double": ctypes.c_double}
VERSION = ("lc_version", "lc_cuda_version")  # identity strings, not kernels: no ctypes binding


def _ctype(decl: str):
    """The ctypes type of one C parameter or return type: any pointer is a void pointer."""
    decl = decl.replace("const", " ").strip()
    if "*" in decl:
        return ctypes.c_void_p
    return C_SCALARS[decl.split()[0]]


def header_declarations() -> dict[str, tuple[object, list]]:
    """name -> (return ctype, [parameter ctypes]) of every LOWCOMM_EXPORT function in abi.h."""
    text = re.sub(r"//[^\n]*", "", HEADER.read_text())
    out = {}
    declaration = r"LOWCOMM_EXPORT\s+([\w\s\*]+?)\s*\b(lc_\w+)\s*\(([^)]*)\)\s*;"
    for ret, name, params in re.findall(declaration, text):
        if name in VERSION:
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


def test_dtype_codes_match_the_header():
    defines = dict(re.findall(r"#define\s+(LC_\w+)\s+(\d+)", HEADER.read_text()))
    names = {"float32": "LC_F32", "float64": "LC_F64", "bfloat16": "LC_BF16"}
    assert {str(dt).removeprefix("torch."): code for dt, code in _native.DTYPE_CODE.items()} == {
        dt: int(defines[macro]) for dt, macro in names.items()}
    assert set(_native.ERRORS) == {int(defines[m]) for m in ("LC_EBADTYPE", "LC_EARG", "LC_ECUDA")}
    assert int(defines["LC_OK"]) == 0


def test_the_loaded_library_is_bound_with_them():
    lib = _native.cpu_lib()
    if lib is None:
        pytest.skip("the native CPU library is not built")
    for name, argtypes in _native.SIGNATURES.items():
        fn = getattr(lib, name)
        assert list(fn.argtypes) == argtypes and fn.restype is _native.RESTYPE, name
