"""Corpus loading and the deterministic file-level train/validation split."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lowcomm_kernels.train.corpus import (
    CorpusError,
    eval_batches,
    is_validation,
    list_files,
    load_corpus,
    sample_batch,
    stdlib_root,
    worker_shard,
)


def test_stdlib_corpus_split_is_disjoint_and_nonempty():
    c = load_corpus(None, max_train_bytes=200_000, max_val_bytes=50_000)
    assert c.source == "python-stdlib"
    assert c.train_files and c.val_files
    assert not set(c.train_files) & set(c.val_files)
    assert c.train.dtype == torch.uint8 and c.train.numel() == 200_000
    assert 0 < c.val.numel() <= 50_000


def test_split_covers_every_stdlib_file_once_and_matches_the_hash_rule():
    root = stdlib_root()
    c = load_corpus(None, max_train_bytes=None, max_val_bytes=None)
    files = [
        p.relative_to(root).as_posix()
        for p in list_files(
            root,
            (".py",),
            frozenset({"test", "tests", "site-packages", "__pycache__", "idle_test", "dist-packages"}),
        )
    ]
    assert sorted(c.train_files + c.val_files) == sorted(files)
    assert all(is_validation(f, 0.1) for f in c.val_files)
    assert not any(is_validation(f, 0.1) for f in c.train_files)
    # ~10% of files go to validation (hash is uniform); loose bounds, hundreds of files
    assert 0.04 < len(c.val_files) / len(files) < 0.2


def test_split_is_identical_in_a_fresh_process():
    """No dependence on PYTHONHASHSEED or run order: a new interpreter picks the same val files."""
    code = (
        "from lowcomm_kernels.train.corpus import load_corpus;"
        "c = load_corpus(None, max_train_bytes=2000, max_val_bytes=2000); print('\\n'.join(c.val_files))"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env=dict(os.environ, PYTHONHASHSEED="123"),
    ).stdout.split()
    here = load_corpus(None, max_train_bytes=2000, max_val_bytes=2000).val_files
    assert out == here


def test_user_folder_split_and_single_file(tmp_path: Path):
    for i in range(40):
        (tmp_path / f"doc{i:02d}.txt").write_text(f"document {i} " * 100)
    (tmp_path / "image.png").write_bytes(b"\x89PNG" * 1000)  # not text: ignored
    c = load_corpus(tmp_path, min_bytes=100)
    assert len(c.train_files) + len(c.val_files) == 40
    assert not set(c.train_files) & set(c.val_files)
    one = tmp_path / "doc00.txt"
    c1 = load_corpus(one, min_bytes=10)
    assert c1.train.numel() + c1.val.numel() == one.stat().st_size + 1  # + the file separator
    assert c1.val.numel() > 0


@pytest.mark.parametrize("case", ["missing", "empty_folder", "empty_file", "no_text"])
def test_bad_corpus_raises_corpus_error(tmp_path: Path, case: str):
    path = tmp_path / "x"
    if case == "empty_folder":
        path.mkdir()
    elif case == "empty_file":
        path.write_text("")
    elif case == "no_text":
        path.mkdir()
        (path / "a.bin").write_bytes(b"\0" * 5000)
    with pytest.raises(CorpusError):
        load_corpus(path)


def test_batches_are_next_byte_pairs_and_shards_disjoint():
    data = torch.arange(1000, dtype=torch.int64).to(torch.uint8)
    shards = [worker_shard(data, r, 4) for r in range(4)]
    assert sum(s.numel() for s in shards) == 1000
    x, y = sample_batch(shards[1], 3, 16, torch.Generator().manual_seed(0))
    assert x.shape == y.shape == (3, 16) and x.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    b1 = eval_batches(data, 2, 3, 16)
    b2 = eval_batches(data, 2, 3, 16)
    assert len(b1) == 2 and all(torch.equal(a[0], b[0]) for a, b in zip(b1, b2, strict=True))
