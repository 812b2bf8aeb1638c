"""The calls an internal caller (the runtime, every sync) makes with ``check_values=False``: the
same results bit for bit, no read of device data on the host, and the user-facing default still
refusing bad values. Plus mask_indices' native launcher building its round keys on the device
without a host-to-device copy."""

from __future__ import annotations

import contextlib
import importlib

import pytest
import torch

import lowcomm_kernels.ops as lk

mask_module = importlib.import_module("lowcomm_kernels.ops.mask_indices")  # the package exports the function

HOST_READS = ("__bool__", "__int__", "__float__", "item", "tolist", "numpy", "cpu")


@contextlib.contextmanager
def no_host_reads(monkeypatch: pytest.MonkeyPatch, device: str):
    """Every way Python code reads a tensor's values on the host raises inside this block (on a
    GPU, torch's sync debug mode also turns any synchronising call into an error)."""

    def refuse(name):
        def read(*args, **kwargs):
            raise AssertionError(f"Tensor.{name} read device data on the host")

        return read

    with monkeypatch.context() as m:
        for name in HOST_READS:
            m.setattr(torch.Tensor, name, refuse(name))
        if device == "cuda":
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("error")
        try:
            yield
        finally:
            if device == "cuda":
                torch.cuda.set_sync_debug_mode("default")


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


def _idx(n: int, k: int, device: str, seed: int = 5) -> torch.Tensor:
    return lk.mask_indices(seed, 3, n, k, device=device)


@pytest.mark.op("sparse_gather")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_gather_unchecked_is_identical_and_reads_nothing(device, backend, dtype, rng, monkeypatch):
    n, k = 10007, 1001
    x = torch.randn(n, generator=rng, dtype=torch.float64).to(device, dtype)
    idx = _idx(n, k, device)
    want = lk.sparse_gather(x, idx, backend=backend)
    out = torch.empty(k, dtype=dtype, device=device)
    with no_host_reads(monkeypatch, device):
        got = lk.sparse_gather(x, idx, out=out, backend=backend, check_values=False)
    assert got is out and torch.equal(_bits(got), _bits(want))


@pytest.mark.op("sparse_scatter_merge_")
@pytest.mark.parametrize("avg_dtype", [None, torch.bfloat16], ids=["avg=x", "avg=bf16"])
def test_scatter_merge_unchecked_is_identical_and_reads_nothing(device, backend, avg_dtype, rng, monkeypatch):
    n, k = 10007, 1001
    x = torch.randn(n, generator=rng, dtype=torch.float64).to(device, torch.float32)
    idx = _idx(n, k, device)
    sent = x[idx] + 0.1
    avg = (sent + 0.2).to(avg_dtype or x.dtype)
    want = x.clone()
    lk.sparse_scatter_merge_(want, idx, avg, sent, beta=0.7, backend=backend)
    with no_host_reads(monkeypatch, device):
        lk.sparse_scatter_merge_(x, idx, avg, sent, beta=0.7, backend=backend, check_values=False)
    assert torch.equal(_bits(x), _bits(want))


@pytest.mark.op("fragment_norms", exclude=("ref",))  # the ref reads offsets on the host by design
@pytest.mark.parametrize("ord", [1, 2])
def test_fragment_norms_unchecked_is_identical_and_reads_nothing(device, backend, ord, rng, monkeypatch):
    buf = torch.randn(100003, generator=rng).to(device)
    offsets = torch.tensor([0, 0, 17, 50000, 50000, 100003], device=device)
    want = lk.fragment_norms(buf, offsets, ord=ord, backend=backend)
    with no_host_reads(monkeypatch, device):
        got = lk.fragment_norms(buf, offsets, ord=ord, backend=backend, check_values=False)
    assert torch.equal(_bits(got), _bits(want))


def test_the_checks_read_the_host_by_default(monkeypatch):
    """The guard above is not vacuous: the default (checked) calls do read the host."""
    x, idx = torch.randn(100), torch.tensor([3, 5, 7])
    with no_host_reads(monkeypatch, "cpu"), pytest.raises(AssertionError, match="host"):
        lk.sparse_gather(x, idx)
    with no_host_reads(monkeypatch, "cpu"), pytest.raises(AssertionError, match="host"):
        lk.fragment_norms(x, torch.tensor([0, 50, 100]), backend="cpu" if _has_cpu() else "ref")


def _has_cpu() -> bool:
    from lowcomm_kernels import _dispatch

    return _dispatch.available("cpu", torch.device("cpu"), "lc_fragment_norms")


# ---- the user-facing default still refuses bad values ---------------------------------------


@pytest.mark.op("sparse_gather", "sparse_scatter_merge_")
def test_default_still_refuses_bad_indices(backend, close):
    x = torch.randn(64)
    avg, sent = torch.randn(4), torch.randn(4)
    for idx in (torch.tensor([0, 5, 6, 64]), torch.tensor([-1, 5, 6, 7])):
        close.assert_rejected(
            lambda idx=idx: lk.sparse_gather(x, idx, backend=backend), ValueError, "idx", [x]
        )
        close.assert_rejected(
            lambda idx=idx: lk.sparse_scatter_merge_(x, idx, avg, sent, backend=backend),
            ValueError,
            "idx",
            [x, avg, sent],
        )
    unsorted = torch.tensor([5, 0, 6, 7])
    close.assert_rejected(
        lambda: lk.sparse_scatter_merge_(x, unsorted, avg, sent, backend=backend), ValueError, "idx", [x]
    )


@pytest.mark.op("fragment_norms")
def test_default_still_refuses_bad_offsets(backend, close):
    buf = torch.randn(64)
    for offsets in (torch.tensor([0, 10, 5, 64]), torch.tensor([0, 10, 65]), torch.tensor([-1, 10])):
        close.assert_rejected(
            lambda o=offsets: lk.fragment_norms(buf, o, backend=backend), ValueError, "offsets"
        )


@pytest.mark.op("sparse_gather", "sparse_scatter_merge_", "fragment_norms")
def test_unchecked_keeps_the_metadata_checks(backend, close):
    """check_values=False skips only the value checks: dtype, device, shape, strides and
    overlap are still refused, and check_values itself must be a bool."""
    x = torch.randn(64)
    idx = torch.tensor([1, 2, 3])
    out = torch.empty(3)
    kw = dict(backend=backend, check_values=False)
    close.assert_rejected(lambda: lk.sparse_gather(x, idx.int(), out=out, **kw), TypeError, "idx", [x, out])
    close.assert_rejected(lambda: lk.sparse_gather(x, idx[None], out=out, **kw), ValueError, "idx", [x, out])
    close.assert_rejected(lambda: lk.sparse_gather(x, idx, out=x[:3], **kw), ValueError, "out", [x])
    close.assert_rejected(lambda: lk.sparse_gather(x, idx, out=torch.empty(4), **kw), ValueError, "out", [x])
    close.assert_rejected(
        lambda: lk.sparse_scatter_merge_(x, idx, x[10:13], torch.randn(3), **kw),
        ValueError,
        ("x", "avg"),
        [x],
    )
    close.assert_rejected(
        lambda: lk.fragment_norms(x, torch.tensor([0.0, 64.0]), **kw), TypeError, "offsets", [x]
    )
    close.assert_rejected(
        lambda: lk.sparse_gather(x, idx, out=out, backend=backend, check_values=1), TypeError, "check_values"
    )


def test_check_values_through_the_registered_ops():
    """The registered ops carry check_values (default True), so a compiled caller can skip too."""
    for op in ("sparse_gather", "sparse_scatter_merge_", "fragment_norms"):
        arg = getattr(torch.ops.lowcomm, op).default._schema.arguments[-1]
        assert arg.name == "check_values" and str(arg.type) == "bool" and arg.default_value is True
    x, idx = torch.randn(10), torch.tensor([1, 4])
    out = torch.empty(2)
    torch.ops.lowcomm.sparse_gather(x, idx, out, None, False)
    assert torch.equal(out, x[idx])


# ---- mask_indices: round keys on the device, no host-to-device copy --------------------------


def test_native_keys_are_filled_on_the_device(monkeypatch):
    """For a GPU the native launcher's key tensors come from fills (a kernel each, the value as
    its argument), never from torch.tensor(..., device=cuda), whose copy from pageable memory
    makes the host wait for the stream. Checked with the allocation redirected to the CPU."""
    values = [3, (1 << 62) + 5, 0, 17]
    real_empty = torch.empty
    allocated: list[torch.device] = []

    def empty_on_cpu(*shape, dtype=None, device=None):
        allocated.append(torch.device(device))
        return real_empty(*shape, dtype=dtype)

    def no_copy(*args, **kwargs):
        raise AssertionError("torch.tensor copies the keys from the host")

    monkeypatch.setattr(mask_module.torch, "empty", empty_on_cpu)
    monkeypatch.setattr(mask_module.torch, "tensor", no_copy)
    keys = mask_module.keys_on(values, torch.device("cuda", 1))
    assert allocated == [torch.device("cuda", 1)]
    assert keys.dtype == torch.int64 and keys.tolist() == values


def test_native_keys_on_the_cpu():
    assert mask_module.keys_on([1, 2, 3, 4], torch.device("cpu")).tolist() == [1, 2, 3, 4]


def test_mask_indices_reads_nothing_on_the_host(monkeypatch):
    """mask_indices takes (seed, round) as Python ints and derives the keys on the host as
    integers: nothing of the device is read (backend by device; the ref's cycle walk does read)."""
    want = lk.mask_indices(9, 4, 100003, 5000)
    with no_host_reads(monkeypatch, "cpu"):
        got = lk.mask_indices(9, 4, 100003, 5000, backend="cpu" if _has_cpu() else "ref")
    assert torch.equal(got, want)
