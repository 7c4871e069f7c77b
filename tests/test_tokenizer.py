"""The default model's tokenizer (built from GGUF metadata): exact round trips, the same ids as
transformers' tokenizer read from the same GGUF, single digits, the chat template, bos/eos."""
import json

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from tokenizer import Tokenizer

TEXTS = [
    "",
    "Hello, world!",
    "Héllo wörld — ça va? Ñandú, naïve café, Straße, Ærøskøbing",
    "日本語のテキストと中文字符，한국어도 섞어서。",
    "emoji: 👍🏽 🎉 👨‍👩‍👧‍👦 🇫🇷 ❤️",
    "def f(x):\n\tif x:\n\t\treturn x  # tabs\n    else:\n        return -1\n",
    "a  b   c\t\t d\n\n\n  \n e    ",
    "   leading spaces",
    "trailing spaces   ",
    "\n",
    " ",
    "\r\n\r\nwindows\r\nlines",
    "12345",
    "pi is 3.14159, a million is 1,000,000 and 0x1F is 31; 2024-06-01T12:00:00Z",
    "nbsp\u00a0zero\u200bwidth\u2028line sep",
    "control \x00\x01\x7f chars",
    "<|im_start|>user\nspecial tokens in text<|im_end|>\n",
    "Ünïcödé ΑΒΓ αβγ Кириллица עברית العربية हिन्दी",
]


@pytest.fixture(scope="module")
def tok(default_model):
    return default_model[1]


@pytest.mark.parametrize("text", TEXTS)
def test_round_trip_is_exact(tok, text):
    assert tok.decode(tok.encode(text, bos=False)) == text


@pytest.mark.parametrize("text", TEXTS)
def test_same_ids_as_transformers(tok, hf_gguf_tokenizer, text):
    assert tok.encode(text, bos=False) == hf_gguf_tokenizer.encode(text, add_special_tokens=False)


def test_digits_are_split_one_by_one(tok):
    ids = tok.encode("12345", bos=False)
    assert len(ids) == 5
    assert [tok.decode([i]) for i in ids] == list("12345")
    ids = tok.encode("year 2024", bos=False)
    assert [tok.decode([i]) for i in ids][-4:] == list("2024")


FRAGMENTS = ["  ", "\t", "\n", "\n\n", " \n ", "123", "0", "é", "日本", "👍🏽", "def ", "x = 1", "'s", "!!", "  \t"]


def texts(chars=st.characters()):
    return st.one_of(
        st.text(chars, max_size=40),
        st.lists(st.one_of(st.sampled_from(FRAGMENTS), st.text(chars, max_size=6)), max_size=10).map("".join))


# SmolLM2's vocabulary has no token for the bytes 0x04, 0x06, 0x13, 0x14, 0x16, 0x1D, nor for the UTF-8
# lead bytes 0xF1 and 0xF2 (code points U+40000..U+BFFFF, unassigned planes): byte-level BPE drops
# them, in transformers as in ours, so only the other characters can round-trip.
UNREPRESENTABLE = set("\x04\x06\x13\x14\x16\x1d")
representable = st.characters().filter(lambda c: c not in UNREPRESENTABLE and not 0x40000 <= ord(c) < 0xC0000)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=texts(representable))
def test_round_trip_on_generated_text(tok, text):
    assert tok.decode(tok.encode(text, bos=False)) == text


@pytest.fixture(scope="module")
def smollm_reference(hf_gguf_tokenizer):
    """transformers' GGUF tokenizer (its vocabulary, merges and special tokens) with the pre-tokenizer
    that llama.cpp uses for tokenizer.ggml.pre = "smollm" and that SmolLM2's own tokenizer.json has:
    single digits first, then the GPT-2 regex. transformers' GGUF reader ignores that field and uses
    the GPT-2 regex alone, which splits a run of spaces before a digit differently ("x  1": its
    x, Ġ, Ġ, 1 against llama.cpp's x, ĠĠ, 1); elsewhere the two agree."""
    from tokenizers import Tokenizer as HFTokenizer, pre_tokenizers
    ref = HFTokenizer.from_str(hf_gguf_tokenizer.backend_tokenizer.to_str())
    ref.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Digits(individual_digits=True),
                                                 pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)])
    return lambda text: ref.encode(text, add_special_tokens=False).ids


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(text=texts())
def test_same_ids_as_reference_on_generated_text(tok, smollm_reference, text):
    assert tok.encode(text, bos=False) == smollm_reference(text)


def test_spaces_before_digits_split_as_llama_cpp_does(tok):
    ids = tok.encode("x  1", bos=False)
    assert [tok.tok.id_to_token(i) for i in ids] == ["x", "ĠĠ", "1"]


@pytest.mark.parametrize("text", ["a\x04b", "\U00040000", "x\U000BFFFFy"])
def test_unrepresentable_bytes_are_dropped_like_transformers(tok, hf_gguf_tokenizer, text):
    ids = tok.encode(text, bos=False)
    assert ids == hf_gguf_tokenizer.encode(text, add_special_tokens=False)
    assert tok.decode(ids) != text


def test_bos_and_eos_ids(tok):
    assert tok.bos_id == 1
    assert tok.eos_id == 2
    assert tok.decode([1]) == "<|im_start|>"
    assert tok.decode([2]) == "<|im_end|>"
    assert tok.encode("hi", bos=True)[0] == 1


def test_chat_template_renders_system_message_and_assistant_turn(tok, hf_gguf_tokenizer):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    text = tok.chat(messages)
    assert text.startswith("<|im_start|>system\n")
    assert "You are a helpful AI assistant named SmolLM, trained by Hugging Face" in text
    assert "<|im_start|>user\nWhat is the capital of France?<|im_end|>\n" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert text == hf_gguf_tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    ids = tok.encode(text, bos=False)
    assert ids[0] == tok.bos_id and tok.eos_id in ids  # <|im_start|> and <|im_end|> are single tokens


def test_chat_template_keeps_a_given_system_message(tok):
    text = tok.chat([{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}])
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>\n")
    assert "SmolLM" not in text
    assert text.endswith("<|im_start|>assistant\n")


# ---------------------------------------------------------------- other tokenizer folders

def test_tokenizer_json_folder(tiny_ctx64_folder):
    tok = Tokenizer(tiny_ctx64_folder)
    assert tok.eos_id == 256 and tok.bos_id is None
    text = "tiny byte-level tokenizer: é 日本 👍"
    ids = tok.encode(text)
    assert len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text
    assert tok.chat([{"role": "user", "content": "raw"}]) == "raw"  # no template: the user's text


def test_sentencepiece_folder(tmp_path):
    import io
    import sentencepiece as spm
    corpus = ["the quick brown fox jumps over the lazy dog", "hello world", "a tiny sentencepiece model"] * 20
    buf = io.BytesIO()
    spm.SentencePieceTrainer.train(sentence_iterator=iter(corpus), model_writer=buf, vocab_size=40,
                                   model_type="bpe", bos_id=1, eos_id=2, unk_id=0, minloglevel=2)
    (tmp_path / "tokenizer.model").write_bytes(buf.getvalue())
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"bos_token": "<s>", "eos_token": "</s>"}))
    tok = Tokenizer(tmp_path)
    assert (tok.bos_id, tok.eos_id) == (1, 2)
    ids = tok.encode("hello world")
    assert ids[0] == 1  # sentencepiece models add bos by default
    assert tok.decode(ids[1:]) == "hello world"


def test_folder_without_tokenizer_is_a_clear_error(tmp_path):
    with pytest.raises(ValueError, match="no tokenizer.json or tokenizer.model"):
        Tokenizer(tmp_path)
