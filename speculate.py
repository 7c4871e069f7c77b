"""The decode step and loop: prefill, the autoregressive step, the tree speculative step (draft a tree,
verify it in one base forward with the tree mask, accept the longest path, compact its KV entries),
the loop every step plugs into, and how a step compiles. generate.py runs them from the command line;
costs.py times them.
"""
from typing import Callable, NamedTuple

import torch
import torch.nn as nn
from torch._inductor import list_mode_options

from heads import draft_dynamic, draft_static, plan_to, static_plan
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
    tokens[:count]; reading them is the loop's one host sync a step. Returns (the new tokens, starting
    with the prefill's first_token, stopping at eos or max_new_tokens; the number of steps).
    span: (live_span(...), the cache length after prefill): the loop, which counts the tokens, then
    calls step(*state, slots) with the cache slots the step has to attend."""
    out, steps = [first_token], 0
    if on_tokens:
        on_tokens(out)
    span, length = span or (None, 0)
    while len(out) < max_new_tokens and out[-1] != eos_id:
        tokens, count, state = step(*state) if span is None else step(*state, span(length))
        count, *tokens = torch.cat([count.view(1), tokens]).tolist()  # the one host sync
        length += count
        new = tokens[:count]
        steps += 1
        if eos_id in new:
            new = new[: new.index(eos_id) + 1]
        new = new[: max_new_tokens - len(out)]
        out += new
        if on_tokens:
            on_tokens(new)
    return out, steps


def live_span(model, rows: int, block: int = 64):
    """span(P) -> the cache slots [0, L) that a step writing `rows` slots after a P-token cache has to
    attend: L = P + rows rounded up to `block`. Attention then costs what the live prefix costs, not
    the static cache. L is marked dynamic: one compiled graph serves every length. None on CUDA, where a CUDA graph is
    recorded per shape and attention is cheap."""
    if model.output.weight.device.type == "cuda":
        return None
    slots = torch.arange(model.max_seq_len, device=model.output.weight.device)

    def span(P: int):
        s = slots[:min(model.max_seq_len, -(-(P + rows) // block) * block)]
        torch._dynamo.maybe_mark_dynamic(s, 0)
        return s
    return span


class Speculator(NamedTuple):
    """A speculative step's parts, fixed once: draft(h, next_tokens, n, P, L) -> (draft_tokens [N], tree)
    and accept(logits, draft_tokens, tree) -> (accept_length, path, next_token); the tree's depth and
    nodes, and the head's scratch slots (the last two size the caches)."""
    draft: Callable
    accept: Callable
    depth: int
    nodes: int
    scratch: int


def speculator(model, head, tree="tree16", dynamic=None, acceptance="greedy", temperature=0.0, top_k=0,
                top_p=1.0, posterior_threshold=0.09, posterior_alpha=0.3):
    """The draft and accept functions of a speculative step, fixed once.
    tree: a tree name, JSON file or list of index paths (static); dynamic: (top_k, depth, total_tokens) for EAGLE-2 trees.
    A WithLookup head adds its prompt-lookup chain to either (as deep as the tree, or as a static
    tree's path [-1, 0, ...] says).
    Returns a Speculator."""
    device = model.output.weight.device
    lookup = head.lookup > 0
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
    if head.max_depth is not None and head.max_depth < levels:
        raise ValueError(f"the tree is {levels} deep but the head has only {head.max_depth} heads: use a shallower tree")
    if acceptance == "greedy" or temperature == 0:
        accept = lambda logits, d, tr: greedy_accept(logits, d, tr.retrieve_indices)
    elif acceptance == "typical":
        accept = lambda logits, d, tr: typical_accept(logits, d, tr.retrieve_indices, temperature,
                                                      posterior_threshold, posterior_alpha)
    elif acceptance == "sample":
        accept = lambda logits, d, tr: sample_accept(logits, d, tr, temperature, top_k, top_p)
    else:
        raise ValueError(f"unknown acceptance '{acceptance}': use greedy, typical or sample")
    return Speculator(draft, accept, depth, nodes, depth + 1 + scratch)


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
    """Before each call Dynamo checks thousands of guards on the model, a few percent of a step on a
    CPU: that each module keeps its class, hooks, attributes and weights, none of which changes after
    compiling (and frozen weights are constants of the compiled code). Kept: the guards on the step's
    inputs and on the modules' buffers (KV caches and RoPE tables, re-allocated for longer prompts),
    but not on the kernels' packed weights (packed once by cpu_kernels.install)."""
    return [not g.orig_guard.source.is_unspecialized_nn_module()
            or (isinstance(g.value, torch.Tensor) and not isinstance(g.value, nn.Parameter)
                and not g.name.endswith("._buffers['packed']")) for g in guards]


def compile_step(fn, device: str, mode=None, gemm=None, prepack: bool = True):
    """fullgraph, static shapes. CUDA: CUDA graphs (reduce-overhead). CPU: max-autotune with
    freezing: weights become constants that the CPU GEMM kernels pre-pack (AMX / AVX-512 micro-kernels
    for bf16 when max-autotune picks them). gemm: the GEMM backends max-autotune chooses among (GEMMS).
    prepack: oneDNN's packed weights, which keep inductor's cache from storing the compiled graph (so
    that every run compiles it again): off where cpu_kernels runs the step's projections.
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
        # the kernels called from C++, not Python: the Python wrapper was a tenth of a token step
        options["cpp_wrapper"] = True
        # inductor tries to fuse each node with the next 64 that read a buffer it reads; the step's inputs are
        # read by every layer, so its fusion pass took a third of the compile; 8 gives the same code
        options["max_fusion_buffer_group_pairwise_attempts"] = 8
        options["cpp.weight_prepack"] = prepack
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
