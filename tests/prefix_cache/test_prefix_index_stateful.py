"""Random interleavings of every index operation against a dictionary model (spec §10).

The model maps label paths (one label per 64-token block) to node ids and (label path, tail)
to snapshot ids. After every step: ``check_invariants`` rebuilds all derived state, every
model entry still in the index has the same identity, a deleted node took its whole subtree
with it, lanes keep their paths, L never decreases, and matching any prompt returns exactly
the path and snapshots the model predicts.
"""

from __future__ import annotations

import dataclasses
import math

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from ninfer_jax.prefix_cache import OwnerState, Readiness, SnapshotKind, block_hashes
from prefix_helpers import Lane, make_index, prompt

LABELS = st.lists(st.integers(1, 2), min_size=1, max_size=3)
TAIL = st.integers(1, 63)
TAIL_LABEL = st.sampled_from([7, 8])
SMALL = st.integers(0, 8)


@dataclasses.dataclass
class LaneRecord:
    lane: Lane
    labels: list[int]
    staging: object


class PrefixIndexMachine(RuleBasedStateMachine):

    @initialize(host=st.booleans(), slots=st.integers(2, 4))
    def setup(self, host, slots):
        self.idx = make_index(device_pages=24, slots=slots, host_slabs=16 if host else 0)
        self.nodes: dict[tuple, int] = {}          # label path -> node id
        self.snaps: dict[tuple, int] = {}          # (label path, tail bytes) -> snapshot id
        self.lanes: list[LaneRecord] = []
        self.writes = []
        self.pinned = []
        self.history = []
        self.last_l = 0.0

    # ---- requests ------------------------------------------------------------------------

    @precondition(lambda self: len(self.lanes) < 2)
    @rule(labels=LABELS, tail=TAIL, tail_label=TAIL_LABEL, land=st.booleans())
    def start_lane(self, labels, tail, tail_label, land):
        self.start(labels, tail, tail_label, land)

    @precondition(lambda self: len(self.lanes) < 2 and self.history)
    @rule(pick=st.integers(0, 1000), extra=st.lists(st.integers(1, 2), max_size=2), tail=TAIL,
          tail_label=TAIL_LABEL, land=st.booleans())
    def continue_conversation(self, pick, extra, tail, tail_label, land):
        """The next turn: an earlier prompt, its partial block completed, then more blocks."""
        labels, old_tail_label = self.history[pick % len(self.history)]
        self.start(labels + [old_tail_label] + extra, tail, tail_label, land)

    @precondition(lambda self: not self.lanes)
    @rule(pick=st.integers(0, 1000), fresh=st.booleans(), extra=st.lists(st.integers(1, 2), max_size=2),
          tail=TAIL, tail_label=TAIL_LABEL, taps=st.lists(st.integers(1, 6), max_size=2),
          outcome=st.sampled_from(["ok", "failed", "pending"]), cold=st.booleans())
    def whole_turn(self, pick, fresh, extra, tail, tail_label, taps, outcome, cold):
        """One request from admission to release: taps, every block, endpoint, write-through.
        ``cold`` first drops every Host-backed Device copy, so the turn restores from the Host."""
        if cold:
            self.idx.reclaim_device_pages(self.idx.pages.num_free + len(self.idx.lists.backed))
        if fresh or not self.history:
            labels = extra or [1]
        else:
            old, old_tail_label = self.history[pick % len(self.history)]
            labels = old + [old_tail_label] + extra
        if not self.start(labels, tail, tail_label, land=True):
            return
        lane = self.lanes[0].lane
        for t in sorted(taps):
            self.tap_at(self.lanes[0], 64 * t, boundary=t % 2 == 0)
        self.finish(0, True, outcome)
        for s in lane.published:  # image write-through, as the engine enqueues at publication
            if self.idx.snapshot(s.id) is s:
                self.settle(self.idx.write_snapshot(s), outcome)

    def start(self, labels, tail, tail_label, land) -> bool:
        self.history.append((list(labels), tail_label))
        tokens = prompt(*labels, tail=tail, tail_label=tail_label)
        self.check_match(labels, tokens)
        n = len(tokens)
        quote = self.idx.quote(tokens, entitlement_pages=math.ceil(n / 64))
        if quote.readiness is not Readiness.READY:
            assert quote.readiness is Readiness.TEMPORARILY_BLOCKED
            return False
        staging = self.idx.stage(quote)
        path = self.idx.activate(staging)
        if land:
            self.idx.complete_restore(staging)
        base = staging.reuse_tokens
        pages = {base // 64 + i: p for i, p in enumerate(staging.lane_pages)}
        lane = Lane(self.idx, tokens, block_hashes(tokens), path, pages, base, staging.snapshot)
        self.lanes.append(LaneRecord(lane, list(labels), staging))
        return True

    @precondition(lambda self: self.lanes)
    @rule(i=st.integers(0, 1), blocks=st.integers(1, 5))
    def commit_blocks(self, i, blocks):
        rec = self.lanes[i % len(self.lanes)]
        lane = rec.lane
        target = min(len(lane.tokens) // 64, len(lane.path) + blocks)
        lane.commit_through(64 * target)
        for d, node in enumerate(lane.path):
            self.nodes[tuple(rec.labels[:d + 1])] = node.id

    @precondition(lambda self: self.lanes)
    @rule(i=st.integers(0, 1), boundary=st.booleans(), keep=st.booleans())
    def tap(self, i, boundary, keep):
        rec = self.lanes[i % len(self.lanes)]
        position = 64 * len(rec.lane.path)
        if not keep:  # the tap is taken but its lane drops it before publication
            grant = self.idx.begin_snapshot(position)
            if grant is not None:
                self.idx.release_staging_slot(grant.slot)
            return
        self.tap_at(rec, position, boundary)

    def tap_at(self, rec, position, boundary):
        lane = rec.lane
        if not (lane.base < position <= len(lane.tokens) - 1 and position >= 64 * len(lane.path)):
            return
        s = lane.tap(position, SnapshotKind.BOUNDARY if boundary else SnapshotKind.TAP)
        for d, node in enumerate(lane.path):
            self.nodes[tuple(rec.labels[:d + 1])] = node.id
        if s is not None:
            self.snaps[(tuple(rec.labels[:position // 64]), b"")] = s.id

    @precondition(lambda self: self.lanes)
    @rule(i=st.integers(0, 1), endpoint=st.booleans(), outcome=st.sampled_from(["ok", "failed", "pending"]))
    def finish(self, i, endpoint, outcome):
        rec = self.lanes.pop(i % len(self.lanes))
        lane = rec.lane
        self.idx.complete_restore(rec.staging)  # a lane released early waits for its restores
        lane.commit_through(len(lane.tokens))
        for d, node in enumerate(lane.path):
            self.nodes[tuple(rec.labels[:d + 1])] = node.id
        if endpoint and len(lane.tokens) - lane.base >= 64:
            s = lane.endpoint()
            if s is not None:
                n = len(lane.tokens)
                self.snaps[(tuple(rec.labels[:n // 64]), lane.tokens[64 * (n // 64):].tobytes())] = s.id
        write = self.idx.release_path(lane.path)
        self.settle(write, outcome)
        private = [p for p in lane.pages.values() if self.idx.pages.is_state(p, OwnerState.ACTIVE)]
        self.idx.free_pages(private)

    # ---- Host tier -----------------------------------------------------------------------

    @precondition(lambda self: self.idx.tree.snapshots)
    @rule(pick=st.integers(0, 1000), outcome=st.sampled_from(["ok", "failed", "pending"]))
    def write_snapshot(self, pick, outcome):
        s = self.pick_snapshot(pick)
        self.settle(self.idx.write_snapshot(s), outcome)

    @precondition(lambda self: self.writes)
    @rule(ok=st.booleans())
    def complete_write(self, ok):
        self.idx.complete_host_write(self.writes.pop(0), ok)

    @rule(k=SMALL)
    def make_host_room(self, k):
        self.idx.make_host_room(self.idx.slabs.num_free + k)

    # ---- Device, pins, supersession ------------------------------------------------------

    @rule(k=SMALL)
    def reclaim_device(self, k):
        out = self.idx.reclaim_device_pages(self.idx.pages.num_free + k)
        for node_id in out.lost_nodes:
            assert self.idx.node(node_id) is None

    @precondition(lambda self: self.idx.tree.snapshots)
    @rule(pick=st.integers(0, 1000))
    def pin(self, pick):
        s = self.pick_snapshot(pick)
        self.idx.pin_snapshot(s)
        self.pinned.append(s)

    @precondition(lambda self: self.pinned)
    @rule()
    def unpin(self):
        self.idx.unpin_snapshot(self.pinned.pop(0))

    @precondition(lambda self: self.idx.tree.snapshots)
    @rule(pick=st.integers(0, 1000))
    def supersede(self, pick):
        self.idx.supersede(self.pick_snapshot(pick))

    @rule(labels=LABELS, tail=TAIL, tail_label=TAIL_LABEL)
    def match(self, labels, tail, tail_label):
        self.check_match(labels, prompt(*labels, tail=tail, tail_label=tail_label))

    # ---- checks --------------------------------------------------------------------------

    @invariant()
    def consistent(self):
        idx = self.idx
        idx.check_invariants()
        tree = idx.tree
        alive = {key: nid for key, nid in self.nodes.items() if tree.nodes.get(nid) is not None}
        assert set(tree.nodes) == set(alive.values()), "the index holds nodes the model never saw"
        for key, nid in alive.items():
            node = tree.nodes[nid]
            assert node.depth == len(key) - 1
            assert node.tokens == prompt(key[-1]).tobytes()
            if len(key) > 1:
                assert node.parent.id == alive.get(key[:-1]), "a deleted node left descendants"
        for (key, tail), sid in self.snaps.items():
            s = tree.snapshots.get(sid)
            if s is not None:
                assert s.anchor is tree.root if not key else s.anchor.id == alive.get(key)
                assert s.tail_tokens == tail
        assert set(tree.snapshots) <= set(self.snaps.values())
        for rec in self.lanes:
            for node in rec.lane.path:
                assert tree.nodes.get(node.id) is node and node.active_refs > 0
        assert idx.inflation >= self.last_l
        self.last_l = idx.inflation

    def check_match(self, labels, tokens):
        n = len(tokens)
        limit = (n - 1) // 64
        expected_path = []
        for d in range(min(limit, len(labels))):
            nid = self.nodes.get(tuple(labels[:d + 1]))
            if nid is None or self.idx.node(nid) is None:
                break
            expected_path.append(nid)
        expected_snaps = set()
        for (key, tail), sid in self.snaps.items():
            s = self.idx.snapshot(sid)
            f = 64 * len(key) + len(tail) // 4
            if (s is not None and f <= n - 1 and tuple(labels[:len(key)]) == key
                    and tokens[64 * len(key):f].tobytes() == tail and len(key) <= len(labels)):
                expected_snaps.add(sid)
        m = self.idx.match(tokens)
        assert [node.id for node in m.path] == expected_path
        assert {s.id for s in m.candidates} == expected_snaps

    def settle(self, write, outcome):
        if outcome == "pending":
            self.writes.append(write)
        else:
            self.idx.complete_host_write(write, outcome == "ok")

    def pick_snapshot(self, pick):
        snaps = sorted(self.idx.tree.snapshots)
        return self.idx.tree.snapshots[snaps[pick % len(snaps)]]

    def teardown(self):
        if not hasattr(self, "idx"):
            return
        for write in self.writes:
            self.idx.complete_host_write(write)
        for s in self.pinned:
            self.idx.unpin_snapshot(s)
        for rec in self.lanes:
            self.idx.complete_restore(rec.staging)
            self.idx.complete_host_write(self.idx.release_path(rec.lane.path))
        self.idx.check_invariants()


PrefixIndexMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=30, deadline=None,
                                                suppress_health_check=[HealthCheck.too_slow])
TestPrefixIndexStateful = PrefixIndexMachine.TestCase
