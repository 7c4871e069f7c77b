"""Side-by-side decode speed on one prompt, in one run: eager vs compiled decoding of our engine,
transformers' `generate` on the same weights, and (with --heads) tree speculative decoding.
Reports decode tokens/s (prefill excluded: time for N tokens minus time for 1) as the median of
--runs runs, and every figure as a ratio to our eager decoding.

    python bench.py --dtype bfloat16                          # base engine vs transformers
    python bench.py --dtype bfloat16 --heads DIR --tree tree16 --skip_hf
"""
import argparse
import statistics
import sys
import time
from pathlib import Path

import torch

import generate as G
from checkpoint import default_checkpoint, load_model
from heads import load_heads

PROMPT = "Write a short story about a robot who learns to paint. Make it about three paragraphs long."


def once(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def ours(model, head, step, prompt, depth, n):
    """One measurement: (decode tokens/s, tau). Decode time = time for n tokens minus time for 1."""
    def run(k):
        first, state = G.start(model, head, prompt, depth, dict(temperature=0.0))
        run.out = G.decode(step, state, first, k, eos_id=None)
        run.steps = G.decode.steps
    with torch.inference_mode():
        t_n = once(lambda: run(n))
        tau = (len(run.out) - 1) / max(run.steps, 1)
        t_1 = once(lambda: run(1))
    return (n - 1) / (t_n - t_1), tau


def hf(dtype, prompt, n):
    from transformers import AutoModelForCausalLM
    path = default_checkpoint()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype).eval()
    gen = lambda k: lambda: model.generate(prompt[None], max_new_tokens=k, min_new_tokens=k, do_sample=False,
                                           pad_token_id=2)

    def measure():
        with torch.inference_mode():
            return (n - 1) / (once(gen(n)) - once(gen(1))), 1.0
    return measure


def spec_bench_tau(model, tok, head, draft, accept, depth, nodes, scratch, per_category, n, max_prompt,
                   compile=False, compile_mode=None):
    """Mean tokens per step (tau) of greedy speculative decoding on the first questions of each
    Spec-Bench category (../shared/data/spec_bench.jsonl: evaluation only). compile: compile the
    step once (one cache of max_prompt + n slots for every prompt: what a question leaves in it past its
    own length is masked), else eager. Returns {category: (tau, questions, tokens)}."""
    import json
    from collections import defaultdict
    path = Path(__file__).resolve().parent.parent / "shared" / "data" / "spec_bench.jsonl"
    by_cat = defaultdict(list)
    for line in path.read_text().splitlines():
        q = json.loads(line)
        ids = tok.encode(tok.chat([{"role": "user", "content": q["turns"][0]}]))
        if len(ids) <= max_prompt and len(by_cat[q["category"]]) < per_category:
            by_cat[q["category"]].append(ids)
    step = lambda h, t, k, P: G.spec_step(model, draft, accept, h, t, k, P)
    if compile:
        G.setup_caches(model, head, G.cache_size(max_prompt, n, nodes, model.args.max_seq_len), scratch)
        step = G.compile_step(step, "cpu", compile_mode)
    out = {}
    for cat, prompts in by_cat.items():
        tokens = steps = 0
        for ids in prompts:
            if not compile:
                G.setup_caches(model, head, G.cache_size(len(ids), n, nodes, model.args.max_seq_len), scratch)
            with torch.inference_mode():
                first, state = G.start(model, head, torch.tensor(ids), depth, dict(temperature=0.0))
                o = G.decode(step, state, first, n, tok.eos_id)
            tokens, steps = tokens + len(o) - 1, steps + G.decode.steps
        out[cat] = (tokens / max(steps, 1), len(prompts), tokens)
    return out


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--compile_mode", default=None, help="default: max-autotune-no-cudagraphs on CPU")
    p.add_argument("--skip_hf", action="store_true")
    p.add_argument("--skip_eager", action="store_true")
    p.add_argument("--heads", default=None)
    p.add_argument("--tree", default="tree16")
    p.add_argument("--lookup", type=int, default=0, help="add a prompt-lookup branch (N-gram) to the head's tree")
    p.add_argument("--dynamic_tree", default=None, help="top_k,depth,total_tokens")
    p.add_argument("--spec_bench", type=int, default=0, metavar="N",
                   help="instead: tau of --heads on the first N Spec-Bench questions of each category")
    p.add_argument("--max_prompt", type=int, default=1024, help="with --spec_bench: skip longer prompts")
    p.add_argument("--compile", action="store_true", help="with --spec_bench: compile the step (faster, same tau)")
    args = p.parse_args()

    dtype = getattr(torch, args.dtype)
    model, tok = load_model(None, "cpu", dtype)
    prompt = torch.tensor(tok.encode(tok.chat([{"role": "user", "content": PROMPT}])))
    n = args.max_new_tokens
    head = load_heads(args.heads, model, None, args.lookup) if args.heads else None
    draft = accept = None
    depth, nodes, scratch = 0, 1, 0
    if head is not None:
        dyn = tuple(int(x) for x in args.dynamic_tree.split(",")) if args.dynamic_tree else None
        draft, accept, depth, nodes, scratch = G.speculator(model, head, args.tree, dyn)
    if args.spec_bench:
        t0 = time.perf_counter()
        taus = spec_bench_tau(model, tok, head, draft, accept, depth, nodes, scratch, args.spec_bench, n, args.max_prompt,
                              args.compile, args.compile_mode)
        print(f"\n{args.heads}{' + lookup' if args.lookup else ''} {args.dynamic_tree or args.tree}, greedy, {n} new tokens, {args.dtype}")
        print("| category | questions | new tokens | tau |\n|---|---|---|---|")
        for cat, (tau, q, t) in taus.items():
            print(f"| {cat} | {q} | {t} | {tau:.2f} |")
        all_t = sum(t for _, _, t in taus.values())
        all_s = sum(t / tau for tau, _, t in taus.values())
        print(f"| all | {sum(q for _, q, _ in taus.values())} | {all_t} | {all_t / all_s:.2f} |")
        print(f"({time.perf_counter() - t0:.0f} s) command: python " + " ".join(sys.argv))
        return
    G.setup_caches(model, head, G.cache_size(len(prompt), n, nodes, model.args.max_seq_len), scratch)
    ar = lambda t, pos: G.ar_step(model, t, pos)
    engines = {}  # name -> a function measuring (tokens/s, tau) once
    if not args.skip_eager:
        engines["ours, eager"] = lambda: ours(model, None, ar, prompt, 0, n)
    compiled = G.compile_step(ar, "cpu", args.compile_mode)
    engines["ours, compiled"] = lambda: ours(model, None, compiled, prompt, 0, n)
    if head is not None:
        spec = G.compile_step(lambda h, t, k, P: G.spec_step(model, draft, accept, h, t, k, P), "cpu", args.compile_mode)
        engines[f"ours, compiled, {type(head).__name__} {args.dynamic_tree or args.tree}"] = \
            lambda: ours(model, head, spec, prompt, depth, n)
    if not args.skip_hf:
        engines["transformers generate"] = hf(dtype, prompt, n)
    for measure in engines.values():  # warm up, compile
        measure()
    # The engines take turns, round after round, so that drifts of this shared machine's speed
    # hit them alike; each engine's ratio to the first is taken round by round.
    results = {name: [] for name in engines}
    for _ in range(args.runs):
        for name, measure in engines.items():
            results[name].append(measure())
    first = next(iter(results.values()))
    rows = [(name, statistics.median(r for r, _ in res), res[-1][1],
             statistics.median(r / f for (r, _), (f, _) in zip(res, first))) for name, res in results.items()]
    print(f"\n{args.dtype}, {n} new tokens, prompt {len(prompt)} tokens, median of {args.runs} interleaved runs, "
          f"{torch.get_num_threads()} threads")
    print(f"| engine | tok/s | ms/token | tau | vs {rows[0][0]} |")
    print("|---|---|---|---|---|")
    for name, rate, tau, ratio in rows:
        print(f"| {name} | {rate:.1f} | {1000 / rate:.1f} | {tau:.2f} | {ratio:.2f}x |")
    print("command: python " + " ".join(sys.argv))


if __name__ == "__main__":
    main()
