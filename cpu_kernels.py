"""The steps' bf16 kernels for CPUs: with AVX-512 bf16 and without AMX (AMD Zen 4) a tree's rows'
projections and attention; with AMX (Intel Xeon) every step's projections and attention;
with AVX2 only (AMD Zen 3) every projection and a tree's attention.

A tree step multiplies 2-16 rows by every weight and attends from them over the cache. What torch
ships does both badly there (docs/speed.md): inductor's GEMM template converts bf16 to fp32 and runs
FMAs (no vdpbf16ps micro-kernel), bound by arithmetic past a few rows, and oneDNN streams the weights
at half the memory's rate with a per-call floor; the tree attention, written in torch ops, costs two
bmm calls, a copy of the cache span to fp32 and a softmax pass a layer. Both kernels here use vdpbf16ps (pairs of bf16 products summed into fp32):

- rows_linear: the weights packed once (pack) so that each 64-byte line holds 16 columns' pair of k;
  every line loaded meets all the rows from registers, with no horizontal sums, and each thread
  streams its panels in order. 8 rows then cost about what one costs (the memory's rate).
- tree_attention: a kv head's query rows 16 at a time, scores, fp32 softmax and values in one pass.
- tiles_linear (with AMX): 1-64 rows on AMX tiles, a bias optional, the weights packed (pack_tiles)
  so that each thread streams one run of B tiles; as fast for a token as inductor's one-row kernel
  and oneDNN, and a tree's rows cost little more than one row.
- tiles_glu (with AMX): a SwiGLU's gate and up projections and silu(gate) * up in one op (pack_glu).
- rows_attention (with AMX): tree_attention's job on AMX tiles, over the tree mask gathered into the
  cache slots (TileTransformer), with the RoPE and cache writes before it.
- argmax (both): the greedy token of each row (trees.argmax), each thread over the columns that its
  core's lm_head wrote.

On AVX2 without AVX-512 (AMD Zen 3) there is no bf16 arithmetic: inductor's bf16 GEMM widens the
weights to fp32 for every few rows and oneDNN's is bound by arithmetic, so a tree's rows cost many
times one row there. cpu_kernels_avx2.cpp's rows_linear, for every row count: the weights packed once
(pack_avx2) so that one 32-byte load and two unpacks give 16 columns in fp32, each meeting up to 6
rows from registers with FMAs, prefetched 2 KB ahead; 1 row streams the weights faster than
inductor's one-row GEMM and 4 rows cost about what 1 costs. Its rows_glu: rows_linear's loop over w1
and w3 packed together (pack_glu_avx2), silu(gate) * up in one call, as tiles_glu. Its
tree_attention: 8 of a kv head's query rows a task (the lanes), the keys and values widened to fp32
once, scores and weighted values by FMAs, in half the time of model.tree_attention's torch ops.

Each output element sums in the same order whatever the number of rows, so a row gets the same
result in a tree step as alone. Ops (treespec::...) so that torch.compile calls them as they are,
written in cpu_kernels.cpp or cpu_kernels_avx2.cpp (cpu_kernels.h: what the two share) and built
with the C++ compiler that inductor needs anyway, once per machine (torch caches the build in
the project's cache folder, kernels/, BUILD_DIR); where that fails the step keeps torch's kernels."""
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from checkpoint import CACHE_DIR
from model import Attention, FeedForward, KVCache, Transformer, tree_attention


# the row counts given to rows_linear (a static shape, so chosen when traced): a token step's one row too,
# as fast as torch's prepacked GEMM and a graph that inductor's cache can keep (docs/speed.md)
MIN_ROWS, MAX_ROWS = 1, 16


def wanted(device, dtype) -> bool:
    """bf16 on a CPU with AVX-512 bf16 and no AMX (rows_linear, tree_attention)."""
    return (torch.device(device).type == "cpu" and dtype == torch.bfloat16
            and torch.cpu._is_avx512_bf16_supported() and not torch.cpu._is_amx_tile_supported())


def wanted_avx2(device, dtype) -> bool:
    """bf16 on a CPU whose best vectors are AVX2's: no bf16 arithmetic (AMD Zen 3; cpu_kernels_avx2.cpp)."""
    return (torch.device(device).type == "cpu" and dtype == torch.bfloat16
            and torch.backends.cpu.get_cpu_capability() == "AVX2")


def wanted_tiles(device, dtype) -> bool:
    """bf16 on a CPU with AMX tiles that the OS lets this process use (tiles_linear, rows_attention)."""
    return (torch.device(device).type == "cpu" and dtype == torch.bfloat16
            and torch.cpu._is_amx_tile_supported() and torch.cpu._init_amx())


_built = None  # the ops that build() loaded (empty where it failed); None before it ran
BUILD_DIR = CACHE_DIR / "kernels"  # (fixed at import: a test's own cache folder would build them again)
CPU_BF16 = torch.cpu._is_avx512_bf16_supported()  # bf16 arithmetic (AVX-512 bf16); read once: dynamo skips it


def has(op: str) -> bool:
    """Whether build() has loaded the op treespec::op (without building anything)."""
    return bool(_built) and op in _built


def build() -> bool:
    """Compiles and loads the ops once per process, from cpu_kernels_avx2.cpp on an AVX2 CPU (no
    AVX-512), else cpu_kernels.cpp; False (with a note) where that fails."""
    global _built
    if _built is None:
        from torch.utils.cpp_extension import load
        avx2 = torch.backends.cpu.get_cpu_capability() == "AVX2"
        name, flags = (("cpu_kernels_avx2", ["-mavx2", "-mfma"]) if avx2 else
                       ("cpu_kernels", ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx512bf16",
                                        "-mamx-tile", "-mamx-bf16"]))
        fakes = {
            "rows_linear": lambda x, wp, b=None: x.new_empty(*x.shape[:-1], 16 * wp.shape[0]),
            "rows_glu": lambda x, wp: x.new_empty(*x.shape[:-1], 8 * wp.shape[0]),
            "tree_attention": lambda q, k, v, k_new, v_new, prefix, tree_mask:
                torch.empty_like(q, memory_format=torch.contiguous_format),
            "tiles_linear": lambda x, wp, b: x.new_empty(*x.shape[:-1], 32 * wp.shape[0]),
            "tiles_glu": lambda x, wp: x.new_empty(*x.shape[:-1], 16 * wp.shape[0]),
            "argmax": lambda x: x.new_empty(x.shape[:-1], dtype=torch.long),
            "topk": lambda x, k: x.new_empty(*x.shape[:-1], k, dtype=torch.long),
            "rows_attention": lambda qkv, freqs, pos, k_cache, v_cache, mask, n_head:
                qkv.new_empty(*qkv.shape[:2], 64 * n_head),
        }
        folder = BUILD_DIR / name
        folder.mkdir(parents=True, exist_ok=True)
        clear_stale_lock(folder)
        try:
            load("treespec_" + name, [str(Path(__file__).with_name(name + ".cpp"))], is_python_module=False,
                 extra_cflags=["-O3", *flags, "-fopenmp"], extra_ldflags=["-fopenmp"], build_directory=str(folder))
            _built = {op for op in fakes if hasattr(torch.ops.treespec, op)}
            for op in _built:
                torch.library.register_fake("treespec::" + op)(fakes[op])
        except Exception as e:
            print(f"note: the CPU kernels did not build ({str(e).splitlines()[0][:120]}); "
                  "tree steps use torch's kernels", file=sys.stderr)
            _built = set()
    return bool(_built)


def clear_stale_lock(folder: Path, older_than: float = 600.0) -> bool:
    """torch's extension build takes a lock file in its folder and waits, silently and for ever, while
    one is there; a build killed midway (Ctrl-C during the first run) leaves its lock behind, and every
    later run hung. A build here takes 1-2 minutes, so a lock older than older_than seconds is such a
    one: removed, with a note. Returns whether it removed one."""
    lock = Path(folder) / "lock"
    try:
        if time.time() - lock.stat().st_mtime < older_than:
            return False
        lock.unlink()
    except FileNotFoundError:
        return False
    print(f"note: removed {lock}, left by a kernel build that was stopped midway", file=sys.stderr)
    return True


def pack(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] -> [N/16, K/2, 16, 2]: 16 columns' pairs of k, one 64-byte line a pair (rows_linear's layout)."""
    N, K = w.shape
    return w.detach().view(N // 16, 16, K // 2, 2).permute(0, 2, 1, 3).contiguous()


def pack_avx2(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] -> [N/16, K, 16]: a panel's 16 columns at each k, ordered 0-3, 8-11, 4-7, 12-15 so that
    AVX2's two unpacks (within 128-bit lanes) widen them to columns 0-7 and 8-15 (the AVX2 rows_linear's layout)."""
    N, K = w.shape
    order = torch.tensor([0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7, 12, 13, 14, 15], device=w.device)
    return w.detach().view(N // 16, 16, K)[:, order].transpose(1, 2).contiguous()


def pack_glu_avx2(w1: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    """w1, w3 [N, K] -> pack_avx2 of [2N, K] holding w1's first 16 rows, w3's, w1's next 16, ... (rows_glu's layout)."""
    N, K = w1.shape
    return pack_avx2(torch.stack([w1.detach().view(N // 16, 16, K), w3.detach().view(N // 16, 16, K)], 1).view(2 * N, K))


def pack_tiles(w: torch.Tensor) -> torch.Tensor:
    """w [N, K] -> [N/32, K/32, 2, 16, 16, 2]: per 32 columns and 32 k, two AMX B tiles (tiles_linear's layout)."""
    N, K = w.shape
    return w.detach().view(N // 32, 2, 16, K // 32, 16, 2).permute(0, 3, 1, 4, 2, 5).contiguous()


def pack_glu(w1: torch.Tensor, w3: torch.Tensor) -> torch.Tensor:
    """w1, w3 [N, K] -> pack_tiles of [2N, K] holding w1's first 32 rows, w3's, w1's next 32, ... (tiles_glu's layout)."""
    N, K = w1.shape
    return pack_tiles(torch.stack([w1.detach().view(N // 32, 32, K), w3.detach().view(N // 32, 32, K)], 1).view(2 * N, K))


class TileLinear(nn.Linear):
    """nn.Linear whose bf16 forward over up to MAX_TILE_ROWS rows (a token step, a tree's rows, a
    draft level, a short prompt) is tiles_linear on a packed copy of the weight, kept beside it
    (longer prompts use the weight as it is)."""

    def forward(self, x):
        if x.dtype == torch.bfloat16 and x.numel() // x.shape[-1] <= MAX_TILE_ROWS:
            return torch.ops.treespec.tiles_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)


class TileFeedForward(FeedForward):
    """FeedForward whose bf16 forward over up to MAX_TILE_ROWS rows makes silu(w1(x)) * w3(x) in one
    tiles_glu call on a packed copy of w1 and w3 (longer prompts use the weights as they are)."""

    def forward(self, x):
        if x.dtype == torch.bfloat16 and x.numel() // x.shape[-1] <= MAX_TILE_ROWS:
            return self.w2(torch.ops.treespec.tiles_glu(x, self.packed))
        return super().forward(x)


class RowsLinear(nn.Linear):
    """nn.Linear whose bf16 forward over MIN_ROWS..MAX_ROWS rows is rows_linear on a packed copy of
    the weight, kept beside it (prefill and other dtypes use the weight as it is)."""

    def forward(self, x):
        if x.dtype == torch.bfloat16 and MIN_ROWS <= x.numel() // x.shape[-1] <= MAX_ROWS:
            return torch.ops.treespec.rows_linear(x, self.packed)
        return F.linear(x, self.weight, self.bias)


class WideLinear(nn.Linear):
    """nn.Linear whose bf16 forward, any number of rows, is the AVX2 rows_linear on a packed copy of
    the weight (pack_avx2), kept beside it: torch's bf16 kernels on AVX2 run 3-8x slower past one row."""

    def forward(self, x):
        if x.dtype == torch.bfloat16:
            return torch.ops.treespec.rows_linear(x, self.packed, self.bias)
        return F.linear(x, self.weight, self.bias)


class WideFeedForward(FeedForward):
    """FeedForward whose bf16 forward makes silu(w1(x)) * w3(x) in one AVX2 rows_glu call on a packed
    copy of w1 and w3 (pack_glu_avx2), any number of rows."""

    def forward(self, x):
        if x.dtype == torch.bfloat16:
            return self.w2(torch.ops.treespec.rows_glu(x, self.packed))
        return super().forward(x)


class CpuAttention(Attention):
    """Attention on any CPU, in any dtype, in torch ops that suit a CPU: a new token's attention
    written out when compiled (inductor makes it one fused loop nest, where SDPA's CPU kernel costs
    about 0.1 ms a call, mostly its setup), and a tree's attention weights meeting bf16 values in
    fp32 where the CPU has no bf16 arithmetic (aten's bf16 bmm runs tens of times slower there)."""

    def token_attention(self, q, k, v, k_new, v_new, mask, cache_pos):
        if not torch.compiler.is_compiling():
            return super().token_attention(q, k, v, k_new, v_new, mask, cache_pos)
        B, G = q.shape[0], self.n_head // self.n_kv_head
        q = q.reshape(B, self.n_kv_head, G, self.head_dim)
        mask = mask.expand(-1, -1, G, -1)                                    # [B or 1, 1, G, L]
        s = (q.float()[:, :, :, None, :] * k.float()[:, :, None]).sum(-1) * self.head_dim ** -0.5
        p = s.masked_fill(~mask, float("-inf")).softmax(-1)                # [B, H_kv, G, L]
        y = (p[..., None] * v.float()[:, :, None]).sum(-2).to(q.dtype)
        return y.view(B, self.n_head, 1, self.head_dim).transpose(1, 2).reshape(B, 1, -1)

    def tree_attention(self, q, k, v, k_new, v_new, prefix, tree_mask):
        pv = torch.float32 if not CPU_BF16 else None
        return tree_attention(q, k, v, k_new, v_new, prefix, tree_mask, pv)


class RowsAttention(CpuAttention):
    """Attention whose bf16 tree attention is the tree_attention kernel."""

    def tree_attention(self, q, k, v, k_new, v_new, prefix, tree_mask):
        if q.dtype == torch.bfloat16 and q.shape[-1] in (64, 128):
            return torch.ops.treespec.tree_attention(q, k, v, k_new, v_new, prefix, tree_mask)
        return super().tree_attention(q, k, v, k_new, v_new, prefix, tree_mask)


class WideAttention(RowsAttention):
    """RowsAttention on AVX2, where a new token's attention is the tree kernel too: the token as a
    one-node tree after the slots its mask allows before it, so that the one-token step gets, bit for
    bit, what its row gets in a tree step, and as fast as inductor's fused loop (docs/speed.md)."""

    def token_attention(self, q, k, v, k_new, v_new, mask, cache_pos):
        L = mask.shape[-1]
        if q.dtype == torch.bfloat16 and q.shape[-1] in (64, 128) and mask.shape[:-1].numel() == 1:
            own = torch.arange(L, device=q.device) == cache_pos    # [L]: the token's slot, read as k_new
            m = mask.reshape(1, L)
            y = torch.ops.treespec.tree_attention(q, k, v, k_new, v_new, m & ~own, (m & own).any(-1, keepdim=True))
            return y.transpose(1, 2).reshape(q.shape[0], 1, -1)
        return super().token_attention(q, k, v, k_new, v_new, mask, cache_pos)


MAX_TILE_ROWS = 64  # a tree's rows; prefill's many stay SDPA's


class TileTransformer(Transformer):
    """Transformer whose tree steps attend through SDPA's path (TileAttention's rows_attention): with
    AMX, a tree's rows over the tree mask gathered into the cache slots cost less than tree_attention's
    bmm calls. The gather is done once a forward, not once a layer."""

    def forward(self, idx, input_pos, mask=None, cache_pos=None, return_hidden=False, tree_mask=None):
        if tree_mask is not None:  # the tree's rows sit at cache_pos
            T, L = tree_mask.shape[0], mask.shape[-1]
            mask = mask | torch.zeros(T, L, dtype=torch.bool, device=idx.device).index_copy_(1, cache_pos, tree_mask)
        return super().forward(idx, input_pos, mask, cache_pos, return_hidden)


class TileAttention(CpuAttention):
    """Attention whose bf16 attention of a tree's rows (up to MAX_TILE_ROWS, head_dim 64, one mask
    for the batch, a KVCache) is the rows_attention kernel on AMX tiles, RoPE and the cache writes in it.
    A new token's too, as a one-row tree: the AR step then gets, bit for bit, what its row gets in a
    tree step, and is faster than inductor's fused loop (docs/speed.md)."""

    def forward(self, x, freqs_cis, mask, cache_pos, tree_mask=None):
        if tree_mask is None:  # (TileTransformer gathers a tree's mask into the slots)
            return self.wo(self.rows_attention(self.wqkv(x), freqs_cis, mask, cache_pos))
        return super().forward(x, freqs_cis, mask, cache_pos, tree_mask)

    def rows_attention(self, qkv, freqs_cis, mask, cache_pos):
        T = qkv.shape[1]
        if (qkv.dtype == torch.bfloat16 and self.head_dim == 64 and T <= MAX_TILE_ROWS and type(self.kv_cache) is KVCache
                and mask.dtype == torch.bool and mask.shape[:-1].numel() in (1, T)):
            c = self.kv_cache
            return torch.ops.treespec.rows_attention(qkv, freqs_cis, cache_pos, c.k_cache, c.v_cache, mask, self.n_head)
        return super().rows_attention(qkv, freqs_cis, mask, cache_pos)


def swap_glu(model: nn.Module, dtype, cls, pack, fits) -> set:
    """model's FeedForwards whose w1 and w3 are bias-free dtype nn.Linears of a shape [N, K] that
    fits(N, K) become cls, with w1 and w3 packed together by pack, in place. Returns the w1 and w3 of
    every cls (also one swapped by an earlier install): their packed copy is in it, not beside them."""
    for m in model.modules():
        if type(m) is FeedForward and all(type(l) is nn.Linear and l.bias is None and l.weight.dtype == dtype
                                          and fits(*l.weight.shape) for l in (m.w1, m.w3)):
            m.register_buffer("packed", pack(m.w1.weight, m.w3.weight), persistent=False)
            m.__class__ = cls
    return {l for m in model.modules() if type(m) is cls for l in (m.w1, m.w3)}


def runs_projections(model: nn.Module) -> bool:
    """Whether install gave model's projections to the kernels (a step's few rows go to them)."""
    return any(type(m) in (RowsLinear, WideLinear, TileLinear) for m in model.modules())


def torch_gemms(model: nn.Module) -> bool:
    """Whether model's step over 1-64 rows may still multiply by a weight in torch's GEMM (which
    max-autotune picks a kernel for): any projection (a module with out_features: nn.Linear,
    RowsLinear outside its rows, quantize's weight-only linears) but WideLinear, TileLinear and the
    FeedForwards' gate and up that install made ours."""
    ours = {l for m in model.modules() if type(m) in (WideFeedForward, TileFeedForward) for l in (m.w1, m.w3)}
    return any(hasattr(m, "out_features") and type(m) not in (WideLinear, TileLinear) and m not in ours
               for m in model.modules())


def install(model: nn.Module, device, dtype) -> nn.Module:
    """Where wanted: model's bias-free nn.Linears (N a multiple of 16, K even) become RowsLinears and
    its Attentions RowsAttentions, in place; with AMX tiles its FeedForwards (bias-free, N and K
    multiples of 32) become TileFeedForwards, its other nn.Linears (N and K multiples of 32, with or
    without a bias) TileLinears and its Attentions TileAttentions; on AVX2 its FeedForwards (bias-free,
    N a multiple of 16) WideFeedForwards, its other nn.Linears (N a multiple of 32, with or without a
    bias) WideLinears and its Attentions WideAttentions. On any CPU the Attentions left become
    CpuAttentions. Returns model."""
    if torch.device(device).type != "cpu":
        return model
    if wanted_tiles(device, dtype) and build():
        glu = swap_glu(model, dtype, TileFeedForward, pack_glu, lambda N, K: N % 32 == 0 and K % 32 == 0)
        for m in model.modules():
            if type(m) is Transformer:
                m.__class__ = TileTransformer
            elif type(m) is Attention:
                m.__class__ = TileAttention
            elif m not in glu and (type(m) is nn.Linear and m.weight.dtype == dtype and (m.bias is None or m.bias.dtype == dtype)
                  and m.weight.shape[0] % 32 == 0 and m.weight.shape[1] % 32 == 0):
                m.register_buffer("packed", pack_tiles(m.weight), persistent=False)
                m.__class__ = TileLinear
    elif wanted_avx2(device, dtype) and build():
        glu = swap_glu(model, dtype, WideFeedForward, pack_glu_avx2, lambda N, K: N % 16 == 0)
        for m in model.modules():
            if type(m) is Attention:
                m.__class__ = WideAttention
            elif m not in glu and (type(m) is nn.Linear and m.weight.dtype == dtype and (m.bias is None or m.bias.dtype == dtype)
                  and m.weight.shape[0] % 32 == 0):
                m.register_buffer("packed", pack_avx2(m.weight), persistent=False)
                m.__class__ = WideLinear
    elif wanted(device, dtype) and build():
        for m in model.modules():
            if type(m) is Attention:
                m.__class__ = RowsAttention
            elif (type(m) is nn.Linear and m.bias is None and m.weight.dtype == dtype
                  and m.weight.shape[0] % 16 == 0 and m.weight.shape[1] % 2 == 0):
                m.register_buffer("packed", pack(m.weight), persistent=False)
                m.__class__ = RowsLinear
    for m in model.modules():
        if type(m) is Attention:
            m.__class__ = CpuAttention
    return model
