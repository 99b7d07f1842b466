"""Process groups, device placement and the two meshes, built from a `ParallelDims`.

Every rank constructs both DeviceMeshes (creating a sub-group is collective over the world), but
only uses the one(s) it belongs to. After start-up there are no collectives spanning both meshes.
"""
from __future__ import annotations

import math
import os
import socket
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from parallel.dims import ParallelDims


def all_gather_flat(output: torch.Tensor, input: torch.Tensor, group=None):
    """Every rank's `input` into `output` (rank order, one flat tensor). torch 2.13 renamed
    all_gather_into_tensor to all_gather_single and warns (a FutureWarning per rank) on the old
    name; torch 2.11 (the GPU machine's) has only the old one."""
    return getattr(dist, "all_gather_single", dist.all_gather_into_tensor)(output, input, group=group)


def pick_device(local_rank: int | None = None) -> torch.device:
    """`LOCAL_RANK % device_count` with CUDA (several ranks may share one GPU), else CPU."""
    if local_rank is None:
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if torch.cuda.is_available() and torch.cuda.device_count() > 0:
        return torch.device("cuda", local_rank % torch.cuda.device_count())
    return torch.device("cpu")


def pin_malloc() -> bool:
    """Pin glibc's allocator policy for this process: mmap threshold at its 32 MiB maximum, no
    trimming. glibc otherwise moves the threshold with the sizes freed so far and hands freed
    memory back to the kernel, so the tensors a step allocates and frees again page-fault afresh
    every step, or not, depending on what ran before. CPU ranks call it at start
    (`init_process_group`): SmolLM2's train step on one core took 0.88-0.89x the time (page
    faults 418k -> 79k a step; its 105 MB logits still come from mmap, above any threshold glibc
    allows); benches call it so that contenders timed in one process cannot slow each other
    through it (BENCHMARKS.md, "Generation": HF generate took 1.09-1.37 s for the same work
    depending on that history). False where glibc's mallopt is not available (nothing changed)."""
    import ctypes
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    m_trim_threshold, m_mmap_threshold = -1, -3  # glibc's malloc.h
    return bool(mallopt(m_mmap_threshold, 32 << 20)) and bool(mallopt(m_trim_threshold, 1 << 30))


def is_timeout(e: RuntimeError, deadline: float = math.inf) -> bool:
    """Whether a collective's error is its timeout: gloo says "Timed out", NCCL "... before
    timing out" (a bare "timeout" is no sign: NCCL's "either an error or timeout" is said of
    both); an error raised at the `deadline` (time.monotonic()) is one whatever it says."""
    text = str(e).lower()
    return "timed out" in text or "timing out" in text or time.monotonic() >= deadline


def backend_for(device: torch.device, requested: str = "cpu:gloo,cuda:nccl") -> str:
    """The configured backend on CUDA; plain gloo on a CPU-only machine (no NCCL there)."""
    return requested if device.type == "cuda" else "gloo"


def init_process_group(device: torch.device, backend: str, timeout_s: float) -> None:
    """This rank's process set up for `device` (a CPU rank pins its allocator, `pin_malloc`),
    then its default process group."""
    if dist.is_initialized():
        return
    if device.type == "cuda":
        torch.cuda.set_device(device)
    else:
        pin_malloc()  # freed host memory is reused, not page-faulted afresh every step
    timeout = timedelta(seconds=timeout_s)
    dist.init_process_group(backend=backend_for(device, backend), timeout=timeout,
                            **_attempt_store(timeout))


def shutdown_barrier(timeout_s: float, group=None) -> None:
    """Wait until every rank arrives, for at most `timeout_s`. On a gloo group (CPU) rank 0 names
    the ranks that did not arrive (monitored_barrier) and the others that rank 0 did not answer; a
    bare barrier's time-out says neither. torch has monitored_barrier for plain gloo groups only:
    others ("cpu:gloo,cuda:nccl" on GPUs) take a barrier under the group's timeout, set to
    `timeout_s` first (warm-up over, it was parallel.timeout_s: the final export's longer wait
    was cut to it)."""
    timeout = timedelta(seconds=timeout_s)
    t0 = time.monotonic()
    try:
        if dist.get_backend(group) != "gloo":
            from torch.distributed.distributed_c10d import _set_pg_timeout  # no public API yet
            _set_pg_timeout(timeout, group)
            dist.barrier(group=group)
        else:
            dist.monitored_barrier(group=group, timeout=timeout, wait_all_ranks=True)
    except RuntimeError as e:
        what = f"rank {dist.get_rank()}: the shutdown barrier (every rank of both meshes done)"
        # gloo says "failed to pass monitoredBarrier in <timeout> ms" of a rank that died at once
        # too: only the clock tells a time-out ("timed out after 1800s", half a second in)
        if is_timeout(e, deadline=t0 + 0.95 * timeout_s):
            raise TimeoutError(f"{what} timed out after {timeout_s:g}s: {e}") from e
        raise ConnectionError(f"{what} failed after {time.monotonic() - t0:.1f}s of its "
                              f"{timeout_s:g}s, not timed out (a rank left the group, or the "
                              f"backend failed): {e}") from e


def _attempt_store(timeout: timedelta) -> dict:
    """Under torchrun the workers share the agent's TCPStore, which outlives a restart: with the
    default env:// rendezvous a restarted job reads the dead attempt's gloo addresses and fails
    ("Gloo connectFullMesh failed ... Connection refused", seen with torch 2.13). A prefix per
    attempt (TORCHELASTIC_RESTART_COUNT) gives every attempt clean keys on one node. Across nodes
    the count disagrees (it is per node: an agent that restarts for another node's failure does
    not count it), so multi-node jobs take a store per rendezvous round instead
    (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, as launch/tandem.sbatch sets; then this is not used)."""
    if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") != "True":
        return {}  # plain env:// (tests, mp.spawn, other launchers; a store per round)
    env = os.environ
    if int(env.get("GROUP_WORLD_SIZE", "1")) > 1 and env.get("RANK") == "0":
        print("warning: torchrun shares its store across restarts on several nodes, whose restart "
              "counts can disagree after a failure (the restart then fails or costs another): "
              "export TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 before torchrun (launch/tandem.sbatch "
              "does)", file=sys.stderr, flush=True)
    client = dist.TCPStore(env["MASTER_ADDR"], int(env["MASTER_PORT"]), int(env["WORLD_SIZE"]),
                           is_master=False, timeout=timeout)
    store = dist.PrefixStore(f"tandem/attempt{env.get('TORCHELASTIC_RESTART_COUNT', '0')}/", client)
    return {"store": store, "rank": int(env["RANK"]), "world_size": int(env["WORLD_SIZE"])}


@dataclass
class Meshes:
    """This rank's view of the world. Ask for meshes by name; there is no global state."""

    dims: ParallelDims
    rank: int
    device: torch.device
    trainer: DeviceMesh | None = None  # (fsdp, tp), None on generator-only ranks
    generator: DeviceMesh | None = None  # (dp, tp), None on trainer-only ranks
    gpu_of: dict[int, tuple] = field(default_factory=dict)  # rank -> (host, gpu index, uuid)
    trainer_group: object = None  # process group over the whole trainer mesh (this rank's side)
    generator_group: object = None
    weights_group: object = None  # point-to-point weight sync (gloo on CPU, NCCL across GPUs)

    def set_timeouts(self, seconds: float) -> None:
        """Collectives of this rank's groups wait at most `seconds`: the start-up budget
        (config.warmup_budget_s) from the meshes' creation, parallel.timeout_s after warm-up
        (model load, compile, first step), the start-up budget again for the run's end. Twice
        that in the groups where ranks wait for their leader's decisions (trainer rank 0's batch
        broadcast, a generator TP group's message broadcast), while the leader itself waits up to
        `seconds` on the other mesh: its error, which it sends them, comes first (at equal
        timeouts they failed with a bare gloo time-out, and torchrun's teardown could cut the
        leader's off)."""
        from torch.distributed.distributed_c10d import _set_pg_timeout  # no public API yet
        groups = [None, self.generator_group, self.weights_group]
        for mesh in (self.trainer, self.generator):
            if mesh is not None:
                groups += [mesh.get_group(name) for name in mesh.mesh_dim_names
                           if (mesh is self.trainer or name != "tp")]
        for g in groups:  # None is the default group
            _set_pg_timeout(timedelta(seconds=seconds), g)
        followers = [self.trainer_group]
        if self.generator is not None:
            followers.append(self.generator.get_group("tp"))
        for g in followers:  # not the default group: a mesh dimension over the whole world is
            # it (colocated gen_tp = world), and every collective on it then waited twice as long
            if g is not None and g is not dist.group.WORLD:
                _set_pg_timeout(timedelta(seconds=2 * seconds), g)

    @property
    def role(self) -> str:
        return self.dims.role(self.rank)

    def same_gpu_peers(self, rank: int | None = None) -> list[int]:
        """Other ranks on the same physical GPU: weight sync uses CUDA IPC with them."""
        rank = self.rank if rank is None else rank
        me = self.gpu_of.get(rank)
        return [r for r, g in self.gpu_of.items() if r != rank and same_gpu(me, g)]


def _placement(device: torch.device) -> tuple[str, int, str]:
    """(host, CUDA index as this process sees it, the GPU's UUID); on CPU (host, -1, the host
    memory's identity: `host_memory_id`)."""
    if device.type != "cuda":
        return socket.gethostname(), -1, host_memory_id()
    uuid = getattr(torch.cuda.get_device_properties(device), "uuid", "")
    return socket.gethostname(), device.index, str(uuid)


def host_memory_id(boot_id_file: str = "/proc/sys/kernel/random/boot_id") -> str:
    """What identifies the memory a CPU process can share with others: the host name and the
    kernel's boot id, which differ between two machines even where their host names are alike
    (cloned containers). "" where there is no boot id (not Linux): no shared-memory weight sync."""
    try:
        with open(boot_id_file) as f:
            boot = f.read().strip()
    except OSError:
        return ""
    return f"{socket.gethostname()}/{boot}" if boot else ""


def shared_host_memory(a: tuple | None, b: tuple | None) -> bool:
    """Two CPU placements whose processes can share memory (weights_sync/ipc.py's CpuShmMemory)."""
    def key(g):
        return g[2] if g is not None and g[1] < 0 and len(g) > 2 and g[2] else None
    return key(a) is not None and key(a) == key(b)


def gpu_key(g: tuple | None) -> tuple | None:
    """What identifies the physical GPU of a placement: its UUID where known, since the index
    depends on each process's CUDA_VISIBLE_DEVICES (SLURM's per-task binding shows every task its
    GPU as cuda:0); else (host, index). None on CPU."""
    if g is None or g[1] < 0:
        return None
    return ("uuid", g[2]) if len(g) > 2 and g[2] else (g[0], g[1])


def same_gpu(a: tuple | None, b: tuple | None) -> bool:
    ka = gpu_key(a)
    return ka is not None and ka == gpu_key(b)


def check_no_duplicate_gpu(groups: list[list[int]], gpu_of: dict[int, tuple], what: str):
    """NCCL refuses two ranks on one GPU ("Duplicate GPU detected"): refuse such a mesh up front."""
    for group in groups:
        seen: dict[tuple, int] = {}
        for r in group:
            g, key = gpu_of[r], gpu_key(gpu_of[r])
            if key is not None and key in seen:
                raise ValueError(
                    f"{what} group {group} puts ranks {seen[key]} and {r} on the same GPU {g[0]}:cuda:{g[1]}; "
                    f"NCCL cannot run a collective over two ranks of one GPU ('Duplicate GPU detected'). "
                    f"Give each rank of a mesh its own GPU (launch more GPUs, or lower that mesh's "
                    f"degrees); ranks of *different* meshes may share a GPU and sync by CUDA IPC")
            if key is not None:
                seen[key] = r


def mesh_groups(grid: list[list[int]]) -> list[list[int]]:
    """The rank groups of a 2-D mesh that run NCCL collectives: its rows, its columns, and the
    whole mesh (its own group: the trainer's or the generator's), where a repeat on the diagonal
    (fsdp 2 x tp 2 on 3 GPUs: ranks 0 and 3) shows in no row or column."""
    rows = [list(row) for row in grid]
    cols = [list(c) for c in zip(*grid)]
    whole = [[r for row in grid for r in row]] if len(rows) > 1 and len(cols) > 1 else []
    return rows + cols + whole


def build_meshes(dims: ParallelDims, device: torch.device) -> Meshes:
    """Collective over the world: every rank must call it, in the same order."""
    rank = dist.get_rank()
    if dist.get_world_size() != dims.world_size:
        raise ValueError(f"the process group has {dist.get_world_size()} ranks but the layout "
                         f"expects world_size={dims.world_size}: {dims.describe()}")
    gathered: list = [None] * dims.world_size
    dist.all_gather_object(gathered, _placement(device))
    gpu_of = dict(enumerate(gathered))
    t_grid, g_grid = dims.trainer_mesh_ranks(), dims.generator_mesh_ranks()
    check_no_duplicate_gpu(mesh_groups(t_grid), gpu_of, "trainer mesh")
    check_no_duplicate_gpu(mesh_groups(g_grid), gpu_of, "generator mesh")
    dev_type = device.type
    tmesh = DeviceMesh(dev_type, torch.tensor(t_grid), mesh_dim_names=("fsdp", "tp"))
    gmesh = DeviceMesh(dev_type, torch.tensor(g_grid), mesh_dim_names=("dp", "tp"))
    tgroup = dist.new_group(dims.trainer_rank_list)  # collective: every rank creates both
    ggroup = dist.new_group(dims.generator_rank_list)
    # Weight bytes get their own communicator, so the background sender never shares one with
    # the link or with FSDP's collectives.
    wgroup = dist.new_group(backend="nccl" if dev_type == "cuda" else "gloo")
    is_t, is_g = dims.is_trainer(rank), dims.is_generator(rank)
    return Meshes(dims, rank, device, trainer=tmesh if is_t else None,
                  generator=gmesh if is_g else None, gpu_of=gpu_of,
                  trainer_group=tgroup if is_t else None, generator_group=ggroup if is_g else None,
                  weights_group=wgroup)
