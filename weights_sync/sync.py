"""Versioned shard-to-shard weight sync (LlamaRL's DDMA) over a point-to-point transport.

Trainer side, `WeightSender.push(v)`:
  1. waits only if version v-1 is still streaming (with a timeout naming the peers and version);
  2. starts a background stream: for every destination peer in plan order, fill a bucket from the
     live shard (cast to the generator dtype), send it, and reuse the bucket once it is received
     (two buckets per stream: staging never exceeds 2 x bucket_bytes per peer being served);
  3. returns at once. The trainer calls `wait_sent()` before its next `optimizer.step()`, so the
     streamed weights are exactly version v: the transfer overlaps the next forward/backward.
Generator side, `WeightReceiver.receive(v)`:
  posts every receive of version v at once into one flat staging buffer per source peer (so a
  receiver never blocks a sender), waits with a timeout, and returns `apply()`, which copies the
  staging into the parameters. The engine calls it between two steps: a model never mixes versions.

Transports: gloo (CPU tensors) and NCCL (CUDA tensors, different GPUs) share this code through
`torch.distributed` isend/irecv on a dedicated process group; processes on the *same* GPU use
CUDA IPC (weights_sync/ipc.py).
"""
from __future__ import annotations

import threading
import time
from datetime import timedelta

import torch
import torch.distributed as dist

from parallel.layout import local_box  # noqa: F401  (re-exported for executors)
from weights_sync import stream

TAG_WEIGHTS = 21


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def local_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """param name -> this rank's local shard (a view: writes go into the model)."""
    return {n: _local(p.data) for n, p in model.named_parameters()}


def _wait(work, timeout_s: float, what: str) -> None:
    try:
        work.wait(timeout=timedelta(seconds=timeout_s))
    except RuntimeError as e:
        raise TimeoutError(f"weight sync timed out after {timeout_s:.0f}s waiting for {what} ({e})") from None


class WeightSender:
    def __init__(self, model, plan, rank: int, dtype: torch.dtype, group, timeout_s: float,
                 bucket_bytes: int = 64 << 20, device: torch.device | None = None):
        self.rank, self.dtype, self.group, self.timeout_s = rank, dtype, group, timeout_s
        self.tensors = local_tensors(model)
        self.device = device or next(iter(self.tensors.values())).device
        self.bucket_numel = max(1, bucket_bytes // torch.empty((), dtype=dtype).element_size())
        self.peers = {d: stream.segments(ts, "src") for d, ts in plan.sends_from(rank).items()}
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self._version = -1
        self.history: list[dict] = []  # bytes, seconds, GB/s per version

    def push(self, version: int) -> None:
        self.wait_sent()
        self._version, self._error = version, None
        self._thread = threading.Thread(target=self._stream_all, args=(version,), daemon=True,
                                        name=f"weights-v{version}")
        self._thread.start()

    def wait_sent(self) -> None:
        """Block until the version in flight is fully received (before touching the params)."""
        if self._thread is None:
            return
        self._thread.join(self.timeout_s)
        if self._thread.is_alive():
            raise TimeoutError(f"trainer rank {self.rank}: weight version {self._version} still not "
                               f"received after {self.timeout_s:.0f}s by generator ranks "
                               f"{sorted(self.peers)}")
        self._thread = None
        if self._error is not None:
            raise self._error

    def _stream_all(self, version: int) -> None:
        t0, nbytes = time.perf_counter(), 0
        try:
            with torch.no_grad():
                for dst, segs in self.peers.items():
                    nbytes += self._stream(dst, segs, version)
        except BaseException as e:  # surfaced by wait_sent on the trainer thread
            self._error = e
            return
        dt = time.perf_counter() - t0
        self.history.append({"version": version, "bytes": nbytes, "seconds": dt,
                             "gbps": nbytes / dt / 1e9 if dt > 0 else 0.0})

    def _stream(self, dst: int, segs, version: int) -> int:
        # A one-element header carries the version, so a receiver can never apply bytes of a
        # version other than the one it was told about (NCCL has no message tags to tell them apart).
        header = torch.tensor([version], dtype=torch.int64, device=self.device)
        head_work = dist.isend(header, dst, group=self.group, tag=TAG_WEIGHTS)
        total = stream.stream_numel(segs)
        pool = [torch.empty(min(self.bucket_numel, total), dtype=self.dtype, device=self.device)
                for _ in range(2)]
        pending: list = [None, None]
        for i, (lo, hi) in enumerate(stream.buckets(total, self.bucket_numel)):
            k = i % 2
            if pending[k] is not None:
                _wait(pending[k], self.timeout_s, f"generator rank {dst} to receive version {version}")
            stream.fill(pool[k], lo, hi, segs, self.tensors)
            pending[k] = dist.isend(pool[k][:hi - lo], dst, group=self.group, tag=TAG_WEIGHTS)
        for w in (head_work, *pending):
            if w is not None:
                _wait(w, self.timeout_s, f"generator rank {dst} to receive version {version}")
        return total * pool[0].element_size() if total else 0

    def close(self) -> None:
        self.wait_sent()


class WeightReceiver:
    def __init__(self, model, plan, rank: int, group, timeout_s: float,
                 bucket_bytes: int = 64 << 20):
        self.rank, self.group, self.timeout_s = rank, group, timeout_s
        self.tensors = local_tensors(model)
        some = next(iter(self.tensors.values()))
        self.dtype, self.device = some.dtype, some.device
        self.bucket_numel = max(1, bucket_bytes // some.element_size())
        self.peers = {s: stream.segments(ts, "dst") for s, ts in plan.recvs_to(rank).items()}
        # One flat staging buffer per source: the generator holds its shard plus one staged copy.
        self.staging = {s: torch.empty(stream.stream_numel(segs), dtype=self.dtype, device=self.device)
                        for s, segs in self.peers.items()}
        self.history: list[dict] = []

    def receive(self, version: int):
        """Receive all of `version` into staging; return `apply()` for the engine's safe point."""
        t0 = time.perf_counter()
        # Post every receive (headers, then all buckets) before waiting on any: a receiver that
        # waited on one sender before posting for the others could close a cycle of waits.
        heads = {s: torch.empty(1, dtype=torch.int64, device=self.device) for s in self.staging}
        works = []
        for src, flat in self.staging.items():
            works.append((src, dist.irecv(heads[src], src, group=self.group, tag=TAG_WEIGHTS)))
            for lo, hi in stream.buckets(flat.numel(), self.bucket_numel):
                works.append((src, dist.irecv(flat[lo:hi], src, group=self.group, tag=TAG_WEIGHTS)))
        for src, w in works:
            _wait(w, self.timeout_s, f"weights version {version} from trainer rank {src}")
        for src, h in heads.items():
            if int(h) != version:
                raise RuntimeError(f"generator rank {self.rank} expected weights version {version} "
                                   f"but trainer rank {src} sent version {int(h)}")
        nbytes = sum(f.numel() * f.element_size() for f in self.staging.values())
        dt = time.perf_counter() - t0
        self.history.append({"version": version, "bytes": nbytes, "seconds": dt,
                             "gbps": nbytes / dt / 1e9 if dt > 0 else 0.0})
        return self._apply

    @torch.no_grad()
    def _apply(self) -> None:
        for src, segs in self.peers.items():
            stream.scatter(self.staging[src], segs, self.tensors)


def exchange_layouts(layout, is_src_leader: bool, is_dst_leader: bool):
    """Start-up only (a world collective, before any cross-mesh traffic): every rank learns both
    layouts. Each mesh derived its own from the real DTensors with `Layout.from_module` over its
    own group; its first rank contributes it here."""
    mine = ("src" if is_src_leader else "dst" if is_dst_leader else None, layout)
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, mine if mine[0] else (None, None))
    found = {side: lay for side, lay in gathered if side is not None}
    if set(found) != {"src", "dst"}:
        raise RuntimeError(f"layout exchange got sides {sorted(found)}; expected one trainer and one "
                           f"generator leader")
    return found["src"], found["dst"]


def transfer_specs(src, dst):
    """Parameters that move: the generator's parameters (a tied head is shared, so stored once)."""
    names = {s.name for s in dst.specs}
    return [s for s in src.specs if s.name in names]
