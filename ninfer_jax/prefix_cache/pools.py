"""Plain-int id pools with one owner state per id: Device page groups and snapshot slots (spec §5.4, §10.1).

A page id names one *page group* (the block's page in every enabled KV pool, the bundle the
engine moves together); a slot id names one Device snapshot slot of the state pool. The
pools own only the ids and their states; which node, snapshot or lane holds an id is the
index's business, and :func:`check_invariants` rebuilds the states from the tree.

Invariants (checked by :meth:`IdPool.check`):
  * every id is in exactly one state; ``FREE`` ids are exactly the ids on the free stack,
    each once;
  * the ledger adds up: ``active + cached + filling + free == capacity``;
  * allocation and free are O(1) per id (an index stack; a batch is sorted so consecutive ids
    stay together, which lets a later copy move runs).
"""

from __future__ import annotations

import enum


class PoolExhausted(RuntimeError):
    """Raised when an allocation asks for more ids than are free."""


class OwnerState(enum.IntEnum):
    """Owner state of a Device page group or snapshot slot."""

    FREE = 0
    ACTIVE = 1   # owned by one sequence (private page, or a tap's staging slot)
    CACHED = 2   # owned by a cache entry (node, snapshot tail or snapshot image)
    FILLING = 3  # destination of an in-flight transfer


class IdPool:
    """Ids ``0 .. capacity-1`` with an owner state each and an O(1) free stack.

    Args:
      capacity: number of ids.
      states: the state enum; member 0 must mean free.
      name: used in error messages.
    """

    def __init__(self, capacity: int, states: type[enum.IntEnum] = OwnerState, name: str = "pool"):
        if capacity < 0:
            raise ValueError(f"{name} capacity must be >= 0, got {capacity}")
        self.name = name
        self._states_enum = states
        self._state = bytearray(capacity)  # every id starts FREE (0)
        # NOTE: the stack top is the smallest id, so a fresh pool hands out 0, 1, 2, ...
        self._free: list[int] = list(range(capacity - 1, -1, -1))
        self._counts = [0] * len(states)
        self._counts[0] = capacity

    # ---- queries -------------------------------------------------------------------------

    @property
    def capacity(self) -> int:
        return len(self._state)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def count(self, state: enum.IntEnum) -> int:
        """Number of ids currently in ``state``."""
        return self._counts[state]

    def state(self, ident: int) -> enum.IntEnum:
        return self._states_enum(self._state[ident])

    def is_state(self, ident: int, state: enum.IntEnum) -> bool:
        """Whether ``ident`` (a valid id) is in ``state`` (cheap: no enum construction)."""
        return 0 <= ident < len(self._state) and self._state[ident] == state

    def ledger(self) -> dict[str, int]:
        """Counts per state plus capacity, for reports and tests."""
        out = {member.name.lower(): self._counts[member] for member in self._states_enum}
        out["capacity"] = self.capacity
        return out

    # ---- mutation ------------------------------------------------------------------------

    def allocate(self, k: int, state: enum.IntEnum) -> list[int]:
        """Takes ``k`` free ids into ``state``; returns them in ascending order.

        Raises:
          PoolExhausted: fewer than ``k`` ids are free (nothing is taken).
        """
        if state == 0:
            raise ValueError(f"{self.name}: cannot allocate into the free state")
        if k > len(self._free):
            raise PoolExhausted(f"{self.name}: asked for {k} ids, {len(self._free)} free")
        free = self._free
        ids = [free.pop() for _ in range(k)]
        ids.sort()
        st = self._state
        for ident in ids:
            st[ident] = state
        self._counts[0] -= k
        self._counts[state] += k
        return ids

    def allocate_one(self, state: enum.IntEnum) -> int:
        """Takes one free id into ``state``."""
        if not self._free:
            raise PoolExhausted(f"{self.name}: no free id")
        ident = self._free.pop()
        self._state[ident] = state
        self._counts[0] -= 1
        self._counts[state] += 1
        return ident

    def set_state(self, ident: int, state: enum.IntEnum) -> None:
        """Moves an allocated id between owned states (never to or from free)."""
        old = self._state[ident]
        if old == 0 or state == 0:
            raise ValueError(f"{self.name}: id {ident} set_state {self._states_enum(old).name} -> "
                             f"{self._states_enum(state).name} must stay allocated")
        self._state[ident] = state
        self._counts[old] -= 1
        self._counts[state] += 1

    def free(self, ids) -> None:
        """Returns ids to the free stack (pushed so the smallest is popped first)."""
        st = self._state
        for ident in sorted(ids, reverse=True):
            old = st[ident]
            if old == 0:
                raise ValueError(f"{self.name}: id {ident} freed twice")
            st[ident] = 0
            self._counts[old] -= 1
            self._free.append(ident)
        self._counts[0] = len(self._free)

    def free_one(self, ident: int) -> None:
        old = self._state[ident]
        if old == 0:
            raise ValueError(f"{self.name}: id {ident} freed twice")
        self._state[ident] = 0
        self._counts[old] -= 1
        self._counts[0] += 1
        self._free.append(ident)

    # ---- checks --------------------------------------------------------------------------

    def check(self, expected: dict[int, enum.IntEnum] | None = None,
              unowned_ok: tuple[enum.IntEnum, ...] = ()) -> None:
        """Rebuilds the ledger and free stack from the state array; raises AssertionError on a mismatch.

        Args:
          expected: ids whose owner the caller knows, mapped to the state they must have.
          unowned_ok: states an id not in ``expected`` may have besides free.
        """
        counts = [0] * len(self._states_enum)
        for ident, s in enumerate(self._state):
            counts[s] += 1
        assert counts == self._counts, f"{self.name}: ledger {self._counts} != rebuilt {counts}"
        assert sum(counts) == self.capacity, f"{self.name}: ledger does not add up to capacity"
        assert len(set(self._free)) == len(self._free), f"{self.name}: an id is on the free stack twice"
        free_ids = {i for i, s in enumerate(self._state) if s == 0}
        assert set(self._free) == free_ids, f"{self.name}: free stack != ids in the free state"
        if expected is None:
            return
        for ident, want in expected.items():
            got = self._state[ident]
            assert got == want, (f"{self.name}: id {ident} is {self._states_enum(got).name}, "
                                 f"its owner says {self._states_enum(want).name}")
        for ident, s in enumerate(self._state):
            if s != 0 and ident not in expected:
                assert s in unowned_ok, (f"{self.name}: id {ident} is {self._states_enum(s).name} "
                                         f"but no cache entry owns it")


class DevicePagePool(IdPool):
    """Device page groups: Free / Active (a lane's private page) / Cached (node or tail) / Filling.

    ``available = free + evictable cached`` (the index adds its device LRU length).
    """

    def __init__(self, capacity: int):
        super().__init__(capacity, OwnerState, "device pages")


class SnapshotSlotPool(IdPool):
    """Device snapshot slots: Free / Active (a tap's staging slot) / Cached (a snapshot image) / Filling."""

    def __init__(self, capacity: int):
        super().__init__(capacity, OwnerState, "snapshot slots")
