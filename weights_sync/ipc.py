"""Weight sync between processes on the *same* GPU, through shared device memory (CUDA IPC).

NCCL refuses two ranks on one GPU ("Duplicate GPU detected"), so a trainer rank and a generator
rank that share a GPU cannot use the NCCL path of weights_sync/sync.py. They share memory instead:
opening a CUDA IPC handle costs ~0.6 ms once, and a copy out of the mapped buffer runs at
~1.5 TB/s on an H200 (shared/REFERENCES.md).

Protocol, per (trainer rank s, generator rank d) pair; the pair's byte stream is the one of
weights_sync/stream.py (the plan's transfers of the pair, row-major, in the generator dtype):
  setup   s allocates `buffers` persistent staging buffers of the whole stream, exports each ONCE
          (`torch.multiprocessing.reductions.reduce_tensor`, the same handle torch's own
          multiprocessing pickles) and publishes the handles, JSON with the bytes in base64, under
          the store key `handles`. d maps them at its first receive() (lazily: no start-up order).
  push v  s takes the next slot k (round robin); if slot k still holds an unacknowledged version
          u, it first waits for `ack/k == u` (timeout naming d and u). It fills slot k from its live
          shard (casting to the generator dtype), waits for the fill to finish, and publishes
          `ready/v = k`. The trainer may change its parameters as soon as the fill is done:
          `wait_sent()` returns then, without waiting for the generator.
  recv v  d waits for `ready/v` (timeout naming s and v), copies slot k into its own staging
          buffer (device to device), waits for the copy, publishes `ack/k = v`, and returns
          `apply()`, which scatters its staging into the parameters at the engine's safe point.
`direct=True` skips the receiver's staging: apply() scatters straight from the mapped slot and
acks after it (one device copy and one model-sized buffer less; see IpcReceiver).
With buffers=2 (double buffering) the trainer only waits if the generator is two versions behind;
the default, 1, saves one staged copy of the shard in GPU memory (the co-located OOM risk) and
costs nothing while the generator acks within one trainer step.

Control messages go through the job's TCPStore (the one the Link uses for its headers), not
gloo: a gloo `irecv` cannot be polled (`is_completed()` turns true only inside `wait()`), a store
key can (`check`), so both ends poll without blocking and every wait has a deadline. Keys live
under `tandem/ipc/<channel>/<s>-<d>/`; one channel pairs one sender with one receiver for the
life of the job (a second sender/receiver pair in the same job takes another `channel`).

Watching the peer: the waits above poll the store, which says nothing when the peer fails; a
failed generator sends SHUTDOWN with its cause on the Link instead (trainer/link.py). With a
`watch` (`watch_link`), the waits look at the link every WATCH_EVERY_S on the thread that owns
it, and a peer's SHUTDOWN ends them at once with PeerError naming the cause and what was awaited
(before, the trainer sat out its whole timeout and failed with a bare TimeoutError). The sender's
staging thread cannot read the link (not thread-safe): `wait_sent()` watches while it joins it,
and abandons it on a SHUTDOWN.

Both ends check their local shards against the plan's layout once, at construction: a box view
of a shard of another shape slices silently (torch clamps), so a larger shard moved only part of
its bytes and a smaller one failed deep inside a copy.

The shared memory is abstracted (`CudaIpcMemory`, `CpuShmMemory`) so that the same protocol
runs on CPU: `CpuShmMemory` shares a staging buffer through a shared-memory file
(`UntypedStorage._share_filename_cpu_`, what torch.multiprocessing does for CPU tensors under its
file_system strategy), the CPU analogue of the CUDA handle. tests/test_ipc.py runs the state
machine that way on real gloo ranks.
"""
from __future__ import annotations

import base64
import json
import signal
import threading
import time
from collections import deque
from collections.abc import Callable, Collection

import torch
import torch.distributed as dist

from weights_sync import stream
from weights_sync.sync import (HISTORY, MultiReceiver, MultiSender, VersionThread, check_shards,
                                staged_apply)

# ----- handles: JSON-able descriptions of a shared buffer ---------------------------------------

_TYPES = {"Tensor": torch.Tensor, "Parameter": torch.nn.Parameter,
          "UntypedStorage": torch.UntypedStorage, "TypedStorage": torch.TypedStorage}


def _encode(x):
    """The args of torch's rebuild function as JSON: no pickle, so a peer cannot run code."""
    if isinstance(x, bytes):
        return {"b64": base64.b64encode(x).decode()}
    if isinstance(x, torch.dtype):
        return {"dtype": str(x).removeprefix("torch.")}
    if isinstance(x, type):
        if _TYPES.get(x.__name__) is not x:
            raise TypeError(f"cannot encode type {x!r} in an IPC handle")
        return {"type": x.__name__}
    if isinstance(x, (tuple, list)):  # torch.Size too
        return {"tuple": [_encode(y) for y in x]}
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    raise TypeError(f"cannot encode {type(x).__name__} {x!r} in an IPC handle")


def _decode(x):
    if not isinstance(x, dict):
        return x
    if "b64" in x:
        return base64.b64decode(x["b64"])
    if "dtype" in x:
        dtype = getattr(torch, x["dtype"], None)
        if not isinstance(dtype, torch.dtype):
            raise ValueError(f"bad dtype {x['dtype']!r} in an IPC handle")
        return dtype
    if "type" in x:
        return _TYPES[x["type"]]
    return tuple(_decode(y) for y in x["tuple"])


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


class CudaIpcMemory:
    """Staging buffers shared by CUDA IPC; copies run on a side stream and are waited for before
    the other process is told (one host wait per pair and version, off the trainer thread: an
    event polled up to the version's deadline, `wait_done`)."""

    kind = "cuda_ipc"
    label = "CUDA IPC"  # in messages

    def __init__(self, device: torch.device):
        self.device = device
        self._stream = None

    @property
    def stream(self):
        if self._stream is None:  # created on first use: the handle code also runs without CUDA
            self._stream = torch.cuda.Stream(self.device)
        return self._stream

    def export(self, t: torch.Tensor) -> dict:
        from torch.multiprocessing.reductions import rebuild_cuda_tensor, reduce_tensor
        fn, args = reduce_tensor(t)
        if fn is not rebuild_cuda_tensor:
            raise RuntimeError(f"torch exported a CUDA tensor with {fn.__name__}, not "
                               "rebuild_cuda_tensor; this torch build cannot share it by IPC")
        return {"args": _encode(args)}

    def open(self, handle: dict) -> torch.Tensor:
        import inspect
        from torch.multiprocessing.reductions import rebuild_cuda_tensor
        bound = inspect.signature(rebuild_cuda_tensor).bind(*_decode(handle["args"]))
        # the same physical GPU, numbered as *this* process sees it
        bound.arguments["storage_device"] = self.device.index
        return rebuild_cuda_tensor(*bound.args)

    def marker(self):
        """Work queued so far on this thread's current stream (e.g. the optimizer step)."""
        ev = torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def run(self, fn: Callable[[], None], after, deadline: float, what: str,
            watch: Callable[[], None] | None = None) -> None:
        """Run `fn`'s copies after `after` on the side stream; return once they are done, so the
        other process may read (or overwrite) the buffer. The wait polls an event recorded
        behind the copies (`wait_done`), with `deadline`, where `stream.synchronize()` had none:
        a wedged GPU held this rank for ever without a word. `what`: the copies, for the error."""
        with torch.cuda.stream(self.stream):  # a no-op without CUDA (the tests' fake stream)
            self.stream.wait_event(after)
            fn()
            done = self.stream.record_event()
        wait_done(done, deadline, what, str(self.device), watch=watch)


class CpuShmMemory:
    """The CPU stand-in: a shared-memory file per buffer (torch's file_system sharing)."""

    kind = "cpu_shm"
    label = "CPU shared memory"  # in messages

    def __init__(self, device: torch.device):
        self.device = device

    def export(self, t: torch.Tensor) -> dict:
        # The first share starts torch's shm manager, a child process that inherits this mask: a
        # SIGTERM or Ctrl-C that torchrun passes to the whole process group meanwhile killed it,
        # and this call then spun for ever with the GIL held (no grace period, no stop line;
        # torchrun's SIGKILL ended it). Blocked, the signal arrives once the call is back.
        old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM, signal.SIGINT})
        try:
            manager, name, nbytes = t.untyped_storage()._share_filename_cpu_()  # moves t into shm
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)
        return {"manager": _encode(manager), "name": _encode(name), "nbytes": nbytes,
                "dtype": _dtype_name(t.dtype), "offset": t.storage_offset(),
                "size": list(t.shape), "stride": list(t.stride())}

    def open(self, handle: dict) -> torch.Tensor:
        try:
            storage = torch.UntypedStorage._new_shared_filename_cpu(
                _decode(handle["manager"]), _decode(handle["name"]), handle["nbytes"])
        except RuntimeError as e:  # e.g. two containers with one boot id but apart /dev/shm
            raise RuntimeError(f"cannot open the trainer's shared-memory weights "
                               f"({_decode(handle['name'])!r}: {e}); if these ranks do not share "
                               "/dev/shm, run with --parallel.cpu_shm=false (weights over gloo)") from e
        dtype = _decode({"dtype": handle["dtype"]})
        return torch.empty(0, dtype=dtype).set_(storage, handle["offset"], handle["size"],
                                                handle["stride"])

    def marker(self):
        return None

    def run(self, fn: Callable[[], None], after, deadline: float, what: str,
            watch: Callable[[], None] | None = None) -> None:
        fn()  # CPU copies are synchronous: nothing to wait for


def shared_memory_for(device: torch.device):
    return CudaIpcMemory(device) if device.type == "cuda" else CpuShmMemory(device)


# ----- control: ready / ack / handles in the store, polled without blocking ----------------------

class Control:
    """One channel's control keys; every call is one or a few store round trips, none blocks."""

    def __init__(self, store=None, channel: str = "weights"):
        base = store if store is not None else dist.distributed_c10d._get_default_store()
        self.store = dist.PrefixStore(f"tandem/ipc/{channel}/", base)

    def _get(self, key: str) -> str | None:
        return self.store.get(key).decode() if self.store.check([key]) else None

    def publish_handles(self, s: int, d: int, info: dict) -> None:
        self.store.set(f"{s}-{d}/handles", json.dumps(info))

    def handles(self, s: int, d: int) -> dict | None:
        raw = self._get(f"{s}-{d}/handles")
        return None if raw is None else json.loads(raw)

    def publish_ready(self, s: int, d: int, version: int, slot: int) -> None:
        self.store.set(f"{s}-{d}/ready/{version}", str(slot))
        self.store.set(f"{s}-{d}/latest", str(version))

    def is_ready(self, s: int, d: int, version: int) -> bool:
        return self.store.check([f"{s}-{d}/ready/{version}"])

    def take_ready(self, s: int, d: int, version: int) -> int | None:
        """The slot holding `version`, once announced (the key is consumed)."""
        raw = self._get(f"{s}-{d}/ready/{version}")
        if raw is not None:
            self.store.delete_key(f"{s}-{d}/ready/{version}")
        return None if raw is None else int(raw)

    def latest(self, s: int, d: int) -> int | None:
        raw = self._get(f"{s}-{d}/latest")
        return None if raw is None else int(raw)

    def ack(self, s: int, d: int, slot: int, version: int) -> None:
        self.store.set(f"{s}-{d}/ack/{slot}", str(version))

    def acked(self, s: int, d: int, slot: int) -> int | None:
        """The last version the receiver released from `slot`."""
        raw = self._get(f"{s}-{d}/ack/{slot}")
        return None if raw is None else int(raw)


# How often a wait on a peer runs its `watch`: a peer's SHUTDOWN ends the wait within this. A
# quiet link costs nothing to look at (`Link.poll` reads the store only after its bell rang).
WATCH_EVERY_S = 0.05


def poll_until(check: Callable[[], object], deadline: float, fail: Callable[[], str],
               spin_s: float = 0.005, *, watch: Callable[[], None] | None = None):
    """Poll `check()` until it returns non-None; TimeoutError(`fail()`) past `deadline`.
    For the first `spin_s` it re-polls at once (a store round trip paces it): a whole GPU sync
    takes a few ms, so sleeping there would add latency. After that it backs off to 1 ms; the
    sleep is a poll interval that yields the core, not synchronisation. `watch()`, if given, runs
    every WATCH_EVERY_S and before a timeout is raised; it raises to end the wait early (a peer's
    SHUTDOWN: its cause beats our timeout)."""
    start = time.monotonic()
    next_watch = start + WATCH_EVERY_S
    backoff = 5e-5
    while True:
        got = check()
        if got is not None:
            return got
        now = time.monotonic()
        if watch is not None and (now >= next_watch or now > deadline):
            watch()
            next_watch = now + WATCH_EVERY_S
        if now > deadline:
            raise TimeoutError(fail())
        if now - start < spin_s:
            time.sleep(0)  # lets the other threads of this process run
            continue
        time.sleep(backoff)
        backoff = min(backoff * 2, 1e-3)


def wait_done(done, deadline: float, what: str, device: str = "the GPU", *,
              watch: Callable[[], None] | None = None) -> None:
    """Wait until `done.query()` is true (a torch.cuda.Event recorded behind some device work;
    anything with query() in the tests), polled by `poll_until`; past `deadline`, TimeoutError
    naming `what`, `device` and the fix. query() raises by itself if the work failed."""
    start = time.monotonic()
    poll_until(lambda: True if done.query() else None, deadline,
               lambda: f"{what} had not finished on {device} after "
                       f"{time.monotonic() - start:.1f}s (its deadline, from "
                       f"parallel.timeout_s); the device is wedged or far slower than expected: "
                       f"check nvidia-smi and the kernel log for Xid errors, or if it is only "
                       f"slow, raise --parallel.timeout_s",
               watch=watch)


def link_watch(link, errors_only: bool) -> Callable[[str], None]:
    """A `watch` over this rank's Link (trainer/link.py), to run on the thread that owns it: it
    raises PeerError, worded as the link's own waits word it, once a peer's SHUTDOWN has arrived,
    naming what this rank waited for. It consumes nothing: the role's loop still handles every
    message, in order. `errors_only`: only a SHUTDOWN that carries an error ends the wait. A
    generator must, since the trainer's normal end is a plain SHUTDOWN sent right after its last
    push, whose announcement may still be on its way."""
    from trainer.link import Msg, PeerError

    def watch(what: str) -> None:
        msgs = link.poll()
        link.put_back(msgs)
        for m in msgs:
            error = m.payload.get("error") if isinstance(m.payload, dict) else None
            if m.type == Msg.SHUTDOWN and (error or not errors_only):
                raise PeerError(f"rank {m.src} shut down while rank {link.rank} waited for {what}: "
                                f"{error or 'no error given'}")
    return watch


def watch_link(io, link) -> None:
    """Make the CUDA-IPC parts of a sender or receiver (what make_sender/make_receiver return)
    watch `link` while they wait on their peers (`link_watch`). The other parts need not: their
    gloo/NCCL waits fail by themselves once the peer's process is gone."""
    for part in io.parts if isinstance(io, (MultiSender, MultiReceiver)) else [io]:
        if isinstance(part, (IpcSender, IpcReceiver)):
            part.watch = link_watch(link, errors_only=isinstance(part, IpcReceiver))


def _foreach_default(device: torch.device) -> bool:
    """copy_all's strategy: on CUDA one copy per parameter (a plain device memcpy each) moved a
    1.1B model 8-9% faster than the multi-tensor copy (BENCHMARKS.md, "GPU"); on CPU one
    multi-tensor call saves the Python loop. bench/weights_sync.py times both."""
    return device.type != "cuda"


def _local_tensors(model) -> dict[str, torch.Tensor]:
    return {n: (p.data.to_local() if hasattr(p.data, "to_local") else p.data)
            for n, p in model.named_parameters()}


# ----- the two ends ------------------------------------------------------------------------------

class IpcSender:
    """`WeightSender`'s interface (push / wait_sent / close) for the destination peers that
    share this rank's GPU. `peers` restricts the plan's destinations (None: all of them).

    `buffers` >= 1: staging buffers per peer (the module docstring's protocol). `buffers=0`
    (zero copy): nothing is staged; the trainer shares its parameter shards themselves, each
    generator copies its boxes straight out of them (casting to its dtype), and `wait_sent()`
    returns only once every peer acked the version, since the parameters must not change while
    a generator reads them. One device copy per version and no staging memory at all, at the
    price of the trainer's next update waiting for the generators.

    `watch` (None, or set by `watch_link`): called with what is awaited while `wait_sent()` and
    `close()` wait on the generators; it raises to end the wait (module docstring)."""

    def __init__(self, model, plan, rank: int, dtype: torch.dtype, timeout_s: float,
                 peers: Collection[int] | None = None, buffers: int = 1, store=None,
                 channel: str = "weights"):
        if buffers < 0:
            raise ValueError(f"buffers={buffers}: use 0 (zero copy: generators read the "
                             f"trainer's parameters) or >= 1 staging buffers per peer")
        self.rank, self.dtype, self.timeout_s = rank, dtype, timeout_s
        self.zero_copy = buffers == 0
        self.tensors = _local_tensors(model)
        self.device = next(iter(self.tensors.values())).device
        self.foreach = _foreach_default(self.device)
        self.memory = shared_memory_for(self.device)
        self.control = Control(store, channel)
        sends = plan.sends_from(rank)
        self.peers = {d: stream.segments(ts, "src") for d, ts in sends.items()
                      if peers is None or d in peers}
        check_shards(self.tensors, plan.src, rank, self.peers, "trainer")
        self.numel = {d: stream.stream_numel(segs) for d, segs in self.peers.items()}
        # Persistent and exported once: the receiver maps them once, then only versions move.
        self.staging = {d: [torch.empty(max(1, n), dtype=dtype, device=self.device)
                            for _ in range(buffers)] for d, n in self.numel.items()}
        for d in self.peers:
            self.control.publish_handles(rank, d, self._handles(d))
        # the fill of each (peer, slot): one multi-tensor copy over views built once
        self.fills = {d: [(stream.part_views(b, self.peers[d]),
                           stream.box_views(self.peers[d], self.tensors)) for b in bufs]
                      for d, bufs in self.staging.items()}
        self.held: dict[int, list[int | None]] = {d: [None] * max(1, buffers) for d in self.peers}
        self.next_slot = dict.fromkeys(self.peers, 0)
        self._inflight = VersionThread()
        self.history: deque[dict] = deque(maxlen=HISTORY)  # bytes, seconds (fill + publish) per version
        self.watch: Callable[[str], None] | None = None
        self._done = threading.Event()  # the staging thread of the version in flight has ended
        self._done.set()
        self._abandon = threading.Event()  # wait_sent() gave that version up (its watch raised)
        self._waiting = ""  # what the staging thread waits for now: the watch's error names it
        # a wait on the generators failed since the last push: close() waits no more
        self._failed = False

    def _handles(self, d: int) -> dict:
        if self.zero_copy:  # export (on CPU: move into shared memory) before any view is taken
            names = sorted({seg.param for seg in self.peers[d]})
            return {"kind": self.memory.kind, "mode": "params",
                    "params": {n: self.memory.export(self.tensors[n]) for n in names}}
        return {"kind": self.memory.kind, "mode": "staged", "dtype": _dtype_name(self.dtype),
                "numel": self.numel[d], "buffers": [self.memory.export(b) for b in self.staging[d]]}

    @property
    def staging_bytes(self) -> int:
        return sum(b.numel() * b.element_size() for bufs in self.staging.values() for b in bufs)

    def push(self, version: int) -> None:
        """Start staging `version` in the background; returns at once."""
        self.wait_sent()
        self._failed = False  # this version's waits say whether the generators still fail
        after = self.memory.marker()  # the fill waits for the caller's queued updates
        self._done.clear()
        try:
            self._inflight.start(version, self._stage_all, (version, after), f"weights-ipc-v{version}")
        except BaseException:
            self._done.set()  # no thread to set it: wait_sent's watch loop would never end
            raise

    def wait_sent(self) -> None:
        """Block until the version in flight is staged (zero copy: read by every peer): the
        parameters may change after this."""
        try:
            self._watch_inflight()
            self._join()
        except BaseException:
            self._failed = True
            raise

    def _join(self) -> None:
        # the thread's own waits time out first (join adds a grace), naming the peer and version
        self._inflight.join(self.timeout_s, self._not_staged())

    def _not_staged(self) -> str:
        return (f"trainer rank {self.rank} has not staged it for generator ranks "
                f"{sorted(self.peers)} ({self.memory.label})")

    def _watch_inflight(self) -> None:
        """With a `watch`: wait for the staging thread in slices and run the watch between them.
        Once it raises, the thread is abandoned (it stops at its next poll rather than sitting
        out its deadline, so no store call of it outlives this one) and the watch's error goes
        up: the generator's cause says more than whatever the thread failed of meanwhile.
        The slices end where `_join` gives up (the thread's deadline plus the join's grace): a
        thread stuck outside its polls (a fill behind a GPU stream that never finishes) kept
        this loop, and so the trainer, waiting for ever where `_join` alone raised."""
        if self.watch is None:
            return
        budget = self.timeout_s + self._inflight.JOIN_GRACE_S
        end = time.monotonic() + budget
        while not self._done.wait(WATCH_EVERY_S):
            try:
                self.watch(self._waiting)
            except BaseException:
                self._abandon.set()
                try:
                    self._join()
                except Exception:  # its "abandoned", or a timeout meanwhile: the cause is the watch's
                    pass
                finally:
                    self._abandon.clear()
                raise
            if time.monotonic() > end:  # as `_join` would say (the watch first: its cause wins)
                raise TimeoutError(f"weights version {self._inflight.version}: "
                                   f"{self._not_staged()} after {budget:g}s")

    def _abandoned(self) -> None:
        """The staging thread's watch: ends its wait once `wait_sent()` gave the version up."""
        if self._abandon.is_set():
            raise RuntimeError(f"trainer rank {self.rank}: weights version {self._inflight.version} "
                               f"abandoned while waiting for {self._waiting}")

    def _watch_here(self) -> None:
        """The watch of a wait on the caller's own thread (`close()`)."""
        if self.watch is not None:
            self.watch(self._waiting)

    def _stage_all(self, version: int, after) -> None:
        try:
            self._stage_version(version, after)
        finally:
            self._done.set()

    def _stage_version(self, version: int, after) -> None:
        t0, nbytes = time.perf_counter(), 0
        deadline = time.monotonic() + self.timeout_s  # one budget for all peers of the version
        self._waiting = (f"weights version {version} to be staged for generator ranks "
                         f"{sorted(self.peers)} ({self.memory.label})")
        with torch.no_grad():
            for d in self.peers:
                nbytes += self._stage(d, version, after, deadline)
            if self.zero_copy:  # announced to all first, so the peers read in parallel
                for d in self.peers:
                    self._wait_released(d, 0, deadline, self._abandoned)
        dt = time.perf_counter() - t0
        self.history.append({"version": version, "bytes": nbytes, "seconds": dt,
                             "gbps": nbytes / dt / 1e9 if dt > 0 else 0.0})

    def _stage(self, d: int, version: int, after, deadline: float) -> int:
        k = self.next_slot[d]
        self._wait_released(d, k, deadline, self._abandoned)
        if self.zero_copy:  # nothing to copy: only the update that made `version` must be done
            what = (f"trainer rank {self.rank}'s update to weights version {version} (the "
                    f"parameters generator rank {d} reads)")
            self.memory.run(lambda: None, after, deadline, what, self._abandoned)
        else:
            dsts, srcs = self.fills[d][k]
            what = (f"trainer rank {self.rank}'s copy of weights version {version} into "
                    f"{self.memory.label} staging buffer {k} for generator rank {d}")
            self.memory.run(lambda: stream.copy_all(dsts, srcs, self.foreach), after, deadline,
                            what, self._abandoned)
        self.held[d][k] = version
        self.next_slot[d] = (k + 1) % len(self.held[d])
        self.control.publish_ready(self.rank, d, version, k)
        return self.numel[d] * self.dtype.itemsize

    def _wait_released(self, d: int, k: int, deadline: float, watch: Callable[[], None]) -> None:
        """Slot k (zero copy: the parameters) may be overwritten only once the receiver acked
        the version it holds."""
        held = self.held[d][k]
        if held is None:
            return
        what = ("the parameters it reads" if self.zero_copy
                else f"{self.memory.label} staging buffer {k}")
        self._waiting = f"generator rank {d} to ack weights version {held} ({what})"
        poll_until(lambda: True if self.control.acked(self.rank, d, k) == held else None, deadline,
                   lambda: f"trainer rank {self.rank}: generator rank {d} has not acked weights "
                           f"version {held} after {self.timeout_s:g}s, so {what} cannot be "
                           f"changed (last ack: {self.control.acked(self.rank, d, k)})",
                   watch=watch)

    def close(self) -> None:
        """Wait until every staged version was copied out, so the buffers can be freed. After a
        failed wait on the generators (one missed its deadline or shut down), close() waits no
        more: that generator already had its timeout, and the caller is handling the error (a
        cleanup's close() held the failing trainer for another whole timeout_s, then raised the
        same error again)."""
        if self._failed:
            return
        self.wait_sent()
        deadline = time.monotonic() + self.timeout_s
        try:
            for d, slots in self.held.items():
                for k in range(len(slots)):
                    self._wait_released(d, k, deadline, self._watch_here)
                    slots[k] = None
        except BaseException:
            self._failed = True
            raise


class IpcReceiver:
    """`WeightReceiver`'s interface (`receive(v) -> apply`) for source peers on this GPU.

    `direct=False` (the protocol of the module docstring): receive() copies each source's slot
    into this rank's staging and acks at once; apply() scatters the staging. `direct=True`: no
    staging (one model copy less in GPU memory, one device copy less per version); receive() only
    waits for the announcements, apply() scatters straight from the mapped slots and then acks,
    so the trainer's slot stays taken until the generator's safe point. A version received but
    never applied is released (acked) by the next receive(). A zero-copy sender (`buffers=0`)
    shares its parameter shards instead of slots; both modes then read the boxes out of them.
    `watch`: as IpcSender's, for receive()'s waits on the trainer."""

    def __init__(self, model, plan, rank: int, timeout_s: float,
                 peers: Collection[int] | None = None, store=None, channel: str = "weights",
                 direct: bool = False):
        self.rank, self.timeout_s, self.direct = rank, timeout_s, direct
        self.tensors = _local_tensors(model)
        some = next(iter(self.tensors.values()))
        self.dtype, self.device = some.dtype, some.device
        self.foreach = _foreach_default(self.device)
        self.memory = shared_memory_for(self.device)
        self.control = Control(store, channel)
        self.transfers = {s: ts for s, ts in plan.recvs_to(rank).items()
                          if peers is None or s in peers}
        self.peers = {s: stream.segments(ts, "dst") for s, ts in self.transfers.items()}
        check_shards(self.tensors, plan.dst, rank, self.peers, "generator")
        self.numel = {s: stream.stream_numel(segs) for s, segs in self.peers.items()}
        self.staging = {} if direct else {
            s: torch.empty(n, dtype=self.dtype, device=self.device) for s, n in self.numel.items()}
        # copy targets, built once: the parameters' boxes, and (staged) the staging's parts
        self.params = {s: stream.box_views(segs, self.tensors) for s, segs in self.peers.items()}
        self.parts = {s: stream.part_views(self.staging[s], segs)
                      for s, segs in self.peers.items() if not direct}
        # staged apply: every source's staging parts into the parameters, one list for all
        self._apply_pairs = ([v for s in self.parts for v in self.params[s]],
                             [v for s in self.parts for v in self.parts[s]])
        self.sources: dict[int, list[list[torch.Tensor]]] = {}  # src -> per slot, its boxes
        self._unapplied: tuple[int, dict[int, int]] | None = None  # direct: (version, slots)
        self.staged_version: int | None = None  # staged: what the staging holds (`staged_apply`)
        self.history: deque[dict] = deque(maxlen=HISTORY)
        self.watch: Callable[[str], None] | None = None

    def _watch_for(self, what: Callable[[], str]) -> Callable[[], None] | None:
        """poll_until's watch for a wait on `what()` (built lazily: only an error needs it)."""
        return None if self.watch is None else lambda: self.watch(what())

    @property
    def staging_bytes(self) -> int:
        return sum(f.numel() * f.element_size() for f in self.staging.values())

    def _open(self, s: int, deadline: float) -> None:
        """Map source s's shared memory (once) and build the views the copies read."""
        if s in self.sources:
            return
        info = poll_until(lambda: self.control.handles(s, self.rank), deadline,
                          lambda: f"generator rank {self.rank}: trainer rank {s} published no "
                                  f"{self.memory.label} handles within {self.timeout_s:g}s",
                          watch=self._watch_for(
                              lambda: f"trainer rank {s}'s {self.memory.label} handles"))
        if info["kind"] != self.memory.kind:
            raise ValueError(f"generator rank {self.rank}: trainer rank {s} shares memory of "
                             f"kind {info['kind']!r}, this rank uses {self.memory.kind!r} (it "
                             f"runs on {self.device}): one side is on a GPU, the other on CPU, "
                             f"yet their placements (make_sender/make_receiver's gpu_of) paired "
                             f"them for shared memory; put both ranks on the same kind of device")
        if info["mode"] == "params":
            self.sources[s] = [self._param_sources(s, info["params"])]
            return
        if info["dtype"] != _dtype_name(self.dtype):
            raise ValueError(f"generator rank {self.rank}: trainer rank {s} stages dtype "
                             f"{info['dtype']}, this rank expects {_dtype_name(self.dtype)}; the "
                             f"trainer must cast to the generator dtype")
        if info["numel"] != self.numel[s]:
            raise ValueError(f"generator rank {self.rank}: trainer rank {s} stages "
                             f"{info['numel']} elements, this rank expects {self.numel[s]}: their "
                             "plans differ; plan both ends from the same layouts "
                             "(plan_between_meshes)")
        self.sources[s] = [stream.part_views(self.memory.open(h), self.peers[s])
                           for h in info["buffers"]]

    def _param_sources(self, s: int, handles: dict) -> list[torch.Tensor]:
        mapped = {n: self.memory.open(h) for n, h in handles.items()}
        views = []
        for t in self.transfers[s]:
            src = mapped.get(t.param)
            ends = tuple(o + n for o, n in zip(t.src_box.offsets, t.src_box.sizes))
            if src is None or len(ends) != src.dim() or any(e > n for e, n in zip(ends, src.shape)):
                raise ValueError(f"generator rank {self.rank}: trainer rank {s} shares "
                                 f"{t.param!r} with shape {None if src is None else tuple(src.shape)}"
                                 f", which does not hold the planned box {t.src_box}; the two "
                                 f"ranks planned with different layouts")
            views.append(src[t.src_box.slices()])
        return views

    def ready(self, version: int) -> bool:
        """Non-blocking: has every source announced `version` (receive() would not wait)?"""
        return all(self.control.is_ready(s, self.rank, version) for s in self.peers)

    def receive(self, version: int):
        """Wait for `version` from every source (copying it into staging and acking, unless
        direct); return `apply()` for the engine's safe point."""
        t0 = time.perf_counter()
        deadline = time.monotonic() + self.timeout_s
        if self._unapplied is not None:
            self._release(*self._unapplied)
        after = self.memory.marker()  # an earlier apply() may still read the staging
        for s in self.peers:
            self._open(s, deadline)
        slots: dict[int, int] = {}
        pending = list(self.peers)
        if not self.direct:  # the staging is about to be refilled, maybe only in part (a timeout):
            self.staged_version = None  # no earlier apply() may install it (staged_apply)

        def step():  # take whichever sources are ready, in any order
            for s in list(pending):
                k = self.control.take_ready(s, self.rank, version)
                if k is None:
                    continue
                slots[s] = k
                if not self.direct:
                    dsts, srcs = self.parts[s], self.sources[s][k]
                    what = (f"generator rank {self.rank}'s copy of weights version {version} out "
                            f"of trainer rank {s}'s {self.memory.label} slot {k}")
                    self.memory.run(lambda: stream.copy_all(dsts, srcs, self.foreach), after,
                                    deadline, what, self._watch_for(lambda: what))
                    self.control.ack(s, self.rank, k, version)
                pending.remove(s)
            return True if not pending else None

        poll_until(step, deadline, lambda: self._timeout_message(version, pending),
                   watch=self._watch_for(lambda: f"weights version {version} from trainer "
                                                f"rank(s) {pending} ({self.memory.label})"))
        nbytes = sum(self.numel.values()) * self.dtype.itemsize
        dt = time.perf_counter() - t0
        self.history.append({"version": version, "bytes": nbytes, "seconds": dt,
                             "gbps": nbytes / dt / 1e9 if dt > 0 else 0.0})
        if not self.direct:
            self.staged_version = version
            return staged_apply(self, version)
        self._unapplied = (version, slots)
        return lambda: self._apply_direct(version, slots)

    def _timeout_message(self, version: int, pending: list[int]) -> str:
        latest = {s: self.control.latest(s, self.rank) for s in pending}
        return (f"generator rank {self.rank} timed out after {self.timeout_s:g}s waiting for "
                f"weights version {version} from trainer rank(s) {pending} over "
                f"{self.memory.label} (latest "
                f"version each announced: {latest})")

    @torch.no_grad()
    def _apply(self) -> None:
        stream.copy_all(*self._apply_pairs, self.foreach)

    @torch.no_grad()
    def _apply_direct(self, version: int, slots: dict[int, int]) -> None:
        if self._unapplied is None or self._unapplied[0] != version:
            raise RuntimeError(f"generator rank {self.rank}: apply() of weights version {version} "
                               f"after a later receive() released it; apply before receiving again")
        dsts = [v for s in slots for v in self.params[s]]
        srcs = [v for s, k in slots.items() for v in self.sources[s][k]]
        what = (f"generator rank {self.rank}'s apply of weights version {version} from trainer "
                f"rank(s) {sorted(slots)} ({self.memory.label}, direct)")
        # after the engine's queued steps (the marker); the slots are released once it is done
        self.memory.run(lambda: stream.copy_all(dsts, srcs, self.foreach), self.memory.marker(),
                        time.monotonic() + self.timeout_s, what, self._watch_for(lambda: what))
        self._release(version, slots)

    def _release(self, version: int, slots: dict[int, int]) -> None:
        for s, k in slots.items():
            self.control.ack(s, self.rank, k, version)
        self._unapplied = None
