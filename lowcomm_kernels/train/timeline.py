"""The timeline picture of ``lowcomm profile`` (and ``lowcomm profile --faults``): per rank, one row
per phase, from the ``lowcomm/*`` ranges of a Chrome trace and the runtime's per-sync records (see
``train.profile`` for the rows)."""

from __future__ import annotations

import json
from pathlib import Path

ROWS = ("compute", "pack", "comm in flight", "wait", "merge", "quorum", "heal")
COLORS = dict(
    zip(ROWS, ("#4c72b0", "#dd8452", "#55a868", "#c44e52", "#8172b3", "#937860", "#da8bc3"), strict=True)
)
FT_ROWS = ("quorum", "heal")  # torchft's rounds (``--faults``): drawn only when a rank recorded them


def load_intervals(trace_path: Path, syncs_path: Path | None) -> dict[str, list[tuple[float, float]]]:
    """{row: [(start_s, duration_s)]} from one rank's Chrome trace, times relative to the first range."""
    events = json.loads(trace_path.read_text())
    events = events.get("traceEvents", events) if isinstance(events, dict) else events
    spans: dict[str, list[tuple[float, float]]] = {r: [] for r in ROWS}
    comm_starts: list[float] = []
    for e in events:
        name = e.get("name", "")
        if e.get("ph") != "X" or not name.startswith("lowcomm/"):
            continue
        phase = name.split("/", 1)[1]
        start, dur = float(e["ts"]) / 1e6, float(e.get("dur", 0)) / 1e6
        if phase == "comm":
            comm_starts.append(start)
        elif phase in spans:
            spans[phase].append((start, dur))
    comm_starts.sort()
    if syncs_path is not None and syncs_path.is_file():
        records = sorted(json.loads(syncs_path.read_text()), key=lambda r: (r["send_step"], r["fragment"]))
        # syncs still in flight at the end were never applied and have no record
        for start, rec in zip(comm_starts, records, strict=False):
            spans["comm in flight"].append((start, max(rec["in_flight_s"], 1e-4)))
    else:  # no records: show the issue ranges only
        spans["comm in flight"] = [(s, 1e-3) for s in comm_starts]
    t0 = min((s for v in spans.values() for s, _ in v), default=0.0)
    return {k: sorted((s - t0, d) for s, d in v) for k, v in spans.items()}


def draw(
    per_rank: list[dict[str, list[tuple[float, float]]]],
    path: Path,
    title: str,
    labels: list[str] | None = None,
) -> None:
    import matplotlib  # optional (the cli extra): only when a timeline is drawn

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(
        len(per_rank), 1, figsize=(12, 1.0 + 1.6 * len(per_rank)), squeeze=False, sharex=True
    )
    rows = [r for r in ROWS if r not in FT_ROWS or any(spans.get(r) for spans in per_rank)]
    for i, spans in enumerate(per_rank):
        ax = axes[i][0]
        for row, name in enumerate(rows):
            # Overlapping in-flight syncs are drawn semi-transparent so their overlap stays visible.
            ax.broken_barh(
                spans.get(name, []),
                (row - 0.4, 0.8),
                color=COLORS[name],
                alpha=0.55 if name == "comm in flight" else 0.9,
            )
        ax.set_yticks(range(len(rows)), rows, fontsize=8)
        ax.invert_yaxis()
        label = labels[i] if labels is not None else f"rank {i}"
        ax.set_ylabel(label if len(per_rank) > 1 else "", fontsize=9)
        ax.grid(axis="x", alpha=0.3)
    axes[-1][0].set_xlabel("seconds since the first recorded range")
    axes[0][0].set_title(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
