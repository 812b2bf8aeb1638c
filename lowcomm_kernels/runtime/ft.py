"""Fault tolerance on torchft: a ``torchft.Manager`` in place of a fixed process group.

``DiLoCo(model, opt, ..., manager=manager, num_replicas=N)`` (likewise Streaming DiLoCo, CoCoDC and
LOSCAR) runs every sync as one torchft *round* (``FTTransport.all_reduce``):

1. ``manager.start_quorum()`` (synchronous quorum: ``Manager(use_async_quorum=False)``), so a replica
   that joins or returns is healed before any collective of the round. Profiler ranges (also under
   ``lowcomm profile``): ``lowcomm/quorum`` around it, ``lowcomm/heal`` around a heal inside it;
2. SUM all-reduces of the payload, the control vector and a *presence* vector (one slot per replica
   slot, 1 from every replica that contributes) through ``manager.allreduce`` (torchft's managed
   process group: an error is reported to the manager instead of raised);
3. ``manager.should_commit()``. Only a committed round is ever applied: the payload is rescaled so
   that the strategy's division by ``num_replicas`` yields the average over the replicas present
   (``N / present``), and so are the control vector's extras (CoCoDC's timings). A round that did not
   commit (a peer died mid-round, a replica reported an error, too few replicas) comes back as a
   ``FailedRound``: the strategy skips it on every replica (g and u unchanged, the fragment restarts
   from g) and training goes on; the next quorum no longer holds the dead replica.

The control vector keeps one slot per replica *slot* (``num_replicas``, a fixed upper bound; the
replica's slot is the trailing digits of its torchft ``replica_id``); slots of absent replicas are
zero and their schedule point is filled in, so the base rules (non-finite skips, schedule check) hold.

Agreement and healing. There is no fixed group to agree over at construction. Instead every replica
registers ``state_dict`` / ``load_state_dict`` with the manager (``register_state_dict_fn``) and
joins at its first hook (``FTTransport.join``): one quorum round. A replica that is behind (a fresh
start's non-primary replicas under ``init_sync``, or a replica that returns after a crash) receives a
healthy peer's g, u, schedule, pending results (CoCoDC's statistics among them) and a digest of the
configuration and model fields that the fixed group agrees on; a different digest raises. It then
sets its parameters to g, clears its inner-optimizer state and replays the rest of the peers' current
step without contributing (presence 0, payload 0), so it holds exactly the others' global state.

The strategy is reached through its public hooks only (``Strategy.heal_state``, ``load_heal_state``,
``replay``, ``restart_from_shared``, ``clear_inner_state``), and this module imports no strategy
module: a strategy is given ``TorchFTMembership`` (``runtime.membership``) and never branches on it, so
a strategy's internals may change without breaking healing.

LOSCAR under ``manager=``. Each round (its k shared coordinates S_r from (seed, round), and the
control vector) is one torchft round, sent at the round's send point and blocking like the others; its
result is the average over the replicas present and is merged, delay-corrected, ``overlap_steps``
steps later as usual, so the overlap steps still run between send and merge but the communication
itself is not overlapped. Per-replica ``local_steps`` / ``overlap_steps`` (indexed by slot) work: a
faster replica waits in the next quorum. A round that did not commit is skipped on every replica, and
deliberately so: each replica keeps its own x, x[S_r] included (not averaged this round; later rounds'
masks pull the coordinates together again), and the mask sequence goes on from the next round. A
replica whose own parameters are non-finite at a skipped round raises ``FloatingPointError`` (there is
no fixed group to restart it from a peer over); the others skip the round and go on, and the replica,
restarted, heals. Healing: LOSCAR keeps no global copy, so the healthy peer sends its own state
(``LOSCAR.heal_state``): its parameters x, step and round counter, and whether it stands at the
round's send point (peers serve a heal only from inside a quorum: at their first step or at a send,
when no round is in flight, so there is no pending result to send). The healed replica takes x, the
step and the round, stands at its own send point of that round, clears its inner-optimizer state and
replays the send without contributing: it then holds the peer's parameters, round and mask, and
merges exactly the same averages as the others from that round on.

Fragments in flight across a membership change: with ``manager=`` each round completes (and commits)
when it is sent, and its result is applied ``fragment_sync_delay`` steps later as usual; a healed
replica receives these pending results in the state. So nothing is in flight across a quorum change:
the price is that communication is not overlapped with compute under ``manager=``. A replica that
is behind without having died (its link was cut, its process stalled in a quorum, then the link came
back) is healed by the quorum of a round it began with its old state: that round's send is void
(``HealedInRound``), and the replica replays the peers' step without contributing, as a joining one.

A replica may itself be a data-parallel group (``Manager(rank=r, world_size=n)`` on each of its n
ranks, DDP over the replica's own process group, the model replicated on every rank), for every
strategy: each rank's rounds go to the same group rank of the other replicas (torchft's process
group), the presence vector counts replicas, and should_commit is agreed by the replica's ranks. The
premise is data parallelism's: the ranks of a replica hold the same parameters (DDP broadcasts group
rank 0's at construction and averages the gradients, the same result on every rank). The rule on top
of it: whatever torchft decides per group rank, or a process computes from its own measurements, is
taken from the replica's group rank 0, over a gloo group of the replica's ranks of its own
(``ReplicaGroup``, made at its first use on the replica's store):

- Healing. torchft heals the group ranks of a replica separately: at a fresh start (``init_sync``)
  each group rank has a primary replica of its own, so some ranks of a replica heal and others do
  not; later each group rank heals from the healthy replica torchft picks for it (spread over the
  healthy replicas), and LOSCAR's replicas (each its own x), like CoCoDC's snapshots in flight, differ
  between replicas. So after the joining quorum, and after every quorum that healed this rank, every
  rank takes group rank 0's state and heal step (``FTTransport.agree_replica``): g, u, the schedule
  and the pending results (LOSCAR: x, step and round), parameters set from them, inner-optimizer state
  cleared; at a fresh start that did not heal every rank clears its inner-optimizer state too.
- CoCoDC's decisions. Its measured T_c / T_s and its scores are reduced with the same group rank of
  the other replicas only, so two ranks of a replica could decide differently (measured timings
  always differ; scores could through rounding). At every period start and every send slot every rank
  takes group rank 0's N and fragment (``ReplicaGroup.agree_decision``); the slots in between follow
  from the agreed N. Group rank 0 of every replica decides from the same reduced values, so all ranks
  of all replicas send the same fragment.

No discrete decision can therefore differ between the ranks of a replica: drift is impossible, not
merely unlikely. The continuous values (g, the merged averages) are the results of one all-reduce per
group rank over identical inputs, bit-identical where those process groups reduce in the same order
(gloo: the same ring over the same replica order; tested). Each exchange in the replica's group starts
with a fixed-size header naming it (and the step), so ranks at different points raise ``SyncError``
instead of pairing two different exchanges, and a rank that does not come (dead, or a heal inside a
round that failed on some of the replica's ranks only) makes the others raise ``SyncError`` after
``timeout_s``: the replica stops and, restarted, heals; it never trains on with ranks that differ.
Refused (a ``ValueError`` naming ``manager``): CoCoDC and LOSCAR on a sharded model (DTensor
parameters) in a replica of several ranks, where each rank holds another shard, so group rank 0's
state cannot stand for the others' and each shard would heal from a different healthy replica.

Not supported with ``manager=`` (refused with an error naming the argument): ``process_group``,
``wan``, quantized wire formats, ``guard_every`` (they need a fixed group); and a Manager built with
``init_sync=False`` or ``use_async_quorum=True``: the fresh start's heal is where replicas agree on
the configuration and take one starting state, and a returning replica must be healed before the
collectives of its first round.
"""

from __future__ import annotations

import io
import time
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from .._checks import integer
from ..profiling import nvtx_range
from .transport import (
    CONTROL_FACTS,
    FailedRound,
    Handle,
    HealedInRound,
    SyncError,
    Transport,
    check_timeout_s,
    ring_wire_bytes,
)

INSTALL_HINT = "pip install 'lowcomm-kernels[ft]'"
JOIN_ATTEMPTS = 20
STATE_KEY = "lowcomm"  # the key of the strategy's state among the manager's state-dict functions
REASONS = ("stale", "round_robin", "never_sent", "score")  # CoCoDC's reasons for a choice (agreed)


def require_torchft() -> Any:
    try:
        import torchft
    except ImportError as e:  # pragma: no cover - exercised only without the extra
        raise ImportError(f"manager= needs torchft, which is not installed: {INSTALL_HINT}") from e
    return torchft


def check_ft_args(manager: Any, num_replicas: Any, process_group: Any, wan: Any) -> None:
    """The strategy's arguments that go with ``manager=``."""
    torchft = require_torchft()
    if not isinstance(manager, torchft.Manager):
        raise TypeError(
            f"manager must be a torchft.Manager (num_replicas= goes with it), got {type(manager).__name__}"
        )
    integer("num_replicas", num_replicas, lo=1)
    if process_group is not None:
        raise ValueError("process_group: pass either process_group= or manager=, not both")
    if wan is not None:
        raise ValueError("wan: the emulated WAN is not supported with manager=")
    if not getattr(manager, "_init_sync", True):
        raise ValueError(
            "manager: build it with Manager(init_sync=True) (torchft's default); at a fresh start the "
            "replicas heal from the primary, which is where they agree on the configuration and model "
            "and take one starting state. With init_sync=False replicas given different knobs or seeds "
            "would train on with different state, and a different wire format would break the collectives"
        )
    if getattr(manager, "_use_async_quorum", False):
        raise ValueError(
            "manager: build it with Manager(use_async_quorum=False); a returning replica must be healed "
            "before the collectives of its first round"
        )


class ReplicaGroup:
    """The ranks of one replica (``Manager(rank=r, world_size=n)``, n > 1, the model replicated on
    each) as a gloo group of their own, over the replica's store, made at its first use. Every rank
    of the replica takes group rank 0's value of what could otherwise differ between them: CoCoDC's
    decision at a send slot or period start, and the state a heal brings (see the module docstring).

    Each exchange starts with a fixed-size header naming what is exchanged (and, for a decision, the
    step), so ranks that are not at the same point raise ``SyncError`` instead of pairing two
    different exchanges."""

    HEADER = 6
    DECISION, STATE = 1, 2
    KINDS = {DECISION: "CoCoDC's decision", STATE: "a heal's state"}

    def __init__(self, manager: Any, timeout_s: float) -> None:
        self.manager = manager
        self.rank = int(manager._group_rank)
        self.size = int(manager._group_world_size)
        self.timeout = timedelta(seconds=timeout_s)
        self._pg: Any = None
        self.exchanges = 0

    def _group(self) -> Any:
        if self._pg is None:
            from torchft.manager import REPLICA_ID_KEY

            store = self.manager._store  # the replica's store (store_addr:store_port)
            # '<replica_id>:<uuid>', written by the replica's group rank 0 at each start: a restarted
            # replica never meets the keys of its previous incarnation
            incarnation = store.get(REPLICA_ID_KEY).decode("utf-8")
            prefixed = dist.PrefixStore(f"lowcomm/replica_group/{incarnation}", store)
            self._pg = dist.ProcessGroupGloo(prefixed, self.rank, self.size, self.timeout)
        return self._pg

    def _broadcast(self, t: torch.Tensor, what: str) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        try:
            self._group().broadcast([t], opts).wait()
        except Exception as e:
            raise SyncError(
                f"{what}: the ranks of this replica did not meet to take group rank 0's value within "
                f"{self.timeout.total_seconds():g} s ({type(e).__name__}: {e}); restart the replica"
            ) from e

    def _header(self, kind: int, values: list[int], what: str) -> list[int]:
        h = torch.zeros(self.HEADER, dtype=torch.int64)
        if self.rank == 0:
            h[0] = kind
            h[1 : 1 + len(values)] = torch.tensor(values, dtype=torch.int64)
        self._broadcast(h, what)
        got = [int(v) for v in h.tolist()]
        if got[0] != kind:
            raise SyncError(
                f"{what}: group rank 0 of this replica sent {self.KINDS.get(got[0], got[0])!r} instead: "
                "the replica's ranks are not at the same point; restart the replica"
            )
        self.exchanges += 1
        return got[1:]

    def agree_decision(
        self, t: int, n: int, choice: tuple[int, str] | None
    ) -> tuple[int, tuple[int, str] | None]:
        """CoCoDC at step t: group rank 0's N and fragment choice (None: no send) on every rank."""
        what = f"CoCoDC's decision at step {t}"
        p, reason = choice if choice is not None else (-1, REASONS[0])
        t0, n0, p0, r0, _ = self._header(self.DECISION, [t, n, p, REASONS.index(reason)], what)
        if t0 != t:
            raise SyncError(
                f"{what}: group rank 0 of this replica decided for step {t0}: the replica's ranks are not "
                "at the same step; restart the replica"
            )
        return n0, (None if p0 < 0 else (p0, REASONS[r0]))

    def agree_state(self, state: Any, what: str) -> Any:
        """Group rank 0's ``state`` (anything ``torch.save`` writes) on every rank of the replica."""
        data = None
        if self.rank == 0:
            buf = io.BytesIO()
            torch.save(state, buf)
            data = torch.frombuffer(bytearray(buf.getbuffer()), dtype=torch.uint8)
        n = self._header(self.STATE, [0 if data is None else data.numel()], what)[0]
        if data is None:
            data = torch.empty(n, dtype=torch.uint8)
        self._broadcast(data, what)
        if self.rank == 0:
            return state
        return torch.load(io.BytesIO(data.numpy().tobytes()), weights_only=True)


class FTHandle(Handle):
    """A round that already completed (and committed or not) when it was sent."""

    def __init__(
        self, transport: FTTransport, name: str, t_send: float, wire: int, values: list, blocked: float
    ) -> None:
        super().__init__(transport, [], name, t_send, t_send, wire, None, None)
        self._values = values
        self._blocked = blocked
        self.t_complete = time.perf_counter()

    def poll(self) -> bool:
        return True

    def wait(self) -> float:
        """The round blocked when it was sent: that time is reported here as the exposed time."""
        if self.waited:
            return 0.0
        self.waited = True
        return self._blocked

    def host_values(self) -> list[float]:
        return self._values


class FTTransport(Transport):
    """Each ``all_reduce`` is one torchft round (see the module docstring)."""

    def __init__(
        self, manager: Any, num_replicas: int | None, *, device: torch.device, timeout_s: float
    ) -> None:
        from torchft.manager import extract_trailing_digits

        check_timeout_s(timeout_s)
        assert num_replicas is not None  # check_ft_args
        replica_id = getattr(manager, "_replica_id", None)
        if not replica_id:
            raise ValueError(
                "manager: build it with replica_id='<name><index>' (the index is the replica's slot)"
            )
        index = extract_trailing_digits(str(replica_id).split(":")[0])
        if not 0 <= index < num_replicas:
            raise ValueError(
                f"num_replicas is {num_replicas} but the manager's replica_id {replica_id!r} names slot "
                f"{index}; "
                "replica ids must end in 0 .. num_replicas - 1"
            )
        self.manager = manager
        self.group = None  # type: ignore[assignment]
        self.world = int(num_replicas)
        self.rank = index
        self.device = device
        self.wan = None
        self.timeout_s = float(timeout_s)
        self._link_free_at = 0.0
        self._cuda = False  # torchft's process group orders its own streams
        self._side = None
        self.joined = False
        self.healed_at: int | None = None  # the step this replica was last healed at (None: never)
        self._open_round = False  # a quorum whose collectives the next all_reduce runs (join)
        self.contribute = True
        # a replica of several ranks holding the model replicated: they take group rank 0's
        # decisions and healed state (ReplicaGroup; set by register)
        self.replica_group: ReplicaGroup | None = None
        # the strategy's own state, its heal and the clearing of the inner-optimizer state (register)
        self.own_state: Any = None
        self.load_state: Any = None
        self.clear_inner_state: Any = None
        self.rounds = 0
        self.failed_rounds = 0
        self.participants: list[int] = []  # how many replicas contributed to each committed round
        self.round_s: list[float] = []  # wall time of each round: quorum + collectives + commit

    def abort(self) -> None:
        pass

    def blocking_all_gather(self, t: torch.Tensor, *, name: str) -> list[torch.Tensor]:
        raise RuntimeError(
            f"{name}: the consistency guard needs a fixed process group; with manager= replicas "
            "hold the same state by healing (runtime.ft)"
        )

    # Transport.all_reduce's signature
    def all_reduce(
        self, tensors: list[torch.Tensor], *, name: str,
        payload_bytes: int | None = None, host: torch.Tensor | None = None,
    ) -> Handle:  # fmt: skip
        from torch.distributed import ReduceOp

        t0 = time.perf_counter()
        if host is None:
            raise ValueError(f"{name}: a fault-tolerant round needs the control vector (host=)")
        if payload_bytes is None:
            payload_bytes = sum(t.numel() * t.element_size() for t in tensors)
        w, head = self.world, CONTROL_FACTS * self.world
        point = float(host[2 * w + self.rank].item())
        if not self._open_round:
            last_heal, self.healed_at = self.healed_at, None
            with nvtx_range("quorum"):
                self._start_quorum(name)
            if self.healed_at is None:
                self.healed_at = last_heal  # the step of this replica's last heal stays readable
            else:
                # This replica was behind (its link was cut and came back) and the quorum healed it:
                # `tensors` and `point` belong to the state it had before. The round stays open for
                # the peers' own send, which finish_heal replays without contributing.
                self._open_round = True
                if self.replica_group is not None:  # all its ranks healed here (the replica's step)
                    self.healed_at = self.agree_replica(self.healed_at)
                raise HealedInRound(self.healed_at)
        self._open_round = False
        presence = torch.zeros(w, dtype=torch.float64, device=host.device)
        if self.contribute:
            presence[self.rank] = 1.0
        else:
            for t in tensors:
                t.zero_()
        works = [self.manager.allreduce(t, reduce_op=ReduceOp.SUM) for t in [*tensors, presence]]
        for work in works:
            work.wait()  # errors are reported to the manager (should_commit then says False)
        committed = bool(self.manager.should_commit())
        present = presence.cpu().tolist()
        n = sum(present)
        self.rounds += 1
        if not committed or n < 1:
            self.failed_rounds += 1
            values: list = FailedRound([0.0] * host.numel())
            for r in range(w):
                values[2 * w + r] = point
        else:
            scale = w / n
            for t in tensors:
                if t is not host and scale != 1.0:
                    t.mul_(scale)
            values = host.cpu().tolist()
            values[head:] = [v * scale for v in values[head:]]
            for r in range(w):
                if present[r] == 0:
                    values[2 * w + r] = point
            self.participants.append(int(n))
        # the pending result keeps the control tensor (checkpoints, healing): store what was decided
        # there too; a failed round's own non-finite slot makes a restored copy skip as well
        kept = list(values)
        if isinstance(values, FailedRound):
            kept[self.rank] = 1.0
        host.copy_(torch.tensor(kept, dtype=host.dtype))
        blocked = time.perf_counter() - t0
        self.round_s.append(blocked)
        wire = ring_wire_bytes(payload_bytes, max(int(n), 1))
        return FTHandle(self, name, t0, wire, values, blocked)

    def _start_quorum(self, what: str) -> None:
        """``manager.start_quorum()``; a quorum that does not form in time is a SyncError naming the
        likely cause, not torchft's raw gRPC 'Timeout expired'."""
        try:
            self.manager.start_quorum()
        except TimeoutError as e:
            raise SyncError(
                f"{what}: no torchft quorum within the Manager's quorum_timeout: the Lighthouse did not "
                "answer (it is down, or not reachable at the Manager's lighthouse_addr), or fewer replicas "
                f"than its min_replicas joined (torchft: {e})"
            ) from e

    def finish_heal(self, strategy: Any, healed: int | None, joining: bool = False) -> bool:
        """After a quorum that is still open (``join``, or a heal inside a round): replay the rest of
        the peers' step ``healed`` without contributing (their sends run the open round), or, with
        nothing to replay, close the round: at a fresh start's joining round after one all-reduce
        that every replica enters (``_hold_for_healers``), otherwise with no collectives. Returns
        whether the round committed."""
        if healed is not None and healed > 0:
            self.replay(strategy, healed)  # runs the open round and the rest of step `healed`
        if self._open_round:  # nothing was sent
            self._open_round = False
            if joining:
                self._hold_for_healers()
            return bool(self.manager.should_commit())
        return True

    def _hold_for_healers(self) -> None:
        """The joining round of a fresh start sends nothing of its own. Without a collective the
        primary would go straight to ``should_commit``, which makes torchft lock its checkpoint
        server before the healing replicas fetched from it: they fail their first round, miss their
        first steps, and the first sync averages fewer replicas. A replica enters this all-reduce
        only after its heal (``start_quorum`` heals before it returns), so it holds the primary
        until every replica has its state."""
        from torch.distributed import ReduceOp

        present = torch.zeros(self.world, dtype=torch.float64)
        present[self.rank] = 1.0
        self.manager.allreduce(present, reduce_op=ReduceOp.SUM).wait()  # an error: should_commit says False

    def agree_replica(self, healed: int | None) -> int | None:
        """A replica of several ranks, right after a quorum, on every rank: each rank takes group rank
        0's state and heal step. torchft heals the group ranks of a replica separately: at a fresh
        start (``init_sync``) each group rank has a primary replica of its own, so some ranks of a
        replica heal and others do not, and later each group rank heals from a healthy replica of
        its own (spread over them). Returns the step group rank 0 healed at (None: it did not)."""
        group = self.replica_group
        assert group is not None
        sent = {"healed": healed, "state": self.own_state()} if group.rank == 0 else None
        got = group.agree_state(sent, f"the state after the quorum at step {healed}")
        if group.rank != 0:
            self.load_state(got["state"], source="group rank 0 of this replica")
        self.healed_at = got["healed"]
        if got["healed"] is None:  # a fresh start: no rank keeps the inner state of its first step
            self.clear_inner_state()
        return got["healed"]

    # ----- joining: the first quorum of this replica -----------------------------------------------
    def join(self, strategy: Any) -> None:
        """At the first hook: one quorum round. A replica that is behind is healed in it (its
        ``load_state_dict`` runs inside ``start_quorum``) and then replays the peers' current step."""
        for _ in range(JOIN_ATTEMPTS):
            self.healed_at = None
            with nvtx_range("quorum"):
                self._start_quorum("the joining round")  # a heal runs inside (lowcomm/heal)
            self._open_round = True
            healed = self.healed_at
            if self.replica_group is not None:  # every rank takes group rank 0's state (and heal)
                healed = self.agree_replica(healed)
            if self.finish_heal(strategy, healed, joining=True):
                if healed is None and strategy.step_count == 0:
                    # a fresh start that did not heal starts its first step like one that did
                    # (init_sync), so every replica and every rank of a replica starts alike
                    strategy.restart_from_shared()
                self.joined = True
                return
            strategy.log.warning("the joining round did not commit (a failed heal?): joining again")
        raise RuntimeError(f"could not join the replicas in {JOIN_ATTEMPTS} quorum rounds")

    def replay(self, strategy: Any, t: int) -> None:
        """The rest of step t as the healthy peers run it (``Strategy.replay``), this replica's sends
        made without contributing: they run the open round beside the peers' own sends."""
        self.contribute = False
        try:
            strategy.replay(t)
        finally:
            self.contribute = True


class TorchFTMembership:
    """Replicas under a torchft ``Manager`` (``runtime.membership.Membership``; see the module
    docstring): every sync is a torchft round, a replica joins at its first step and heals from a
    healthy peer through the strategy's public heal hooks."""

    fixed_group = False

    def __init__(self, manager: Any, num_replicas: Any, *, process_group: Any, wan: Any) -> None:
        check_ft_args(manager, num_replicas, process_group, wan)
        self.manager = manager
        self.num_replicas = int(num_replicas)
        self._transport: FTTransport | None = None

    def transport(self, *, device: torch.device, timeout_s: float) -> FTTransport:
        self._transport = FTTransport(self.manager, self.num_replicas, device=device, timeout_s=timeout_s)
        return self._transport

    def join(self, strategy: Any, fields: dict[str, Any]) -> None:
        assert self._transport is not None and strategy.transport is self._transport
        register(strategy, self.manager, self._transport, fields)

    def before_step(self, strategy: Any) -> None:
        tr = self._transport
        assert tr is not None
        if not tr.joined:  # the first quorum, at the first step
            tr.join(strategy)

    def finish_heal(self, strategy: Any, step: int) -> None:
        assert self._transport is not None
        self._transport.finish_heal(strategy, step)


def register(strategy: Any, manager: Any, tr: FTTransport, fields: dict[str, Any]) -> None:
    """The fixed group's agreement (``FixedGroup.join``) under ``manager=``: refuse what needs a fixed
    group and register the strategy's heal hooks with the manager. Only the strategy's public
    attributes and hooks are used (``Strategy.heal_state`` and the ones next to it)."""
    from .agreement import _digest
    from .sharding import any_sharded

    if strategy.wire.quant is not None:
        raise ValueError(
            f"wire_dtype: the quantized wire format {strategy.wire.name!r} uses a process group of its "
            "own and is not supported with manager="
        )
    if strategy.guard_every:
        raise ValueError("guard_every: the consistency guard needs a fixed process group (not with manager=)")
    ranks = int(getattr(manager, "_group_world_size", 1) or 1)
    sharded = any_sharded(strategy.model)
    if ranks > 1 and sharded and strategy.method not in ("diloco", "streaming_diloco"):
        raise ValueError(
            f"manager: a replica of {ranks} ranks holding a sharded model (DTensor parameters) is "
            f"supported for DiLoCo and Streaming DiLoCo only; with {strategy.method} each rank would heal "
            "its shard from whichever healthy replica torchft assigns to its group rank (torchft spreads "
            "the ranks of a healing replica over the healthy replicas), and LOSCAR's replicas, like "
            "CoCoDC's snapshots in flight, differ between replicas. Replicate the model inside the "
            "replica (DistributedDataParallel) or use one rank per replica (Manager(world_size=1))"
        )
    if STATE_KEY in getattr(manager, "_load_state_dict_fns", {}):
        raise ValueError(
            "manager: this Manager already carries another strategy's state (torchft registers it once "
            "per Manager); build a new Manager for each strategy"
        )
    fields = dict(fields)
    fields.pop("process group size", None)
    digest = _digest(fields)
    if ranks > 1 and not sharded:  # the model replicated on the replica's ranks: group rank 0 decides
        tr.replica_group = ReplicaGroup(manager, tr.timeout_s)

    def state_dict() -> dict[str, Any]:
        # what the strategy shares (LOSCAR, which keeps no global copy: its own parameters and round)
        return {"digest": digest, "num_replicas": tr.world, "strategy": strategy.heal_state()}

    def load_state_dict(sd: dict[str, Any], source: str = "a peer") -> None:
        with nvtx_range("heal"):
            theirs = sd.get("num_replicas", tr.world)
            if theirs != tr.world:  # (else refused below as another world size of the state's shape)
                raise ValueError(
                    f"num_replicas: this replica was built with num_replicas={tr.world} but the healthy peer "
                    f"it heals from with num_replicas={theirs}; every replica must pass the same num_replicas"
                )
            if sd.get("digest") != digest:
                raise ValueError(
                    f"{strategy.method}: this replica's configuration or model differs from the healthy "
                    "peer it heals from (every replica must run the same strategy knobs and model)"
                )
            what = strategy.load_heal_state(sd["strategy"])
            strategy.clear_inner_state()
            tr.healed_at = strategy.step_count
            strategy.log.warning(
                f"healed from {source} at step {strategy.step_count}: parameters set to {what}, "
                "inner-optimizer state cleared"
            )

    tr.own_state, tr.load_state, tr.clear_inner_state = (
        state_dict,
        load_state_dict,
        strategy.clear_inner_state,
    )
    manager.register_state_dict_fn(STATE_KEY, load_state_dict, state_dict)
