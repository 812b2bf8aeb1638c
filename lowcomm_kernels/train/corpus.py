"""Byte-level corpora: the Python standard library's own source (default) or the user's text.

The default corpus needs no download: every Python installation carries its standard library's
``.py`` files. Files are split into train and validation by a hash of their path relative to the
corpus root, so the split is the same on every machine and run and no file is in both.
"""

from __future__ import annotations

import hashlib
import os
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch

# Skipped inside the stdlib: tests (huge generated data files, non-representative), third-party
# site-packages, caches and IDLE's test data.
_STDLIB_SKIP_DIRS = frozenset({"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"})
TEXT_SUFFIXES = (".py", ".txt", ".md", ".rst", ".c", ".h", ".cpp", ".json", ".toml", ".cfg", ".ini", ".sh")


class CorpusError(ValueError):
    """Raised for a missing, empty or unusable corpus; the CLI prints it as one line."""


def stdlib_root() -> Path:
    """Directory holding the running interpreter's standard library source."""
    path = sysconfig.get_paths().get("stdlib") or os.path.dirname(os.__file__)
    root = Path(path)
    if not (root / "os.py").is_file():  # some distributions move it; os.__file__ is authoritative
        root = Path(os.path.dirname(os.__file__))
    return root


def is_validation(relpath: str, val_fraction: float) -> bool:
    """True when the file goes to validation: first 8 bytes of sha256(relpath) / 2^64 < val_fraction.

    ``relpath`` uses '/' separators so the split is identical across operating systems.
    """
    h = int.from_bytes(hashlib.sha256(relpath.encode("utf-8")).digest()[:8], "big")
    return h / 2.0**64 < val_fraction


def list_files(root: Path, suffixes: tuple[str, ...], skip_dirs: frozenset[str] = frozenset()) -> list[Path]:
    """Sorted files under ``root`` (or ``[root]`` for a file) with one of ``suffixes``."""
    if root.is_file():
        return [root]
    out: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in skip_dirs and not d.startswith("."))
        out.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(suffixes))
    return out


@dataclass
class Corpus:
    """Train and validation byte streams (uint8 tensors) and the files behind them."""

    train: torch.Tensor
    val: torch.Tensor
    train_files: list[str]
    val_files: list[str]
    source: str

    def describe(self) -> str:
        return (
            f"{self.source}: {len(self.train_files)} train files ({self.train.numel() / 1e6:.2f} MB), "
            f"{len(self.val_files)} val files ({self.val.numel() / 1e6:.2f} MB)"
        )


def _read_concat(paths: list[Path], limit: int | None) -> torch.Tensor:
    chunks: list[bytes] = []
    total = 0
    for p in paths:
        try:
            data = p.read_bytes()
        except OSError:
            continue  # unreadable file (permissions, broken link): skip rather than fail the run
        if not data:
            continue
        chunks.append(data + b"\n")
        total += len(data) + 1
        if limit is not None and total >= limit:
            break
    buf = b"".join(chunks)
    if limit is not None:
        buf = buf[:limit]
    return torch.frombuffer(bytearray(buf), dtype=torch.uint8) if buf else torch.empty(0, dtype=torch.uint8)


def load_corpus(
    path: str | os.PathLike | None = None,
    *,
    val_fraction: float = 0.1,
    max_train_bytes: int | None = 4_000_000,
    max_val_bytes: int | None = 400_000,
    min_bytes: int = 1024,
) -> Corpus:
    """Load a corpus and split it by file.

    path: None for the Python standard library, else a text file or a folder of text files
    (``TEXT_SUFFIXES``). A single file cannot be split by file, so its last ``val_fraction`` of
    bytes becomes validation. Raises :class:`CorpusError` when the path is missing, holds no text,
    or either split is shorter than ``min_bytes``.
    """
    if not 0.0 < val_fraction < 1.0:
        raise CorpusError(f"val_fraction must be in (0, 1), got {val_fraction}")
    suffixes: tuple[str, ...]
    if path is None:
        root, suffixes, skip, source = stdlib_root(), (".py",), _STDLIB_SKIP_DIRS, "python-stdlib"
    else:
        root = Path(path).expanduser()
        suffixes, skip, source = TEXT_SUFFIXES, frozenset({"__pycache__", ".git"}), str(root)
        if not root.exists():
            raise CorpusError(f"--data path does not exist: {root}")
    if root.is_file():
        data = _read_concat([root], None)
        if data.numel() < 2 * min_bytes:
            raise CorpusError(f"corpus {root} has {data.numel()} bytes; need at least {2 * min_bytes}")
        cut = int(data.numel() * (1 - val_fraction))
        train, val = data[:cut], data[cut:]
        if max_train_bytes is not None:
            train = train[:max_train_bytes]
        if max_val_bytes is not None:
            val = val[:max_val_bytes]
        return Corpus(train, val, [root.name], [root.name + " (tail)"], source)
    files = list_files(root, suffixes, skip)
    if not files:
        raise CorpusError(f"corpus folder {root} holds no text files ({', '.join(suffixes)})")
    rel = [p.relative_to(root).as_posix() for p in files]
    val_files = [p for p, r in zip(files, rel, strict=True) if is_validation(r, val_fraction)]
    train_files = [p for p, r in zip(files, rel, strict=True) if not is_validation(r, val_fraction)]
    if not train_files or not val_files:
        raise CorpusError(
            f"corpus folder {root} has {len(files)} file(s): too few to split by file "
            f"(train {len(train_files)}, val {len(val_files)}); add files or pass a single file"
        )
    train = _read_concat(train_files, max_train_bytes)
    val = _read_concat(val_files, max_val_bytes)
    for name, t in (("train", train), ("validation", val)):
        if t.numel() < min_bytes:
            raise CorpusError(f"corpus {root}: {name} split has {t.numel()} bytes; need at least {min_bytes}")
    return Corpus(
        train,
        val,
        [p.relative_to(root).as_posix() for p in train_files],
        [p.relative_to(root).as_posix() for p in val_files],
        source,
    )


#: bytes per block of the 'iid' split (a 64-byte window straddles two blocks, i.e. joins text that was
#: not adjacent, with probability 63 / 4096, about 1.5%)
IID_BLOCK = 4096


def worker_shard(data: torch.Tensor, rank: int, world_size: int, split: str = "contiguous") -> torch.Tensor:
    """``rank``'s share of the byte stream, disjoint across ranks and the same on every call.

    - ``contiguous``: the rank-th 1/world_size slice. The stream is the sorted files' concatenation,
      so each worker reads other files (other modules, other styles): a non-iid split.
    - ``iid``: blocks of :data:`IID_BLOCK` bytes dealt round-robin (rank, rank + W, rank + 2W, ...),
      joined: every worker reads every part of the stream, the same number of blocks each (a
      tail shorter than W blocks is left out).
    """
    if split == "contiguous":
        n = data.numel() // world_size
        return data[rank * n : (rank + 1) * n]
    if split != "iid":
        raise ValueError(f"split must be 'contiguous' or 'iid', got {split!r}")
    per_rank = data.numel() // (IID_BLOCK * world_size)
    if per_rank == 0:
        raise CorpusError(
            f"the iid split needs {IID_BLOCK * world_size} bytes ({IID_BLOCK} per worker), got {data.numel()}"
        )
    blocks = data[: per_rank * world_size * IID_BLOCK].view(per_rank, world_size, IID_BLOCK)
    return blocks[:, rank].reshape(-1)


def sample_batch(
    data: torch.Tensor, batch_size: int, seq_len: int, generator: torch.Generator
) -> tuple[torch.Tensor, torch.Tensor]:
    """Random windows: x (B, T) int64 bytes and y = x shifted by one (next-byte targets)."""
    if data.numel() <= seq_len + 1:
        raise CorpusError(f"shard of {data.numel()} bytes is shorter than seq_len + 1 = {seq_len + 1}")
    starts = torch.randint(0, data.numel() - seq_len - 1, (batch_size,), generator=generator)
    idx = starts[:, None] + torch.arange(seq_len + 1)
    window = data[idx].long()
    return window[:, :-1], window[:, 1:]


def eval_batches(
    data: torch.Tensor, n_batches: int, batch_size: int, seq_len: int
) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """Fixed validation batches: evenly spaced windows, the same for every method and run."""
    n_windows = n_batches * batch_size
    if data.numel() <= seq_len + 1:
        raise CorpusError(f"validation split of {data.numel()} bytes is shorter than seq_len + 1")
    starts = torch.linspace(0, data.numel() - seq_len - 2, n_windows).long()
    idx = starts[:, None] + torch.arange(seq_len + 1)
    window = data[idx].long()
    x, y = window[:, :-1], window[:, 1:]
    return [(x[i : i + batch_size], y[i : i + batch_size]) for i in range(0, n_windows, batch_size)]


#: default of ``--eval-bytes``: validation bytes scored per evaluation (256 KiB; the default
#: validation split is 400,000 bytes, so 4,096 windows of 64 bytes)
DEFAULT_EVAL_BYTES = 262_144


@dataclass(frozen=True)
class EvalSet:
    """The validation windows: n non-overlapping windows spread evenly over the whole validation text.

    Window i reads bytes ``[s_i, s_i + T)`` and predicts ``[s_i + 1, s_i + T + 1)`` (T = seq_len)
    with s_i = floor(i (L - 1 - T) / (n - 1)) on a text of L bytes and
    n = min(L - 1, eval_bytes) // T, so no target byte is scored twice. A subset smaller than the
    text is a systematic sample of all of it, not its first bytes: the beginning of a text is one
    document, whose difficulty need not be the text's (on the default corpus, one model of 16-byte
    context scored 3.40 nats per byte on the first 4 KiB, 2.65 on 4 KiB spread evenly and 2.68 on
    256 KiB spread evenly). When the windows
    cover the text (n T = L - 1) they tile it, and every byte of ``text[1:]`` is scored exactly once.
    The windows depend on the text, T and ``eval_bytes`` only: the same at every evaluation, for
    every method and on every machine.
    """

    text: torch.Tensor
    seq_len: int
    n_windows: int

    @property
    def scored_bytes(self) -> int:
        """Target bytes per evaluation: n_windows * seq_len."""
        return self.n_windows * self.seq_len

    @property
    def starts(self) -> torch.Tensor:
        """Window i's first byte, s_i (int64, increasing, at least seq_len apart)."""
        n, span = self.n_windows, self.text.numel() - 1 - self.seq_len
        if n == 1:
            return torch.zeros(1, dtype=torch.int64)
        return torch.arange(n, dtype=torch.int64) * span // (n - 1)

    def rank_range(self, rank: int, world: int) -> range:
        """``rank``'s contiguous share of the window indices (sizes differ by at most one)."""
        return range(self.n_windows * rank // world, self.n_windows * (rank + 1) // world)

    def batches(self, windows: range, batch_windows: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The windows ``windows`` as (x, y) int64 batches of at most ``batch_windows`` windows each."""
        out = []
        starts, offsets = self.starts, torch.arange(self.seq_len + 1)
        for lo in range(windows.start, windows.stop, batch_windows):
            hi = min(lo + batch_windows, windows.stop)
            window = self.text[starts[lo:hi, None] + offsets].long()
            out.append((window[:, :-1], window[:, 1:]))
        return out


def eval_set(data: torch.Tensor, seq_len: int, eval_bytes: int = DEFAULT_EVAL_BYTES) -> EvalSet:
    """The fixed validation windows scoring up to ``eval_bytes`` target bytes (see :class:`EvalSet`).

    Raises ValueError naming ``seq_len`` or ``eval_bytes`` when either is not an int with
    eval_bytes >= seq_len >= 1, and :class:`CorpusError` when the text holds no window of seq_len + 1
    bytes.
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    if isinstance(eval_bytes, bool) or not isinstance(eval_bytes, int) or eval_bytes < seq_len:
        raise ValueError(f"eval_bytes must be an int >= seq_len = {seq_len}, got {eval_bytes!r}")
    if data.numel() < seq_len + 1:
        raise CorpusError(
            f"validation split of {data.numel()} bytes is shorter than seq_len + 1 = {seq_len + 1}"
        )
    n = min(data.numel() - 1, eval_bytes) // seq_len
    return EvalSet(data, seq_len, n)
