"""Colocated weight sync: every rank sends its trainer shards and receives its generator shards
over one process group, with all of a version's point-to-point operations posted as one batch.

Split mode streams from a sender thread while the receiving ranks post their receives
(weights_sync/sync.py); a colocated rank is both at once. Over NCCL the point-to-point operations
between two ranks run in posting order on one stream of that pair's communicator, and a layout
change swaps pieces both ways (a row shard of the trainer for a column block of the generator):
a send posted before the receive of the same pair, on both ranks, waits for a receive queued
behind it, past NCCL's buffer. One `dist.batch_isend_irecv` over all sends and receives of a
version is one NCCL group, in which they progress together. Gloo runs the same batch (the CPU
tests). The messages and headers are split mode's (`stream.messages`, `header`), so one plan
serves both, and the receiver's own `begin` / `slices` / `finish` (its header checks, its
history, the staged version) serve the batch.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from weights_sync import stream
from weights_sync.sync import TAG_WEIGHTS, WeightReceiver, WeightSender


class BatchedExchange:
    """One version both ways between the ranks of `sender.group`: `run(version)` returns
    `apply()` (the receiver's staging into the generator's parameters), as `receive` does.

    Sends from a shard that is contiguous and already in the wire dtype go without a copy (as in
    split mode); the others are filled into buffers allocated once (a batch holds every message
    at once, so the `sender`'s streaming buckets cannot serve it: build it with streams=False).
    Generator replicas hold the same shards, so the plan sends the same pieces to the ranks of
    one TP coordinate in every replica: a buffer serves every peer whose segments are the same,
    filled once a version, and the buffers hold at most this rank's trainer shard (one per
    replica before: gen_dp - 1 copies of it)."""

    def __init__(self, sender: WeightSender, receiver: WeightReceiver):
        self.sender, self.receiver = sender, receiver
        self.group, self.timeout_s = sender.group, sender.timeout_s
        patterns: dict[tuple, int] = {}  # the peers' segments, numbered: equal ones share
        self._pattern = {dst: patterns.setdefault(tuple(segs), len(patterns))
                         for dst, segs in sender.peers.items()}
        self._bufs = {}  # (pattern, lo) -> buffer
        for dst, msgs in sender.messages.items():
            for lo, hi, view in msgs:
                if view is None and self._key(dst, lo) not in self._bufs:
                    self._bufs[self._key(dst, lo)] = torch.empty(hi - lo, dtype=sender.dtype,
                                                                 device=sender.device)
        self._started = False

    def _key(self, dst: int, lo: int) -> tuple[int, int]:
        return self._pattern[dst], lo

    @property
    def staging_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self._bufs.values())

    def peers(self) -> list[int]:
        return sorted(set(self.sender.peers) | set(self.receiver.peers))

    @torch.no_grad()
    def run(self, version: int):
        if not self._started:  # NCCL: a group's first operation must involve all its ranks
            dist.barrier(group=self.group)  # (under the group's own timeout)
            self._started = True
        r = self.receiver
        t0, deadline, heads = r.begin()
        ops = self._sends(version) + [
            dist.P2POp(dist.irecv, t, src, self.group, TAG_WEIGHTS)
            for src, head in heads.items() for t in (head, *r.slices(src))]
        peers = f"ranks {self.peers()} (one batch, both ways)"
        works = [(peers, w) for w in (dist.batch_isend_irecv(ops) if ops else [])]
        return r.finish((version, t0, deadline, heads, works))

    def _sends(self, version: int) -> list[dist.P2POp]:
        s, ops, filled = self.sender, [], set()
        for dst, segs in s.peers.items():
            ops.append(dist.P2POp(dist.isend, s.head(version, dst), dst, self.group, TAG_WEIGHTS))
            for lo, hi, view in s.messages[dst]:
                if view is None:
                    key = self._key(dst, lo)
                    view = self._bufs[key]
                    if key not in filled:
                        stream.fill(view, lo, hi, segs, s.tensors)
                        filled.add(key)
                ops.append(dist.P2POp(dist.isend, view, dst, self.group, TAG_WEIGHTS))
        return ops
