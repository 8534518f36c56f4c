"""SlotTable: which runner state slot is each lane's active state and each index snapshot slot's (spec §7.7)."""

from __future__ import annotations

import numpy as np


class SlotTable:
    """Two tables over the runner's C + D state slots; at start lane i has slot i and snapshot slot s has C + s.

    An endpoint hands the lane's slot to the snapshot and takes the snapshot slot's in exchange (§7.7: the
    active image itself becomes the snapshot, no copy). The slot a lane takes holds stale state nothing reads:
    a lane starting at position 0 starts from zero, and a resumed lane has its slot loaded first.
    Invariant: the two tables together are a permutation of the runner's slots.
    """

    def __init__(self, lanes: int, snapshot_slots: int):
        self.lane_slots = np.arange(lanes, dtype=np.int32)  # lane -> its active slot (the decode step's input)
        self._snapshot_slots = np.arange(lanes, lanes + snapshot_slots, dtype=np.int32)

    def lane(self, lane: int) -> int:
        """The runner slot holding lane `lane`'s active state."""
        return int(self.lane_slots[lane])

    def snapshot(self, index_slot: int) -> int:
        """The runner slot holding the index's snapshot slot `index_slot`."""
        return int(self._snapshot_slots[index_slot])

    def hand_over(self, lane: int, index_slot: int) -> None:
        """The lane's state becomes snapshot slot `index_slot`'s; the lane takes that slot's old runner slot."""
        self.lane_slots[lane], self._snapshot_slots[index_slot] = \
            self._snapshot_slots[index_slot], self.lane_slots[lane]

    def check(self) -> None:
        slots = np.concatenate([self.lane_slots, self._snapshot_slots])
        assert sorted(slots) == list(range(len(slots))), f"state slots not one per lane and snapshot slot: {slots}"
