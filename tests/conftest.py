"""Shared fixtures: the default model (loaded once, fp32), tiny random Hugging Face folders,
the transformers reference tokenizer for the default GGUF, and a runner for generate.py."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

import checkpoint  # noqa: E402

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


@pytest.fixture(scope="session")
def default_model():
    """(Transformer, Tokenizer) of the embedded SmolLM2-135M-Instruct, fp32 on CPU, loaded once.
    Uses the real cache ($TREESPEC_CACHE or ~/.cache/treespec): the first run converts the GGUF."""
    model, tokenizer = checkpoint.load_model(None, "cpu", torch.float32)
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
