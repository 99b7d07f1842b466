"""Versioned shard-to-shard weight sync (LlamaRL's DDMA) over a point-to-point transport.

Trainer side, `WeightSender.push(v)`:
  1. waits only if version v-1 is still streaming (with a timeout naming the peers and version);
  2. starts a background stream: every peer's header first, then for every destination peer in
     plan order, the pair's messages (`stream.messages`, derived from the plan by both ends
     alike). A piece that is contiguous in the live shard and already in the generator dtype goes
     straight from the shard (no copy: fp32 -> fp32 FSDP row shards); the rest (casts, column
     blocks, runs of small norms/biases) is filled into one of two persistent buckets, reused
     once received;
  3. returns at once. The trainer calls `wait_sent()` before its next `optimizer.step()`, so the
     streamed weights are exactly version v (and the shard memory handed to the transport stays
     unchanged until it is sent): the transfer overlaps the next forward/backward.
Generator side, `WeightReceiver.receive(v)`:
  posts every receive of version v into one flat staging buffer per source peer (so a receiver
  never blocks a sender), waits with a timeout, checks each source's header (version, wire dtype,
  stream length, bucket size), and returns `apply()`, which copies the staging into the
  parameters. The engine calls it between two steps: a model never mixes versions. The first
  version's headers are checked before its bytes are posted, so a sender of another dtype or
  bucket size than the generator's is refused by name before any of its bytes lands (bf16 bits
  read as fp16 were applied silently, smaller buckets left most of a buffer stale, and fp32 into
  bf16 buffers aborted the generator in gloo: "Received data size doesn't match expected size").

Transports: gloo (CPU tensors) and NCCL (CUDA tensors, different GPUs) share this code through
`torch.distributed` isend/irecv on a dedicated process group; processes on the *same* GPU use
CUDA IPC (weights_sync/ipc.py). `make_sender` / `make_receiver` pick the transport per peer from
the placement (`Meshes.gpu_of`) and combine both kinds when a rank has peers of each.
"""
from __future__ import annotations

import bisect
import threading
import time
import zlib
from collections import deque
from collections.abc import Collection, Mapping
from datetime import timedelta

import torch
import torch.distributed as dist

from parallel.mesh import gpu_key, is_timeout, same_gpu, shared_host_memory
from weights_sync import stream

TAG_WEIGHTS = 21
# int64 header of every (sender, receiver) pair and version: (version, wire dtype, stream numel,
# bucket numel); see `header`
HEADER_NUMEL = 4
# versions whose transfer stats (`history`) a sender or receiver keeps: a run of 100k steps kept
# them all, one dict a version, read by nobody past the last few
HISTORY = 64


def small_numel(bucket_numel: int) -> int:
    """Pieces below this travel packed into buckets; larger ones alone, without a copy where
    possible (stream.messages). A 64 MiB bucket gives 256 KiB: only norms and biases get packed,
    and a message costs tens of microseconds, so their count stays negligible."""
    return max(1, bucket_numel // 256)


def _dtype_code(dtype: torch.dtype) -> int:
    """A number for `dtype` that every process computes alike (Python's str hash is salted)."""
    return zlib.crc32(str(dtype).encode())


def _code_name(code: int) -> str:
    known = (torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.float8_e4m3fn,
             torch.float8_e5m2)
    return next((str(d).removeprefix("torch.") for d in known if _dtype_code(d) == code),
                f"dtype code {code}")


def header(version: int, dtype: torch.dtype, segs, bucket_numel: int) -> list[int]:
    """What a pair's header carries: both ends derive the last three from their own side, and the
    receiver compares them (`check_header`) before it posts a buffer."""
    return [version, _dtype_code(dtype), stream.stream_numel(segs), bucket_numel]


def check_header(got: list[int], want: list[int], rank: int, src: int) -> None:
    """Raise, naming both ends, where trainer rank `src`'s header `got` differs from `want`."""
    (v, dtype, numel, bucket), (wv, wdtype, wnumel, wbucket) = got, want
    if v != wv:
        raise RuntimeError(f"generator rank {rank} expected weights version {wv} but trainer "
                           f"rank {src} sent version {v}")
    if dtype != wdtype:
        raise ValueError(f"generator rank {rank}: trainer rank {src} sends weights as "
                         f"{_code_name(dtype)}, this rank's parameters are {_code_name(wdtype)}; "
                         f"the trainer must cast to the generator dtype (make_sender's dtype = "
                         f"model.gen_dtype)")
    if numel != wnumel:
        raise ValueError(f"generator rank {rank}: trainer rank {src} sends {numel} elements, the "
                         f"plan gives this pair {wnumel}; plan both ends from the same layouts "
                         f"(weights_sync.sync.plan_between_meshes)")
    if bucket != wbucket:
        raise ValueError(f"generator rank {rank}: trainer rank {src} cuts its stream every "
                         f"{bucket} elements, this rank every {wbucket}; give make_sender and "
                         f"make_receiver the same bucket_bytes")


def _local(p: torch.Tensor) -> torch.Tensor:
    return p.to_local() if hasattr(p, "to_local") else p


def local_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """param name -> this rank's local shard (a view: writes go into the model)."""
    return {n: _local(p.data) for n, p in model.named_parameters()}


class PeerLost(ConnectionError, TimeoutError):
    """The peer's connection closed while this rank waited on it (it crashed or exited). A
    ConnectionError (what happened) that is also a TimeoutError (what the waiter gets: the awaited
    weights will never come), so callers that handle a missing peer by its timeout still do."""


def _wait(work, deadline: float, timeout_s: float, what: str) -> None:
    """Wait for `work` until `deadline` (time.monotonic()), the end of the version's budget of
    `timeout_s`: every wait of one version shares it, so a slow peer served first cannot push a
    later one's timeout past `VersionThread.join`'s (which then raced the thread, see there)."""
    left = max(1e-3, deadline - time.monotonic())  # past the deadline: a poll, not a 0 s wait
    try:
        work.wait(timeout=timedelta(seconds=left))
    except RuntimeError as e:  # gloo and NCCL raise RuntimeError both for timeouts and for dead peers
        if is_timeout(e, deadline):
            raise TimeoutError(f"weight sync timed out after {timeout_s:.0f}s waiting for {what} ({e})") from None
        raise PeerLost(f"weight sync lost its peer while waiting for {what} ({e})") from None


class VersionThread:
    """One version in flight in a background thread: `start` it (after the previous one is done),
    `join` it before the parameters change. The thread's exception is re-raised by `join`.

    `join(timeout_s)` waits JOIN_GRACE_S longer than the thread's own waits, which share one
    deadline of timeout_s per version (not timeout_s per peer): a missing peer then surfaces as
    the thread's error naming that peer, after the thread has ended. Joining first raced them:
    the caller got an error naming no peer in particular and could tear the process group down
    while the thread still sat in a gloo wait, and the process aborted (SIGABRT, "terminate
    called without an active exception"; tests/test_weights_sync.py)."""

    JOIN_GRACE_S = 5.0

    def __init__(self):
        self._thread: threading.Thread | None = None
        self.error: BaseException | None = None
        self.version = -1
        self.timed_out: str | None = None  # a join's time-out, while its thread is still stuck

    def start(self, version: int, target, args: tuple, name: str) -> None:
        self.version, self.error = version, None
        self._thread = threading.Thread(target=self._run, args=(target, args), daemon=True, name=name)
        self._thread.start()

    def _run(self, target, args) -> None:
        try:
            target(*args)
        except BaseException as e:  # surfaced by join() on the trainer's thread
            self.error = e

    def join(self, timeout_s: float, waiting_for: str) -> None:
        if self._thread is None:
            return
        if self.timed_out is not None and self._thread.is_alive():  # waited out once already
            raise TimeoutError(self.timed_out)
        self._thread.join(timeout_s + self.JOIN_GRACE_S)
        if self._thread.is_alive():
            self.timed_out = (f"weights version {self.version}: {waiting_for} after "
                              f"{timeout_s + self.JOIN_GRACE_S:.0f}s")
            raise TimeoutError(self.timed_out)
        self._thread, self.timed_out = None, None
        if self.error is not None:
            raise self.error


def check_shards(tensors: dict[str, torch.Tensor], layout, rank: int, peers: dict,
                 who: str) -> None:
    """Every local shard that the plan reads or writes for `peers` (peer -> its segments) has
    the shape the plan's layout gives `rank`. Run once per setup: the copies then use views built
    from these very boxes."""
    boxes = layout.boxes.get(rank, {})
    for name in sorted({seg.param for segs in peers.values() for seg in segs}):
        want = tuple(boxes[name].sizes) if name in boxes else None
        have = tuple(tensors[name].shape) if name in tensors else None
        if want != have:
            raise ValueError(
                f"{who} rank {rank}: the weight-sync plan gives parameter {name!r} a local shard "
                f"of shape {want}, this rank's model has {have}; the plan was derived from another "
                f"model or layout than the one synced. Build the trainer and the generator from "
                f"the same model (model.path and config) and plan from these very modules "
                f"(weights_sync.sync.plan_between_meshes)")


class WeightSender:
    """`peers` restricts the plan's destinations to those this transport serves (None: all).
    `streams` False: no streaming buckets, for a caller that sends its messages itself
    (weights_sync/exchange.py); push() is then refused."""

    def __init__(self, model, plan, rank: int, dtype: torch.dtype, group, timeout_s: float,
                 bucket_bytes: int = 64 << 20, device: torch.device | None = None,
                 peers: Collection[int] | None = None, streams: bool = True):
        self.rank, self.dtype, self.group, self.timeout_s = rank, dtype, group, timeout_s
        self.tensors = local_tensors(model)
        self.device = device or next(iter(self.tensors.values())).device
        self.bucket_numel = max(1, bucket_bytes // torch.empty((), dtype=dtype).element_size())
        self.peers = {d: stream.segments(ts, "src") for d, ts in plan.sends_from(rank).items()
                      if peers is None or d in peers}
        check_shards(self.tensors, plan.src, rank, self.peers, "trainer")
        # Per peer, its messages: a flat view of the live shard where the piece is contiguous
        # and already in the wire dtype (sent without a copy), else None (filled into a bucket).
        self.messages = {d: self._messages(segs) for d, segs in self.peers.items()}
        # Two buckets, allocated once and shared by the peers (served one after the other): a
        # fresh 64 MiB buffer per version would page-fault its way in (~1 GB/s on a CPU).
        longest = max((hi - lo for ms in self.messages.values() for lo, hi, view in ms
                       if view is None), default=0)
        self.pool = [torch.empty(longest, dtype=dtype, device=self.device)
                     for _ in range(2 if longest and streams else 0)]
        self.streams = streams
        self._inflight = VersionThread()
        self.history: deque[dict] = deque(maxlen=HISTORY)  # bytes, seconds, GB/s per version

    @property
    def staging_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for b in self.pool)

    def push(self, version: int) -> None:
        if not self.streams:
            raise RuntimeError("this WeightSender was built with streams=False (its messages are "
                               "sent by weights_sync.exchange.BatchedExchange); push() cannot "
                               "stream them")
        self.wait_sent()
        self._inflight.start(version, self._stream_all, (version,), f"weights-v{version}")

    def wait_sent(self) -> None:
        """Block until the version in flight is fully received (before touching the params)."""
        self._inflight.join(self.timeout_s, f"trainer rank {self.rank} still waiting for generator "
                                            f"ranks {sorted(self.peers)} to receive it")

    def _stream_all(self, version: int) -> None:
        t0, nbytes = time.perf_counter(), 0
        deadline = time.monotonic() + self.timeout_s  # one budget for all peers of the version
        # Every peer's header before any peer's data: a receiver posts a sender's buffers only
        # once that sender's header and those of the senders before it are in
        # (WeightReceiver.post), so a header held back behind another peer's data could close a
        # cycle of waits.
        heads = {}
        for dst in self.peers:
            h = self.head(version, dst)
            heads[dst] = (h, dist.isend(h, dst, group=self.group, tag=TAG_WEIGHTS))
        with torch.no_grad():
            for dst, segs in self.peers.items():
                nbytes += self._stream(dst, segs, version, deadline, heads[dst][1])
        dt = time.perf_counter() - t0
        self.history.append({"version": version, "bytes": nbytes, "seconds": dt,
                             "gbps": nbytes / dt / 1e9 if dt > 0 else 0.0})

    def head(self, version: int, dst: int) -> torch.Tensor:
        """The header of `version` to peer `dst` (`header`), as the tensor sent."""
        return torch.tensor(header(version, self.dtype, self.peers[dst], self.bucket_numel),
                            dtype=torch.int64, device=self.device)

    def _messages(self, segs) -> list[tuple[int, int, torch.Tensor | None]]:
        out, starts = [], [s.start for s in segs]
        for lo, hi in stream.messages(segs, self.bucket_numel, small_numel(self.bucket_numel)):
            seg = segs[bisect.bisect_right(starts, lo) - 1]  # the segment where the message starts
            view = None
            if hi <= seg.start + seg.numel:  # one piece of one param
                src = self.tensors[seg.param][seg.box.slices()]
                if src.dtype == self.dtype and src.is_contiguous():
                    view = src.reshape(-1)[lo - seg.start:hi - seg.start]
            out.append((lo, hi, view))
        return out

    def _stream(self, dst: int, segs, version: int, deadline: float, head_work) -> int:
        # The header (sent by _stream_all) carries the version, so a receiver can never apply
        # bytes of a version other than the one it was told about (NCCL has no message tags to
        # tell them apart), and the wire dtype, so it never reads them as another dtype.
        works = [head_work]
        pool, what = self.pool, f"generator rank {dst} to receive version {version}"
        pending: list = [None, None]  # the send using each bucket of the pool
        filled = 0
        for lo, hi, view in self.messages[dst]:
            if view is not None:  # zero copy: the shard stays untouched until wait_sent()
                works.append(dist.isend(view, dst, group=self.group, tag=TAG_WEIGHTS))
                continue
            k = filled % 2
            filled += 1
            if pending[k] is not None:
                _wait(pending[k], deadline, self.timeout_s, what)
            stream.fill(pool[k], lo, hi, segs, self.tensors)
            pending[k] = dist.isend(pool[k][:hi - lo], dst, group=self.group, tag=TAG_WEIGHTS)
        for w in (*works, *pending):
            if w is not None:
                _wait(w, deadline, self.timeout_s, what)
        return stream.stream_numel(segs) * torch.empty((), dtype=self.dtype).element_size()

    def close(self) -> None:
        """Wait for the version in flight; after a `wait_sent` that timed out (the caller is
        handling that error), no second wait of timeout_s for the same stuck thread."""
        if self._inflight.timed_out is None:
            self.wait_sent()


def staged_apply(receiver, version: int):
    """The `apply()` that a staging receiver's `receive(version)` returns. It installs what the
    staging holds when it runs: kept past a later receive(), it would install that version's
    weights while the engine tags their tokens with this one. Refused, as the direct IPC
    receiver refuses it."""
    def apply() -> None:
        if receiver.staged_version != version:
            later = receiver.staged_version
            what = (f"receive() of version {later} refilled the staging" if later is not None else
                    "a later receive() began refilling the staging (not completed)")
            raise RuntimeError(f"generator rank {receiver.rank}: apply() of weights version "
                               f"{version} after {what}; apply before receiving again")
        receiver._apply()
    return apply


class WeightReceiver:
    """`peers` restricts the plan's sources to those this transport serves (None: all)."""

    def __init__(self, model, plan, rank: int, group, timeout_s: float,
                 bucket_bytes: int = 64 << 20, peers: Collection[int] | None = None):
        self.rank, self.group, self.timeout_s = rank, group, timeout_s
        self.tensors = local_tensors(model)
        some = next(iter(self.tensors.values()))
        self.dtype, self.device = some.dtype, some.device
        self.bucket_numel = max(1, bucket_bytes // some.element_size())
        self.peers = {s: stream.segments(ts, "dst") for s, ts in plan.recvs_to(rank).items()
                      if peers is None or s in peers}
        check_shards(self.tensors, plan.dst, rank, self.peers, "generator")
        # One flat staging buffer per source: the generator holds its shard plus one staged copy.
        self.staging = {s: torch.empty(stream.stream_numel(segs), dtype=self.dtype, device=self.device)
                        for s, segs in self.peers.items()}
        self.history: deque[dict] = deque(maxlen=HISTORY)
        self.staged_version: int | None = None  # what the staging holds (`staged_apply`)
        self._format_checked = False  # the first version's headers are checked before its bytes

    @property
    def staging_bytes(self) -> int:
        return sum(f.numel() * f.element_size() for f in self.staging.values())

    def receive(self, version: int):
        """Receive all of `version` into staging; return `apply()` for the engine's safe point."""
        return self.finish(self.post(version))

    def post(self, version: int):
        """Post every receive of `version` (headers, then the bytes) and return the ticket `finish`
        waits on. The first version's headers are awaited and checked source by source before its
        bytes are posted: a sender of another dtype, stream length or bucket size is named before
        its bytes reach buffers of the wrong type or size. Every sender sends all its headers
        before any bytes (`WeightSender._stream_all`), so waiting on a header never waits on
        another pair's bytes (no cycle of waits). Both ends fix the format at construction, so
        later versions post everything at once (waiting for a header first cost the CPU sync
        5-10%) and `finish` checks their headers before anything can be applied."""
        t0, deadline, heads = self.begin()
        head_works = {s: dist.irecv(h, s, group=self.group, tag=TAG_WEIGHTS)
                      for s, h in heads.items()}
        works = []  # (source, work) of what `finish` waits for (a gloo work is waited once)
        for src in self.staging:
            if self._format_checked:
                works.append((src, head_works[src]))
            else:
                _wait(head_works[src], deadline, self.timeout_s,
                      f"weights version {version} from trainer rank {src}")
                self._check(heads[src], src, version)
            for view in self.slices(src):
                works.append((src, dist.irecv(view, src, group=self.group, tag=TAG_WEIGHTS)))
        self._format_checked = True
        return version, t0, deadline, heads, works

    def begin(self) -> tuple[float, float, dict[int, torch.Tensor]]:
        """A version's start: no earlier apply() may run (the staging is being overwritten); its
        clock, its one deadline for all sources, and a header buffer per source."""
        self.staged_version = None
        heads = {s: torch.empty(HEADER_NUMEL, dtype=torch.int64, device=self.device)
                 for s in self.staging}
        return time.perf_counter(), time.monotonic() + self.timeout_s, heads

    def slices(self, src: int) -> list[torch.Tensor]:
        """Where source `src`'s messages land in its staging, in the order it sends them."""
        flat = self.staging[src]
        return [flat[lo:hi] for lo, hi in stream.messages(self.peers[src], self.bucket_numel,
                                                          small_numel(self.bucket_numel))]

    def _check(self, head: torch.Tensor, src: int, version: int) -> None:
        want = header(version, self.dtype, self.peers[src], self.bucket_numel)
        check_header(head.tolist(), want, self.rank, src)

    def finish(self, ticket):
        """`ticket`: `post`'s, or one whose works name their peers in words (a batch's)."""
        version, t0, deadline, heads, works = ticket
        for src, w in works:
            peer = f"trainer rank {src}" if isinstance(src, int) else src
            _wait(w, deadline, self.timeout_s, f"weights version {version} from {peer}")
        for src, h in heads.items():
            self._check(h, src, version)
        nbytes = self.staging_bytes
        dt = time.perf_counter() - t0
        self.history.append({"version": version, "bytes": nbytes, "seconds": dt,
                             "gbps": nbytes / dt / 1e9 if dt > 0 else 0.0})
        self.staged_version = version
        return staged_apply(self, version)

    @torch.no_grad()
    def _apply(self) -> None:
        for src, segs in self.peers.items():
            stream.scatter(self.staging[src], segs, self.tensors)


# ---------------------------------------------------------------------------------------------
# Transport per peer: CUDA IPC on a shared GPU, NCCL across GPUs, gloo on CPU.

def transport_for(src: int, dst: int, gpu_of: Mapping[int, tuple] | None,
                  cpu_shm: bool = False) -> str:
    """"ipc" when both ranks sit on the same GPU (NCCL refuses that pair), "nccl" when both are
    on GPUs, else "gloo"; with `cpu_shm`, also "ipc" for two CPU ranks that share host memory
    (the same protocol over a shared-memory file: one memcpy each side instead of gloo's TCP
    loopback). `gpu_of`: rank -> (host, GPU index (-1 on CPU)[, GPU UUID or, on CPU, the host
    memory's id]), as `Meshes.gpu_of`; the UUID, where given, decides what "the same GPU" is."""
    a, b = (gpu_of or {}).get(src), (gpu_of or {}).get(dst)
    if cpu_shm and shared_host_memory(a, b):
        return "ipc"
    if gpu_key(a) is None or gpu_key(b) is None:
        return "gloo"
    return "ipc" if same_gpu(a, b) else "nccl"


def _split(rank: int, peers, gpu_of, is_src: bool, cpu_shm: bool) -> tuple[set[int], set[int]]:
    """(IPC peers, point-to-point peers) of this rank."""
    kinds = {p: transport_for(*((rank, p) if is_src else (p, rank)), gpu_of, cpu_shm)
             for p in peers}
    ipc = {p for p, k in kinds.items() if k == "ipc"}
    return ipc, set(kinds) - ipc


class MultiSender:
    """One sender per transport, driven together (a trainer rank whose generator peers are on
    its own GPU and on others). Each part streams in its own background thread."""

    def __init__(self, parts: list):
        self.parts = parts

    def push(self, version: int) -> None:
        for p in self.parts:
            p.push(version)

    def wait_sent(self) -> None:
        for p in self.parts:
            p.wait_sent()

    def close(self) -> None:
        """Close every part, then raise the first part's error: one part's failure left the
        others unclosed (their waits for the generators not made)."""
        first = None
        for p in self.parts:
            try:
                p.close()
            except Exception as e:
                first = first or e
        if first is not None:
            raise first

    @property
    def staging_bytes(self) -> int:
        return sum(p.staging_bytes for p in self.parts)


class MultiReceiver:
    """Point-to-point receives are posted first, the IPC copies run while those bytes arrive."""

    def __init__(self, p2p: WeightReceiver, ipc):
        self.p2p, self.ipc = p2p, ipc
        self.parts = [p2p, ipc]

    def receive(self, version: int):
        ticket = self.p2p.post(version)
        apply_ipc = self.ipc.receive(version)
        apply_p2p = self.p2p.finish(ticket)

        def apply() -> None:
            apply_ipc()
            apply_p2p()
        return apply

    @property
    def staging_bytes(self) -> int:
        return self.p2p.staging_bytes + self.ipc.staging_bytes


def make_sender(model, plan, rank: int, dtype: torch.dtype, group, timeout_s: float,
                gpu_of: Mapping[int, tuple] | None = None, *,
                bucket_bytes: int = 64 << 20, ipc_buffers: int = 1, store=None,
                channel: str = "weights", cpu_shm: bool = False):
    """The trainer-side sender for this rank: `WeightSender` (NCCL/gloo on `group`) for peers
    on other GPUs or CPUs, `IpcSender` for peers on this rank's GPU, a `MultiSender` of both
    when it has both kinds. `WeightSender`'s arguments plus the placement `gpu_of`; `cpu_shm`:
    CPU peers sharing this host's memory count as IPC peers (`transport_for`)."""
    from weights_sync.ipc import IpcSender
    ipc, p2p = _split(rank, plan.sends_from(rank), gpu_of, is_src=True, cpu_shm=cpu_shm)
    parts = []
    if ipc:
        parts.append(IpcSender(model, plan, rank, dtype, timeout_s, peers=ipc,
                               buffers=ipc_buffers, store=store, channel=channel))
    if p2p or not ipc:
        parts.append(WeightSender(model, plan, rank, dtype, group, timeout_s,
                                  bucket_bytes=bucket_bytes, peers=p2p))
    return parts[0] if len(parts) == 1 else MultiSender(parts)


def make_receiver(model, plan, rank: int, group, timeout_s: float,
                  gpu_of: Mapping[int, tuple] | None = None, *,
                  bucket_bytes: int = 64 << 20, store=None, channel: str = "weights",
                  ipc_direct: bool = False, cpu_shm: bool = False):
    """The generator-side counterpart of `make_sender` (same transport choice per peer).
    `ipc_direct`: apply straight from the trainer's IPC staging (`IpcReceiver(direct=True)`)."""
    from weights_sync.ipc import IpcReceiver
    ipc, p2p = _split(rank, plan.recvs_to(rank), gpu_of, is_src=False, cpu_shm=cpu_shm)
    ipc_part = IpcReceiver(model, plan, rank, timeout_s, peers=ipc, store=store,
                           channel=channel, direct=ipc_direct) if ipc else None
    p2p_part = WeightReceiver(model, plan, rank, group, timeout_s, bucket_bytes=bucket_bytes,
                              peers=p2p) if p2p or not ipc else None
    if ipc_part is not None and p2p_part is not None:
        return MultiReceiver(p2p_part, ipc_part)
    return ipc_part or p2p_part


def describe_receiver(receiver) -> str:
    """How this generator rank gets its weights, for the start-up log: one phrase per part."""
    parts = receiver.parts if isinstance(receiver, MultiReceiver) else [receiver]
    words = []
    for part in parts:
        peers, direct = sorted(part.peers), ""
        if isinstance(part, WeightReceiver):
            how = f"{dist.get_backend(part.group) if dist.is_initialized() else 'gloo'} point-to-point"
        else:
            how = "CUDA IPC" if part.device.type == "cuda" else "shared memory (parallel.cpu_shm)"
            if part.direct:  # parallel.ipc_buffers=0: no staged copy on this side either
                direct = ", applied straight from their memory"
        words.append(f"{how} from trainer ranks {peers}{direct}")
    return "weight sync by " + "; ".join(words)


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


def plan_between_meshes(model, group, is_src_leader: bool, is_dst_leader: bool):
    """Start-up of one rank of either mesh: its mesh's layout from the model's real DTensors (over
    the mesh's own `group`), both layouts exchanged (`exchange_layouts`, a world collective), and
    the plan of the parameters that move, from `plan_cached`."""
    from parallel.layout import Layout
    from weights_sync.plan import plan_cached
    src, dst = exchange_layouts(Layout.from_module(model, group=group), is_src_leader, is_dst_leader)
    return plan_cached(src, dst, transfer_specs(src, dst))


def transfer_specs(src, dst):
    """Parameters that move: the generator's parameters, every one of which the trainer must hold
    (else it would keep its initial values at every version). Both sides list a tied head once,
    as the embedding (`named_parameters` drops the shared duplicate); trainer-only parameters
    stay behind."""
    have = {s.name for s in src.specs}
    missing = [s.name for s in dst.specs if s.name not in have]
    if missing:
        raise ValueError(f"generator parameters {missing} are not trainer parameters, so weight "
                         f"sync could never update them; build both sides from the same model "
                         f"config (e.g. tie_word_embeddings) so the names match")
    names = {s.name for s in dst.specs}
    return [s for s in src.specs if s.name in names]
