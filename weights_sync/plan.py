"""The weight reshard plan: a pure function from (source layout, destination layout, params) to
typed point-to-point transfers, with no process group.

This is LlamaRL's DDMA (arXiv 2505.24034: every trainer rank sends only its own shard, straight
to the generator ranks that need it, and no rank gathers the model) planned the way ReaL
(arXiv 2406.14088) plans parameter reallocation: derive the steps from the two layouts, cache
them, then execute. Every rank builds the same plan independently, so sender and receiver agree
on what crosses each (src, dst) pair, and in which order, without talking.

Rules
  * Coverage: per param, the source's distinct boxes must tile it exactly once (identical boxes
    on several ranks are copies: src replicas, TP-replicated norms). Each destination rank gets
    its whole box, cut into pieces `dst_box ∩ src_box`, each piece from exactly one sender.
  * Direct fan-out: every destination rank of every generator DP replica receives from trainer
    ranks directly (no relay through another replica).
  * Balance: a piece held by one source rank has no choice. A piece held by h copies goes to
    its r receivers by exact unit greedy ("least bytes sent so far, lowest rank on ties"), with
    replicated pieces placed largest first after all forced ones; receiver j (in rank order)
    takes the j-th pick, so consecutive receivers alternate between the copies (with equal
    loads a generator TP rank t hears the trainer's TP rank t copy, a pair its weights use).
    When the copies form disjoint groups (FSDP x TP trainers: a norm shard's copies are one TP
    group) the greedy ends within one piece of the fractional optimum: if s is the busiest
    sender and took its last piece at load L as the least loaded copy in its group X, all of X
    carried >= L, so L <= demand(X) / |X| <= optimum. tests/test_plan.py checks this bound.
  * Order: the transfers of one pair follow the param order of `specs`. Pairs are ordered by
    (round, src, dst) with round = (replica index of dst + u) mod n_replicas, where u is the
    sender's position among the pieces of the receiver's box (first param of the pair). A sender
    thus serves the DP replicas in a rotated order, a receiver's senders are spread over the
    rounds, and sends_from/recvs_to are both restrictions of one global order, so executing them
    with blocking send/recv cannot deadlock.

Worked example (`python -m weights_sync.plan --demo`): trainer ranks 0-3 on mesh (fsdp=2, tp=2),
generator ranks 4-7 on mesh (dp=2, tp=2), replicas {4, 5} and {6, 7}.
  w (10, 6), TP colwise + FSDP2: trainer rows 0:[0,3) 2:[3,5) 1:[5,8) 3:[8,10);
                                 generator rows 4,6:[0,5) 5,7:[5,10)
  norm (7,), FSDP Shard(0), TP-replicated: trainer 0,1:[0,4) 2,3:[4,7); generator: all of it
  w pieces have one holder each: 0 sends w[0:3] to 4 and 6, 2 sends w[3:5] to 4 and 6, ...
  norm[0:4] has copies on 0 and 1 with equal loads, so receivers 4,5,6,7 take 0,1,0,1;
  norm[4:7] likewise takes 2,3,2,3. Every sender sends 2 pairs, every receiver hears 2 senders:
    round 0: 0->4 (w[0:3], norm[0:4])  1->5  2->6  3->7      (one sender per receiver)
    round 1: 0->6  1->7  2->4 (w[3:5], norm[4:7])  3->5
"""
from __future__ import annotations

import argparse
import functools
import operator
from collections import OrderedDict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from parallel.layout import Box, Layout, ParamSpec, Tiling, dtype_bytes


@dataclass(frozen=True, slots=True)
class Transfer:
    """One piece of one param: `src_box` indexes the sender's local shard, `dst_box` the
    receiver's local shard, `global_box` the full parameter."""
    param: str
    src_box: Box
    dst_box: Box
    global_box: Box


@dataclass
class _ParamPlan:
    spec: ParamSpec
    src: Tiling                       # distinct source boxes, tiling the param; holders = copies
    dst: Tiling                       # distinct destination boxes; holders = receivers
    recv_pos: list[dict[int, int]]    # per dst box: receiver rank -> its index j
    counts: dict[tuple[int, int], tuple[int, ...]] = field(default_factory=dict)
    # (dst box, src box) -> receivers served by each copy, only where the piece has > 1 copy


def _transfer(param: str, offs: tuple[int, ...], sizes: tuple[int, ...], src_box: Box,
              dst_box: Box) -> Transfer:
    """The piece at global (offs, sizes), which lies inside both shards by construction."""
    return Transfer(param, Box(tuple(map(operator.sub, offs, src_box.offsets)), sizes),
                    Box(tuple(map(operator.sub, offs, dst_box.offsets)), sizes), Box(offs, sizes))


def _water_fill(loads: Sequence[int], unit: int, r: int) -> tuple[int, ...]:
    """Exact result of giving r units of `unit` bytes, one at a time, to the least loaded holder
    (lowest index on ties), in O(h log h).

    Holder i's k-th unit is the slot loads[i] + k * unit = (q_i + k) * unit + rho_i, so slots
    sort by (level q_i + k, rho_i, i). Find the last level N with fewer than r slots below it;
    every holder fills levels q_i .. N - 1 and the rest go, in (rho_i, i) order, to level N.
    """
    q = [x // unit for x in loads]
    qs, prefix, level = sorted(q), 0, None
    for m in range(1, len(qs) + 1):  # m lowest holders active: slots below N = m * N - prefix
        prefix += qs[m - 1]
        level = (r - 1 + prefix) // m
        if m == len(qs) or level <= qs[m]:
            break
    counts = [max(0, level - qi) for qi in q]
    at_level = sorted((x % unit, i) for i, x in enumerate(loads) if q[i] <= level)
    for _, i in at_level[:r - sum(counts)]:
        counts[i] += 1
    return tuple(counts)


def _assignment(counts: Sequence[int]) -> list[int]:
    """Holder position of each receiver j: rounds over the holders (in order), holder i taking
    part in rounds 0 .. counts[i] - 1. E.g. counts (2, 1) -> [0, 1, 0]."""
    return [i for k in range(max(counts)) for i, c in enumerate(counts) if c > k]


def _holder_of(j: int, counts: Sequence[int]) -> int:
    """`_assignment(counts)[j]` in O(h) without building the list."""
    base = 0
    for level in sorted({c for c in counts if c > 0}):
        members = [i for i, c in enumerate(counts) if c >= level]
        band = (level - base) * len(members)
        if j < band:
            return members[j % len(members)]
        j, base = j - band, level
    raise AssertionError(f"receiver {j} beyond counts {counts}")


def _param_plan(spec: ParamSpec, src: Layout, dst: Layout) -> _ParamPlan:
    for side, layout in (("source", src), ("destination", dst)):
        if spec.name not in layout.by_param:
            raise ValueError(f"param {spec.name!r} is missing from the {side} layout")
    _check_shapes(spec, src, dst)
    try:
        src_t = Tiling(spec.name, spec.shape, src.by_param[spec.name], strict=True)
    except ValueError as e:
        raise ValueError(f"source layout: {e}") from None
    dst_t = Tiling(spec.name, spec.shape, dst.by_param[spec.name], strict=False)
    recv_pos = [{r: j for j, r in enumerate(rs)} for rs in dst_t.holders]
    return _ParamPlan(spec, src_t, dst_t, recv_pos)


def _check_shapes(spec: ParamSpec, src: Layout, dst: Layout) -> None:
    """Both meshes hold `spec` at its global shape. A generator built from another model (another
    vocabulary, width or head count) is refused here, at planning, on every rank alike: before any
    sender or receiver exists, so nothing is sent and nobody waits for it."""
    want = tuple(spec.shape)
    have = {side: tuple(layout.spec_by_name.get(spec.name, spec).shape)
            for side, layout in (("source", src), ("destination", dst))}
    if set(have.values()) == {want}:
        return
    specs_too = f" and {want} in the planned specs" if have["source"] != want else ""
    raise ValueError(f"param {spec.name!r} has shape {have['source']} on the trainer (source) "
                     f"mesh but {have['destination']} on the generator (destination) "
                     f"mesh{specs_too}: the two meshes hold different models. Build the trainer "
                     f"and the generator from the same model (model.path and its config.json)")


def plan(src: Layout, dst: Layout, specs: Sequence[ParamSpec]) -> Plan:
    """Plan the transfers that give every `dst` rank its box of every param in `specs` from the
    `src` ranks' shards (see the module docstring for the rules)."""
    names = [s.name for s in specs]
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise ValueError(f"duplicate param names in specs: {dup}")
    params = [_param_plan(s, src, dst) for s in specs]
    load = {r: 0 for r in src.ranks}  # bytes sent so far, per source rank
    replicated = []
    for pi, pp in enumerate(params):
        itemsize = pp.spec.itemsize
        for did, dbox in enumerate(pp.dst.boxes):
            r = len(pp.dst.holders[did])
            for sid, numel in pp.src.overlap_numels(dbox):
                holders, nbytes = pp.src.holders[sid], numel * itemsize
                if len(holders) == 1:
                    load[holders[0]] += nbytes * r
                else:
                    replicated.append((-nbytes * r, pi, did, sid, nbytes, r))
    replicated.sort()  # largest first; (pi, did, sid) makes the order total and deterministic
    for _, pi, did, sid, nbytes, r in replicated:
        holders = params[pi].src.holders[sid]
        counts = _water_fill([load[h] for h in holders], nbytes, r)
        params[pi].counts[(did, sid)] = counts
        for h, c in zip(holders, counts):
            load[h] += c * nbytes
    return Plan(src, dst, tuple(specs), params, load)


class Plan:
    """Transfers per (src_rank, dst_rank) pair. Built compactly; `sends_from(rank)` and
    `recvs_to(rank)` materialise one rank's side, `steps` materialises all of it."""

    def __init__(self, src: Layout, dst: Layout, specs: tuple[ParamSpec, ...],
                 params: list[_ParamPlan], load: dict[int, int]):
        self.src, self.dst, self.specs = src, dst, specs
        self._params, self._load = params, load
        self._positions: dict[tuple[int, int], dict[int, int]] = {}

    def _position(self, pi: int, did: int, sid: int) -> int:
        """Index of source box `sid` among the pieces of destination box `did` (param pi)."""
        key = (pi, did)
        if key not in self._positions:
            pp = self._params[pi]
            hits = pp.src.overlaps(pp.dst.boxes[did])
            self._positions[key] = {s: u for u, (s, _, _) in enumerate(hits)}
        return self._positions[key][sid]

    def _round(self, d: int, first: tuple[int, int, int]) -> int:
        """Schedule round of a pair whose first piece is (param, dst box, src box)."""
        return (self.dst.replica_of(d) + self._position(*first)) % len(self.dst.replicas)

    def _sends(self, rank: int) -> tuple[dict[int, list[Transfer]], dict[int, int]]:
        """(dst rank -> transfers, dst rank -> round) for one source rank."""
        out: dict[int, list[Transfer]] = {}
        rounds: dict[int, int] = {}
        for pi, pp in enumerate(self._params):
            sbox = self.src.boxes.get(rank, {}).get(pp.spec.name)
            if sbox is None or sbox.is_empty:
                continue
            sid = pp.src.index[sbox]
            holders = pp.src.holders[sid]
            for did, offs, sizes in pp.dst.overlaps(sbox):
                t = _transfer(pp.spec.name, offs, sizes, sbox, pp.dst.boxes[did])
                receivers = pp.dst.holders[did]
                if len(holders) > 1:
                    mine = holders.index(rank)
                    seq = _assignment(pp.counts[(did, sid)])
                    receivers = [d for d, h in zip(receivers, seq) if h == mine]
                for d in receivers:
                    out.setdefault(d, []).append(t)
                    if d not in rounds:
                        rounds[d] = self._round(d, (pi, did, sid))
        return out, rounds

    def sends_from(self, rank: int) -> dict[int, list[Transfer]]:
        """dst rank -> transfers this source rank sends it; peers in schedule order."""
        out, rounds = self._sends(rank)
        return {d: out[d] for d in sorted(out, key=lambda d: (rounds[d], d))}

    def recvs_to(self, rank: int) -> dict[int, list[Transfer]]:
        """src rank -> transfers this destination rank receives from it; peers in schedule order."""
        out: dict[int, list[Transfer]] = {}
        rounds: dict[int, int] = {}
        for pi, pp in enumerate(self._params):
            dbox = self.dst.boxes.get(rank, {}).get(pp.spec.name)
            if dbox is None or dbox.is_empty:
                continue
            did = pp.dst.index[dbox]
            j = pp.recv_pos[did][rank]
            for sid, offs, sizes in pp.src.overlaps(dbox):
                holders = pp.src.holders[sid]
                s = holders[0]
                if len(holders) > 1:
                    s = holders[_holder_of(j, pp.counts[(did, sid)])]
                out.setdefault(s, []).append(
                    _transfer(pp.spec.name, offs, sizes, pp.src.boxes[sid], dbox))
                if s not in rounds:
                    rounds[s] = self._round(rank, (pi, did, sid))
        return {s: out[s] for s in sorted(out, key=lambda s: (rounds[s], s))}

    @functools.cached_property
    def steps(self) -> dict[tuple[int, int], list[Transfer]]:
        """(src, dst) -> transfers for every pair, in the global (round, src, dst) order that
        sends_from/recvs_to restrict. O(transfers): for tests and small meshes."""
        keyed = {}
        for s in sorted(self.src.ranks):
            out, rounds = self._sends(s)
            keyed.update(((rounds[d], s, d), ts) for d, ts in out.items())
        return {(s, d): keyed[(r, s, d)] for r, s, d in sorted(keyed)}

    def bytes_per_pair(self, dtype_bytes_fn: Callable[[str], int] = dtype_bytes
                       ) -> dict[tuple[int, int], int]:
        """(src, dst) -> bytes on the wire, with `dtype_bytes_fn(spec.dtype)` bytes per element
        (pass the generator's dtype size when the sender casts)."""
        size = {s.name: dtype_bytes_fn(s.dtype) for s in self.specs}
        return {p: sum(t.global_box.numel * size[t.param] for t in ts)
                for p, ts in self.steps.items()}

    def send_volume_by_rank(self) -> dict[int, int]:
        """Source rank -> bytes it sends (at each spec's dtype); known without materialising."""
        return dict(self._load)

    def summary(self) -> str:
        vol = self.send_volume_by_rank()
        busy = [v for v in vol.values() if v]
        return (f"{len(self.src.ranks)} src ranks -> {len(self.dst.ranks)} dst ranks "
                f"({len(self.dst.replicas)} replicas), {len(self.specs)} params, "
                f"{_size(sum(vol.values()))}; per busy sender max "
                f"{_size(max(vol.values(), default=0))}, mean "
                f"{_size(sum(busy) / max(1, len(busy)))} ({len(busy)} of {len(vol)} senders busy)")


def _size(nbytes: float) -> str:
    """Bytes in the largest decimal unit that keeps a digit before the point (a tiny model's plan
    read "0.00 GB")."""
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if nbytes >= scale:
            return f"{nbytes / scale:.2f} {unit}"
    return f"{nbytes:.0f} bytes"


# ---------------------------------------------------------------------------------------------
# Cache: the plan depends only on the two layouts and the params, so it is computed once.

_CACHE: OrderedDict[tuple, Plan] = OrderedDict()
_CACHE_SIZE = 8
_CACHE_STATS = {"hits": 0, "misses": 0}


def plan_cached(src: Layout, dst: Layout, specs: Sequence[ParamSpec]) -> Plan:
    """`plan` with an LRU cache keyed by the layouts' stable digests (`Layout.key`) and specs."""
    key = (src.key, dst.key, tuple(specs))
    if key in _CACHE:
        _CACHE_STATS["hits"] += 1
        _CACHE.move_to_end(key)
        return _CACHE[key]
    _CACHE_STATS["misses"] += 1
    result = _CACHE[key] = plan(src, dst, specs)
    while len(_CACHE) > _CACHE_SIZE:
        _CACHE.popitem(last=False)
    return result


def plan_cache_info() -> dict[str, int]:
    return {**_CACHE_STATS, "size": len(_CACHE)}


def plan_cache_clear() -> None:
    _CACHE.clear()
    _CACHE_STATS.update(hits=0, misses=0)


# ---------------------------------------------------------------------------------------------
# Demo: python -m weights_sync.plan --demo

def demo_layouts() -> tuple[Layout, Layout, list[ParamSpec]]:
    """The module docstring's example: trainer (fsdp=2, tp=2) on ranks 0-3, generator (dp=2,
    tp=2) on ranks 4-7."""
    specs = [ParamSpec("w", (10, 6), "float32"), ParamSpec("norm", (7,), "float32")]
    trainer = Layout.from_placements(
        specs, [0, 1, 2, 3], (2, 2), ("fsdp", "tp"),
        {"w": [("strided_shard", 0, 2), ("shard", 0)], "norm": [("shard", 0), ("replicate",)]})
    generator = Layout.from_placements(
        specs, [4, 5, 6, 7], (2, 2), ("dp", "tp"),
        {"w": [("replicate",), ("shard", 0)], "norm": [("replicate",), ("replicate",)]},
        replica_axis="dp")
    return trainer, generator, specs


def _demo() -> None:
    src, dst, specs = demo_layouts()
    p = plan(src, dst, specs)
    print(p.summary())
    for (s, d), ts in p.steps.items():
        rows = "  ".join(t.param + "[" + ", ".join(
            f"{o}:{o + n}" for o, n in zip(t.global_box.offsets, t.global_box.sizes)) + "]"
            for t in ts)
        print(f"  {s} -> {d}: {rows}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--demo", action="store_true", help="print the plan of a small example")
    if parser.parse_args().demo:
        _demo()
