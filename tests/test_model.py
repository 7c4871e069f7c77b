"""The model against transformers (logit parity), the KV cache against a full forward, tree-style
masked calls against plain causal ones, and compiled decode against eager."""
import copy
import gc

import pytest
import torch

import cpu_kernels as ck
import generate
from generate import load_model
from speculate import ar_step, decode, prefill
import speculate

TOL = 1e-3


def our_logits(model, ids: torch.Tensor) -> torch.Tensor:
    """ids: [T] -> logits [T, V] from one full forward over a fresh cache."""
    model.setup_caches(1, len(ids))
    with torch.no_grad():
        return model(ids[None], torch.arange(len(ids)))[0]


def hf_logits(hf_model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf_model(ids[None], use_cache=False).logits[0].float()


# ---------------------------------------------------------------- parity with transformers

def test_default_model_matches_transformers_on_the_same_gguf(default_model, default_gguf):
    from transformers import AutoModelForCausalLM
    model, tokenizer = default_model
    text = tokenizer.chat([{"role": "user", "content": "Name three rivers of Europe."}])
    ids = torch.tensor(tokenizer.encode(text, bos=False))
    assert 25 <= len(ids) <= 45, len(ids)
    hf = AutoModelForCausalLM.from_pretrained(str(default_gguf.parent), gguf_file=default_gguf.name,
                                              dtype=torch.float32).eval()
    try:
        expected = hf_logits(hf, ids)
    finally:
        del hf
        gc.collect()
    got = our_logits(model, ids)
    assert got.shape == expected.shape
    assert (got - expected).abs().max().item() < TOL
    assert torch.equal(got.argmax(-1), expected.argmax(-1))


TINY_CASES = {
    # name: (arch, sharded, legacy_rope, config overrides)
    "llama-gqa-tied": ("llama", False, False, dict(num_key_value_heads=2, tie_word_embeddings=True)),
    "llama-mha-untied-sharded": ("llama", True, False, dict(num_key_value_heads=4, tie_word_embeddings=False)),
    "qwen2-bias-gqa-untied": ("qwen2", False, False, dict(num_key_value_heads=2, tie_word_embeddings=False)),
    "qwen2-bias-mha-tied": ("qwen2", False, False, dict(num_key_value_heads=4, tie_word_embeddings=True)),
    "mistral-gqa": ("mistral", False, False, dict(num_key_value_heads=1, sliding_window=None)),
    "llama3-rope-scaling": ("llama", False, True, dict(
        rope_theta=50000.0, max_position_embeddings=256,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 64})),
}


@pytest.mark.parametrize("case", list(TINY_CASES))
def test_tiny_hf_folder_matches_transformers(case, make_hf_folder):
    arch, sharded, legacy_rope, overrides = TINY_CASES[case]
    hf, folder = make_hf_folder(arch, max_shard_size="40KB" if sharded else None, legacy_rope=legacy_rope, **overrides)
    if sharded:
        assert (folder / "model.safetensors.index.json").exists()
        assert len(list(folder.glob("*.safetensors"))) > 1
    model, tokenizer = load_model(folder, "cpu", torch.float32)
    assert model.args.attn_bias == (arch == "qwen2")
    assert model.args.tie_embeddings == overrides.get("tie_word_embeddings", False)
    assert model.args.n_kv_head == overrides.get("num_key_value_heads", 2)
    # Past the original 64-token context for the rope-scaling case; random ids elsewhere.
    torch.manual_seed(1)
    ids = torch.randint(0, hf.config.vocab_size, (100,))
    got, expected = our_logits(model, ids), hf_logits(hf, ids)
    assert (got - expected).abs().max().item() < TOL


def test_tiny_hf_folder_rope_parameters_format_matches_transformers(make_hf_folder):
    """The same llama3 rope-scaling model, config.json as transformers 5 writes it."""
    hf, folder = make_hf_folder("llama", rope_theta=50000.0, max_position_embeddings=256, rope_scaling={
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
        "original_max_position_embeddings": 64})
    model, _ = load_model(folder, "cpu", torch.float32)
    torch.manual_seed(1)
    ids = torch.randint(0, hf.config.vocab_size, (100,))
    assert (our_logits(model, ids) - hf_logits(hf, ids)).abs().max().item() < TOL


# ---------------------------------------------------------------- KV cache and tree-style calls

@pytest.fixture
def tiny_model(make_hf_folder):
    _, folder = make_hf_folder("qwen2", num_key_value_heads=2)
    model, _ = load_model(folder, "cpu", torch.float32)
    return model


def test_incremental_decoding_equals_full_forward(tiny_model):
    torch.manual_seed(2)
    ids = torch.randint(0, tiny_model.args.vocab_size, (40,))
    full = our_logits(tiny_model, ids)

    tiny_model.setup_caches(1, 64)  # longer than needed: the unused slots must stay masked
    n_prefill = 12
    with torch.no_grad():
        steps = [tiny_model(ids[None, :n_prefill], torch.arange(n_prefill))[0]]
        for t in range(n_prefill, len(ids)):
            steps.append(tiny_model(ids[None, t:t + 1], torch.tensor([t]))[0])
    incremental = torch.cat(steps)
    assert incremental.shape == full.shape
    assert (incremental - full).abs().max().item() < 1e-4


@pytest.mark.parametrize("gathered", [False, True])
def test_tree_mask_call_equals_plain_causal_calls(tiny_model, gathered):
    """Four draft nodes in cache slots P..P+3: two paths of depth 2, a->b and c->d.
    Node i sits at slot P+i with RoPE position P+depth and sees the prefix, its ancestors and itself.
    gathered: the tree mask gathered into the cache slots for SDPA (cpu_kernels.TileTransformer, as on AMX
    CPUs in bf16), or tree_attention."""
    torch.manual_seed(3)
    P, S = 10, 32
    prefix = torch.randint(0, tiny_model.args.vocab_size, (P,))
    a, b, c, d = torch.randint(0, tiny_model.args.vocab_size, (4,)).tolist()
    tiny_model.setup_caches(1, S)
    verifier = tiny_model
    if gathered:  # the same modules and caches
        verifier = copy.copy(tiny_model)
        verifier.__class__ = ck.TileTransformer
    with torch.no_grad():
        tiny_model(prefix[None], torch.arange(P))
        tree_tokens = torch.tensor([[a, b, c, d]])
        depth = torch.tensor([0, 1, 0, 1])
        ancestors = [[0], [0, 1], [2], [2, 3]]
        mask = torch.zeros(4, S, dtype=torch.bool)
        mask[:, :P] = True
        for i, anc in enumerate(ancestors):
            mask[i, [P + j for j in anc]] = True
        tree = tiny_model(tree_tokens, P + depth, mask=mask, cache_pos=P + torch.arange(4))[0]
        # as spec_step calls it: the prefix slots, and the tree's own rows through tree_mask
        tree_mask = mask[:, P:P + 4]
        by_tree_mask = verifier(tree_tokens, P + depth, mask=torch.arange(S)[None, :] < P,
                                  cache_pos=P + torch.arange(4), tree_mask=tree_mask)[0]

        # The same paths as plain causal calls after the same prefix (each overwrites slots P, P+1).
        path_ab = tiny_model(torch.tensor([[a, b]]), torch.arange(P, P + 2))[0]
        path_cd = tiny_model(torch.tensor([[c, d]]), torch.arange(P, P + 2))[0]
    assert (tree[[0, 1]] - path_ab).abs().max().item() < 1e-4
    assert (tree[[2, 3]] - path_cd).abs().max().item() < 1e-4
    assert (by_tree_mask - tree).abs().max().item() < 1e-4


def test_four_dim_mask_equals_two_dim_mask(tiny_model):
    torch.manual_seed(4)
    ids = torch.randint(0, tiny_model.args.vocab_size, (8,))
    tiny_model.setup_caches(1, 16)
    mask = torch.arange(16)[None, :] <= torch.arange(8)[:, None]
    with torch.no_grad():
        two = tiny_model(ids[None], torch.arange(8), mask=mask)
        four = tiny_model(ids[None], torch.arange(8), mask=mask[None, None])
        default = tiny_model(ids[None], torch.arange(8))
    assert torch.allclose(two, four, atol=1e-6)
    assert torch.allclose(two, default, atol=1e-6)


# ---------------------------------------------------------------- compiled decode

def test_compiled_decode_gives_the_same_greedy_tokens_as_eager(default_model, no_recompiles):
    """Compiled, attending the live span of the cache (one graph while the span grows past two
    blocks), against eager over the whole cache."""
    model, tokenizer = default_model
    ids = torch.tensor(tokenizer.encode(tokenizer.chat([{"role": "user", "content": "Tell me about the sea."}]),
                                        bos=False))
    n = 64
    model.setup_caches(1, generate.cache_size(len(ids), n, 1, model.args.max_seq_len))

    def run(step, span=None):
        with torch.inference_mode():
            token = prefill(model, ids)[0]
            return decode(step, (token, torch.tensor(len(ids))), int(token), n, eos_id=None, span=span)[0]

    eager = run(lambda t, p: ar_step(model, t, p))
    compiled_step = speculate.compile_step(lambda t, p, span: ar_step(model, t, p, span=span), "cpu", mode="default")
    compiled = run(compiled_step, (speculate.live_span(model, 1, block=32), len(ids)))
    assert len(eager) == n
    assert compiled == eager


def test_lean_guards_keep_inputs_and_buffers_but_not_weights_or_packed_copies():
    from types import SimpleNamespace as NS
    g = lambda name, value, module=True: NS(name=name, value=value,
                                             orig_guard=NS(source=NS(is_unspecialized_nn_module=lambda: module)))
    guards = [g("L['t']", torch.zeros(1), module=False), g("G['m']._buffers['k_cache']", torch.zeros(1)),
              g("G['m']._modules['w']._buffers['packed']", torch.zeros(1)),
              g("G['m']._parameters['weight']", torch.nn.Parameter(torch.zeros(1))), g("G['m'].training", False)]
    assert speculate.lean_guards(guards) == [True, True, False, False, False]


def test_compiled_step_recompiles_for_longer_caches(tiny_model):
    """compile_step drops Dynamo's guards on modules and weights (lean_guards) but keeps those on
    buffers: caches re-allocated longer (a longer prompt) compile a second graph rather than run the
    first one past its cache's end, and both graphs give eager's tokens."""
    torch._dynamo.reset()
    torch.manual_seed(4)
    ids = torch.randint(0, tiny_model.args.vocab_size, (6,))
    step = speculate.compile_step(lambda t, p: ar_step(tiny_model, t, p), "cpu", mode="default")

    def run(step, n):
        tiny_model.setup_caches(1, len(ids) + n)
        with torch.inference_mode():
            token = prefill(tiny_model, ids)[0]
            return decode(step, (token, torch.tensor(len(ids))), int(token), n, eos_id=None)[0]

    frames = lambda: torch._dynamo.utils.counters["stats"]["unique_graphs"]
    assert run(step, 4) == run(lambda t, p: ar_step(tiny_model, t, p), 4)
    graphs = frames()
    assert run(step, 20) == run(lambda t, p: ar_step(tiny_model, t, p), 20)
    assert frames() == graphs + 1
