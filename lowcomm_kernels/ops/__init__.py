"""The fused sync ops. Importing this module registers ``torch.ops.lowcomm.*``.

Each op lives in its own module: the ``*_ref`` specification; its launchers, one per backend, in
the table of ``_common``; the implementation (checks, backend choice, launch) that is both the
registered op's body and the eager path; the registered custom op with its fake kernel; and the
public function, documented with its arguments, shapes and what it mutates.

Internal callers (the runtime, in every sync) skip the checks that read device data on the host
-- each one a full synchronisation on a GPU -- with ``check_values=False``:

    sparse_gather(x, idx, check_values=False)
    sparse_scatter_merge_(x, idx, avg, sent, beta=beta, check_values=False)
    fragment_norms(buf, offsets, ord=ord, check_values=False)

for indices from ``mask_indices`` and offsets from their own fragment table. The cheap metadata
checks (dtype, device, shape, strides, aliasing) still run; the users' default checks everything.
``mask_indices`` reads nothing of the device (its keys are host integers, passed to the kernels
as scalar arguments) and ``pack`` has no value checks.
"""

from .fragment_norms import fragment_norms, fragment_norms_ref
from .mask_indices import mask_indices, mask_indices_ref, mask_keys
from .outer_merge import outer_merge_, outer_merge_ref, taylor_norms_ref
from .pack import pack, pack_ref
from .quantize import (
    FORMATS,
    QuantFormat,
    Quantized,
    dequantize,
    dequantize_ref,
    pack_quantized,
    pack_quantized_ref,
    quantize,
    quantize_ref,
    reduce_quantized,
    reduce_quantized_ref,
)
from .sparse import sparse_gather, sparse_gather_ref, sparse_scatter_merge_, sparse_scatter_merge_ref
from .topk import TopKFormat, topk_decode_add_, topk_decode_add_ref, topk_encode, topk_encode_ref

__all__ = [
    "fragment_norms",
    "fragment_norms_ref",
    "mask_indices",
    "mask_indices_ref",
    "mask_keys",
    "outer_merge_",
    "outer_merge_ref",
    "taylor_norms_ref",
    "pack",
    "pack_ref",
    "FORMATS",
    "QuantFormat",
    "Quantized",
    "dequantize",
    "dequantize_ref",
    "pack_quantized",
    "pack_quantized_ref",
    "quantize",
    "quantize_ref",
    "reduce_quantized",
    "reduce_quantized_ref",
    "sparse_gather",
    "sparse_gather_ref",
    "sparse_scatter_merge_",
    "sparse_scatter_merge_ref",
    "TopKFormat",
    "topk_decode_add_",
    "topk_decode_add_ref",
    "topk_encode",
    "topk_encode_ref",
]
