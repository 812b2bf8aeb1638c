"""Corpus loading and the deterministic file-level train/validation split."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from lowcomm_kernels.train.corpus import (
    DEFAULT_EVAL_BYTES,
    CorpusError,
    eval_batches,
    eval_set,
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


def test_eval_set_scores_every_byte_once_in_non_overlapping_windows():
    data = torch.randint(0, 256, (1001,), generator=torch.Generator().manual_seed(1), dtype=torch.int64)
    data = data.to(torch.uint8)
    tiled = eval_set(data[: 62 * 16 + 1], 16, 10_000)  # the cap is above the text: all of it
    assert tiled.n_windows == 62 and tiled.scored_bytes == 62 * 16
    batches = tiled.batches(range(tiled.n_windows), 5)
    assert [b[0].shape[0] for b in batches] == [5] * 12 + [2]
    x = torch.cat([b[0] for b in batches])
    y = torch.cat([b[1] for b in batches])
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (62, 16)
    assert torch.equal(x.reshape(-1), data[: 62 * 16].long())  # windows tile the text, no overlap
    assert torch.equal(y.reshape(-1), data[1 : 62 * 16 + 1].long())  # every target byte once
    for cap, n in ((10_000, 62), (100, 6), (16, 1), (17 * 16, 17)):  # 100 target bytes: 6 windows
        es = eval_set(data, 16, cap)
        assert es.n_windows == n and es.scored_bytes == 16 * n
        s = es.starts
        assert int(s[0]) == 0 and int(s[-1]) == (1000 - 16 if n > 1 else 0)  # first and last byte
        assert bool((s[1:] - s[:-1] >= 16).all())  # no target byte scored twice
        x, y = (torch.cat(t) for t in zip(*es.batches(range(n), 4), strict=True))
        assert torch.equal(x, data[s[:, None] + torch.arange(16)].long())
        assert torch.equal(y, data[s[:, None] + torch.arange(1, 17)].long())


def test_eval_set_spreads_a_subset_over_the_whole_text():
    """A subset is a systematic sample of all of the text, not its first bytes: with 1/10 of a
    text of ten distinct documents, every document holds windows."""
    docs = torch.arange(10, dtype=torch.uint8).repeat_interleave(1600)  # document d is bytes d
    es = eval_set(docs, 16, 1600)
    x = torch.cat([b[0] for b in es.batches(range(es.n_windows), 8)])
    assert es.n_windows == 100 and sorted(set(x[:, 0].tolist())) == list(range(10))


def test_eval_set_rank_shares_partition_the_windows():
    es = eval_set(torch.zeros(16 * 61 + 1, dtype=torch.uint8), 16, 16 * 61)
    for world in (1, 2, 3, 4, 7):
        shares = [es.rank_range(r, world) for r in range(world)]
        assert [i for s in shares for i in s] == list(range(61))
        assert max(len(s) for s in shares) - min(len(s) for s in shares) <= 1


def test_default_eval_set_is_deterministic_and_at_least_256_kib():
    """The default validation set: 262,144 scored bytes (4,096 windows of 64) of the stdlib's
    validation split, identical in a fresh process (no dependence on seeds or run order)."""
    c = load_corpus(None)
    es = eval_set(c.val, 64)
    assert es.scored_bytes == DEFAULT_EVAL_BYTES == 262_144 and es.n_windows == 4096
    x = torch.cat([b[0] for b in es.batches(range(es.n_windows), 512)])
    digest = hashlib.sha256(x.numpy().tobytes()).hexdigest()
    code = (
        "import hashlib, torch; from lowcomm_kernels.train.corpus import load_corpus, eval_set;"
        "es = eval_set(load_corpus(None).val, 64);"
        "x = torch.cat([b[0] for b in es.batches(range(es.n_windows), 512)]);"
        "print(hashlib.sha256(x.numpy().tobytes()).hexdigest())"
    )
    out = subprocess.run(
        [sys.executable, "-c", code],
        capture_output=True,
        text=True,
        check=True,
        env={**os.environ, "PYTHONHASHSEED": "12345"},
    )
    assert out.stdout.strip() == digest


@pytest.mark.parametrize(
    ("seq_len", "eval_bytes", "name"), [(16, 15, "eval_bytes"), (0, 100, "seq_len"), (16, 16.0, "eval_bytes")]
)
def test_eval_set_rejects_bad_sizes_by_name(seq_len, eval_bytes, name):
    with pytest.raises(ValueError, match=name):
        eval_set(torch.zeros(100, dtype=torch.uint8), seq_len, eval_bytes)


def test_eval_set_needs_one_window_of_text():
    with pytest.raises(CorpusError, match="seq_len \\+ 1 = 17"):
        eval_set(torch.zeros(16, dtype=torch.uint8), 16, 64)
