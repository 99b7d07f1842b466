"""Bounded off-policy buffer with AReaL's staleness gate. Pure and thread-safe; no transport.

Two mechanisms keep samples fresh, and they are deliberately different:

1. `GenerationGate` (generator side) PAUSES generation when it runs too far ahead of the
   trainer. It never discards work: discarding the samples that arrive late would throw away
   mostly the long completions (they take longest), biasing training towards short answers.
2. `OffPolicyBuffer.take` never hands out a group older than `trainer_version - max_staleness`.
   Such groups are dropped and counted. With the gate respected and groups finishing roughly in
   order this does not happen; a nonzero `dropped_stale` says a generation straggled or the
   generator's weights lagged (e.g. one replica slower than the others, whose fresher groups
   fill the trainer's batches meanwhile). Each drop is counted for the replica that made the
   group (`dropped_of`) and given back to that replica's gate with the next weights: each drop
   would otherwise shrink the window for good (the gates admit (max_staleness + 1) * B groups
   beyond those trained, less the drops): after max_staleness * B drops the run is synchronous,
   and drops past that (several in one take) would leave fewer than B admissible: the trainer
   would wait for groups nobody may start. Given back, the window stays whole; a drop reaches
   its gate one version later, by which time the gate has admitted a new batch's share anyway.

Capacity counts SAMPLES (memory is per sample); groups are never split (the group baseline needs
all n samples of a prompt). `put` blocks while full (back-pressure on the generator). Every wait
has a timeout and the TimeoutError says what was awaited.
"""
from __future__ import annotations

import heapq
import itertools
import math
import threading
import warnings
from typing import Any

from trainer.batch import Group


class BufferClosed(RuntimeError):
    """Raised in every blocked or later `put`/`take`/`acquire` once `close(reason)` was called."""


def _check_timeout(timeout: float | None, what: str) -> float:
    # NaN passes `< 0` and makes Condition.wait_for wait for ever; inf overflows its deadline
    if timeout is None or not math.isfinite(timeout) or timeout < 0:
        raise ValueError(f"{what} needs a finite timeout >= 0 (hangs are bugs), got {timeout}; "
                         f"pass a number of seconds (parallel.timeout_s)")
    return float(timeout)


def staleness_gate_allows(n_generated_groups: int, trainer_version: int, batch_groups: int,
                          max_staleness: int) -> bool:
    """AReaL's admission rule, in groups: may generation of one more group START?

    `floor((N_r - 1) / B) <= i + eta` with N_r the groups generated so far INCLUDING the new one,
    B the groups per trainer step, i the trainer version and eta the max staleness. Group N_r
    (FIFO) is consumed at step floor((N_r - 1) / B), so it will be at most eta versions stale.

    >>> [staleness_gate_allows(n, 0, batch_groups=2, max_staleness=0) for n in (1, 2, 3)]
    [True, True, False]
    >>> staleness_gate_allows(3, 1, batch_groups=2, max_staleness=0)
    True
    """
    if n_generated_groups < 1:
        raise ValueError(f"n_generated_groups counts the new group, so it is >= 1, "
                         f"got {n_generated_groups}")
    return (n_generated_groups - 1) // batch_groups <= trainer_version + max_staleness


class GenerationGate:
    """Thread-safe gate the generator asks before starting each group; it pauses, never drops.

    The generator calls `acquire(timeout)` (blocks) or `try_acquire()` before starting a group;
    whoever learns of trainer progress calls `update(trainer_version, dropped_groups)`. Groups the
    buffer dropped as stale are given back (`dropped_groups`, a running total), otherwise each
    drop would permanently shrink the window (see the module docstring).
    """

    def __init__(self, batch_groups: int, max_staleness: int, n_started: int = 0,
                 trainer_version: int = 0):
        if batch_groups < 1 or max_staleness < 0:
            raise ValueError(f"GenerationGate needs batch_groups >= 1 and max_staleness >= 0, "
                             f"got {batch_groups} and {max_staleness}")
        self.batch_groups, self.max_staleness = batch_groups, max_staleness
        self._started, self._dropped, self._version = n_started, 0, trainer_version
        self._closed: str | None = None
        self._cond = threading.Condition()

    @property
    def n_started(self) -> int:
        return self._started

    @property
    def trainer_version(self) -> int:
        return self._version

    def _allowed(self) -> bool:
        n_r = self._started - self._dropped + 1
        return staleness_gate_allows(n_r, self._version, self.batch_groups, self.max_staleness)

    def _min_version_for_next(self) -> int:
        return (self._started - self._dropped) // self.batch_groups - self.max_staleness

    def update(self, trainer_version: int, dropped_groups: int | None = None) -> None:
        """Record trainer progress. Both arguments are absolute, so a repeated message is a
        no-op; they only ever move forward."""
        with self._cond:
            self._version = max(self._version, trainer_version)
            if dropped_groups is not None:
                self._dropped = max(self._dropped, dropped_groups)
            self._cond.notify_all()

    def try_acquire(self) -> bool:
        """Claim the next group slot if the gate allows it now."""
        with self._cond:
            if self._closed is not None:
                raise BufferClosed(f"generation gate closed: {self._closed}")
            if not self._allowed():
                return False
            self._started += 1
            return True

    def acquire(self, timeout: float) -> int:
        """Block until the next group may start; returns its 1-based generation index."""
        timeout = _check_timeout(timeout, "GenerationGate.acquire")
        with self._cond:
            ok = self._cond.wait_for(lambda: self._closed is not None or self._allowed(), timeout)
            if self._closed is not None:
                raise BufferClosed(f"generation gate closed: {self._closed}")
            if not ok:
                raise TimeoutError(
                    f"GenerationGate.acquire waited {timeout}s for the trainer to advance: group "
                    f"{self._started - self._dropped + 1} may start only at trainer version "
                    f">= {self._min_version_for_next()}, trainer is at {self._version} "
                    f"(batch_groups={self.batch_groups}, max_staleness={self.max_staleness}). "
                    f"Is the trainer stepping?")
            self._started += 1
            return self._started

    def close(self, reason: str) -> None:
        with self._cond:
            self._closed = reason
            self._cond.notify_all()


class OffPolicyBuffer:
    """Holds whole `Group`s between generator and trainer; bounded in samples; oldest first.

    `take` returns groups in (min_version, arrival) order, so the groups closest to going stale
    train first.
    """

    def __init__(self, capacity_samples: int, max_staleness: int, batch_groups: int,
                 group_size: int):
        if min(batch_groups, group_size) < 1 or max_staleness < 0:
            raise ValueError(f"OffPolicyBuffer needs batch_groups, group_size >= 1 and "
                             f"max_staleness >= 0, got {batch_groups}, {group_size}, "
                             f"{max_staleness}")
        if capacity_samples < batch_groups * group_size:
            raise ValueError(
                f"capacity_samples={capacity_samples} cannot hold one trainer batch of "
                f"batch_groups * group_size = {batch_groups} * {group_size} samples; raise it")
        self.capacity_samples, self.max_staleness = capacity_samples, max_staleness
        self.batch_groups, self.group_size = batch_groups, group_size
        self._heap: list[tuple[int, int, Group]] = []   # (min_version, arrival, group)
        self._arrival = itertools.count()
        self._samples = 0
        self._stats = {"put_groups": 0, "taken_groups": 0, "dropped_stale": 0,
                       "dropped_stale_samples": 0, "waiting_puts": 0, "waiting_takes": 0}
        self._dropped_by: dict[int, int] = {}  # replica -> its groups dropped as stale
        self._closed: str | None = None
        self._cond = threading.Condition()

    # -- gate ---------------------------------------------------------------------------------
    def admit_allowed(self, n_generated_groups: int, trainer_version: int) -> bool:
        """`staleness_gate_allows` with this buffer's B and eta. `n_generated_groups` counts
        every group started so far including the new one; the groups this buffer dropped as
        stale are subtracted here (they free their slot in the window)."""
        with self._cond:
            dropped = self._stats["dropped_stale"]
        return staleness_gate_allows(n_generated_groups - dropped, trainer_version,
                                     self.batch_groups, self.max_staleness)

    # -- producer -----------------------------------------------------------------------------
    def _check_group(self, group: Group) -> None:
        if group.num_samples != self.group_size:
            raise ValueError(f"group prompt_id={group.prompt_id} has {group.num_samples} samples; "
                             f"this buffer holds whole groups of group_size={self.group_size}")

    def _push(self, group: Group) -> None:
        heapq.heappush(self._heap, (group.min_version, next(self._arrival), group))
        self._samples += group.num_samples
        self._stats["put_groups"] += 1
        self._cond.notify_all()

    def _has_room(self, group: Group) -> bool:
        return self._samples + group.num_samples <= self.capacity_samples

    def try_put(self, group: Group) -> bool:
        """Add `group` if there is room now; False (nothing added) when full."""
        self._check_group(group)
        with self._cond:
            self._raise_if_closed()
            if not self._has_room(group):
                return False
            self._push(group)
            return True

    def put(self, group: Group, timeout: float) -> None:
        """Add `group`, blocking while the buffer is full (back-pressure on the generator)."""
        self._check_group(group)
        timeout = _check_timeout(timeout, "OffPolicyBuffer.put")
        with self._cond:
            self._stats["waiting_puts"] += 1
            try:
                ok = self._cond.wait_for(
                    lambda: self._closed is not None or self._has_room(group), timeout)
            finally:
                self._stats["waiting_puts"] -= 1
            self._raise_if_closed()
            if not ok:
                raise TimeoutError(
                    f"OffPolicyBuffer.put waited {timeout}s for room for {group.num_samples} "
                    f"samples (group prompt_id={group.prompt_id}); the buffer holds "
                    f"{self._samples}/{self.capacity_samples} samples in {len(self._heap)} "
                    f"groups. Is the trainer calling take()?")
            self._push(group)

    # -- consumer -----------------------------------------------------------------------------
    def _drop_stale(self, min_ok_version: int) -> None:
        dropped = False
        while self._heap and self._heap[0][0] < min_ok_version:
            _, _, g = heapq.heappop(self._heap)
            self._samples -= g.num_samples
            self._stats["dropped_stale"] += 1
            self._stats["dropped_stale_samples"] += g.num_samples
            self._dropped_by[g.replica] = self._dropped_by.get(g.replica, 0) + 1
            dropped = True
        if dropped:
            self._cond.notify_all()

    def _pop(self, n_groups: int) -> list[Group]:
        out = [heapq.heappop(self._heap)[2] for _ in range(n_groups)]
        self._samples -= sum(g.num_samples for g in out)
        self._stats["taken_groups"] += n_groups
        self._cond.notify_all()
        return out

    def _check_take(self, n_groups: int) -> None:
        if n_groups < 1 or n_groups * self.group_size > self.capacity_samples:
            most = self.capacity_samples // self.group_size
            raise ValueError(f"take({n_groups}) must ask for 1..{most} groups "
                             f"(capacity_samples={self.capacity_samples}, "
                             f"group_size={self.group_size})")

    def try_take(self, n_groups: int, trainer_version: int) -> list[Group] | None:
        """`take` without waiting: the groups, or None if fewer than n fresh ones are here."""
        self._check_take(n_groups)
        with self._cond:
            self._raise_if_closed()
            self._drop_stale(trainer_version - self.max_staleness)
            return self._pop(n_groups) if len(self._heap) >= n_groups else None

    def take(self, n_groups: int, trainer_version: int, timeout: float) -> list[Group]:
        """Wait for `n_groups` groups with `min_version >= trainer_version - max_staleness`.
        Older groups are dropped and counted; a stale sample is never returned."""
        self._check_take(n_groups)
        timeout = _check_timeout(timeout, "OffPolicyBuffer.take")
        min_ok = trainer_version - self.max_staleness

        def ready() -> bool:
            if self._closed is not None:
                return True
            self._drop_stale(min_ok)   # re-checked on each wake: new arrivals may be stale
            return len(self._heap) >= n_groups

        with self._cond:
            self._stats["waiting_takes"] += 1
            try:
                ok = self._cond.wait_for(ready, timeout)
            finally:
                self._stats["waiting_takes"] -= 1
            self._raise_if_closed()
            if not ok:
                versions = sorted(v for v, _, _ in self._heap)
                raise TimeoutError(
                    f"OffPolicyBuffer.take waited {timeout}s for {n_groups} groups with "
                    f"min_version >= {min_ok} (trainer_version {trainer_version} - max_staleness "
                    f"{self.max_staleness}); it has {len(self._heap)} (versions {versions}), "
                    f"dropped {self._stats['dropped_stale']} stale so far. Is the generator "
                    f"running and sending groups?")
            return self._pop(n_groups)

    # -- misc ---------------------------------------------------------------------------------
    def __len__(self) -> int:
        """Number of groups held."""
        with self._cond:
            return len(self._heap)

    @property
    def num_samples(self) -> int:
        with self._cond:
            return self._samples

    def dropped_of(self, replica: int) -> int:
        """Groups of generator replica `replica` dropped as stale so far (a running total)."""
        with self._cond:
            return self._dropped_by.get(replica, 0)

    def stats(self) -> dict[str, int]:
        """Counters: put_groups, taken_groups, dropped_stale (groups), dropped_stale_samples,
        waiting_puts / waiting_takes (callers blocked right now), size_groups, size_samples."""
        with self._cond:
            return {**self._stats, "size_groups": len(self._heap), "size_samples": self._samples}

    def close(self, reason: str) -> None:
        """Wake every waiter with `BufferClosed(reason)` (shutdown, or the peer crashed)."""
        with self._cond:
            self._closed = reason
            self._cond.notify_all()

    def _raise_if_closed(self) -> None:
        if self._closed is not None:
            raise BufferClosed(f"buffer closed: {self._closed}")

    def state_dict(self) -> dict[str, Any]:
        """Plain-python snapshot of the contents (oldest first) and the counters."""
        with self._cond:
            return {"groups": [g.to_dict() for _, _, g in sorted(self._heap, key=lambda e: e[:2])],
                    "stats": {k: self._stats[k] for k in
                              ("put_groups", "taken_groups", "dropped_stale",
                               "dropped_stale_samples")},
                    "dropped_by": {str(r): n for r, n in self._dropped_by.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Replace the contents with a `state_dict()` snapshot (validated against this config)."""
        groups = [Group.from_dict(d) for d in state["groups"]]
        for g in groups:
            self._check_group(g)
        samples = sum(g.num_samples for g in groups)
        if samples > self.capacity_samples:
            raise ValueError(f"the saved buffer holds {samples} samples but capacity_samples is "
                             f"{self.capacity_samples}; resume with a capacity >= {samples}")
        with self._cond:
            self._heap = []
            self._samples = 0
            for g in groups:
                heapq.heappush(self._heap, (g.min_version, next(self._arrival), g))
                self._samples += g.num_samples
            self._stats.update(state["stats"])
            if "dropped_by" not in state and state["stats"].get("dropped_stale"):
                warnings.warn(f"a checkpoint of the earlier code: its {state['stats']['dropped_stale']} "
                              "stale drops are not attributed to replicas, so their places in the "
                              "generators' staleness windows stay lost", stacklevel=2)
            self._dropped_by = {int(r): n for r, n in state.get("dropped_by", {}).items()}
            self._cond.notify_all()
