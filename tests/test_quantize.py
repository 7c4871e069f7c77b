"""Weight-only int8 / int4 quantization: the schemes' error bounds, the kernels against F.linear on the
dequantized weights, the GGUF's Q4_1 blocks taken exactly, checkpoints through save and load, greedy
speculative decoding on a quantized base, the compiled step, and the CLI's errors."""
import copy
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

import bench
import checkpoint
import generate as G
import quantize as Q
from conftest import ROOT
from test_speculative import Oracle, ar_decode, cut, make_head, spec_decode
import speculate as sp


pytestmark = pytest.mark.usefixtures("one_thread")


def weights(N=128, K=256, seed=0):
    """Random weights with outliers, a constant group and a zero row: the schemes' edge cases."""
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(N, K, generator=g) * 0.05
    w[3, 7] = 1.5
    w[5, :64] = 0.25
    w[9] = 0
    return w


# ---------------------------------------------------------------- schemes and kernels

def test_int8_error_within_half_a_step_per_channel():
    w = weights()
    q, s = Q.quantize_int8(w)
    assert q.dtype == torch.int8 and s.shape == (w.shape[0],)
    err = (w - Q.dequantize_int8(q, s)).abs()
    assert (err <= s[:, None] / 2 * (1 + 1e-5)).all()
    assert Q.dequantize_int8(q, s)[9].abs().max() == 0


@pytest.mark.parametrize("groupsize", [32, 64, 128, 256])
def test_int4_error_within_half_a_step_per_group(groupsize):
    w = weights()
    nib, s, m = Q.quantize_int4(w, groupsize)
    assert nib.shape == (128, 128) and s.shape == m.shape == (128, 256 // groupsize)
    q = Q.unpack_int4(nib)
    assert q.max() <= 15 and torch.equal(Q.pack_int4(q), nib)
    err = (w - Q.dequantize_int4(nib, s, m)).abs().view(128, -1, groupsize)
    assert (err <= s[..., None] / 2 * (1 + 1e-5) + 1e-7).all()
    if groupsize <= 64:  # a constant group is exact
        assert (Q.dequantize_int4(nib, s, m)[5, :64] == 0.25).all()


def quantized_linear(mode, w, dtype):
    if mode == "int8":
        q, s = Q.quantize_int8(w)
        return Q.WeightOnlyInt8Linear(q, s, dtype=dtype), Q.dequantize_int8(q, s), Q.dequantize_int8(q.abs(), s.abs())
    nib, s, m = Q.quantize_int4(w, 32)
    # what bf16 rounding of the scales and zeros (kernel: (q - 8) * scale + zero) or of the scales, mins
    # and the dequantized weight (long inputs: q * scale + min) is relative to
    q = Q.unpack_int4(nib).float().view(128, -1, 32)
    mag = (q - 8).abs() * s[..., None] + (m + 8 * s).abs()[..., None] + q * s[..., None] + m.abs()[..., None]
    return Q.WeightOnlyInt4Linear(nib, s, m, 32, dtype=dtype), Q.dequantize_int4(nib, s, m), mag.view(128, -1)


@pytest.mark.parametrize("mode", ["int8", "int4"])
@pytest.mark.parametrize("rows", [1, 16, Q.KERNEL_ROWS + 1])
def test_kernel_equals_linear_on_dequantized_weight(mode, rows):
    """bf16 kernels (and, over KERNEL_ROWS rows, the bf16 GEMM on the weight dequantized in bf16):
    within 2**-7 * (|x| @ |W|.T) + 2**-8 |y| of the fp32 product (the scales, zeros and dequantized
    weights are rounded to bf16, 2**-9 relative each, and the output once). fp32 (dequantize, then
    F.linear): equal to F.linear on the dequantized weight."""
    w = weights()
    x = torch.randn(rows, 256, generator=torch.Generator().manual_seed(rows)).bfloat16()
    layer, deq, mag = quantized_linear(mode, w, torch.bfloat16)
    assert layer.kernel == "cpu"
    y = layer(x[None])[0].float()
    ref = F.linear(x.float(), deq)
    bound = 2 ** -7 * F.linear(x.float().abs(), mag) + 2 ** -8 * ref.abs()
    assert ((y - ref).abs() <= bound).all(), ((y - ref).abs() / bound).max()
    layer32, deq, _ = quantized_linear(mode, w, torch.float32)
    assert layer32.kernel == "dequant"
    y32 = layer32(x.float())
    if mode == "int4":
        assert torch.equal(y32, F.linear(x.float(), deq))
    else:  # the scales multiply after the dot product
        torch.testing.assert_close(y32, F.linear(x.float(), deq), rtol=1e-5, atol=1e-6)


def test_q4_1_blocks_reproduce_the_gguf_exactly(default_gguf):
    from gguf import GGUFReader
    from gguf.quants import dequantize
    t = next(t for t in GGUFReader(default_gguf).tensors if t.name == "blk.3.ffn_down.weight")
    nib, d, m = Q.q4_1_blocks(t)
    ref = dequantize(t.data, t.tensor_type).reshape(nib.shape[0], -1)
    assert torch.equal(Q.dequantize_int4(nib, d, m), torch.from_numpy(ref))


@pytest.fixture(scope="module")
def int4_g32(default_gguf, tmp_path_factory):
    return Q.write_quantized(None, tmp_path_factory.mktemp("q") / "int4-g32", "int4", 32)


def test_int4_g32_from_the_gguf_is_the_default_model_in_fp32(int4_g32, default_model):
    """The Q4_1 path (q, k, v rows concatenated as convert_gguf does, no permutation): in fp32 the
    quantized model's logits are the default model's, bit for bit (its float weights are the same
    Q4_1 blocks dequantized)."""
    assert checkpoint.quantization(int4_g32)["source"].startswith("Q4_1 blocks")
    model, _ = G.load_model(int4_g32, "cpu", torch.float32)
    base, tok = default_model
    ids = torch.tensor([tok.encode("The capital of France is")])
    with torch.inference_mode():
        model.setup_caches(1, 32), base.setup_caches(1, 32)
        assert torch.equal(model(ids, torch.arange(ids.shape[1])), base(ids, torch.arange(ids.shape[1])))
    assert torch.equal(model.tok_embeddings.weight, base.tok_embeddings.weight)


def test_quality_report_in_fp32_isolates_the_schemes_error(int4_g32, tmp_path):
    """bench.quality in fp32 on two held-out answers: int4-g32 from the GGUF holds the reference's
    very weights (KL 0, same top-1 everywhere, the same perplexity); int8 quantizes them again (a small
    KL above 0, the top-1 nearly always kept)."""
    int8 = Q.write_quantized(None, tmp_path / "int8", "int8")
    rows, n, positions = bench.quality([int4_g32, int8], n=2, dtype=torch.float32)
    g32, i8 = rows
    assert n == 2 and positions > 50
    assert g32["kl_mean"] == 0 and g32["kl_p99"] == 0 and g32["same_top1"] == 1 and g32["ppl"] == g32["ppl_ref"]
    assert 0 < i8["kl_mean"] < 0.01 and i8["same_top1"] > 0.95 and abs(i8["ppl"] / i8["ppl_ref"] - 1) < 0.05


# ---------------------------------------------------------------- checkpoints

def dequantized_copy(folder):
    """A float Transformer whose linears hold the checkpoint's dequantized weights."""
    folder, args, state = checkpoint.resolve(folder)
    quant = checkpoint.quantization(folder)
    for name in Q.linear_names(args, quant["lm_head"] == "int8"):
        if name == "output" or quant["mode"] == "int8":
            w = Q.dequantize_int8(state.pop(f"{name}.weight_int8"), state.pop(f"{name}.scales"))
        else:
            w = Q.dequantize_int4(*(state.pop(f"{name}.{k}") for k in ("weight_int4", "scales", "mins")))
        state[f"{name}.weight"] = w
    model = checkpoint.Transformer(args)
    lm_head = state.pop("output.weight", None)
    model.load_state_dict(state, strict=False)
    if lm_head is not None:  # untied from the (exact) embedding
        model.output.weight = torch.nn.Parameter(lm_head)
    return model.eval()


@pytest.mark.parametrize("mode,groupsize,lm_head", [("int8", 32, "int8"), ("int4", 64, None), ("int4", 32, "int8")])
def test_checkpoint_round_trips_through_save_and_load(tiny, tmp_path, mode, groupsize, lm_head):
    out = Q.write_quantized(tiny, tmp_path / "q", mode, groupsize, lm_head)
    assert checkpoint.quantization(out) == {"mode": mode, "groupsize": groupsize if mode == "int4" else None,
                                            "lm_head": lm_head, "source": "quantized from the float weights"}
    src, _ = G.load_model(tiny)
    ref = dequantized_copy(out)
    ids = torch.tensor([[5, 77, 3, 120, 9, 33, 200, 1]])
    with torch.inference_mode():
        for dtype in (torch.float32, torch.bfloat16):
            model, tok = G.load_model(out, "cpu", dtype)
            cls = Q.WeightOnlyInt8Linear if mode == "int8" else Q.WeightOnlyInt4Linear
            assert isinstance(model.layers[1].feed_forward.w2, cls)
            assert isinstance(model.output, Q.WeightOnlyInt8Linear) == (lm_head == "int8")
            # the lookup stays exact; the tied lm_head's float rows (the heads read them) are the embedding
            assert torch.equal(model.tok_embeddings.weight, src.tok_embeddings.weight.to(dtype))
            assert model.output.weight is model.tok_embeddings.weight
            model.setup_caches(1, 16), ref.setup_caches(1, 16)
            got, want = model(ids, torch.arange(8)).float(), ref(ids, torch.arange(8))
            if dtype == torch.float32:  # the same weights through F.linear
                torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
            else:  # bf16: about as far as the float copy in bf16 is (measured 0.37 and 0.36 of 17.5)
                ref16 = copy.deepcopy(ref).bfloat16()
                ref16.setup_caches(1, 16)
                base = (ref16(ids, torch.arange(8)).float() - want).abs().max()
                assert (got - want).abs().max() <= 1.5 * base
    assert tok.eos_id == 256


def test_greedy_speculative_on_a_quantized_base_equals_its_autoregressive_output(tmp_path):
    """int8 (with the lm_head) of the default model, in fp32: the dequantized weights go through F.linear,
    so the fp32 exactness argument of test_speculative holds. EAGLE tree16 with the oracle drafter."""
    out_dir = Q.write_quantized(None, tmp_path / "int8", "int8", lm_head="int8")
    model, tok = G.load_model(out_dir, "cpu", torch.float32)
    oracle = Oracle(make_head("eagle", model.args, seed=2), model.args.vocab_size, seed=4)
    n_tokens = n_steps = 0
    for text in ["Tell me a short story about a brave cat.", "List five fruits that are red."]:
        prompt = torch.tensor(tok.encode(tok.chat([{"role": "user", "content": text}]), bos=False))
        with torch.inference_mode():
            ref = ar_decode(model, prompt, 32)
            oracle.set_truth(prompt.tolist() + ref)
            out, steps = spec_decode(model, oracle, prompt, 32, tok.eos_id)
        assert out == cut(ref, 32, tok.eos_id)
        n_tokens, n_steps = n_tokens + len(out) - 1, n_steps + len(steps)
    assert n_tokens / n_steps >= 2.5


def test_compiled_step_on_a_quantized_model_compiles_fullgraph(tiny, tmp_path, no_recompiles):
    """int4 layers and an int8 lm_head, bf16 (torch's kernels): sp.compile_step's fullgraph
    autoregressive step gives the eager step's tokens. One shape."""
    import torch._dynamo
    out_dir = Q.write_quantized(tiny, tmp_path / "q", "int4", 32, "int8")
    model, _ = G.load_model(out_dir, "cpu", torch.bfloat16)
    prompt = torch.tensor([5, 77, 3, 120, 9, 33])
    with torch.inference_mode():
        eager = ar_decode(model, prompt, 12)
        step = sp.compile_step(lambda t, p: sp.ar_step(model, t, p), "cpu", mode="default")
        first, state = sp.start(model, None, prompt, 0, dict(temperature=0.0))
        assert sp.decode(step, state, first, 12)[0] == eager
    torch._dynamo.reset()


def test_speed_times_each_base_side_by_side(tiny, tmp_path):
    """bench.py quantized: the float base and a quantized one, AR and speculative (prompt lookup on
    chain4), measured in turns (eager here: the compiled runs are the benchmark's)."""
    out = Q.write_quantized(tiny, tmp_path / "q", "int8")
    rows = bench.quantized_speed([out], tiny, heads="ngram", tree="chain4", n=8, runs=2, compiled=False)
    names = [r[0] for r in rows]
    assert names == [f"{tiny}, AR", f"{tiny}, ngram chain4", f"{out}, AR", f"{out}, ngram chain4"]
    assert all(rate > 0 and tau >= 1 for _, rate, tau, _ in rows) and rows[0][3] == 1.0


# ---------------------------------------------------------------- bad input

def run_quantize(*args):
    return subprocess.run([sys.executable, "quantize.py", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=120, stdin=subprocess.DEVNULL)


def test_cli_errors_are_one_line_and_exit_2(tiny, tmp_path):
    done = Q.write_quantized(tiny, tmp_path / "done", "int8")
    cases = [(["--mode", "int3"], "unknown --mode int3"),
             (["--mode", "int4", "--groupsize", "128"], "does not divide the 64 in-features"),
             (["--mode", "int4", "--groupsize", "48"], "--groupsize 48 is not one of"),
             (["--mode", "int8", "--checkpoint", done], "is already quantized")]
    for extra, message in cases:
        args = ["--out", tmp_path / "x", *extra]
        if "--checkpoint" not in extra:
            args += ["--checkpoint", tiny]
        r = run_quantize(*args)
        assert r.returncode == 2, (extra, r.stderr)
        assert r.stderr.count("\n") == 1 and r.stderr.startswith("error: ") and message in r.stderr, r.stderr


def test_llama_cpp_without_its_package_is_refused_before_any_work(tiny, monkeypatch, capsys):
    """--llama_cpp needs llama-cpp-python, which the engine never depends on: one line, exit 2, before
    any model is loaded or compiled."""
    gguf = str(checkpoint.default_checkpoint())
    monkeypatch.setattr(bench.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(bench, "quantized_speed", lambda *a, **k: pytest.fail("quantized_speed() ran"))
    with pytest.raises(SystemExit) as e:
        bench.main(["quantized", str(tiny), "--llama_cpp", gguf])
    assert e.value.code == 2 and "needs llama-cpp-python" in capsys.readouterr().err


def test_llama_cpp_engine_decodes_the_default_gguf():
    """Where llama-cpp-python is installed (a benchmark tool, not in CI's requirements): the engine
    bench.py quantized --llama_cpp times runs greedy decoding on the embedded GGUF."""
    pytest.importorskip("llama_cpp")
    rate, tau = bench.llama_cpp(checkpoint.default_checkpoint(), torch.tensor([1, 504, 3437, 314]), 8)()
    assert rate > 0 and tau == 1.0


def test_a_device_without_the_kernels_is_refused(tiny, tmp_path, monkeypatch):
    out_dir = Q.write_quantized(tiny, tmp_path / "q", "int4", 32)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (7, 5))
    with pytest.raises(checkpoint.CheckpointError, match="compute capability 8.0"):
        G.load_model(out_dir, "cuda", torch.bfloat16)
    with pytest.raises(checkpoint.CheckpointError, match="run on cpu or cuda, not meta"):
        G.load_model(out_dir, "meta", torch.bfloat16)


def test_cli_writes_int8_heads_into_the_quantized_checkpoint(tiny, tmp_path):
    """quantize.py --mode int4 --heads DIR --out OUT: OUT/<DIR's name> holds the heads in int8, which
    load on the quantized base in bf16 (torch's int8 kernel); quantizing them again is refused."""
    src = tmp_path / "eagle-tiny"
    checkpoint.save_heads(make_head("eagle", G.load_model(tiny)[0].args, seed=1), src)
    r = run_quantize("--mode", "int4", "--checkpoint", tiny, "--heads", src, "--out", tmp_path / "q")
    assert r.returncode == 0, r.stderr
    base, _ = G.load_model(tmp_path / "q", "cpu", torch.bfloat16)
    head = G.load_heads(tmp_path / "q" / "eagle-tiny", base)
    assert isinstance(head.fc, Q.WeightOnlyInt8Linear) and head.fc.kernel == "cpu"
    r = run_quantize("--mode", "int8", "--checkpoint", tiny, "--heads", tmp_path / "q" / "eagle-tiny",
                     "--out", tmp_path / "q2")
    assert r.returncode == 2 and r.stderr.count("\n") == 1 and "is already quantized" in r.stderr, r.stderr
    assert not (tmp_path / "q2").exists()  # refused before anything was written
