"""The asynchronous link: every cross-mesh message goes through this module.

After start-up there are no collectives spanning both meshes, only typed point-to-point messages
between known peers over gloo (CPU tensors, so it works whatever the accelerator). Bulk weight bytes
travel through weights_sync/, announced and acknowledged here.

Wire format of one message from `src` to `dst`:
    body    uint8[nbytes] = UTF-8 JSON, sent first with gloo `isend` (tag TAG_BODY)
    header  a ticket n = store.add("<dst>/tickets", 1), then store key "<dst>/<n>" =
            JSON {type, version, src, nbytes}, in the job's TCPStore
    bell    store key "<dst>/bell", set after the header
    error   store key "error/<src>", the cause a failing rank left before its SHUTDOWNs (the first)
The store gives receivers a truly non-blocking poll (gloo's `Work.is_completed()` only turns true
inside `wait()`, so an irecv cannot be polled): a receiver reads its ticket counter, and for each
published header posts a receive for a body that is already on its way. Tickets from one sender
are increasing in its send order, and gloo matches messages of one (src, tag) in order, so bodies
pair with their headers. JSON (not pickle) means a corrupt peer cannot execute code, and it is
exact for ints and Python floats (repr round-trips), which is all a trajectory holds.

The bell makes an idle poll free. A watcher thread blocks in the store (over its own connection)
on this rank's bell, deletes it and flags the arrival; `poll()` reads the store only after that.
The generator polls before every decode step, and a store round trip took 0.5-0.7 ms when 4 ranks
shared 2 cores (its server, in torchrun's agent, waits for a core): ~15% of a generator's wall
time (BENCHMARKS.md, "Planner"). A ring that lands between the watcher's wake-up and its delete is
not lost: its header was written before it, so the receive that the flag triggers reads it.

Blocking waits (`wait_for`) always have a timeout, and the error names the peer and what was
awaited. Messages that arrive while waiting for something else are queued, not lost.

A failing rank waits a few seconds for each peer to take its SHUTDOWN (`broadcast_shutdown`); a
body not taken by then leaves with its sender. So the cause goes into the store first (`error`
above): a peer that reads the SHUTDOWN later (it was in a collective, or still starting up), or
whose connection to the rank broke, raises PeerError with it, not gloo's "Connection closed by
peer". Under torchrun the store lives in the agent and outlives the ranks; where every rendezvous
round has a store of its own (`_attempt`) it lives in global rank 0's process, and goes with it.
Ranks without a link (trainer ranks waiting for rank 0 in a collective) read it: `left_error`.
"""
from __future__ import annotations

import atexit
import itertools
import json
import math
import os
import sys
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass
from datetime import timedelta
from enum import IntEnum
from typing import Any

import torch
import torch.distributed as dist

from launch import preemption
from parallel.mesh import is_timeout

TAG_BODY = 12
# The watcher's store wait. Long: every timed-out wait logs a c10d warning; `close()` rings the
# bell to end it.
WATCH_S = 24 * 3600.0
# How often a sender with a full window looks whether its oldest message was taken (a receipt
# rings no bell; Link._wait_oldest): first after RECEIPT_POLL_S, then twice as long each time up
# to RECEIPT_POLL_MAX_S, so that senders blocked through a long trainer step (hundreds of
# generator replicas) cost the job's store a few calls a second each, not 100-300.
RECEIPT_POLL_S = 0.01
RECEIPT_POLL_MAX_S = 0.5
_WATCHED: "weakref.WeakSet[Link]" = weakref.WeakSet()  # links whose watcher runs


def _check_timeout(seconds: float, what: str) -> float:
    """A wait's timeout: NaN never passes its deadline (wait_for spun for ever) and inf is none."""
    if not isinstance(seconds, (int, float)) or not math.isfinite(seconds) or seconds < 0:
        raise ValueError(f"{what} needs a finite timeout_s >= 0 (hangs are bugs), got {seconds!r}; "
                         "pass a number of seconds (parallel.timeout_s)")
    return float(seconds)


def _attempt() -> str:
    """A key prefix per torchrun attempt where the workers share the agent's store, which outlives
    a restart (a restarted job must not read the tickets the crashed attempt left behind); none
    where every rendezvous round has a store of its own (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1,
    launch/tandem.sbatch). There the restart count would be wrong: it is per node, and a node
    whose agent restarts for another node's failure does not count it, so the two nodes' ranks
    wrote and read tickets under different prefixes and no message arrived."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return ""
    return os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") + "/"


def attempt_store(name: str, store=None):
    """The job's store (default: the process group's), its keys under `tandem/<name>/` and this
    torchrun attempt (`_attempt`)."""
    base = store if store is not None else dist.distributed_c10d._get_default_store()
    return dist.PrefixStore(f"tandem/{name}/{_attempt()}", base)


def left_error(rank: int, store=None) -> str | None:
    """The error that `rank` left in the job's store (default: the process group's) as it shut
    down (`Link.broadcast_shutdown`), or None: it left none, or the store went with it."""
    try:
        return _read_error(attempt_store("link", store), rank)
    except (RuntimeError, ValueError):  # no process group, no store
        return None


def leave_error(rank: int, error: str, store=None) -> None:
    """Leave `rank`'s cause in the job's store (default: the process group's) where its peers find
    it after it is gone (`left_error`); the first one stays: a second failure on the way out is
    not the cause. Best effort: a store gone too leaves nothing."""
    try:
        _write_error(attempt_store("link", store), rank, error)
    except (RuntimeError, ValueError):  # no process group, no store
        pass


def _write_error(store, rank: int, error: str) -> None:
    try:
        store.compare_set(f"error/{rank}", "", error[:4000])
    except RuntimeError:
        pass  # the store is gone: the SHUTDOWNs' bodies carry it as far as they get


def _read_error(store, rank: int) -> str | None:
    key = f"error/{rank}"
    try:
        return store.get(key).decode() if store.check([key]) else None
    except RuntimeError:  # the store is gone: it lived in that rank's process (module docstring)
        return None


@atexit.register
def _close_watched() -> None:
    """A watcher still blocked in the store when the interpreter tears down aborts the process
    (SIGABRT, seen in 1 of 6 runs of tests/test_link.py): end every one first."""
    for link in list(_WATCHED):
        link.close()


class Msg(IntEnum):
    TRAJECTORIES = 1  # generator -> buffer owner: one or more whole prompt groups
    WEIGHTS_READY = 2  # trainer -> generators: version v is staged, pull it
    ACK = 3  # generator -> trainer: version v applied
    CHECKPOINT = 4  # trainer -> generators: report in-flight prompt ids
    SHUTDOWN = 5  # either way: stop; payload may carry an error
    STATS = 6  # generator -> trainer: counters for metrics
    STOP = 7  # generator -> trainer: this rank got SIGTERM; stop at a step boundary (preemption)
    EVALUATING = 8  # generator -> trainer: a held-out evaluation of version v starts (or ends)


@dataclass
class Message:
    type: Msg
    version: int
    src: int
    payload: Any = None


class PeerError(RuntimeError):
    """A peer asked for shutdown because of an error; the message names it."""


class Link:
    """Typed point-to-point messages between this rank and known peers (see module docstring)."""

    def __init__(self, rank: int, peers: list[int], timeout_s: float, max_in_flight: int = 64,
                 store=None):
        self.rank, self.peers = rank, list(peers)
        self.timeout_s = _check_timeout(timeout_s, "Link")
        self.max_in_flight = max_in_flight
        self.store = attempt_store("link", store)
        self._next_ticket = 1  # next of my tickets to read
        self._queue: deque[Message] = deque()
        # (work, body, dst, type, header key) of every message not known to be received
        self._sends: deque[tuple[Any, torch.Tensor, int, Msg, str]] = deque()
        self._waiter = None  # a second store connection, the watcher's (_waiter_store)
        self._watcher: threading.Thread | bool | None = None  # started on the first receive
        self._arrived = threading.Event()  # the bell rang since the last receive
        self._closed = False
        # peers sent a SHUTDOWN: they read everything up to it (its body must be waited for, a
        # dropped gloo send never arrives), nothing after it
        self._shut: set[int] = set()
        self._gone: set[int] = set()  # peers that sent this rank a SHUTDOWN: they read nothing more
        self.bytes_sent = self.bytes_received = 0

    # ----- sending ----------------------------------------------------------------------------
    def send(self, dst: int, type: Msg, version: int, payload: Any = None) -> None:
        """Asynchronous; blocks (with timeout) only when `max_in_flight` bodies are unreceived
        (`_wait_window`)."""
        body = torch.frombuffer(bytearray(json.dumps(payload).encode()), dtype=torch.uint8)
        try:
            work = dist.isend(body, dst, tag=TAG_BODY)
        except RuntimeError as e:  # gloo refuses at once where the connection to dst broke
            raise self._broken(e, f"rank {dst} to receive a {type.name} message", dst) from None
        ticket = self.store.add(f"{dst}/tickets", 1)
        header = {"type": int(type), "version": version, "src": self.rank, "nbytes": body.numel()}
        self.store.set(f"{dst}/{ticket}", json.dumps(header))
        self.store.set(f"{dst}/bell", "1")
        self._sends.append((work, body, dst, type, f"{dst}/{ticket}"))
        if type == Msg.SHUTDOWN:
            self._shut.add(dst)
        self.bytes_sent += body.numel()
        while len(self._sends) > self.max_in_flight:
            self._wait_window()

    def _wait_window(self) -> None:
        """Bring the messages in flight back to half the window. One store look per receiver
        tells whether its messages among those were taken (their headers: the bodies are then on
        their way, and the gloo waits end at once): a receiver takes its headers in ticket order,
        so the newest taken means all are. A window of one peer's messages costs one look per
        max_in_flight / 2 sends (freed one slot at a time, every send beyond it would cost one)."""
        n = len(self._sends) - self.max_in_flight // 2
        newest = {dst: key for _, _, dst, _, key in itertools.islice(self._sends, n)}
        if any(self._unread(dst, key) for dst, key in newest.items()):
            self._wait_oldest()
            return
        for _ in range(n):
            self._pop_sent()

    def _unread(self, dst: int, key: str) -> bool:
        """The message with header `key` is not taken, and `dst` still reads."""
        return dst not in self._gone and self.store.check([key])

    def _wait_oldest(self) -> None:
        """Wait until the oldest message in flight is taken, or its receiver shut down: that one
        reads nothing more, and a blocking wait for it kept this rank from reading its SHUTDOWN.
        (A generator that shipped more than max_in_flight groups during the trainer's last step
        waited so for the trainer, which waited for it to take the final SHUTDOWN, until both
        timed out: the finished run failed.) The store is looked at ever less often
        (RECEIPT_POLL_S doubling up to RECEIPT_POLL_MAX_S); a gloo wait cannot be sliced, since
        one that times out breaks the process group (`_wait`)."""
        _, _, dst, type, key = self._sends[0]
        deadline, pause = time.monotonic() + self.timeout_s, RECEIPT_POLL_S
        while self._unread(dst, key):
            if self._shutdown_waiting(dst):
                self._gone.add(dst)
            elif time.monotonic() > deadline:
                raise TimeoutError(f"rank {self.rank} timed out after {self.timeout_s:.0f}s "
                                   f"waiting for rank {dst} to receive a {type.name} message "
                                   f"(it sends at most {self.max_in_flight} messages ahead)")
            else:
                time.sleep(min(pause, max(0.0, deadline - time.monotonic())))
                pause = min(2 * pause, RECEIPT_POLL_MAX_S)
        self._pop_sent()

    def _pop_sent(self) -> None:
        """The oldest message in flight, taken or never to be (its receiver shut down)."""
        if self._sends[0][2] in self._gone:
            self._sends.popleft()
        else:
            self._wait_send()

    def _shutdown_waiting(self, src: int) -> bool:
        """A SHUTDOWN from `src` is among this rank's messages not yet received (one received is
        in `_gone`). Read-only: the headers stay for `poll`, which receives it in its turn."""
        published = self.store.add(f"{self.rank}/tickets", 0)
        for n in range(self._next_ticket, published + 1):
            key = f"{self.rank}/{n}"
            if not self.store.check([key]):
                return False  # ticket taken, header not written yet: the next look
            header = json.loads(self.store.get(key))
            if header["type"] == Msg.SHUTDOWN and header["src"] == src:
                return True
        return False

    def _wait_send(self, timeout_s: float | None = None) -> None:
        work, _, dst, type, _ = self._sends.popleft()
        self._wait(work, f"rank {dst} to receive a {type.name} message", dst, timeout_s)

    def flush(self, timeout_s: float | None = None) -> None:
        """Wait until every message sent so far has been received, each for at most `timeout_s`
        (None: the link's)."""
        if timeout_s is not None:
            _check_timeout(timeout_s, "Link.flush")
        while self._sends:
            self._wait_send(timeout_s)

    # ----- receiving --------------------------------------------------------------------------
    def _receive_published(self) -> None:
        published = self.store.add(f"{self.rank}/tickets", 0)
        while self._next_ticket <= published:
            key = f"{self.rank}/{self._next_ticket}"
            if not self.store.check([key]):
                return  # ticket taken, header not written yet: next poll
            header = json.loads(self.store.get(key))
            self.store.delete_key(key)
            self._next_ticket += 1
            src = header["src"]
            try:
                payload = self._receive_body(src, header["nbytes"])
            except PeerError:  # its sender left before this rank took the body: the cause is
                if header["type"] != Msg.SHUTDOWN:  # in the store, the SHUTDOWN arrives with it
                    raise
                payload = {"error": self._left_error(src)}
            if header["type"] == Msg.SHUTDOWN:
                self._gone.add(src)
            self._queue.append(Message(Msg(header["type"]), header["version"], src, payload))

    def _receive_body(self, src: int, nbytes: int) -> Any:
        body = torch.empty(nbytes, dtype=torch.uint8)
        what = f"the body of a message from rank {src}"
        try:
            work = dist.irecv(body, src, tag=TAG_BODY)
        except RuntimeError as e:  # gloo refuses at once where the connection to src broke
            raise self._broken(e, what, src) from None
        self._wait(work, what, src)
        self.bytes_received += body.numel()
        return json.loads(bytes(body.numpy()).decode())

    def poll(self) -> list[Message]:
        """Every message that has arrived (queued first), without blocking on new ones. No store
        round trip unless the watcher saw the bell (or there is no watcher)."""
        if not self._watching() or self._arrived.is_set():
            self._arrived.clear()
            self._receive_published()
        out = list(self._queue)
        self._queue.clear()
        return out

    def put_back(self, messages: list[Message]) -> None:
        """Return consumed messages to the front of the queue, in order: the next `poll` or
        `wait_for` sees them first."""
        self._queue.extendleft(reversed(messages))

    def wait_for(self, types: set[Msg] | Msg, what: str, timeout_s: float | None = None,
                 peer: int | None = None, consume: bool = True) -> Message:
        """Block until a message of one of `types` arrives; others stay queued for `poll`.
        With `consume=False` the message stays queued too (wait now, handle it in order later).

        A SHUTDOWN from a peer raises PeerError at once (a crash on one side ends the other)."""
        types = {types} if isinstance(types, Msg) else set(types)
        timeout = self.timeout_s if timeout_s is None else _check_timeout(
            timeout_s, f"Link.wait_for ({what})")
        deadline = time.monotonic() + timeout
        while True:
            self._arrived.clear()
            self._receive_published()
            for m in list(self._queue):
                if m.type == Msg.SHUTDOWN and Msg.SHUTDOWN not in types:
                    raise PeerError(f"rank {m.src} shut down while rank {self.rank} waited for {what}: "
                                    f"{(m.payload or {}).get('error', 'no error given')}")
                if m.type in types and (peer is None or m.src == peer):
                    if consume:
                        self._queue.remove(m)
                    return m
            if time.monotonic() > deadline:
                who = f"rank {peer}" if peer is not None else f"ranks {self.peers}"
                raise TimeoutError(f"rank {self.rank} timed out after {timeout:.0f}s "
                                   f"waiting for {what} from {who}")
            self._await_next_header(deadline - time.monotonic())

    def _await_next_header(self, seconds: float) -> None:
        """Block until the bell rings (the watcher flags it), or `seconds` pass (then the caller's
        deadline check names what it waited for). Waking on the bell, not polling: a
        sleep-and-poll loop (0.1 ms doubling to 10 ms) added up to its interval to every hand-off
        between the meshes."""
        if seconds <= 0:
            return
        if self._watching():
            self._arrived.wait(seconds)
        else:  # a store without clone(): poll
            time.sleep(min(seconds, 1e-3))

    def _watching(self) -> bool:
        """Start the watcher once (module docstring); False where the store cannot be cloned or
        the watcher stopped."""
        if self._watcher is None:
            waiter = self._waiter_store()
            self._watcher = waiter is not None and threading.Thread(
                target=self._watch, args=(waiter,), name=f"link-watcher-{self.rank}", daemon=True)
            if self._watcher:
                _WATCHED.add(self)
                self._watcher.start()
        return bool(self._watcher) and not self._closed

    def _watch(self, waiter) -> None:
        bell = f"{self.rank}/bell"
        while not self._closed:
            try:
                waiter.wait([bell], timedelta(seconds=WATCH_S))
                waiter.delete_key(bell)
            except dist.DistStoreError:
                continue  # no ring within WATCH_S
            except Exception:  # the store is gone (the job is ending): receive on every poll
                self._closed = True
            self._arrived.set()

    def close(self, timeout_s: float = 5.0) -> None:
        """Stop the watcher: ring this rank's own bell and wait for the thread to end (before the
        interpreter shuts down under it). Later polls read the store themselves."""
        self._closed = True
        if isinstance(self._watcher, threading.Thread):
            try:
                self.store.set(f"{self.rank}/bell", "1")
            except Exception:
                pass  # the store is gone: the watcher's wait has failed already
            self._watcher.join(timeout_s)

    def _waiter_store(self):
        """A clone of the store (its own connection) for the watcher's blocking waits: a TCPStore
        client serves one request at a time, so a wait on the shared one would hold up every
        other thread's store call in this process (the CUDA-IPC sender's thread signals its
        versions through it) until a message arrived."""
        if self._waiter is None:
            try:
                self._waiter = self.store.clone()
            except (RuntimeError, NotImplementedError):
                self._waiter = False
        return self._waiter or None

    def _wait(self, work, what: str, peer: int, timeout_s: float | None = None) -> None:
        """A timed-out wait breaks the whole process group, not just this message: gloo then
        closes every pair of its context ("Application timeout caused pair closure"; the peers'
        next operation on the group fails with "Connection closed by peer")."""
        timeout_s = self.timeout_s if timeout_s is None else timeout_s
        try:
            work.wait(timeout=timedelta(seconds=timeout_s))
        except RuntimeError as e:  # gloo raises RuntimeError both for timeouts and for dead peers
            raise self._broken(e, what, peer, timeout_s) from None

    def _broken(self, e: RuntimeError, what: str, peer: int,
                timeout_s: float | None = None) -> Exception:
        """The error for a gloo operation with `peer` that failed: PeerError with the cause the
        peer left as it shut down (module docstring), else what gloo said."""
        cause = self._left_error(peer)
        if cause is not None:
            return PeerError(f"rank {peer} shut down while rank {self.rank} waited for {what}: {cause}")
        failure = preemption.recorded_failure()  # a node whose ranks torchrun ended
        if failure is not None:
            return PeerError(f"the run failed on another node: {failure} (rank {self.rank} lost "
                             f"rank {peer} while waiting for {what})")
        if is_timeout(e):
            return TimeoutError(f"rank {self.rank} timed out after "
                                f"{self.timeout_s if timeout_s is None else timeout_s:.0f}s "
                                f"waiting for {what} ({e})")
        return ConnectionError(f"rank {self.rank} lost its peer while waiting for {what} ({e})")

    def _left_error(self, peer: int) -> str | None:
        return _read_error(self.store, peer)

    def _leave_error(self, error: str) -> None:
        _write_error(self.store, self.rank, error)  # (`leave_error`, over this link's store)

    def broadcast_shutdown(self, error: str | None = None, timeout_s: float = 5.0,
                           announce: bool = True) -> None:
        """Best effort: tell every peer to stop (with the cause), waiting at most `timeout_s` a
        peer for it to arrive: a process that exits right after would take the message's body
        with it (the peer then failed on the missing body, without the cause). `announce`: print
        the error first, in case that wait ends in torchrun's teardown (SIGTERM) before this
        rank's traceback (not for Ctrl-C, which prints one line for the whole run).

        A peer that sent this rank a SHUTDOWN is not sent one (it reads nothing more), nor is one
        already sent a SHUTDOWN (an earlier broadcast, or the normal end's) sent another: it
        stops reading at the first, so the second's body was never received, the
        wait for it timed out, and that closed the process group under this rank (_wait): with
        two SHUTDOWNs sent back to back, 12 of 80 runs of the two-rank test failed in the
        harness's barrier under CPU load (all, when the second followed the first's flush)."""
        if error and announce:
            print(f"error (rank {self.rank}): {error}", file=sys.stderr, flush=True)
        if error:  # first: it reaches a peer that takes its SHUTDOWN after this rank is gone
            self._leave_error(error)
        for p in self.peers:
            if p in self._shut | self._gone:
                continue
            try:
                self.send(p, Msg.SHUTDOWN, -1, {"error": error} if error else None)
            except Exception:
                pass
        # what a peer that shut down has not taken, it never will: waiting for that first timed
        # out (breaking the process group) before the other peers' SHUTDOWNs were waited for
        self._sends = deque(e for e in self._sends if e[2] not in self._gone)
        try:
            self.flush(timeout_s)
        except Exception:
            self._sends.clear()  # a dead or busy peer: the cause goes to the log instead
