"""The wire formats, in one table: every name a user may give as ``wire_dtype`` and what it puts
on the wire. Every other module reads this table (a test fails if a list of format names is
written again elsewhere):

- ``_checks.NARROW_WIRE_DTYPES``: the dense dtypes narrower than the data a wire buffer may hold;
- ``ops.quantize.FORMATS`` (and csrc/include/lowcomm/abi.h's ``LC_Q_*`` codes, ``abi``): the
  quantized formats' code grids;
- ``runtime.schedule.WIRE_FORMATS`` / ``SPARSE_WIRE_FORMATS``: the names the strategies, the CLI
  and the simulator accept;
- the Triton AOT check's format constants.

Kinds: ``dense`` (the pseudo-gradient as a tensor of ``dtype``, summed on the wire), ``quantized``
(``bits``-bit codes plus one fp32 scale per block, averaged by runtime.compression), ``sparse``
(top-k entries per chunk, all-gathered by runtime.topk_wire; its bits per value are its own knob).

This module sits at the package's lowest layer (it imports only torch), so the kernels' helpers
can read it as well as the ops and the runtime.
"""

from __future__ import annotations

import dataclasses

import torch


@dataclasses.dataclass(frozen=True)
class WireSpec:
    """One wire format. ``bits``: bits per value on the wire (dense: the dtype's; quantized: per
    code, the block scales aside; sparse: None, set per run). Dense formats: ``dtype``, and
    ``narrow`` when a wire buffer of that dtype may carry data of a wider dtype. Quantized formats:
    the code grid (``grid`` "int" or "float", ``qmax`` its largest magnitude, ``exp_bits`` /
    ``man_bits`` of a float grid) and ``abi``, the format's code in abi.h (``LC_Q_*``)."""

    name: str
    kind: str
    bits: int | None
    dtype: torch.dtype | None = None
    narrow: bool = False
    grid: str = ""
    qmax: float = 0.0
    exp_bits: int = 0
    man_bits: int = 0
    abi: int = -1

    @property
    def emin(self) -> int:
        """The exponent of a float grid's smallest normal value (1 − bias); 0 for the rest."""
        return float_emin(self.exp_bits) if self.grid == "float" else 0


def float_emin(exp_bits: int) -> int:
    """The exponent of the smallest normal value of a float grid with `exp_bits` exponent bits."""
    return 2 - (1 << (exp_bits - 1))


def _q(
    name: str, bits: int, grid: str, qmax: float, abi: int, exp_bits: int = 0, man_bits: int = 0
) -> WireSpec:
    return WireSpec(
        name, "quantized", bits, grid=grid, qmax=qmax, exp_bits=exp_bits, man_bits=man_bits, abi=abi
    )


#: The table, in the order the users see the names (the quantized ones in abi.h's LC_Q_* order).
TABLE: tuple[WireSpec, ...] = (
    WireSpec("fp32", "dense", 32, torch.float32),
    WireSpec("bf16", "dense", 16, torch.bfloat16, narrow=True),
    _q("int8", 8, "int", 127.0, 0),
    _q("int4", 4, "int", 7.0, 1),
    _q("fp8_e4m3", 8, "float", 448.0, 2, exp_bits=4, man_bits=3),
    _q("fp8_e5m2", 8, "float", 57344.0, 3, exp_bits=5, man_bits=2),
    _q("fp4_e2m1", 4, "float", 6.0, 4, exp_bits=2, man_bits=1),
    _q("fp4_e3m0", 4, "float", 16.0, 5, exp_bits=3, man_bits=0),  # the Streaming DiLoCo paper's FP4
    WireSpec("topk", "sparse", None),
)
BY_NAME: dict[str, WireSpec] = {s.name: s for s in TABLE}
DENSE: tuple[WireSpec, ...] = tuple(s for s in TABLE if s.kind == "dense")
QUANTIZED: tuple[WireSpec, ...] = tuple(s for s in TABLE if s.kind == "quantized")
SPARSE: tuple[WireSpec, ...] = tuple(s for s in TABLE if s.kind == "sparse")
#: The dense wire dtypes narrower than the data they may carry.
NARROW_DTYPES: tuple[torch.dtype, ...] = tuple(s.dtype for s in DENSE if s.narrow)

assert [s.abi for s in QUANTIZED] == list(range(len(QUANTIZED))), "abi.h's LC_Q_* codes are 0, 1, ..."
