"""Shared test plumbing: the tolerance table, the seeded `rng`, backend parametrization, markers.

Tolerances come from the maths, not from trial and error (docs/design.md, "Numerics"):

* **elementwise** ops compute each output from a handful of O(1) inputs with at most ~8 roundings
  (outer_merge: the SGD step, then g_new + β·v − λ·v·v·D and the α mix). Each rounding is at most
  ½ ulp of an O(1) intermediate, and a backend may fuse (FMA) or reorder them, so two correct
  implementations differ by at most ~8·eps relative to the inputs' scale: rtol = atol = 8·eps
  (fp64 ≈ 1.8e-15, fp32 ≈ 9.5e-7, i.e. ~1e-6 relative). atol assumes O(1)
  intermediates; `assert_close(scale=...)` multiplies it by the largest intermediate's magnitude.
* **reductions** of n non-negative terms (‖·‖₁, ‖·‖₂²), formed identically on both sides, then
  accumulated in fp64 in different orders
  differ by a relative error that grows like √n·eps_acc for random rounding (and blocked/pairwise
  summation stays well under that); the result is then rounded once to the output dtype:
  rtol = 8·√n·eps_fp64 + eps_out. Terms that carry their own roundings (normalized λ's sums of
  v⊙v⊙D) need the elementwise rtol added.
* **bf16 wire**: the spec rounds the exact difference (computed in g's dtype) once to bf16, so a
  correct backend is *bit-identical* to ``(g - x).to(torch.bfloat16)``; the 2⁻⁸ relative bound of
  one bf16 rounding (~4e-3, "~1e-2") is what a consumer of the wire value may assume.

``rng`` gives every test fresh random inputs: the seed is drawn per test and printed in the
failure report (rerun with ``--seed N``). Property tests use hypothesis' own derandomized draws.

``TRITON_INTERPRET`` is removed from the environment here, so the op tests run the backends a user
gets on a CPU; ``tests/ops/test_triton_interpret.py`` sets it for itself.

**Parallel runs.** ``pytest`` over ``tests/`` runs on one pytest-xdist worker per CPU (at most 8)
unless ``-n`` is given (``-n 0``: one process, in file order); the suite is CPU-bound (mostly
process start-up and gloo ranks), so this roughly halves it on 2 cores. Here:

* a module that defines a module- or class-scoped fixture (one process group for the whole file,
  say) runs on one worker, so the fixture is built once (``--dist loadgroup`` and a scheduler of
  our own, ``pytest_xdist_make_scheduler``);
* modules with ``slow`` tests are handed out first, so no worker is left with a long test at the end;
* a test marked ``serial`` (wall-clock assertions) runs while no other test runs: every test holds
  a shared lock on a file of this run, a ``serial`` one an exclusive lock.

Tests marked ``study`` (long end-to-end study, benchmark-script, soak and many-process fault runs)
are deselected by ``addopts`` in pyproject.toml; ``pytest -m study`` runs them (a step of its own in
``.ci/run``).
"""

from __future__ import annotations

import contextlib
import functools
import math
import os
import pathlib
import re
import secrets
from collections.abc import Callable, Iterator, Sequence

import pytest

# Before torch loads OpenMP: in a parallel run (see below) the other worker's processes keep the
# cores busy, and OpenMP threads that spin while they wait for work burn the time those need (the
# quantize op tests took 2.6x the CPU time beside a busy core). Passive threads sleep instead; the
# thread count, and so every threaded code path the tests reach, stays the same.
if os.environ.get("PYTEST_XDIST_WORKER"):
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

# Before lowcomm_kernels is imported anywhere: Triton decides interpretation when kernels are
# decorated, and _dispatch would offer the 'triton' backend on CPU tensors with it set.
os.environ.pop("TRITON_INTERPRET", None)

from lowcomm_kernels import _dispatch  # noqa: E402

EPS = {dt: torch.finfo(dt).eps for dt in (torch.float64, torch.float32, torch.bfloat16)}

#: kind -> dtype -> (rtol, atol); reductions add the √n term in `tolerance`.
TOL: dict[str, dict[torch.dtype, tuple[float, float]]] = {
    "elementwise": {dt: (8 * EPS[dt], 8 * EPS[dt]) for dt in (torch.float64, torch.float32)},
    "reduction": {dt: (EPS[dt], 0.0) for dt in (torch.float64, torch.float32)},
    # one round-to-nearest to bf16: |err| <= 2^-9 relative (eps_bf16 = 2^-7 is the ulp of 1).
    "wire_bf16": {torch.bfloat16: (2.0**-8, 0.0)},
}


def tolerance(kind: str, dtype: torch.dtype, n: int = 1) -> tuple[float, float]:
    """(rtol, atol) for comparing a backend with the reference (see the module docstring)."""
    rtol, atol = TOL[kind][dtype]
    if kind == "reduction":
        rtol += 8 * math.sqrt(max(n, 1)) * EPS[torch.float64]
    return rtol, atol


class Checks:
    """Assertion helpers, handed to tests through the session-scoped `close` fixture (a fixture
    rather than an import: pytest imports each conftest under the bare name ``conftest``)."""

    TOL = TOL
    EPS = EPS
    tolerance = staticmethod(tolerance)

    @staticmethod
    def assert_close(
        actual: torch.Tensor,
        expected: torch.Tensor,
        kind: str = "elementwise",
        n: int | None = None,
        scale: float = 1.0,
        msg: str = "",
    ) -> None:
        """`scale`: the magnitude of the largest intermediate (the table assumes O(1) inputs)."""
        assert actual.dtype == expected.dtype, f"{msg}: dtype {actual.dtype} != {expected.dtype}"
        assert actual.shape == expected.shape, (
            f"{msg}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
        )
        rtol, atol = tolerance(kind, expected.dtype, n if n is not None else expected.numel())
        atol *= scale
        torch.testing.assert_close(
            actual,
            expected,
            rtol=rtol,
            atol=atol,
            equal_nan=True,
            msg=lambda m: f"{msg} [{kind}, rtol={rtol:.2g}, atol={atol:.2g}]\n{m}",
        )

    @staticmethod
    def storage_bytes(t: torch.Tensor) -> torch.Tensor:
        """A copy of every byte of `t`'s whole storage (a write anywhere in it shows up)."""
        return torch.empty(0, dtype=torch.uint8, device=t.device).set_(t.untyped_storage()).clone()

    @classmethod
    def assert_rejected(
        cls,
        call: Callable[[], object],
        exc: type[Exception] | tuple[type[Exception], ...],
        arg: str | Sequence[str],
        buffers: Sequence[torch.Tensor | None] = (),
    ) -> None:
        """`call()` raises `exc` whose message starts with the argument's name (or one of `arg`),
        and no byte of any buffer in `buffers` (their whole storages) changed."""
        names = [arg] if isinstance(arg, str) else list(arg)
        live = [b for b in buffers if isinstance(b, torch.Tensor) and b.device.type != "meta"]
        before = [cls.storage_bytes(b) for b in live]
        with pytest.raises(exc) as info:
            call()
        text = str(info.value)
        assert any(re.match(rf"{re.escape(nm)}\b", text) for nm in names), (
            f"the error does not start with the argument name {names}: {text!r}"
        )
        for i, (b, bb) in enumerate(zip(live, before, strict=True)):
            assert torch.equal(cls.storage_bytes(b), bb), (
                f"buffer #{i} was written by a rejected call ({text})"
            )


@pytest.fixture(scope="session")
def close() -> type[Checks]:
    return Checks


# ---- rng: fresh inputs per test, seed in the report -------------------------------------------

_SEED_KEY = pytest.StashKey[int]()


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--seed",
        type=int,
        default=None,
        help="seed for the `rng` fixture (default: a fresh random seed per test)",
    )


@pytest.fixture
def rng(request: pytest.FixtureRequest) -> torch.Generator:
    """A torch.Generator seeded freshly for this test (or with --seed)."""
    seed = request.config.getoption("--seed")
    if seed is None:
        seed = secrets.randbits(63)
    request.node.stash[_SEED_KEY] = seed
    return torch.Generator().manual_seed(seed)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    seed = item.stash.get(_SEED_KEY, None)
    if report.failed and seed is not None:
        report.sections.append(("rng seed", f"rng seed {seed}: rerun with --seed {seed}"))


# ---- backends and markers ----------------------------------------------------------------------

#: public op -> the C ABI entry its native backends need (dispatch checks the same name).
NATIVE_ENTRY = {
    "pack": "lc_pack",
    "outer_merge_": "lc_outer_merge",
    "mask_indices": "lc_mask_perm",
    "sparse_gather": "lc_sparse_gather",
    "sparse_scatter_merge_": "lc_sparse_scatter_merge",
    "fragment_norms": "lc_fragment_norms",
}


def backends_for(ops: Sequence[str], device: str = "cpu") -> list[str]:
    """Backends that can run every op in `ops` on `device` now (evaluated at collection time, so a
    freshly built native library is picked up by the next pytest run)."""
    dev = torch.device(device)
    return [
        b
        for b in _dispatch.available_backends(dev)
        if all(_dispatch.available(b, dev, NATIVE_ENTRY[op]) for op in ops)
    ]


@pytest.fixture(scope="session", name="backends_for")
def _backends_for_fixture() -> Callable[..., list[str]]:
    """`backends_for` for tests that need the whole list at once (a subprocess checking them all)."""
    return backends_for


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line(
        "markers",
        "op(*names, exclude=()): the ops a test exercises; parametrizes `backend` "
        "(and `device`) over the backends that can run them all",
    )


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """`backend` (with `device` if the test asks for it) is parametrized over every backend that
    can run the test's ops (its `op` marker): CPU always, CUDA when a GPU is present (marked gpu).
    A test asking for `op_name` and `backend` gets every (op, backend) pair on the CPU."""
    if "backend" not in metafunc.fixturenames:
        return
    if "op_name" in metafunc.fixturenames:  # every (op, backend) pair
        metafunc.parametrize(
            ("op_name", "backend"),
            [pytest.param(op, b, id=f"{op}-{b}") for op in NATIVE_ENTRY for b in backends_for((op,))],
        )
        return
    marker = metafunc.definition.get_closest_marker("op")
    if marker is None:  # the test parametrizes `backend` itself
        return
    ops = marker.args
    exclude = marker.kwargs.get("exclude", ())  # e.g. exclude=("ref",) for native-path tests
    if "device" in metafunc.fixturenames:
        params = [pytest.param("cpu", b, id=f"cpu-{b}") for b in backends_for(ops, "cpu") if b not in exclude]
        if torch.cuda.is_available():
            params += [
                pytest.param("cuda", b, id=f"cuda-{b}", marks=pytest.mark.gpu)
                for b in backends_for(ops, "cuda")
                if b not in exclude
            ]
        metafunc.parametrize(("device", "backend"), params)
    else:
        metafunc.parametrize("backend", [b for b in backends_for(ops, "cpu") if b not in exclude])


GPU_TESTS = pathlib.Path(__file__).resolve().parent / "gpu"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _slow_modules_first(items)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    # LOWCOMM_GPU_TESTS_DEVICE=cpu: tests/gpu run on the CPU instead (tests/gpu/conftest.py)
    on_cpu = GPU_TESTS if os.environ.get("LOWCOMM_GPU_TESTS_DEVICE") == "cpu" else None
    for item in items:
        if item.get_closest_marker("gpu") and not (on_cpu and item.path.is_relative_to(on_cpu)):
            item.add_marker(skip)


@pytest.fixture(autouse=True, scope="module")
def _no_triton_interpret(request: pytest.FixtureRequest):
    """Keep TRITON_INTERPRET unset in every test module but the Triton-interpreter file, even if
    that file set it at import (module scope: hypothesis rejects function-scoped autouse fixtures)."""
    if request.node.path.name == "test_triton_interpret.py":
        yield
        return
    saved = os.environ.pop("TRITON_INTERPRET", None)
    yield
    if saved is not None:
        os.environ["TRITON_INTERPRET"] = saved


# ---- parallel runs (pytest-xdist): see the module docstring -------------------------------------

MAX_WORKERS = 8  # each worker imports torch (~1 GB); the tests' own process groups load the cores


def _cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


@pytest.hookimpl(tryfirst=True)  # before xdist's own (also tryfirst) turns -n into workers
def pytest_cmdline_main(config: pytest.Config) -> None:
    """One xdist worker per CPU when the run did not choose (-n, --tx, --dist, --pdb)."""
    opt = config.option
    if hasattr(config, "workerinput") or not config.pluginmanager.hasplugin("xdist"):
        return  # an xdist worker, or xdist not installed (-p no:xdist): one process
    if os.environ.get("PYTEST_XDIST_WORKER"):
        return  # a pytest started by a test (a script's own pytest stage): one process
    if opt.numprocesses is None and not opt.tx and opt.dist == "no" and not (opt.usepdb or opt.collectonly):
        env = os.environ.get("PYTEST_XDIST_AUTO_NUM_WORKERS")
        opt.numprocesses = int(env) if env else min(_cpus(), MAX_WORKERS)
        if opt.numprocesses:
            opt.dist = "loadgroup"
            opt.loadscopereorder = False  # hand out in collection order: slow modules first (below)


_SHARED_FIXTURE = re.compile(r"@pytest\.fixture\([^)]*scope\s*=\s*[\"'](?:module|class|package|session)[\"']")


@functools.cache
def _has_shared_fixture(path: str) -> bool:
    """The test file defines a fixture wider than a function (read from its source: the controller
    of a parallel run sees node ids only)."""
    try:
        with open(path, encoding="utf-8") as f:
            return _SHARED_FIXTURE.search(f.read()) is not None
    except OSError:
        return False


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_make_scheduler(config: pytest.Config, log):
    """--dist loadgroup, and a module that defines a shared fixture goes to one worker whole (its
    process group, say, is then built once). (xdist's own grouping appends the group to each node
    id in the workers, which pytest 9.2's structured node ids silently drop; here the controller
    reads the scope off the plain node id.)"""
    if config.option.dist != "loadgroup":
        return None
    from xdist.scheduler import LoadGroupScheduling

    class ModuleFixtureScheduling(LoadGroupScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            if scope != nodeid:  # an xdist_group mark (on a pytest that keeps the renamed id)
                return scope
            path = nodeid.split("::", 1)[0]
            return path if _has_shared_fixture(str(config.rootpath / path)) else nodeid

    return ModuleFixtureScheduling(config, log)


def _slow_modules_first(items: list[pytest.Item]) -> None:
    """Modules with a slow test first (whole modules, so that a module fixture is built once), the
    rest as collected: in a parallel run, a long test handed out last would run alone at the end."""
    slow = {item.getparent(pytest.Module) for item in items if item.get_closest_marker("slow")}
    items.sort(key=lambda item: item.getparent(pytest.Module) not in slow)


def _lock_path(config: pytest.Config) -> str | None:
    """A file of this run, beside the workers' temporary folders (None outside an xdist worker)."""
    basetemp = getattr(config.option, "basetemp", None)
    if not hasattr(config, "workerinput") or not basetemp:
        return None
    return os.path.join(os.path.dirname(os.path.abspath(basetemp)), "serial.lock")


@contextlib.contextmanager
def _run_lock(config: pytest.Config, exclusive: bool) -> Iterator[None]:
    """A readers-writer lock over the run's workers: shared for a test, exclusive for a serial one.
    A serial test that waits holds the turnstile, so no other test starts before it."""
    path = _lock_path(config)
    if path is None:
        yield
        return
    import fcntl  # (POSIX; only xdist workers get here)

    with open(path + ".turn", "a") as turn, open(path, "a") as lock:
        fcntl.flock(turn, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        fcntl.flock(lock, fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH)
        fcntl.flock(turn, fcntl.LOCK_UN)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    """Set-up (module fixtures included), call and teardown under the run's lock."""
    with _run_lock(item.config, exclusive=item.get_closest_marker("serial") is not None):
        yield
