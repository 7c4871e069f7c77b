"""What a step costs on this machine, measured once and kept: the tables that `--tree auto` weighs
(a base forward over N tree rows, a head's draft levels, the whole steps) and that the compiler's
GEMM choice reads, under the project's cache folder, keyed by machine, model, dtype, head and the
engine's code; and auto_tree, the tree they and the head's measured acceptance choose
(trees.choose_tree). `bench.py rows` prints the same tables."""
import functools
import hashlib
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch
from tqdm import tqdm

import checkpoint as ckpt
import cpu_kernels
import speculate as S
from heads import NGram, draft_static, plan_to, static_plan
from trees import PLAIN, choose_tree, interpolate, split_chain, step_walk

# tree rows and draft depths timed for --tree auto: every size up to 32 rows (the forwards over 2 or more
# rows are one compiled graph with the rows symbolic, so sizes cost only their run time, and no size is
# read between timed ones where a CPU's curve bends), then a line to 64; bench.py rows prints the powers of two
ROWS, DEPTHS = (*range(1, 33), 48, 64), (1, 4)
# trees predicted this close to the best are timed whole, at most this many, in this many turns
NEAR, NEAR_TREES, NEAR_REPS = 0.03, 3, 60
TIE = 0.02  # timed whole, trees this close to the fastest are a tie, which goes to the fewest nodes
ENGINE = ("model.py", "cpu_kernels.py", "cpu_kernels.h", "cpu_kernels.cpp", "cpu_kernels_avx2.cpp", "heads.py",
          "trees.py", "speculate.py", "costs.py", "quantize.py")  # whose code the timings time


def machine(device: str) -> str:
    """The CPU's model name as lscpu prints it, with its family and model numbers (two Xeons of
    different speeds have both called themselves "Intel(R) Xeon(R) Processor"), or the GPU's name:
    speed depends on it."""
    if device.startswith("cuda"):
        return torch.cuda.get_device_name(device)
    try:
        info = dict(line.split(":", 1) for line in Path("/proc/cpuinfo").read_text().split("\n\n")[0].splitlines()
                    if ":" in line)
        info = {k.strip(): v.strip() for k, v in info.items()}
        if "model name" in info:
            ids = f" (family {info['cpu family']} model {info['model']})" if "cpu family" in info else ""
            return info["model name"] + ids
    except OSError:
        pass
    return platform.processor() or platform.machine()


GEMMS = ("CPP,ATEN", "ATEN")  # inductor's C++ GEMM template or oneDNN, by timing; oneDNN alone


def gemm_choice(model, device: str, mode=None, checkpoint=None):
    """The GEMM backends (one of GEMMS) that make this model's one-token step fastest here, for
    speculate.compile_step, or None where there is nothing to choose. On a CPU max-autotune picks each
    GEMM's kernel by timing it over and over on the same weights, hot in the caches, while a decode
    step streams them from memory, so it can pick the slower one for a step (docs/speed.md). So the
    one-row forward is timed with each of GEMMS once per machine and model (cached, like --tree auto's
    costs), and every step compiled here gets the faster. Where our kernels do every projection
    (cpu_kernels.torch_gemms) there is nothing to choose."""
    if not (device == "cpu" and "max-autotune" in (mode or "max-autotune") and cpu_kernels.torch_gemms(model)):
        return None

    prepack = not cpu_kernels.runs_projections(model)

    def measure(idx):
        return {i: step_costs(model, None, lambda f, g=GEMMS[i]: S.compile_step(f, device, mode, g, prepack),
                              rows=(1,))[0][1] for i in idx}
    t = cached_costs({**cost_key(model, device, mode, checkpoint), "part": "gemm", "gemms": GEMMS},
                     range(len(GEMMS)), measure, ckpt.CACHE_DIR)
    return GEMMS[min(range(len(GEMMS)), key=t.get)]


def compiler(model, device: str, mode=None, checkpoint=None):
    """speculate.compile_step for this model's steps (fn -> compiled fn), with gemm_choice's GEMM backends
    (and no oneDNN prepacking where our kernels run the projections: the graphs stay in inductor's cache)."""
    return functools.partial(S.compile_step, device=device, mode=mode, gemm=gemm_choice(model, device, mode, checkpoint),
                             prepack=not cpu_kernels.runs_projections(model))


def step_costs(model, head, compiled, rows=ROWS, depths=DEPTHS, prefix=512, reps=20, trees=()):
    """What a speculative step is made of, on this machine: seconds of a base forward over N tree
    rows (a chain: row i sees the prefix and rows 0..i) after a `prefix`-token context, and (head
    given) of the head's draft of a one-node-a-level chain of each depth (its levels one after
    another), each wrapped by `compiled` (compile_step, or `lambda f: f` for eager). trees (static
    trees as index paths, head given): also the whole decode steps as the loop calls them, plain
    (ar_step) and speculative with each tree (spec_step), host sync included. Medians of `reps` calls
    taken in turns, so that drifts hit every shape alike. Returns ({N: s}, {depth: s},
    {"ar": s, "spec": [s for each tree]} or {})."""
    dev = model.output.weight.device
    sync = torch.cuda.synchronize if dev.type == "cuda" else lambda: None
    depths = list(depths) if head is not None else []
    max_depth, max_rows = max(depths, default=0), max(rows, default=1)
    prefix = min(prefix, model.args.max_seq_len // 2)  # (small test models)
    rows = [N for N in rows if prefix + N + 2 * max_depth + 2 <= model.args.max_seq_len]
    gen = torch.Generator().manual_seed(0)
    ctx = torch.randint(model.args.vocab_size // 2, model.args.vocab_size, (prefix,), generator=gen).to(dev)
    specs = [S.speculator(model, head, t) for t in trees]  # each (draft, accept, depth, nodes, head scratch)
    # the caches' lengths are static in a compiled graph: sized alike for every call (the verify table's, the
    # draft levels', the whole steps'), the one-row forward that each of them times is one graph, compiled
    # once in a process; the whole steps' head scratch is generation's, so that generation's steps are these
    # graphs (S.SLOTS; a few trees timed together share the head cache's length as setup_caches rounds it)
    max_depth = max(max_depth, *DEPTHS, *(s.depth for s in specs))
    max_rows = max(max_rows, *ROWS, *(s.nodes for s in specs))
    scratch = max([max_rows + 2 * max_depth + 2 if depths else 0] + [s.scratch for s in specs])
    S.setup_caches(model, head, min(prefix + max_rows + max_depth + 1, model.args.max_seq_len), scratch)
    P = torch.tensor(prefix, device=dev)

    def verify(tokens, P):  # tokens [N], as spec_step calls the model
        N = tokens.shape[0]
        chain = torch.ones(N, N, dtype=torch.bool, device=dev).tril()
        slots = torch.arange(N, device=dev)
        prefix = torch.arange(model.max_seq_len, device=dev)[None, :] < P
        return model(tokens[None], P + slots, prefix, cache_pos=P + slots, tree_mask=chain)
    # one row compiles static, as gemm_choice timed it; 2 or more rows share one graph, the rows symbolic:
    # one compile in all, not one for each size, at the speed of static graphs (docs/speed.md)
    verify = compiled(verify)
    calls = {}
    # dynamo's limit of 8 graphs a code object: the gemm choice's graphs, each compiler's static and
    # symbolic ones (and the AMX kernels' row ranges) share verify's code
    with torch.inference_mode(), torch._dynamo.config.patch(recompile_limit=64):
        model(ctx[None], torch.arange(prefix, device=dev))  # fill the prefix's cache slots
        for N in rows:
            tokens = ctx[:N].clone()
            if N > 1:
                torch._dynamo.maybe_mark_dynamic(tokens, 0)  # (a kernel's row range may pin a size)
            calls[("verify", N)] = lambda tokens=tokens: verify(tokens, P)
        if depths:
            lookup = head.lookup > 0
            draft = compiled(lambda plan, h, t, n, P: draft_static(head, model, plan, h, t, n, P))
            for d in depths:
                plan = plan_to(static_plan([[0] * (i + 1) for i in range(d)], lookup), dev)
                _, state = S.start(model, head, ctx, d, dict(temperature=0.0))
                calls[("draft", d)] = lambda plan=plan, state=state: draft(plan, *state)
        if specs:
            ar = compiled(lambda token, pos, span: S.ar_step(model, token, pos, span=span))  # (generation's names: one graph)
            span = S.live_span(model, 1) or (lambda P: None)
            host = lambda out: torch.cat([out[1].view(1), out[0]]).tolist()  # the loop's one host sync
            calls[("step", "ar")] = lambda: host(ar(ctx[-1], P, span(prefix)))
        for i, (draft_fn, accept, d, nodes, _) in enumerate(specs):
            sp = compiled(lambda h, t, n, P, span, draft_fn=draft_fn, accept=accept:
                          S.spec_step(model, draft_fn, accept, h, t, n, P, span))
            _, state = S.start(model, head, ctx, d, dict(temperature=0.0))
            tree_span = S.live_span(model, nodes) or (lambda P: None)
            calls[("step", i)] = lambda sp=sp, state=state, tree_span=tree_span: host(sp(*state, tree_span(prefix)))
        for fn in tqdm(calls.values(), desc="timing the step's parts (once per machine and model)", unit="shape",
                       file=sys.stderr):
            fn(), fn()  # compile (and autotune) outside the timing
        times = {k: [] for k in calls}
        for _ in range(reps):
            for k, fn in calls.items():
                sync()
                t0 = time.perf_counter()
                fn()
                sync()
                times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    return ({N: med[("verify", N)] for N in rows},
            {d: med[("draft", d)] for d in depths if ("draft", d) in med},
            {"ar": med[("step", "ar")], "spec": [med[("step", i)] for i in range(len(specs))]} if specs else {})


def cache_file(key: dict, folder: Path, kind: str) -> Path:
    return Path(folder) / f"{kind}-{hashlib.sha1(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]}.json"


def cached_costs(key: dict, wanted, measure, folder: Path) -> dict:
    """{n: seconds} (tree rows or draft depths) for the step part that key names (machine, model,
    dtype, head, mode...), kept in folder as JSON: measure(wanted) runs where the cache of this key
    lacks one of `wanted` (all of `wanted` again, so that the sizes a caller compares come from one
    run: this host's speed drifts by 10-30% over minutes), else nothing. Returns every cached n."""
    key = json.loads(json.dumps(key))  # as it reads back (tuples become lists)
    path = cache_file(key, folder, "step-costs")
    costs = {}
    if path.is_file():
        rec = json.loads(path.read_text())
        if rec.get("key") == key:
            costs = {int(n): t for n, t in rec["costs"].items()}
    if any(n not in costs for n in wanted):
        costs.update(measure(list(wanted)))
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_text(json.dumps(dict(key=key, costs=dict(sorted(costs.items()))), indent=1))
        tmp.replace(path)
    return dict(sorted(costs.items()))


def cost_key(model, device: str, compile_mode=None, checkpoint=None, head=None, heads_dir=None) -> dict:
    """What a step part's cost depends on: the machine, the model, its dtype, the mode, the engine's
    code; for the draft also the head (its folder's name and its weights' contents, not where the folder
    lies: the CLI and the benchmark in two checkouts share the tables) and its lookup branch (its n-gram
    length: the choice weighs that lookup's acceptance)."""
    code = hashlib.sha1(b"".join((Path(__file__).parent / f).read_bytes() for f in ENGINE)).hexdigest()[:12]
    key = dict(machine=machine(device), threads=torch.get_num_threads(), torch=torch.__version__, engine=code, device=device,
               dtype=str(model.output.weight.dtype), checkpoint=str(checkpoint or "default"),
               layers=model.args.n_layer, dim=model.args.dim, compiled=compile_mode)
    if head is None:
        return {**key, "part": "verify"}
    folder = Path(str(heads_dir))
    weights = sorted((f.name, hashlib.sha1(f.read_bytes()).hexdigest()) for f in folder.glob("*")
                     if f.suffix in (".safetensors", ".pt", ".bin")) if folder.is_dir() else []
    return {**key, "part": "draft", "heads": folder.name, "weights": weights, "lookup": head.lookup}


def timing_compiler(model, device: str, compile_mode, checkpoint):
    """How the step's timings compile (compile_mode None: eager), and the mode their cache keys name:
    with the GEMM backends gemm_choice chose, which the timings depend on."""
    if not compile_mode:
        return (lambda f: f), compile_mode
    mode = None if compile_mode == "default" else compile_mode
    compiled = compiler(model, device, mode, checkpoint)
    return compiled, f"{compile_mode} {compiled.keywords['gemm']}"


def measured_costs(model, head, heads_dir, device: str, compile_mode=None, checkpoint=None, rows=ROWS,
                   depths=DEPTHS):
    """step_costs on this machine (compiled as compile_mode compiles; None: eager), measured once per
    cost_key and kept under the project's cache folder: verification once for the base model (every
    head shares it), each head's draft levels once for that head. --tree auto and bench.py rows
    share them. Returns ({N: s}, {depth: s}) (no head: {})."""
    compiled, compile_mode = timing_compiler(model, device, compile_mode, checkpoint)
    t_verify = cached_costs(cost_key(model, device, compile_mode, checkpoint), rows,
                            lambda rs: step_costs(model, None, compiled, rows=rs)[0], ckpt.CACHE_DIR)
    if head is None:
        return t_verify, {}

    def draft_costs(ds):  # in the verify table's units: one row timed in the same turns
        one, draft, _ = step_costs(model, head, compiled, rows=(1,), depths=ds)
        return {d: t * t_verify[1] / one[1] for d, t in draft.items()}
    t_draft = cached_costs(cost_key(model, device, compile_mode, checkpoint, head, heads_dir), depths, draft_costs,
                           ckpt.CACHE_DIR)
    return t_verify, t_draft


def step_overhead(model, head, heads_dir, device: str, compile_mode, checkpoint, t_verify, t_draft, trees,
                  reps=20) -> tuple:
    """(o_ar, [o_spec for each tree]): seconds that a whole decode step, plain and with each of the
    static trees, costs beyond what the tables give for its forwards (t_verify's rows, t_draft's
    levels): the loop's host sync, sampling or acceptance, compaction, the one-row step's own attention
    path, and what the tables miss, such as a draft whose weights the base's forward has just pushed out
    of the caches, or a host whose speed has moved since the tables. The steps are timed in turns beside
    one row, to carry them into the tables' units; the tables' own parts are subtracted, so that a tree is
    predicted at its measured step (docs/speed.md). Timed once per set of trees (cached)."""
    compiled, compile_mode = timing_compiler(model, device, compile_mode, checkpoint)

    def measure(_):
        verify, _, step = step_costs(model, head, compiled, rows=(1,), depths=(), reps=reps, trees=trees)
        scale = t_verify[1] / verify[1]
        o = {0: step["ar"] * scale - interpolate(t_verify, 1)}
        for i, (paths, t) in enumerate(zip(trees, step["spec"])):
            depth = max(len(p) for p in split_chain(paths)[0])  # the head's draft levels (a lookup chain drafts none)
            nodes = static_plan(paths, head.lookup > 0).tree.num_nodes
            o[i + 1] = t * scale - interpolate(t_draft, depth) - interpolate(t_verify, nodes)
        return o
    key = {**cost_key(model, device, compile_mode, checkpoint, head, heads_dir), "part": "overhead", "trees": trees}
    o = cached_costs(key, range(len(trees) + 1), measure, ckpt.CACHE_DIR)  # 0: plain decoding's, i: tree i-1's
    return o[0], [o[i + 1] for i in range(len(trees))]


def ngram_acceptance(n: int, checkpoint=None):
    """The n-gram drafter's acceptance, as a head's acceptance.json gives it: it has none of its own,
    but `bench.py acceptance` measured its chain beside each shipped head of the base model
    (heads/*/), on the calibration prompts. The chain's tokens are checked against the base's own
    greedy tokens, so its hits do not depend on the head beside it; the files are pooled. The chain
    is a head of one path: [0] * j right as often as the lookup's first j tokens. None for another
    base model."""
    steps = [s for f in sorted((Path(__file__).parent / "heads").glob("*/acceptance.json"))
             for s in [json.loads(f.read_text()).get("step", {})]
             if s.get("checkpoint") == str(checkpoint or "default") and str(n) in s.get("lookup", {}).get("counts", {})]
    if not steps:
        return None
    hits = [sum(c) for c in zip(*(s["lookup"]["counts"][str(n)] for s in steps))]
    # where the chain was measured at every position: as the walk of a head of one path
    walk = [[((0,) * k, 0) for _, k in prompt] for s in steps for prompt in step_walk(s, n) or ()]
    return dict(roots=sum(s["lookup"]["roots"] for s in steps), paths=[[0] * j for j in range(1, len(hits) + 1)],
                counts=hits, **({"walk": walk} if walk else {}))


def auto_tree(model, head, heads_dir, device: str, compile_mode=None, checkpoint=None):
    """--tree auto: the static tree (or plain decoding) that maximises expected tokens a second
    here (trees.choose_tree), from the head's acceptance and this machine's measured step costs.
    acceptance.json holds the held-out counts train.py measured on its data and, where
    `bench.py acceptance` ran, counts measured in the step on realistic prompts, the lookup chain
    beside the head (its "step"): those are preferred; the n-gram drafter's chain: ngram_acceptance.
    None: no acceptance measured (official checkpoints; the n-gram drafter on another base model)."""
    ngram = isinstance(head, NGram)  # no weights, no acceptance.json: the chain beside the shipped heads
    if ngram:
        acc, heldout = ngram_acceptance(head.n, checkpoint), {}
        stamp = acc and json.dumps(acc).encode()
    else:
        path = Path(heads_dir) / "acceptance.json"
        stamp = path.is_file() and path.read_bytes()
        heldout = json.loads(stamp) if stamp else {}
        acc = heldout.get("step", heldout)
    if not stamp:
        return None
    # the choice is kept too, with the step overhead it was weighed with: a later run names it at once
    key = {**cost_key(model, device, compile_mode, checkpoint, head, heads_dir), "part": "choice",
           "acceptance": hashlib.sha1(stamp).hexdigest()}
    kept = cache_file(key, ckpt.CACHE_DIR, "tree-auto")
    if kept.is_file():
        return json.loads(kept.read_text())
    counts = {tuple(p): c for p, c in zip(acc["paths"], acc["counts"])}
    depth = max((len(p) for p in acc["paths"]), default=1)
    depth = min(depth, head.max_depth or depth)
    t_verify, t_draft = measured_costs(model, head, heads_dir, device, compile_mode, checkpoint,
                                       depths=sorted({1, depth}))
    lookup, hits, both = head.lookup > 0, None, None
    n = lookup and str(head.lookup)
    if lookup and n in acc.get("both", {}):  # measured beside the head: no independence assumed
        both = {tuple(p): c for p, c in zip(acc["paths"], acc["both"][n])}
        hits = [c / acc["lookup"]["roots"] for c in acc["lookup"]["counts"][n]]
    elif lookup and n in heldout.get("lookup", {}).get("counts", {}):
        hits = [c / heldout["lookup"]["roots"] for c in heldout["lookup"]["counts"][n]]

    # measured at every position (with this lookup, if any): each tree's tau walked, not summed
    walk = acc.get("walk") if ngram else step_walk(acc, int(n) if lookup else 0)
    choose = lambda overhead=(0.0, 0.0): choose_tree(counts, acc["roots"], t_verify, t_draft, lookup=lookup,
                                                     lookup_hits=hits, both=both, overhead=overhead, walk=walk)
    choice = choose()
    if choice["paths"] is not None:
        # the chosen tree's whole step, against plain decoding's, for what the forwards leave out; every
        # tree is then weighed with that fixed cost (close for trees of similar size)
        o_ar, (o_spec,) = step_overhead(model, head, heads_dir, device, compile_mode, checkpoint, t_verify, t_draft,
                                        [choice["paths"]])
        choice = {**choose((o_ar, o_spec)), "overhead": [o_ar, o_spec]}
    # predictions within a few percent are a tie that one cost table cannot break: they are weighed at their
    # own whole steps, the best of each size (what the tables can miss is what the rows cost), timed in turns
    # in one run, since timed one run a tree their overheads moved more than the few percent between them
    near = {}
    for c in sorted(choice["candidates"], key=lambda c: -c["speedup"]) if choice["paths"] is not None else ():
        if c["speedup"] >= (1 - NEAR) * choice["speedup"] and len(near) < NEAR_TREES:
            near.setdefault(c["nodes"], c)
    if len(near) > 1:
        o_ar, o_spec = step_overhead(model, head, heads_dir, device, compile_mode, checkpoint, t_verify, t_draft,
                                     [c["paths"] for c in near.values()], reps=NEAR_REPS)
        for c, o in zip(near.values(), o_spec):
            c.update(overhead=[o_ar, o], speedup=c["tau"] * (interpolate(t_verify, 1) + o_ar) / (
                interpolate(t_draft, c["depth"]) + interpolate(t_verify, c["nodes"]) + o))
        top = max(near.values(), key=lambda c: c["speedup"])
        # a tie goes to the smaller tree: where Spec-Bench measured both, the larger's extra rows cost more and
        # its extra tau bought less than the calibration and the 512-token timing said (docs/speed.md)
        tie = [c for c in near.values() if c["speedup"] >= (1 - TIE) * top["speedup"] and c["speedup"] > 1.0]
        choice = {**choice, **(min(tie, key=lambda c: c["nodes"]) if tie else PLAIN), "timed": list(near)}
    kept.parent.mkdir(parents=True, exist_ok=True)
    tmp = kept.with_suffix(f".{os.getpid()}.tmp")
    tmp.write_text(json.dumps(choice))
    tmp.replace(kept)
    return choice
