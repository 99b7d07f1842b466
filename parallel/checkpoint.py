"""Sharded checkpoints (torch.distributed.checkpoint), Hugging Face export and JSON-able RNG state.

A checkpoint is a directory `<root>/step_000123/` holding
  - the DCP files: every trainer rank writes only its own shards of the model and optimizer state
    (DTensors from FSDP2/TP), so resume works without any rank holding the full model, and DCP
    reshards on load if the trainer layout changed;
  - `extra.json`: plain JSON written by trainer rank 0 (policy version, data cursor, buffer
    contents, RNG states as lists). JSON, not pickle: it is readable, diffable and safe to load.
Saves are atomic: everything goes to `step_000123.tmp/`, and rank 0 renames it only after every
rank has finished writing. `latest_checkpoint` never returns a `.tmp` directory, so a crash during
a save leaves the previous checkpoint as the one resumed from. Saving a step that exists moves the
old folder aside to `step_000123.old/` first; a crash between that rename and the next leaves no
`step_000123/`, and the `.old` folder (complete) stands for it until that step is saved again.

Every function that takes `group` is collective over it: pass a process group spanning every
trainer rank (and no generator rank). `None` means the default group, or no group at all when
torch.distributed is not initialised. All ranks must see the same file system at `path`.
"""
from __future__ import annotations

import json
import logging
import os
import random
import re
import shutil
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)
from torch.distributed.tensor import DTensor

from model.hf_io import (INDEX_FILE, SINGLE_FILE, _split_shards, expected_tensors, save_file,
                         to_dtype)
from parallel.mesh import is_timeout

EXTRA_FILE = "extra.json"
_STEP_DIR = re.compile(r"step_(\d+)(\.old)?")  # full match: "step_000123.tmp" is never one
_ASIDE = ".old"  # suffix of a finished folder moved aside while a new one replaces it (_replace_dir)


# ----- directory naming, latest and pruning (pure file-system logic, no process group) ---------
def checkpoint_dir(root: str | os.PathLike, step: int) -> Path:
    """`<root>/step_000123`: zero-padded so that names sort like steps (up to a million)."""
    return Path(root) / f"step_{step:06d}"


def complete_checkpoints(root: str | os.PathLike) -> list[tuple[int, Path]]:
    """(step, dir) of every finished checkpoint under root, oldest first: a folder named like one
    with DCP's .metadata in it (written last; a half-copied folder lacks it, and 'auto' resumed
    from one and failed on every rank). A step's `.old` folder counts only where the step has no
    folder of its own: a save of that step again was cut off between `_replace_dir`'s renames,
    and the step was lost to every resume. Read only, so that every rank sees the same."""
    root = Path(root)
    if not root.is_dir():
        return []
    found: dict[int, Path] = {}
    for child in root.iterdir():
        m = _STEP_DIR.fullmatch(child.name)
        if m and (child / ".metadata").is_file():
            step = int(m.group(1))
            if m.group(2) is None or step not in found:  # the step's own folder wins
                found[step] = child
    return sorted(found.items())


def latest_checkpoint(root: str | os.PathLike) -> Path | None:
    """The finished checkpoint with the highest step under `root`, or None (a missing root too)."""
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def prune_checkpoints(root: str | os.PathLike, keep_last: int) -> list[Path]:
    """Delete all finished checkpoints but the newest `keep_last`; return what was deleted.
    Call it on one rank (trainer rank 0) after a save. In-progress `.tmp` directories are left alone."""
    if not isinstance(keep_last, int) or keep_last < 1:
        raise ValueError(f"keep_last must be an integer >= 1 (the checkpoint just saved is always "
                         f"kept), got {keep_last!r}")
    doomed = [d for _, d in complete_checkpoints(root)[:-keep_last]]
    for d in doomed:
        shutil.rmtree(d)
        # and the copy a save of that step cut off in its clean-up left aside (if d is not it)
        shutil.rmtree(_aside(d.with_name(d.name.removesuffix(_ASIDE))), ignore_errors=True)
    return doomed


# ----- process-group helpers ----------------------------------------------------------------
def _rank(group) -> int:
    return dist.get_rank(group) if dist.is_initialized() else 0


@contextmanager
def _together(group, what: str):
    """Run the block on this rank, then meet every rank of `group` (collective: a barrier that
    also carries errors). A block that raised on any rank raises on every rank: there its own
    error, elsewhere one naming the rank that failed and its cause. Work that one rank does alone
    (rank 0's renames and writes) or sees alone (a folder another node does not) left the others
    in the next collective until the group's timeout, failing with gloo's bare "Timed out
    waiting 3000ms for recv operation" (or "Connection closed by peer", once that rank exited)."""
    if not dist.is_initialized():
        yield
        return
    try:
        yield
    except Exception as e:
        _meet(group, what, f"{type(e).__name__}: {e}")
        raise
    _meet(group, what, None)


def _meet(group, what: str, error: str | None) -> None:
    """`_together`'s meeting: raises here for another rank's error, or where the meeting itself
    fails (a rank that never came), naming what every rank was to finish."""
    ranks = dist.get_process_group_ranks(group if group is not None else dist.group.WORLD)
    try:
        failed = _gather_errors(group, ranks, error)
    except RuntimeError as e:  # gloo: a time-out or a lost peer, both RuntimeError
        if error is not None:
            return  # this rank's own error is the one it raises
        kind = TimeoutError if is_timeout(e) else ConnectionError
        raise kind(f"rank {dist.get_rank()} waited for every rank of {ranks} to finish {what}, "
                   f"and gave up: {e}") from e
    others = {r: err for r, err in failed.items() if r != dist.get_rank()}
    if others and error is None:
        raise RuntimeError(f"rank {dist.get_rank()}: {what} failed on "
                           + "; ".join(f"rank {r}: {err}" for r, err in others.items()))


def _gather_errors(group, ranks: list[int], error: str | None) -> dict[int, str]:
    """{global rank: error} of the ranks of `group` that failed, on every rank. One small
    all-gather where none did (the cost of a barrier); the texts only where one did. CPU tensors:
    gloo's half of a "cpu:gloo,cuda:nccl" group, no device sync."""
    data = (error or "").encode()
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in ranks]
    dist.all_gather(sizes, torch.tensor([len(data)]), group=group)
    n = max(int(s) for s in sizes)
    if n == 0:
        return {}
    padded = torch.zeros(n, dtype=torch.uint8)
    padded[:len(data)] = torch.tensor(list(data), dtype=torch.uint8)
    texts = [torch.empty(n, dtype=torch.uint8) for _ in ranks]
    dist.all_gather(texts, padded, group=group)
    return {r: bytes(t[:int(k)].tolist()).decode(errors="replace")
            for r, t, k in zip(ranks, texts, sizes) if int(k)}


@contextmanager
def _quiet_single_process():
    """DCP warns that it "assumes" single-process mode without a process group; here that is the
    intent (single-device runs and tests), so the warning is noise."""
    with warnings.catch_warnings():
        if not dist.is_initialized():
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _aside(final: Path) -> Path:
    return final.with_name(final.name + _ASIDE)


def _replace_dir(tmp: Path, final: Path) -> None:
    """Rename `tmp` to `final`; an existing `final` (same step saved again) is moved aside first,
    because a directory rename cannot overwrite a non-empty directory. A crash between the two
    renames leaves `final.old`, which `complete_checkpoints` takes for `final`; the `.old` folder
    is deleted only once `final` is in place."""
    old = _aside(final)
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)  # also one that an earlier cut-off save left


def _fresh_tmp(final: Path, group) -> Path:
    """`final.tmp`, emptied of any leftovers from a crashed save, visible to every rank on return."""
    tmp = final.with_name(final.name + ".tmp")
    with _together(group, f"preparing {tmp}"):
        if _rank(group) == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
    return tmp


# ----- DCP save / load ----------------------------------------------------------------------
def _app_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer | None) -> dict:
    """{"model": ..., "optim": ...} keyed by parameter FQNs (the HF names), values sharded DTensors.
    get_state_dict gives an optimizer without state yet (fresh, before its first step) a zero
    state via a step with lr=0, so that DCP has tensors to load into."""
    if optimizer is None:
        return {"model": get_model_state_dict(model)}
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def _encode_extra(extra: dict | None) -> str | None:
    if extra is None:
        return None
    if not isinstance(extra, dict):
        raise ValueError(f"extra must be a dict of JSON-able values, got {type(extra).__name__}")
    try:
        return json.dumps(extra, indent=1, sort_keys=True, allow_nan=True)
    except TypeError as e:  # e.g. a tensor: convert with .tolist() / .item() first
        raise ValueError(f"extra must hold only JSON-able values (dict, list, str, int, float, bool, "
                         f"None): {e}; convert tensors with .tolist() or .item()") from None


def save_sharded(path: str | os.PathLike, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer | None = None, extra: dict | None = None,
                 group: dist.ProcessGroup | None = None) -> Path:
    """Write model (+ optimizer) shards and `extra.json` to `path`, atomically. Collective over
    `group`. Pass the same `extra` on every rank: it is validated everywhere (so that a bad value
    raises on all ranks instead of hanging the others) and written by rank 0. JSON turns tuples
    into lists."""
    final = Path(path)
    text = _encode_extra(extra)
    tmp = _fresh_tmp(final, group)
    if optimizer is not None and not optimizer.state:
        # no step taken yet (every one skipped as non-finite): `_app_state` would give the live
        # optimizer a state of step 1, and its first real update a bias correction 27% smaller
        # than the run's without this save; none is saved, and `load_sharded` keeps it fresh
        optimizer = None
    with _quiet_single_process():  # (DCP shares a rank's failure within the save itself)
        dcp.save(_app_state(model, optimizer), checkpoint_id=str(tmp), process_group=group)
    with _together(group, f"writing the shards of {final}"):
        pass  # every rank's shards (and DCP's metadata) are on disk before the rename
    # nobody returns (and e.g. prunes or resumes) before the rename; a failed one fails all
    with _together(group, f"renaming {tmp} to {final}"):
        if _rank(group) == 0:
            if text is not None:
                (tmp / EXTRA_FILE).write_text(text + "\n")
            _replace_dir(tmp, final)
    return final


def load_sharded(path: str | os.PathLike, model: torch.nn.Module,
                 optimizer: torch.optim.Optimizer | None = None,
                 group: dist.ProcessGroup | None = None) -> dict:
    """Load a `save_sharded` directory into a model (+ optimizer) built with the same parameter
    names; the parallel layout may differ (DCP reshards: a checkpoint saved by fsdp=2 loads into
    one process). Returns the `extra` dict ({} if none).
    Collective over `group`; every rank reads `extra.json` itself."""
    folder = Path(path)
    # every rank looks before any enters DCP's collectives: one that cannot see the folder (a
    # node without the mount) failed alone, the others waited in DCP until the group's timeout
    with _together(group, f"reading checkpoint {folder}"):
        if not (folder / ".metadata").is_file():
            latest = latest_checkpoint(folder.parent)
            raise ValueError(f"{folder} is not a finished checkpoint (no DCP .metadata file); "
                             f"latest finished checkpoint under {folder.parent}: {latest}")
        extra_file = folder / EXTRA_FILE
        extra = json.loads(extra_file.read_text()) if extra_file.is_file() else {}
    if folder.name.endswith(_ASIDE) and _rank(group) == 0:
        print(f"loading {folder}: the save that was replacing it was cut off between its renames "
              f"(no {folder.name.removesuffix(_ASIDE)}), so this earlier save of that step is "
              "the checkpoint", flush=True)
    if optimizer is not None and not _holds_optimizer(folder):
        optimizer = None  # saved before its first step (`save_sharded`): it stays fresh
    state = _app_state(model, optimizer)
    with _quiet_single_process():
        dcp.load(state, checkpoint_id=str(folder), process_group=group)
    if optimizer is None:
        set_model_state_dict(model, state["model"])
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    return extra


def _holds_optimizer(folder: Path) -> bool:
    """Whether a checkpoint's DCP metadata has optimizer state ("optim.*" entries)."""
    meta = dcp.FileSystemReader(str(folder)).read_metadata()
    return any(key.startswith("optim.") for key in meta.state_dict_metadata)


# ----- Hugging Face export ------------------------------------------------------------------
def _full_tensor(param: torch.Tensor) -> torch.Tensor:
    """The whole parameter; collective over its DTensor mesh, so every rank must call it."""
    return param.full_tensor() if isinstance(param, DTensor) else param


@contextmanager
def _no_redistribute_advice():
    """DTensor logs, once on every rank, that gathering a 2-D (fsdp x tp) parameter takes two
    all-gathers ("This is suboptimal ..."): advice for torch's developers, which filled an
    export's console with one warning per trainer rank. Errors still pass."""
    log = logging.getLogger("torch.distributed.tensor._redistribute")
    level = log.level
    log.setLevel(logging.ERROR)
    try:
        yield
    finally:
        log.setLevel(level)


@torch.no_grad()
def export_hf(model: torch.nn.Module, path: str | os.PathLike, tokenizer=None,
              group: dist.ProcessGroup | None = None, dtype: str | torch.dtype | None = None,
              max_shard_bytes: int = 5 * 2**30) -> Path:
    """Write a Hugging Face model folder (config.json + safetensors, an index when sharded) from a
    sharded `model.Transformer`, loadable by `transformers.AutoModelForCausalLM.from_pretrained`.

    Parameters are gathered one at a time (`full_tensor()`, collective: every rank of the model's
    mesh must call this). Rank 0 moves each to CPU and writes a safetensors file as soon as it has
    one file's worth; the other ranks drop it at once. Peak extra memory: one full tensor on the
    device, and one safetensors file (<= max_shard_bytes) in host memory on rank 0. The folder is
    written as `path.tmp` and renamed when complete. `dtype` casts on the way out (default: the
    parameters' own dtype); config.json records the dtype actually written."""
    final = Path(path)
    writer = _rank(group) == 0
    cfg = model.args.to_hf_config()  # first: args config.json cannot carry are refused on every
    tmp = _fresh_tmp(final, group)   # rank before anything is written (no `.tmp` left behind)
    params = dict(model.named_parameters(remove_duplicate=False))
    names = list(expected_tensors(model))  # same order on every rank: the gathers must line up
    out_dtype = to_dtype(dtype) if dtype is not None else params[names[0]].dtype
    # Plan the files on meta tensors (shapes and dtype only), then fill them one file at a time.
    plan = _split_shards({n: torch.empty(params[n].shape, dtype=out_dtype, device="meta")
                          for n in names}, max_shard_bytes)
    files = [SINGLE_FILE] if len(plan) == 1 else [
        f"model-{i:05d}-of-{len(plan):05d}.safetensors" for i in range(1, len(plan) + 1)]
    weight_map, total = {}, 0
    for fname, shard in zip(files, plan):
        tensors = {}
        for name in shard:
            with _no_redistribute_advice():
                full = _full_tensor(params[name].detach())
            if writer:
                tensors[name] = full.to(device="cpu", dtype=out_dtype).contiguous()
            del full
        # a failed write (a full disk) fails every rank here, not in the next file's gathers
        with _together(group, f"writing {tmp / fname}"):
            if writer:
                save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
                weight_map.update(dict.fromkeys(tensors, fname))
                total += sum(t.numel() * t.element_size() for t in tensors.values())
    with _together(group, f"finishing the export {final}"):
        if writer:
            _finish_export(tmp, final, cfg, out_dtype, tokenizer, weight_map, total, len(files))
    return final


def _finish_export(tmp: Path, final: Path, cfg: dict, out_dtype: torch.dtype, tokenizer,
                   weight_map: dict, total: int, n_files: int) -> None:
    """Rank 0's end of `export_hf`: the index (several files), config.json, the tokenizer, then
    the rename of `tmp` to `final`."""
    if n_files > 1:
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    cfg["torch_dtype"] = cfg["dtype"] = str(out_dtype).replace("torch.", "")
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    if tokenizer is not None:
        tokenizer.save(tmp)
    _replace_dir(tmp, final)


# ----- RNG state as JSON ----------------------------------------------------------------------
def seed_rngs(seed: int) -> None:
    """Seed this process's torch (every device) and Python `random` generators: what a trainer
    rank draws is then the run's (trainer.seed), and a resume restores it (`rng_state`)."""
    random.seed(seed)
    torch.manual_seed(seed)


def rng_state() -> dict:
    """This process's RNG states as plain lists: torch CPU, the current CUDA device (only if CUDA
    is already initialised: a process that never touched CUDA has no CUDA randomness to restore)
    and Python's `random`. Per rank: gather them (all_gather_object) to keep every rank's."""
    version, mt, gauss = random.getstate()
    state = {"python": [version, list(mt), gauss], "torch": torch.get_rng_state().tolist()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state().tolist()
    return state


def set_rng_state(state: dict) -> None:
    """Restore what `rng_state()` returned (after a JSON round trip); absent entries are skipped."""
    if "python" in state:
        version, mt, gauss = state["python"]
        random.setstate((version, tuple(mt), gauss))
    if "torch" in state:
        torch.set_rng_state(torch.tensor(state["torch"], dtype=torch.uint8))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(torch.tensor(state["cuda"], dtype=torch.uint8))
