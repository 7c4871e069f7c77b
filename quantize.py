"""Weight-only int8 / int4 quantization of the base model's linear layers on torch's own kernels: the
quantized modules, which transform a float model from outside, and quantized checkpoints of the base
model and its heads (bench.py's `quality` and `quantized` report what they cost and buy).

    python quantize.py --mode int8 --out ckpt/smollm2-int8                  # symmetric, per output channel
    python quantize.py --mode int4 --out ckpt/smollm2-int4-g32              # the GGUF's Q4_1 blocks, as they are
    python quantize.py --mode int4 --groupsize 128 --lm_head int8 --out ckpt/smollm2-int4-g128
    python generate.py --dtype bfloat16 --compile --checkpoint ckpt/smollm2-int4-g32
    python quantize.py --mode int8 --heads heads/eagle-smollm2 --out ckpt/smollm2-int8   # + int8 heads in it
    python bench.py quality ckpt/smollm2-int8 ckpt/smollm2-int4-g32 ckpt/smollm2-int4-g128
    python bench.py quantized ckpt/smollm2-int8 ckpt/smollm2-int4-g32 --heads heads/eagle-smollm2 --lookup 3

A quantized checkpoint is our layout (model.safetensors, model_args.json, tokenizer) with a
"quantization" entry in model_args.json; generate.load_model builds these modules from it (install). The file
holds a device-independent form: int8 weights [N, K] + scales [N] (w = q * scale), or int4 nibbles
[N, K/2] (byte j: element 2j low, 2j+1 high) + scales and mins [N, K/G] (w = q * scale + min, q in 0..15,
Q4_1's form). The kernels' packed forms are made at load time for the device.
"""
import argparse
import json
import shutil
import sys
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

import checkpoint as C

GROUPSIZES = (32, 64, 128, 256)
# Up to this many rows the packed kernels run (decode and tree verification: memory-bound); over it
# (prefill) the weight is dequantized for the bf16 GEMM, which runs about twice as fast there (docs/speed.md).
KERNEL_ROWS = 64
_noted = set()


class QuantizationError(C.CheckpointError):
    pass


def note_once(msg: str):
    if msg not in _noted:
        _noted.add(msg)
        print(f"quantize: {msg}", file=sys.stderr)


def kernel_for(mode: str, device, dtype) -> str:
    """'cpu' or 'cuda' (torch's packed kernels, bf16 activations) or 'dequant' (dequantize the weight in
    each forward, then F.linear: exact in fp32, where the CPU kernels run a scalar loop 5-20x slower)."""
    kind = torch.device(device).type
    if kind not in ("cpu", "cuda"):
        raise QuantizationError(f"{mode} quantized checkpoints run on cpu or cuda, not {kind}")
    if kind == "cuda" and mode == "int4" and torch.cuda.get_device_capability(device) < (8, 0):
        raise QuantizationError("the CUDA int4 kernel needs compute capability 8.0 or newer: "
                                "use an int8 checkpoint or --device cpu")
    if dtype == torch.bfloat16:
        return "cpu" if kind == "cpu" else ("cuda" if mode == "int4" else "dequant")
    note_once(f"{mode} weights with {str(dtype)[6:]} activations: torch's kernels are fast for bfloat16 "
              "only, so each weight is dequantized in every forward (slow): use --dtype bfloat16")
    return "dequant"


class WeightOnlyInt8Linear(nn.Module):
    """y = x @ (q * scales[:, None]).T + bias; q: int8 [N, K], symmetric per output channel."""

    def __init__(self, q: Tensor, scales: Tensor, bias=None, device="cpu", dtype=torch.bfloat16):
        super().__init__()
        self.out_features, self.in_features = q.shape
        self.kernel = kernel_for("int8", device, dtype)
        # a fresh (64-byte aligned) copy: torch 2.13's CPU kernel segfaults from 16 rows on with a weight
        # that sits unaligned inside the safetensors file's buffer
        self.register_buffer("weight_int8", q.to(device).clone(), persistent=False)
        self.register_buffer("scales", scales.to(device, dtype), persistent=False)
        self.register_buffer("bias", None if bias is None else bias.to(device, dtype), persistent=False)
        self.register_parameter("weight", None)  # the lm_head's float rows (heads read them), set by the loader

    def forward(self, x: Tensor) -> Tensor:
        if self.kernel == "dequant":
            y = F.linear(x, self.weight_int8.to(x.dtype)) * self.scales
        elif x.numel() > KERNEL_ROWS * self.in_features:
            y = F.linear(x, self.weight_int8.to(x.dtype) * self.scales[:, None])
        else:  # (measured: as fast compiled as inductor's woq pattern, which rewrites into this op anyway)
            y = torch._weight_int8pack_mm(x.reshape(-1, self.in_features), self.weight_int8, self.scales)
            y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


class WeightOnlyInt4Linear(nn.Module):
    """y = x @ W.T + bias, W = q * scale + min per group of `groupsize` inputs, q in 0..15."""

    def __init__(self, nibbles: Tensor, scales: Tensor, mins: Tensor, groupsize: int, bias=None,
                 device="cpu", dtype=torch.bfloat16):
        super().__init__()
        self.out_features, self.in_features = nibbles.shape[0], nibbles.shape[1] * 2
        self.groupsize, self.kernel = groupsize, kernel_for("int4", device, dtype)
        self.register_buffer("bias", None if bias is None else bias.to(device, dtype), persistent=False)
        self.register_parameter("weight", None)
        # the portable form: the fallback's and long inputs' (in dtype: fp32 keeps Q4_1's values exact)
        for name, t in (("nibbles", nibbles), ("scales", scales.to(dtype)), ("mins", mins.to(dtype))):
            self.register_buffer(name, t.to(device), persistent=False)
        if self.kernel == "dequant":
            return
        # the kernels dequantize (q - 8) * scale + zero: zero = min + 8 * scale; [K/G, N, 2]
        sz = torch.stack([scales, mins + 8 * scales], -1).transpose(0, 1).contiguous()
        q = unpack_int4(nibbles).to(device)
        if self.kernel == "cpu":
            packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.int(), 2)
        else:  # CUDA (not tested here: no GPU): uint8 [N, K/2], even element in the high nibble
            tiles = next(t for t in (8, 4, 2) if self.in_features % (16 * t) == 0)
            packed = torch.ops.aten._convert_weight_to_int4pack((q[:, ::2] << 4 | q[:, 1::2]).to(torch.uint8), tiles)
        self.register_buffer("weight_packed", packed, persistent=False)
        self.register_buffer("scales_and_zeros", sz.to(device, dtype), persistent=False)

    def forward(self, x: Tensor) -> Tensor:
        if self.kernel == "dequant" or x.numel() > KERNEL_ROWS * self.in_features:
            y = F.linear(x, dequantize_int4(self.nibbles, self.scales.to(x.dtype), self.mins.to(x.dtype)))
        else:
            op = torch.ops.aten._weight_int4pack_mm_for_cpu if self.kernel == "cpu" else torch.ops.aten._weight_int4pack_mm
            y = op(x.reshape(-1, self.in_features), self.weight_packed, self.groupsize, self.scales_and_zeros)
            y = y.view(*x.shape[:-1], self.out_features)
        return y if self.bias is None else y + self.bias


# ---------------------------------------------------------------- the schemes

def quantize_int8(w: Tensor):
    """w [N, K] -> (q int8 [N, K], scales fp32 [N]); |w - q * scale| <= scale / 2."""
    w = w.float()
    scales = w.abs().amax(1) / 127
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    return (w / scales[:, None]).round().clamp(-127, 127).to(torch.int8), scales


def dequantize_int8(q: Tensor, scales: Tensor) -> Tensor:
    return q.to(scales.dtype) * scales[:, None]


def quantize_int4(w: Tensor, groupsize: int):
    """w [N, K] -> (nibbles uint8 [N, K/2], scales, mins fp32 [N, K/G]); asymmetric per group of G inputs:
    scale = (max - min) / 15, |w - (q * scale + min)| <= scale / 2."""
    N, K = w.shape
    wg = w.float().view(N, K // groupsize, groupsize)
    lo, hi = wg.amin(-1), wg.amax(-1)
    scales = (hi - lo) / 15
    scales = torch.where(scales > 0, scales, torch.ones_like(scales))
    q = ((wg - lo[..., None]) / scales[..., None]).round().clamp(0, 15).to(torch.uint8).view(N, K)
    return pack_int4(q), scales, lo


def pack_int4(q: Tensor) -> Tensor:
    return (q[:, 0::2] | (q[:, 1::2] << 4)).to(torch.uint8)


def unpack_int4(nibbles: Tensor) -> Tensor:
    return torch.stack([nibbles & 15, nibbles >> 4], -1).view(nibbles.shape[0], -1)  # uint8 [N, K]


def dequantize_int4(nibbles: Tensor, scales: Tensor, mins: Tensor) -> Tensor:
    N, G = scales.shape
    q = unpack_int4(nibbles).to(scales.dtype).view(N, G, -1)
    return (q * scales[..., None] + mins[..., None]).view(N, -1)


def q4_1_blocks(tensor):
    """A GGUF Q4_1 tensor [N, K] -> (nibbles, scales, mins) as quantize_int4(w, 32) gives them. A block
    is 20 bytes: fp16 d, fp16 m, 16 bytes whose byte j holds element j (low nibble) and j + 16 (high)."""
    raw = torch.from_numpy(tensor.data.copy()).view(torch.uint8)
    N, K = int(tensor.shape[1]), int(tensor.shape[0])  # GGUF shapes are reversed
    blocks = raw.reshape(N, K // 32, 20)
    d = blocks[..., 0:2].contiguous().view(torch.float16)[..., 0].float()
    m = blocks[..., 2:4].contiguous().view(torch.float16)[..., 0].float()
    qs = blocks[..., 4:]
    q = torch.cat([qs & 15, qs >> 4], -1).reshape(N, K)
    return pack_int4(q), d, m


# ---------------------------------------------------------------- checkpoints

def linear_names(args, lm_head: bool):
    names = [f"layers.{i}.{m}" for i in range(args.n_layer) for m in
             ("attention.wqkv", "attention.wo", "feed_forward.w1", "feed_forward.w2", "feed_forward.w3")]
    return names + ["output"] * lm_head


def install(model, state: dict, quant: dict, device, dtype) -> dict:
    """Replaces model's (meta) linears named by `quant` with quantized modules built from their stored
    tensors in `state`, on device in dtype. Returns the rest of the state, for load_state_dict."""
    mode, g, lm_head = quant.get("mode"), quant.get("groupsize"), quant.get("lm_head")
    if mode not in ("int8", "int4") or lm_head not in (None, "int8"):
        raise QuantizationError(f"unknown quantization {quant}: this engine knows int8, int4 and lm_head int8")
    state = dict(state)
    for name in linear_names(model.args, lm_head == "int8"):
        pop = lambda k: state.pop(f"{name}.{k}", None)
        bias = pop("bias")
        try:
            if name == "output" or mode == "int8":
                q, s = pop("weight_int8"), pop("scales")
                layer = WeightOnlyInt8Linear(q, s, bias, device, dtype)
                if name == "output" and not model.args.tie_embeddings:  # heads read the lm_head's rows
                    state["output.weight"] = dequantize_int8(q, s)
            else:
                layer = WeightOnlyInt4Linear(pop("weight_int4"), pop("scales"), pop("mins"), g, bias, device, dtype)
        except (AttributeError, TypeError):
            raise QuantizationError(f"the quantized weights of {name} are missing from the checkpoint") from None
        parent, _, child = name.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, layer)
    return state


def quantize_state(state: dict, args, mode: str, groupsize: int, lm_head, gguf=None):
    """Our float state dict -> (the stored quantized state, source note). gguf: the source GGUF file,
    whose Q4_1 tensors give int4-g32 weights without a round trip through floats."""
    raw = {}
    if gguf is not None and mode == "int4" and groupsize == 32:
        from gguf import GGMLQuantizationType, GGUFReader
        raw = {t.name: t for t in GGUFReader(gguf).tensors if t.tensor_type == GGMLQuantizationType.Q4_1}
    # llama.cpp's q/k rows are already our interleaved RoPE layout (checkpoint.convert_gguf): no permutation
    gguf_names = {"attention.wqkv": ("attn_q", "attn_k", "attn_v"), "attention.wo": ("attn_output",),
                  "feed_forward.w1": ("ffn_gate",), "feed_forward.w3": ("ffn_up",), "feed_forward.w2": ("ffn_down",)}
    out, from_gguf = dict(state), 0
    for name in linear_names(args, lm_head == "int8"):
        w = out.pop(f"{name}.weight", None)
        if w is None:  # a tied lm_head: the embedding's rows; the embedding itself stays exact
            w = state["tok_embeddings.weight"]
        if name == "output" or mode == "int8":
            out[f"{name}.weight_int8"], out[f"{name}.scales"] = quantize_int8(w)
            continue
        if w.shape[1] % groupsize:
            raise QuantizationError(f"--groupsize {groupsize} does not divide the {w.shape[1]} in-features of {name}: "
                                    f"use one of {', '.join(str(g) for g in GROUPSIZES if w.shape[1] % g == 0)}")
        _, i, sub = name.split(".", 2)
        tensors = [raw.get(f"blk.{i}.{t}.weight") for t in gguf_names[sub]]
        if raw and all(t is not None for t in tensors):
            parts = [q4_1_blocks(t) for t in tensors]
            packed = tuple(torch.cat([p[j] for p in parts]) for j in range(3))
            from_gguf += 1
        else:
            packed = quantize_int4(w, groupsize)
        for k, t in zip(("weight_int4", "scales", "mins"), packed):
            out[f"{name}.{k}"] = t
    out.pop("output.weight", None)
    return out, f"Q4_1 blocks of {Path(gguf).name}" if from_gguf else "quantized from the float weights"


def write_quantized(src, out_dir, mode: str, groupsize: int = 32, lm_head=None) -> Path:
    """The quantized checkpoint folder of src (None: the embedded model; a folder, .gguf or hub id)."""
    if mode not in ("int8", "int4"):
        raise QuantizationError(f"unknown --mode {mode}: use int8 or int4")
    if mode == "int4" and groupsize not in GROUPSIZES:
        raise QuantizationError(f"--groupsize {groupsize} is not one of {', '.join(map(str, GROUPSIZES))}")
    if lm_head not in (None, "none", "int8"):
        raise QuantizationError(f"unknown --lm_head {lm_head}: use int8 (or leave it out)")
    lm_head = None if lm_head == "none" else lm_head
    gguf = C.default_checkpoint() if src is None else Path(src)
    gguf = gguf if gguf.suffix == ".gguf" and gguf.is_file() else None
    folder, args, state = C.resolve(src)
    if C.quantization(folder):
        raise QuantizationError(f"{folder} is already quantized ({C.quantization(folder)['mode']}): "
                                "quantize its float source instead")
    qstate, source = quantize_state(state, args, mode, groupsize, lm_head, gguf)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    C.save_file({k: v.contiguous() for k, v in qstate.items()}, out / "model.safetensors")
    cfg = args.to_dict()
    cfg["quantization"] = {"mode": mode, "groupsize": groupsize if mode == "int4" else None,
                           "lm_head": lm_head, "source": source}
    (out / "model_args.json").write_text(json.dumps(cfg, indent=1))
    for f in C.TOKENIZER_FILES:
        if (Path(folder) / f).exists():
            shutil.copy(Path(folder) / f, out / f)
    return out


# ---------------------------------------------------------------- draft heads

# A quantized head folder is the head's official layout with every linear weight `X.weight` [N, K]
# stored as `X.weight_int8` + `X.scales` (int8, per output channel, whatever the base's mode: a
# head's layers are too small for int4's groups to pay) and a "quantization" entry in config.json.
# checkpoint.load_heads dequantizes the file for its layout code, then quantize_linears quantizes the float head
# again, which gives back the stored integers (the scales to fp32 rounding): tested.

def quantize_heads_state(sd: dict) -> dict:
    out = {}
    for k, v in sd.items():
        if k.endswith(".weight") and v.ndim == 2 and v.is_floating_point():
            out[k[:-len("weight")] + "weight_int8"], out[k[:-len("weight")] + "scales"] = quantize_int8(v)
        else:
            out[k] = v
    return out


def quantize_linears(module: nn.Module, device, dtype) -> nn.Module:
    """Swaps every nn.Linear of a (float) draft head for the int8 module of its weight, in place."""
    for name, m in list(module.named_modules()):
        if isinstance(m, nn.Linear):
            q, s = quantize_int8(m.weight.detach())
            parent, _, child = name.rpartition(".")
            bias = None if m.bias is None else m.bias.detach()
            setattr(module.get_submodule(parent) if parent else module, child,
                    WeightOnlyInt8Linear(q, s, bias, device, dtype))
    return module


def float_heads_config(src) -> dict:
    f = Path(src) / "config.json"
    cfg = json.loads(f.read_text()) if f.exists() else {}
    if cfg.get("quantization"):
        raise QuantizationError(f"{src} is already quantized ({cfg['quantization']['mode']}): "
                                "quantize its float source instead")
    return cfg


def write_quantized_heads(src, out_dir, base) -> Path:
    """The int8 head folder of the float head folder src (its official layout); base: the float base
    model the head drafts for, in fp32 (which keeps a float head's values exactly)."""
    cfg = float_heads_config(src)
    head, _ = C.load_heads(src, base)
    out = Path(out_dir)
    C.save_heads(head, out, cfg.get("base_model_name_or_path", ""), torch.float32)
    weights = next(f for f in out.iterdir() if f.suffix == ".safetensors")
    C.save_file(quantize_heads_state(C.read_safetensors(weights)), weights)
    cfg = json.loads((out / "config.json").read_text())
    cfg["quantization"] = {"mode": "int8", "source": str(src)}
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    for f in ("acceptance.json", "tree.json"):  # the float head's measured acceptance: --tree auto reads it
        if (Path(src) / f).exists():
            shutil.copy(Path(src) / f, out / f)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--mode", help="int8 (symmetric per output channel) or int4 (asymmetric groupwise)")
    p.add_argument("--groupsize", type=int, default=32, help="int4: inputs per group, 32 | 64 | 128 | 256")
    p.add_argument("--lm_head", default=None, help="int8: quantize the output projection too (the embedding "
                                                   "lookup stays exact)")
    p.add_argument("--checkpoint", default=None, help="the float source (default: the embedded model)")
    p.add_argument("--out", help="the quantized checkpoint folder to write")
    p.add_argument("--heads", default=None, help="also write these heads in int8 to OUT/<their folder name>")
    args = p.parse_args(argv)
    try:
        if not args.mode or not args.out:
            raise ValueError("give --mode int8|int4 and --out DIR")
        if args.heads:
            float_heads_config(args.heads)  # before anything is written
        out = write_quantized(args.checkpoint, args.out, args.mode, args.groupsize, args.lm_head)
        print(f"wrote {out} ({C.quantization(out)})")
        if args.heads:
            base, _ = C.load_model(args.checkpoint, "cpu", torch.float32)
            heads = write_quantized_heads(args.heads, out / Path(args.heads).name, base)
            print(f"wrote {heads} (int8 heads: python generate.py --checkpoint {out} --heads {heads})")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
