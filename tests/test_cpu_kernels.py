"""The steps' CPU kernels (cpu_kernels.py): rows_linear and tiles_linear are bf16 matmuls for every
row count (their blocks and tails), tiles_glu and rows_glu are the compiled SwiGLU's silu(gate) * up,
tree_attention is model.tree_attention, rows_attention is RoPE, the cache writes and SDPA, install swaps what it should (once),
argmax is torch's, and a compiled bf16 tree forward calls them and agrees with the fp32 one."""
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import cpu_kernels as ck
from model import Attention, FeedForward, KVCache, ModelArgs, Transformer, precompute_freqs_cis, tree_attention
import speculate as sp

zen4 = pytest.mark.skipif(not ck.wanted("cpu", torch.bfloat16),
                          reason="the kernels are for CPUs with AVX-512 bf16 and no AMX")
amx = pytest.mark.skipif(not ck.wanted_tiles("cpu", torch.bfloat16), reason="the tile kernels are for CPUs with AMX")
avx2 = pytest.mark.skipif(not ck.wanted_avx2("cpu", torch.bfloat16), reason="the AVX2 kernel is for CPUs without AVX-512")


@avx2
@pytest.mark.parametrize("K", [1, 100, 576])
def test_avx2_rows_linear_is_a_bf16_matmul(K, two_threads):
    assert ck.build()
    g = torch.Generator().manual_seed(K)
    w = torch.randn(96, K, generator=g).bfloat16()  # 3 tasks of 32 columns
    wp = ck.pack_avx2(w)
    # a panel's 16 columns as AVX2's unpacks within 128-bit lanes widen them: 0-3, 8-11, 4-7, 12-15
    assert wp.shape == (6, K, 16) and wp[1, K - 1, 4] == w[16 + 8, K - 1] and wp[1, 0, 9] == w[16 + 5, 0]
    alone = torch.randn(1, K, generator=g).bfloat16()
    for M in range(1, 20):  # 1 and 2 rows' wide tile, blocks of 6 rows and every remainder
        x = torch.randn(3, M, K, generator=g).bfloat16()
        y = torch.ops.treespec.rows_linear(x, wp)
        assert y.shape == (3, M, 96) and y.dtype == torch.bfloat16
        ref = x.float() @ w.float().T
        if K == 1:  # one product, exact in fp32: rounded to bf16 as torch rounds
            assert torch.equal(y, ref.bfloat16())
        else:  # the fp32 sums in another order, rounded once to bf16: within half an ulp and a hair
            torch.testing.assert_close(y.float(), ref, rtol=2 ** -8 + 1e-5, atol=1e-4)
        x[1, M // 2] = alone  # a row's result does not depend on the rows beside it
        assert torch.equal(torch.ops.treespec.rows_linear(x, wp)[1, M // 2], torch.ops.treespec.rows_linear(alone, wp)[0])


@avx2
def test_avx2_rows_linear_rounds_ties_to_even_and_keeps_inf_and_nan():
    assert ck.build()
    # exact fp32 sums: 1 + 2^-8 is a tie between 1 and 1 + 2^-7 (to even: 1), 1 + 3 * 2^-8 one between
    # 1 + 2^-7 and 1 + 2^-6 (to even: up); then inf, NaN and a finite sum that rounds to inf
    x = torch.tensor([[1, 2 ** -8], [1 + 2 ** -7, 2 ** -8], [float("inf"), 1], [float("nan"), 1],
                      [3.39e38, 3.39e38]]).bfloat16()
    y = torch.ops.treespec.rows_linear(x, ck.pack_avx2(torch.ones(32, 2).bfloat16()))
    ref = (x.float() @ torch.ones(2, 32)).bfloat16()
    assert ref[0, 0] == 1 and ref[1, 0] == 1 + 2 ** -6 and ref[4, 0] == float("inf")
    assert torch.equal(y[[0, 1, 2, 4]], ref[[0, 1, 2, 4]]) and y[3].isnan().all()


@avx2
def test_avx2_install_swaps_linears_and_attention_for_every_row_count(one_thread):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 96, bias=False), nn.Linear(96, 64), nn.Linear(64, 48, bias=False),
                      Attention(ModelArgs(dim=128, n_head=2))).bfloat16()
    w0, w1, b1 = m[0].weight, m[1].weight, m[1].bias
    ck.install(m, "cpu", torch.bfloat16)
    # N not a multiple of the kernel's 32 columns: left as it is
    assert [type(l) for l in m] == [ck.WideLinear, ck.WideLinear, nn.Linear, ck.WideAttention]
    assert m[0].weight is w0 and "packed" not in m[0].state_dict()  # checkpoints keep their layout
    for rows in (1, 13, 70):
        x = torch.randn(rows, 64).bfloat16()
        torch.testing.assert_close(m[0](x).float(), x.float() @ w0.float().T, rtol=2 ** -8 + 1e-5, atol=1e-4)
        # a bias (EAGLE's fc, Qwen2's q/k/v) joins the fp32 sums, rounded once as F.linear rounds
        x = torch.randn(rows, 96).bfloat16()
        torch.testing.assert_close(m[1](x).float(), x.float() @ w1.float().T + b1.float(), rtol=2 ** -8 + 1e-5, atol=1e-4)
    fp32 = ck.install(nn.Sequential(nn.Linear(8, 32, bias=False)), "cpu", torch.float32)
    assert type(fp32[0]) is nn.Linear
    f = FeedForward(ModelArgs(dim=64, intermediate_size=48)).bfloat16()
    ck.install(f, "cpu", torch.bfloat16)  # w1 and w3 packed together, for rows_glu; w2 alone
    assert type(f) is ck.WideFeedForward and [type(l) for l in (f.w1, f.w2, f.w3)] == [nn.Linear, ck.WideLinear, nn.Linear]
    ck.install(f, "cpu", torch.bfloat16)  # again: w1 and w3 stay plain (no second packed copy)
    assert [type(l) for l in (f.w1, f.w3)] == [nn.Linear, nn.Linear]
    for rows in (1, 13, 70):
        x = torch.randn(rows, 64).bfloat16()
        assert torch.equal(f(x), f.w2(torch.ops.treespec.rows_glu(x, ck.pack_glu_avx2(f.w1.weight, f.w3.weight))))


@avx2
@pytest.mark.parametrize("K", [1, 576])
def test_avx2_rows_glu_is_silu_gate_times_up(K, two_threads):
    """Bit for bit what the compiled FeedForward makes of rows_linear's two projections: each rounded
    to bf16, silu and the product in fp32 (torch's exp, as inductor's), rounded once; a row alone the same."""
    assert ck.build()
    g = torch.Generator().manual_seed(K)
    w1, w3 = (torch.randn(48, K, generator=g).mul(0.1).bfloat16() for _ in range(2))  # 3 tasks of 16 columns
    wp = ck.pack_glu_avx2(w1, w3)
    assert wp.shape == (6, K, 16) and torch.equal(wp[2], ck.pack_avx2(w1)[1]) and torch.equal(wp[5], ck.pack_avx2(w3)[2])
    alone = torch.randn(1, K, generator=g).bfloat16()
    for M in range(1, 14):  # 1 and 2 rows' wide tile, blocks of 6 rows and every remainder
        x = torch.randn(2, M, K, generator=g).bfloat16()
        a, b = (torch.ops.treespec.rows_linear(x, ck.pack_avx2(torch.cat([w, w]))).float()[..., :48] for w in (w1, w3))
        y = torch.ops.treespec.rows_glu(x, wp)
        assert y.shape == (2, M, 48) and torch.equal(y, (a / (1 + torch.exp(-a)) * b).bfloat16())
        x[1, M // 2] = alone
        assert torch.equal(torch.ops.treespec.rows_glu(x, wp)[1, M // 2], torch.ops.treespec.rows_glu(alone, wp)[0])


@zen4
@pytest.mark.parametrize("K", [64, 100, 576])
def test_rows_linear_is_a_bf16_matmul(K, two_threads):
    assert ck.build()
    g = torch.Generator().manual_seed(K)
    w = torch.randn(80, K, generator=g).bfloat16()  # 5 panels of 16 columns: a block of 3 and one of 2
    wp = ck.pack(w)
    assert wp.shape == (5, K // 2, 16, 2) and wp[3, 7, 5, 1] == w[3 * 16 + 5, 2 * 7 + 1]
    alone = torch.randn(1, K, generator=g).bfloat16()
    for M in range(1, 18):  # blocks of 8 rows and every remainder
        x = torch.randn(3, M, K, generator=g).bfloat16()
        y = torch.ops.treespec.rows_linear(x, wp)
        assert y.shape == (3, M, 80) and y.dtype == torch.bfloat16
        # the fp32 sums in another order, rounded once to bf16: within half an ulp (2**-8) and a hair
        ref = x.float() @ w.float().T
        torch.testing.assert_close(y.float(), ref, rtol=2 ** -8 + 1e-5, atol=1e-4)
        # a row's result does not depend on the rows beside it
        x[1, M // 2] = alone
        assert torch.equal(torch.ops.treespec.rows_linear(x, wp)[1, M // 2], torch.ops.treespec.rows_linear(alone, wp)[0])


@amx
@pytest.mark.parametrize("K", [64, 576])
def test_tiles_linear_is_a_bf16_matmul(K, two_threads):
    assert ck.build()
    g = torch.Generator().manual_seed(K)
    w = torch.randn(96, K, generator=g).bfloat16()  # 3 groups of 32 columns
    wp = ck.pack_tiles(w)
    assert wp.shape == (3, K // 32, 2, 16, 16, 2) and wp[2, 1, 1, 7, 5, 1] == w[2 * 32 + 16 + 5, 32 + 2 * 7 + 1]
    alone = torch.randn(1, K, generator=g).bfloat16()
    for M in (1, 2, 13, 16, 17, 32, 33, 45):  # A tiles of 16 rows, blocks of 32 and their tails
        x = torch.randn(1, M, K, generator=g).bfloat16()
        y = torch.ops.treespec.tiles_linear(x, wp, None)
        assert y.shape == (1, M, 96) and y.dtype == torch.bfloat16
        torch.testing.assert_close(y.float(), x.float() @ w.float().T, rtol=2 ** -8 + 1e-5, atol=1e-4)
        x[0, M // 2] = alone  # a row's result does not depend on the rows beside it
        assert torch.equal(torch.ops.treespec.tiles_linear(x, wp, None)[0, M // 2], torch.ops.treespec.tiles_linear(alone, wp, None)[0])
    b = torch.randn(96, generator=g).bfloat16()  # a bias (EAGLE's fc) joins the fp32 sums, rounded once
    torch.testing.assert_close(torch.ops.treespec.tiles_linear(x, wp, b).float(), x.float() @ w.float().T + b.float(),
                               rtol=2 ** -8 + 1e-5, atol=1e-4)


@pytest.mark.skipif(not (ck.wanted("cpu", torch.bfloat16) or ck.wanted_avx2("cpu", torch.bfloat16)),
                    reason="the kernel is for CPUs with AVX-512 bf16 and no AMX, or AVX2 only")
@pytest.mark.parametrize("B,H,H_kv,T,D,L,P", [(1, 9, 3, 8, 64, 530, 512), (1, 9, 3, 5, 64, 261, 250), (1, 9, 3, 16, 64, 530, 300),
                                              (2, 4, 2, 5, 128, 67, 40), (1, 2, 2, 1, 64, 9, 9)])
def test_tree_attention_kernel_is_model_tree_attention(B, H, H_kv, T, D, L, P, two_threads):
    """Strided as the model hands them over (q and the new rows transposed, k and v a slice of the
    cache); against model.tree_attention in fp32 on the same bf16 values, closer than that function in bf16."""
    assert ck.build()
    g = torch.Generator().manual_seed(T * D + L)
    bf = lambda *s: torch.randn(*s, generator=g).bfloat16()
    q = bf(B, T, H, D).transpose(1, 2)
    k, v = bf(B, H_kv, L + 7, D)[:, :, :L], bf(B, H_kv, L + 7, D)[:, :, :L]
    k_new, v_new = bf(B, T, H_kv, D).transpose(1, 2), bf(B, T, H_kv, D).transpose(1, 2)
    prefix = torch.arange(L)[None] < P
    tree_mask = ((torch.rand(T, T, generator=g) < 0.5) | torch.eye(T, dtype=torch.bool)).tril()
    y = torch.ops.treespec.tree_attention(q, k, v, k_new, v_new, prefix, tree_mask)
    ref = tree_attention(*(t.float() for t in (q, k, v, k_new, v_new)), prefix, tree_mask)
    in_bf16 = tree_attention(q, k, v, k_new, v_new, prefix, tree_mask)
    assert y.shape == (B, H, T, D) and y.dtype == torch.bfloat16
    err, err_bf16 = (y.float() - ref).abs().max(), (in_bf16.float() - ref).abs().max()
    assert err <= max(err_bf16, 2 ** -8 * ref.abs().max()), (err, err_bf16)


@avx2
@pytest.mark.parametrize("L,P", [(128, 100), (576, 575), (64, 0)])
def test_avx2_token_attention_is_its_row_in_a_tree(L, P, two_threads):
    """WideAttention: a new token's attention (the AR step's) is the tree kernel's with the token as a
    one-node tree after the slots before it: bit for bit what its row gets in a tree step, and SDPA's
    in fp32 within bf16 rounding."""
    assert ck.build()
    a = ck.install(Attention(ModelArgs(dim=576, n_head=9, n_kv_head=3)).bfloat16(), "cpu", torch.bfloat16)
    assert type(a) is ck.WideAttention
    g = torch.Generator().manual_seed(L + P)
    bf = lambda *s: torch.randn(*s, generator=g).bfloat16()
    q, k, v = bf(1, 9, 3, 64), bf(1, 3, L + 5, 64)[:, :, :L], bf(1, 3, L + 5, 64)[:, :, :L]
    mask = (torch.arange(L) <= P)[None, None, None]                     # its own slot P written, as cached() leaves it
    y = a.token_attention(q[:, :, :1], k, v, k[:, :, P:P + 1], v[:, :, P:P + 1], mask, torch.tensor([P]))
    # the same token as the root of a 3-row tree: the slots before P, then itself
    k_new, v_new = torch.cat([k[:, :, P:P + 1], bf(1, 3, 2, 64)], 2), torch.cat([v[:, :, P:P + 1], bf(1, 3, 2, 64)], 2)
    tree = torch.ones(3, 3, dtype=torch.bool).tril()
    in_tree = torch.ops.treespec.tree_attention(q, k, v, k_new, v_new, (torch.arange(L) < P)[None], tree)
    assert y.shape == (1, 1, 9 * 64) and torch.equal(y.view(9, 64), in_tree[0, :, 0])
    ref = F.scaled_dot_product_attention(q[:, :, :1].float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(y.float().view(1, 9, 1, 64), ref, rtol=2 ** -7, atol=2 ** -7 * ref.abs().max().item())


@amx
@pytest.mark.parametrize("B,H,H_kv,T,L,P", [(1, 9, 3, 13, 576, 563), (1, 9, 3, 16, 300, 250), (2, 4, 2, 5, 67, 40),
                                           (1, 9, 3, 1, 9, 8), (1, 3, 3, 64, 100, 36)])
def test_rows_attention_kernel_is_rope_cache_and_sdpa(B, H, H_kv, T, L, P, two_threads):
    """As TileAttention hands them over (qkv, the rows' RoPE frequencies, their cache slots after P,
    a tree mask gathered into those slots, some slots shut to all): the caches get bit for bit what
    Attention.cached writes; y is SDPA in fp32 over its q and the cache, as close as SDPA in bf16; a
    [1, L] mask as well."""
    assert ck.build()
    g = torch.Generator().manual_seed(T * H + L)
    a = Attention(ModelArgs(dim=64 * H, n_head=H, n_kv_head=H_kv))
    a.kv_cache = KVCache(B, H_kv, L + 6, 64, torch.bfloat16)
    for c in (a.kv_cache.k_cache, a.kv_cache.v_cache):
        c.copy_(torch.randn(c.shape, generator=g))
    qkv = torch.randn(B, T, (H + 2 * H_kv) * 64, generator=g).bfloat16()
    pos = P + torch.arange(T)
    freqs = precompute_freqs_cis(ModelArgs(), L + 7)[pos]
    tree = ((torch.rand(T, T, generator=g) < 0.5) | torch.eye(T, dtype=torch.bool)).tril()
    mask = torch.zeros(T, L, dtype=torch.bool)
    mask[:, :P - 5] = True
    mask[:, P:P + T] = tree
    for m in (mask[None, None], mask[:1]):
        k_cache, v_cache = a.kv_cache.k_cache.clone(), a.kv_cache.v_cache.clone()
        y = torch.ops.treespec.rows_attention(qkv, freqs, pos, k_cache, v_cache, m, H)
        q, k, v, _, _ = a.cached(qkv, freqs, m, pos)
        assert torch.equal(k_cache, a.kv_cache.k_cache) and torch.equal(v_cache, a.kv_cache.v_cache)
        m4 = m.view(1, 1, -1, L)
        ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=m4, enable_gqa=True)
        in_bf16 = F.scaled_dot_product_attention(q, k, v, attn_mask=m4, enable_gqa=True)
        ref, in_bf16 = (t.transpose(1, 2).reshape(B, T, H * 64) for t in (ref, in_bf16))
        assert y.shape == (B, T, H * 64) and y.dtype == torch.bfloat16
        err, err_bf16 = (y.float() - ref).abs().max(), (in_bf16.float() - ref).abs().max()
        assert err <= max(err_bf16, 2 ** -8 * ref.abs().max()), (err, err_bf16)


@amx
@pytest.mark.parametrize("P", [62, 300])
def test_tiles_token_attention_is_its_row_in_a_tree(P, two_threads):
    """TileAttention: a new token (the AR step's, over its live span) goes through rows_attention as
    a one-row tree, and gets bit for bit what it gets as the root of a tree over a longer span
    (the tree mask gathered into the slots, as Transformer.forward hands it over); the caches alike."""
    assert ck.build()
    g = torch.Generator().manual_seed(P)
    a = ck.install(Attention(ModelArgs(dim=576, n_head=9, n_kv_head=3)).bfloat16(), "cpu", torch.bfloat16)
    assert type(a) is ck.TileAttention
    S = P + 80
    a.kv_cache = KVCache(1, 3, S, 64, torch.bfloat16)
    for c in (a.kv_cache.k_cache, a.kv_cache.v_cache):
        c.copy_(torch.randn(c.shape, generator=g))
    cache = [c.clone() for c in (a.kv_cache.k_cache, a.kv_cache.v_cache)]
    x = torch.randn(1, 3, 576, generator=g).bfloat16()          # the token, then two more rows of a chain
    freqs = precompute_freqs_cis(ModelArgs(), S)
    span = lambda rows: -(-(P + rows) // 64) * 64                   # sp.live_span's rounding
    L = span(1)
    y = a(x[:, :1], freqs[P:P + 1], (torch.arange(L) <= P)[None, None, None], torch.tensor([P]))
    token_cache = [c.clone() for c in (a.kv_cache.k_cache, a.kv_cache.v_cache)]
    a.kv_cache.k_cache.copy_(cache[0]), a.kv_cache.v_cache.copy_(cache[1])
    L = span(3)
    mask = (torch.arange(L) < P)[None].repeat(3, 1)
    mask[:, P:P + 3] = torch.ones(3, 3, dtype=torch.bool).tril()
    in_tree = a(x, freqs[P:P + 3], mask[None, None], P + torch.arange(3))
    assert torch.equal(y[0, 0], in_tree[0, 0])
    assert all(torch.equal(t[:, :, :P + 1], c[:, :, :P + 1]) for t, c in zip(token_cache, (a.kv_cache.k_cache, a.kv_cache.v_cache)))
    # and SDPA's in fp32, within bf16 rounding
    q, k, v, _, _ = Attention.cached(a, a.wqkv(x[:, :1]), freqs[P:P + 1], torch.ones(1, P + 1, dtype=torch.bool), torch.tensor([P]))
    ref = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), enable_gqa=True).transpose(1, 2).reshape(1, 1, -1)
    torch.testing.assert_close(y.float(), a.wo(ref.bfloat16()).float(), rtol=0.02, atol=0.02 * y.float().abs().max().item())


@amx
@pytest.mark.parametrize("K", [64, 576])
def test_tiles_glu_is_silu_gate_times_up(K, two_threads):
    """Bit for bit what the compiled FeedForward makes of the two projections: each rounded to bf16,
    silu and the product in fp32 (torch's exp, as inductor's), rounded once; a row alone the same."""
    assert ck.build()
    g = torch.Generator().manual_seed(K)
    w1, w3 = (torch.randn(96, K, generator=g).mul(0.1).bfloat16() for _ in range(2))  # 3 groups of 32 columns
    wp = ck.pack_glu(w1, w3)
    assert wp.shape == (6, K // 32, 2, 16, 16, 2) and torch.equal(wp[2], ck.pack_tiles(w1)[1])
    assert torch.equal(wp[5], ck.pack_tiles(w3)[2])
    alone = torch.randn(1, K, generator=g).bfloat16()
    for M in (1, 2, 13, 16, 17, 32, 33, 45):
        x = torch.randn(1, M, K, generator=g).bfloat16()
        a, b = (torch.ops.treespec.tiles_linear(x, ck.pack_tiles(w), None).float() for w in (w1, w3))
        y = torch.ops.treespec.tiles_glu(x, wp)
        assert y.shape == (1, M, 96) and torch.equal(y, (a / (1 + torch.exp(-a)) * b).bfloat16())
        x[0, M // 2] = alone
        assert torch.equal(torch.ops.treespec.tiles_glu(x, wp)[0, M // 2], torch.ops.treespec.tiles_glu(alone, wp)[0])


@amx
def test_install_with_tiles_swaps_linears_and_attention():
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 96, bias=False), nn.Linear(96, 64), nn.Linear(64, 48, bias=False),
                      Attention(ModelArgs(dim=128, n_head=2, n_kv_head=1)))
    w0 = m[0].weight
    ck.install(m.bfloat16(), "cpu", torch.bfloat16)
    # N not a multiple of the kernel's 32 columns: left as it is
    assert [type(l) for l in m] == [ck.TileLinear, ck.TileLinear, nn.Linear, ck.TileAttention]
    assert m[0].weight is w0 and "packed" not in m[0].state_dict()  # checkpoints keep their layout
    x = torch.randn(ck.MAX_TILE_ROWS + 1, 64).bfloat16()  # prefill: torch's kernel, bit for bit
    assert torch.equal(m[0](x), F.linear(x, w0))
    x = torch.randn(2, 5, 64).bfloat16()  # 10 rows: the kernel, the batch dims kept
    torch.testing.assert_close(m[0](x).float(), x.float() @ w0.float().T, rtol=2 ** -8 + 1e-5, atol=1e-4)
    x = torch.randn(3, 96).bfloat16()  # with its bias
    torch.testing.assert_close(m[1](x).float(), F.linear(x.float(), m[1].weight.float(), m[1].bias.float()),
                               rtol=2 ** -8 + 1e-5, atol=1e-4)
    assert type(ck.install(Attention(ModelArgs(dim=128, n_head=2)), "cpu", torch.float32)) is ck.CpuAttention
    f = FeedForward(ModelArgs(dim=64, intermediate_size=96)).bfloat16()
    ck.install(f, "cpu", torch.bfloat16)  # w1 and w3 packed together, for tiles_glu; w2 alone
    assert type(f) is ck.TileFeedForward and [type(l) for l in (f.w1, f.w2, f.w3)] == [nn.Linear, ck.TileLinear, nn.Linear]
    ck.install(f, "cpu", torch.bfloat16)  # again: w1 and w3 stay plain (no second packed copy)
    assert [type(l) for l in (f.w1, f.w3)] == [nn.Linear, nn.Linear]
    x = torch.randn(3, 64).bfloat16()
    assert torch.equal(f(x), f.w2(torch.ops.treespec.tiles_glu(x, ck.pack_glu(f.w1.weight, f.w3.weight))))
    x = torch.randn(ck.MAX_TILE_ROWS + 1, 64).bfloat16()  # prefill: torch's kernels
    assert torch.equal(f(x), f.w2(F.silu(F.linear(x, f.w1.weight)) * F.linear(x, f.w3.weight)))
    a = m[3]  # rows past MAX_TILE_ROWS: Attention's rows_attention (RoPE, the cache, SDPA), bit for bit
    a.kv_cache = KVCache(1, 1, 80, 64, torch.bfloat16)
    T = ck.MAX_TILE_ROWS + 1
    qkv, freqs, pos = torch.randn(1, T, 256).bfloat16(), precompute_freqs_cis(ModelArgs(), T), torch.arange(T)
    mask = torch.ones(1, 1, T, 80, dtype=torch.bool).tril()
    y = a.rows_attention(qkv, freqs, mask, pos)
    k = a.kv_cache.k_cache.clone()
    assert torch.equal(y, Attention.rows_attention(a, qkv, freqs, mask, pos)) and torch.equal(k, a.kv_cache.k_cache)


@amx
def test_eagle_head_attends_with_the_base_kernels():
    """A head's decoder layer and draft vocab rows take the base's kernels: its draft rows go to
    rows_attention and tiles_linear too."""
    from pathlib import Path
    from generate import load_heads, load_model
    base, _ = load_model(None, "cpu", torch.bfloat16)
    head = load_heads(Path(__file__).parents[1] / "heads" / "eagle-smollm2", base, lookup=3)
    assert type(head.head.layer.block.attention) is ck.TileAttention
    assert type(head.head.draft_lm) is ck.TileLinear and type(head.head.layer.block.feed_forward) is ck.TileFeedForward
    assert type(head.head.fc) is ck.TileLinear and head.head.fc.bias is not None


@avx2
def test_avx2_eagle_head_takes_the_base_kernels():
    """On AVX2 a head's projections, its fc with a bias too, are the base's rows_linear."""
    from pathlib import Path
    from generate import load_heads, load_model
    base, _ = load_model(None, "cpu", torch.bfloat16)
    head = load_heads(Path(__file__).parents[1] / "heads" / "eagle-smollm2", base, lookup=3)
    assert type(head.head.draft_lm) is ck.WideLinear and type(head.head.layer.block.feed_forward) is ck.WideFeedForward
    assert type(head.head.fc) is ck.WideLinear and head.head.fc.bias is not None


@pytest.mark.skipif(not (ck.wanted("cpu", torch.bfloat16) or ck.wanted_tiles("cpu", torch.bfloat16)
                         or ck.wanted_avx2("cpu", torch.bfloat16)),
                    reason="the kernels are for CPUs with AVX-512 bf16 or AVX2")
def test_argmax_op_is_torchs_first_maximum(two_threads):
    """treespec::argmax, which trees.argmax calls for bf16 logits once the kernels are built: torch's
    first maximum for one row and many, ties (few distinct values) across the threads' runs included
    (two runs of columns, whatever the machine)."""
    import trees as T
    assert ck.build()
    g = torch.Generator().manual_seed(0)
    for rows, V in [(1, 16), (1, 49152), (13, 49152), (4, 4096), (3, 112)]:
        for x in (torch.randint(0, 3, (rows, V), generator=g).bfloat16(), torch.randn(rows, V, generator=g).bfloat16()):
            x[0, :V // 2] = -float("inf")  # the winner in the last thread's run
            assert torch.equal(torch.ops.treespec.argmax(x), x.argmax(-1)) and torch.equal(T.argmax(x), x.argmax(-1))
            assert torch.equal(torch.ops.treespec.argmax(x[None]), x[None].argmax(-1))
    x = torch.full((2, 64), -float("inf")).bfloat16()
    x[1, 40] = 1
    assert torch.ops.treespec.argmax(x).tolist() == [0, 40]
    x[1, 3] = float("nan")  # passed over by the op (torch: 3; the max-and-min fallback: 63), so trees.argmax calls it
    assert torch.ops.treespec.argmax(x).tolist() == [0, 40] and T.argmax(x).tolist() == [0, 40]


@pytest.mark.skipif(not (ck.wanted("cpu", torch.bfloat16) or ck.wanted_tiles("cpu", torch.bfloat16)
                         or ck.wanted_avx2("cpu", torch.bfloat16)),
                    reason="the kernels are for CPUs with AVX-512 bf16 or AVX2")
def test_topk_op_is_a_stable_sorts_first_k(two_threads):
    """treespec::topk, which trees.top_indices calls for a draft's bf16 logits: the first k of a stable
    descending sort (the earlier index first among equals), for rows of few distinct values (ties
    across the 16-column chunks), of -inf, and with NaNs (passed over; fewer than k others: index 0)."""
    import trees as T
    assert ck.build()
    g = torch.Generator().manual_seed(0)
    for rows, V in [(1, 16), (2, 8192), (5, 112), (1, 49152)]:
        for k in (1, 2, 5, 16, 64):
            if k > V:
                continue
            for x in (torch.randint(0, 4, (rows, V), generator=g).bfloat16(), torch.randn(rows, V, generator=g).bfloat16()):
                x[0, ::3] = -float("inf")
                x[-1, 1::7] = float("nan")
                if k > x.isfinite().sum(-1).min():  # (a NaN sorts among the -infs here, the op passes it over)
                    continue
                ref = torch.sort(x.float().nan_to_num(nan=-float("inf")), dim=-1, descending=True, stable=True).indices[:, :k]
                assert torch.equal(torch.ops.treespec.topk(x, k), ref) and torch.equal(T.top_indices(x, k), ref)
                assert torch.equal(torch.ops.treespec.topk(x[None], k), ref[None])
    x = torch.tensor([[float("nan")] * 14 + [1.0, 2.0]]).bfloat16()
    assert torch.ops.treespec.topk(x, 3).tolist() == [[15, 14, 0]]


@zen4
def test_install_swaps_linears_and_attention_and_keeps_other_rows_as_torch(one_thread):
    torch.manual_seed(0)
    m = nn.Sequential(nn.Linear(64, 96, bias=False), nn.Linear(96, 64), nn.Linear(64, 40, bias=False)).bfloat16()
    w0 = m[0].weight
    ck.install(m, "cpu", torch.bfloat16)
    # a bias, or N not a multiple of the kernel's 16 columns: left as they are
    assert type(m[0]) is ck.RowsLinear and type(m[1]) is nn.Linear and type(m[2]) is nn.Linear
    assert m[0].weight is w0 and "packed" not in m[0].state_dict()  # checkpoints keep their layout
    for rows in (ck.MAX_ROWS + 1, 40):  # torch's kernel, bit for bit
        x = torch.randn(rows, 64).bfloat16()
        assert torch.equal(m[0](x), F.linear(x, w0))
    x = torch.randn(1, 64).bfloat16()  # a token step's one row: the kernel
    torch.testing.assert_close(m[0](x).float(), x.float() @ w0.float().T, rtol=2 ** -8 + 1e-5, atol=1e-4)
    x = torch.randn(2, 5, 64).bfloat16()  # 10 rows: the kernel, the batch dims kept
    torch.testing.assert_close(m[0](x).float(), x.float() @ w0.float().T, rtol=2 ** -8 + 1e-5, atol=1e-4)
    fp32 = ck.install(nn.Sequential(nn.Linear(8, 16, bias=False), Attention(ModelArgs(dim=128, n_head=2))), "cpu", torch.float32)
    assert [type(l) for l in fp32] == [nn.Linear, ck.CpuAttention]
    assert type(ck.install(Attention(ModelArgs(dim=128, n_head=2)), "cpu", torch.bfloat16)) is ck.RowsAttention


@pytest.mark.skipif(not (ck.wanted("cpu", torch.bfloat16) or ck.wanted_tiles("cpu", torch.bfloat16)
                         or ck.wanted_avx2("cpu", torch.bfloat16)),
                    reason="the kernels are for CPUs with AVX-512 bf16 or AVX2")
def test_compiled_tree_forward_calls_the_kernels(one_thread):
    """As the tree step compiles it (freezing, C++ wrapper): a bf16 forward over 8 tree rows calls
    rows_linear and tree_attention (no AMX) or tiles_linear, tiles_glu and rows_attention (AMX; q/k/v with a bias,
    as Qwen2's), and agrees with the fp32 forward to bf16 rounding; its greedy tokens are the argmax op's."""
    from torch._inductor.utils import run_and_get_code
    import trees as T
    torch.manual_seed(0)
    args = ModelArgs(dim=128, n_layer=1, n_head=2, n_kv_head=1, intermediate_size=256, vocab_size=512, max_seq_len=64,
                     attn_bias=True)
    ref = Transformer(args).eval()
    model = Transformer(args).eval()
    model.load_state_dict(ref.state_dict())
    ck.install(model.bfloat16(), "cpu", torch.bfloat16)
    ref.float()
    N, P = 8, 20
    tree = torch.ones(N, N, dtype=torch.bool).tril()
    tokens = torch.randint(0, 512, (1, P + N))
    with torch.inference_mode():
        for m in (ref, model):
            m.setup_caches(1, 63)
            m(tokens[:, :P], torch.arange(P))
        step = lambda m: (lambda t: m(t, P + torch.arange(N), torch.arange(63)[None] < P,
                                      cache_pos=P + torch.arange(N), tree_mask=tree))
        greedy = lambda t: (lambda y: (y, T.argmax(y[0])))(step(model)(t))
        (y, top), code = run_and_get_code(sp.compile_step(greedy, "cpu", mode="default"), tokens[:, P:])
        want = step(ref)(tokens[:, P:])
    code = "\n".join(code)
    if ck.wanted_tiles("cpu", torch.bfloat16):
        assert "rows_attention" in code and "tiles_linear" in code and "tiles_glu" in code and "rows_linear" not in code
    else:
        assert "rows_linear" in code and "tree_attention" in code
        assert ("rows_glu" in code) == ck.wanted_avx2("cpu", torch.bfloat16)
    assert ck.has("argmax") == ("treespec::argmax" in code) and torch.equal(top, y[0].argmax(-1))
    torch.testing.assert_close(y.float(), want, rtol=0.03, atol=0.03 * want.abs().max().item())


def test_build_clears_a_lock_left_by_a_stopped_build(tmp_path):
    """torch's build waits, silently and for ever, on a lock file in its folder; a first run stopped
    midway left one and every later run hung. build() clears a lock older than any build (10 minutes),
    never a fresh one: another process's build under way."""
    import os
    import time
    lock = tmp_path / "lock"
    assert not ck.clear_stale_lock(tmp_path)                      # none there
    lock.touch()
    assert not ck.clear_stale_lock(tmp_path) and lock.exists()    # a build under way
    os.utime(lock, (time.time() - 3600,) * 2)
    assert ck.clear_stale_lock(tmp_path) and not lock.exists()
    if ck.build():  # the kernels are built in the folder whose lock it clears
        assert list(ck.BUILD_DIR.glob("*/*.so"))


@pytest.mark.skipif(not (ck.wanted("cpu", torch.bfloat16) or ck.wanted_tiles("cpu", torch.bfloat16)
                         or ck.wanted_avx2("cpu", torch.bfloat16)), reason="the kernels are for bf16 on these CPUs")
def test_a_compiled_step_on_the_kernels_is_kept_by_inductors_cache(tmp_path, monkeypatch):
    """Where the kernels run the projections, compile_step leaves oneDNN's weight prepacking off: its
    packed (mkldnn) weights cannot be pickled, and inductor's FX graph cache then compiled every run's
    graphs again. The token step's graph is stored, and a fresh compile of it (another run) loads it."""
    import costs
    from torch._dynamo.utils import counters
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    assert ck.build()
    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim=128, n_layer=2, n_head=2, n_kv_head=1, intermediate_size=256, vocab_size=512,
                                  max_seq_len=128)).bfloat16().eval()
    ck.install(model, "cpu", torch.bfloat16)
    assert ck.runs_projections(model)
    model.setup_caches(1, 64)
    compiled = costs.compiler(model, "cpu", "default")
    assert compiled.keywords["prepack"] is False
    outs = []
    for _ in range(2):
        torch._dynamo.reset()
        counters.clear()
        with torch.inference_mode():
            outs.append(compiled(lambda t, pos: sp.ar_step(model, t, pos))(torch.tensor(3), torch.tensor(5))[0])
        assert counters["inductor"]["fxgraph_cache_bypass"] == 0, dict(counters["inductor"])
    assert counters["inductor"]["fxgraph_cache_hit"] >= 1 and torch.equal(outs[0], outs[1])
