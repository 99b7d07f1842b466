"""Where every parameter lives: a `Layout` maps each rank to the box (offsets, sizes) of each
parameter that the rank holds, independent of torch DTensor objects.

This is the input of the weight reshard planner (`weights_sync.plan`), in the spirit of ReaL's
parameter reallocation (arXiv 2406.14088): a layout is data, so the plan between two layouts is a
pure function that every rank can evaluate for itself, without a process group.

Placements (one per mesh axis, DTensor-style):
  ("replicate",)                      the axis holds copies
  ("shard", dim)                      DTensor `Shard(dim)`: axes apply left to right, each axis
                                      splits the *current local chunk* with torch.chunk semantics
                                      (chunk = ceil(n / k)); trailing chunks may be short or empty
  ("strided_shard", dim, split)       DTensor `_StridedShard(dim, split_factor=split)`, as FSDP2
                                      emits it for FSDP over a TP-sharded dim: this axis splits the
                                      chunk left by the *later* axes on `dim` (whose degrees must
                                      multiply to `split`), i.e. TP first, then FSDP on the TP chunk

Example, `w` of shape (10, 6) on mesh (fsdp=2, tp=2), TP colwise + FSDP2 = placements
[("strided_shard", 0, 2), ("shard", 0)]: TP chunks rows [0,5) [5,10); FSDP splits each 3+2, so
coordinate (fsdp, tp) -> rows (0,0) [0,3), (1,0) [3,5), (0,1) [5,8), (1,1) [8,10).

Note: for uneven sizes torch's `compute_local_shape_and_global_offset` disagrees with what FSDP2
actually stores under `_StridedShard` (e.g. 7 rows, tp=2, fsdp=3: torch reports 1 row at offset 6
on coordinate (2, 0), FSDP2 stores 0 rows there and row 6 on (2, 1)). `shard_box` follows the
stored data; for `Shard`/`Replicate` it reproduces torch exactly, including the empty-shard
convention offset = dim size.
"""
from __future__ import annotations

import bisect
import functools
import hashlib
import itertools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

Placement = tuple  # ("replicate",) | ("shard", dim) | ("strided_shard", dim, split_factor)

_DTYPE_BYTES = {
    "float64": 8, "double": 8, "float32": 4, "float": 4, "bfloat16": 2, "float16": 2, "half": 2,
    "float8_e4m3fn": 1, "float8_e4m3fnuz": 1, "float8_e5m2": 1, "float8_e5m2fnuz": 1,
    "int64": 8, "long": 8, "int32": 4, "int": 4, "int16": 2, "int8": 1, "uint8": 1, "bool": 1,
}


def dtype_bytes(dtype: str) -> int:
    """Bytes per element of a dtype named as in torch ("bfloat16" or "torch.bfloat16")."""
    name = dtype.removeprefix("torch.")
    if name not in _DTYPE_BYTES:
        raise ValueError(f"unknown dtype {dtype!r}; known: {sorted(_DTYPE_BYTES)}")
    return _DTYPE_BYTES[name]


@dataclass(frozen=True, slots=True)
class Box:
    """An axis-aligned block of a tensor: `offsets[d] <= i_d < offsets[d] + sizes[d]`."""
    offsets: tuple[int, ...]
    sizes: tuple[int, ...]

    @staticmethod
    def full(shape: Sequence[int]) -> Box:
        return Box((0,) * len(shape), tuple(shape))

    @property
    def numel(self) -> int:
        return math.prod(self.sizes)

    @property
    def is_empty(self) -> bool:
        return 0 in self.sizes

    def intersect(self, other: Box) -> Box | None:
        """The common block, or None when the boxes share no element (or either is empty)."""
        if len(self.sizes) != len(other.sizes):
            raise ValueError(f"cannot intersect boxes of rank {len(self.sizes)} and "
                             f"{len(other.sizes)}")
        offs, sizes = [], []
        for a, n, b, m in zip(self.offsets, self.sizes, other.offsets, other.sizes):
            lo, hi = max(a, b), min(a + n, b + m)
            if hi <= lo:
                return None
            offs.append(lo)
            sizes.append(hi - lo)
        return Box(tuple(offs), tuple(sizes))

    def relative_to(self, outer: Box) -> Box:
        """This box in the coordinates of `outer`'s local tensor (it must lie inside `outer`)."""
        offs = tuple(a - b for a, b in zip(self.offsets, outer.offsets))
        if len(offs) != len(self.sizes) or any(
                o < 0 or o + n > m for o, n, m in zip(offs, self.sizes, outer.sizes)):
            raise ValueError(f"{self} does not lie inside {outer}")
        return Box(offs, self.sizes)

    def slices(self) -> tuple[slice, ...]:
        """Index a tensor: `local[piece.relative_to(outer_box).slices()]`."""
        return tuple(slice(o, o + n) for o, n in zip(self.offsets, self.sizes))


@dataclass(frozen=True, slots=True)
class ParamSpec:
    """A parameter's name (as in `named_parameters`), global shape and dtype name."""
    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def itemsize(self) -> int:
        return dtype_bytes(self.dtype)


# ---------------------------------------------------------------------------------------------
# One rank's box: DTensor placement semantics.

def _check_placements(ndim: int, mesh_shape: Sequence[int], placements: Sequence[Placement]):
    if len(placements) != len(mesh_shape):
        raise ValueError(f"{len(placements)} placements {list(placements)} for a mesh of shape "
                         f"{tuple(mesh_shape)}; give one per mesh axis")
    for p in placements:
        ok = (p == ("replicate",) or (len(p) == 2 and p[0] == "shard")
              or (len(p) == 3 and p[0] == "strided_shard" and p[2] >= 1))
        if not ok:
            raise ValueError(f"bad placement {p!r}; use ('replicate',), ('shard', dim) or "
                             "('strided_shard', dim, split_factor)")
        if p[0] != "replicate" and not 0 <= p[1] < ndim:
            raise ValueError(f"placement {p!r} shards dim {p[1]} of a {ndim}-d tensor")


def _axis_order(axes: Sequence[int], placements, mesh_shape) -> list[int]:
    """The order in which the mesh `axes` (all sharding one dim, in mesh order) split it:
    left to right, except that a strided axis waits for the later axes (FSDP2 after TP)."""
    if not axes:
        return []
    first, rest = axes[0], _axis_order(axes[1:], placements, mesh_shape)
    if placements[first][0] != "strided_shard":
        return [first, *rest]
    later = math.prod(mesh_shape[a] for a in axes[1:])
    if placements[first][2] != later:
        raise ValueError(
            f"strided_shard {placements[first]!r} on mesh axis {first}: split_factor must equal "
            f"the product of the later axes' degrees on that dim ({later}); other strided "
            "shardings are not contiguous boxes")
    return [*rest, first]


def shard_box(shape: Sequence[int], mesh_shape: Sequence[int], placements: Sequence[Placement],
              coord: Sequence[int]) -> Box:
    """The box held at mesh coordinate `coord`, as DTensor's
    `compute_local_shape_and_global_offset` computes it (empty shards: size 0, offset = dim size).
    Strided shards follow FSDP2's stored data (see the module docstring)."""
    _check_placements(len(shape), mesh_shape, placements)
    if len(coord) != len(mesh_shape) or any(not 0 <= c < k for c, k in zip(coord, mesh_shape)):
        raise ValueError(f"coordinate {tuple(coord)} is not in a mesh of shape {tuple(mesh_shape)}")
    return _box(shape, mesh_shape, _split_orders(len(shape), mesh_shape, placements), coord)


def _split_orders(ndim: int, mesh_shape, placements) -> list[list[int]]:
    """Per tensor dim: the mesh axes that split it, in the order they apply."""
    return [_axis_order([a for a, p in enumerate(placements) if p[0] != "replicate" and p[1] == d],
                        placements, mesh_shape) for d in range(ndim)]


def _box(shape, mesh_shape, orders: list[list[int]], coord) -> Box:
    offsets, sizes = [], []
    for n, order in zip(shape, orders):
        off, size = 0, n
        for axis in order:
            k, i = mesh_shape[axis], coord[axis]
            chunk = -(-size // k)  # torch.chunk: ceil(n / k) per chunk, trailing ones short/empty
            start = min(chunk * i, size)
            off, size = off + start, max(0, min(size, start + chunk) - start)
        if order and size == 0:
            off = n  # DTensor's convention for an empty shard
        offsets.append(off)
        sizes.append(size)
    return Box(tuple(offsets), tuple(sizes))


# ---------------------------------------------------------------------------------------------
# The distinct boxes of one parameter, indexed for fast intersection.

class Tiling:
    """The distinct non-empty boxes of one parameter, sorted, with the ranks holding each.

    When the boxes form a product of per-dim interval partitions (every DTensor layout does),
    `overlaps` finds the boxes meeting a query box by bisection per dim, so a query costs
    O(log n + hits) instead of a scan over all boxes. `strict=True` also requires the boxes to
    partition the parameter (no gap, no partial overlap) and raises ValueError otherwise.
    """

    def __init__(self, name: str, shape: Sequence[int], held: Mapping[Box, Sequence[int]],
                 strict: bool = True):
        """`held`: box -> ranks holding it, kept in the given order (`Layout.by_param` gives rank
        order, which the planner's tie-breaks rely on)."""
        self.name, self.shape = name, tuple(shape)
        items = [(b, tuple(r)) for b, r in held.items() if not b.is_empty]
        for b, _ in items:
            if len(b.sizes) != len(self.shape):
                raise ValueError(f"param {name!r}: box {b} does not match the rank of its shape "
                                 f"{self.shape}")
        # Sorted by offsets: on a grid, box id = mixed-radix index of its per-dim intervals.
        items.sort(key=lambda it: (it[0].offsets, it[0].sizes))
        self._build_grid([b for b, _ in items])
        self.boxes = [b for b, _ in items]
        self.holders = [r for _, r in items]
        self._check_bounds()
        if strict:
            self._check_partition()

    @functools.cached_property
    def index(self) -> dict[Box, int]:
        """box -> its id (position in `boxes`)."""
        return {b: i for i, b in enumerate(self.boxes)}

    def _build_grid(self, boxes: list[Box]) -> None:
        """Per-dim sorted intervals, if the boxes are a product of per-dim partitions."""
        per_dim = [sorted({(b.offsets[d], b.offsets[d] + b.sizes[d]) for b in boxes})
                   for d in range(len(self.shape))]
        partitions = all(all(a[1] == b[0] for a, b in zip(iv, iv[1:])) for iv in per_dim)
        self.is_grid = bool(boxes) and partitions and len(boxes) == math.prod(map(len, per_dim))
        if self.is_grid:
            self._intervals = per_dim
            self._starts = [[lo for lo, _ in iv] for iv in per_dim]
            self._strides = [math.prod(len(iv) for iv in per_dim[d + 1:])
                             for d in range(len(per_dim))]

    def _check_bounds(self) -> None:
        if self.is_grid:  # the grid's extent is the union of its per-dim intervals
            inside = all(iv[0][0] >= 0 and iv[-1][1] <= n
                         for iv, n in zip(self._intervals, self.shape))
        else:
            inside = all(all(o >= 0 and o + k <= n for o, k, n in
                             zip(b.offsets, b.sizes, self.shape)) for b in self.boxes)
        if not inside:
            raise ValueError(f"param {self.name!r}: boxes {self.boxes[:4]}... reach outside its "
                             f"shape {self.shape}")

    def _check_partition(self) -> None:
        if self.is_grid and all(iv[0][0] == 0 and iv[-1][1] == n
                                for iv, n in zip(self._intervals, self.shape)):
            return
        total, covered = math.prod(self.shape), sum(b.numel for b in self.boxes)
        if not self.is_grid and covered == total and not any(
                a.intersect(b) for a, b in itertools.combinations(self.boxes, 2)):
            return
        raise ValueError(f"param {self.name!r} {self.shape}: the distinct boxes {self.boxes[:6]}"
                         f"{'...' if len(self.boxes) > 6 else ''} do not tile it exactly once "
                         f"(cover {covered} of {total} elements, or overlap partially)")

    def _hits(self, box: Box) -> list[list[tuple[int, int, int]]] | None:
        """Per dim: (interval index, overlap start, overlap length) of the grid intervals."""
        per_dim = []
        for lo, n, iv, starts in zip(box.offsets, box.sizes, self._intervals, self._starts):
            hi, i, hits = lo + n, max(0, bisect.bisect_right(starts, lo) - 1), []
            while i < len(iv) and iv[i][0] < hi:
                a, b = max(iv[i][0], lo), min(iv[i][1], hi)
                if b > a:
                    hits.append((i, a, b - a))
                i += 1
            if not hits:
                return None
            per_dim.append(hits)
        return per_dim

    def overlaps(self, box: Box) -> list[tuple[int, tuple[int, ...], tuple[int, ...]]]:
        """(box id, piece offsets, piece sizes) for every box meeting `box`, in box-id order."""
        if box.is_empty or not self.boxes:
            return []
        if not self.is_grid:
            hits = ((i, box.intersect(b)) for i, b in enumerate(self.boxes))
            return [(i, p.offsets, p.sizes) for i, p in hits if p is not None]
        per_dim = self._hits(box)
        if per_dim is None:
            return []
        strides = self._strides
        return [(sum(c[0] * st for c, st in zip(combo, strides)), tuple(c[1] for c in combo),
                 tuple(c[2] for c in combo)) for combo in itertools.product(*per_dim)]

    def overlap_numels(self, box: Box) -> list[tuple[int, int]]:
        """(box id, piece numel) for every box meeting `box`: `overlaps` without building
        tuples, for the planner's load accounting (usually a single dim has several hits)."""
        if box.is_empty or not self.boxes:
            return []
        if not self.is_grid:
            return [(i, math.prod(s)) for i, _, s in self.overlaps(box)]
        per_dim = self._hits(box)
        if per_dim is None:
            return []
        base, numel, multi = 0, 1, []
        for hits, st in zip(per_dim, self._strides):
            if len(hits) == 1:
                base, numel = base + hits[0][0] * st, numel * hits[0][2]
            else:
                multi.append((hits, st))
        if not multi:
            return [(base, numel)]
        if len(multi) == 1:
            hits, st = multi[0]
            return [(base + i * st, numel * n) for i, _, n in hits]
        return [(base + sum(c[0] * st for c, (_, st) in zip(combo, multi)),
                 numel * math.prod(c[2] for c in combo))
                for combo in itertools.product(*(h for h, _ in multi))]


# ---------------------------------------------------------------------------------------------
# Layout: every rank's box of every parameter.

@dataclass(frozen=True, eq=False)
class Layout:
    """`boxes[rank][param_name] -> Box` for a set of global ranks, plus `replicas`: groups of
    ranks that together hold one full copy of the model (a trainer is usually one replica; a
    generator has one per data-parallel rank, each of tp ranks). Treat as immutable."""
    specs: tuple[ParamSpec, ...]
    ranks: tuple[int, ...]
    boxes: dict[int, dict[str, Box]]
    replicas: tuple[tuple[int, ...], ...]

    def __post_init__(self):
        if set(self.boxes) != set(self.ranks):
            raise ValueError(f"boxes given for ranks {sorted(self.boxes)[:8]}..., "
                             f"layout ranks are {list(self.ranks)[:8]}...")
        flat = sorted(r for rep in self.replicas for r in rep)
        if flat != sorted(self.ranks):
            raise ValueError(f"replicas {[list(r) for r in self.replicas][:4]}... must partition "
                             f"the ranks {list(self.ranks)[:8]}...")

    @classmethod
    def from_placements(cls, specs: Sequence[ParamSpec], ranks: Sequence[int],
                        mesh_shape: Sequence[int], mesh_axis_names: Sequence[str],
                        placements_per_param: Mapping[str, Sequence[Placement]],
                        replica_axis: str | None = None) -> Layout:
        """Pure: `ranks` laid out row-major over `mesh_shape`; each param sharded by its
        placements. Ranks with the same coordinate on `replica_axis` form one replica (None: all
        ranks are one replica)."""
        if len(ranks) != math.prod(mesh_shape) or len(set(ranks)) != len(ranks):
            raise ValueError(f"{len(ranks)} ranks for a mesh of shape {tuple(mesh_shape)} "
                             f"({math.prod(mesh_shape)} distinct ranks needed)")
        if len(mesh_axis_names) != len(mesh_shape):
            raise ValueError(f"axis names {list(mesh_axis_names)} vs mesh shape "
                             f"{tuple(mesh_shape)}: give one name per axis")
        coords = list(itertools.product(*(range(k) for k in mesh_shape)))
        boxes: dict[int, dict[str, Box]] = {r: {} for r in ranks}
        keys_by_axes: dict[tuple[int, ...], list[tuple[int, ...]]] = {}
        for spec in specs:
            if spec.name not in placements_per_param:
                raise ValueError(f"no placements for param {spec.name!r}")
            pl = [tuple(p) for p in placements_per_param[spec.name]]
            _check_placements(len(spec.shape), mesh_shape, pl)
            sharding = tuple(a for a, p in enumerate(pl) if p[0] != "replicate")
            orders = _split_orders(len(spec.shape), mesh_shape, pl)
            if sharding not in keys_by_axes:  # a rank's shard depends only on these coordinates
                keys_by_axes[sharding] = [tuple(c[a] for a in sharding) for c in coords]
            cache: dict[tuple[int, ...], Box] = {}  # one Box object per distinct shard
            for r, c, key in zip(ranks, coords, keys_by_axes[sharding]):
                box = cache.get(key)
                if box is None:
                    box = cache[key] = _box(spec.shape, mesh_shape, orders, c)
                boxes[r][spec.name] = box
        replicas = _replicas_on_axis(ranks, coords, mesh_axis_names, replica_axis,
                                     placements_per_param, specs)
        return cls(tuple(specs), tuple(ranks), boxes, replicas)

    @classmethod
    def from_module(cls, module, group=None) -> Layout:
        """Collective over `group`: derive every rank's boxes from the module's real DTensor
        parameters (FSDP2 `fully_shard` and/or TP `parallelize_module`); plain parameters are
        full boxes. Replicas are derived from the gathered boxes (`replicas_from_boxes`)."""
        import torch
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        specs, mine = [], {}
        with torch.no_grad():
            for name, p in module.named_parameters():
                shape = tuple(p.shape)
                if isinstance(p, DTensor):
                    box = dtensor_box(name, p)
                else:
                    box = Box.full(shape)
                specs.append(ParamSpec(name, shape, str(p.dtype).removeprefix("torch.")))
                mine[name] = (box.offsets, box.sizes)
        ranks = (dist.get_process_group_ranks(group) if group is not None
                 else list(range(dist.get_world_size())))
        gathered: list = [None] * len(ranks)
        dist.all_gather_object(gathered, mine, group=group)
        for r, g in zip(ranks, gathered):
            if list(g) != list(mine):
                raise ValueError(f"rank {r} has params {list(g)[:5]}..., this rank has "
                                 f"{list(mine)[:5]}...: all ranks must hold the same module")
        boxes = {r: {n: Box(*ob) for n, ob in g.items()} for r, g in zip(ranks, gathered)}
        return cls(tuple(specs), tuple(ranks), boxes, replicas_from_boxes(ranks, boxes))

    def replica_of(self, rank: int) -> int:
        """Index into `replicas` of the replica holding `rank`."""
        return self._replica_index[rank]

    @functools.cached_property
    def _replica_index(self) -> dict[int, int]:
        return {r: i for i, rep in enumerate(self.replicas) for r in rep}

    @functools.cached_property
    def spec_by_name(self) -> dict[str, ParamSpec]:
        return {s.name: s for s in self.specs}

    @functools.cached_property
    def by_param(self) -> dict[str, dict[Box, list[int]]]:
        """param -> distinct box -> ranks holding it (in rank order)."""
        out: dict[str, dict[Box, list[int]]] = {s.name: {} for s in self.specs}
        for r in sorted(self.ranks):
            for name, box in self.boxes[r].items():
                held = out.get(name)
                if held is None:
                    held = out[name] = {}
                ranks = held.get(box)
                if ranks is None:
                    held[box] = [r]
                else:
                    ranks.append(r)
        return out

    @functools.cached_property
    def key(self) -> str:
        """A stable digest of the layout (same on every process), used to cache plans."""
        h = hashlib.sha1()
        h.update(repr((self.specs, self.replicas)).encode())
        for name, held in sorted(self.by_param.items()):
            h.update(repr((name, [(b.offsets, b.sizes, r) for b, r in held.items()])).encode())
        return h.hexdigest()


def dtensor_box(name: str, p) -> Box:
    """This rank's box of DTensor parameter `p`, checked against its local tensor."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    placements = []
    for pl in p.placements:
        if isinstance(pl, _StridedShard):
            placements.append(("strided_shard", pl.dim, pl.split_factor))
        elif isinstance(pl, Shard):
            placements.append(("shard", pl.dim))
        elif isinstance(pl, Replicate):
            placements.append(("replicate",))
        else:
            raise ValueError(f"param {name!r}: placement {pl} is not Shard/Replicate; a layout "
                             "needs materialised values (no Partial)")
    coord = p.device_mesh.get_coordinate()
    if coord is None:
        raise ValueError(f"param {name!r}: this rank is not in its mesh {p.device_mesh}")
    box = shard_box(tuple(p.shape), tuple(p.device_mesh.shape), placements, coord)
    local = tuple(p.to_local().shape)
    if box.sizes != local:
        raise AssertionError(f"param {name!r}: computed box {box} but local shard is {local} "
                             f"(placements {p.placements}, mesh {tuple(p.device_mesh.shape)})")
    return box


def local_box(name: str, p) -> Box:
    """This rank's box of any parameter: a DTensor's shard, or the whole of a plain tensor."""
    from torch.distributed.tensor import DTensor
    return dtensor_box(name, p) if isinstance(p, DTensor) else Box.full(tuple(p.shape))


def _replicas_on_axis(ranks, coords, axis_names, replica_axis, placements_per_param, specs):
    if replica_axis is None:
        return (tuple(ranks),)
    if replica_axis not in axis_names:
        raise ValueError(f"replica_axis {replica_axis!r} is not a mesh axis {list(axis_names)}")
    a = list(axis_names).index(replica_axis)
    for s in specs:
        if placements_per_param[s.name][a][0] != "replicate":
            raise ValueError(f"param {s.name!r} is sharded on the replica axis {replica_axis!r}")
    groups: dict[int, list[int]] = {}
    for r, c in zip(ranks, coords):
        groups.setdefault(c[a], []).append(r)
    return tuple(tuple(g) for _, g in sorted(groups.items()))


def replicas_from_boxes(ranks: Sequence[int], boxes: Mapping[int, Mapping[str, Box]]):
    """Group ranks into replicas from their boxes: ranks with identical boxes for every param are
    copies of each other (the replicate axes of the mesh). With k copies in every class, replica
    i takes the i-th rank (in rank order) of each class; otherwise all ranks form one replica."""
    classes: dict[tuple, list[int]] = {}
    for r in sorted(ranks):
        classes.setdefault(tuple(sorted(boxes[r].items(), key=lambda kv: kv[0])), []).append(r)
    sizes = {len(c) for c in classes.values()}
    if len(sizes) != 1:
        return (tuple(sorted(ranks)),)
    k = sizes.pop()
    return tuple(tuple(sorted(c[i] for c in classes.values())) for i in range(k))


def coverage_check(layout: Layout, specs: Sequence[ParamSpec]) -> None:
    """Each replica's boxes cover each full param exactly once (identical boxes on several ranks
    of a replica are copies, e.g. TP-replicated norms). AssertionError names the param."""
    for rep in layout.replicas:
        for spec in specs:
            held: dict[Box, list[int]] = {}
            for r in rep:
                if spec.name not in layout.boxes[r]:
                    raise AssertionError(f"rank {r} has no box for param {spec.name!r}")
                held.setdefault(layout.boxes[r][spec.name], []).append(r)
            try:
                Tiling(spec.name, spec.shape, held, strict=True)
            except ValueError as e:
                raise AssertionError(f"replica {list(rep)[:8]}: {e}") from None
