"""generate.py (and bench.py's argument checks) as a user runs them: bad input gets one `error: ...` line and a non-zero exit (never a
traceback, never silent garbage); the default model answers a question end to end."""
import json
import shutil
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from conftest import ROOT, build_hf_model, write_hf_folder
import speculate as sp

# name: what to pass, and what the last line of stderr must say
BAD_INPUTS = {
    "missing-checkpoint": "does not exist",
    "truncated-safetensors": "truncated or corrupt",
    "truncated-gguf": "truncated or corrupt",
    "unsupported-architecture": "GPT2LMHeadModel is not supported",
    "prompt-past-context": "shorten the prompt",
    "max-new-tokens-past-context": "lower --max_new_tokens",
    "max-new-tokens-zero": "--max_new_tokens must be at least 1",
    "unknown-device": "unknown device 'tpu'",
    "unavailable-device": "device 'cuda' is not available",
    "unknown-dtype": "invalid choice: 'float8'",
}


@pytest.fixture(scope="module")
def cli_runs(run_cli, tmp_path_factory, tiny_ctx64_folder, default_gguf):
    """Every bad-input run (and one good run on the same tiny folder, the control), started together
    since each spends most of its few seconds importing torch."""
    tmp = tmp_path_factory.mktemp("cli")
    tiny = ["--checkpoint", tiny_ctx64_folder, "--no_chat"]

    truncated_st = write_hf_folder(build_hf_model("llama", num_hidden_layers=1), tmp / "truncated-st")
    f = truncated_st / "model.safetensors"
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])

    cut = tmp / "cut.gguf"
    with open(default_gguf, "rb") as g:
        cut.write_bytes(g.read(1 << 20))

    gpt2 = tmp / "gpt2"
    shutil.copytree(tiny_ctx64_folder, gpt2)
    cfg = json.loads((gpt2 / "config.json").read_text())
    cfg["architectures"] = ["GPT2LMHeadModel"]
    (gpt2 / "config.json").write_text(json.dumps(cfg))

    runs = {
        "missing-checkpoint": (["--checkpoint", tmp / "does-not-exist", "--max_new_tokens", 2], None),
        "truncated-safetensors": (["--checkpoint", truncated_st, "--no_chat", "--max_new_tokens", 2], None),
        "truncated-gguf": (["--checkpoint", cut, "--max_new_tokens", 2], {"TREESPEC_CACHE": str(tmp / "cache")}),
        "unsupported-architecture": (["--checkpoint", gpt2, "--no_chat", "--max_new_tokens", 2], None),
        "prompt-past-context": (tiny + ["--prompt", "x" * 100, "--max_new_tokens", 2], None),
        "max-new-tokens-past-context": (tiny + ["--prompt", "hello", "--max_new_tokens", 100], None),
        "max-new-tokens-zero": (tiny + ["--prompt", "hello", "--max_new_tokens", 0], None),
        "unknown-device": (["--device", "tpu", "--max_new_tokens", 2], None),
        "unavailable-device": (["--device", "cuda", "--max_new_tokens", 2], None),
        "unknown-dtype": (["--dtype", "float8", "--max_new_tokens", 2], None),
        "control": (tiny + ["--prompt", "hello", "--max_new_tokens", 20], None),
    }
    with ThreadPoolExecutor(max_workers=4) as pool:
        futures = {name: pool.submit(run_cli, *args, env=env) for name, (args, env) in runs.items()}
        results = {name: f.result() for name, f in futures.items()}
    results["cache"] = tmp / "cache"
    return results


@pytest.mark.parametrize("case", list(BAD_INPUTS))
def test_bad_input_is_one_clear_error_line(cli_runs, case):
    r = cli_runs[case]
    assert r.returncode != 0, f"exit 0 for bad input; stdout: {r.stdout!r}"
    assert "Traceback" not in r.stderr, r.stderr
    lines = r.stderr.strip().splitlines()
    assert lines, "nothing on stderr"
    last = lines[-1]
    # ours: "error: ..."; argparse's (for --dtype): "generate.py: error: ..."
    assert last.startswith("error:") or (case == "unknown-dtype" and last.startswith("generate.py: error:")), last
    assert BAD_INPUTS[case] in last, last
    assert r.returncode == 2


def test_truncated_gguf_leaves_nothing_in_the_cache(cli_runs):
    assert not list(cli_runs["cache"].glob("*/model_args.json")), "a broken conversion was cached"


def test_the_same_tiny_model_generates_within_its_context(cli_runs):
    """The control for the context errors above: a prompt that fits runs."""
    r = cli_runs["control"]
    assert r.returncode == 0, r.stderr
    assert "Traceback" not in r.stderr
    assert "tokens in" in r.stderr


def test_paris(run_cli):
    r = run_cli("--prompt", "What is the capital of France?", "--max_new_tokens", 20, timeout=300)
    assert r.returncode == 0, r.stderr
    assert any("Paris" in line for line in r.stdout.splitlines()), r.stdout


@pytest.mark.parametrize("args,says", [
    (["spec_bench", 1], "give --heads"),
    (["spec_bench", 1, "--heads", "ngram", "--questions", "no-such-file.jsonl"], "give --questions"),
    (["speed", "--device", "cuda", "--skip_hf"], "device 'cuda' is not available"),
    (["speed", "--checkpoint", "some/model"], "add --skip_hf with --checkpoint"),
    (["rows", "--lookup", 3], "give --heads too"),
    (["acceptance", "data/calibrate.jsonl"], "give --heads"),
    (["acceptance", "../shared/data/spec_bench.jsonl", "--heads", "ngram"], "give other prompts"),
    (["acceptance", "data/calibrate.jsonl", "--heads", "ngram"], "ngram is not a folder"),
    (["acceptance", "no-such-file.jsonl", "--heads", "heads/hydra-smollm2"], "cannot read the prompts file"),
    (["quantized", "ckpt/none", "--llama_cpp", "no-such.gguf"], "no such GGUF file"),
])
def test_bench_bad_input_is_one_clear_error_line(args, says):
    if "cuda" in args and torch.cuda.is_available():
        pytest.skip("a CUDA device is here")
    r = subprocess.run([sys.executable, "bench.py", *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                       timeout=120, stdin=subprocess.DEVNULL)
    assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines()[-1].startswith("error:") and says in r.stderr, r.stderr


def test_profile_table_names_each_op_with_its_shapes():
    import bench
    lin = torch.nn.Linear(8, 24)
    x = torch.randn(4, 8)
    table = bench.profile_table(lambda: lin(x))
    assert "aten::addmm" in table or "aten::linear" in table
    assert "[4, 8]" in table and "[24, 8]" in table  # group_by_input_shape: which linear it was


def test_near_tie():
    """bench.py --ties: where two outputs first differ, the fp32 logits of their two tokens after the
    common prefix, the run dtype's spacing at their size, and which is the fp32 argmax."""
    import math

    import bench
    from model import ModelArgs, Transformer
    torch.manual_seed(0)
    model = Transformer(ModelArgs(dim=64, n_layer=2, n_head=4, n_kv_head=2, vocab_size=300, intermediate_size=128,
                                  max_seq_len=64))
    model.setup_caches(1, 64)
    ids, common = [5, 6, 7], [8, 9]
    with torch.inference_mode():
        z = model(torch.tensor([ids + common]), torch.arange(5))[0, -1]
    first, second, third = z.topk(3).indices.tolist()
    i, gap, ulp, top = bench.near_tie(model, ids, common + [first, 1], common + [second, 2], torch.bfloat16)
    assert (i, top) == (2, "spec") and gap == pytest.approx(float(z[first] - z[second])) and gap >= 0
    assert ulp == 2.0 ** (math.floor(math.log2(max(abs(float(z[first])), abs(float(z[second]))))) - 7)
    assert bench.near_tie(model, ids, common + [second], common + [first], torch.bfloat16)[3] == "ar"
    assert bench.near_tie(model, ids, common + [second], common + [third], torch.bfloat16)[3] == "other"
    assert bench.near_tie(model, ids, common, common + [first], torch.bfloat16) is None


def test_spec_bench_runs_several_trees_against_one_autoregressive_decode(default_model, tmp_path):
    """bench.py --spec_bench with several --tree values: each tree decodes every question, the
    question's one autoregressive decode is the reference of all (same output, its time)."""
    import bench
    import generate as G
    from generate import load_heads
    model, tok = default_model
    qs = tmp_path / "q.jsonl"
    qs.write_text("\n".join(json.dumps(dict(category=c, turns=[t])) for c, t in [
        ("lists", "List the days of the week, each with one sentence about it."), ("math", "What is 12 times 13?")]))
    head = load_heads("ngram", model)
    specs = []
    for tree in ("chain4", [[0]]):
        draft, accept, depth, nodes, scratch = sp.speculator(model, head, tree)
        specs.append((str(tree), lambda h, t, k, P, span=None, d=draft, a=accept:
                      sp.spec_step(model, d, a, h, t, k, P, span), depth, nodes))
    sp.setup_caches(model, head, G.cache_size(64, 24, 8, model.args.max_seq_len), 8)
    res = bench.spec_bench(model, tok, head, specs, lambda t, pos, span=None: sp.ar_step(model, t, pos, span=span),
                           qs, 1, 24, 64, speed=True)
    assert list(res) == ["chain4", "[[0]]"] and all(list(r) == ["lists", "math"] for r in res.values())
    for r in res.values():
        assert all(c["same"] == c["q"] == 1 and c["tokens"] > 0 and c["t_ar"] > 0 for c in r.values())
    # one AR decode per question: the same reference time in both trees' records
    assert [c["t_ar"] for c in res["chain4"].values()] == [c["t_ar"] for c in res["[[0]]"].values()]
    assert res["chain4"]["lists"]["steps"] < res["[[0]]"]["lists"]["steps"]  # the deeper chain takes fewer steps
