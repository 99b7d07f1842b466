"""The byte stream of one (src rank, dst rank) pair, cut into buckets.

Both ends derive it from the same plan: the transfers of the pair, in plan order, each flattened
row-major in the destination dtype, concatenated. The sender fills one bucket at a time from its
live shard (casting on the way: fp32 master -> bf16 generator weights happens before bytes move);
the receiver lands the whole stream in one flat staging buffer and later scatters it into its
parameters in one atomic swap.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from parallel.layout import Box


@dataclass(frozen=True)
class Segment:
    param: str
    box: Box  # in the local shard of whichever end reads this segment
    start: int  # element offset in the pair's stream
    numel: int


def segments(transfers, side: str) -> list[Segment]:
    """`side` = "src" (boxes in the sender's shard) or "dst" (in the receiver's shard)."""
    out, start = [], 0
    for t in transfers:
        box = t.src_box if side == "src" else t.dst_box
        out.append(Segment(t.param, box, start, box.numel))
        start += box.numel
    return out


def stream_numel(segs: list[Segment]) -> int:
    return segs[-1].start + segs[-1].numel if segs else 0


def buckets(total: int, bucket_numel: int) -> list[tuple[int, int]]:
    """[start, end) element ranges of the buckets of a stream of `total` elements."""
    return [(s, min(s + bucket_numel, total)) for s in range(0, total, max(1, bucket_numel))]


def fill(bucket: torch.Tensor, lo: int, hi: int, segs: list[Segment], tensors: dict) -> None:
    """Copy stream elements [lo, hi) from local shards into `bucket[: hi - lo]` (with cast)."""
    for seg in segs:
        a, b = max(lo, seg.start), min(hi, seg.start + seg.numel)
        if a >= b:
            continue
        at = a - lo
        for piece in _flat_range(tensors[seg.param][seg.box.slices()], a - seg.start, b - seg.start):
            bucket[at:at + piece.numel()].view(piece.shape).copy_(piece)
            at += piece.numel()


def _flat_range(view: torch.Tensor, a: int, b: int) -> list[torch.Tensor]:
    """Views of `view` whose row-major concatenation is `view.reshape(-1)[a:b]`, copying nothing.
    Flattening a box that is not contiguous in its shard (a column block) copies the whole box:
    once per bucket, that was quadratic in the box size. Here: a partial first row, the full rows
    between, a partial last row (the partial rows recursively, for boxes of 3+ dims)."""
    if view.is_contiguous() or view.dim() <= 1:
        return [view.reshape(-1)[a:b]]  # a view in both cases
    row = view[0].numel()
    first, last = -(-a // row), b // row  # the full rows are [first, last)
    if first > last:  # [a, b) lies inside row `last`
        return _flat_range(view[last], a - last * row, b - last * row)
    out = _flat_range(view[first - 1], a - (first - 1) * row, row) if a % row else []
    if last > first:
        out.append(view[first:last])
    if b % row:
        out += _flat_range(view[last], 0, b - last * row)
    return out


def scatter(flat: torch.Tensor, segs: list[Segment], tensors: dict) -> None:
    """Copy a received stream into the receiver's local parameter tensors."""
    for seg in segs:
        part = flat[seg.start:seg.start + seg.numel]
        tensors[seg.param][seg.box.slices()].copy_(part.view(seg.box.sizes))


def part_views(flat: torch.Tensor, segs: list[Segment]) -> list[torch.Tensor]:
    """Each segment's part of a stream buffer, shaped like its box (views, built once for a
    persistent buffer)."""
    return [flat[seg.start:seg.start + seg.numel].view(seg.box.sizes) for seg in segs]


def box_views(segs: list[Segment], tensors: dict) -> list[torch.Tensor]:
    """Each segment's box in its local shard (views, built once for persistent shards)."""
    return [tensors[seg.param][seg.box.slices()] for seg in segs]


def copy_all(dsts: list[torch.Tensor], srcs: list[torch.Tensor], foreach: bool = True) -> None:
    """dst <- src (with cast) for every pair: one multi-tensor copy (`foreach`: a few launches
    for all the parameters), or one copy per pair (on CUDA a plain memcpy each, which may move
    large tensors faster; bench/weights_sync.py times both)."""
    if foreach and dsts:
        torch._foreach_copy_(dsts, srcs)
    elif not foreach:
        for d, s in zip(dsts, srcs):
            d.copy_(s)


def messages(segs: list[Segment], bucket_numel: int, small_numel: int) -> list[tuple[int, int]]:
    """[start, end) element ranges of the point-to-point messages of a pair's stream.

    A segment of at least `small_numel` elements travels alone (cut every `bucket_numel`), so a
    sender whose box is contiguous in its shard and already in the wire dtype can hand the
    shard's memory to the transport without a copy; runs of smaller segments are packed into
    messages of at most `bucket_numel`. Both ends derive the same ranges from the plan."""
    bucket_numel = max(1, bucket_numel)
    out: list[tuple[int, int]] = []
    run = None  # start of the current run of small segments
    for seg in segs:
        lo, hi = seg.start, seg.start + seg.numel
        if seg.numel >= small_numel:
            if run is not None and run < lo:
                out.append((run, lo))
            run = None
            out.extend((a, min(a + bucket_numel, hi)) for a in range(lo, hi, bucket_numel))
            continue
        run = lo if run is None else run
        while hi - run > bucket_numel:
            out.append((run, run + bucket_numel))
            run += bucket_numel
    if run is not None and segs and run < stream_numel(segs):
        out.append((run, stream_numel(segs)))
    return out
