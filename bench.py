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

import torch

import generate as G
from checkpoint import default_checkpoint, load_model
from heads import load_heads

PROMPT = "Write a short story about a robot who learns to paint. Make it about three paragraphs long."


def timed(fn, runs: int):
    times = []
    for _ in range(runs):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def decode_rate(model, head, step, prompt, depth, n, runs):
    """tokens/s of the decode loop alone, and tau (tokens per step)."""
    def run(k):
        def f():
            first, state = G.start(model, head, prompt, depth, dict(temperature=0.0))
            run.out = G.decode(step, state, first, k, eos_id=None)
            run.steps = G.decode.steps
        return f
    with torch.inference_mode():
        run(n)()  # warm up (and compile)
        t_n, t_1 = timed(run(n), runs), timed(run(1), runs)
        run(n)()
    return (n - 1) / (t_n - t_1), (len(run.out) - 1) / max(run.steps, 1)


def hf_rate(dtype, prompt, n, runs):
    from transformers import AutoModelForCausalLM
    path = default_checkpoint()
    hf = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype).eval()
    ids = prompt[None]
    gen = lambda k: lambda: hf.generate(ids, max_new_tokens=k, min_new_tokens=k, do_sample=False, pad_token_id=2)
    with torch.inference_mode():
        gen(n)()
        t_n, t_1 = timed(gen(n), runs), timed(gen(1), runs)
    return (n - 1) / (t_n - t_1)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--runs", type=int, default=3)
    p.add_argument("--compile_mode", default=None, help="default: max-autotune-no-cudagraphs on CPU")
    p.add_argument("--skip_hf", action="store_true")
    p.add_argument("--skip_eager", action="store_true")
    p.add_argument("--heads", default=None)
    p.add_argument("--tree", default="tree16")
    p.add_argument("--dynamic_tree", default=None, help="top_k,depth,total_tokens")
    args = p.parse_args()

    dtype = getattr(torch, args.dtype)
    model, tok = load_model(None, "cpu", dtype)
    prompt = torch.tensor(tok.encode(tok.chat([{"role": "user", "content": PROMPT}])))
    n = args.max_new_tokens
    rows = []
    head = load_heads(args.heads, model) if args.heads else None
    draft = accept = None
    depth, nodes, scratch = 0, 1, 0
    if head is not None:
        dyn = tuple(int(x) for x in args.dynamic_tree.split(",")) if args.dynamic_tree else None
        draft, accept, depth, nodes, scratch = G.speculator(model, head, args.tree, dyn)
    G.setup_caches(model, head, G.cache_size(len(prompt), n, nodes, model.args.max_seq_len), scratch)
    ar = lambda t, pos: G.ar_step(model, t, pos)
    if not args.skip_eager:
        rows.append(("ours, eager", *decode_rate(model, None, ar, prompt, 0, n, args.runs)))
    rows.append(("ours, compiled", *decode_rate(model, None, G.compile_step(ar, "cpu", args.compile_mode),
                                                prompt, 0, n, args.runs)))
    if head is not None:
        spec = G.compile_step(lambda h, t, k, P: G.spec_step(model, draft, accept, h, t, k, P), "cpu", args.compile_mode)
        rows.append((f"ours, compiled, {type(head).__name__} {args.dynamic_tree or args.tree}",
                     *decode_rate(model, head, spec, prompt, depth, n, args.runs)))
    if not args.skip_hf:
        rows.append(("transformers generate", hf_rate(dtype, prompt, n, args.runs), 1.0))
    base = rows[0][1]
    print(f"\n{args.dtype}, {n} new tokens, prompt {len(prompt)} tokens, median of {args.runs} runs, "
          f"{torch.get_num_threads()} threads")
    print(f"| engine | tok/s | ms/token | tau | vs {rows[0][0]} |")
    print("|---|---|---|---|---|")
    for name, rate, tau in rows:
        print(f"| {name} | {rate:.1f} | {1000 / rate:.1f} | {tau:.2f} | {rate / base:.2f}x |")
    print("command: python " + " ".join(sys.argv))


if __name__ == "__main__":
    main()
