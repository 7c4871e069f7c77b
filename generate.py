"""Generate text with a Llama-family model: prefill, then one decode loop that every step plugs into
(autoregressive now; the speculative tree step returns several tokens a step through the same interface).

    python generate.py --prompt "What is the capital of France?"            # embedded SmolLM2-135M-Instruct
    python generate.py --compile --dtype bfloat16 --prompt "..."            # compiled decode step
    python generate.py --interactive                                        # chat
"""
import argparse
import platform
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
from torch._inductor import list_mode_options

import checkpoint as ckpt
import cpu_kernels
from checkpoint import load_model
from heads import NGram, WithLookup, draft_dynamic, draft_static, load_heads, plan_to, static_plan
from trees import argmax, emitted_tokens, greedy_accept, load_tree, logits_to_probs, sample, sample_accept, typical_accept


def sample_token(logits, temperature: float, top_k: int, top_p: float):
    # logits: [V] -> long scalar
    if temperature == 0:
        return argmax(logits)
    return sample(logits_to_probs(logits, temperature, top_k, top_p))


def prefill(model, prompt, temperature=0.0, top_k=0, top_p=1.0):
    """prompt: [T] long. Fills cache slots [0, T); returns the first new token and the hidden
    states after the final norm [T, dim], which draft heads read."""
    logits, _, h = model(prompt[None], torch.arange(len(prompt), device=prompt.device), return_hidden=True)
    return sample_token(logits[0, -1], temperature, top_k, top_p), h[0]


def ar_step(model, token, pos, temperature: float = 0.0, top_k: int = 0, top_p: float = 1.0, span=None):
    """One autoregressive step. token: long scalar, not yet in the cache; pos: long scalar, its slot;
    span: the cache slots [L] to attend (live_span; default all). Returns (tokens [1], count, state)
    like a speculative step; state = (next token, next pos)."""
    mask = None if span is None else span[None, :] <= pos
    logits = model(token.view(1, 1), pos.view(1), mask)
    nxt = sample_token(logits[0, -1], temperature, top_k, top_p)
    return nxt.view(1), torch.ones_like(pos), (nxt, pos + 1)


def spec_step(model, draft, accept, h, next_tokens, n, P, span=None):
    """One tree speculative step: draft a tree, verify it in one base forward with the tree mask,
    accept the longest path, move its KV entries to the contiguous slots after the prefix.
    State: h [D+1, dim] base hidden states of the last accepted path, at positions P-n .. P-1;
    next_tokens [D+1] the token after each of them (next_tokens[n-1] is the root, not yet in the
    cache); n the path's length; P the cache length. span: the cache slots [L] verification attends
    (live_span; default all). Returns (tokens [D+1], count, state)."""
    draft_tokens, tree = draft(h, next_tokens, n, P, None if span is None else span.shape[0])  # [N]
    N, D = draft_tokens.shape[0], tree.depth
    slots = P + torch.arange(N, device=P.device)
    prefix = (torch.arange(model.max_seq_len, device=P.device) if span is None else span)[None, :] < P  # [1, L]
    logits, _, hidden = model(draft_tokens[None], P + tree.positions, prefix, cache_pos=slots, return_hidden=True,
                              tree_mask=tree.tree_mask)
    accept_length, path, next_token = accept(logits[0], draft_tokens, tree)
    path_slots = P + path                                         # [D+1]
    model.compact(path_slots, P + torch.arange(D + 1, device=P.device))
    tokens, count = emitted_tokens(draft_tokens, accept_length, path, next_token)
    return tokens, count, (hidden[0, path], tokens, count, P + count)


def decode(step, state, first_token: int, max_new_tokens: int, eos_id=None, on_tokens=None, span=None):
    """The decode loop every step plugs into. `step(*state) -> (tokens [K], count, state)` emits
    tokens[:count]; reading them is the loop's one host sync a step. Returns the new tokens,
    starting with the prefill's first_token, stopping at eos or max_new_tokens.
    span: (live_span(...), the cache length after prefill): the loop, which counts the tokens, then
    calls step(*state, slots) with the cache slots the step has to attend."""
    out = [first_token]
    decode.steps = 0
    if on_tokens:
        on_tokens(out)
    span, length = span or (None, 0)
    while len(out) < max_new_tokens and out[-1] != eos_id:
        tokens, count, state = step(*state) if span is None else step(*state, span(length))
        count, *tokens = torch.cat([count.view(1), tokens]).tolist()  # the one host sync
        length += count
        new = tokens[:count]
        decode.steps += 1
        if eos_id in new:
            new = new[: new.index(eos_id) + 1]
        new = new[: max_new_tokens - len(out)]
        out += new
        if on_tokens:
            on_tokens(new)
    return out


def live_span(model, rows: int, block: int = 64):
    """span(P) -> the cache slots [0, L) that a step writing `rows` slots after a P-token cache has to
    attend: L = P + rows rounded up to `block`. Attention then costs what the live prefix costs, not
    the static cache (on a CPU, 30 layers over 1,536 slots took 7 ms a token against 1.7 ms over 256).
    L is marked dynamic: one compiled graph serves every length. None on CUDA, where a CUDA graph is
    recorded per shape and attention is cheap."""
    if model.output.weight.device.type == "cuda":
        return None
    slots = torch.arange(model.max_seq_len, device=model.output.weight.device)

    def span(P: int):
        s = slots[:min(model.max_seq_len, -(-(P + rows) // block) * block)]
        torch._dynamo.maybe_mark_dynamic(s, 0)
        return s
    return span


def speculator(model, head, tree="tree16", dynamic=None, acceptance="greedy", temperature=0.0, top_k=0,
                top_p=1.0, posterior_threshold=0.09, posterior_alpha=0.3):
    """The draft and accept functions of a speculative step, fixed once.
    tree: a tree name, JSON file or list of index paths (static); dynamic: (top_k, depth, total_tokens) for EAGLE-2 trees.
    A WithLookup head adds its prompt-lookup chain to either (as deep as the tree, or as a static
    tree's path [-1, 0, ...] says).
    Returns (draft, accept, depth, tree_nodes, head_scratch): the last two size the caches."""
    device = model.output.weight.device
    lookup = isinstance(head, WithLookup)
    if dynamic:
        k, depth, total = dynamic
        pool = k + (depth - 1) * k * k
        if not (k >= 1 and depth >= 1 and 2 <= total <= pool + 1):
            raise ValueError(f"dynamic tree needs --top_k >= 1, --depth >= 1 and 2 <= --total_tokens <= "
                             f"{pool + 1} (top_k + (depth-1) * top_k^2 + 1)")
        nodes, scratch, levels = total + (depth if lookup else 0), pool + 1, depth
        draft = lambda h, t, n, P, L=None: draft_dynamic(head, model, h, t, n, P, k, depth, total, L)
    else:
        plan = plan_to(static_plan(tree if isinstance(tree, list) else load_tree(tree), lookup), device)
        depth, nodes, levels = plan.tree.depth, plan.tree.num_nodes, len(plan.topk) - 1
        scratch = nodes
        draft = lambda h, t, n, P, L=None: draft_static(head, model, plan, h, t, n, P, L)
    inner = head.head if lookup else head
    if getattr(inner, "num_heads", levels) < levels:
        raise ValueError(f"the tree is {levels} deep but the head has only {inner.num_heads} heads: use a shallower tree")
    if acceptance == "greedy" or temperature == 0:
        accept = lambda logits, d, tr: greedy_accept(logits, d, tr.retrieve_indices)
    elif acceptance == "typical":
        accept = lambda logits, d, tr: typical_accept(logits, d, tr.retrieve_indices, temperature,
                                                      posterior_threshold, posterior_alpha)
    elif acceptance == "sample":
        accept = lambda logits, d, tr: sample_accept(logits, d, tr, temperature, top_k, top_p)
    else:
        raise ValueError(f"unknown acceptance '{acceptance}': use greedy, typical or sample")
    return draft, accept, depth, nodes, depth + 1 + scratch


def resolve_tree(model, head, heads_dir, tree, device: str, compile_mode=None, checkpoint=None):
    """--tree as the speculator takes it: `auto` becomes the tree costs.auto_tree chooses (a list of index
    paths), or None where plain decoding is predicted fastest; a head with no measured acceptance
    gets tree16 (the n-gram drafter chain4). Prints what was chosen and the predicted speed-up
    (kept in resolve_tree.choice)."""
    if tree != "auto":
        return tree
    folder = Path(str(heads_dir))
    import costs  # (it times this module's steps)
    choice = resolve_tree.choice = costs.auto_tree(model, head, folder, device, compile_mode, checkpoint)
    if choice is None and isinstance(head, NGram):  # one branch: a chain
        print("--tree auto: no measured acceptance of the n-gram drafter for this base model, so chain4",
              file=sys.stderr)
        return "chain4"
    if choice is None:
        print(f"--tree auto: {folder} has no acceptance.json (train.py writes it), so tree16", file=sys.stderr)
        return "tree16"
    if choice["paths"] is None:
        timed = [c for c in choice["candidates"] if "overhead" in c]  # (near trees timed whole: at their steps)
        best = max(timed or choice["candidates"], key=lambda c: c["speedup"], default=None)
        near = f" (the best tree, {best['nodes']} nodes, {best['speedup']:.2f}x)" if best else ""
        print(f"--tree auto: plain autoregressive decoding is predicted fastest here{near}", file=sys.stderr)
        return None
    chain = f", a lookup chain {choice['chain']} deep" if choice.get("chain") else ""
    near = f" (of {len(choice['timed'])} near-equal trees timed whole)" if choice.get("timed") else ""
    print(f"--tree auto: {sum(p[0] >= 0 for p in choice['paths'])} paths, {choice['nodes']} verified nodes, "
          f"{choice['depth']} deep{chain}; "
          f"expected tau {choice['tau']:.2f}, predicted {choice['speedup']:.2f}x over autoregressive decoding{near}",
          file=sys.stderr)
    return choice["paths"]


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


# On a CPU every cache is at least SLOTS long (the model's context allowing): the length that --tree auto's
# timings use (costs.step_costs), so that generation's compiled steps are the graphs those timings compiled
# and inductor's cache hands them over. A step there attends only the live span (live_span): the slots
# beyond cost memory (17 MB for SmolLM2), not time.
SLOTS = 768


def setup_caches(model, head, max_seq_len: int, head_scratch: int = 0):
    if model.output.weight.device.type == "cpu":
        max_seq_len = max(max_seq_len, min(SLOTS, model.args.max_seq_len))
    model.setup_caches(1, max_seq_len)
    if head is not None:  # rounded up: trees of near sizes share one shape, and so the graphs that auto timed
        head.setup_caches(-(-(max_seq_len + head_scratch) // 64) * 64)  # (on a CPU a step attends its live span)


def start(model, head, prompt, depth: int, sampling: dict):
    """Prefill, then the first state of the decode loop: (first token, state)."""
    token, h = prefill(model, prompt, **sampling)
    T = len(prompt)
    if head is None:
        return int(token), (token, torch.tensor(T, device=prompt.device))
    head.prefill(model, h, torch.cat([prompt[1:], token.view(1)]))
    hs = h.new_zeros(depth + 1, h.shape[1])
    hs[0] = h[-1]
    nt = prompt.new_zeros(depth + 1)
    nt[0] = token
    one = torch.tensor(1, device=prompt.device)
    return int(token), (hs, nt, one, torch.tensor(T, device=prompt.device))


def lean_guards(guards):
    """Before each call Dynamo checks ~4,000 guards on the model (0.7 ms of a 15 ms step on a 2-core
    CPU): that each module keeps its class, hooks, attributes and weights, none of which changes after
    compiling (and frozen weights are constants of the compiled code). Kept: the guards on the step's
    inputs and on the modules' buffers (KV caches and RoPE tables, re-allocated for longer prompts),
    but not on the kernels' packed weights (packed once by cpu_kernels.install: 151 guards, which
    cost 0.3-0.4 ms of a 12 ms token step on a 2-core Xeon with AMX)."""
    return [not g.orig_guard.source.is_unspecialized_nn_module()
            or (isinstance(g.value, torch.Tensor) and not isinstance(g.value, nn.Parameter)
                and not g.name.endswith("._buffers['packed']")) for g in guards]


def compile_step(fn, device: str, mode=None, gemm=None):
    """fullgraph, static shapes. CUDA: CUDA graphs (reduce-overhead). CPU: max-autotune with
    freezing: weights become constants that the CPU GEMM kernels pre-pack (AMX / AVX-512 micro-kernels
    for bf16 when max-autotune picks them). gemm: the GEMM backends max-autotune chooses among (GEMMS).
    Sizes the caller marks (torch._dynamo.maybe_mark_dynamic) stay symbolic: the live span, the rows
    that costs times."""
    if mode is None:
        mode = "reduce-overhead" if device.startswith("cuda") else "max-autotune-no-cudagraphs"
    if not device.startswith("cuda"):
        import torch._inductor.config as inductor  # (`import torch._inductor...` here would make torch a local)
        # a global switch: inductor reads it outside the `options` of one compile
        inductor.freezing = True
    options = list_mode_options(mode)
    if not device.startswith("cuda"):
        options["guard_filter_fn"] = lean_guards
        # the kernels called from C++, not Python: profiled on a 2-core Zen 5, the Python wrapper took 1.2 ms
        # of a 10 ms token step (2.5 of a tree step's 22); side by side, Spec-Bench: AR 1.04x, a tree 1.075x faster
        options["cpp_wrapper"] = True
        # inductor tries to fuse each node with the next 64 that read a buffer it reads; the step's inputs are
        # read by every layer, so its fusion pass tried 47,000 pairs: 38 of an AR step's 115 s of compiling
        # on a 2-core Zen 3, 60 of a tree step's 133. 8 gave the same code for both, line for line, in 8 and 14 s
        options["max_fusion_buffer_group_pairwise_attempts"] = 8
        if gemm and "max-autotune" in mode:
            options["max_autotune_gemm_backends"] = gemm
    step = torch.compile(fn, options=options, fullgraph=True, dynamic=False)
    if mode != "reduce-overhead":
        return step
    # A CUDA graph's outputs live in its memory pool and its next replay overwrites them; the decode
    # loop feeds them back as the next step's inputs, so copy them out first (as gpt-fast does)
    def clone(x):
        return tuple(map(clone, x)) if isinstance(x, tuple) else x.clone()
    return lambda *args: clone(step(*args))


GEMMS = ("CPP,ATEN", "ATEN")  # inductor's C++ GEMM template or oneDNN, by timing; oneDNN alone


def compiler(model, device: str, mode=None, checkpoint=None):
    """compile_step for this model's steps, with the GEMM backends that make its one-token step
    fastest here (.gemm). On a CPU max-autotune picks each GEMM's kernel by timing it over and over
    on the same weights, hot in the caches, while a decode step streams them from memory: on an AMD
    Zen 5 it picked the C++ template, which then streamed 13 GB/s in the step against oneDNN's 26
    (a token 20 ms against 13), and on a Zen 3 the template was the faster one. So the one-row
    forward is timed with each of GEMMS once per machine and model (cached, like --tree auto's
    costs), and every step compiled here gets the faster. Where our kernels do every projection
    (cpu_kernels.torch_gemms) there is nothing to choose: .gemm None (on AVX2 it had timed two
    compiles of the same graph, 3 minutes)."""
    gemm = None
    if device == "cpu" and "max-autotune" in (mode or "max-autotune") and cpu_kernels.torch_gemms(model):
        import costs  # (it times this module's steps)

        def measure(idx):
            return {i: costs.step_costs(model, None, lambda f, g=GEMMS[i]: compile_step(f, device, mode, g),
                                        rows=(1,))[0][1] for i in idx}
        t = costs.cached_costs({**costs.cost_key(model, device, mode, checkpoint), "part": "gemm", "gemms": GEMMS},
                               range(len(GEMMS)), measure, ckpt.CACHE_DIR)
        gemm = GEMMS[min(range(len(GEMMS)), key=t.get)]

    def compiled(fn):
        return compile_step(fn, device, mode, gemm)
    compiled.gemm = gemm
    return compiled


class Streamer:
    """Prints text as tokens arrive, holding back bytes of a character that is not complete yet."""

    def __init__(self, tokenizer, file=sys.stdout):
        self.tokenizer, self.file, self.ids, self.printed = tokenizer, file, [], 0

    def __call__(self, new):
        self.ids += [t for t in new if t != self.tokenizer.eos_id]
        text = self.tokenizer.decode(self.ids)
        if not text.endswith("\ufffd"):
            self.file.write(text[self.printed:])
            self.file.flush()
            self.printed = len(text)


def check_device(device: str) -> str:
    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise ValueError(f"unknown device '{device}': use cpu, cuda or cuda:N") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device '{device}' is not available on this machine: use --device cpu")
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"device '{device}' is not supported: use cpu, cuda or cuda:N")
    return device


def cache_size(prompt_len: int, max_new_tokens: int, margin: int, context: int) -> int:
    """Static cache length: room for the prompt, the new tokens and one step's scratch slots,
    rounded up so that nearby prompts share one compiled graph."""
    if max_new_tokens < 1:
        raise ValueError(f"--max_new_tokens must be at least 1, got {max_new_tokens}")
    need = prompt_len + max_new_tokens + margin
    if prompt_len + margin >= context:
        raise ValueError(f"the prompt has {prompt_len} tokens, more than the model's context of {context} "
                         "allows: shorten the prompt")
    if need > context:
        raise ValueError(f"the prompt ({prompt_len} tokens) plus --max_new_tokens {max_new_tokens} exceeds the "
                         f"model's context of {context}: lower --max_new_tokens to at most "
                         f"{context - prompt_len - margin}")
    return min(context, -(-need // 256) * 256)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", default="What is the capital of France?")
    p.add_argument("--checkpoint", default=None, help="model folder (ours or Hugging Face), .gguf file or hub id; "
                                                       "default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--no_chat", action="store_true", help="feed the prompt as raw text, without the chat template")
    p.add_argument("--interactive", action="store_true", help="chat in the terminal")
    p.add_argument("--max_new_tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top_k", type=int, default=0, help="sampling: keep the k most likely tokens (0: all); "
                                                         "with --dynamic_tree: children per frontier node")
    p.add_argument("--top_p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--compile", action="store_true", help="compile the decode step (fullgraph, static shapes)")
    p.add_argument("--compile_mode", default=None, help="torch.compile mode (default: max-autotune-no-cudagraphs "
                                                        "on CPU, reduce-overhead (CUDA graphs) on CUDA)")
    s = p.add_argument_group("speculative decoding")
    s.add_argument("--heads", default=None, help="draft heads: a Medusa, Hydra or EAGLE folder or hub id")
    s.add_argument("--head_type", choices=["medusa", "hydra", "eagle"], default=None, help="default: from the checkpoint")
    s.add_argument("--tree", default="auto", help="static tree: a name (mc_sim_7b_63, tree16, chain4...), a JSON file "
                   "of index paths (with --lookup, a path [-1, 0, ..., 0] sets the lookup chain's depth), "
                   "or auto: the fastest tree here (or plain decoding) from the head's measured "
                   "acceptance and this machine's step costs, timed once and cached")
    s.add_argument("--dynamic_tree", action="store_true", help="EAGLE-2 dynamic tree (--top_k, --depth, --total_tokens)")
    s.add_argument("--lookup", type=int, default=0, metavar="N", help="add a prompt-lookup branch (matching up to "
                   "N tokens of the context, 3 is good) to the head's tree, static or dynamic")
    s.add_argument("--depth", type=int, default=4)
    s.add_argument("--total_tokens", type=int, default=16)
    s.add_argument("--acceptance", default="greedy", choices=["greedy", "typical", "sample"],
                   help="greedy (exact), sample (lossless speculative sampling) or typical (Medusa's, lossy)")
    s.add_argument("--posterior_threshold", type=float, default=0.09)
    s.add_argument("--posterior_alpha", type=float, default=0.3)
    s.add_argument("--compare", action="store_true", help="also decode autoregressively and print both speeds")
    args = p.parse_args(argv)
    try:
        run(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except (KeyboardInterrupt, EOFError):
        print()


def run(args):
    device = check_device(args.device)
    if args.temperature < 0 or not 0 < args.top_p <= 1 or args.top_k < 0:
        raise ValueError("need --temperature >= 0, 0 < --top_p <= 1 and --top_k >= 0")
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    model, tokenizer = load_model(args.checkpoint, device, getattr(torch, args.dtype))
    if args.lookup and not args.heads:
        raise ValueError("--lookup adds a branch to a head's tree: give --heads too (or --heads ngram alone)")
    head = load_heads(args.heads, model, args.head_type, args.lookup).to(device) if args.heads else None
    print(f"loaded in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    sampling = dict(temperature=args.temperature, top_k=0 if args.dynamic_tree else args.top_k, top_p=args.top_p)
    ar = lambda token, pos, span=None: ar_step(model, token, pos, **sampling, span=span)
    depth, nodes, scratch, step = 0, 1, 0, ar
    tree = args.tree
    if head is not None and not args.dynamic_tree:
        tree = resolve_tree(model, head, args.heads, tree, device,
                            (args.compile_mode or "default") if args.compile else None, args.checkpoint)
        if tree is None:
            head = None
    if head is not None:
        draft, accept, depth, nodes, scratch = speculator(
            model, head, tree, (args.top_k or 8, args.depth, args.total_tokens) if args.dynamic_tree else None,
            args.acceptance, args.temperature, sampling["top_k"], args.top_p, args.posterior_threshold, args.posterior_alpha)
        step = lambda h, t, n, P, span=None: spec_step(model, draft, accept, h, t, n, P, span)
    if args.compile:
        compiled = compiler(model, device, args.compile_mode, args.checkpoint)
        step, ar = compiled(step), compiled(ar)

    messages, cache_len = [], 0
    while True:
        user = input("> ") if args.interactive else args.prompt
        messages.append({"role": "user", "content": user})
        text = user if args.no_chat else tokenizer.chat(messages)
        ids = tokenizer.encode(text, bos=None if args.no_chat else False)
        prompt = torch.tensor(ids, device=device)
        need = cache_size(len(ids), args.max_new_tokens, nodes, model.args.max_seq_len)
        if cache_len < need:  # (auto's timing left caches of its own size)
            setup_caches(model, head, need, scratch)
            cache_len = model.max_seq_len
            span, ar_span = live_span(model, nodes), live_span(model, 1)
            if args.compile:  # compile now, not inside the timed decode (the next prefill overwrites the cache)
                t0 = time.perf_counter()
                with torch.inference_mode():
                    decode(step, start(model, head, prompt, depth, sampling)[1], 0, 2, span=(span, len(ids)))
                    if args.compare and head is not None:
                        decode(ar, start(model, None, prompt, 0, sampling)[1], 0, 2, span=(ar_span, len(ids)))
                print(f"compiled in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        with torch.inference_mode():
            t0 = time.perf_counter()
            first, state = start(model, head, prompt, depth, sampling)
            ttft = time.perf_counter() - t0
            t1 = time.perf_counter()
            out = decode(step, state, first, args.max_new_tokens, tokenizer.eos_id, Streamer(tokenizer), (span, len(ids)))
            dt = time.perf_counter() - t1
            steps = decode.steps
        print(file=sys.stdout)
        rate = (len(out) - 1) / max(dt, 1e-9)
        print(f"time to first token {ttft * 1000:.0f} ms; {len(out) - 1} tokens in {dt:.2f} s: {rate:.1f} tok/s",
              file=sys.stderr)
        if head is not None:
            print(f"tau (mean tokens per step, with the bonus token) {(len(out) - 1) / max(steps, 1):.2f} "
                  f"over {steps} steps", file=sys.stderr)
        if args.compare and head is not None:
            with torch.inference_mode():
                first, state = start(model, None, prompt, 0, sampling)
                t1 = time.perf_counter()
                ref = decode(ar, state, first, args.max_new_tokens, tokenizer.eos_id, span=(ar_span, len(ids)))
                dt_ar = time.perf_counter() - t1
            rate_ar = (len(ref) - 1) / max(dt_ar, 1e-9)
            same = ("identical" if ref == out else "different (when sampling; in bfloat16 also where two tokens "
                    "tie within its rounding: float32 gives identical outputs)")
            print(f"autoregressive {rate_ar:.1f} tok/s; speculative {rate:.1f} tok/s = {rate / rate_ar:.2f}x; "
                  f"outputs {same}", file=sys.stderr)
        if not args.interactive:
            return
        reply = out[:-1] if out[-1] == tokenizer.eos_id else out
        messages.append({"role": "assistant", "content": tokenizer.decode(reply)})


if __name__ == "__main__":
    main()
