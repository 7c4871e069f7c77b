"""The benchmarks, one mode a subcommand, each timing side by side in one run (in turns, round after
round, so that a drift of this shared machine's speed hits every engine alike), decode tokens/s with the
prefill excluded (the time for N tokens minus the time for 1):

    python bench.py speed --dtype bfloat16                    # the story prompt: eager, compiled, transformers
    python bench.py speed --heads DIR --tree auto tree16 --skip_hf [--profile prof.txt]   # + trees, where the time goes
    python bench.py spec_bench 5 --heads DIR --dynamic_tree 10,6,60 --max_new_tokens 256 --compile   # tau
    python bench.py spec_bench 2 --heads DIR --lookup 3 --tree auto --max_new_tokens 256 --speed   # + AR, outputs compared
    python bench.py rows --heads DIR                         # the cost of N tree rows and of each draft level
    python bench.py acceptance data/calibrate.jsonl --heads DIR --lookup 3   # what --tree auto weighs
    python bench.py quality ckpt/smollm2-int8 --dtype float32   # quantized checkpoints against the float model
    python bench.py quantized ckpt/smollm2-int8 --heads DIR --lookup 3 --tree auto [--llama_cpp]

spec_bench N decodes the first N questions of each Spec-Bench category (evaluation only); several --tree
names time each tree against the same autoregressive decode. --json FILE writes the results with the
date, the machine and the command; `python plots.py FILE...` draws them into docs/img/.
"""
import argparse
import datetime
import importlib.util
import json
import math
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

import costs
import generate as G
import speculate as S
from checkpoint import default_checkpoint, quantization
from distill import read_data, read_prompts
from heads import static_plan
from trees import best_paths, load_tree, split_chain, step_counts

SPEC_BENCH = Path(__file__).resolve().parent.parent / "shared" / "data" / "spec_bench.jsonl"  # evaluation only
PROMPT = "Write a short story about a robot who learns to paint. Make it about three paragraphs long."


def write_json(path, kind: str, args, **results):
    """bench.py's results for plots.py: what was run, where, when, and the numbers."""
    record = dict(kind=kind, date=datetime.date.today().isoformat(), machine=costs.machine(args.device),
                  threads=torch.get_num_threads(), torch=torch.__version__, dtype=args.dtype,
                  max_new_tokens=args.max_new_tokens, heads=args.heads, lookup=args.lookup,
                  checkpoint=getattr(args, "checkpoint", None),
                  command="python " + " ".join(sys.argv), **results)
    Path(path).write_text(json.dumps(record, indent=1) + "\n")
    print(f"results: {path}")


def once(fn):
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def ours(model, head, step, prompt, depth, n, rows=1):
    """One measurement: (decode tokens/s, tau). Decode time = time for n tokens minus time for 1.
    rows: the cache slots a step writes (the tree's nodes), for the live span it attends."""
    def run(k):
        first, state = S.start(model, head, prompt, depth, dict(temperature=0.0))
        return S.decode(step, state, first, k, eos_id=None, span=(S.live_span(model, rows), len(prompt)))
    with torch.inference_mode():
        t0 = time.perf_counter()
        out, steps = run(n)
        t_n = time.perf_counter() - t0
        tau = (len(out) - 1) / max(steps, 1)
        t_1 = once(lambda: run(1))
    return (n - 1) / (t_n - t_1), tau


def side_by_side(engines: dict, runs: int) -> dict:
    """engines {name: measure() -> (tokens/s, tau)}, each warmed up (compiled) once, then measured
    `runs` times in turns, round after round, so that drifts of this shared machine's speed hit them
    alike. Returns {name: [(tokens/s, tau) per round]}; take ratios round by round (ratio)."""
    for measure in engines.values():
        measure()
    results = {name: [] for name in engines}
    for _ in range(runs):
        for name, measure in engines.items():
            results[name].append(measure())
    return results


def ratio(res: list, to: list) -> float:
    """The median over rounds of res's tokens/s over to's, both lists from side_by_side."""
    return statistics.median(r / f for (r, _), (f, _) in zip(res, to))


def hf(dtype, device, prompt, n):
    from transformers import AutoModelForCausalLM
    path = default_checkpoint()
    model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=dtype).to(device).eval()
    gen = lambda k: lambda: model.generate(prompt[None], max_new_tokens=k, min_new_tokens=k, do_sample=False,
                                           pad_token_id=2)

    def measure():
        with torch.inference_mode():
            return (n - 1) / (once(gen(n)) - once(gen(1))), 1.0
    return measure


def profile_table(fn, cuda: bool = False, rows: int = 30) -> str:
    """torch.profiler over one call of fn: the ops by self time, split by input shapes (which linear,
    which attention), as a text table."""
    from torch.profiler import ProfilerActivity, profile
    activities = [ProfilerActivity.CPU] + [ProfilerActivity.CUDA] * cuda
    with profile(activities=activities, record_shapes=True) as prof:
        fn()
    key = "self_cuda_time_total" if cuda else "self_cpu_time_total"
    return prof.key_averages(group_by_input_shape=True).table(sort_by=key, row_limit=rows)


def near_tie(ref, ids, spec_out, ar_out, dtype):
    """Where a speculative and an autoregressive output first differ: the two tokens' logits from
    `ref` (an fp32 copy of the base) over the common prefix. Returns (position, fp32 logit of the
    speculative token minus the autoregressive one's, the run dtype's spacing at their size, which
    of the two is the fp32 argmax: 'spec', 'ar' or 'other'), or None if one is a prefix of the other."""
    i = next((j for j, (x, y) in enumerate(zip(spec_out, ar_out)) if x != y), None)
    if i is None:
        return None
    prefix = torch.tensor([ids + ar_out[:i]], device=ref.output.weight.device)
    with torch.inference_mode():
        z = ref(prefix, torch.arange(prefix.shape[1], device=prefix.device))[0, -1].float()   # [V]
    a, b = spec_out[i], ar_out[i]
    size = max(abs(float(z[a])), abs(float(z[b])), torch.finfo(dtype).tiny)
    ulp = torch.finfo(dtype).eps * 2.0 ** math.floor(math.log2(size))
    top = int(z.argmax())
    return i, float(z[a] - z[b]), ulp, "spec" if top == a else "ar" if top == b else "other"


def spec_bench(model, tok, head, specs, ar, questions, per_category, n, max_prompt, speed=False, ref=None):
    """Greedy speculative decoding on the first questions of each Spec-Bench category (evaluation
    only), with each of specs [(name, step, depth, nodes)], one after the other on each question. speed:
    also decode each question autoregressively (step `ar`), once, timing every decode loop side by
    side (prefill excluded), and compare each output with it token for token; ref: an fp32 copy of
    the base, to judge where they differ (near_tie).
    Returns {name: {category: dict(q, tokens, steps, t_spec, tokens_ar, t_ar, same, ties)}}."""
    import json
    from collections import defaultdict
    by_cat = defaultdict(list)
    for line in Path(questions).read_text().splitlines():
        q = json.loads(line)
        ids = tok.encode(tok.chat([{"role": "user", "content": q["turns"][0]}]))
        if len(ids) <= max_prompt and len(by_cat[q["category"]]) < per_category:
            by_cat[q["category"]].append(ids)
    dev = model.output.weight.device
    sync = torch.cuda.synchronize if dev.type == "cuda" else lambda: None

    def decode(step, h, ids, d, rows):
        with torch.inference_mode():
            first, state = S.start(model, h, torch.tensor(ids, device=dev), d, dict(temperature=0.0))
            span = S.live_span(model, rows)
            sync()
            t0 = time.perf_counter()
            out, steps = S.decode(step, state, first, n, tok.eos_id, span=(span, len(ids)))
            sync()
            return out, steps, time.perf_counter() - t0

    if speed:  # compile and record (CUDA graphs) outside the timed runs
        t0 = time.perf_counter()
        ids = next(iter(by_cat.values()))[0]
        for _, spec, depth, nodes in specs:
            decode(spec, head, ids, depth, nodes)
        decode(ar, None, ids, 0, 1)
        print(f"compiled and warmed up in {time.perf_counter() - t0:.0f} s", file=sys.stderr, flush=True)
    out = {name: {} for name, *_ in specs}
    for cat, prompts in by_cat.items():
        rs = {name: dict(q=len(prompts), tokens=0, steps=0, t_spec=0.0, tokens_ar=0, t_ar=0.0, same=0, ties=[])
              for name in out}
        for ids in prompts:
            outs = {}
            for name, spec, depth, nodes in specs:
                o, steps, t = outs[name] = decode(spec, head, ids, depth, nodes)
                r = rs[name]
                r["tokens"], r["steps"], r["t_spec"] = r["tokens"] + len(o) - 1, r["steps"] + steps, r["t_spec"] + t
            if speed:
                o_ar, _, t = decode(ar, None, ids, 0, 1)
                for name, r in rs.items():
                    o = outs[name][0]
                    r["tokens_ar"], r["t_ar"] = r["tokens_ar"] + len(o_ar) - 1, r["t_ar"] + t
                    r["same"] += o_ar == o
                    if ref is not None and o_ar != o:
                        r["ties"].append(near_tie(ref, ids, o, o_ar, model.output.weight.dtype))
        for name, r in rs.items():
            out[name][cat] = r
        print(f"{cat}: tau " + ", ".join(f"{r['tokens'] / max(r['steps'], 1):.2f}" for r in rs.values()),
              file=sys.stderr, flush=True)
    return out


def step_acceptance(model, tok, head, paths, prompts, n, max_prompt):
    """How often the head's drafts are accepted, measured the way a step drafts and verifies them
    (EAGLE on the base's own features, the lookup chain beside the head), at every position of each
    prompt's greedy text: a step of a big static tree of index paths `paths` (and a WithLookup
    head's chain) at each, noting the deepest head node and the lookup tokens the base accepted
    there, then keeping the root's own next token only. Under greedy acceptance whether a node is
    accepted depends on it and its ancestors only, so what this tree sees at a root holds for each
    of its subtrees, and walking the positions (trees.walk_tau) gives any subtree's decode, step by
    step. Returns trees.step_counts at the roots the big tree's own decode steps on (what
    choose_tree takes) and `walk`: the positions of each prompt (lengths), at each the index in its
    paths of the deepest accepted head path (best; -1: none) and the lookup's right tokens (lookup:
    {n: [...]}; trees.step_walk reads them)."""
    lookup = head.lookup
    plan = static_plan(paths, lookup)                             # the speculator's node order
    draft, accept, depth, nodes, scratch = S.speculator(model, head, paths)
    parents, heads_own = plan.tree.parents.tolist(), {tuple(p) for p in paths}
    observed, lengths = [], []

    def noting(logits, draft_tokens, tree):  # eager: a host sync a step is fine here
        target, tokens = logits.argmax(-1).tolist(), draft_tokens.tolist()
        right, best, k = [True] * len(tokens), (), 0
        for i in range(1, len(tokens)):
            right[i] = right[parents[i]] and tokens[i] == target[parents[i]]
            if right[i] and plan.paths[i] in heads_own:
                best = max(best, plan.paths[i], key=len)
            elif right[i]:
                k = max(k, len(plan.paths[i]))
        observed.append((best, k))
        path = torch.zeros_like(tree.retrieve_indices[0])         # the root alone: the next position is a root
        return path[0], path, torch.tensor(target[0], device=path.device)

    texts = [ids for ids in (tok.encode(tok.chat([{"role": "user", "content": t}])) for t in read_prompts(prompts))
             if len(ids) <= max_prompt]
    S.setup_caches(model, head, G.cache_size(max_prompt, n, nodes, model.args.max_seq_len), scratch)
    step = lambda h, t, k, P, span=None: S.spec_step(model, draft, noting, h, t, k, P, span)
    dev = model.output.weight.device
    with torch.inference_mode():
        for ids in tqdm(texts, desc="a big tree at every position", unit="prompt", file=sys.stderr):
            first, state = S.start(model, head, torch.tensor(ids, device=dev), depth, dict(temperature=0.0))
            before = len(observed)
            S.decode(step, state, first, n, tok.eos_id, span=(S.live_span(model, nodes), len(ids)))
            lengths.append(len(observed) - before)
    roots, at = [], 0  # the big tree's own decode: a step takes the deeper of the two, then the token after
    for length in lengths:
        i, end = at, at + length
        while i < end:
            roots.append(observed[i])
            i += 1 + max(len(observed[i][0]), observed[i][1])
        at = end
    counts = step_counts(roots, split_chain(paths)[0], lookup)
    index = {tuple(p): i for i, p in enumerate(counts["paths"])}
    walk = dict(lengths=lengths, best=[index[p] if p else -1 for p, _ in observed])
    if lookup:
        walk["lookup"] = {str(lookup): [k for _, k in observed]}
    return dict(prompts=len(texts), **counts, walk=walk)


def quality(dirs, reference=None, data="data/selfdistill.npz", n=24, held_out=134, dtype=torch.bfloat16):
    """Next-token distributions of each quantized checkpoint against the float reference over the
    answer positions of n held-out sequences (the last `held_out` of the data: greedy answers of the
    base model), all in dtype (float32: the dequantized weights through F.linear, which isolates the
    scheme's own error from bf16's rounding). Returns one dict of statistics per checkpoint (and the
    reference's perplexity)."""
    seqs, prompt_lens, _, _ = read_data(data)
    held = list(zip(seqs, prompt_lens))[len(seqs) - held_out:][:n]
    L = max(len(s) for s, _ in held)
    models = [G.load_model(d, "cpu", dtype)[0] for d in [reference, *dirs]]
    for m in models:
        m.setup_caches(1, L)
    kl, same, nll = [[] for _ in dirs], [0] * len(dirs), [[] for _ in models]
    with torch.inference_mode():
        for s, p in held:
            ids = torch.as_tensor(s.astype("int64"))
            target = ids[p:]                                                       # the answer [A]
            logps = [m(ids[None], torch.arange(len(ids)))[0, p - 1:-1].float().log_softmax(-1) for m in models]
            for j, lp in enumerate(logps):
                nll[j].append(-lp.gather(1, target[:, None])[:, 0])
            ref = logps[0]
            for j, lp in enumerate(logps[1:]):
                kl[j].append((ref.exp() * (ref - lp)).sum(-1).clamp(min=0))
                same[j] += int((lp.argmax(-1) == ref.argmax(-1)).sum())
    positions = sum(len(s) - p for s, p in held)
    ppl = [torch.cat(x).mean().exp().item() for x in nll]
    rows = []
    for j, d in enumerate(dirs):
        k = torch.cat(kl[j])
        rows.append(dict(checkpoint=str(d), quant=quantization(d), mb=(Path(d) / "model.safetensors").stat().st_size / 1e6,
                         kl_mean=k.mean().item(), kl_median=k.median().item(), kl_p99=k.quantile(0.99).item(),
                         same_top1=same[j] / positions, ppl=ppl[j + 1], ppl_ref=ppl[0]))
    return rows, len(held), positions


def llama_cpp(gguf, prompt, n: int):
    """llama.cpp's greedy decode on a GGUF through llama-cpp-python (installed for the benchmark only,
    never a dependency of the engine), measured as ours() measures ours: the time of n new tokens
    minus the time of 1, on the same prompt ids, this process's threads. Returns measure() -> (tokens/s, 1.0)."""
    from llama_cpp import Llama
    threads = torch.get_num_threads()
    llm = Llama(str(gguf), n_ctx=-(-(len(prompt) + n) // 256) * 256, n_threads=threads, n_threads_batch=threads,
                verbose=False)
    ids = [int(t) for t in prompt]

    def run(k):
        llm.reset()
        llm.eval(ids)
        for _ in range(k - 1):  # the prompt's next token is the first; each further one is a one-token eval
            llm.eval([int(llm.scores[llm.n_tokens - 1].argmax())])

    def measure():
        t_n = once(lambda: run(n))
        return (n - 1) / (t_n - once(lambda: run(1))), 1.0
    return measure


def quantized_speed(dirs, reference=None, heads=None, lookup=0, tree="tree16", n=128, runs=5, compiled=True, gguf=None):
    """Compiled decode tokens/s (bf16 activations) of the reference model and of each quantized
    checkpoint on the story prompt, side by side in one run (side_by_side: in turns,
    round after round): autoregressive and, with heads, speculative on `tree` (auto: what --tree auto
    picks for each base, timed on first use); with gguf also llama.cpp's decoding of that file.
    compiled=False: eager (tests). Returns [(name, tokens/s, tau, vs the reference's AR)]."""
    engines = {}
    for d in [reference, *dirs]:
        model, tok = G.load_model(d, "cpu", torch.bfloat16)
        compile_step = costs.compiler(model, "cpu", checkpoint=d) if compiled else lambda f: f
        prompt = torch.tensor(tok.encode(tok.chat([{"role": "user", "content": PROMPT}])))
        name = str(d or "bf16")
        ar = compile_step(lambda t, pos, span=None, m=model: S.ar_step(m, t, pos, span=span))
        engines[f"{name}, AR"] = lambda m=model, s=ar, p=prompt: ours(m, None, s, p, 0, n)
        if not heads:
            S.setup_caches(model, None, G.cache_size(len(prompt), n, 1, model.args.max_seq_len))
            continue
        head = G.load_heads(heads, model, None, lookup)
        paths, _ = G.resolve_tree(model, head, heads, tree, "cpu", "default" if compiled else None, d)
        if paths is None:  # auto chose plain decoding: its AR row above is the figure
            S.setup_caches(model, None, G.cache_size(len(prompt), n, 1, model.args.max_seq_len))
            continue
        draft, accept, depth, nodes, scratch = S.speculator(model, head, paths)
        S.setup_caches(model, head, G.cache_size(len(prompt), n, nodes, model.args.max_seq_len), scratch)
        spec = compile_step(lambda h, t, k, P, span=None, m=model, dr=draft, a=accept:
                            S.spec_step(m, dr, a, h, t, k, P, span))
        label = f"{Path(heads).name}{' + lookup' if lookup else ''} {tree}"
        engines[f"{name}, {label}"] = lambda m=model, hd=head, s=spec, p=prompt, dp=depth, nd=nodes: ours(m, hd, s, p, dp, n, nd)
    if gguf:
        engines[f"llama.cpp, {Path(gguf).name}"] = llama_cpp(gguf, prompt, n)
    results = side_by_side(engines, runs)
    ref = next(iter(results.values()))
    return [(name, statistics.median(r for r, _ in res), res[-1][1], ratio(res, ref))
            for name, res in results.items()]


# ---------------------------------------------------------------- the modes

def where(device: str) -> str:
    return f"{costs.machine(device)}, {torch.get_num_threads()} threads" if device == "cpu" else costs.machine(device)


def load(args):
    """The base model in --dtype (generate.load_model) and --heads with any --lookup branch."""
    if args.lookup and not args.heads:
        raise ValueError("--lookup adds a branch to a head's tree: give --heads too (or --heads ngram alone)")
    model, tok = G.load_model(args.checkpoint, args.device, getattr(torch, args.dtype))
    head = G.load_heads(args.heads, model, None, args.lookup) if args.heads else None
    return model, tok, head


def speculators(args, model, head):
    """One speculator a tree: --tree's static trees (tree16 if neither is given), then --dynamic_tree.
    Returns ([(tree name, Speculator)], auto's choice or None)."""
    specs, predicted = [], None
    if head is None:
        return specs, predicted
    dyn = tuple(int(x) for x in args.dynamic_tree.split(",")) if args.dynamic_tree else None
    for tree in (args.tree or ([] if dyn else ["tree16"])) + ([f"dynamic {args.dynamic_tree}"] if dyn else []):
        paths = tree
        if tree == "auto":  # what generate.py's --tree auto picks for a compiled step here
            paths, predicted = G.resolve_tree(model, head, args.heads, "auto", args.device,
                                              args.compile_mode or "default", args.checkpoint)
            if paths is None:
                continue  # plain decoding: the compiled AR engine is already in the table
        specs.append((tree, S.speculator(model, head, paths, dyn if tree.startswith("dynamic") else None)))
    return specs, predicted


def run_rows(args):
    """The cost of a compiled base forward over N tree rows, and of --heads' draft levels: the same
    measurement as --tree auto's, read from (and kept in) its cache."""
    model, _, head = load(args)
    verify, draft = costs.measured_costs(model, head, args.heads or "", args.device, args.compile_mode or "default",
                                         args.checkpoint, rows=(1, 2, 4, 8, 16, 32, 64), depths=(1, 2, 3, 4))
    print(f"\ncompiled base forward over N tree rows after a 512-token prefix, {args.dtype}, {where(args.device)}, "
          "median of 20 calls taken in turns")
    print("| rows | ms | vs 1 row |\n|---|---|---|")
    for N, t in verify.items():
        print(f"| {N} | {t * 1e3:.2f} | {t / verify[1]:.2f}x |")
    if draft:
        print(f"\n{args.heads}{' + lookup' if args.lookup else ''}: compiled draft of a chain, one node a level")
        print("| depth | ms | ms for the last level |\n|---|---|---|")
        for d, t in draft.items():
            print(f"| {d} | {t * 1e3:.2f} | {(t - draft.get(d - 1, 0.0)) * 1e3:.2f} |")
    print("command: python " + " ".join(sys.argv))
    if args.json:
        write_json(args.json, "rows", args, verify_s=verify, draft_s=draft)


def run_spec_bench(args):
    """tau of --heads on the first N questions of each Spec-Bench category; with --speed also each
    question decoded autoregressively, both timed and their outputs compared; with --ties also how
    close to a tie (in an fp32 forward) the two tokens were where the outputs first differ."""
    args.speed = args.speed or args.ties
    if not args.heads:
        raise ValueError("spec_bench measures draft heads: give --heads")
    if not Path(args.questions).is_file():
        raise ValueError(f"no questions file {args.questions}: give --questions (Spec-Bench's question.jsonl)")
    model, tok, head = load(args)
    specs, predicted = speculators(args, model, head)
    if not specs:
        raise ValueError("--tree auto chose plain decoding here: nothing to speculate with; give a tree")
    n, t0 = args.max_new_tokens, time.perf_counter()
    compiled = costs.compiler(model, args.device, args.compile_mode, args.checkpoint) if args.compile or args.speed \
        else (lambda f: f)
    # one cache for every question (what a question leaves in it past its own length is masked), so that
    # compiled steps are compiled once
    S.setup_caches(model, head, G.cache_size(args.max_prompt, n, max(s.nodes for _, s in specs), model.args.max_seq_len),
                   max(s.scratch for _, s in specs))
    steps = [(name, compiled(lambda h, t, k, P, span=None, s=s: S.spec_step(model, s.draft, s.accept, h, t, k, P, span)),
              s.depth, s.nodes) for name, s in specs]
    ar = compiled(lambda t, pos, span=None: S.ar_step(model, t, pos, span=span))
    ref = None
    if args.ties:  # an fp32 copy of the base judges where the outputs differ
        ref, _ = G.load_model(args.checkpoint, args.device, torch.float32)
        ref.setup_caches(1, args.max_prompt + n + 1)
    results = spec_bench(model, tok, head, steps, ar, args.questions, args.per_category, n, args.max_prompt,
                         args.speed, ref)
    records = [spec_bench_table(args, tree, s.nodes, res, predicted) for (tree, s), res in zip(specs, results.values())]
    if args.json:  # the first tree's figures at the top level (what plots.py draws), every tree's in `trees`
        write_json(args.json, "spec_bench", args, **records[0], questions_per_category=args.per_category,
                   speed=args.speed, auto_predicted=predicted and {k: v for k, v in predicted.items()
                                                                   if k != "candidates"}, trees=records)
    if ref is not None:
        ties_table(args, [(cat, *t) for res in results.values() for cat, r in res.items() for t in r["ties"]
                          if t is not None])
    print(f"({time.perf_counter() - t0:.0f} s) command: python " + " ".join(sys.argv))


def spec_bench_table(args, tree, nodes, res, predicted) -> dict:
    """Prints one tree's Spec-Bench table; returns its record for the JSON."""
    name = f"{args.heads}{' + lookup' if args.lookup else ''} {tree}"
    if tree == "auto":
        name += f" ({predicted['nodes']} nodes, predicted {predicted['speedup']:.2f}x)"
    print(f"\n{name}, greedy, {args.max_new_tokens} new tokens, {args.dtype}, {where(args.device)}")
    cols = " tok/s AR | tok/s spec | speedup | same output |" if args.speed else ""
    print(f"| category | questions | new tokens | tau |{cols}\n|---|---|---|---|" + "---|" * 4 * args.speed)
    total = {k: sum(r[k] for r in res.values()) for k in next(iter(res.values())) if k != "ties"}
    for cat, r in [*res.items(), ("all", total)]:
        row = f"| {cat} | {r['q']} | {r['tokens']} | {r['tokens'] / max(r['steps'], 1):.2f} |"
        if args.speed:
            ar_rate, spec_rate = r["tokens_ar"] / r["t_ar"], r["tokens"] / r["t_spec"]
            row += f" {ar_rate:.0f} | {spec_rate:.0f} | {spec_rate / ar_rate:.2f}x | {r['same']}/{r['q']} |"
        print(row)
        r["tau"] = r["tokens"] / max(r["steps"], 1)
        if args.speed:
            r["speedup"] = r["tokens"] / r["t_spec"] / (r["tokens_ar"] / r["t_ar"])
    return dict(tree=tree, nodes=nodes, categories={c: {k: v for k, v in r.items() if k != "ties"}
                                                    for c, r in [*res.items(), ("all", total)]})


def ties_table(args, ties: list):
    print(f"\nwhere the {len(ties)} differing outputs first differ, an fp32 forward over the common prefix:")
    print(f"| category | token | fp32 logit, speculative - AR token | {args.dtype} spacing there | "
          "fp32 argmax |\n|---|---|---|---|---|")
    for cat, i, gap, ulp, top in ties:
        print(f"| {cat} | {i} | {gap:+.3f} | {ulp:.3f} | {top} |")
    close = sum(abs(gap) <= 2 * ulp for _, _, gap, ulp, _ in ties)
    votes = {w: sum(t[-1] == w for t in ties) for w in ("spec", "ar", "other")}
    print(f"within 2 {args.dtype} spacings: {close} of {len(ties)}; the fp32 argmax is the speculative "
          f"token in {votes['spec']}, the autoregressive one in {votes['ar']}, another in {votes['other']}")


def run_speed(args):
    """The story prompt: our engine eager and compiled, transformers' generate and --heads' trees,
    side by side in one run; with --profile also where each engine's time goes."""
    if args.checkpoint and not args.skip_hf:
        raise ValueError("the transformers peer runs the embedded default model only: add --skip_hf with --checkpoint")
    model, tok, head = load(args)
    prompt = torch.tensor(tok.encode(tok.chat([{"role": "user", "content": PROMPT}])), device=args.device)
    n = args.max_new_tokens
    specs, predicted = speculators(args, model, head)
    # (choosing the GEMM backends times a step once, on caches of its own: before the caches are set up)
    compiled = costs.compiler(model, args.device, args.compile_mode, args.checkpoint)
    S.setup_caches(model, head, G.cache_size(len(prompt), n, max([s.nodes for _, s in specs], default=1),
                                             model.args.max_seq_len), max([s.scratch for _, s in specs], default=0))
    ar = lambda t, pos, span=None: S.ar_step(model, t, pos, span=span)
    engines = {}  # name -> a function measuring (tokens/s, tau) once
    if not args.skip_eager:
        engines["ours, eager"] = lambda: ours(model, None, ar, prompt, 0, n)
    ar_compiled = compiled(ar)
    engines["ours, compiled"] = lambda: ours(model, None, ar_compiled, prompt, 0, n)
    tree_of = {}  # engine name -> (tree, nodes)
    for tree, s in specs:
        name = f"ours, compiled, {type(head).__name__} {tree}"
        step = compiled(lambda h, t, k, P, span=None, s=s: S.spec_step(model, s.draft, s.accept, h, t, k, P, span))
        engines[name] = lambda step=step, s=s: ours(model, head, step, prompt, s.depth, n, s.nodes)
        tree_of[name] = (tree, s.nodes)
    if not args.skip_hf:
        engines["transformers generate"] = hf(getattr(torch, args.dtype), args.device, prompt, n)
    results = side_by_side(engines, args.runs)
    first, ar_c = next(iter(results.values())), results["ours, compiled"]
    rows = [(name, statistics.median(r for r, _ in res), res[-1][1], ratio(res, first), ratio(res, ar_c))
            for name, res in results.items()]
    threads = f"{torch.get_num_threads()} threads" if args.device == "cpu" else torch.cuda.get_device_name(args.device)
    print(f"\n{args.dtype}, {n} new tokens, prompt {len(prompt)} tokens, median of {args.runs} interleaved runs, "
          f"{threads}")
    print(f"| engine | tok/s | ms/token | tau | vs {rows[0][0]} |\n|---|---|---|---|---|")
    for name, rate, tau, vs_first, _ in rows:
        print(f"| {name} | {rate:.1f} | {1000 / rate:.1f} | {tau:.2f} | {vs_first:.2f}x |")
    if predicted is not None:
        got = next((r for r in rows if tree_of.get(r[0], (None,))[0] == "auto"), None)
        print(f"--tree auto predicted {predicted['speedup']:.2f}x over compiled AR at expected tau "
              f"{predicted['tau']:.2f}; measured " + (f"{got[4]:.2f}x at tau {got[2]:.2f}" if got else
              "1.00x (it chose plain decoding)"))
    print("command: python " + " ".join(sys.argv))
    if args.json:
        write_json(args.json, "speed", args, prompt_tokens=len(prompt), runs=args.runs,
                   auto_predicted=predicted and {k: v for k, v in predicted.items() if k != "candidates"}, engines=[
            dict(name=name, tree=tree_of.get(name, (None,))[0], nodes=tree_of.get(name, (None, 1))[1],
                 tok_s=rate, tau=tau, vs_first=vs_first, vs_compiled_ar=vs_ar)
            for name, rate, tau, vs_first, vs_ar in rows])
    if args.profile:  # after the timed rounds, so that the profiler's overhead stays out of them
        with open(args.profile, "w") as f:
            for name, measure in engines.items():
                f.write(f"{name}, one measurement ({n} + 1 tokens)\n"
                        f"{profile_table(measure, args.device.startswith('cuda'))}\n")
        print(f"profile of each engine: {args.profile}")


def run_acceptance(args):
    """--heads' acceptance measured in the real step on PROMPTS, kept in the heads' acceptance.json
    (where --tree auto reads it): step_acceptance on a tree of the head's 64 most frequent held-out
    paths (Medusa's mc_sim_7b_63 without them) and a lookup chain 8 deep (how deep `auto` may then make
    its chain), kept as acceptance.json's "step" beside the held-out counts."""
    if "spec_bench" in Path(args.prompts).name.lower():
        raise ValueError("acceptance tunes --tree auto: on Spec-Bench it would tune the trees to the evaluation "
                         "set; give other prompts (data/calibrate.jsonl)")
    if not args.heads:
        raise ValueError("acceptance measures draft heads: give --heads")
    if not Path(args.heads).is_dir():  # before the model loads
        raise ValueError(f"acceptance keeps its counts in the heads' folder: {args.heads} is not a folder")
    read_prompts(args.prompts)  # a bad file fails before the model loads
    model, tok, head = load(args)
    path = Path(args.heads) / "acceptance.json"
    acc = json.loads(path.read_text()) if path.is_file() else {}
    limit = head.max_depth or 0
    paths = best_paths({tuple(p): c for p, c in zip(acc["paths"], acc["counts"])}, 64, limit) if "paths" in acc \
        else [p for p in load_tree("mc_sim_7b_63") if not limit or len(p) <= limit]
    t0 = time.perf_counter()
    chain = [[-1] + [0] * 7] if head.lookup else []
    step = step_acceptance(model, tok, head, paths + chain, args.prompts, args.max_new_tokens, args.max_prompt)
    acc["step"] = dict(source=Path(args.prompts).name, max_new_tokens=args.max_new_tokens, dtype=args.dtype,
                       checkpoint=args.checkpoint or "default", date=datetime.date.today().isoformat(), **step)
    path.write_text(json.dumps(acc) + "\n")
    R = step["roots"]
    head_rates = ", ".join(f"{p} {c / R:.0%}" for p, c in zip(step["paths"][:6], step["counts"]))
    lookup_rates = "".join(f"; lookup (n={k}) right 1-{len(v)} deep at " + "/".join(f"{c / R:.0%}" for c in v)
                           for k, v in step["lookup"]["counts"].items() if v)
    print(f"{path}: {sum(step['walk']['lengths'])} positions over {step['prompts']} prompts "
          f"({time.perf_counter() - t0:.0f} s); the big tree's own decode took {R} steps, where the accepted "
          f"path starts with {head_rates}{lookup_rates}")


def run_quality(args):
    """Quantized checkpoints' next-token distributions against the float model's (--checkpoint)."""
    rows, n, positions = quality(args.dirs, args.checkpoint, args.data, args.n, dtype=getattr(torch, args.dtype))
    print(f"\n`python bench.py quality {' '.join(args.dirs)} --n {args.n} --dtype {args.dtype}`: {n} held-out "
          f"sequences of {args.data}, {positions} answer positions, {args.dtype} activations, reference "
          f"the float model in {args.dtype} (perplexity {rows[0]['ppl_ref']:.3f})\n")
    print("| checkpoint | scheme | MB | KL mean | KL median | KL p99 | same top-1 | perplexity |\n"
          "|---|---|---|---|---|---|---|---|")
    for r in rows:
        q = r["quant"] or {}
        scheme = f"{q.get('mode')}{'-g%s' % q['groupsize'] if q.get('groupsize') else ''}" + \
                 (" + lm_head int8" if q.get("lm_head") else "")
        print(f"| {r['checkpoint']} | {scheme} | {r['mb']:.0f} | {r['kl_mean']:.4f} | {r['kl_median']:.4f} "
              f"| {r['kl_p99']:.4f} | {100 * r['same_top1']:.1f}% | {r['ppl']:.3f} |")


def run_quantized(args):
    """Compiled decode speed of quantized checkpoints beside the float model's (--checkpoint), side by side."""
    gguf = default_checkpoint() if args.llama_cpp == "default" else args.llama_cpp
    if gguf and not Path(gguf).is_file():
        raise ValueError(f"--llama_cpp {gguf}: no such GGUF file")
    if gguf and importlib.util.find_spec("llama_cpp") is None:
        raise ValueError("--llama_cpp needs llama-cpp-python (pip install llama-cpp-python: a benchmark "
                         "tool, not a dependency; it builds llama.cpp, about 15 minutes on 2 cores)")
    tree = (args.tree or ["tree16"])[0]
    rows = quantized_speed(args.dirs, args.checkpoint, args.heads, args.lookup, tree, args.max_new_tokens,
                           args.runs, gguf=gguf)
    print(f"\ncompiled decoding, bf16 activations, the story prompt, {args.max_new_tokens} new tokens, "
          f"median of {args.runs} interleaved runs, {where('cpu')}")
    print(f"| engine | tok/s | tau | vs {rows[0][0]} |\n|---|---|---|---|")
    for name, rate, tau, vs in rows:
        print(f"| {name} | {rate:.1f} | {tau:.2f} | {vs:.2f}x |")
    print("command: python " + " ".join(sys.argv))


MODES = {"speed": run_speed, "spec_bench": run_spec_bench, "rows": run_rows, "acceptance": run_acceptance,
         "quality": run_quality, "quantized": run_quantized}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    base = argparse.ArgumentParser(add_help=False)
    base.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    base.add_argument("--device", default="cpu", help="cpu or cuda (compiled steps then run as CUDA graphs)")
    base.add_argument("--checkpoint", default=None, help="base model (default: the embedded SmolLM2-135M-Instruct)")
    base.add_argument("--max_new_tokens", type=int, default=128)
    base.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON (for plots.py)")
    drafting = argparse.ArgumentParser(add_help=False, parents=[base])
    drafting.add_argument("--heads", default=None)
    drafting.add_argument("--tree", nargs="+", default=None, help="static tree(s), each timed in the same run "
                          "(default tree16, none with --dynamic_tree)")
    drafting.add_argument("--lookup", type=int, default=0, help="add a prompt-lookup branch (N-gram) to the head's tree")
    drafting.add_argument("--dynamic_tree", default=None, help="top_k,depth,total_tokens: an EAGLE-2 dynamic tree "
                          "(beside any --tree)")
    drafting.add_argument("--compile_mode", default=None,
                          help="default: max-autotune-no-cudagraphs on CPU, reduce-overhead (CUDA graphs) on CUDA")
    drafting.add_argument("--runs", type=int, default=5)
    modes = p.add_subparsers(dest="mode", required=True, metavar="MODE")
    m = modes.add_parser("speed", parents=[drafting], help=run_speed.__doc__.split("\n")[0])
    m.add_argument("--skip_hf", action="store_true")
    m.add_argument("--skip_eager", action="store_true")
    m.add_argument("--profile", default=None, metavar="FILE", help="also profile each engine once (torch.profiler, "
                   "ops by self time and input shapes) into FILE")
    m = modes.add_parser("spec_bench", parents=[drafting], help=run_spec_bench.__doc__.split("\n")[0])
    m.add_argument("per_category", type=int, metavar="N", help="questions of each category")
    m.add_argument("--questions", default=str(SPEC_BENCH), help="the questions (JSONL, turns)")
    m.add_argument("--max_prompt", type=int, default=1024, help="skip longer prompts")
    m.add_argument("--compile", action="store_true", help="compile the step (faster, same tau)")
    m.add_argument("--speed", action="store_true", help="also decode each question autoregressively; time both "
                   "and compare their outputs")
    m.add_argument("--ties", action="store_true", help="(implies --speed) where an output differs from the "
                   "autoregressive one, compare the two tokens' logits in an fp32 forward")
    modes.add_parser("rows", parents=[drafting], help="the cost of a compiled base forward over N = 1..64 tree "
                     "rows on a 512-token prefix (ratios to N = 1), and of --heads' draft levels")
    m = modes.add_parser("acceptance", parents=[drafting], help="measure --heads' acceptance in the real step "
                         "(greedy, a 64-node tree and any --lookup chain) on PROMPTS (JSONL, not Spec-Bench) and keep "
                         "it in the heads' acceptance.json, where --tree auto reads it")
    m.add_argument("prompts", metavar="PROMPTS")
    m.add_argument("--max_prompt", type=int, default=1024, help="skip longer prompts")
    m = modes.add_parser("quality", parents=[base], help="quality of quantized checkpoints against the float model "
                         "(--checkpoint): KL, top-1 agreement and perplexity on held-out answers")
    m.add_argument("dirs", nargs="+", metavar="DIR")
    m.add_argument("--data", default="data/selfdistill.npz", help="sequences; the last 134 are held out")
    m.add_argument("--n", type=int, default=24, help="held-out sequences to score")
    m = modes.add_parser("quantized", parents=[drafting], help="compiled decode speed of quantized checkpoints "
                         "beside the float model's (--checkpoint), side by side in one run")
    m.add_argument("dirs", nargs="+", metavar="DIR")
    m.add_argument("--llama_cpp", nargs="?", const="default", default=None, metavar="GGUF",
                   help="also llama.cpp on this GGUF (default: the embedded model's), through "
                        "llama-cpp-python, which the benchmark needs and the engine never imports")
    args = p.parse_args(argv)
    try:
        args.device = G.check_device(args.device)
        MODES[args.mode](args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
