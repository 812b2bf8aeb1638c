"""The README's code examples run as written (a front door that lies is worse than none)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

README = Path(__file__).resolve().parents[1] / "README.md"


def _python_blocks() -> list[str]:
    return re.findall(r"```python\n(.*?)```", README.read_text(), flags=re.S)


def _block(marker: str) -> str:
    matches = [b for b in _python_blocks() if marker in b]
    assert len(matches) == 1, f"expected one README python block containing {marker!r}, found {len(matches)}"
    return matches[0]


def test_ops_example_runs():
    out = subprocess.run([sys.executable, "-c", _block("from lowcomm_kernels import ops")],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().startswith("tensor(["), out.stdout


@pytest.mark.slow
def test_wrapping_example_runs_under_torchrun(tmp_path):
    script = tmp_path / "train.py"
    script.write_text(_block("StreamingDiLoCo"))
    logs = tmp_path / "logs"  # one stdout file per rank: the two ranks' prints would interleave on one pipe
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
                          f"--log-dir={logs}", "--redirects=1", str(script)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-3000:]
    texts = [p.read_text() for p in sorted(logs.rglob("stdout.log"))]
    lines = sorted(line.split() for text in texts for line in text.splitlines() if line.strip())
    assert [ln[0] for ln in lines] == ["0", "1"], texts
    for _, syncs, sent in lines:  # rank, number of syncs, bytes sent: both ranks synced the same
        assert int(syncs) > 0 and int(sent) > 0
    assert lines[0][1:] == lines[1][1:]
