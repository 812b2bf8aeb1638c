"""Chaos soak: random faults on real gloo ranks, each of which must end in a correct run or in the
same clear, named error on every live rank (never a hang, never a signal death other than the rank
we kill, never a silent divergence).

Faults, on a random method (DiLoCo, Streaming DiLoCo, CoCoDC, LOSCAR), dtype, inner optimizer and
group of 2 or 3 ranks:

- one NaN loss on a random rank and step: the run completes with one (rarely two) sync(s) skipped
  alike on every rank, finite parameters, g identical across ranks, and a rerun is bit-identical
  (with ``on_nonfinite="raise"``: FloatingPointError on every rank instead);
- NaN at every step from some step on one rank: FloatingPointError naming that rank and
  "consecutive syncs" on every rank;
- a rank given a different configuration: ConfigMismatchError at construction on every rank naming
  the knob;
- parameters reassigned after wrapping on one rank: ParameterViewError on every rank at the next
  send, or, when reassigned after the last send, on that rank alone in finish();
- a corrupted or truncated checkpoint at restore: CheckpointError on the rank(s) that read it, and
  restoring every rank from the previous generation ends bit-identical to the uninterrupted run;
- a checkpoint saved with a sync in flight under one wire format (fp32, bf16, int8, int4, fp8, fp4;
  error feedback on or off) and loaded under another or the same: a strategy with error feedback
  whose checkpoint holds no residual refuses it with CheckpointError naming the residual on every
  rank, nothing changed (parameters, optimizer state, g, u, step); anything else loads (the result in
  flight records the wire it was sent in) and follows the uninterrupted run bit for bit until that
  result has landed, to the end under the same wire, each rank's residual restored as saved (or
  dropped with a warning when the loader has no error feedback);
- a checkpoint written by a group of R ranks loaded by one of R +- 1 (all ranks, or all but the
  last): the plain per-rank file is refused naming world_size on every loading rank, nothing
  changed; the DCP save resumes with the saved g, u, step and syncs in flight and follows the
  writers bit for bit until those have landed (fp32, bf16 and quantized wires), then stays
  replicated; with error feedback DCP refuses it naming the per-rank residuals;
- SIGKILL of a random rank at a random step (or while it writes a checkpoint): every survivor
  raises SyncError naming the sync within timeout_s (+ margin); restarting ALL ranks from the
  newest checkpoint generation they all hold ends bit-identical (torch.equal on every parameter)
  to an uninterrupted run.

Process start-up is the cost (seconds per rank on a small machine), so the test runs a short chain
of long-lived groups (rt_chaos.segment): each restarts the previous group's kill, runs many
in-process episodes (each followed by a probe run proving the group's collectives still pair up),
and, while the budget allows another group, ends with a SIGKILL episode. Bounded:
LOWCOMM_CHAOS_SECONDS (default 100) of wall clock in all, every group with a timeout;
LOWCOMM_CHAOS_SEED (default fixed) makes a run reproducible and picks the group size. Every
episode's description is printed with its id; replay some with LOWCOMM_CHAOS_ONLY=s3,k0 (same
seed). LOWCOMM_CHAOS_REPORT=path writes the summary as JSON.
"""

from __future__ import annotations

import json
import os
import pickle
import re
import time

import pytest

from lowcomm_kernels.runtime.checkpoint import read_checkpoint
from lowcomm_kernels.runtime.launch import spawn_local
from tests.runtime import rt_chaos

CHAOS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "rt_chaos.py")
DEFAULT_SECONDS = 100.0
DEFAULT_SEED = 20240917
KILL_MARGIN_S = 10.0  # beyond timeout_s, for a survivor to notice a SIGKILLed peer on a loaded machine
PG_TIMEOUT_S = 30.0  # the test's own collectives; larger than any strategy timeout_s (<= 10 s)
MIN_SOAK_EPISODES = len(rt_chaos.SOAK_KINDS)  # the first group runs every kind once at least
MIN_SOAK_S = 5.0  # soak time a group must have to be worth starting
FIXED_GUESS_S = 15.0  # start-up (processes, imports) of a 2-rank group, before it is measured
KILL_COST_S = 5.0  # a SIGKILL episode and its restart
SEGMENT_GRACE_S = 90.0  # a group's bound beyond its soak deadline: start-up, restart, kill, last episode


# ----- verdicts: each returns the broken guarantees of one episode (empty: correct) --------------


def _same(values) -> bool:
    values = list(values)
    return all(v == values[0] for v in values[1:])


def _judge_soak(ep: dict, recs: list[dict | None]) -> list[str]:
    bad = [
        f"rank {r} left no result (its process died or the group lost its pairing)"
        for r, rec in enumerate(recs)
        if rec is None
    ]
    if bad:
        return bad
    for r, rec in enumerate(recs):
        if rec["harness_error"]:
            bad.append(f"rank {r}: the test's own steps failed: {rec['harness_error']}")
        if rec["probe"]["error"]:
            bad.append(f"rank {r}: the probe run after the episode failed: {rec['probe']['error']}")
    if not _same(rec["probe"]["g"] for rec in recs):
        bad.append("the probe run after the episode ended with g differing between ranks")
    if bad:
        return bad
    res = [rec["result"] for rec in recs]
    return JUDGES[ep["kind"]](ep, res)


def _judge_clean(ep, res) -> list[str]:
    bad = [f"rank {r}: {x['error'] or x['error2']}" for r, x in enumerate(res) if x["error"] or x["error2"]]
    if bad:
        return bad
    if any(x["skipped"] for x in res):
        bad.append(f"a fault-free run skipped syncs: {[x['skipped'] for x in res]}")
    bad += _agreement(ep, res)
    bad += [
        f"rank {r}: a rerun is not bit-identical (parameters {x['diff']})"
        for r, x in enumerate(res)
        if not x["deterministic"]
    ]
    return bad


def _agreement(ep, res) -> list[str]:
    """Every rank saw the same syncs (skips included) and the same shared state after each."""
    if ep["method"] == "loscar":  # per-rank step counts: compare rounds, not steps
        recs = [[(rec[4], rec[3]) for rec in x["records"]] for x in res]
    else:
        recs = [x["records"] for x in res]
    bad = []
    if not _same(recs):
        bad.append(f"ranks recorded different syncs: {recs}")
    if not _same(x["g"] for x in res):
        what = "masks" if ep["method"] == "loscar" else "g"
        bad.append(f"{what} differs between ranks after some sync (silent divergence)")
    return bad


def _judge_nan(ep, res) -> list[str]:
    if ep["kw"].get("on_nonfinite") == "raise":
        return _all_raise(res, "FloatingPointError", [f"rank(s) [{ep['rank']}]"])
    bad = [f"rank {r}: {x['error'] or x['error2']}" for r, x in enumerate(res) if x["error"] or x["error2"]]
    if bad:
        return bad
    skipped = [x["skipped"] for x in res]
    if not _same(skipped) or not 1 <= skipped[0] <= 2:
        bad.append(f"syncs skipped by rank: {skipped} (one, rarely two, on every rank alike)")
    bad += _agreement(ep, res)
    bad += [f"rank {r}: parameters not finite at the end" for r, x in enumerate(res) if not x["finite"]]
    last = res[0]["records"][-1] if res[0]["records"] else None
    if last is None or last[3]:
        bad.append(f"training did not go on after the skip (last sync {last})")
    if ep["method"] != "loscar":
        skips = [rec for rec in res[0]["records"] if rec[3]]
        firsts = [rec for rec in res[0]["records"] if rec[1] >= ep["step"]]
        if skips and firsts and skips[0] != firsts[0]:
            bad.append(f"the skipped sync {skips[0]} is not the first one sent after the NaN ({firsts[0]})")
    else:
        rec = [x["recovery"] for x in res]
        if not _same(rec) or rec[0] <= 0:
            bad.append(f"LOSCAR recovery bytes by rank: {rec} (the poisoned rank restarts from a peer)")
    bad += [
        f"rank {r}: a rerun with the same NaN is not bit-identical (parameters {x['diff']})"
        for r, x in enumerate(res)
        if not x["deterministic"]
    ]
    return bad


def _all_raise(res, typ: str, words: list[str], *, same_text: str = "") -> list[str]:
    """Every rank raised `typ` saying each of `words` (and, with `same_text`, the same words after
    that marker on every rank)."""
    bad = []
    for r, x in enumerate(res):
        err = x["error"]
        if err is None or not err.startswith(typ + ":"):
            bad.append(f"rank {r}: expected {typ}, got {err!r}")
        else:
            bad += [f"rank {r}: {typ} does not say {w!r}: {err}" for w in words if w not in err]
    if not bad and same_text and not _same(x["error"].split(same_text)[-1] for x in res):
        bad.append(f"ranks raised different messages: {[x['error'] for x in res]}")
    return bad


def _judge_stuck(ep, res) -> list[str]:
    bad = _all_raise(res, "FloatingPointError", [f"rank(s) [{ep['rank']}]", "consecutive syncs"])
    if bad and all(x["error"] is None for x in res):  # say how the run went on instead
        recs = res[0]["records"]
        bad.append(
            f"the run completed: {sum(r[3] for r in recs)} of {len(recs)} syncs skipped, "
            f"syncs (fragment, sent, applied, skipped, round): {recs}"
        )
    return bad


def _judge_views(ep, res) -> list[str]:
    mine = res[ep["rank"]]["error"] or ""
    if mine.startswith("ParameterViewError") and " finish at step " in mine:
        # reassigned after the last send: finish() catches it on that rank alone (the others'
        # results are complete), naming what broke
        bad = [
            f"rank {r}: expected no error (the fault was on rank {ep['rank']} after the last send), "
            f"got {x['error']!r}"
            for r, x in enumerate(res)
            if r != ep["rank"] and x["error"]
        ]
        if ep["how"] == "data" and repr(ep["param"]) not in mine:
            bad.append(f"the broken rank's error does not name {ep['param']!r}: {mine}")
        return bad
    bad = _all_raise(res, "ParameterViewError", [f"rank(s) [{ep['rank']}]"])
    if bad:
        return bad
    mine = res[ep["rank"]]["error"]
    if "On this rank" not in mine:
        bad.append(f"the broken rank's error does not say what broke: {mine}")
    if ep["how"] == "data" and repr(ep["param"]) not in mine:
        bad.append(f"the broken rank's error does not name {ep['param']!r}: {mine}")
    where = [x["error"].split(" every rank stops.")[0] for x in res]
    if isinstance(ep["T"], list):  # per-rank LOSCAR rounds: the same round (or the finish) comes at
        where = [re.sub(r" at step \d+", "", w) for w in where]  # different steps on different ranks
    if not _same(where):
        bad.append(f"ranks stopped at different syncs: {[x['error'] for x in res]}")
    return bad


def _judge_config(ep, res) -> list[str]:
    bad = [
        f"rank {r}: failed at {x['stage']}, not at construction: {x['error']}"
        for r, x in enumerate(res)
        if x["stage"] != "construct"
    ]
    if bad:
        return bad
    words = [f"the first difference is {ep['field']} ("]
    # each rank's message opens with its own method's name; the difference it names must be the same
    return _all_raise(res, "ConfigMismatchError", words, same_text="the first difference is")


def _judge_restore(res, victims: list[int], fallback: int, notes: list[str]) -> list[str]:
    """First attempt: refused on the damaged rank(s) only; then every rank loads the fallback."""
    bad = []
    first = [x["attempts"][0] if x["attempts"] else None for x in res]
    for r, a in enumerate(first):
        if a is None:
            continue
        if r in victims:
            if a["error"] is None:
                notes.append(
                    f"rank {r} loaded its damaged file without error (the damage left the content "
                    "identical; the run must still end bit-identical)"
                )
            elif not a["error"].startswith("CheckpointError:"):
                bad.append(f"rank {r}: a damaged checkpoint raised {a['error']!r}, not CheckpointError")
            else:
                notes.append(f"rank {r} refused step {a['step']}: {_short(a['error'])}")
        elif a["error"] is not None:
            bad.append(f"rank {r}: its intact checkpoint was refused: {a['error']}")
    loaded = [x["loaded"] for x in res]
    if not _same(loaded) or loaded[0] is None:
        bad.append(f"ranks restored different generations or none: {loaded}")
    elif any(a is not None and a["error"] for a in first) and loaded[0] != fallback:
        bad.append(
            f"after a refusal the ranks restored step {loaded[0]}, not the previous generation {fallback}"
        )
    return bad


def _short(err: str) -> str:
    """An error without the file path (tmp paths make the report unreadable)."""
    return re.sub(r"'[^']*\.pt'", "<file>", err)[:110]


def _judge_corrupt(ep, res) -> list[str]:
    bad = [f"rank {r}: the uninterrupted run failed: {x['error']}" for r, x in enumerate(res) if x["error"]]
    if bad:
        return bad
    notes = ep.setdefault("notes", [])
    bad += _judge_restore(res, ep["victims"], ep["fallback"], notes)
    for r, x in enumerate(res):
        ats = [a["at_step"] for a in x["attempts"] if a["all_ok"]]
        if ats and ats[-1] != x["loaded"]:
            bad.append(f"rank {r}: restored generation {x['loaded']} but the strategy is at step {ats[-1]}")
        if x["error_b"]:
            bad.append(f"rank {r}: the restored run failed: {x['error_b']}")
        elif x["diff"]:
            bad.append(f"rank {r}: restored run is not bit-identical to the uninterrupted one: {x['diff']}")
    return bad


def _judge_wire(ep, res) -> list[str]:
    """Saved with a sync in flight under one wire format (error feedback on or off), loaded under
    another or the same. A strategy with error feedback has a residual to restore: a checkpoint
    without one is refused by name on every rank, nothing changed. Anything else loads (the result in
    flight records the wire it was sent in): bit-identical to the uninterrupted run until that result
    has landed, to the end under the same wire; residuals come back per rank, or are dropped aloud."""
    bad = [f"rank {r}: the uninterrupted run failed: {x['error']}" for r, x in enumerate(res) if x["error"]]
    if bad:
        return bad
    notes = ep.setdefault("notes", [])
    if any(x.get("skip") for x in res):
        if not all(x.get("skip") for x in res):
            return [f"ranks disagree on whether a sync was in flight: saved at {[x['saved'] for x in res]}"]
        notes.append("no sync in flight from save_from on: nothing saved")
        return bad
    saved = [x["saved"] for x in res]
    if not _same(saved) or not _same(x["in_flight"] for x in res):
        bad.append(
            f"ranks saved at different steps or syncs in flight: {saved}, {[x['in_flight'] for x in res]}"
        )
    save_ef, load_ef = ep["kw"]["error_feedback"], ep["load_kw"]["error_feedback"]
    if load_ef and not save_ef:
        bad += _all_raise([{"error": x["refused"]} for x in res], "CheckpointError", ["residual"])
        bad += [
            f"rank {r}: the refused load changed {x['changed']}"
            for r, x in enumerate(res)
            if x.get("changed")
        ]
        return bad
    for r, x in enumerate(res):
        if x["refused"]:
            bad.append(f"rank {r}: the checkpoint was refused: {x['refused']}")
            continue
        if x["error_b"]:
            bad.append(f"rank {r}: the resumed run failed: {x['error_b']}")
        if x["differ"]:
            bad.append(
                f"rank {r}: the resumed run differs from the uninterrupted one at steps {x['differ']} "
                f"(exact until step {x['until']}: the result in flight lands there)"
            )
        if ep["load_kw"] == ep["kw"] and not x["end_equal"]:
            bad.append(f"rank {r}: under the same wire the resumed run does not end bit-identical")
        if save_ef and load_ef and not x["residual_equal"]:
            bad.append(f"rank {r}: its error-feedback residual was not restored as saved")
        dropped = any("error-feedback residuals" in m for m in x["logged"])
        if dropped != (save_ef and not load_ef):
            bad.append(
                f"rank {r}: residuals dropped aloud: {dropped}, expected {save_ef and not load_ef} "
                f"(logged {x['logged']})"
            )
    if save_ef and load_ef and len(res) > 1 and len({x["residual_saved"] for x in res}) < len(res):
        notes.append("two ranks saved the same residual (the per-rank check is weaker here)")
    if not bad and res[0]["in_flight"]:
        notes.append(f"in flight at step {saved[0]}: {res[0]['in_flight']}, exact until {res[0]['until']}")
    return bad


def _judge_resize(ep, res) -> list[str]:
    """Saved by a group of one size, loaded by a group of another: a plain (per-rank) checkpoint is
    refused naming the world size on every loading rank, nothing changed; the DCP save resumes with
    the saved g, u, step and syncs in flight, follows the writers bit for bit until those have landed,
    and stays replicated (with error feedback: refused naming the residuals on every loading rank)."""
    bad = [f"rank {r}: the writers' run failed: {x['error']}" for r, x in enumerate(res) if x["error"]]
    if bad:
        return bad
    loaders = [x for x in res if x["loader"]]
    if any(x.get("skip") for x in loaders):
        ep.setdefault("notes", []).append("the writers never saved")
        return bad
    for r, x in enumerate(res):
        if not x["loader"]:
            continue
        err = x["plain_refused"] or ""
        if not err.startswith("CheckpointError:") or "world_size" not in err:
            bad.append(f"rank {r}: a plain checkpoint of another world size was not refused by name: {err!r}")
        if x["plain_changed"]:
            bad.append(f"rank {r}: the refused plain load changed {x['plain_changed']}")
        if ep["kw"]["error_feedback"]:
            if (
                not (x["dcp_refused"] or "").startswith("CheckpointException")
                or "error_feedback_residual_by_rank" not in x["dcp_refused"]
            ):
                bad.append(
                    f"rank {r}: a DCP save with error feedback on another number of ranks: "
                    f"expected a refusal naming the residuals, got {x['dcp_refused']!r}"
                )
            continue
        if x["dcp_refused"]:
            bad.append(f"rank {r}: the DCP resume was refused: {x['dcp_refused']}")
            continue
        if x["loaded"] != x["saved"]:
            bad.append(f"rank {r}: DCP resumed {x['loaded']}, saved {x['saved']}")
        if x["error_b"]:
            bad.append(f"rank {r}: the resumed run failed: {x['error_b']}")
        elif x["differ"]:
            bad.append(
                f"rank {r}: g / u differ from the writers' at steps {x['differ']} (before the syncs "
                f"in flight at the save had landed)"
            )
        if not x["finite"]:
            bad.append(f"rank {r}: parameters not finite at the end")
    done = [x for x in loaders if x.get("final_g") is not None]
    if not bad and not _same(x["final_g"] for x in done):
        bad.append("g / u differ between the loading ranks at the end (silent divergence)")
    return bad


JUDGES = {
    "clean": _judge_clean,
    "nan": _judge_nan,
    "stuck": _judge_stuck,
    "views": _judge_views,
    "config": _judge_config,
    "corrupt": _judge_corrupt,
    "wire": _judge_wire,
    "resize": _judge_resize,
}


# ----- the SIGKILL episode ---------------------------------------------------------------------


def _load(path: str):
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return pickle.load(f)


def _common_generations(d: str, world: int) -> tuple[list[int], list[str]]:
    """Steps (newest first) for which every rank's file exists, reads, and holds that step."""
    problems = []
    steps = {int(f.split("_")[1]) for f in os.listdir(d) if f.startswith("ckpt_") and f.endswith(".pt")}
    common = []
    for s in sorted(steps, reverse=True):
        paths = [rt_chaos.ckpt_path(d, s, r) for r in range(world)]
        if not all(os.path.exists(p) for p in paths):
            continue
        held = []
        for p in paths:
            try:
                held.append(read_checkpoint(p)["strategy"]["step"])
            except Exception as e:  # an atomic writer never leaves a damaged file behind
                problems.append(
                    f"{os.path.basename(p)} written by the killed run is unreadable: {type(e).__name__}: {e}"
                )
                held.append(None)
        if held == [s] * world:
            common.append(s)
        elif all(h is not None for h in held):
            problems.append(f"files named step {s} hold steps {held}")
    return common, problems


def _judge_kill(ep: dict, out: str, notes: list[str]) -> tuple[list[str], float]:
    """The survivors of the SIGKILL each raised SyncError naming the sync, within timeout_s + margin.
    Also returns how long the killed run took."""
    bad, seconds = [], 0.0
    limit = ep["kw"]["timeout_s"] + KILL_MARGIN_S
    for r in range(ep["world"]):
        x = _load(os.path.join(out, f"kill_{ep['id']}_rank{r}.pkl"))
        if r == ep["victim"]:
            if x is not None:
                bad.append(f"the victim rank {r} did not die: {x}")
            continue
        if x is None:
            bad.append(f"survivor rank {r} left no result")
            continue
        seconds = max(seconds, x["seconds"])
        err = x["error"]
        if err is None or not err.startswith("SyncError:"):
            bad.append(f"survivor rank {r}: expected SyncError, got {err!r}")
        elif not any(w in err for w in ("sync of", "finish at step", "consistency guard at step")):
            bad.append(f"survivor rank {r}: SyncError does not name the sync: {err}")
        elif x["after_kill_s"] is None or x["after_kill_s"] > limit:
            bad.append(f"survivor rank {r}: raised {x['after_kill_s']} s after the kill (limit {limit} s)")
        else:
            notes.append(f"rank {r} raised {x['after_kill_s']:.1f} s after the kill, at step {x['step']}")
    if ep["mode"] == "mid_save":  # killed between writing the temporary file and renaming it
        d = os.path.join(out, ep["id"])
        name = os.path.basename(rt_chaos.ckpt_path(d, ep["kill_at"], ep["victim"]))
        files = os.listdir(d) if os.path.isdir(d) else []
        if name in files:
            bad.append(f"{name} exists although its writer was killed before the rename")
        if not any(f.startswith(name + ".tmp") for f in files):
            bad.append(f"no temporary file of {name}: the victim was not killed while writing it")
    return bad, seconds


def _prepare_restart(ep: dict, d: str, notes: list[str]) -> tuple[dict, list[str]]:
    """Candidates: the newest generation every rank holds, the one before, then from scratch; maybe
    damage one rank's newest file first (it must be refused and the previous one used)."""
    common, bad = _common_generations(d, ep["world"]) if os.path.isdir(d) else ([], [])
    candidates = common[:2] + [0]
    rc = ep.get("restart_corrupt")
    victims = []
    if rc and common:
        rt_chaos.corrupt_file(rt_chaos.ckpt_path(d, common[0], rc["rank"]), rc["corruption"])
        victims = [rc["rank"]]
    notes.append(f"restarting from {candidates[0] or 'scratch'} (common generations {common})")
    return {"ep": ep, "dir": d, "candidates": candidates, "victims": victims}, bad


def _judge_restart(r: dict, out: str, notes: list[str]) -> tuple[list[str], float]:
    """Every rank restored the expected generation and ended bit-identical to the uninterrupted run.
    Also returns how long the restart took."""
    ep, candidates = r["ep"], r["candidates"]
    recs = [_load(os.path.join(out, f"restart_{ep['id']}_rank{k}.pkl")) for k in range(ep["world"])]
    seconds = max((x["seconds"] for x in recs if x is not None), default=0.0)
    bad = [f"restart: rank {k} left no result" for k, x in enumerate(recs) if x is None]
    bad += [
        f"restart: rank {k}: the test's own steps failed: {x['harness_error']}"
        for k, x in enumerate(recs)
        if x is not None and x["harness_error"]
    ]
    if bad:
        return bad, seconds
    res = [x["result"] for x in recs]
    if r["victims"]:
        bad += _judge_restore(res, r["victims"], candidates[1], notes)
    elif not _same(x["loaded"] for x in res) or res[0]["loaded"] != candidates[0]:
        bad.append(
            f"restart loaded {[x['loaded'] for x in res]}, expected {candidates[0]} on every rank "
            f"(attempts {[x['attempts'] for x in res]})"
        )
    for k, x in enumerate(res):
        if x["error"] or x["ref_error"]:
            bad.append(f"rank {k}: restarted run error {x['error']!r}, reference error {x['ref_error']!r}")
        elif x["diff"]:
            bad.append(
                f"rank {k}: restart from step {x['loaded']} is not bit-identical to the uninterrupted "
                f"run: parameters {x['diff']}"
            )
    return bad, seconds


# ----- the chain of groups ---------------------------------------------------------------------


def _soak_verdicts(world: int, out: str) -> list[tuple[dict, list[str], float]]:
    ids = sorted(
        {f.split("_")[1] for f in os.listdir(out) if f.startswith("ep_") and f.endswith(".pkl")},
        key=lambda i: int(i[1:]),
    )
    verdicts = []
    for i in ids:
        recs = [_load(os.path.join(out, f"ep_{i}_rank{r}.pkl")) for r in range(world)]
        spec = next(rec["spec"] for rec in recs if rec is not None)
        bad = _judge_soak(spec, recs)
        verdicts.append((spec, bad, max(rec["seconds"] for rec in recs if rec is not None)))
    return verdicts


def _parse_only(text: str | None) -> tuple[list[int], list[int]] | None:
    if not text:
        return None
    ids = [s.strip() for s in text.split(",") if s.strip()]
    return [int(s[1:]) for s in ids if s.startswith("s")], [int(s[1:]) for s in ids if s.startswith("k")]


@pytest.mark.slow
@pytest.mark.study  # a soak: CI runs it in its own step (pytest -m study)
@pytest.mark.serial  # its kill verdicts allow a loaded machine, not a second test beside it
def test_chaos_soak(tmp_path):
    seconds = float(os.environ.get("LOWCOMM_CHAOS_SECONDS", DEFAULT_SECONDS))
    seed = int(os.environ.get("LOWCOMM_CHAOS_SEED", DEFAULT_SEED))
    only = _parse_only(os.environ.get("LOWCOMM_CHAOS_ONLY"))
    world = rt_chaos.soak_world(seed)
    t0 = time.monotonic()
    deadline = t0 + seconds
    print(
        f"chaos: seed {seed}, {world} ranks, {seconds:.0f} s "
        f"(replay: LOWCOMM_CHAOS_SEED={seed} LOWCOMM_CHAOS_ONLY=<ids, e.g. s3,k0>)"
    )
    verdicts: list[tuple[dict, list[str], float]] = []
    failures: list[str] = []
    fixed = FIXED_GUESS_S * world / 2  # what a group costs besides soaking; measured in the first one
    restart: dict | None = None  # the previous group's kill, to restart in the next group
    next_soak, n_kill, seg = 0, 0, 0
    while True:
        now = time.monotonic()
        if only is not None:
            kill_index = only[1][n_kill] if n_kill < len(only[1]) else None
            plan = {"only": only[0] if seg == 0 else [], "first": 0}
            soak_until = now
        else:
            left = deadline - now
            if seg == 0:  # always one SIGKILL; the first group soaks for about a third of the budget
                kill_index, soak_until = 0, now + max(fixed + MIN_SOAK_S, 0.35 * seconds)
            elif left >= 2 * fixed + 2 * MIN_SOAK_S:  # another group with a kill, and one to restart it, fit
                kill_index, soak_until = n_kill, now + fixed + (left - 2 * fixed) / 2
            else:
                kill_index, soak_until = None, deadline
            plan = {
                "first": next_soak,
                "min": MIN_SOAK_EPISODES if seg == 0 else 0,
                "deadline": time.time() + (soak_until - now),
            }
        kill_ep = rt_chaos.kill_episode(seed, world, kill_index) if kill_index is not None else None
        plan.update(restart=restart and {k: restart[k] for k in ("ep", "dir", "candidates")}, kill=kill_ep)
        out = str(tmp_path / f"group{seg}")
        os.makedirs(out)
        if kill_ep:
            print(rt_chaos.describe(kill_ep), flush=True)
        t_spawn, t_group = time.time(), time.monotonic()
        try:
            res = spawn_local(
                f"{CHAOS}:segment",
                world,
                (seed, plan, out),
                pg_timeout_s=PG_TIMEOUT_S,
                timeout_s=max(0.0, soak_until - time.monotonic()) + SEGMENT_GRACE_S,
                allow_dead=(kill_ep["victim"],) if kill_ep else (),
            )
            ready = [x["ready"] for x in res if x is not None]
            if seg == 0 and ready:
                fixed = max(ready) - t_spawn + KILL_COST_S
            print(
                f"group {seg}: {max(x['episodes'] for x in res if x is not None)} soak episodes in "
                f"{time.monotonic() - t_group:.0f} s, start-up {max(ready) - t_spawn:.0f} s",
                flush=True,
            )
            failures += sorted({f"group {seg}: {x['desync']}" for x in res if x is not None and x["desync"]})
        except RuntimeError as e:  # a rank hung, died of a signal, or failed outside an episode
            failures.append(f"group {seg} failed: {e}")
        if restart is not None:  # the previous group's kill, now restarted: its verdict is complete
            ep, notes = restart["ep"], restart["notes"]
            more, dt = _judge_restart(restart, out, notes)
            ep["notes"] = notes
            verdicts.append((ep, restart["bad"] + more, restart["seconds"] + dt))
            _report(*verdicts[-1])
        for spec, bad, dt in _soak_verdicts(world, out):
            print(rt_chaos.describe(spec))
            verdicts.append((spec, bad, dt))
            _report(spec, bad, dt)
            next_soak = max(next_soak, int(spec["id"][1:]) + 1)
        restart = None
        if kill_ep is None:
            break
        notes: list[str] = []
        bad, dt = _judge_kill(kill_ep, out, notes)
        r, more = _prepare_restart(kill_ep, os.path.join(out, kill_ep["id"]), notes)
        restart = {**r, "bad": bad + more, "notes": notes, "seconds": dt}
        n_kill += 1
        seg += 1

    elapsed = time.monotonic() - t0
    counts = dict.fromkeys(rt_chaos.FAULT_KINDS, 0)
    for ep, _, _ in verdicts:
        if ep["kind"] in counts:
            counts[ep["kind"]] += 1
        if ep.get("restart_corrupt"):
            counts["corrupt"] += 1
    broken = [f"{rt_chaos.describe(ep)}\n    " + "\n    ".join(bad) for ep, bad, _ in verdicts if bad]
    line = (
        f"chaos: {len(verdicts)} episodes, {sum(counts.values())} faults ("
        + ", ".join(f"{k}: {v}" for k, v in counts.items())
        + f") in {elapsed:.0f} s"
    )
    print(line)
    report = os.environ.get("LOWCOMM_CHAOS_REPORT")
    if report:
        with open(report, "w") as f:
            json.dump(
                {
                    "summary": line,
                    "seed": seed,
                    "world": world,
                    "seconds_budget": seconds,
                    "elapsed_s": round(elapsed, 1),
                    "episodes": len(verdicts),
                    "faults": sum(counts.values()),
                    "by_kind": counts,
                    "failures": failures + broken,
                    "notes": {ep["id"]: ep["notes"] for ep, _, _ in verdicts if ep.get("notes")},
                },
                f,
                indent=2,
            )
    assert not failures and not broken, "\n".join(
        [line, f"replay: LOWCOMM_CHAOS_SEED={seed} LOWCOMM_CHAOS_ONLY=<ids>"] + failures + broken
    )
    assert verdicts, "no episode ran"


def _report(ep: dict, bad: list[str], dt: float) -> None:
    verdict = "ok" if not bad else "BROKEN: " + "; ".join(bad)
    notes = f" [{'; '.join(ep.get('notes', []))}]" if ep.get("notes") else ""
    print(f"  [{ep['id']}] {verdict} ({dt:.1f} s){notes}", flush=True)
