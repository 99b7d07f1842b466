"""Hugging Face checkpoint I/O: config.json + safetensors (single file or sharded with an index).

Nothing here unpickles: weights are read with safetensors only.
"""
from __future__ import annotations

import json
import os
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import save_file as _save_safetensors

from model.args import ModelArgs
from model.transformer import Transformer

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
LEGACY_ROPE_BUFFER = "rotary_emb.inv_freq"  # in names like model.layers.0.self_attn.rotary_emb.inv_freq
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
EMBED, HEAD = "model.embed_tokens.weight", "lm_head.weight"


def to_dtype(dtype: str | torch.dtype | None, default: str = "float32") -> torch.dtype:
    """'bfloat16' / torch.bfloat16 / None (-> default) to a torch dtype, with a clear error."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = (dtype or default).replace("torch.", "")
    if name not in DTYPES:
        raise ValueError(f"unsupported dtype {name!r}; choose one of {sorted(DTYPES)}")
    return DTYPES[name]


def save_file(tensors: dict, path: str, metadata: dict | None = None) -> None:
    """safetensors' `save_file`, the file then as readable as the umask makes any other: newer
    safetensors (0.8) create it 0600 through a temporary file, so an export's weights were
    unreadable to the rest of a cluster's group while its config.json and tokenizer were not."""
    _save_safetensors(tensors, path, metadata=metadata)
    readable_as_umask(path)


def readable_as_umask(*paths) -> None:
    """Give these files the mode a plain `open(..., "w")` gives (0666 less the umask)."""
    mode = 0o666 & ~_umask()
    for p in paths:
        os.chmod(p, mode)


def _umask() -> int:
    """This process's umask, read without setting it where Linux shows it (os.umask can only
    read it by changing it, for a moment, for every thread of the process)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except OSError:
        pass
    old = os.umask(0o022)
    os.umask(old)
    return old


def load_model_args(path: str | os.PathLike) -> ModelArgs:
    """Parse `<path>/config.json`; errors name the folder and what is missing."""
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(f"model folder {str(folder)!r} does not exist; pass a Hugging Face model "
                         f"folder containing config.json and *.safetensors")
    cfg_file = folder / "config.json"
    if not cfg_file.is_file():
        raise ValueError(f"{cfg_file} is missing: {str(folder)!r} is not a Hugging Face model folder")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{cfg_file}:{e.lineno}: invalid JSON ({e.msg})") from None
    return ModelArgs.from_hf_config(cfg, source=str(cfg_file))


class CheckpointReader:
    """Lazy access to the tensors of a model folder, by name, whole or by slice.

    Sharded loading (parallel/) reads only the slice a rank owns via `get_slice`.
    """

    def __init__(self, path: str | os.PathLike):
        self.folder = Path(path)
        self.file_of = _tensor_files(self.folder)  # tensor name -> file name
        self._handles: dict[str, object] = {}
        self._stored_as: dict[str, str] = {}  # `read_as`: model name -> name in the checkpoint
        self._check_files()

    def names(self) -> list[str]:
        return list(self.file_of)

    def read_as(self, name: str, stored: str) -> None:
        """Read tensor `name` from the checkpoint's tensor `stored` from now on."""
        self.file_of[name], self._stored_as[name] = self.file_of[stored], stored

    def _file(self, fname: str):
        if fname not in self._handles:
            self._handles[fname] = _open(self.folder / fname)
        return self._handles[fname]

    def _check_files(self) -> None:
        """Every tensor is in the file the index names: an index that does not belong to its
        shards (hand-merged, or a shard re-saved) failed in safetensors naming no file."""
        listed: dict[str, set[str]] = {}
        for name, fname in self.file_of.items():
            listed.setdefault(fname, set()).add(name)
        wrong = [f"{name} ({fname})" for fname, names in sorted(listed.items())
                 for name in sorted(names - set(self._file(fname).keys()))]
        if wrong:
            raise ValueError(f"{self.folder / INDEX_FILE} lists tensors in shard files that do "
                             f"not hold them: {wrong}; the index does not belong to these "
                             "shards, re-save or re-download the checkpoint")

    def stored_name(self, name: str) -> str:
        """The checkpoint's name of model tensor `name` (another one after `read_as`)."""
        return self._stored_as.get(name, name)

    def _where(self, name: str):
        """The open file holding model tensor `name`, and its name there."""
        return self._file(self.file_of[name]), self.stored_name(name)

    def shape(self, name: str) -> tuple[int, ...]:
        f, stored = self._where(name)
        return tuple(f.get_slice(stored).get_shape())

    def get(self, name: str) -> torch.Tensor:
        f, stored = self._where(name)
        return f.get_tensor(stored)

    def get_slice(self, name: str, offsets, sizes) -> torch.Tensor:
        """The sub-tensor [offsets, offsets + sizes) without reading the rest of the tensor."""
        index = tuple(slice(o, o + n) for o, n in zip(offsets, sizes))
        f, stored = self._where(name)
        return f.get_slice(stored)[index]


def _open(file: Path):
    try:
        return safe_open(str(file), framework="pt")
    except Exception as e:  # safetensors raises its own error type for truncated headers/data
        raise ValueError(f"{file}: cannot read safetensors file ({e}); the file is truncated or "
                         f"corrupt, re-save or re-download it") from None


def _tensor_files(folder: Path) -> dict[str, str]:
    """Tensor name -> file. A folder with both the single file and an index is read from the
    single file, as transformers reads it."""
    index, single = folder / INDEX_FILE, folder / SINGLE_FILE
    if index.is_file() and not single.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            if not isinstance(weight_map, dict) or not all(isinstance(f, str)
                                                           for f in weight_map.values()):
                raise TypeError(f"weight_map is {json.dumps(weight_map)[:80]}")
        except (json.JSONDecodeError, KeyError, TypeError) as e:
            raise ValueError(f"{index}: not a safetensors index ({type(e).__name__}: {e}); it "
                             'needs {"weight_map": {tensor name: shard file}}: re-save or '
                             "re-download the checkpoint") from None
        missing = sorted({f for f in weight_map.values() if not (folder / f).is_file()})
        if missing:
            raise ValueError(f"{index} lists shard files that are missing: {missing}")
        return dict(weight_map)
    if not single.is_file():
        raise ValueError(f"{folder} has no {SINGLE_FILE} or {INDEX_FILE}; tandem reads "
                         f"safetensors only (convert .bin checkpoints first)")
    with _open(single) as f:
        return {name: SINGLE_FILE for name in f.keys()}


def expected_tensors(model: Transformer) -> dict[str, tuple[int, ...]]:
    """Checkpoint tensor names and full shapes of a model (tied heads are not stored)."""
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters(remove_duplicate=False)}
    if model.args.tie_word_embeddings:
        shapes.pop(HEAD, None)
    return shapes


def check_tensors(reader: CheckpointReader, expected: dict[str, tuple[int, ...]]) -> None:
    """Raise one ValueError listing every missing, unexpected or mis-shaped tensor. A tied
    model stored with its head only (`safetensors.torch.save_model` keeps the first name of a
    shared tensor, lm_head.weight) has `reader` read the embedding from the head, as
    transformers does."""
    # Old transformers saved each layer's rope buffer; it is recomputed from config.json (by
    # transformers too, which skips these names), so it is no weight to load.
    have = {n for n in reader.names() if not n.endswith(LEGACY_ROPE_BUFFER)}
    if HEAD not in expected and HEAD in have:
        if EMBED in expected and EMBED not in have:
            reader.read_as(EMBED, HEAD)
            have.add(EMBED)
        else:
            _check_stored_tied_head(reader, expected)  # some exporters store a copy anyway
        have.discard(HEAD)
    missing, unexpected = sorted(set(expected) - have), sorted(have - set(expected))
    problems = []
    if missing:
        problems.append(f"missing tensors: {missing}")
    if unexpected:
        problems.append(f"unexpected tensors: {unexpected}")
    for name in sorted(set(expected) & have):
        if reader.shape(name) != expected[name]:
            stored = reader.stored_name(name)  # the tied head-only checkpoint's lm_head.weight
            what = name if stored == name else f"{name} (stored as {stored})"
            problems.append(f"tensor {what}: checkpoint shape {list(reader.shape(name))} "
                            f"!= model shape {list(expected[name])}")
    if problems:
        raise ValueError(f"{reader.folder}: checkpoint does not match the model config: "
                         + "; ".join(problems))


def _check_stored_tied_head(reader: CheckpointReader, expected: dict[str, tuple[int, ...]]) -> None:
    """tie_word_embeddings is true and the checkpoint stores lm_head.weight too: a copy of the
    embedding is fine, but transformers keeps a different stored head, untied, where tying it
    here would silently replace it with the embedding.

    Compared a block of rows at a time, so no more than ~64 MiB of either is held (sharded
    loading calls this on every rank); a cost only checkpoints that store a tied head pay."""
    emb, head = EMBED, HEAD
    if emb not in reader.names() or reader.shape(emb) != expected.get(emb):
        return  # reported as missing or mis-shaped with the other tensors
    if reader.shape(head) != reader.shape(emb) or not _same_values(reader, emb, head):
        raise ValueError(f"{reader.folder}: {head} differs from {emb} but config.json sets "
                         "tie_word_embeddings true (transformers would load the stored head, "
                         "untied; tandem would tie it to the embedding). Set "
                         f'"tie_word_embeddings": false in {reader.folder / "config.json"} to '
                         f"train the stored head, or remove {head} from the checkpoint to tie it")


def _same_values(reader: CheckpointReader, a: str, b: str, block_bytes: int = 2**26) -> bool:
    """Whether two stored 2-D tensors of one shape hold equal values, read a block of rows at a
    time (fp32 copies of at most `block_bytes`)."""
    rows, cols = reader.shape(a)
    step = max(1, block_bytes // (4 * cols))
    for start in range(0, rows, step):
        n = min(step, rows - start)
        x, y = (reader.get_slice(name, (start, 0), (n, cols)).float() for name in (a, b))
        if not torch.equal(x, y):
            return False
    return True


def load_pretrained(path, device: str | torch.device = "cpu", dtype=None) -> Transformer:
    """Load a HF model folder. Built on the meta device, materialised once, filled tensor by tensor."""
    args = load_model_args(path)
    dt = to_dtype(dtype, default=args.torch_dtype)
    reader = CheckpointReader(path)
    with torch.device("meta"):
        model = Transformer(args).to(dt)
    check_tensors(reader, expected_tensors(model))
    model.to_empty(device=device)
    model.tie_weights()
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name in expected_tensors(model):
            params[name].copy_(reader.get(name))
    return model


def save_pretrained(model: Transformer, path, dtype=None, max_shard_bytes: int = 5 * 2**30,
                    tokenizer=None) -> None:
    """Write config.json + safetensors (sharded with an index above `max_shard_bytes`)."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    dt = to_dtype(dtype) if dtype else None
    state = model.state_dict()
    tensors = {n: (state[n].to(dt) if dt else state[n]).detach().contiguous().cpu()
               for n in expected_tensors(model)}
    args_cfg = model.args.to_hf_config()
    # Label the dtype written, not args.torch_dtype: a bf16 checkpoint trained in fp32 is saved
    # in fp32, and a loader defaulting to the label would cast it back to bf16.
    written = next(iter(tensors.values())).dtype
    args_cfg["torch_dtype"] = args_cfg["dtype"] = str(written).replace("torch.", "")
    shards = _split_shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        save_file(shards[0], str(folder / SINGLE_FILE), metadata={"format": "pt"})
        (folder / INDEX_FILE).unlink(missing_ok=True)
    else:
        _save_sharded(folder, shards)
    (folder / "config.json").write_text(json.dumps(args_cfg, indent=2, sort_keys=True) + "\n")
    if tokenizer is not None:
        tokenizer.save(folder)


def _split_shards(tensors: dict[str, torch.Tensor], max_bytes: int) -> list[dict]:
    shards, current, size = [], {}, 0
    for name, t in tensors.items():
        nbytes = t.numel() * t.element_size()
        if current and size + nbytes > max_bytes:
            shards.append(current)
            current, size = {}, 0
        current[name], size = t, size + nbytes
    return shards + [current] if current else shards


def _save_sharded(folder: Path, shards: list[dict]) -> None:
    weight_map, total = {}, 0
    for i, shard in enumerate(shards, 1):
        fname = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file(shard, str(folder / fname), metadata={"format": "pt"})
        for name, t in shard.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    (folder / INDEX_FILE).write_text(json.dumps(index, indent=2) + "\n")
    (folder / SINGLE_FILE).unlink(missing_ok=True)
