"""`lowcomm train --wire-dtype/--quant-block/--error-feedback` and the top-k format's `--topk-k/--topk-chunk/
--topk-bits/--ef-beta`: every format runs end to end on 2 gloo ranks and reports its true bytes; bad input
is one line naming the flag (exit code 2)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from lowcomm_kernels.cli import main
from lowcomm_kernels.ops import FORMATS, TopKFormat
from lowcomm_kernels.runtime.schedule import SPARSE_WIRE_FORMATS, WIRE_FORMATS
from lowcomm_kernels.train.model import ModelConfig, parameter_count
from lowcomm_kernels.train.spec import WIRE_DTYPE_NAMES

TINY = (
    "--workers 2 --steps 8 --eval-every 4 --eval-bytes 512 --batch-size 2 --dim 16 --layers 2 "
    "--heads 2 --mlp-hidden 32 --seq-len 16 --sync-every 4 --delay 1 --fragments 2 --latency-ms 5 "
    "--bandwidth-mbps 1000 --warmup 2 --no-progress"
).split()


def test_the_cli_offers_every_wire_format_of_the_runtime():
    assert WIRE_DTYPE_NAMES == (*WIRE_FORMATS, *SPARSE_WIRE_FORMATS) == ("fp32", "bf16", *FORMATS, "topk")


def _bytes(out: Path) -> float:
    rows = json.loads((out / "results.json").read_text())["runs"]
    assert len(rows) == 1 and rows[0]["final_loss"] == rows[0]["final_loss"]  # ran, not NaN
    return rows[0]["bytes_sent"]


def test_quantized_wire_with_error_feedback_trains_and_sends_fewer_bytes(tmp_path: Path):
    sent = {}
    for wire, extra in (("fp32", []), ("int4", ["--quant-block", "32", "--error-feedback"])):
        out = tmp_path / wire
        args = ["train", "--method", "streaming", "--wire-dtype", wire, *extra, *TINY, "--out", str(out)]
        assert main(args) == 0
        sent[wire] = _bytes(out)
    # 4-bit codes + one fp32 scale per 32 values: 4 / (0.5 + 4 / 32) = 6.4x fewer bytes than fp32
    assert sent["fp32"] / sent["int4"] == pytest.approx(6.4, rel=0.02), sent


def test_topk_wire_trains_and_reports_a_hand_count_of_its_bytes(tmp_path: Path):
    """DiLoCo on 2 workers, 8 steps, a sync every 4: 2 syncs, each sending (M − 1) = 1 payload of
    the whole model: per chunk of 256 values a 4-byte scale, 16 indices of 8 bits, 16 values of 1 bit."""
    out = tmp_path / "topk"
    knobs = ["--topk-k", "16", "--topk-chunk", "256", "--topk-bits", "1", "--ef-beta", "0.9"]
    args = ["train", "--method", "diloco", "--wire-dtype", "topk", *knobs, *TINY, "--out", str(out)]
    assert main(args) == 0
    n = parameter_count(ModelConfig(dim=16, n_layers=2, n_heads=2, mlp_hidden=32, seq_len=16))
    chunks, last = -(-n // 256), n % 256 or 256
    per_chunk = 4 + 16 + 2
    hand = (chunks - 1) * per_chunk + 4 + (min(16, last) * 8 + 7) // 8 + (min(16, last) + 7) // 8
    assert hand == TopKFormat(16, 256, 1).payload_bytes(n)
    assert _bytes(out) == 2 * hand


@pytest.mark.parametrize(
    "extra, flag",
    [
        (["--wire-dtype", "int3"], "--wire-dtype"),
        (["--wire-dtype", "int8", "--quant-block", "48"], "--quant-block must be a power of two"),
        # beyond what the ops take: it used to fail in the workers at the first sync, naming `block`
        (["--wire-dtype", "int8", "--quant-block", str(2**50)], "--quant-block must be <= 2**40"),
        (["--wire-dtype", "bf16", "--error-feedback"], "--error-feedback=True needs a quantized"),
        (["--wire-dtype", "int8", "--error-feedback", "--method", "loscar"], "--error-feedback is not"),
        (["--wire-dtype", "topk", "--topk-k", "65", "--topk-chunk", "64"], "--topk-k must be in [1, 64]"),
        (["--wire-dtype", "topk", "--ef-beta", "1.5"], "--ef-beta must be <= 1"),
        (["--wire-dtype", "topk", "--method", "loscar"], "--wire-dtype topk is not supported by LOSCAR"),
    ],
)
def test_bad_wire_input_is_one_line_naming_the_flag(tmp_path: Path, capsys, extra, flag):
    args = ["train", "--method", "streaming", *TINY, "--out", str(tmp_path / "x"), *extra]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: ") and flag in err[0], err
