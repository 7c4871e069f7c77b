"""Side-by-side decode speed on one prompt, in one run: eager vs compiled decoding of our engine,
transformers' `generate` on the same weights, and (with --heads) tree speculative decoding.
Reports decode tokens/s (prefill excluded: time for N tokens minus time for 1) as the median of
--runs runs, and every figure as a ratio to our eager decoding.

    python bench.py --dtype bfloat16                          # base engine vs transformers
    python bench.py --dtype bfloat16 --heads DIR --tree tree16 --skip_hf [--profile prof.txt]   # + where the time goes
    python bench.py --heads DIR --dynamic_tree 10,6,60 --spec_bench 5 --max_new_tokens 256 --compile   # tau
    python bench.py --device cuda --heads DIR --tree mc_sim_7b_63 --spec_bench 5 --max_new_tokens 256 --speed
    python bench.py --rows --heads DIR                        # the cost of N tree rows and of each draft level

--spec_bench N measures tau on the first N questions of each Spec-Bench category; with --speed it also
decodes each question autoregressively (compiled; CUDA graphs on a GPU) and reports both speeds and
whether the outputs are the same; with --ties also how close to a tie (in an fp32 forward) the two
tokens were where the outputs first differ. Several --tree names (speed run) time each tree against
the same autoregressive engine (with --spec_bench, each question's one AR decode). --json FILE writes the results with the date, the machine and the
command; `python plots.py FILE...` draws them into docs/img/.
"""
import argparse
import datetime
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
from checkpoint import default_checkpoint, load_model
from distill import read_prompts
from heads import WithLookup, load_heads, static_plan
from trees import best_paths, load_tree, split_chain, step_counts

SPEC_BENCH = Path(__file__).resolve().parent.parent / "shared" / "data" / "spec_bench.jsonl"  # evaluation only
PROMPT = "Write a short story about a robot who learns to paint. Make it about three paragraphs long."


def write_json(path, kind: str, args, **results):
    """bench.py's results for plots.py: what was run, where, when, and the numbers."""
    record = dict(kind=kind, date=datetime.date.today().isoformat(), machine=G.machine(args.device),
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
        first, state = G.start(model, head, prompt, depth, dict(temperature=0.0))
        run.out = G.decode(step, state, first, k, eos_id=None, span=(G.live_span(model, rows), len(prompt)))
        run.steps = G.decode.steps
    with torch.inference_mode():
        t_n = once(lambda: run(n))
        tau = (len(run.out) - 1) / max(run.steps, 1)
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
            first, state = G.start(model, h, torch.tensor(ids, device=dev), d, dict(temperature=0.0))
            span = G.live_span(model, rows)
            sync()
            t0 = time.perf_counter()
            out = G.decode(step, state, first, n, tok.eos_id, span=(span, len(ids)))
            sync()
            return out, G.decode.steps, time.perf_counter() - t0

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
    lookup = isinstance(head, WithLookup)
    plan = static_plan(paths, lookup)                             # the speculator's node order
    draft, accept, depth, nodes, scratch = G.speculator(model, head, paths)
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
    G.setup_caches(model, head, G.cache_size(max_prompt, n, nodes, model.args.max_seq_len), scratch)
    step = lambda h, t, k, P, span=None: G.spec_step(model, draft, noting, h, t, k, P, span)
    dev = model.output.weight.device
    with torch.inference_mode():
        for ids in tqdm(texts, desc="a big tree at every position", unit="prompt", file=sys.stderr):
            first, state = G.start(model, head, torch.tensor(ids, device=dev), depth, dict(temperature=0.0))
            before = len(observed)
            G.decode(step, state, first, n, tok.eos_id, span=(G.live_span(model, nodes), len(ids)))
            lengths.append(len(observed) - before)
    roots, at = [], 0  # the big tree's own decode: a step takes the deeper of the two, then the token after
    for length in lengths:
        i, end = at, at + length
        while i < end:
            roots.append(observed[i])
            i += 1 + max(len(observed[i][0]), observed[i][1])
        at = end
    counts = step_counts(roots, split_chain(paths)[0], head.ngram.n if lookup else 0)
    index = {tuple(p): i for i, p in enumerate(counts["paths"])}
    walk = dict(lengths=lengths, best=[index[p] if p else -1 for p, _ in observed])
    if lookup:
        walk["lookup"] = {str(head.ngram.n): [k for _, k in observed]}
    return dict(prompts=len(texts), **counts, walk=walk)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    p.add_argument("--device", default="cpu", help="cpu or cuda (compiled steps then run as CUDA graphs)")
    p.add_argument("--checkpoint", default=None, help="base model (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--max_new_tokens", type=int, default=128)
    p.add_argument("--runs", type=int, default=5)
    p.add_argument("--compile_mode", default=None,
                   help="default: max-autotune-no-cudagraphs on CPU, reduce-overhead (CUDA graphs) on CUDA")
    p.add_argument("--skip_hf", action="store_true")
    p.add_argument("--skip_eager", action="store_true")
    p.add_argument("--heads", default=None)
    p.add_argument("--tree", nargs="+", default=None, help="static tree(s), each timed in the same run "
                   "(default tree16, none with --dynamic_tree)")
    p.add_argument("--lookup", type=int, default=0, help="add a prompt-lookup branch (N-gram) to the head's tree")
    p.add_argument("--dynamic_tree", default=None, help="top_k,depth,total_tokens: an EAGLE-2 dynamic tree "
                   "(beside any --tree)")
    p.add_argument("--spec_bench", type=int, default=0, metavar="N",
                   help="instead: tau of --heads on the first N Spec-Bench questions of each category")
    p.add_argument("--questions", default=str(SPEC_BENCH), help="with --spec_bench: the questions (JSONL, turns)")
    p.add_argument("--max_prompt", type=int, default=1024, help="with --spec_bench: skip longer prompts")
    p.add_argument("--compile", action="store_true", help="with --spec_bench: compile the step (faster, same tau)")
    p.add_argument("--speed", action="store_true", help="with --spec_bench: also decode each question "
                   "autoregressively; time both and compare their outputs")
    p.add_argument("--ties", action="store_true", help="with --spec_bench (implies --speed): where an output "
                   "differs from the autoregressive one, compare the two tokens' logits in an fp32 forward")
    p.add_argument("--rows", action="store_true", help="instead: the cost of a compiled base forward over "
                   "N = 1..64 tree rows on a 512-token prefix (ratios to N = 1), and of --heads' draft levels")
    p.add_argument("--acceptance", default=None, metavar="PROMPTS", help="instead: measure --heads' acceptance in "
                   "the real step (greedy, a 64-node tree and any --lookup chain) on PROMPTS (JSONL, not Spec-Bench) "
                   "and keep it in the heads' acceptance.json, where --tree auto reads it")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the results as JSON (for plots.py)")
    p.add_argument("--profile", default=None, metavar="FILE", help="without --spec_bench: also profile each "
                   "engine once (torch.profiler, ops by self time and input shapes) into FILE")
    args = p.parse_args()
    try:
        run(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def run(args):
    device = G.check_device(args.device)
    args.speed = args.speed or args.ties
    if args.ties and not args.spec_bench:
        raise ValueError("--ties judges Spec-Bench outputs: give --spec_bench N")
    if args.profile and args.spec_bench:
        raise ValueError("--profile profiles the story prompt's speed run: drop --spec_bench")
    if args.rows and (args.spec_bench or args.profile):
        raise ValueError("--rows is a benchmark of its own: drop --spec_bench and --profile")
    if args.acceptance and (args.spec_bench or args.rows or args.profile):
        raise ValueError("--acceptance is a measurement of its own: drop --spec_bench, --rows and --profile")
    if args.acceptance and "spec_bench" in Path(args.acceptance).name.lower():
        raise ValueError("--acceptance tunes --tree auto: on Spec-Bench it would tune the trees to the evaluation "
                         "set; give other prompts (data/calibrate.jsonl)")
    if args.acceptance and not args.heads:
        raise ValueError("--acceptance measures draft heads: give --heads")
    if args.acceptance and not Path(args.heads).is_dir():  # before the model loads
        raise ValueError(f"--acceptance keeps its counts in the heads' folder: {args.heads} is not a folder")
    if args.acceptance:
        read_prompts(args.acceptance)  # a bad file fails before the model loads
    if args.spec_bench and not args.heads:
        raise ValueError("--spec_bench measures draft heads: give --heads")
    if args.checkpoint and not (args.skip_hf or args.spec_bench):
        raise ValueError("the transformers peer runs the embedded default model only: add --skip_hf with --checkpoint")
    if args.spec_bench and not Path(args.questions).is_file():
        raise ValueError(f"no questions file {args.questions}: give --questions (Spec-Bench's question.jsonl)")
    dtype = getattr(torch, args.dtype)
    model, tok = load_model(args.checkpoint, device, dtype)
    prompt = torch.tensor(tok.encode(tok.chat([{"role": "user", "content": PROMPT}])), device=device)
    n = args.max_new_tokens
    head = load_heads(args.heads, model, None, args.lookup).to(device) if args.heads else None
    if args.acceptance:
        return measure_acceptance(args, model, tok, head)
    # one speculator per tree: (name, draft, accept, depth, nodes, scratch)
    specs, predicted = [], None
    if head is not None:
        dyn = tuple(int(x) for x in args.dynamic_tree.split(",")) if args.dynamic_tree else None
        # --tree's static trees (tree16 if neither is given), then the dynamic one
        for tree in (args.tree or ([] if dyn else ["tree16"])) + ([f"dynamic {args.dynamic_tree}"] if dyn else []):
            paths = tree
            if tree == "auto":  # what generate.py's --tree auto picks for a compiled step here
                paths = G.resolve_tree(model, head, args.heads, "auto", device, args.compile_mode or "default",
                                       args.checkpoint)
                predicted = G.resolve_tree.choice
                if paths is None:
                    continue  # plain decoding: the compiled AR engine is already in the table
            specs.append((tree, *G.speculator(model, head, paths, dyn if tree.startswith("dynamic") else None)))
        if args.spec_bench and not specs:
            raise ValueError("--tree auto chose plain decoding here: nothing to speculate with; give a tree")
    nodes, scratch = max([s[4] for s in specs], default=1), max([s[5] for s in specs], default=0)
    spec_of = lambda draft, accept: lambda h, t, k, P, span=None: G.spec_step(model, draft, accept, h, t, k, P, span)
    ar = lambda t, pos, span=None: G.ar_step(model, t, pos, span=span)
    # (choosing the GEMM backends times a step once, on caches of its own: before the caches are set up)
    compiled = G.compiler(model, device, args.compile_mode, args.checkpoint) \
        if not args.rows and (args.compile or args.speed or not args.spec_bench) else None
    if args.rows:
        # the same measurement as --tree auto's, read from (and kept in) its cache
        verify, draft = costs.measured_costs(model, head, args.heads or "", device, args.compile_mode or "default",
                                         args.checkpoint, rows=(1, 2, 4, 8, 16, 32, 64), depths=(1, 2, 3, 4))
        where = f"{G.machine(device)}, {torch.get_num_threads()} threads" if device == "cpu" else G.machine(device)
        print(f"\ncompiled base forward over N tree rows after a 512-token prefix, {args.dtype}, {where}, "
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
        return
    if args.spec_bench:
        t0 = time.perf_counter()
        # one cache for every question (what a question leaves in it past its own length is masked),
        # so that compiled steps are compiled once
        G.setup_caches(model, head, G.cache_size(args.max_prompt, n, nodes, model.args.max_seq_len), scratch)
        steps = [(name, spec_of(draft, accept), depth, nodes) for name, draft, accept, depth, nodes, _ in specs]
        if args.compile or args.speed:
            steps, ar = [(name, compiled(step), *rest) for name, step, *rest in steps], compiled(ar)
        ref = None
        if args.ties:  # an fp32 copy of the base judges where the outputs differ
            ref, _ = load_model(args.checkpoint, device, torch.float32)
            ref.setup_caches(1, args.max_prompt + n + 1)
        results = spec_bench(model, tok, head, steps, ar, args.questions, args.spec_bench, n, args.max_prompt,
                             args.speed, ref)
        where = f"{G.machine(device)}, {torch.get_num_threads()} threads" if device == "cpu" else G.machine(device)
        records = []
        for (tree, *_, tree_nodes, _), res in zip(specs, results.values()):
            name = f"{args.heads}{' + lookup' if args.lookup else ''} {tree}"
            if tree == "auto":
                name += f" ({predicted['nodes']} nodes, predicted {predicted['speedup']:.2f}x)"
            print(f"\n{name}, greedy, {n} new tokens, {args.dtype}, {where}")
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
            records.append(dict(tree=tree, nodes=tree_nodes, categories={
                c: {k: v for k, v in r.items() if k != "ties"} for c, r in [*res.items(), ("all", total)]}))
        if args.json:  # the first tree's figures at the top level (what plots.py draws), every tree's in `trees`
            write_json(args.json, "spec_bench", args, **records[0], questions_per_category=args.spec_bench,
                       speed=args.speed, auto_predicted=predicted and {k: v for k, v in predicted.items()
                                                                       if k != "candidates"}, trees=records)
        if ref is not None:
            ties = [(cat, *t) for res in results.values() for cat, r in res.items() for t in r["ties"] if t is not None]
            print(f"\nwhere the {len(ties)} differing outputs first differ, an fp32 forward over the common prefix:")
            print(f"| category | token | fp32 logit, speculative - AR token | {args.dtype} spacing there | "
                  "fp32 argmax |\n|---|---|---|---|---|")
            for cat, i, gap, ulp, top in ties:
                print(f"| {cat} | {i} | {gap:+.3f} | {ulp:.3f} | {top} |")
            close = sum(abs(gap) <= 2 * ulp for _, _, gap, ulp, _ in ties)
            votes = {w: sum(t[-1] == w for t in ties) for w in ("spec", "ar", "other")}
            print(f"within 2 {args.dtype} spacings: {close} of {len(ties)}; the fp32 argmax is the speculative "
                  f"token in {votes['spec']}, the autoregressive one in {votes['ar']}, another in {votes['other']}")
        print(f"({time.perf_counter() - t0:.0f} s) command: python " + " ".join(sys.argv))
        return
    G.setup_caches(model, head, G.cache_size(len(prompt), n, nodes, model.args.max_seq_len), scratch)
    engines = {}  # name -> a function measuring (tokens/s, tau) once
    if not args.skip_eager:
        engines["ours, eager"] = lambda: ours(model, None, ar, prompt, 0, n)
    ar_compiled = compiled(ar)
    engines["ours, compiled"] = lambda: ours(model, None, ar_compiled, prompt, 0, n)
    tree_of = {}  # engine name -> (tree, nodes)
    for tree, draft, accept, depth, nodes, _ in specs:
        name = f"ours, compiled, {type(head).__name__} {tree}"
        engines[name] = (lambda step, d, r: lambda: ours(model, head, step, prompt, d, n, r))(
            compiled(spec_of(draft, accept)), depth, nodes)
        tree_of[name] = (tree, nodes)
    if not args.skip_hf:
        engines["transformers generate"] = hf(dtype, device, prompt, n)
    results = side_by_side(engines, args.runs)
    first, ar_c = next(iter(results.values())), results["ours, compiled"]
    rows = [(name, statistics.median(r for r, _ in res), res[-1][1], ratio(res, first), ratio(res, ar_c))
            for name, res in results.items()]
    threads = f"{torch.get_num_threads()} threads" if device == "cpu" else torch.cuda.get_device_name(device)
    print(f"\n{args.dtype}, {n} new tokens, prompt {len(prompt)} tokens, median of {args.runs} interleaved runs, "
          f"{threads}")
    print(f"| engine | tok/s | ms/token | tau | vs {rows[0][0]} |")
    print("|---|---|---|---|---|")
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
                f.write(f"{name}, one measurement ({n} + 1 tokens)\n{profile_table(measure, device.startswith('cuda'))}\n")
        print(f"profile of each engine: {args.profile}")


def measure_acceptance(args, model, tok, head):
    """--acceptance: step_acceptance on a tree of the head's 64 most frequent held-out paths (Medusa's
    mc_sim_7b_63 without them) and a lookup chain 8 deep (how deep `auto` may then make its chain),
    kept as acceptance.json's "step" beside the held-out counts."""
    path = Path(args.heads) / "acceptance.json"
    acc = json.loads(path.read_text()) if path.is_file() else {}
    inner = head.head if isinstance(head, WithLookup) else head
    limit = getattr(inner, "num_heads", 0)
    paths = best_paths({tuple(p): c for p, c in zip(acc["paths"], acc["counts"])}, 64, limit) if "paths" in acc \
        else [p for p in load_tree("mc_sim_7b_63") if not limit or len(p) <= limit]
    t0 = time.perf_counter()
    chain = [[-1] + [0] * 7] if isinstance(head, WithLookup) else []
    step = step_acceptance(model, tok, head, paths + chain, args.acceptance, args.max_new_tokens, args.max_prompt)
    acc["step"] = dict(source=Path(args.acceptance).name, max_new_tokens=args.max_new_tokens, dtype=args.dtype,
                       checkpoint=args.checkpoint or "default", date=datetime.date.today().isoformat(), **step)
    path.write_text(json.dumps(acc) + "\n")
    R = step["roots"]
    head_rates = ", ".join(f"{p} {c / R:.0%}" for p, c in zip(step["paths"][:6], step["counts"]))
    lookup_rates = "".join(f"; lookup (n={k}) right 1-{len(v)} deep at " + "/".join(f"{c / R:.0%}" for c in v)
                           for k, v in step["lookup"]["counts"].items() if v)
    print(f"{path}: {sum(step['walk']['lengths'])} positions over {step['prompts']} prompts "
          f"({time.perf_counter() - t0:.0f} s); the big tree's own decode took {R} steps, where the accepted "
          f"path starts with {head_rates}{lookup_rates}")


if __name__ == "__main__":
    main()
