"""A Llama-family transformer with a static KV cache (gpt-fast style).

Covers Llama 2 / Vicuna, Llama 3.x (rope scaling), Mistral, Qwen2 (q/k/v bias) and SmolLM.
q/k projections are stored in the interleaved-pairs RoPE layout (as in Meta's and
llama.cpp's checkpoints); the HF loader permutes rotate-half weights into it.
"""
import math
from dataclasses import dataclass, asdict
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor


@dataclass
class ModelArgs:
    dim: int = 576
    n_layer: int = 30
    n_head: int = 9
    n_kv_head: int = 3
    intermediate_size: int = 1536
    vocab_size: int = 49152
    head_dim: int = 0  # 0: dim // n_head
    norm_eps: float = 1e-5
    rope_base: float = 100000.0
    rope_scaling: Optional[dict] = None  # Llama 3.x: factor, low_freq_factor, high_freq_factor, original_max_position_embeddings
    rope_freq_factors: Optional[list] = None  # the same, as llama.cpp stores it: one divisor per frequency
    max_seq_len: int = 8192
    attn_bias: bool = False  # q/k/v bias (Qwen2)
    tie_embeddings: bool = True

    def __post_init__(self):
        if not self.head_dim:
            self.head_dim = self.dim // self.n_head

    def to_dict(self):
        return asdict(self)


class KVCache(nn.Module):
    def __init__(self, batch: int, n_kv_head: int, max_seq_len: int, head_dim: int, dtype, device=None):
        super().__init__()
        # one slot more than a step ever writes or reads: a step attends slots [0, L) with L <= max_seq_len,
        # so the slice k[:, :, :L] is never the whole tensor, which a compiled graph with L symbolic
        # would otherwise guard on (a second graph for L == max_seq_len)
        shape = (batch, n_kv_head, max_seq_len + 1, head_dim)
        self.register_buffer("k_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)
        self.register_buffer("v_cache", torch.zeros(shape, dtype=dtype, device=device), persistent=False)

    def update(self, cache_pos: Tensor, k: Tensor, v: Tensor):
        # cache_pos: [T]; k, v: [B, H_kv, T, D]
        self.k_cache.index_copy_(2, cache_pos, k)
        self.v_cache.index_copy_(2, cache_pos, v)
        return self.k_cache, self.v_cache

    def compact(self, src: Tensor, dst: Tensor):
        # Move the accepted path's entries (slots src) to the contiguous slots dst. Gather first:
        # src and dst may overlap, and an in-place copy over overlapping slots would read overwritten data.
        for cache in (self.k_cache, self.v_cache):
            cache.index_copy_(2, dst, cache.index_select(2, src))


class Transformer(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        self.tok_embeddings = nn.Embedding(args.vocab_size, args.dim)
        self.layers = nn.ModuleList(Block(args) for _ in range(args.n_layer))
        self.norm = RMSNorm(args.dim, args.norm_eps)
        self.output = nn.Linear(args.dim, args.vocab_size, bias=False)
        if args.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight
        self.max_batch = -1
        self.max_seq_len = -1

    def setup_caches(self, max_batch: int, max_seq_len: int):
        if max_seq_len > self.args.max_seq_len:
            raise ValueError(f"cache of {max_seq_len} tokens is longer than the model's context "
                             f"of {self.args.max_seq_len}: ask for fewer tokens")
        dtype, device = self.output.weight.dtype, self.output.weight.device
        self.max_batch, self.max_seq_len = max_batch, max_seq_len
        for layer in self.layers:
            layer.attention.kv_cache = KVCache(max_batch, self.args.n_kv_head, max_seq_len,
                                               self.args.head_dim, dtype, device)
        self.register_buffer("freqs_cis", precompute_freqs_cis(self.args, max_seq_len, device), persistent=False)

    def compact(self, src: Tensor, dst: Tensor):
        """After a tree step: move the accepted path's cache slots src [K] to the contiguous slots dst [K]."""
        for layer in self.layers:
            layer.attention.kv_cache.compact(src, dst)

    def forward(self, idx: Tensor, input_pos: Tensor, mask: Optional[Tensor] = None,
                cache_pos: Optional[Tensor] = None, return_hidden: bool = False,
                tree_mask: Optional[Tensor] = None):
        """idx: [B, T] tokens; input_pos: [T] RoPE positions.
        cache_pos: [T] cache slots to write (default input_pos; a tree writes node i at slot
        cache_len + i while its position is cache_len + depth).
        mask: bool [T, L] or [B, 1, T, L], True = may attend to that slot; attention reads only the
        first L <= max_seq_len cache slots (default L = max_seq_len, causal on cache_pos).
        tree_mask: bool [T, T], for a tree's rows: then mask is [1, L], the prefix slots every row
        sees, and row i sees row j of this call where tree_mask[i, j] (tree_attention).
        Returns logits [B, T, V], and with return_hidden also the last hidden states
        before and after the final norm, each [B, T, dim]."""
        if cache_pos is None:
            cache_pos = input_pos
        if mask is None:
            mask = torch.arange(self.max_seq_len, device=idx.device)[None, :] <= cache_pos[:, None]
        if mask.dim() == 2:
            mask = mask[None, None]
        freqs_cis = self.freqs_cis[input_pos]
        x = self.tok_embeddings(idx)
        for layer in self.layers:
            x = layer(x, freqs_cis, mask, cache_pos, tree_mask)
        h = self.norm(x)
        logits = self.output(h)
        if return_hidden:
            return logits, x, h
        return logits


class Block(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.attention = Attention(args)
        self.feed_forward = FeedForward(args)
        self.attention_norm = RMSNorm(args.dim, args.norm_eps)
        self.ffn_norm = RMSNorm(args.dim, args.norm_eps)

    def forward(self, x: Tensor, freqs_cis: Tensor, mask: Tensor, cache_pos: Tensor,
                tree_mask: Optional[Tensor] = None) -> Tensor:
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask, cache_pos, tree_mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Attention(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.n_head, self.n_kv_head, self.head_dim = args.n_head, args.n_kv_head, args.head_dim
        qkv = (args.n_head + 2 * args.n_kv_head) * args.head_dim
        self.wqkv = nn.Linear(args.dim, qkv, bias=args.attn_bias)
        self.wo = nn.Linear(args.n_head * args.head_dim, args.dim, bias=False)
        self.kv_cache: Optional[KVCache] = None

    def forward(self, x: Tensor, freqs_cis: Tensor, mask: Tensor, cache_pos: Tensor,
                tree_mask: Optional[Tensor] = None) -> Tensor:
        B, T, _ = x.shape
        qkv = self.wqkv(x)
        if tree_mask is None and T > 1:  # prefill, EAGLE's draft rows
            return self.wo(self.rows_attention(qkv, freqs_cis, mask, cache_pos))
        q, k, v, k_new, v_new = self.cached(qkv, freqs_cis, mask, cache_pos)
        if tree_mask is not None:
            y = self.tree_attention(q, k, v, k_new, v_new, mask, tree_mask)
            return self.wo(y.transpose(1, 2).reshape(B, T, -1))
        return self.wo(self.token_attention(q, k, v, k_new, v_new, mask, cache_pos))

    def token_attention(self, q: Tensor, k: Tensor, v: Tensor, k_new: Tensor, v_new: Tensor, mask: Tensor,
                        cache_pos: Tensor) -> Tensor:
        """One new token, q [B, H, 1, D], over the cache's span k, v [B, H_kv, L, D] (its own slot
        cache_pos written; k_new, v_new [B, H_kv, 1, D] its key and value) under mask [B or 1, 1, 1, L].
        Returns [B, 1, H * D]."""
        B, T = q.shape[0], 1
        # One new token: the G query heads that share a kv head go in as one head of G rows, so that
        # SDPA multiplies G rows at once rather than one row at a time
        G = self.n_head // self.n_kv_head
        q = q.reshape(B, self.n_kv_head, G, self.head_dim)
        mask = mask.expand(-1, -1, G, -1)                              # [B or 1, 1, G, L]
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, H_kv, G, D]
        return y.view(B, self.n_head, T, self.head_dim).transpose(1, 2).reshape(B, T, -1)

    def cached(self, qkv: Tensor, freqs_cis: Tensor, mask: Tensor, cache_pos: Tensor):
        """q and k rotated, this call's k and v written into the cache slots cache_pos. Returns q
        [B, H, T, D], the cache's first L = mask.shape[-1] slots k, v [B, H_kv, L, D] and this call's
        k_new, v_new [B, H_kv, T, D]."""
        B, T, _ = qkv.shape
        q_size, kv_size = self.n_head * self.head_dim, self.n_kv_head * self.head_dim
        q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
        q = apply_rotary_emb(q.view(B, T, self.n_head, self.head_dim), freqs_cis)
        k = apply_rotary_emb(k.view(B, T, self.n_kv_head, self.head_dim), freqs_cis)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.view(B, T, self.n_kv_head, self.head_dim).transpose(1, 2)
        k_new, v_new = k, v
        k, v = self.kv_cache.update(cache_pos, k, v)
        L = mask.shape[-1]  # the live slots: attention costs what the prefix costs, not the static cache
        return q, k[:, :, :L], v[:, :, :L], k_new, v_new

    def rows_attention(self, qkv: Tensor, freqs_cis: Tensor, mask: Tensor, cache_pos: Tensor) -> Tensor:
        """Rows (qkv [B, T, ...]) over a bool mask [.., T or 1, L]. Returns [B, T, H * D]."""
        q, k, v, _, _ = self.cached(qkv, freqs_cis, mask, cache_pos)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=self.n_head != self.n_kv_head)
        return y.transpose(1, 2).reshape(*qkv.shape[:2], -1)

    def tree_attention(self, *args) -> Tensor:
        return tree_attention(*args)


def tree_attention(q: Tensor, k: Tensor, v: Tensor, k_new: Tensor, v_new: Tensor, prefix: Tensor,
                   tree_mask: Tensor, pv_dtype: Optional[torch.dtype] = None) -> Tensor:
    """Attention of a tree's T rows: over the cache's prefix slots as two batched matmuls, over the
    tree's own rows, whose keys and values are at hand, written out: a [T, L] mask over the cache
    slots would need the tree mask gathered into them. Scores and softmax in fp32, as SDPA's; the
    weights meet the cached values in pv_dtype (default the cache's, as SDPA does).
    q [B, H, T, D]; k, v [B, H_kv, L, D] the cache's span; k_new, v_new [B, H_kv, T, D];
    prefix: bool [.., L] the slots every row sees; tree_mask: bool [T, T]. Returns [B, H, T, D]."""
    B, H, T, D = q.shape
    H_kv = k.shape[1]
    G = H // H_kv
    q = q.float().reshape(B, H_kv, G * T, D) * D ** -0.5                     # a kv head's query heads as rows
    s_prefix = (q @ k.float().transpose(-1, -2)).masked_fill(~prefix, float("-inf"))      # [B, H_kv, G*T, L]
    s_tree = (q[:, :, :, None] * k_new.float()[:, :, None]).sum(-1)           # [B, H_kv, G*T, T]
    s_tree = s_tree.view(B, H_kv, G, T, T).masked_fill(~tree_mask, float("-inf")).view(B, H_kv, G * T, T)
    p = torch.cat([s_prefix, s_tree], -1).softmax(-1)
    L = k.shape[2]
    pv = pv_dtype or v.dtype
    y = (p[..., :L].to(pv) @ v.to(pv).contiguous()).float() + (p[..., L:, None] * v_new.float()[:, :, None]).sum(-2)
    return y.to(v.dtype).view(B, H, T, D)


class FeedForward(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.w1 = nn.Linear(args.dim, args.intermediate_size, bias=False)  # gate
        self.w3 = nn.Linear(args.dim, args.intermediate_size, bias=False)  # up
        self.w2 = nn.Linear(args.intermediate_size, args.dim, bias=False)  # down

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        # In fp32, as HF does, so bf16 models match the reference.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * x32.type_as(x)


def rope_frequencies(args: ModelArgs) -> Tensor:
    d = args.head_dim
    freqs = 1.0 / (args.rope_base ** (torch.arange(0, d, 2, dtype=torch.float64)[: d // 2] / d))
    s = args.rope_scaling
    if s is not None:  # Llama 3.x: slow down the low frequencies, keep the high ones
        factor, lo, hi = s["factor"], s.get("low_freq_factor", 1.0), s.get("high_freq_factor", 4.0)
        old_ctx = s["original_max_position_embeddings"]
        wavelen = 2 * math.pi / freqs
        smooth = (old_ctx / wavelen - lo) / (hi - lo)
        scaled = (1 - smooth) * freqs / factor + smooth * freqs
        freqs = torch.where(wavelen < old_ctx / hi, freqs, torch.where(wavelen > old_ctx / lo, freqs / factor, scaled))
    if args.rope_freq_factors is not None:
        freqs = freqs / torch.tensor(args.rope_freq_factors, dtype=torch.float64)
    return freqs


def precompute_freqs_cis(args: ModelArgs, seq_len: int, device=None) -> Tensor:
    freqs = rope_frequencies(args)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), freqs)
    return torch.stack([angles.cos(), angles.sin()], dim=-1).float().to(device)  # [S, D/2, 2]


def apply_rotary_emb(x: Tensor, freqs_cis: Tensor) -> Tensor:
    # x: [B, T, H, D], rotated in interleaved pairs (x0, x1), (x2, x3), ...; freqs_cis: [T, D/2, 2]
    xs = x.float().reshape(*x.shape[:-1], -1, 2)
    fc = freqs_cis.view(1, xs.size(1), 1, xs.size(3), 2)
    out = torch.stack([xs[..., 0] * fc[..., 0] - xs[..., 1] * fc[..., 1],
                       xs[..., 1] * fc[..., 0] + xs[..., 0] * fc[..., 1]], dim=-1)
    return out.flatten(3).type_as(x)
