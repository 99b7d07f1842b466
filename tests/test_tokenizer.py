"""model.tokenizer against transformers and sentencepiece, on tokenizers built in-test."""
import json

import pytest
import sentencepiece
import transformers
from tokenizers import Tokenizer as RawTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from model.tokenizer import (HFTokenizer, SentencePieceTokenizer, build_char_tokenizer,
                             load_tokenizer, render_chat_template)

TEXTS = ["12+34=46", "0+0=0", " 9 +\n1=", "", "7<eos>8"]
CORPUS = ["the quick brown fox jumps over the lazy dog",
          "hello world, this is a small tokenizer test",
          "reinforcement learning for language models is fun",
          "numbers like 12 + 34 = 46 appear here too"] * 10
CHATML = ("{{ bos_token }}{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}"
          "<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
MESSAGES = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello world"}]


def test_char_tokenizer_round_trip_and_specials():
    tok = build_char_tokenizer("0123456789+= \n")
    assert (tok.pad_id, tok.bos_id, tok.eos_id) == (0, 1, 2)
    assert tok.vocab_size == 4 + 14 and tok.add_bos_default
    ids = tok.encode("12+34=46")
    assert len(ids) == 8 and all(i >= 4 for i in ids)
    assert tok.decode(ids) == "12+34=46"
    assert tok.encode("1", add_bos=True) == [1, tok.encode("1")[0]]
    assert tok.decode([1] + ids + [2]) == "12+34=46"
    assert tok.decode([1] + ids + [2], skip_special=False) == "<bos>12+34=46<eos>"
    assert tok.encode("x") == [3]  # outside the alphabet: <unk>


def test_char_tokenizer_saved_folder_matches_auto_tokenizer(tmp_path):
    build_char_tokenizer("0123456789+= \n").save(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"  # readable by transformers 4 too
    ours = load_tokenizer(tmp_path)
    auto = transformers.AutoTokenizer.from_pretrained(str(tmp_path), local_files_only=True)
    assert isinstance(ours, HFTokenizer)
    assert (ours.bos_id, ours.eos_id, ours.pad_id) == (auto.bos_token_id, auto.eos_token_id,
                                                       auto.pad_token_id) == (1, 2, 0)
    for text in TEXTS:
        assert ours.encode(text, add_bos=True) == auto(text)["input_ids"]
        assert ours.encode(text) == auto.encode(text, add_special_tokens=False)
        assert ours.decode(ours.encode(text)) == auto.decode(auto.encode(text),
                                                             skip_special_tokens=True)


def _bpe_folder(folder, template=CHATML, generation_eos=None):
    """A byte-level BPE tokenizer.json trained on CORPUS, ChatML specials, template in config."""
    raw = RawTokenizer(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.decoder = decoders.ByteLevel()
    specials = ["<s>", "</s>", "<|im_start|>", "<|im_end|>"]
    raw.train_from_iterator(CORPUS, trainers.BpeTrainer(
        vocab_size=300, special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False))
    folder.mkdir(parents=True, exist_ok=True)
    raw.save(str(folder / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>",
              "eos_token": "<|im_end|>", "clean_up_tokenization_spaces": False}
    if template is not None:
        config["chat_template"] = template
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if generation_eos is not None:
        (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": generation_eos}))
    return folder


def test_bpe_chat_template_matches_transformers(tmp_path):
    folder = _bpe_folder(tmp_path / "bpe", generation_eos=[3, 1])
    ours = load_tokenizer(folder)
    auto = transformers.AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
    assert ours.has_chat_template and not ours.add_bos_default
    assert ours.eos_id == 3 and ours.stop_ids == [3, 1] and ours.pad_id == 3  # pad falls back to EOS
    for gen in (True, False):
        expected = auto.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen)
        assert ours.apply_chat_template(MESSAGES, add_generation_prompt=gen) == expected
        # the renderer used for sentencepiece folders agrees with transformers as well
        assert render_chat_template(CHATML, MESSAGES, gen, bos_token="<s>",
                                    eos_token="<|im_end|>") == expected
    text = ours.apply_chat_template(MESSAGES)
    assert ours.encode(text) == auto.encode(text, add_special_tokens=False)
    assert ours.encode(text)[:2] == [0, 2]  # "<s><|im_start|>" are single special ids
    assert ours.decode(ours.encode("hello world")) == "hello world"


def test_hf_save_round_trip(tmp_path):
    ours = load_tokenizer(_bpe_folder(tmp_path / "src", generation_eos=[3, 1]))
    ours.save(tmp_path / "dst")
    again = load_tokenizer(tmp_path / "dst")
    text = ours.apply_chat_template(MESSAGES)
    assert again.apply_chat_template(MESSAGES) == text
    assert again.encode(text) == ours.encode(text) and again.vocab_size == ours.vocab_size
    # generation_config.json travels along: an export (hf_final) kept only EOS as a stop id
    assert again.stop_ids == ours.stop_ids == [3, 1]


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    """A ~60-piece sentencepiece model trained on CORPUS."""
    work = tmp_path_factory.mktemp("sp")
    (work / "corpus.txt").write_text("\n".join(CORPUS))
    sentencepiece.SentencePieceTrainer.train(
        input=str(work / "corpus.txt"), model_prefix=str(work / "m"), vocab_size=60,
        hard_vocab_limit=False, minloglevel=2)
    return work / "m.model"


def test_sentencepiece_folder_encodes_like_sentencepiece(tmp_path, sp_model):
    (tmp_path / "tokenizer.model").write_bytes(sp_model.read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    ours = load_tokenizer(tmp_path)
    sp = sentencepiece.SentencePieceProcessor(model_file=str(sp_model))
    assert isinstance(ours, SentencePieceTokenizer)
    assert (ours.bos_id, ours.eos_id, ours.vocab_size) == (sp.bos_id(), sp.eos_id(), sp.get_piece_size())
    assert ours.pad_id == ours.eos_id  # this model has no pad piece
    for text in ["hello world", "the lazy fox 12 + 34", ""]:
        assert ours.encode(text) == sp.encode(text)
        assert ours.decode(ours.encode(text)) == sp.decode(sp.encode(text))
    assert ours.encode("hello", add_bos=True) == [sp.bos_id()] + sp.encode("hello")
    # a control piece written in text (as chat templates do) is one id, not characters
    assert ours.encode("<s>hello") == [sp.bos_id()] + sp.encode("hello")
    ids = [sp.bos_id()] + sp.encode("hello") + [sp.eos_id()]
    assert ours.decode(ids) == "hello" and ours.decode(ids, skip_special=False) == "<s>hello</s>"
    assert ours.apply_chat_template(MESSAGES).startswith("<s><|im_start|>system\nbe brief")


def test_sentencepiece_save_round_trip(tmp_path, sp_model):
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "tokenizer.model").write_bytes(sp_model.read_bytes())
    load_tokenizer(tmp_path / "src").save(tmp_path / "dst")
    again = load_tokenizer(tmp_path / "dst")
    assert again.encode("hello world") == load_tokenizer(tmp_path / "src").encode("hello world")
    assert not again.has_chat_template


def test_errors_name_the_path_and_the_fix(tmp_path):
    with pytest.raises(ValueError, match="does not exist.*tokenizer.json"):
        load_tokenizer(tmp_path / "nope")
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(ValueError, match=f"no tokenizer in '{tmp_path}'.*tokenizer.json.*"
                                         f"tokenizer.model.*config.json"):
        load_tokenizer(tmp_path)
    (tmp_path / "tokenizer.model").write_bytes(b"not a model")
    with pytest.raises(ValueError, match="not a valid sentencepiece model"):
        load_tokenizer(tmp_path)
    with pytest.raises(ValueError, match="no chat template.*chat_template = false"):
        build_char_tokenizer("ab").apply_chat_template(MESSAGES)
    with pytest.raises(ValueError, match="non-empty alphabet"):
        build_char_tokenizer("")
    bad = _bpe_folder(tmp_path / "bad")
    (bad / "generation_config.json").write_text("{oops")
    with pytest.raises(ValueError, match="generation_config.json is not valid JSON"):
        load_tokenizer(bad)


def test_chat_template_renders_without_transformers_imported(tmp_path, sp_model):
    """`import jinja2` does not load jinja2.ext: a sentencepiece folder's template failed with
    "module 'jinja2' has no attribute 'ext'" in a process that had not imported transformers (a
    training run); the tests passed only because this module imports it."""
    import subprocess
    import sys
    from pathlib import Path

    (tmp_path / "tokenizer.model").write_bytes(sp_model.read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML}))
    code = ("import sys; from model.tokenizer import load_tokenizer; "
            f"print(load_tokenizer({str(tmp_path)!r}).apply_chat_template({MESSAGES!r})); "
            "assert 'transformers' not in sys.modules and 'jinja2.ext' in sys.modules")
    root = Path(__file__).resolve().parent.parent
    out = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.startswith("<s><|im_start|>system\nbe brief<|im_end|>\n")


def test_generation_tag_renders_like_transformers():
    """transformers' templates may mark the assistant's turns with {% generation %} (training
    masks); the sentencepiece renderer refused the tag ("unknown tag 'generation'")."""
    from transformers.utils.chat_template_utils import render_jinja_template

    template = ("{% for m in messages %}{% if m['role'] == 'assistant' %}{% generation %}"
                "{{ m['content'] }}{% endgeneration %}{% else %}{{ m['role'] }}:{{ m['content'] }}"
                "{% endif %}\n{% endfor %}{% if add_generation_prompt %}A:{% endif %}")
    chat = MESSAGES + [{"role": "assistant", "content": "hi"}, {"role": "user", "content": "2"}]
    for gen in (True, False):
        expected = render_jinja_template([chat], chat_template=template, add_generation_prompt=gen)
        assert render_chat_template(template, chat, gen) == expected[0][0]
    assert render_chat_template(template, chat, True) == "system:be briefuser:hello worldhiuser:2A:"


def test_sentencepiece_added_tokens_and_ids_past_the_model(tmp_path, sp_model):
    """tokenizer_config.json's added_tokens_decoder (a ChatML fine-tune of a sentencepiece model):
    its EOS "<|im_end|>" resolved to the model's "</s>", its pad to EOS, the template's markers
    were spelled out piece by piece, and decoding an added id (or any id past the model, which a
    padded vocabulary can sample) raised IndexError in the generator."""
    sp = sentencepiece.SentencePieceProcessor(model_file=str(sp_model))
    n = sp.get_piece_size()
    added = {str(n + k): {"content": t, "special": k != 1, "lstrip": False, "rstrip": False,
                          "normalized": False, "single_word": False}
             for k, t in enumerate(["<|im_start|>", "<|x|>", "<|im_end|>", "<pad>"])}
    (tmp_path / "tokenizer.model").write_bytes(sp_model.read_bytes())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps(
        {"bos_token": "<s>", "eos_token": "<|im_end|>", "pad_token": "<pad>", "chat_template": CHATML,
         "added_tokens_decoder": {"0": {"content": "<unk>", "special": True}, **added}}))
    tok = load_tokenizer(tmp_path)
    assert (tok.bos_id, tok.eos_id, tok.pad_id, tok.vocab_size) == (sp.bos_id(), n + 2, n + 3, n + 4)
    assert tok.stop_ids == [n + 2]
    text = tok.apply_chat_template(MESSAGES)
    assert tok.encode(text)[:3] == [sp.bos_id(), n, *sp.encode("system")[:1]]
    assert tok.encode("hello<|im_end|>") == sp.encode("hello") + [n + 2]
    ids = sp.encode("hello") + [n + 1] + sp.encode("world") + [n + 2, n + 3, n + 50, -1]
    assert tok.decode(ids) == "hello<|x|>world"  # <|x|> is not special: kept
    assert tok.decode(ids, skip_special=False) == "hello<|x|>world<|im_end|><pad>"
    tok.save(tmp_path / "again")
    assert load_tokenizer(tmp_path / "again").encode(text) == tok.encode(text)
