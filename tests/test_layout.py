"""parallel.layout: boxes reproduce DTensor / FSDP2 sharding exactly, replicas tile every param,
and `Layout.from_module` on real FSDP2 + TP parameters (4 gloo ranks) equals the pure layout."""
from __future__ import annotations

import itertools
import random

import pytest
import torch
from torch.distributed.tensor._utils import _compute_local_shape_and_global_offset
from torch.distributed.tensor.placement_types import Replicate, Shard

from parallel.layout import Box, Layout, ParamSpec, Tiling, coverage_check, replicas_from_boxes, shard_box
from tests.dist import run_ranks


def _chunk(lo: int, n: int, k: int, i: int) -> tuple[int, int]:
    """torch.chunk's i-th of k chunks of [lo, lo + n), as (start, size); missing chunks empty."""
    idx = torch.arange(lo, lo + n)
    parts = list(torch.chunk(idx, k)) if n else []
    part = parts[i] if i < len(parts) else idx[:0]
    return (int(part[0]) if len(part) else None), len(part)


# ------------------------------------------------------------------------------------------ Box

def test_box_helpers():
    a, b = Box((0, 2), (4, 3)), Box((2, 4), (5, 5))
    assert a.numel == 12 and not a.is_empty and Box((3,), (0,)).is_empty
    assert a.intersect(b) == Box((2, 4), (2, 1))
    assert a.intersect(Box((4, 0), (1, 9))) is None  # touching, not overlapping
    assert a.intersect(Box((1, 1), (0, 9))) is None  # empty
    assert Box((2, 4), (2, 1)).relative_to(a) == Box((2, 2), (2, 1))
    with pytest.raises(ValueError, match="does not lie inside"):
        b.relative_to(a)
    assert Box.full((3, 5)) == Box((0, 0), (3, 5)) and Box.full(()).numel == 1
    t = torch.arange(12).view(4, 3)
    assert t[Box((1, 1), (2, 2)).slices()].tolist() == [[4, 5], [7, 8]]


# ------------------------------------------------------------------------------ shard_box

def test_shard_box_matches_torch_dtensor():
    """Shard/Replicate placements, several axes on one dim, uneven and empty shards: exactly
    torch's `_compute_local_shape_and_global_offset` (sizes and offsets)."""
    rng = random.Random(0)
    for _ in range(600):
        shape = tuple(rng.randint(0, 9) for _ in range(rng.randint(1, 3)))
        mesh = tuple(rng.randint(1, 4) for _ in range(rng.randint(1, 3)))
        pl = [("replicate",) if rng.random() < 0.3 else ("shard", rng.randrange(len(shape)))
              for _ in mesh]
        coord = tuple(rng.randrange(k) for k in mesh)
        torch_pl = [Replicate() if p[0] == "replicate" else Shard(p[1]) for p in pl]
        sizes, offsets = _compute_local_shape_and_global_offset(shape, mesh, list(coord), torch_pl)
        box = shard_box(shape, mesh, pl, coord)
        assert (box.sizes, box.offsets) == (tuple(sizes), tuple(offsets)), (shape, mesh, pl, coord)


def test_strided_shard_is_fsdp2_storage():
    """("strided_shard", 0, tp) on the fsdp axis + ("shard", 0) on tp: FSDP2 chunks the TP-local
    chunk, i.e. chunk_fsdp(chunk_tp(rows)); torch's offset formula agrees only when even."""
    rng = random.Random(1)
    for _ in range(300):
        n, fs, tp = rng.randint(0, 17), rng.randint(1, 4), rng.randint(2, 4)
        pl = [("strided_shard", 0, tp), ("shard", 0)]
        for f, t in itertools.product(range(fs), range(tp)):
            start, size = _chunk(0, n, tp, t)
            start, size = _chunk(start or 0, size, fs, f)
            box = shard_box((n, 3), (fs, tp), pl, (f, t))
            assert box.sizes == (size, 3) and (size == 0 or box.offsets[0] == start), (n, fs, tp, f, t)
            if n % (fs * tp) == 0:
                from torch.distributed.tensor.placement_types import _StridedShard
                sizes, offsets = _compute_local_shape_and_global_offset(
                    (n, 3), (fs, tp), [f, t], [_StridedShard(0, split_factor=tp), Shard(0)])
                assert (box.sizes, box.offsets) == (tuple(sizes), tuple(offsets))


def test_dcp_offsets_of_uneven_strided_shards():
    """Where torch's DTensor offsets (which torch.distributed.checkpoint writes and reads by) part
    from FSDP2's storage of a strided shard: only where tp does not divide the dim and fsdp >= 3.
    `ParallelDims._check_vocab` refuses exactly those trainer layouts for the vocabulary."""
    from torch.distributed.tensor.placement_types import _StridedShard

    def torch_agrees(n, fs, tp):
        pl, torch_pl = [("strided_shard", 0, tp), ("shard", 0)], [_StridedShard(0, split_factor=tp), Shard(0)]
        for f, t in itertools.product(range(fs), range(tp)):
            box = shard_box((n, 3), (fs, tp), pl, (f, t))
            sizes, offsets = _compute_local_shape_and_global_offset((n, 3), (fs, tp), [f, t], torch_pl)
            if box.sizes != tuple(sizes) or (box.sizes[0] and box.offsets != tuple(offsets)):
                return False
        return True
    for n, fs, tp in itertools.product(range(1, 120), range(2, 5), range(2, 5)):
        if fs == 2 or n % tp == 0:
            assert torch_agrees(n, fs, tp), (n, fs, tp)
    assert not torch_agrees(97, 3, 2)  # the tiny models' vocabulary on a 6-rank trainer


def test_shard_box_rejects_bad_input():
    with pytest.raises(ValueError, match="placements"):
        shard_box((4,), (2, 2), [("shard", 0)], (0, 0))
    with pytest.raises(ValueError, match="dim 1"):
        shard_box((4,), (2,), [("shard", 1)], (0,))
    with pytest.raises(ValueError, match="split_factor"):
        shard_box((8,), (2, 2), [("strided_shard", 0, 4), ("shard", 0)], (0, 0))
    with pytest.raises(ValueError, match="coordinate"):
        shard_box((8,), (2,), [("shard", 0)], (2,))


# ------------------------------------------------------------------------ property: coverage

def _random_case(rng: random.Random):
    """A random mesh, param shapes (uneven, zero-size dims) and placements, some strided."""
    mesh = tuple(rng.randint(1, 4) for _ in range(rng.randint(1, 3)))
    names = [f"axis{a}" for a in range(len(mesh))]
    replica_axis = rng.choice([None, *names])
    specs, placements = [], {}
    for i in range(rng.randint(1, 3)):
        shape = tuple(rng.randint(0, 11) for _ in range(rng.randint(0, 3)))
        pl = []
        for a in range(len(mesh)):
            if names[a] == replica_axis or not shape or rng.random() < 0.3:
                pl.append(("replicate",))
            else:
                pl.append(("shard", 0 if rng.random() < 0.5 else rng.randrange(len(shape))))
        for a, p in enumerate(pl):  # FSDP2-style: strided before later axes on the same dim
            later = [b for b in range(a + 1, len(mesh)) if pl[b][0] != "replicate" and pl[b][1] == p[-1]]
            if p[0] == "shard" and later and rng.random() < 0.7:
                pl[a] = ("strided_shard", p[1], 1)
        for a, p in enumerate(pl):
            if p[0] == "strided_shard":
                later = [b for b in range(a + 1, len(mesh)) if pl[b][0] != "replicate" and pl[b][1] == p[1]]
                pl[a] = ("strided_shard", p[1], int(torch.tensor([mesh[b] for b in later]).prod()))
        specs.append(ParamSpec(f"p{i}", shape, "float32"))
        placements[f"p{i}"] = pl
    return mesh, names, replica_axis, specs, placements


def test_replicas_cover_each_param_exactly_once_property():
    """~300 random layouts: every replica holds every element of every param, and any element
    held twice within a replica is held by identical boxes (copies), checked by counting."""
    rng = random.Random(2)
    for case in range(300):
        mesh, names, replica_axis, specs, placements = _random_case(rng)
        ranks = list(range(100, 100 + int(torch.tensor(mesh).prod())))
        layout = Layout.from_placements(specs, ranks, mesh, names, placements, replica_axis)
        coverage_check(layout, specs)
        for rep in layout.replicas:
            for spec in specs:
                count = torch.zeros(spec.shape, dtype=torch.int32)
                for box in {layout.boxes[r][spec.name] for r in rep}:
                    count[box.slices()] += 1
                assert bool((count == 1).all()), (case, mesh, placements[spec.name], spec)


def test_coverage_check_names_the_param():
    spec = ParamSpec("w", (6, 4), "float32")
    gap = Layout((spec,), (0, 1), {0: {"w": Box((0, 0), (3, 4))}, 1: {"w": Box((4, 0), (2, 4))}},
                 ((0, 1),))
    with pytest.raises(AssertionError, match="'w'"):
        coverage_check(gap, [spec])
    overlap = Layout((spec,), (0, 1), {0: {"w": Box((0, 0), (4, 4))}, 1: {"w": Box((3, 0), (3, 4))}},
                     ((0, 1),))
    with pytest.raises(AssertionError, match="'w'"):
        coverage_check(overlap, [spec])
    copies = Layout((spec,), (0, 1), {0: {"w": Box.full((6, 4))}, 1: {"w": Box.full((6, 4))}},
                    ((0, 1),))
    coverage_check(copies, [spec])


def test_tiling_overlaps_grid_and_generic():
    """The bisection index finds the same pieces as brute force, grid or not."""
    rng = random.Random(3)
    for _ in range(100):
        mesh, names, _, specs, placements = _random_case(rng)
        ranks = list(range(int(torch.tensor(mesh).prod())))
        layout = Layout.from_placements(specs, ranks, mesh, names, placements, None)
        for spec in specs:
            t = Tiling(spec.name, spec.shape, layout.by_param[spec.name])
            q = Box(tuple(rng.randint(0, max(0, n - 1)) for n in spec.shape),
                    tuple(rng.randint(0, n) for n in spec.shape))
            brute = [(i, p.offsets, p.sizes) for i, b in enumerate(t.boxes)
                     if (p := q.intersect(b)) is not None]
            assert t.overlaps(q) == brute
            assert t.overlap_numels(q) == [(i, Box(o, s).numel) for i, o, s in brute]
    l_shape = {Box((0, 0), (2, 3)): [0], Box((0, 3), (2, 1)): [1], Box((2, 0), (2, 1)): [2],
               Box((2, 1), (2, 3)): [3]}
    t = Tiling("l", (4, 4), l_shape)
    assert not t.is_grid and [i for i, _, _ in t.overlaps(Box((1, 0), (2, 4)))] == [0, 1, 2, 3]


def test_from_placements_replicas_and_errors():
    specs = [ParamSpec("w", (10, 6), "bfloat16"), ParamSpec("norm", (7,), "bfloat16")]
    pl = {"w": [("replicate",), ("shard", 0)], "norm": [("replicate",), ("replicate",)]}
    gen = Layout.from_placements(specs, [8, 9, 10, 11, 12, 13], (3, 2), ("dp", "tp"), pl, "dp")
    assert gen.replicas == ((8, 9), (10, 11), (12, 13)) and gen.replica_of(11) == 1
    assert replicas_from_boxes(gen.ranks, gen.boxes) == gen.replicas
    assert gen.boxes[11]["w"] == Box((5, 0), (5, 6))
    with pytest.raises(ValueError, match="replica axis"):
        Layout.from_placements(specs, [0, 1, 2, 3], (2, 2), ("dp", "tp"), pl, "tp")
    with pytest.raises(ValueError, match="ranks"):
        Layout.from_placements(specs, [0, 1, 2], (2, 2), ("dp", "tp"), pl, "dp")
    with pytest.raises(ValueError, match="'norm'"):
        Layout.from_placements(specs, [0, 1, 2, 3], (2, 2), ("dp", "tp"), {"w": pl["w"]}, "dp")


# ------------------------------------------------------------------ real FSDP2 + TP, 4 ranks

TRAINER_PLACEMENTS = {  # mesh (fsdp=2, tp=2): what FSDP2 over TP emits, in layout terms
    "0.weight": [("strided_shard", 0, 2), ("shard", 0)], "0.bias": [("strided_shard", 0, 2), ("shard", 0)],
    "1.weight": [("shard", 0), ("shard", 1)], "1.bias": [("shard", 0), ("replicate",)],
    "2.weight": [("strided_shard", 0, 2), ("shard", 0)], "3.weight": [("shard", 0), ("replicate",)],
}
GENERATOR_PLACEMENTS = {  # mesh (dp=2, tp=2), TP only
    "0.weight": [("replicate",), ("shard", 0)], "0.bias": [("replicate",), ("shard", 0)],
    "1.weight": [("replicate",), ("shard", 1)], "1.bias": [("replicate",), ("replicate",)],
    "2.weight": [("replicate",), ("shard", 0)], "3.weight": [("replicate",), ("replicate",)],
}


def _toy_module() -> torch.nn.Module:
    torch.manual_seed(0)  # identical full weights on every rank
    return torch.nn.Sequential(torch.nn.Linear(7, 10), torch.nn.Linear(10, 5),
                               torch.nn.Embedding(11, 6), torch.nn.LayerNorm(5, bias=False))


def _from_module_worker(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

    tp_plan = {"0": ColwiseParallel(), "1": RowwiseParallel(), "2": RowwiseParallel()}
    out = {}
    for role, names in (("trainer", ("fsdp", "tp")), ("generator", ("dp", "tp"))):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=names)
        model = _toy_module()
        full = {k: v.detach().clone() for k, v in model.named_parameters()}
        parallelize_module(model, mesh["tp"], tp_plan)
        if role == "trainer":
            fully_shard(model, mesh=mesh["fsdp"])
        layout = Layout.from_module(model)
        for name, p in model.named_parameters():
            box = layout.boxes[rank][name]
            local = p.to_local() if isinstance(p, DTensor) else p
            assert torch.equal(local.detach(), full[name][box.slices()]), (role, name, box)
            if isinstance(p, DTensor):  # torch agrees here: 2 x 2 splits of these dims
                sizes, offsets = compute_local_shape_and_global_offset(p.shape, p.device_mesh,
                                                                      p.placements)
                assert (box.sizes, box.offsets) == (tuple(sizes), tuple(offsets)), (role, name)
        out[role] = {"boxes": {r: {n: (b.offsets, b.sizes) for n, b in bs.items()}
                               for r, bs in layout.boxes.items()},
                     "replicas": [list(r) for r in layout.replicas],
                     "specs": [(s.name, s.shape, s.dtype) for s in layout.specs]}
    return out


@pytest.mark.slow
def test_from_module_fsdp2_tp_matches_pure_layout():
    """4 gloo ranks, mesh (fsdp=2, tp=2): FSDP2 + TP on Linear(7,10) colwise, Linear(10,5)
    rowwise, Embedding(11,6) rowwise, LayerNorm(5) plain; and TP-only on mesh (dp=2, tp=2)."""
    results = run_ranks(_from_module_worker, 4, timeout=120)
    for role, placements, axes, replica_axis in (
            ("trainer", TRAINER_PLACEMENTS, ("fsdp", "tp"), None),
            ("generator", GENERATOR_PLACEMENTS, ("dp", "tp"), "dp")):
        specs = [ParamSpec(n, tuple(s), d) for n, s, d in results[0][role]["specs"]]
        pure = Layout.from_placements(specs, [0, 1, 2, 3], (2, 2), axes, placements, replica_axis)
        for res in results:  # every rank assembled the same, complete layout
            got = {r: {n: Box(tuple(o), tuple(s)) for n, (o, s) in bs.items()}
                   for r, bs in res[role]["boxes"].items()}
            assert got == pure.boxes, role
            assert [tuple(r) for r in res[role]["replicas"]] == list(pure.replicas), role
        coverage_check(pure, specs)
