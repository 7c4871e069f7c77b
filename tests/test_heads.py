"""Draft heads in their official checkpoint layouts: Medusa (.pt, .safetensors, own or shared lm_head),
Hydra (mlp, prefix-mlp), EAGLE (pytorch_model.bin, model.safetensors; HF rotate-half q/k). Each is
written with save_heads (re-saved with torch.save for the .pt/.bin variants), read back with
load_heads on a tiny random base model, and must give the same drafts as the original and a
speculative decode equal to the autoregressive one. Heads for another hidden size or vocab are
refused with a HeadError naming the mismatch; hub ids go through snapshot_download; and the CLI
decodes with a saved EAGLE head exactly as without it."""
import json

import pytest
import torch

import heads as H
from model import ModelArgs
from test_speculative import TINY, Oracle, ar_decode, make_head, spec_decode, tiny_model  # noqa: F401
from checkpoint import HeadError, save_heads
from generate import load_heads

pytestmark = pytest.mark.usefixtures("one_thread")

# name: (head kind, weights file the loader must read, re-save with torch.save under that name)
FORMATS = {
    "medusa-safetensors": ("medusa", "medusa_lm_head.safetensors"),
    "medusa-pt": ("medusa", "medusa_lm_head.pt"),
    "medusa-shared-lm-head": ("medusa-shared", "medusa_lm_head.safetensors"),
    "hydra-mlp-safetensors": ("hydra", "hydra_lm_head.safetensors"),
    "hydra-mlp-pt": ("hydra", "hydra_lm_head.pt"),
    "hydra-prefix-mlp-safetensors": ("hydra++", "hydra_lm_head.safetensors"),
    "hydra-prefix-mlp-pt": ("hydra++", "hydra_lm_head.pt"),
    "eagle-safetensors": ("eagle", "model.safetensors"),
    "eagle-bin": ("eagle", "pytorch_model.bin"),
}


@pytest.fixture(scope="module")
def base():
    return tiny_model(TINY, seed=11)


def write(head, folder, weights: str):
    """save_heads, then for .pt/.bin the same tensors with torch.save and the safetensors file deleted."""
    save_heads(head, folder, base_model="org/tiny-base")
    if not weights.endswith(".safetensors"):
        from safetensors.torch import load_file
        st = next(folder.glob("*.safetensors"))
        torch.save(load_file(st), folder / weights)
        st.unlink()
    assert sorted(p.name for p in folder.iterdir()) == sorted(["config.json", weights])
    return folder


def read_weights(folder, weights: str) -> dict:
    if weights.endswith(".safetensors"):
        from safetensors.torch import load_file
        return load_file(folder / weights)
    return torch.load(folder / weights, weights_only=True)


def check_layout(kind, head, folder, weights):
    """The official key names and config.json fields."""
    cfg = json.loads((folder / "config.json").read_text())
    keys = set(read_weights(folder, weights))
    if kind.startswith("medusa"):
        assert cfg["medusa_num_heads"] == 4 and cfg["medusa_num_layers"] == 1
        assert cfg["base_model_name_or_path"] == "org/tiny-base"
        want = {f"{k}.0.linear.{w}" for k in range(4) for w in ("weight", "bias")}
        if kind == "medusa":
            want |= {f"{k}.1.weight" for k in range(4)}
        assert keys == want  # shared lm_head: no {head}.{L}.weight at all
    elif kind.startswith("hydra"):
        assert cfg["hydra_num_heads"] == 4 and cfg["hydra_num_layers"] == 1 and cfg["grounded_heads"] is True
        assert cfg["hydra_head_arch"] == ("prefix-mlp" if kind == "hydra++" else "mlp")
        assert {"hydra_mlp.0.1.linear.weight", "hydra_mlp.3.1.res_connection.weight", "hydra_lm_head.3.1.bias"} <= keys
        if kind == "hydra++":
            assert {"prefix_embeding_layer.layers.0.self_attn.q_proj.weight", "prefix_embeding_layer.norm.weight",
                    "prefix_embeding_layer.layers.0.input_layernorm.weight"} <= keys
        assert not any(k.startswith("prefix.") for k in keys)
    else:
        assert cfg["num_hidden_layers"] == 1 and cfg["bias"] is True
        assert cfg["hidden_size"] == TINY.dim and cfg["vocab_size"] == TINY.vocab_size
        layer = {f"layers.0.self_attn.{x}_proj.weight" for x in "qkvo"} | {
            f"layers.0.mlp.{x}_proj.weight" for x in ("gate", "up", "down")} | {"layers.0.post_attention_layernorm.weight"}
        assert keys == {"fc.weight", "fc.bias"} | layer  # no input_layernorm: EAGLE skips it


def drafts(head, base, seed=0):
    """begin then expand at depth 1 and 2 on fixed inputs (caches filled by prefill first)."""
    g = torch.Generator().manual_seed(seed)
    T, P, n, D = 12, 12, 3, 4
    ids = torch.randint(0, TINY.vocab_size, (T + 1,), generator=g)
    base.setup_caches(1, 64)
    head.setup_caches(64)
    out = []
    with torch.inference_mode():
        _, _, h = base(ids[None, :T], torch.arange(T), return_hidden=True)
        h = h[0]
        head.prefill(base, h[: T - n + 1], ids[1: T - n + 2])
        hs = torch.cat([h[T - n:], h[:D + 1 - n]])  # rows past n are stale
        nt = torch.cat([ids[T - n + 1: T + 1], ids[:D + 1 - n]])
        logits, state = head.begin(base, hs, nt, torch.tensor(n), torch.tensor(P))
        out.append(logits)
        k = 3
        for d in (1, 2):
            tokens = logits[-1].topk(k).indices
            nodes = torch.arange(1, k + 1) + (d - 1) * k
            anc = torch.zeros(k, 2 * k + 1, dtype=torch.bool)
            anc[torch.arange(k), nodes] = True
            if d == 2:
                anc[:, 1] = True  # all under node 1
            attn = H.draft_attn(head, torch.tensor(P), torch.tensor(n), d, D, nodes, anc)
            logits, state = head.expand(base, d, state[-1:].expand(k, *state.shape[1:]), tokens, attn)
            out.append(logits)
    return out


@pytest.mark.parametrize("name", list(FORMATS))
def test_official_format_round_trip(name, base, tmp_path):
    kind, weights = FORMATS[name]
    head = make_head(kind, TINY, seed=len(name))
    folder = write(head, tmp_path / name, weights)
    check_layout(kind, head, folder, weights)
    loaded = load_heads(folder, base)
    assert type(loaded) is type(head)
    want, got = head.state_dict(), loaded.state_dict()
    assert set(got) == set(want)
    assert all(torch.equal(got[k], want[k]) for k in want)  # the layout round-trips exactly (q/k permutations too)
    for a, b in zip(drafts(head, base), drafts(loaded, base)):
        assert torch.equal(a, b)

    # a speculative decode with the loaded head equals the autoregressive one (oracle: long paths)
    prompt = torch.randint(0, TINY.vocab_size, (10,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = ar_decode(base, prompt, 36)
        oracle = Oracle(loaded, TINY.vocab_size, seed=2).set_truth(prompt.tolist() + ref)
        out, steps = spec_decode(base, oracle, prompt, 30)
        plain, _ = spec_decode(base, loaded, prompt, 30, dynamic=(3, 3, 10))
    assert out == ref[:30] and plain == ref[:30]
    assert (len(out) - 1) / len(steps) >= 2.0


def test_eagle_layout_is_hf_rotate_half(base, tmp_path):
    """The saved EAGLE layer, read by transformers' own LlamaDecoderLayer (rotate-half RoPE, input
    norm removed as EAGLE does), computes what our layer (interleaved RoPE) computes."""
    from transformers import LlamaConfig
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer, LlamaRotaryEmbedding
    args = ModelArgs(**{**TINY.to_dict(), "rope_base": 10000.0, "n_layer": 1})
    head = make_head("eagle", args, seed=3)
    with torch.no_grad():  # visible attention: sharper q/k than std 0.02, and unit norm weights
        head.layer.block.attention.wqkv.weight.normal_(0, 0.3)
        head.layer.block.ffn_norm.weight.fill_(1.0)
    save_heads(head, tmp_path)
    from safetensors.torch import load_file
    sd = {k.removeprefix("layers.0."): v for k, v in load_file(tmp_path / "model.safetensors").items()
          if k.startswith("layers.0.")}
    config = LlamaConfig.from_pretrained(tmp_path)
    config._attn_implementation = "sdpa"
    hf = LlamaDecoderLayer(config, layer_idx=0).eval()
    hf.input_layernorm = torch.nn.Identity()
    hf.load_state_dict(sd, strict=True)  # every saved key, and nothing missing
    T = 10
    x = torch.randn(1, T, args.dim, generator=torch.Generator().manual_seed(0))
    pos = torch.arange(T)[None]
    causal = torch.ones(T, T, dtype=torch.bool).tril()[None, None]
    with torch.no_grad():
        want = hf(x, attention_mask=causal, position_ids=pos,
                  position_embeddings=LlamaRotaryEmbedding(config)(x, pos))
        want = want[0] if isinstance(want, tuple) else want
        head.setup_caches(T)
        got = head.layer.catch_up(x[0], torch.zeros((), dtype=torch.long))
    assert (got - want[0]).abs().max().item() < 1e-5


OTHER_DIM = ModelArgs(**{**TINY.to_dict(), "dim": 48, "head_dim": 0})   # 4 heads of 12
OTHER_VOCAB = ModelArgs(**{**TINY.to_dict(), "vocab_size": 101})
PREFIX_DIM_BUG = ("heads.load_heads converts a prefix-mlp Hydra's prefix layer (_hf_layer -> checkpoint.hf_block, "
                  "which views q/k with the BASE model's head_dim) before _fit checks shapes, so a head for "
                  "another hidden size raises RuntimeError ('shape ... is invalid'), not HeadError")


@pytest.mark.parametrize("kind,other,what", [
    ("medusa", OTHER_DIM, "hidden size"), ("medusa", OTHER_VOCAB, "vocab"),
    ("medusa-shared", OTHER_DIM, "hidden size"),
    ("hydra", OTHER_DIM, "hidden size"), ("hydra", OTHER_VOCAB, "vocab"),
    ("hydra++", OTHER_DIM, "hidden size"),
    ("hydra++", OTHER_VOCAB, "vocab"),
    ("eagle", OTHER_DIM, "hidden size"), ("eagle", OTHER_VOCAB, "vocab"),
])
def test_head_for_another_base_model_is_refused(kind, other, what, base, tmp_path):
    save_heads(make_head(kind, other), tmp_path)
    with pytest.raises(HeadError) as e:
        load_heads(tmp_path, base)
    msg = str(e.value)
    assert what in msg and "base model" in msg
    if what == "hidden size":
        assert "48" in msg and "64" in msg
    else:
        assert "101" in msg and "97" in msg


def test_hub_id_goes_through_snapshot_download(base, tmp_path, monkeypatch):
    import huggingface_hub
    head = make_head("eagle", TINY, seed=5)
    save_heads(head, tmp_path / "snapshot")
    calls = []

    def fake_snapshot_download(repo_id, **kwargs):
        calls.append((repo_id, kwargs))
        return str(tmp_path / "snapshot")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", fake_snapshot_download)
    monkeypatch.chdir(tmp_path)  # "org/name" must not exist as a local folder
    loaded = load_heads("org/name", base)
    assert [c[0] for c in calls] == ["org/name"]
    assert "*.safetensors" in calls[0][1].get("allow_patterns", [])
    assert all(torch.equal(a, b) for a, b in zip(drafts(head, base), drafts(loaded, base)))

    def failing(repo_id, **kwargs):
        raise OSError("no network")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", failing)
    with pytest.raises(HeadError, match="cannot fetch heads org/other from the hub"):
        load_heads("org/other", base)


def test_cli_with_a_saved_eagle_head_gives_the_autoregressive_output(default_model, run_cli, tmp_path):
    model, _ = default_model
    save_heads(make_head("eagle", model.args, seed=9), tmp_path / "eagle", base_model="SmolLM2-135M-Instruct")
    r = run_cli("--heads", tmp_path / "eagle", "--compare", "--max_new_tokens", 24,
                "--prompt", "Tell me a short story about a brave cat.", timeout=600,
                env={"OMP_NUM_THREADS": "1"})  # see conftest.one_thread
    assert r.returncode == 0, r.stderr[-2000:]
    assert "outputs identical" in r.stderr, r.stderr[-2000:]
    assert "tau" in r.stderr


# ---------------------------------------------------------------- the heads shipped for the default model

SHIPPED = ["medusa-smollm2", "hydra-smollm2", "eagle-smollm2"]
HEADS_DIR = __import__("pathlib").Path(__file__).resolve().parent.parent / "heads"


def test_context_tokens_join_the_draft_vocab(base, monkeypatch):
    """A head with a draft vocab that shares the base's lm_head also drafts over the context's tokens
    outside that vocab: each added once, only where valid, up to CTX; their logits are the base's
    lm_head rows, unused slots -inf; a new prompt clears them."""
    monkeypatch.setattr(H, "CTX", 4)
    head = H.set_draft_vocab(make_head("eagle", base.args, seed=1), base, torch.arange(0, 64, 2))  # V' = 32
    head.note_context(base, torch.tensor([3, 4, 5, 3, 7]), reset=True)         # 4 is in the vocab, 3 twice
    assert head.ctx_n.item() == 3 and head.ctx_ids[:3].tolist() == [3, 5, 7]
    head.note_context(base, torch.tensor([7, 9, 11]), valid=torch.tensor([True, True, False]))
    assert head.ctx_n.item() == 4 and head.ctx_ids[:4].tolist() == [3, 5, 7, 9]
    x = torch.randn(2, base.args.dim)
    logits = head.shared_logits(base, x)                                          # [2, V' + CTX]
    ids = head.token_ids(torch.arange(32 + 4))
    assert ids[32:].tolist() == [3, 5, 7, 9]
    torch.testing.assert_close(logits, base.output(x)[:, ids])
    head.note_context(base, torch.tensor([13, 15, 17, 19, 21]), reset=True)       # more than CTX
    assert head.ctx_n.item() == 4 and head.token_ids(torch.arange(32, 36)).tolist() == [13, 15, 17, 19]
    head.note_context(base, torch.tensor([1]), reset=True)
    logits = head.shared_logits(base, x)
    assert torch.isinf(logits[:, 33:]).all()
    torch.testing.assert_close(logits[:, :33], base.output(x)[:, torch.cat([head.d2t, torch.tensor([1])])])


def test_shipped_heads_are_small_bf16_files():
    files = [f for name in SHIPPED for f in (HEADS_DIR / name).glob("*.safetensors")]
    assert len(files) == len(SHIPPED)
    assert sum(f.stat().st_size for f in files) < 30e6
    from safetensors import safe_open
    for f in files:
        with safe_open(f, "pt") as st:
            assert {st.get_slice(k).get_dtype() for k in st.keys() if k != "d2t"} == {"BF16"}, f


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_heads_decode_exactly_and_get_drafts_accepted(default_model, name):
    """On the default model in fp32: greedy speculative output equals autoregressive output, and the
    trained head gets drafts accepted (a random head's tau is 1.0)."""
    from test_ngram import speculative_tau
    model, tok = default_model
    head = load_heads(HEADS_DIR / name, model)
    assert len(head.d2t) == 8192
    tau = speculative_tau(model, tok, head, "tree16", "Explain why the sky is blue, in three sentences.", n=64)
    assert tau > 1.2, tau  # measured: Medusa 1.40, Hydra 1.54 (after their --context stage), EAGLE 2.03 (after its stage on the steered-prompt data)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_heads_draft_the_prompts_rare_words(default_model, name):
    """Made-up words are outside every shipped head's draft vocab; the heads draft their tokens from
    the context (note_context in the decode loop), and decoding stays exact."""
    from test_train import speculative_equals_autoregressive
    model, tok = default_model
    head = load_heads(HEADS_DIR / name, model)
    prompt = tok.encode(tok.chat([{"role": "user", "content":
                                   "Write one sentence that uses the words Zorblax, Quintavian and Merfleck."}]))
    drafted = []
    speculative_equals_autoregressive(model, head, prompt, 40, drafted, tree="tree16")
    assert head.ctx_n.item() > 0
    assert sum((~torch.isin(t[1:], head.d2t)).sum().item() for t in drafted) > 0  # measured: EAGLE 10, Hydra 11, Medusa 22 (shipped heads, 2026-12-01)


# ---------------------------------------------------------------- int8 heads (quantize.py --heads)

@pytest.mark.parametrize("kind", ["medusa", "hydra++", "eagle"])
def test_int8_heads_hold_the_stored_integers_and_draft_as_their_dequantized_weights(kind, base, tmp_path):
    """quantize.write_quantized_heads: the official layout with int8 linears; loaded, every linear is
    int8 with exactly the integers quantize_int8 gives the float head's weight, and the drafts (fp32:
    the dequantized weight through F.linear) are those of the float head with the dequantized weights.
    Refused: heads quantized again, and int8 heads for another base (the float checks still run)."""
    import quantize as Q
    head = make_head(kind, TINY, seed=7)
    src = tmp_path / "float"
    save_heads(head, src, base_model="org/tiny-base")
    out = Q.write_quantized_heads(src, tmp_path / "int8", base)
    stored = next(out.glob("*.safetensors"))
    assert stored.stat().st_size < 0.4 * next(src.glob("*.safetensors")).stat().st_size  # fp32 -> int8
    assert json.loads((out / "config.json").read_text())["quantization"]["mode"] == "int8"
    loaded = load_heads(out, base)
    assert not any(isinstance(m, torch.nn.Linear) for m in loaded.modules())
    floats = dict(head.named_modules())
    dequant = make_head(kind, TINY, seed=7)
    with torch.no_grad():
        for name, m in loaded.named_modules():
            if isinstance(m, Q.WeightOnlyInt8Linear):
                q, s = Q.quantize_int8(floats[name].weight)
                assert torch.equal(m.weight_int8, q)
                torch.testing.assert_close(m.scales, s, rtol=1e-6, atol=0)
                dict(dequant.named_modules())[name].weight.copy_(Q.dequantize_int8(q, s))
    # in bf16 too: quantized before the head is cast, so from the stored values
    import copy
    int8 = {n: m.weight_int8 for n, m in loaded.named_modules() if isinstance(m, Q.WeightOnlyInt8Linear)}
    loaded16 = load_heads(out, copy.deepcopy(base).bfloat16())
    assert {n: m.weight_int8 for n, m in loaded16.named_modules() if isinstance(m, Q.WeightOnlyInt8Linear)}.keys() == int8.keys()
    assert all(torch.equal(m.weight_int8, int8[n]) for n, m in loaded16.named_modules() if n in int8)
    moved = sum((a - b).abs().max() > 0 for a, b in zip(drafts(head, base), drafts(loaded, base)))
    assert moved > 0  # int8 is not the float head...
    for a, b in zip(drafts(dequant, base), drafts(loaded, base)):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)  # ...but its dequantized weights

    prompt = torch.randint(0, TINY.vocab_size, (10,), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        ref = ar_decode(base, prompt, 24)
        out_tokens, _ = spec_decode(base, loaded, prompt, 24)
    assert out_tokens == ref[:24]

    with pytest.raises(Q.QuantizationError, match="already quantized"):
        Q.write_quantized_heads(out, tmp_path / "again", base)
    with pytest.raises(HeadError, match="base model"):
        load_heads(out, tiny_model(OTHER_DIM if kind != "hydra++" else OTHER_VOCAB, seed=3))


def test_int8_heads_draft_over_the_draft_vocabs_rows_in_int8(base, tmp_path):
    """An int8 head with a draft vocab (shared lm_head) reads the base's rows of that vocab in int8
    (half the bytes of a draft level): the integers quantize_int8 gives those rows; the logits those of
    the dequantized rows; the context's tokens keep the base's float rows."""
    import quantize as Q
    d2t = torch.arange(0, 64, 2)
    save_heads(H.set_draft_vocab(make_head("eagle", base.args, seed=1), base, d2t), tmp_path / "float")
    head = load_heads(Q.write_quantized_heads(tmp_path / "float", tmp_path / "int8", base), base)
    rows = base.output.weight[d2t]
    q, s = Q.quantize_int8(rows)
    assert torch.equal(head.draft_lm.weight_int8, q) and type(head.draft_lm) is Q.WeightOnlyInt8Linear  # no float rows
    head.note_context(base, torch.tensor([3, 5]), reset=True)
    x = torch.randn(2, base.args.dim)
    logits = head.shared_logits(base, x)
    torch.testing.assert_close(logits[:, :32], x @ Q.dequantize_int8(q, s).T, rtol=1e-5, atol=1e-5)
    assert (logits[:, :32] - x @ rows.T).abs().max() > 0
    torch.testing.assert_close(logits[:, 32:34], base.output(x)[:, [3, 5]])
