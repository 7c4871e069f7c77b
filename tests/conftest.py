"""Shared fixtures: the default model (loaded once, fp32), tiny random Hugging Face folders, a tiny
random base model in our layout and the data it wrote itself (for test_distill and test_train), the
transformers reference tokenizer for the default GGUF, and a runner for generate.py."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import checkpoint  # noqa: E402
import distill  # noqa: E402
import generate  # noqa: E402
from model import ModelArgs, Transformer  # noqa: E402

if os.environ.get("PYTEST_XDIST_WORKER"):
    # pytest.ini runs two workers, one a core: each on one intra-op thread, or OpenMP's spin-waiting
    # threads of one worker take the other's core (see one_thread). Tests of the kernels' split
    # across threads set their own count (two_threads).
    torch.set_num_threads(1)

TINY_VOCAB = 260  # 256 byte tokens, <|endoftext|>, and a few unused ids


def tiny_tokenizer():
    """A byte-level BPE without merges: one token a byte (so a text's length in tokens is its
    length in UTF-8 bytes), plus <|endoftext|> as id 256."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE({c: i for i, c in enumerate(alphabet)}, [], fuse_unk=False))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True, normalized=False)])
    assert tok.token_to_id("<|endoftext|>") == 256
    return tok


def build_hf_model(arch: str = "llama", seed: int = 0, **overrides):
    """A tiny random transformers model. Weights are drawn larger than HF's init (std 0.02) so that
    attention is far from uniform and a wrong q/k layout or RoPE shows in the logits."""
    from transformers import (LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM,
                              Qwen2Config, Qwen2ForCausalLM)
    classes = {"llama": (LlamaConfig, LlamaForCausalLM), "qwen2": (Qwen2Config, Qwen2ForCausalLM),
               "mistral": (MistralConfig, MistralForCausalLM)}
    config_cls, model_cls = classes[arch]
    cfg = dict(vocab_size=TINY_VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
               rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=None, eos_token_id=256,
               pad_token_id=None)
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(config_cls(**cfg)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0, 0.15)
    return model


def write_hf_folder(model, folder: Path, max_shard_size=None, legacy_rope: bool = False) -> Path:
    """save_pretrained (safetensors; sharded with an index when max_shard_size is small) plus a tiny
    tokenizer. legacy_rope rewrites transformers 5's `rope_parameters` into the top-level
    `rope_theta` / `rope_scaling` keys that checkpoints saved by transformers 4 carry."""
    folder = Path(folder)
    kwargs = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(folder, **kwargs)
    if legacy_rope:
        cfg = json.loads((folder / "config.json").read_text())
        rope = dict(cfg.pop("rope_parameters"))
        cfg["rope_theta"] = rope.pop("rope_theta")
        if rope.get("rope_type", "default") != "default":
            cfg["rope_scaling"] = rope
        (folder / "config.json").write_text(json.dumps(cfg, indent=1))
    tiny_tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<|endoftext|>", "add_bos_token": False}))
    return folder


@pytest.fixture
def make_hf_folder(tmp_path_factory):
    """make_hf_folder(arch="llama", max_shard_size=None, legacy_rope=False, seed=0, **config) ->
    (transformers model, folder)."""
    def make(arch="llama", max_shard_size=None, legacy_rope=False, seed=0, **overrides):
        model = build_hf_model(arch, seed, **overrides)
        folder = write_hf_folder(model, tmp_path_factory.mktemp(f"hf-{arch}"), max_shard_size, legacy_rope)
        return model, folder
    return make


@pytest.fixture(scope="session")
def tiny_ctx64_folder(tmp_path_factory):
    """A tiny random Llama HF folder with a 64-token context, for fast CLI runs."""
    model = build_hf_model("llama", seed=1, max_position_embeddings=64)
    return write_hf_folder(model, tmp_path_factory.mktemp("hf-ctx64"))


# test_distill and test_train: a tiny base model in our layout (`tiny`), and the text it wrote (`dataset`,
# made with the small `distill.py generate` settings DATA)
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|endoftext|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
DATA = ["--batch_size", "8", "--max_new_tokens", "48", "--max_user_tokens", "24", "--max_prompt_tokens", "128"]


@pytest.fixture(scope="session")
def tiny(tmp_path_factory):
    """A tiny random base model in our layout, with a byte tokenizer and a ChatML-like template that ends
    a turn with <|endoftext|> (the eos)."""
    folder = tmp_path_factory.mktemp("tiny-base")
    args = ModelArgs(dim=64, n_layer=2, n_head=4, n_kv_head=2, vocab_size=TINY_VOCAB, intermediate_size=128,
                     max_seq_len=256)
    torch.manual_seed(0)
    model = Transformer(args)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
        model.tok_embeddings.weight.mul_(4)  # (tied lm_head) peaked next-token distributions, like a real model's
    save_file({k: v for k, v in model.state_dict().items() if k != "output.weight"}, folder / "model.safetensors")
    (folder / "model_args.json").write_text(json.dumps(args.to_dict()))
    tiny_tokenizer().save(str(folder / "tokenizer.json"))
    (folder / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|endoftext|>", "add_bos_token": False, "chat_template": CHATML}))
    return folder


@pytest.fixture(scope="session")
def dataset(tiny, tmp_path_factory):
    """Made by `distill.py generate` itself: the model invents its prompts and answers them greedily.
    On one thread, as test_distill and test_train run (their one_thread): this fixture, session-wide,
    is made before their module-wide one_thread applies."""
    path = tmp_path_factory.mktemp("data") / "selfdistill.npz"
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        distill.main(["generate", "--checkpoint", str(tiny), "--out", str(path), "--tokens", "1500", *DATA])
    finally:
        torch.set_num_threads(n)
    return path


@pytest.fixture(scope="session")
def default_model():
    """(Transformer, Tokenizer) of the embedded SmolLM2-135M-Instruct, fp32 on CPU, loaded once.
    Uses the real cache ($TREESPEC_CACHE or ~/.cache/treespec): the first run converts the GGUF."""
    model, tokenizer = generate.load_model(None, "cpu", torch.float32)
    return model, tokenizer


@pytest.fixture(scope="session")
def default_gguf() -> Path:
    path = checkpoint.default_checkpoint()
    assert path.is_file(), f"the default GGUF is missing: {path}"
    return path


@pytest.fixture(scope="session")
def hf_gguf_tokenizer(default_gguf):
    """transformers' own tokenizer read from the same GGUF: the reference for ours."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(default_gguf.parent), gguf_file=default_gguf.name)


@pytest.fixture(scope="session")
def run_cli():
    """run_cli(*args, env=None, timeout=120) -> CompletedProcess of `python generate.py args` in the repo root."""
    def run(*args, env=None, timeout=120):
        full_env = dict(os.environ)
        full_env.update(env or {})
        return subprocess.run([sys.executable, "generate.py", *map(str, args)], cwd=ROOT, env=full_env,
                              capture_output=True, text=True, timeout=timeout, stdin=subprocess.DEVNULL)
    return run


@pytest.fixture
def no_recompiles():
    """A second compiled graph is an error. Not monkeypatch: its undo deletes the entry from
    torch._dynamo.config (a config module), and every later test that sets it fails."""
    import torch._dynamo
    with torch._dynamo.config.patch(error_on_recompile=True):
        yield


@pytest.fixture
def two_threads():
    """Two intra-op threads for one test, whatever the process runs on (one under pytest.ini's two
    workers): the kernels split their tasks across threads, and a test of a kernel checks the split."""
    n = torch.get_num_threads()
    torch.set_num_threads(2)
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread (modules take it with `pytestmark`): tiny models' ops are microseconds
    long, and on a CPU shared with other jobs OpenMP workers spin-wait and thrash (measured 0.6 ms a
    tiny decode step on one thread, up to 70 ms on two; test_speculative 2x to 10x slower)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
