"""Loading: the hub path (offline, through a patched snapshot_download), GGUF conversion into a cache,
and clear CheckpointErrors for bad checkpoints."""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import checkpoint
from checkpoint import CheckpointError, load_model, resolve
from conftest import ROOT, build_hf_model, write_hf_folder


def logits(model, ids):
    model.setup_caches(1, len(ids))
    with torch.no_grad():
        return model(ids[None], torch.arange(len(ids)))[0]


# ---------------------------------------------------------------- hub ids

def test_hub_id_goes_through_snapshot_download(monkeypatch, make_hf_folder):
    import huggingface_hub
    hf, folder = make_hf_folder("llama")
    calls = []

    def fake_snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(folder)

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    got_folder, args, state = resolve("someorg/somemodel")
    assert got_folder == folder
    assert [c[0] for c in calls] == ["someorg/somemodel"]
    patterns = calls[0][1].get("allow_patterns") or []
    assert "*.safetensors" in patterns and "*.json" in patterns

    model, tokenizer = load_model("someorg/somemodel")
    ids = torch.arange(20)
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    assert (logits(model, ids) - expected).abs().max().item() < 1e-3
    assert tokenizer.eos_id == 256


def test_failing_download_is_a_checkpoint_error(monkeypatch):
    import huggingface_hub

    def failing(repo_id, **kwargs):
        raise OSError("network unreachable")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", failing)
    with pytest.raises(CheckpointError, match="cannot fetch someorg/somemodel from the hub"):
        resolve("someorg/somemodel")


def test_offline_hub_with_an_empty_cache_is_a_clear_error(tmp_path):
    """The real snapshot_download, with HF_HUB_OFFLINE=1 and an empty HF_HOME (set before huggingface_hub
    is imported, hence a subprocess)."""
    env = dict(os.environ, HF_HUB_OFFLINE="1", HF_HOME=str(tmp_path / "hf_home"))
    env.pop("HF_HUB_CACHE", None)
    env.pop("HUGGINGFACE_HUB_CACHE", None)
    code = ("import checkpoint\n"
            "try:\n"
            "    checkpoint.resolve('someorg/somemodel')\n"
            "except checkpoint.CheckpointError as e:\n"
            "    print('CheckpointError:', e)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith("CheckpointError: cannot fetch someorg/somemodel from the hub"), r.stdout + r.stderr


# ---------------------------------------------------------------- GGUF

def llama3_rope_factors(c) -> np.ndarray:
    """What llama.cpp's converter stores as rope_freqs.weight for Llama 3.1 rope scaling."""
    s, dim = c.rope_parameters, c.head_dim
    freqs = 1.0 / (s["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    lo_wavelen = s["original_max_position_embeddings"] / s["low_freq_factor"]
    hi_wavelen = s["original_max_position_embeddings"] / s["high_freq_factor"]
    out = []
    for f in freqs:
        wavelen = 2 * math.pi / f
        if wavelen < hi_wavelen:
            out.append(1.0)
        elif wavelen > lo_wavelen:
            out.append(s["factor"])
        else:
            smooth = (s["original_max_position_embeddings"] / wavelen - s["low_freq_factor"]) / \
                (s["high_freq_factor"] - s["low_freq_factor"])
            out.append(1 / ((1 - smooth) / s["factor"] + smooth))
    return np.array(out, dtype=np.float32)


def write_tiny_gguf(hf, path, tie: bool):
    """A llama GGUF (f32) holding the weights of a transformers model, as llama.cpp's converter writes
    it: q/k rows permuted from rotate-half to interleaved pairs, a byte-level BPE vocabulary, and for
    llama3 rope scaling its per-frequency factors as rope_freqs.weight."""
    from gguf import GGUFWriter
    from tokenizers import pre_tokenizers
    c = hf.config
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    merges = ["Ġ t", "h e", "Ġt he"]
    tokens = specials + sorted(pre_tokenizers.ByteLevel.alphabet()) + ["Ġt", "he", "Ġthe"]
    assert len(tokens) == c.vocab_size
    w = GGUFWriter(str(path), "llama")
    w.add_context_length(c.max_position_embeddings)
    w.add_embedding_length(c.hidden_size)
    w.add_block_count(c.num_hidden_layers)
    w.add_feed_forward_length(c.intermediate_size)
    w.add_head_count(c.num_attention_heads)
    w.add_head_count_kv(c.num_key_value_heads)
    w.add_rope_dimension_count(c.head_dim)
    w.add_layer_norm_rms_eps(c.rms_norm_eps)
    w.add_rope_freq_base(c.rope_parameters["rope_theta"])
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3] * len(specials) + [1] * (len(tokens) - len(specials)))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    sd = {k: v.detach().float().numpy() for k, v in hf.state_dict().items()}

    def permute(x, n):
        return x.reshape(n, 2, x.shape[0] // n // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)

    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    if c.rope_parameters.get("rope_type") == "llama3":
        w.add_tensor("rope_freqs.weight", llama3_rope_factors(c))
    if not tie:
        w.add_tensor("output.weight", sd["lm_head.weight"])
    for i in range(c.num_hidden_layers):
        p, b = f"model.layers.{i}.", f"blk.{i}."
        w.add_tensor(b + "attn_q.weight", permute(sd[p + "self_attn.q_proj.weight"], c.num_attention_heads))
        w.add_tensor(b + "attn_k.weight", permute(sd[p + "self_attn.k_proj.weight"], c.num_key_value_heads))
        for ours, theirs in [("attn_v", "self_attn.v_proj"), ("attn_output", "self_attn.o_proj"),
                             ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"), ("ffn_down", "mlp.down_proj"),
                             ("attn_norm", "input_layernorm"), ("ffn_norm", "post_attention_layernorm")]:
            w.add_tensor(f"{b}{ours}.weight", np.ascontiguousarray(sd[p + theirs + ".weight"]))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("tie", [False, True], ids=["untied", "tied"])
def test_gguf_converts_once_into_the_cache_and_matches_transformers(tmp_path, monkeypatch, tie):
    monkeypatch.setattr(checkpoint, "CACHE_DIR", tmp_path / "cache")
    hf = build_hf_model("llama", seed=5, vocab_size=262, num_key_value_heads=2, tie_word_embeddings=tie)
    gguf_path = write_tiny_gguf(hf, tmp_path / "tiny.gguf", tie)

    model, tokenizer = load_model(gguf_path)
    converted = list((tmp_path / "cache").iterdir())
    assert [p.name for p in converted] == [f"tiny-{gguf_path.stat().st_size}"]
    assert (converted[0] / "model_args.json").exists()
    assert model.args.tie_embeddings == tie and model.args.n_kv_head == 2
    torch.manual_seed(0)
    ids = torch.randint(0, 262, (50,))
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    assert (logits(model, ids) - expected).abs().max().item() < 1e-3

    assert (tokenizer.bos_id, tokenizer.eos_id) == (1, 2)
    assert tokenizer.encode(" the", bos=False) == [261]  # the merges were carried over
    assert tokenizer.decode(tokenizer.encode("the 12 thé", bos=False)) == "the 12 thé"

    # A second load reuses the converted folder without reading the GGUF again.
    import gguf

    def no_read(*a, **k):
        raise AssertionError("the GGUF was read again")

    monkeypatch.setattr(gguf, "GGUFReader", no_read)
    model2, _ = load_model(gguf_path)
    assert (logits(model2, ids) - expected).abs().max().item() < 1e-3


def test_two_first_runs_converting_at_once_both_load(tmp_path, monkeypatch):
    # Two data jobs started together on a fresh machine both convert the default GGUF: the one that
    # finishes second must neither write into the other's folder nor fail.
    monkeypatch.setattr(checkpoint, "CACHE_DIR", tmp_path / "cache")
    hf = build_hf_model("llama", seed=5, vocab_size=262, num_key_value_heads=2)
    gguf_path = write_tiny_gguf(hf, tmp_path / "tiny.gguf", tie=False)
    real_save, calls = checkpoint.save_file, []

    def save_while_another_run_converts(state, file):
        calls.append(file)
        if len(calls) == 1:  # the other run, start to end, while this one is writing
            assert (checkpoint.convert_gguf(gguf_path) / "model_args.json").exists()
        real_save(state, file)

    monkeypatch.setattr(checkpoint, "save_file", save_while_another_run_converts)
    out = checkpoint.convert_gguf(gguf_path)
    assert len(calls) == 2 and calls[0].parent != calls[1].parent
    assert [p.name for p in (tmp_path / "cache").iterdir()] == [out.name]  # no temporary folder left
    model, _ = load_model(gguf_path)
    ids = torch.randint(0, 262, (20,))
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    assert (logits(model, ids) - expected).abs().max().item() < 1e-3


def test_gguf_with_llama3_rope_factors_matches_transformers_or_is_refused(tmp_path, monkeypatch):
    monkeypatch.setattr(checkpoint, "CACHE_DIR", tmp_path / "cache")
    hf = build_hf_model("llama", seed=6, vocab_size=262, max_position_embeddings=256, rope_theta=50000.0,
                        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})
    gguf_path = write_tiny_gguf(hf, tmp_path / "llama31.gguf", tie=False)
    try:
        model, _ = load_model(gguf_path)
    except CheckpointError:
        return  # refusing the file is fine; loading it with the wrong RoPE is not
    torch.manual_seed(0)
    ids = torch.randint(0, 262, (100,))
    with torch.no_grad():
        expected = hf(ids[None]).logits[0]
    assert (logits(model, ids) - expected).abs().max().item() < 1e-3


def test_gguf_of_another_architecture_is_a_checkpoint_error(tmp_path, monkeypatch):
    from gguf import GGUFWriter
    monkeypatch.setattr(checkpoint, "CACHE_DIR", tmp_path / "cache")
    w = GGUFWriter(str(tmp_path / "other.gguf"), "gpt2")
    w.add_block_count(1)
    w.add_tensor("token_embd.weight", np.zeros((4, 4), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(CheckpointError, match="GGUF architecture gpt2 is not supported"):
        resolve(tmp_path / "other.gguf")


# ---------------------------------------------------------------- bad HF folders and paths

@pytest.fixture
def hf_folder(tmp_path):
    return write_hf_folder(build_hf_model("llama", num_hidden_layers=1), tmp_path / "model")


def test_missing_path_is_a_checkpoint_error(tmp_path):
    with pytest.raises(CheckpointError, match="does not exist"):
        resolve(tmp_path / "nope")


def test_file_that_is_not_a_model_is_a_checkpoint_error(tmp_path):
    (tmp_path / "weights.bin").write_bytes(b"\0" * 16)
    with pytest.raises(CheckpointError, match="neither a .gguf file nor a folder"):
        resolve(tmp_path / "weights.bin")


def test_truncated_safetensors_is_a_checkpoint_error(hf_folder):
    f = hf_folder / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    with pytest.raises(CheckpointError, match="truncated or corrupt"):
        load_model(hf_folder)


def test_unsupported_architecture_is_a_checkpoint_error(hf_folder):
    cfg = json.loads((hf_folder / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (hf_folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="architecture GPT2LMHeadModel is not supported"):
        load_model(hf_folder)


def test_unsupported_rope_scaling_is_a_checkpoint_error(hf_folder):
    cfg = json.loads((hf_folder / "config.json").read_text())
    cfg.pop("rope_parameters", None)
    cfg["rope_scaling"] = {"rope_type": "yarn", "factor": 4.0}
    (hf_folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="rope_scaling yarn is not supported"):
        load_model(hf_folder)


def test_missing_weight_is_a_checkpoint_error(hf_folder):
    from safetensors.torch import load_file, save_file
    f = hf_folder / "model.safetensors"
    state = load_file(f)
    del state["model.layers.0.mlp.up_proj.weight"]
    save_file(state, f)
    with pytest.raises(CheckpointError, match="model.layers.0.mlp.up_proj.weight is missing"):
        load_model(hf_folder)


def test_folder_without_safetensors_is_a_checkpoint_error(hf_folder):
    (hf_folder / "model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no \\*.safetensors weights"):
        load_model(hf_folder)


def test_config_without_a_required_key_is_a_checkpoint_error(hf_folder):
    cfg = json.loads((hf_folder / "config.json").read_text())
    del cfg["hidden_size"]
    (hf_folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="hidden_size"):
        load_model(hf_folder)


def test_weights_that_do_not_fit_the_config_are_a_checkpoint_error(hf_folder):
    cfg = json.loads((hf_folder / "config.json").read_text())
    cfg["intermediate_size"] += 4
    (hf_folder / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError):
        load_model(hf_folder)
