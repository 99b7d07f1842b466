"""Tokenizer loading: one small `Tokenizer` interface over Hugging Face and sentencepiece files.

tandem works in token ids end to end (prompts are encoded once, completions are never re-encoded),
so this module only has to answer a few questions well: the ids of a prompt, the text of ids for
rewards and logs, the special ids (BOS/EOS/pad/stop), and the chat-template rendering.

Two back ends, picked by the files in the model folder:
- `tokenizer.json` (every modern HF model): loaded with `transformers.AutoTokenizer` from local
  files only, which reads `tokenizer_config.json` / `chat_template.jinja` for the special tokens
  and the chat template.
- `tokenizer.model` only (older sentencepiece checkpoints): loaded with `sentencepiece` directly.
  We deliberately never construct `LlamaTokenizer(vocab_file=...)`: in transformers 5 that builds
  a tokenizer that silently disagrees with the sentencepiece model.

`build_char_tokenizer` makes the tiny character-level tokenizer of the CPU demo; it saves as a
standard `tokenizer.json` + `tokenizer_config.json` folder that `AutoTokenizer` loads as well.
"""
from __future__ import annotations

import json
import logging
import re
import shutil
from datetime import datetime
from pathlib import Path

logger = logging.getLogger("tandem.tokenizer")

TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model")
CHAR_SPECIALS = ("<pad>", "<bos>", "<eos>", "<unk>")  # ids 0, 1, 2, 3 of build_char_tokenizer


class Tokenizer:
    """What tandem needs from a tokenizer. Subclasses implement the `_`-prefixed hooks.

    `encode` never adds special tokens unless asked (`add_bos`); chat-template text already
    carries its own BOS, and `add_bos_default` says what the model's authors intended for raw text.
    """

    path: str | None = None
    bos_id: int | None = None
    eos_id: int | None = None
    unk_id: int | None = None  # what text outside the vocabulary encodes to, if anything
    chat_template: str | None = None
    add_bos_default: bool = False

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        """Token ids of `text`; with `add_bos`, BOS is prepended (when this tokenizer has one)."""
        ids = self._encode(text)
        if add_bos and self.bos_id is not None:
            ids = [self.bos_id] + ids
        return ids

    def decode(self, ids, skip_special: bool = True) -> str:
        """Text of `ids`; special tokens (BOS/EOS/pad...) are dropped when `skip_special`."""
        return self._decode([int(i) for i in ids], skip_special)

    @property
    def pad_id(self) -> int:
        """Padding id: the pad token, else EOS (padding is always masked out), else 0."""
        pad = self._pad_id()
        if pad is not None:
            return pad
        return self.eos_id if self.eos_id is not None else 0

    @property
    def stop_ids(self) -> list[int]:
        """Ids that end a completion: EOS plus any extra EOS ids of generation_config.json."""
        ids = [] if self.eos_id is None else [self.eos_id]
        return ids + [i for i in getattr(self, "_extra_stop_ids", []) if i not in ids]

    @property
    def vocab_size(self) -> int:
        """Number of ids the tokenizer can produce (base vocab + added tokens)."""
        raise NotImplementedError

    @property
    def has_chat_template(self) -> bool:
        return bool(self.chat_template)

    def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool = True) -> str:
        """Render chat `messages` ([{"role", "content"}, ...]) to text with the folder's template."""
        if not self.has_chat_template:
            raise ValueError(
                f"tokenizer {self.path or '<in-memory>'} has no chat template (looked in "
                f"tokenizer_config.json 'chat_template' and chat_template.jinja); use a model folder "
                f"that ships one, or set data.chat_template = false to feed the raw prompt text")
        return self._render_chat(messages, add_generation_prompt)

    def save(self, path) -> None:
        """Write the tokenizer files into folder `path` (created if needed)."""
        raise NotImplementedError

    def _save_generation_config(self, folder: Path) -> None:
        """Copy the source folder's generation_config.json along (its extra EOS ids are part of
        `stop_ids`; an export without it stopped only on EOS, as HF generate would too)."""
        src = Path(self.path) / "generation_config.json" if self.path else None
        if src is not None and src.is_file() and src.resolve() != (folder / src.name).resolve():
            shutil.copyfile(src, folder / src.name)

    # hooks
    def _encode(self, text: str) -> list[int]:
        raise NotImplementedError

    def _decode(self, ids: list[int], skip_special: bool) -> str:
        raise NotImplementedError

    def _pad_id(self) -> int | None:
        return None

    def _render_chat(self, messages: list[dict], add_generation_prompt: bool) -> str:
        raise NotImplementedError

    def __repr__(self) -> str:
        return (f"{type(self).__name__}(path={self.path!r}, vocab_size={self.vocab_size}, "
                f"bos={self.bos_id}, eos={self.eos_id}, pad={self.pad_id}, "
                f"chat_template={self.has_chat_template})")


class HFTokenizer(Tokenizer):
    """A `transformers` fast tokenizer (tokenizer.json) behind the `Tokenizer` interface."""

    def __init__(self, hf_tokenizer, path: str | None = None, extra_stop_ids=()):
        self.hf = hf_tokenizer
        self.path = path
        self.bos_id = hf_tokenizer.bos_token_id
        self.eos_id = hf_tokenizer.eos_token_id
        self.unk_id = _distinct_unk(hf_tokenizer.unk_token_id, self.bos_id, self.eos_id,
                                    hf_tokenizer.pad_token_id)
        self._extra_stop_ids = list(extra_stop_ids)
        template = hf_tokenizer.chat_template
        self.chat_template = template if template else None
        probe = hf_tokenizer.encode("a", add_special_tokens=True)
        self.add_bos_default = bool(probe) and self.bos_id is not None and probe[0] == self.bos_id

    @property
    def vocab_size(self) -> int:
        return len(self.hf)

    def _encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def _decode(self, ids: list[int], skip_special: bool) -> str:
        return self.hf.decode(ids, skip_special_tokens=skip_special)

    def _pad_id(self) -> int | None:
        return self.hf.pad_token_id

    def _render_chat(self, messages: list[dict], add_generation_prompt: bool) -> str:
        return self.hf.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt)

    def save(self, path) -> None:
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        self.hf.save_pretrained(str(folder))
        _portable_tokenizer_class(folder / "tokenizer_config.json")
        self._save_generation_config(folder)


class SentencePieceTokenizer(Tokenizer):
    """A sentencepiece `tokenizer.model`, read with the sentencepiece library itself.

    Control pieces written in text (e.g. "<s>" produced by a chat template) are mapped to their
    ids, as Hugging Face tokenizers do; sentencepiece alone would spell them out character by
    character. So are the tokens that tokenizer_config.json's `added_tokens_decoder` adds past the
    model's pieces (a fine-tune's ChatML "<|im_start|>"/"<|im_end|>", its "<pad>"); they may be
    the special tokens, and they decode to their text.
    """

    def __init__(self, model_proto: bytes, config: dict | None = None, path: str | None = None,
                 extra_stop_ids=()):
        import sentencepiece

        self.sp = sentencepiece.SentencePieceProcessor(model_proto=model_proto)
        self.path = path
        self.config = dict(config or {})
        n = self.sp.get_piece_size()
        self._added, added_special = _added_tokens(self.config, n)
        self.bos_id = self._special_id("bos_token", self.sp.bos_id())
        self.eos_id = self._special_id("eos_token", self.sp.eos_id())
        self.unk_id = _distinct_unk(self.sp.unk_id() if self.sp.unk_id() >= 0 else None,
                                    self.bos_id, self.eos_id)
        self._pad = self._special_id("pad_token", self.sp.pad_id())
        self._extra_stop_ids = list(extra_stop_ids)
        self.chat_template = self.config.get("chat_template") or None
        self.add_bos_default = bool(self.config.get("add_bos_token", True)) and self.bos_id is not None
        control = {self.sp.id_to_piece(i): i for i in range(n) if self.sp.is_control(i)}
        self._special = set(control.values()) | added_special
        self._control = {**control, **self._added}  # text -> id of the pieces matched whole
        self._text_of = {i: t for t, i in self._added.items()}
        # longest first, so that a control piece that prefixes another never wins
        pieces = sorted(self._control, key=len, reverse=True)
        self._split_re = re.compile("(" + "|".join(map(re.escape, pieces)) + ")") if pieces else None

    def _special_id(self, key: str, sp_default: int) -> int | None:
        """The id of special token `key` named in tokenizer_config.json, else sentencepiece's."""
        token = _token_content(self.config.get(key))
        if token in self._added:
            return self._added[token]
        if token is not None:
            i = self.sp.piece_to_id(token)
            if i != self.sp.unk_id() or token == self.sp.id_to_piece(self.sp.unk_id()):
                return i
        return sp_default if sp_default >= 0 else None

    @property
    def vocab_size(self) -> int:
        return max([self.sp.get_piece_size()] + [i + 1 for i in self._text_of])

    def _encode(self, text: str) -> list[int]:
        if self._split_re is None:
            return list(self.sp.encode(text))
        ids: list[int] = []
        for part in self._split_re.split(text):
            if part in self._control:
                ids.append(self._control[part])
            elif part:
                ids.extend(self.sp.encode(part))
        return ids

    def _decode(self, ids: list[int], skip_special: bool) -> str:
        n = self.sp.get_piece_size()
        out, run = [], []
        for i in ids:
            if i in self._special:
                if skip_special:
                    continue
            elif 0 <= i < n:
                run.append(i)
                continue
            elif i not in self._text_of:
                # past the tokenizer (a model's vocabulary padded beyond it): nothing, as in HF;
                # sentencepiece raised IndexError, which ended the generator at its reward
                continue
            out += [self.sp.decode(run), self._text_of.get(i) or self.sp.id_to_piece(i)]
            run = []
        return "".join(out + [self.sp.decode(run)])

    def _pad_id(self) -> int | None:
        return self._pad

    def _render_chat(self, messages: list[dict], add_generation_prompt: bool) -> str:
        tokens = {k: _token_content(self.config.get(k)) for k in
                  ("bos_token", "eos_token", "unk_token", "pad_token")}
        for key, i in (("bos_token", self.bos_id), ("eos_token", self.eos_id)):
            if tokens[key] is None and i is not None:
                tokens[key] = self.sp.id_to_piece(i)
        return render_chat_template(self.chat_template, messages, add_generation_prompt,
                                    **{k: v for k, v in tokens.items() if v is not None})

    def save(self, path) -> None:
        folder = Path(path)
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "tokenizer.model").write_bytes(self.sp.serialized_model_proto())
        config = dict(self.config)
        if self.chat_template:
            config["chat_template"] = self.chat_template
        (folder / "tokenizer_config.json").write_text(json.dumps(config, indent=2) + "\n")
        self._save_generation_config(folder)


def render_chat_template(template: str, messages: list[dict], add_generation_prompt: bool = True,
                         **special_tokens: str) -> str:
    """Render a Hugging Face chat template the way transformers does (same Jinja settings).

    Used for sentencepiece folders, where transformers is not involved; `special_tokens` are
    the `bos_token=...` style variables templates refer to.
    """
    import jinja2
    import jinja2.ext  # not loaded by `import jinja2`: without transformers imported first, the
    # environment below failed with "module 'jinja2' has no attribute 'ext'"
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # jinja's own tojson escapes HTML characters, which chat templates do not expect
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols, _generation_tag()])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return env.from_string(template).render(
        messages=messages, tools=None, documents=None,
        add_generation_prompt=add_generation_prompt, **special_tokens)


def _generation_tag():
    """The `{% generation %}...{% endgeneration %}` block of transformers' templates (it marks the
    assistant's tokens for training masks); rendering, it is just its body. A template using it
    failed to compile here ("unknown tag 'generation'") while transformers rendered it."""
    import jinja2.ext
    from jinja2 import nodes

    class GenerationTag(jinja2.ext.Extension):
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            body = parser.parse_statements(("name:endgeneration",), drop_needle=True)
            return nodes.Scope(body).set_lineno(lineno)

    return GenerationTag


def load_tokenizer(path) -> Tokenizer:
    """Load the tokenizer of a local model folder (tokenizer.json, else tokenizer.model)."""
    folder = Path(path)
    if not folder.is_dir():
        raise ValueError(
            f"tokenizer folder {str(folder)!r} does not exist or is not a folder; pass a local "
            f"model folder containing one of {list(TOKENIZER_FILES)}")
    extra_stops = _generation_eos_ids(folder)
    if (folder / "tokenizer.json").is_file():
        return _load_hf(folder, extra_stops)
    if (folder / "tokenizer.model").is_file():
        config = _read_tokenizer_config(folder)
        proto = (folder / "tokenizer.model").read_bytes()
        try:
            return SentencePieceTokenizer(proto, config, str(folder), extra_stops)
        except RuntimeError as e:  # sentencepiece reports a corrupt model as RuntimeError
            raise ValueError(f"{folder / 'tokenizer.model'} is not a valid sentencepiece "
                             f"model: {e}") from e
    present = sorted(p.name for p in folder.iterdir())[:20]
    raise ValueError(
        f"no tokenizer in {str(folder)!r}: looked for {list(TOKENIZER_FILES)}, found {present}; "
        f"copy the tokenizer files of the base model into this folder")


def _load_hf(folder: Path, extra_stops: list[int]) -> HFTokenizer:
    import transformers

    try:
        hf = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    except Exception as e:  # transformers raises many types here; name the folder either way
        raise ValueError(f"could not load the tokenizer in {str(folder)!r} with "
                         f"transformers.AutoTokenizer: {type(e).__name__}: {e}") from e
    if not getattr(hf, "is_fast", False):
        raise ValueError(f"{str(folder)!r}: AutoTokenizer returned a slow tokenizer "
                         f"({type(hf).__name__}); tandem expects tokenizer.json to be used")
    tok = HFTokenizer(hf, str(folder), extra_stops)
    if tok.eos_id is None:
        logger.warning("tokenizer in %s has no EOS token: completions end only at max_new_tokens "
                       "or generator.stop_token_ids", folder)
    return tok


def _read_tokenizer_config(folder: Path) -> dict:
    """tokenizer_config.json (or {}), with chat_template.jinja taking precedence when present."""
    config = _read_json(folder / "tokenizer_config.json")
    jinja = folder / "chat_template.jinja"
    if jinja.is_file():
        config["chat_template"] = jinja.read_text()
    return config


def _generation_eos_ids(folder: Path) -> list[int]:
    """EOS ids from generation_config.json (chat models often list several, e.g. <|eot_id|>)."""
    eos = _read_json(folder / "generation_config.json").get("eos_token_id")
    if eos is None:
        return []
    return [int(i) for i in (eos if isinstance(eos, list) else [eos])]


def _read_json(path: Path) -> dict:
    if not path.is_file():
        return {}
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{path} is not valid JSON (line {e.lineno}, column {e.colno}: "
                         f"{e.msg}); fix or remove the file") from e


def _token_content(token) -> str | None:
    """tokenizer_config.json writes special tokens as "<s>" or {"content": "<s>", ...}."""
    if isinstance(token, dict):
        return token.get("content")
    return token


def _added_tokens(config: dict, n_pieces: int) -> tuple[dict[str, int], set[int]]:
    """The tokens of tokenizer_config.json's added_tokens_decoder ({"32000": {"content":
    "<|im_start|>", "special": true, ...}}) past the model's `n_pieces` (the entries of its own
    pieces are skipped): ({text: id}, the ids of the special ones). transformers writes this table
    into every tokenizer_config.json it saves."""
    added, special = {}, set()
    for key, token in (config.get("added_tokens_decoder") or {}).items():
        i, text = int(key), _token_content(token)
        if i >= n_pieces and text:
            added[text] = i
            if not isinstance(token, dict) or token.get("special", True):
                special.add(i)
    return added, special


def _portable_tokenizer_class(config_path: Path) -> None:
    """transformers 5 writes tokenizer_class "TokenizersBackend", which transformers 4 cannot
    read; "PreTrainedTokenizerFast" means the same thing to both."""
    config = _read_json(config_path)
    if config.get("tokenizer_class") == "TokenizersBackend":
        config["tokenizer_class"] = "PreTrainedTokenizerFast"
        config_path.write_text(json.dumps(config, indent=2) + "\n")


def _distinct_unk(unk: int | None, *specials: int | None) -> int | None:
    """The unknown-text id, unless it doubles as BOS/EOS/pad (GPT-2's <|endoftext|> is all of
    them): a prompt holding it then says nothing of text outside the vocabulary."""
    return None if unk is None or unk in specials else unk


def build_char_tokenizer(alphabet: str) -> HFTokenizer:
    """A character-level tokenizer: `<pad>`=0, `<bos>`=1, `<eos>`=2, `<unk>`=3, then `alphabet`.

    Every character of `alphabet` is one token (repeats are ignored); characters outside it
    encode to `<unk>`. Like Llama, the model's default encoding prepends `<bos>`
    (`add_bos_default`). `save(dir)` writes tokenizer.json + tokenizer_config.json, which both
    `load_tokenizer(dir)` and `transformers.AutoTokenizer.from_pretrained(dir)` read.
    """
    from tokenizers import AddedToken, Regex, decoders, models, pre_tokenizers, processors
    from tokenizers import Tokenizer as RawTokenizer
    import transformers

    if not alphabet:
        raise ValueError("build_char_tokenizer needs a non-empty alphabet, e.g. '0123456789+='")
    vocab = {s: i for i, s in enumerate(CHAR_SPECIALS)}
    for ch in alphabet:
        vocab.setdefault(ch, len(vocab))
    raw = RawTokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    # [\s\S] rather than "." so that newlines are characters too
    raw.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    raw.decoder = decoders.Fuse()  # join characters without the WordLevel default spaces
    raw.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in CHAR_SPECIALS])
    raw.post_processor = processors.TemplateProcessing(
        single="<bos> $A", pair="<bos> $A <bos> $B", special_tokens=[("<bos>", 1)])
    hf = transformers.PreTrainedTokenizerFast(
        tokenizer_object=raw, bos_token="<bos>", eos_token="<eos>", pad_token="<pad>",
        unk_token="<unk>", clean_up_tokenization_spaces=False)
    return HFTokenizer(hf)
