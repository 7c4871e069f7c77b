"""Tree speculative decoding end to end: greedy speculative output equals greedy autoregressive output
token for token (every head type, static and dynamic trees, random heads and a test-only oracle
drafter that makes long accepted paths), in fp32, in bf16 (divergence only at bf16 near-ties) and
compiled; tree verification and cache compaction against sequential decoding; and lossless tree
speculative sampling against the base model's exact distribution."""
import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import checkpoint
import costs
import cpu_kernels as ck
import generate as G
import heads as H
import trees as T
from model import ModelArgs, Transformer
import speculate as sp

# ---------------------------------------------------------------- shared helpers

pytestmark = pytest.mark.usefixtures("one_thread")


PROMPTS = {  # varied: questions, code, a list, a story, math
    "capital": "What is the capital of France?",
    "reverse": "Write a Python function that reverses a string.",
    "fruits": "List five fruits that are red.",
    "cat": "Tell me a short story about a brave cat.",
    "mult": "What is 17 times 23? Show your work.",
    "sky": "Explain why the sky is blue.",
    "haiku": "Write a haiku about autumn leaves.",
    "sort": "How do I sort a list of dictionaries by a key in Python?",
    "tips": "Give me three tips for learning a new language.",
    "solve": "Solve for x: 2x + 6 = 14.",
}
REF_LEN = 40  # greedy autoregressive tokens cached per prompt (eos not applied: the oracle reads past it)


def randomize(head: nn.Module, seed: int) -> nn.Module:
    """Random weights everywhere (the constructors zero-init the ResBlocks, which would make Medusa
    a plain copy of the hidden state)."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in head.parameters():
            nn.init.normal_(p, std=0.02, generator=g)
    return head.eval()


def make_head(kind: str, args: ModelArgs, seed: int = 0, num_heads: int = 4) -> nn.Module:
    one_layer = ModelArgs(**{**args.to_dict(), "n_layer": 1})
    if kind == "medusa":
        head = H.Medusa(args.dim, args.vocab_size, num_heads)
    elif kind == "medusa-shared":  # MLC-LLM style: the base lm_head
        head = H.Medusa(args.dim, args.vocab_size, num_heads, lm_head=False)
    elif kind == "hydra":
        head = H.Hydra(args.dim, args.vocab_size, num_heads)
    elif kind == "hydra++":
        head = H.Hydra(args.dim, args.vocab_size, num_heads, prefix_args=one_layer)
    elif kind == "eagle":
        head = H.Eagle(one_layer)
    else:
        raise ValueError(kind)
    return randomize(head, seed)


class Oracle(H.Drafter):
    """Test-only drafter with a high acceptance rate. It runs the real head's begin/expand (so the
    head's cache and state paths are exercised, EAGLE's catch-up over accepted paths of length up to
    depth+1 included) and adds a large bonus to the logits of the TRUE next token, read from the
    autoregressive reference `truth` (prompt + generated tokens, past eos): the root sits at position
    P, so the children of nodes at depth d are truth[P + d + 1] (clamped past the end).
    Seeded corruption: at each (P, depth), with prob p_wrong the bonus goes to a wrong token, so the
    accepted length varies. Only tensor ops, so that it also runs under torch.compile(fullgraph=True);
    `truth` is a fixed-size buffer refilled in place (set_truth) so one graph serves every prompt."""

    def __init__(self, inner: nn.Module, vocab_size: int, p_wrong: float = 0.25, seed: int = 0,
                 bonus: float = 1000.0, max_len: int = 1024, max_depth: int = 16):
        super().__init__()
        self.inner, self.vocab_size, self.bonus = inner, vocab_size, bonus
        g = torch.Generator().manual_seed(seed)
        self.wrong = torch.rand(max_len, max_depth, generator=g) < p_wrong           # bias a wrong token?
        self.offset = torch.randint(1, vocab_size, (max_len, max_depth), generator=g)  # which (never the truth)
        self.truth = torch.zeros(max_len, dtype=torch.long)
        self.P = None

    def set_truth(self, tokens):
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        self.truth.copy_(torch.cat([tokens, tokens[-1:].expand(len(self.truth) - len(tokens))]))
        return self

    @property
    def needs_attn(self):
        return self.inner.needs_attn

    @property
    def cache_len(self):
        return self.inner.cache_len

    @property
    def max_depth(self):
        return self.inner.max_depth

    def setup_caches(self, max_seq_len):
        self.inner.setup_caches(max_seq_len)

    def prefill(self, base, h, next_tokens):
        self.inner.prefill(base, h, next_tokens)

    def begin(self, base, h, next_tokens, n, P, L=None):
        logits, state = self.inner.begin(base, h, next_tokens, n, P, L)
        self.P = P
        return self._bias(logits, 0), state

    def expand(self, base, depth, parent_state, tokens, attn):
        logits, state = self.inner.expand(base, depth, parent_state, tokens, attn)
        return self._bias(logits, depth), state

    def _bias(self, logits, depth: int):
        # index_select with a [1] index: indexing with a 0-dim tensor would read it on the host
        i = (self.P + depth + 1).clamp(max=self.truth.shape[0] - 1).reshape(1)
        tok = self.truth.index_select(0, i)
        wrong = self.wrong[:, depth].index_select(0, i)
        tok = torch.where(wrong, (tok + self.offset[:, depth].index_select(0, i)) % self.vocab_size, tok)
        return logits + self.bonus * F.one_hot(tok, self.vocab_size).to(logits.dtype)  # [1, V]: every row


def spec_decode(model, head, prompt, max_new, eos=None, tree="tree16", dynamic=None, acceptance="greedy",
                temperature=0.0, cache_len=None, step_wrapper=None):
    """Speculative decode with the cache sized exactly prompt + max_new + tree nodes (the minimum).
    Returns (new tokens, per-step [(tokens[:count] list, count)])."""
    draft, accept, depth, nodes, scratch = sp.speculator(model, head, tree, dynamic, acceptance, temperature)
    sp.setup_caches(model, head, cache_len or len(prompt) + max_new + nodes, scratch)
    steps = []

    def step(h, t, n, P):
        tokens, count, state = sp.spec_step(model, draft, accept, h, t, n, P)
        steps.append((tokens[: int(count)].tolist(), int(count)))
        return tokens, count, state

    first, state = sp.start(model, head, prompt, depth, dict(temperature=temperature))
    out, _ = sp.decode(step_wrapper(step) if step_wrapper else step, state, first, max_new, eos)
    return out, steps


def ar_decode(model, prompt, max_new, eos=None):
    sp.setup_caches(model, None, len(prompt) + max_new + 1)
    first, state = sp.start(model, None, prompt, 0, dict(temperature=0.0))
    return sp.decode(lambda t, p: sp.ar_step(model, t, p), state, first, max_new, eos)[0]


def cut(tokens, max_new, eos):
    """What decode returns given the full greedy continuation: up to max_new tokens, through eos."""
    tokens = tokens[:max_new]
    return tokens[: tokens.index(eos) + 1] if eos in tokens else tokens


def tau(out, steps):
    return (len(out) - 1) / max(len(steps), 1)


def eos_inside_path(steps, eos):
    """Did a step emit eos with accepted tokens after it (eos inside an accepted path)?"""
    return any(eos in toks and toks.index(eos) < count - 1 for toks, count in steps)


def cut_inside_path(out, steps, max_new, eos):
    """Did max_new stop the run inside the last step's accepted path (not at an eos): were an accepted
    draft token and the bonus token after it dropped?"""
    emitted = 1 + sum(c for _, c in steps)
    return len(out) == max_new and eos not in out and emitted - max_new >= 2


@pytest.fixture(scope="module")
def smol(default_model):
    """The default model (fp32) with its prompts, AR references computed once per prompt, and random
    heads built once per kind."""
    model, tok = default_model
    refs, heads = {}, {}

    def prompt(name):
        return torch.tensor(tok.encode(tok.chat([{"role": "user", "content": PROMPTS[name]}]), bos=False))

    def ref(name):
        """Greedy AR continuation of REF_LEN tokens, past eos; truth = prompt + continuation."""
        if name not in refs:
            with torch.inference_mode():
                refs[name] = ar_decode(model, prompt(name), REF_LEN)
        return refs[name]

    def head(kind):
        if kind not in heads:
            heads[kind] = make_head(kind, model.args, seed=["medusa", "hydra", "hydra++", "eagle"].index(kind) + 1)
        return heads[kind]

    return SimpleNamespace(model=model, tok=tok, eos=tok.eos_id, prompt=prompt, ref=ref, head=head)


# ---------------------------------------------------------------- 1. exactness, fp32, default model

DYN = (4, 4, 16)


def test_eagle_static_oracle_equals_autoregressive_over_ten_prompts(smol):
    """EAGLE, tree16, oracle drafter: 10 prompts x 30 to 34 tokens, each with the cache sized exactly
    prompt + max_new + nodes. At least one reference hits eos inside an accepted path, and at least
    one run is cut by max_new inside an accepted path."""
    model, eos = smol.model, smol.eos
    oracle = Oracle(smol.head("eagle"), model.args.vocab_size, seed=1)
    n_tokens = n_steps = 0
    eos_inside = cut_inside = 0
    for i, name in enumerate(PROMPTS):
        prompt, ref = smol.prompt(name), smol.ref(name)
        max_new = 30 + i % 5
        oracle.set_truth(prompt.tolist() + ref)
        with torch.inference_mode():
            out, steps = spec_decode(model, oracle, prompt, max_new, eos)
        assert out == cut(ref, max_new, eos), name
        n_tokens, n_steps = n_tokens + len(out) - 1, n_steps + len(steps)
        eos_inside += eos_inside_path(steps, eos)
        cut_inside += cut_inside_path(out, steps, max_new, eos)
    print(f"EAGLE tree16 oracle: tau {n_tokens / n_steps:.2f} over {n_tokens} tokens, {n_steps} steps; "
          f"eos inside a path in {eos_inside} runs, max_new cut inside a path in {cut_inside}")
    assert n_tokens >= 200
    assert n_tokens / n_steps >= 2.5
    assert eos_inside >= 1, "no reference hit eos inside an accepted path: change a prompt or the seed"
    assert cut_inside >= 1


# (head kind, tree, dynamic, oracle, prompts, max_new)
COMBOS = [
    ("medusa", "tree16", None, True, ["reverse", "fruits"], 32),
    ("hydra", "tree16", None, True, ["cat", "mult"], 32),
    ("hydra++", "tree16", None, True, ["sky", "haiku"], 32),
    ("medusa", "mc_sim_7b_63", None, True, ["sort"], 32),
    ("eagle", None, DYN, True, ["tips", "solve"], 32),
    ("hydra", None, DYN, True, ["reverse", "cat"], 32),
    ("medusa", "tree16", None, False, ["capital"], 10),
    ("hydra", "tree16", None, False, ["fruits"], 10),
    ("hydra++", "tree16", None, False, ["mult"], 10),
    ("eagle", "tree16", None, False, ["sky"], 10),
    ("eagle", None, DYN, False, ["haiku"], 10),
    ("medusa", None, DYN, False, ["sort"], 10),
]


@pytest.mark.parametrize("kind,tree,dynamic,oracle,names,max_new", COMBOS,
                         ids=[f"{c[0]}-{c[1] or 'dynamic'}-{'oracle' if c[3] else 'random'}" for c in COMBOS])
def test_greedy_speculative_equals_autoregressive(smol, kind, tree, dynamic, oracle, names, max_new):
    model, eos = smol.model, smol.eos
    head = smol.head(kind)
    if oracle:
        head = Oracle(head, model.args.vocab_size, seed=len(kind))
    n_tokens = n_steps = 0
    for name in names:
        prompt, ref = smol.prompt(name), smol.ref(name)
        if oracle:
            head.set_truth(prompt.tolist() + ref)
        with torch.inference_mode():
            out, steps = spec_decode(model, head, prompt, max_new, eos, tree=tree or "tree16", dynamic=dynamic)
        assert out == cut(ref, max_new, eos), name
        n_tokens, n_steps = n_tokens + len(out) - 1, n_steps + len(steps)
    t = n_tokens / n_steps
    print(f"{kind} {tree or dynamic} {'oracle' if oracle else 'random'}: tau {t:.2f} over {n_tokens} tokens")
    if oracle:
        assert t >= 2.5  # long accepted paths were verified and compacted
    else:
        assert t <= 1.3  # a random head is (almost) never right


# ---------------------------------------------------------------- 2. bf16

def test_bf16_eagle_oracle_diverges_only_at_bf16_near_ties(smol):
    """bf16 base model and head, EAGLE tree16 with the oracle. The tree forward (16 tokens) and the AR
    forward (1 token) round differently, so greedy outputs may part where the top-2 logits are within
    bf16 rounding. Where they part, each path's token must trail the top logit of an fp32 forward of
    the same (bf16) weights over the common prefix by at most (two, or more where several are near-tied)
        BOUND = 4 * 2**-7 * max(|top1|, 1),
    i.e. 4 ulps of the top logit: bf16 keeps 8 significant bits, so one ulp of x is at most 2**-7 |x|
    and one rounding moves a value by half an ulp. The bf16 logits are rounded once at the end (two
    logits one ulp apart may come out tied or swapped), and the residual stream is rounded after each
    of 30 layers, with a different matmul blocking and attention width in the two forwards; those
    errors, mostly independent, add up to about one ulp at the logits (measured: the fp32 margins at
    the partings are 0.03 to 0.14, at most about 1 ulp; with AMX tiles, 2026-12-05, AR took the third
    of four logits within 0.25, 0.21 below the top). 4 ulps leaves room; a real bug (a wrong mask,
    position or cache slot) moves logits by O(1) and parts the outputs far from a tie.
    A run whose outputs do not part passes trivially (reported), and must show long accepted paths."""
    from generate import load_model
    model, tok = load_model(None, "cpu", torch.bfloat16)
    head = make_head("eagle", model.args, seed=7).to(torch.bfloat16)
    oracle = Oracle(head, model.args.vocab_size, seed=3)
    bound = lambda top1: 4 * 2 ** -7 * max(abs(top1), 1.0)
    parted = 0
    # on this machine "tips" parts at its 4th new token, "sort" does not part
    for name, max_new in [("tips", 24), ("sort", 40)]:
        prompt = smol.prompt(name)
        with torch.inference_mode():
            ref = ar_decode(model, prompt, max_new + 6)
            oracle.set_truth(prompt.tolist() + ref)
            out, steps = spec_decode(model, oracle, prompt, max_new, tok.eos_id)
        expected = cut(ref, max_new, tok.eos_id)
        if out == expected:
            print(f"bf16 {name}: speculative and autoregressive outputs are identical (no divergence "
                  f"to check); tau {tau(out, steps):.2f}")
            assert tau(out, steps) >= 2.5
            continue
        parted += 1
        i = next(k for k in range(min(len(out), len(expected))) if out[k] != expected[k])
        common = torch.tensor(prompt.tolist() + expected[:i])
        with torch.inference_mode():
            model.setup_caches(1, len(common))
            logits16 = model(common[None], torch.arange(len(common)))[0, -1].float()
            m32 = copy.deepcopy(model).float()
            logits = m32(common[None], torch.arange(len(common)))[0, -1]
            del m32
        top, top16 = logits.topk(4), logits16.topk(4)
        gaps = [(top.values[0] - logits[t]).item() for t in (expected[i], out[i])]
        print(f"bf16 {name}: outputs part at new token {i}: AR {expected[i]}, speculative {out[i]}, "
              f"below the fp32 top logit by {gaps[0]:.4f} and {gaps[1]:.4f} (bound {bound(top.values[0].item()):.4f}); "
              f"fp32 forward top-4 {top.indices.tolist()} {[round(x, 3) for x in top.values.tolist()]}; "
              f"bf16 forward top-4 {top16.indices.tolist()} {top16.values.tolist()}")
        assert max(gaps) <= bound(top.values[0].item())
    print(f"bf16: {parted} of 2 runs parted from the AR output")


# ---------------------------------------------------------------- 3. compiled

def test_compiled_eagle_tree_step_equals_autoregressive(smol, monkeypatch, no_recompiles):
    """The whole EAGLE static tree10 step (draft with the head's cache, tree attention, accept,
    compaction) under torch.compile(fullgraph=True): two prompts, one cache size, one graph, whose
    attention reads the live span of the cache (its length grows over the decode, the graph stays)."""
    import torch._dynamo
    model, eos = smol.model, smol.eos
    oracle = Oracle(smol.head("eagle"), model.args.vocab_size, seed=5)
    names, max_new = ["fruits", "solve"], 32
    refs = {name: smol.ref(name) for name in names}  # before the caches are sized: ar_decode resizes them
    draft, accept, depth, nodes, scratch = sp.speculator(model, oracle, "tree10")
    S = max(len(smol.prompt(n)) for n in names) + max_new + nodes
    sp.setup_caches(model, oracle, S, scratch)
    step = sp.compile_step(lambda h, t, n, P, span: sp.spec_step(model, draft, accept, h, t, n, P, span), "cpu",
                          mode="default")
    span = sp.live_span(model, nodes, block=16)
    taus = []
    for name in names:
        prompt, ref = smol.prompt(name), refs[name]
        oracle.set_truth(prompt.tolist() + ref)
        with torch.inference_mode():
            first, state = sp.start(model, oracle, prompt, depth, dict(temperature=0.0))
            out, steps = sp.decode(step, state, first, max_new, eos, span=(span, len(prompt)))
        assert out == cut(ref, max_new, eos), name
        taus.append((len(out) - 1) / steps)
    print(f"compiled EAGLE tree10 oracle: tau {', '.join(f'{t:.2f}' for t in taus)}")
    # both high: the second prompt's truth reached the graph (not frozen in as a constant), and
    # accepted paths of several tokens were compacted inside the graph
    assert min(taus) >= 2.0


# ---------------------------------------------------------------- tiny random models

TINY = ModelArgs(dim=64, n_layer=2, n_head=4, n_kv_head=2, vocab_size=97, intermediate_size=128, max_seq_len=256)


def tiny_model(args: ModelArgs = TINY, seed: int = 0) -> Transformer:
    """Random weights drawn large enough that attention is far from uniform and the next token depends
    on the context (with PyTorch's default init the argmax barely reads it, and a wrong mask or cache
    slot would go unseen)."""
    torch.manual_seed(seed)
    model = Transformer(args).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.15 * torch.randn_like(p))
    return model


def snapshot(model):
    return [(l.attention.kv_cache.k_cache.clone(), l.attention.kv_cache.v_cache.clone()) for l in model.layers]


def restore(model, snap):
    for l, (k, v) in zip(model.layers, snap):
        l.attention.kv_cache.k_cache.copy_(k)
        l.attention.kv_cache.v_cache.copy_(v)


# ---------------------------------------------------------------- 4. tree verification

@st.composite
def random_trees(draw):
    """A tree from a random parent array (tree_from_parents, rows per node, nodes in any order with
    parents first) or from a random set of Medusa index paths (tree_buffers, rows per leaf)."""
    n = draw(st.integers(2, 20))
    parents = [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]
    depth_of = [0]
    for i in range(1, n):
        depth_of.append(depth_of[parents[i]] + 1)
    if draw(st.booleans()):
        return T.tree_from_parents(torch.tensor(parents), max(depth_of) + draw(st.integers(0, 2)))
    paths, rank = {0: ()}, {}
    for i in range(1, n):
        rank[parents[i]] = rank.get(parents[i], -1) + 1
        paths[i] = paths[parents[i]] + (rank[parents[i]],)
    return T.tree_buffers([list(paths[i]) for i in range(1, n)])


@pytest.fixture(scope="module")
def tiny():
    return tiny_model()


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(tree=random_trees(), prefix_len=st.integers(1, 40), seed=st.integers(0, 2 ** 16))
def test_one_tree_forward_equals_each_path_run_sequentially(tiny, tree, prefix_len, seed):
    model, S = tiny, 64
    g = torch.Generator().manual_seed(seed)
    N, P = tree.num_nodes, prefix_len
    prefix = torch.randint(0, TINY.vocab_size, (P,), generator=g)
    draft_tokens = torch.randint(0, TINY.vocab_size, (N,), generator=g)
    model.setup_caches(1, S)
    with torch.inference_mode():
        model(prefix[None], torch.arange(P))
        snap = snapshot(model)
        prefix = torch.arange(S)[None, :] < P  # as spec_step calls it
        tree_logits = model(draft_tokens[None], P + tree.positions, prefix, cache_pos=P + torch.arange(N),
                            tree_mask=tree.tree_mask)[0]
        for row in tree.retrieve_indices.tolist():
            path = [i for i in row if i >= 0]
            restore(model, snap)
            seq = model(draft_tokens[path][None], torch.arange(P, P + len(path)))[0]
            assert (tree_logits[path] - seq).abs().max().item() < 1e-4, path


# ---------------------------------------------------------------- 5. compaction

def test_compaction_leaves_the_cache_of_sequential_decoding():
    """Every (leaf path, accept length) of tree16: tree forward, compact the accepted path to the
    slots after the prefix, and compare the caches with decoding those tokens one by one."""
    model, S, P = tiny_model(seed=1), 48, 13
    g = torch.Generator().manual_seed(0)
    prefix = torch.randint(0, TINY.vocab_size, (P,), generator=g)
    tree = T.tree_buffers(T.load_tree("tree16"))
    N, D = tree.num_nodes, tree.depth
    draft_tokens = torch.randint(0, TINY.vocab_size, (N,), generator=g)
    model.setup_caches(1, S)
    ref = copy.deepcopy(model)
    checked = 0
    with torch.inference_mode():
        model(prefix[None], torch.arange(P))
        snap = snapshot(model)
        for row in tree.retrieve_indices.tolist():
            length = sum(i >= 0 for i in row) - 1
            for a in range(length + 1):
                path = torch.tensor([row[min(j, a)] for j in range(D + 1)])  # as trees._path pads it
                restore(model, snap)
                model(draft_tokens[None], P + tree.positions, torch.arange(S)[None, :] < P,
                      cache_pos=P + torch.arange(N), tree_mask=tree.tree_mask)
                model.compact(P + path, P + torch.arange(D + 1))
                restore(ref, snap)
                for j in range(a + 1):  # the root and the accepted tokens, one by one
                    ref(draft_tokens[path[j]].view(1, 1), torch.tensor([P + j]))
                end = P + a + 1
                for lm, lr in zip(model.layers, ref.layers):
                    for name in ("k_cache", "v_cache"):
                        got = getattr(lm.attention.kv_cache, name)[:, :, :end]
                        want = getattr(lr.attention.kv_cache, name)[:, :, :end]
                        assert (got - want).abs().max().item() < 1e-5, (row, a, name)
                checked += 1
    assert checked > 20


def test_eagle_cache_after_spec_steps_equals_one_catch_up_over_the_accepted_sequence():
    """After every step (the oracle makes accepted paths of 1 to 5 tokens), EAGLE's own cache over
    [0, P) equals the cache of one catch-up over the whole accepted sequence from a fresh cache:
    rows (base hidden state at t, token t+1) for t < P."""
    model = tiny_model(seed=2)
    base = copy.deepcopy(model)  # for the reference hidden states, with its own caches
    head = make_head("eagle", TINY, seed=3)
    oracle = Oracle(head, TINY.vocab_size, seed=4)
    prompt = torch.randint(0, TINY.vocab_size, (20,), generator=torch.Generator().manual_seed(5))
    max_new = 60
    with torch.inference_mode():
        ref = ar_decode(model, prompt, max_new + 6)
        truth = prompt.tolist() + ref
        oracle.set_truth(truth)
        checks = []

        def checked(step):
            def run(*state):
                tokens, count, state = step(*state)
                h, nt, n, P = state
                head.begin(model, h, nt, n, P)  # the next step's catch-up (it rewrites the same rows)
                P = int(P)
                fresh = copy.deepcopy(head)
                fresh.setup_caches(head.cache_len)
                base.setup_caches(1, P)
                _, _, hidden = base(torch.tensor(truth[:P])[None], torch.arange(P), return_hidden=True)
                fresh.layer.catch_up(fresh.rows(base, hidden[0], torch.tensor(truth[1:P + 1])),
                                     torch.zeros((), dtype=torch.long))
                for name in ("k_cache", "v_cache"):
                    got = getattr(head.layer.block.attention.kv_cache, name)[:, :, :P]
                    want = getattr(fresh.layer.block.attention.kv_cache, name)[:, :, :P]
                    checks.append((got - want).abs().max().item())
                return tokens, count, state
            return run

        out, steps = spec_decode(model, oracle, prompt, max_new, step_wrapper=checked)
    print(f"EAGLE cache vs one catch-up: max difference {max(checks):.2e} over {len(checks)} steps, "
          f"tau {tau(out, steps):.2f}")
    assert out == ref[:max_new]
    assert max(c for _, c in steps) == 5 and tau(out, steps) >= 2.5
    assert max(checks) < 1e-5, max(checks)


# ---------------------------------------------------------------- 6. sampling

SMALL = ModelArgs(dim=32, n_layer=2, n_head=4, n_kv_head=2, vocab_size=8, intermediate_size=64,
                  max_seq_len=64, tie_embeddings=False)
TEMP = 0.9


@pytest.fixture(scope="module")
def small_setup():
    """A tiny base model over 8 tokens with spread-out next-token distributions, a random EAGLE head,
    a prompt, and the exact joint distribution of the two tokens after the prefill's first token."""
    torch.manual_seed(0)
    model = Transformer(SMALL).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(1 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    head = make_head("eagle", SMALL, seed=1)
    prompt = torch.tensor([1, 5, 2, 7, 3, 0, 6])
    with torch.inference_mode():
        first = ar_decode(model, prompt, 1)[0]  # the prefill's token, greedy: the runs condition on it
        seq = prompt.tolist() + [first]
        model.setup_caches(1, len(seq) + 1)
        p2 = T.logits_to_probs(model(torch.tensor(seq)[None], torch.arange(len(seq)))[0, -1], TEMP)
        joint = torch.zeros(8, 8, dtype=torch.float64)
        for a in range(8):
            x = torch.tensor(seq + [a])
            p3 = T.logits_to_probs(model(x[None], torch.arange(len(x)))[0, -1], TEMP)
            joint[a] = p2[a].double() * p3.double()
    return SimpleNamespace(model=model, head=head, prompt=prompt, first=first, joint=joint)


def sample_pairs(s, acceptance, runs, seed, **kw):
    """Runs speculative decoding `runs` times from the same prefill (the prefix cache is never written
    by a step) and counts the two tokens it emits after the first."""
    model, head = s.model, s.head
    draft, accept, depth, nodes, scratch = sp.speculator(model, head, "tree16", None, acceptance, TEMP, **kw)
    sp.setup_caches(model, head, len(s.prompt) + 3 + nodes + 1, scratch)
    step = lambda h, t, n, P: sp.spec_step(model, draft, accept, h, t, n, P)
    counts = torch.zeros(8, 8, dtype=torch.float64)
    accepted = 0
    torch.manual_seed(seed)
    with torch.inference_mode():
        first, state = sp.start(model, head, s.prompt, depth, dict(temperature=0.0))
        assert first == s.first
        for _ in range(runs):
            out, steps = sp.decode(step, state, first, 3)
            counts[out[1], out[2]] += 1
            accepted += steps == 1
    return counts, accepted / runs


def chi2_pvalue(counts: torch.Tensor, probs: torch.Tensor) -> float:
    """Pearson's chi-square goodness of fit; cells expected below 5 are pooled into one."""
    n = counts.sum()
    expected, counts = (probs.flatten() / probs.sum()) * n, counts.flatten()
    small = expected < 5
    e = torch.cat([expected[~small], expected[small].sum().view(1)])
    c = torch.cat([counts[~small], counts[small].sum().view(1)])
    keep = e > 0
    e, c = e[keep], c[keep]
    stat = ((c - e) ** 2 / e).sum()
    df = len(e) - 1
    return torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2).item()


RUNS = 2000


def test_tree_speculative_sampling_keeps_the_base_distribution(small_setup):
    counts, one_step = sample_pairs(small_setup, "sample", RUNS, seed=0)
    p = chi2_pvalue(counts, small_setup.joint)
    tv = 0.5 * (counts / RUNS - small_setup.joint).abs().sum().item()
    print(f"sample acceptance: chi-square p {p:.3g}, total variation {tv:.3f}, "
          f"both tokens from one step in {one_step:.0%} of runs")
    assert one_step > 0.3  # the tree's drafts were accepted often: the acceptance rule was exercised
    assert p > 1e-3


def test_the_sampling_check_catches_lossy_typical_acceptance(small_setup):
    """The same check on Medusa's typical acceptance (lossy) must fail: it accepts any drafted token
    above a probability floor, so drafted tokens are over-represented."""
    runs = 400
    counts, _ = sample_pairs(small_setup, "typical", runs, seed=0)
    p = chi2_pvalue(counts, small_setup.joint)
    tv = 0.5 * (counts / runs - small_setup.joint).abs().sum().item()
    print(f"typical acceptance: chi-square p {p:.3g}, total variation {tv:.3f}")
    assert p < 1e-6


# ---------------------------------------------------------------- the EAGLE draft's own tree attention

@pytest.mark.parametrize("n,lookup", [(1, False), (3, False), (2, True)])
def test_eagle_draft_nodes_see_exactly_their_path(n, lookup):
    """Every node that EAGLE expands in a static tree gets the logits that running its draft layer
    along the node's path, one row at a time, gives. A wrong draft attention mask (a sibling's or a
    stale scratch row visible, an ancestor hidden, a wrong position) fails here, though in decoding it
    would only lower tau. n: the accepted path's length (catch-up rows); lookup: the tree carries the
    prompt-lookup branch, which shifts node ids."""
    base, P, dim = tiny_model(seed=2), 20, TINY.dim
    eagle = make_head("eagle", TINY, seed=3)
    with torch.no_grad():  # sharp attention: with make_head's small weights it is near uniform and blind to positions
        eagle.layer.block.attention.wqkv.weight.mul_(20)
    head = H.WithLookup(eagle, H.NGram(TINY.vocab_size)) if lookup else eagle
    plan = H.static_plan(T.load_tree("tree16"), lookup)
    tree, D = plan.tree, plan.tree.depth
    head.setup_caches(P + 2 * (D + 1) + tree.num_nodes)
    g = torch.Generator().manual_seed(n)
    prompt_h, prompt_next = torch.randn(P - n + 1, dim, generator=g), torch.randint(0, 97, (P - n + 1,), generator=g)
    h, next_tokens = torch.randn(D + 1, dim, generator=g), torch.randint(0, 97, (D + 1,), generator=g)
    calls = {}
    begin, expand = eagle.begin, eagle.expand
    eagle.begin = lambda *a: calls.setdefault("begin", begin(*a))
    eagle.expand = lambda *a: calls.setdefault(a[1], expand(*a))       # keyed by depth
    with torch.inference_mode():
        head.prefill(base, prompt_h, prompt_next)                       # rows 0 .. P-n-1
        draft_tokens, _ = H.draft_static(head, base, plan, h, next_tokens, torch.tensor(n), torch.tensor(P))
        checked = 0
        slot = torch.arange(eagle.cache_len)
        for d in range(1, D):
            logits = calls[d][0]                                        # [F_d, V]
            for r, i in enumerate(plan.expand_nodes[d].tolist()):
                path = tree.tree_mask[i].nonzero()[:, 0]
                path = path[tree.positions[path].argsort()][1:]          # the node's ancestors but the root, and itself
                f = calls["begin"][1]                                   # the root's predicted feature [1, dim]
                for j, node in enumerate(path.tolist()):
                    pos = torch.tensor([P + j])
                    mask = (slot < P) | ((slot >= P) & (slot <= P + j))
                    f = eagle.layer(eagle.rows(base, f, draft_tokens[node].view(1)), pos, pos, mask[None])
                torch.testing.assert_close(logits[r], base.output(f)[0], atol=1e-4, rtol=1e-4)
                checked += 1
    assert checked == sum(len(x) for x in plan.expand_nodes[1:])


@pytest.mark.parametrize("kind,dynamic", [("eagle", False), ("eagle", True), ("hydra++", False)])
def test_draft_over_the_live_span_equals_the_draft_over_the_whole_cache(kind, dynamic):
    """spec_step lets the draft attend only the head's first L + D + 1 + M cache slots (L: the base's
    live span, at least P + the tree's nodes): the prefix, the catch-up rows and the scratch rows. The
    draft tokens and what the draft leaves in the head's caches are then those of a draft over every
    slot; a span too short for a scratch or catch-up row fails here. Slots past the span hold noise."""
    base, P, n = tiny_model(seed=4), 24, 2
    head = H.WithLookup(make_head(kind, TINY, seed=5), H.NGram(TINY.vocab_size))
    g = torch.Generator().manual_seed(6)
    if dynamic:
        k, D, total = 3, 3, 10
        M = k + (D - 1) * k * k + 1
        draft = lambda hd, h, t, L: H.draft_dynamic(hd, base, h, t, torch.tensor(n), torch.tensor(P), k, D, total, L)
    else:
        plan = H.static_plan(T.load_tree("tree16"), lookup=True)
        D, M = plan.tree.depth, plan.tree.num_nodes
        draft = lambda hd, h, t, L: H.draft_static(hd, base, plan, h, t, torch.tensor(n), torch.tensor(P), L)
    L = P + M                                              # the shortest span a step of M nodes gets
    head.setup_caches(TINY.max_seq_len + D + 1 + M)
    with torch.no_grad():
        for b in head.buffers():                           # noise in every slot, then the prompt's rows
            b.copy_(torch.randint(0, TINY.vocab_size, b.shape, generator=g) if b.dtype == torch.long
                    else torch.randn(b.shape, generator=g).to(b.dtype) if b.is_floating_point() else b)
    h = torch.randn(P - n + 1 + D + 1, TINY.dim, generator=g)
    tokens = torch.randint(0, TINY.vocab_size, (P - n + 1 + D + 1,), generator=g)
    with torch.inference_mode():
        head.prefill(base, h[:P - n + 1], tokens[:P - n + 1])
        other = copy.deepcopy(head)
        whole, live = draft(head, h[-(D + 1):], tokens[-(D + 1):], None), draft(other, h[-(D + 1):], tokens[-(D + 1):], L)
    assert torch.equal(whole[0], live[0])
    for a, b in zip(head.buffers(), other.buffers()):  # (SDPA over fewer slots sums in another order)
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# ---------------------------------------------------------------- --tree auto

def test_step_costs_are_measured_once_per_key(tmp_path):
    calls = []
    measure = lambda rows: calls.append(rows) or {n: 0.01 * n for n in rows}
    key = dict(machine="m", dtype="torch.bfloat16", heads="/h", weights=[("w.safetensors", 10, 123)])
    assert costs.cached_costs(key, (1, 8), measure, tmp_path) == {1: 0.01, 8: 0.08}
    assert costs.cached_costs(key, (1, 8), measure, tmp_path) == {1: 0.01, 8: 0.08} and len(calls) == 1
    assert costs.cached_costs(key, (8,), measure, tmp_path) == {1: 0.01, 8: 0.08} and len(calls) == 1  # a subset
    costs.cached_costs({**key, "dtype": "torch.float32"}, (1, 8), measure, tmp_path)   # another key: measured again
    assert len(calls) == 2
    # more rows than cached: all of them measured again, in one run, and kept beside the others
    assert costs.cached_costs(key, (1, 2), measure, tmp_path) == {1: 0.01, 2: 0.02, 8: 0.08} and calls[-1] == [1, 2]
    assert costs.cached_costs(key, (1, 2, 8), measure, tmp_path) and len(calls) == 3


def test_compiler_takes_the_gemm_backends_that_time_fastest(tmp_path, monkeypatch):
    """gemm_choice times the one-row forward with each of GEMMS (once per machine and model, cached) and
    compiler compiles every step with the faster; without max-autotune, or on CUDA, there is no choice."""
    import checkpoint
    monkeypatch.setattr(checkpoint, "CACHE_DIR", tmp_path)
    model, seen = tiny_model(), []
    monkeypatch.setattr(sp, "compile_step", lambda fn, device, mode=None, gemm=None, prepack=True: seen.append(gemm) or fn)
    for fastest in costs.GEMMS:
        def step_costs(m, head, compiled, rows=costs.ROWS, **k):  # what each choice costs: known here
            compiled(None)
            return {N: 0.01 if seen[-1] == fastest else 0.02 for N in rows}, {}
        monkeypatch.setattr(costs, "step_costs", step_costs)
        f = costs.compiler(model, "cpu", checkpoint=f"ckpt-{fastest}")
        assert set(seen) == set(costs.GEMMS)
        seen.clear()
        f(lambda: None)
        assert seen == [fastest]
        monkeypatch.setattr(costs, "step_costs", lambda *a, **k: pytest.fail("the choice was timed again"))
        assert costs.gemm_choice(model, "cpu", checkpoint=f"ckpt-{fastest}") == fastest
        seen.clear()
    assert costs.gemm_choice(model, "cpu", mode="default") is None   # no max-autotune: nothing to choose
    assert ck.torch_gemms(model)
    for m in model.modules():  # every projection our kernel (as cpu_kernels.install makes them on AVX2): nothing either
        if type(m) is nn.Linear:
            m.__class__ = ck.WideLinear
    assert not ck.torch_gemms(model) and costs.gemm_choice(model, "cpu", checkpoint="ours") is None
    import quantize as Q  # a weight-only int8 linear multiplies in torch's kernels: there is a choice again
    model.output = Q.WeightOnlyInt8Linear(torch.zeros(TINY.vocab_size, TINY.dim, dtype=torch.int8),
                                          torch.ones(TINY.vocab_size))
    assert ck.torch_gemms(model)
    assert costs.gemm_choice(model, "cuda") is None                  # CUDA graphs: nothing to choose


def test_step_costs_compile_two_graphs_for_any_number_of_row_counts():
    """One row compiles static, as the decode step does; 2 or more rows share one graph with the rows
    symbolic (a compiled CPU shape costs 1-2 minutes): ten row counts, two graphs."""
    from torch._dynamo.testing import CompileCounter
    model, graphs = tiny_model(), CompileCounter()
    compiled = lambda f: torch.compile(f, backend=graphs, fullgraph=True, dynamic=False)  # as compile_step
    verify = costs.step_costs(model, None, compiled, rows=tuple(range(1, 11)), prefix=16, reps=1)[0]
    assert sorted(verify) == list(range(1, 11)) and all(t > 0 for t in verify.values())
    assert graphs.frame_count == 2


def test_step_costs_compile_the_one_row_forward_once_for_every_call():
    """The verify table, the draft levels and the whole steps are timed in separate calls, each beside a
    one-row forward (to carry them into one run's units): the caches sized alike in every call, that
    forward is one graph in a process, not one a call (70 s a compile on a 2-core Zen 3; the same graph
    again, inductor's cache gives it in 20). Freezing off, as here by default: with it (compile_step
    sets it for the process) Dynamo guards on the caches' identity, re-allocated by each call, and
    only inductor's cache sees that the graphs are the same."""
    from torch._dynamo.testing import CompileCounter
    model, graphs = tiny_model(), CompileCounter()
    compiled = lambda f: torch.compile(f, backend=graphs, fullgraph=True, dynamic=False)  # as compile_step
    with torch._inductor.config.patch(freezing=False):
        costs.step_costs(model, None, compiled, rows=(1, 2, 3), prefix=16, reps=1)
        assert graphs.frame_count == 2
        for rows in [(1,), (1, 5)]:
            costs.step_costs(model, None, compiled, rows=rows, prefix=16, reps=1)
    assert graphs.frame_count == 2, graphs.frame_count


def test_auto_times_the_whole_steps_that_generation_then_compiles():
    """--tree auto times the whole decode steps beside its tables, compiled; generation then compiles
    the same steps again. Both size the caches alike on a CPU (sp.SLOTS), so they are the same graphs
    (the same inputs, shapes included) and inductor's cache hands generation what the timing compiled:
    20 s a step there against 90 to compile it (2-core Zen 3). Trees of near sizes timed together
    (auto's near trees) share the head cache's length, so this holds for each of them."""
    import dataclasses
    args = dataclasses.replace(TINY, max_seq_len=1024)  # a context longer than SLOTS, as SmolLM2's
    model, head = tiny_model(args), randomize(make_head("eagle", args), 1)
    graphs = []

    def record(gm, inputs):  # each graph's inputs: the step's state, the weights, the caches
        graphs.append(sorted(tuple(x.shape) for x in inputs if isinstance(x, torch.Tensor)))
        return gm.forward
    compiled = lambda f: torch.compile(f, backend=record, fullgraph=True, dynamic=False)  # as compile_step
    paths = [[0], [0, 0], [1]]
    costs.step_costs(model, head, compiled, rows=(1,), depths=(), prefix=16, reps=1,
                     trees=[[[0], [1], [2], [0, 0], [0, 0, 0], [0, 0, 0, 0]], paths])  # (the larger first)
    timed = len(graphs)  # the one-row forward, the plain step, the two tree steps
    # generation, as generate.run sets it up for a short prompt
    draft, accept, depth, nodes, scratch = sp.speculator(model, head, paths)
    prompt = torch.tensor([5, 17, 3, 44, 8, 21])
    sp.setup_caches(model, head, G.cache_size(len(prompt), 24, nodes, args.max_seq_len), scratch)
    ar = compiled(lambda token, pos, span=None: sp.ar_step(model, token, pos, span=span))
    step = compiled(lambda h, t, n, P, span=None: sp.spec_step(model, draft, accept, h, t, n, P, span))
    greedy = dict(temperature=0.0)
    with torch.inference_mode():
        out, _ = sp.decode(step, sp.start(model, head, prompt, depth, greedy)[1], 0, 12, span=(sp.live_span(model, nodes), 6))
        ref, _ = sp.decode(ar, sp.start(model, None, prompt, 0, greedy)[1], 0, 12, span=(sp.live_span(model, 1), 6))
    assert out == ref
    assert timed == 4 and len(graphs) > timed
    assert all(g in graphs[:timed] for g in graphs[timed:]), "generation compiled a step that auto did not time"


def test_step_costs_symbolic_rows_follow_a_kernels_row_ranges():
    """Where a kernel serves a range of row counts (RowsLinear 8-16 rows on AVX-512, TileLinear up to
    64 on AMX), the symbolic graph is guarded on that range: one graph a range, every size timed."""
    from torch._dynamo.testing import CompileCounter

    class Ranged(nn.Linear):  # another path for 3-5 rows, as RowsLinear has for MIN_ROWS..MAX_ROWS
        def forward(self, x):
            if 3 <= x.numel() // x.shape[-1] <= 5:
                return F.linear(x, self.weight.neg(), self.bias).neg()
            return super().forward(x)
    model, graphs = tiny_model(), CompileCounter()
    for m in model.modules():
        if type(m) is nn.Linear:
            m.__class__ = Ranged
    compiled = lambda f: torch.compile(f, backend=graphs, fullgraph=True, dynamic=False)  # as compile_step
    verify = costs.step_costs(model, None, compiled, rows=tuple(range(1, 11)), prefix=16, reps=1)[0]
    assert sorted(verify) == list(range(1, 11))
    assert graphs.frame_count == 4, graphs.frame_count  # 1 row static; 2 rows; 3-5; 6-10


@pytest.mark.parametrize("kind", ["eagle", "hydra"])
def test_auto_tree_times_this_machine_and_stays_exact(tmp_path, monkeypatch, kind):
    """--tree auto on real (eager) step timings of a tiny model: a tree or plain decoding, printed,
    cached, and the chosen tree decodes exactly like autoregressive decoding."""
    import json
    import checkpoint
    monkeypatch.setattr(checkpoint, "CACHE_DIR", tmp_path / "cache")
    model = tiny_model()
    head = randomize(make_head(kind, TINY), 1)
    folder = tmp_path / "heads"
    folder.mkdir()
    paths = [[0], [1], [0, 0], [0, 0, 0], [0, 0, 0, 0]]   # a made-up, very good head
    (folder / "acceptance.json").write_text(json.dumps(dict(roots=10, paths=paths, counts=[9, 1, 8, 7, 6])))
    tree, choice = G.resolve_tree(model, head, folder, "auto", "cpu")
    assert tree is None or (tree and all(p in paths for p in tree))
    assert list((tmp_path / "cache").glob("step-costs-*.json"))
    if tree is not None:  # the size chosen was timed itself
        verify, _ = costs.measured_costs(model, None, folder, "cpu")
        assert choice["nodes"] in verify
    monkeypatch.setattr(costs, "step_costs", lambda *a, **k: pytest.fail("the cached costs were measured again"))
    assert G.resolve_tree(model, head, folder, "auto", "cpu")[0] == tree  # the choice is kept: nothing timed
    assert list((tmp_path / "cache").glob("tree-auto-*.json"))
    if tree is not None:  # the whole steps were timed (eager, real) beside the forwards, and cached
        verify, _ = costs.measured_costs(model, None, folder, "cpu")
        c = choice
        (o_ar, o_spec), (_, t_draft) = c["overhead"], costs.measured_costs(model, head, folder, "cpu", depths=(1, 4))
        assert abs(o_ar) < verify[1] and abs(o_spec) < 5 * verify[1]  # (a tiny model: either sign)
        assert c["speedup"] == pytest.approx(c["tau"] * (verify[1] + o_ar) / (
            T.interpolate(t_draft, c["depth"]) + T.interpolate(verify, c["nodes"]) + o_spec))
    # another head on the same base: only its draft levels are timed, verification's costs are shared
    other = tmp_path / "other"
    other.mkdir()
    (other / "acceptance.json").write_text((folder / "acceptance.json").read_text())
    timed = []
    monkeypatch.setattr(costs, "step_costs", lambda m, h, c, rows=costs.ROWS, depths=costs.DEPTHS, trees=(), **k:
                        timed.append(list(rows)) or ({N: 2e-3 * N for N in rows}, {d: 1e-3 * d for d in depths},
                                                     {"ar": 2.5e-3, "spec": [9e-3] * len(trees)} if trees else {}))
    _, choice = G.resolve_tree(model, head, other, "auto", "cpu")
    # the draft beside one row (its times in the verify table's units), then the chosen tree's whole step
    # beside one row
    assert all(rows == [1] for rows in timed), timed
    verify, t_draft = costs.measured_costs(model, head, other, "cpu", depths=(1,))
    assert t_draft[1] == pytest.approx(1e-3 * verify[1] / 2e-3)
    c = choice
    if c["paths"] is not None:  # a tree is predicted at its whole step (9 ms beside a 2 ms row, in the tables' units)
        verify, t_draft = costs.measured_costs(model, head, other, "cpu", depths=(1, 4))
        monkeypatch.setattr(checkpoint, "CACHE_DIR", tmp_path / "fresh")
        o_ar, (o_spec,) = costs.step_overhead(model, head, other, "cpu", None, None, verify, t_draft, [c["paths"]])
        step = T.interpolate(t_draft, c["depth"]) + T.interpolate(verify, c["nodes"]) + o_spec
        assert step == pytest.approx(9e-3 * verify[1] / 2e-3)
        assert verify[1] + o_ar == pytest.approx(2.5e-3 * verify[1] / 2e-3)
        monkeypatch.setattr(checkpoint, "CACHE_DIR", tmp_path / "cache")
    prompt = torch.tensor([5, 17, 3, 44, 8, 21])
    if tree is not None:
        assert spec_decode(model, head, prompt, 24, tree=tree)[0] == ar_decode(model, prompt, 24)
    kept = len(list((tmp_path / "cache").glob("tree-auto-*.json")))
    (folder / "acceptance.json").write_text(json.dumps(dict(roots=10, paths=paths, counts=[9, 0, 0, 0, 0])))
    _, choice = G.resolve_tree(model, head, folder, "auto", "cpu")    # new acceptance: chosen again, kept beside the old
    assert len(list((tmp_path / "cache").glob("tree-auto-*.json"))) == kept + 1
    (folder / "acceptance.json").unlink()                 # no measured acceptance: the old default
    assert G.resolve_tree(model, head, folder, "auto", "cpu")[0] == "tree16"


def test_cost_key_names_a_head_by_its_contents_not_its_path(tmp_path):
    """The tables of a head are found again from another checkout (another path, other file times):
    the key holds its folder's name and its weights' contents; other weights, another key."""
    import os
    import shutil
    model, head = tiny_model(), H.WithLookup(make_head("eagle", TINY), H.NGram(TINY.vocab_size, 3))
    a, b = tmp_path / "one" / "eagle-tiny", tmp_path / "two" / "eagle-tiny"
    checkpoint.save_heads(make_head("eagle", TINY), a)
    shutil.copytree(a, b)
    os.utime(b / "model.safetensors", (1, 1))
    key = lambda d: costs.cost_key(model, "cpu", "default", None, head, d)
    assert key(a) == key(b) and key(a)["weights"] and key(a)["lookup"] == 3
    checkpoint.save_heads(make_head("eagle", TINY, seed=1), b)
    assert key(a) != key(b)


def test_auto_tree_times_every_size_it_may_choose(tmp_path, monkeypatch):
    """Forwards that cost what one row costs up to 6 rows, then more a row (as on a CPU): timed at a
    few sizes, the line between them puts 5 and 6 rows dearer than they are and chooses another tree.
    auto times every size up to 32 rows, in one run, and chooses what the full table chooses."""
    import json
    import checkpoint
    monkeypatch.setattr(checkpoint, "CACHE_DIR", tmp_path / "cache")
    model, head = tiny_model(), randomize(make_head("hydra", TINY), 1)
    folder = tmp_path / "heads"
    folder.mkdir()
    acc = dict(roots=10, paths=[[0], [1], [2], [0, 0], [1, 0]], counts=[8, 1, 1, 6, 1])
    (folder / "acceptance.json").write_text(json.dumps(acc))
    f = lambda N: 2e-3 + 1e-3 * max(0, N - 6)
    timed = []
    monkeypatch.setattr(costs, "step_costs", lambda m, h, c, rows=costs.ROWS, depths=costs.DEPTHS, trees=(), **k:
                        timed.append(list(rows)) or ({N: f(N) for N in rows}, {d: 0.2e-3 * d for d in depths},
                                                     {"ar": 2.1e-3, "spec": [3e-3] * len(trees)} if trees else {}))
    _, c = G.resolve_tree(model, head, folder, "auto", "cpu")
    assert timed[0] == list(range(1, 33)) + [48, 64] and all(rows == [1] for rows in timed[1:]), timed
    _, t_draft = costs.measured_costs(model, head, folder, "cpu", depths=(1, 2))
    counts = {tuple(p): n for p, n in zip(acc["paths"], acc["counts"])}
    full = T.choose_tree(counts, 10, {N: f(N) for N in range(1, 65)}, t_draft, overhead=tuple(c["overhead"]))
    grid = T.choose_tree(counts, 10, {N: f(N) for N in (1, 4, 8, 16, 64)}, t_draft, overhead=tuple(c["overhead"]))
    assert (c["paths"], c["speedup"]) == (full["paths"], pytest.approx(full["speedup"]))
    assert grid["nodes"] != c["nodes"]


def test_auto_tree_times_the_near_trees_whole(tmp_path, monkeypatch, capsys):
    """Trees predicted within costs.NEAR of the best are a tie the tables cannot break: each is timed
    as a whole step beside plain decoding's, and the fastest so is chosen; a tree whose step costs
    more than its forwards promise loses to its neighbour. Timed within costs.TIE of the fastest, the
    tree with the fewest nodes wins."""
    import json
    import checkpoint
    model, head = tiny_model(), randomize(make_head("hydra", TINY), 1)
    folder = tmp_path / "heads"
    folder.mkdir()
    # 5, 4 and 3 nodes are within 1% of each other (tau 2.44, 2.43, 2.42)
    (folder / "acceptance.json").write_text(json.dumps(dict(roots=100, paths=[[0], [0, 0], [1], [2], [1, 0]],
                                                            counts=[80, 60, 2, 1, 1])))
    timed = []

    def chosen(whole, near=None):  # whole: the tree step's seconds, by the tree; near: in the near trees' run
        def step_costs(m, h, c, rows=costs.ROWS, depths=costs.DEPTHS, trees=(), reps=20, **k):
            timed.append(trees)
            f = near if near and len(trees) > 1 else whole
            assert reps == (costs.NEAR_REPS if len(trees) > 1 else 20)  # the near trees: more turns
            return ({N: 2e-3 for N in rows}, {d: 0.2e-3 * d for d in depths},
                    {"ar": 2e-3, "spec": [f(t) for t in trees]} if trees else {})
        monkeypatch.setattr(costs, "step_costs", step_costs)
        monkeypatch.setattr(checkpoint, "CACHE_DIR", tmp_path / f"cache{len(timed)}")
        return G.resolve_tree(model, head, folder, "auto", "cpu")

    tree, c = chosen(lambda tree: 2.6e-3)  # the same whole steps: 1% apart by tau, a tie, to the fewest nodes
    assert len(tree) == 3 and c["tau"] == pytest.approx(2.42) and c["timed"] == [6, 5, 4]
    # the first choice alone, then the near ones (it among them) in turns in one run
    assert [[len(t) for t in trees] for trees in timed if trees] == [[5], [5, 4, 3]]
    tree, c = chosen(lambda tree: 2.6e-3 if len(tree) == 5 else 2.8e-3)  # the largest 7% ahead: no tie
    assert len(tree) == 5 and c["speedup"] == pytest.approx(c["tau"] * 2e-3 / 2.6e-3)
    assert c["tau"] == pytest.approx(2.44) and c["overhead"][1] == pytest.approx(2.6e-3 - 2e-3 - 0.4e-3)
    assert next(d for d in c["candidates"] if d["nodes"] == 4 and "overhead" in d)["speedup"] == pytest.approx(
        2.42 * 2e-3 / 2.8e-3)  # (timed: it holds its step's overhead)
    # a tie never takes a tree that plain decoding beats: the largest at 1.01x, the others at 0.995x
    tree, c = chosen(lambda tree: 2.6e-3, near=lambda tree: {5: 2.44, 4: 2.43, 3: 2.42}[len(tree)] * 2e-3 / (
        1.01 if len(tree) == 5 else 0.995))
    assert len(tree) == 5 and c["speedup"] == pytest.approx(1.01)
    tree, c = chosen(lambda tree: 4e-3 if len(tree) == 5 else 2.6e-3)  # the largest dear: the others tie
    assert len(tree) == 3 and c["speedup"] == pytest.approx(2.42 * 2e-3 / 2.6e-3)
    assert next(d for d in c["candidates"] if d["nodes"] == 6)["speedup"] == pytest.approx(2.44 * 2e-3 / 4e-3)
    before = len(timed)
    tree, c = chosen(lambda tree: 8e-3)  # the first tree's whole step dearer than its tokens pay for
    assert tree is None and c["paths"] is None and [len(t) for t in timed[before:] if t] == [1]  # no near tree timed
    # the near trees' run finds every one of them dear: plain decoding, and the message names a tree
    # at its timed step (2.44 * 2 / 8 = 0.61x), not at the first run's
    tree, c = chosen(lambda tree: 2.6e-3, near=lambda tree: 8e-3)
    assert tree is None and c["paths"] is None and c["timed"] == [6, 5, 4]
    said = capsys.readouterr().err.splitlines()[-1]
    assert "plain autoregressive decoding" in said and "0.61x" in said, said


def test_auto_tree_walks_a_heads_positions_with_its_lookup(tmp_path, monkeypatch):
    """A head's acceptance measured at every position with the lookup chain (n = 3): `auto` weighs each
    tree at its tau walked through them. With another n-gram length nothing was walked for it, and the
    counts are weighed as before."""
    import json
    import checkpoint
    monkeypatch.setattr(checkpoint, "CACHE_DIR", tmp_path / "cache")
    monkeypatch.setattr(costs, "step_costs", lambda m, h, c, rows=costs.ROWS, depths=costs.DEPTHS, trees=(), **k:
                        ({N: 2e-3 + 0.05e-3 * N for N in rows}, {d: 0.2e-3 * d for d in depths},
                         {"ar": 2e-3, "spec": [3e-3] * len(trees)} if trees else {}))
    model = tiny_model()
    nodes = [[0], [1], [0, 0], [1, 0]]
    walk = [[((0,), 3), ((), 0), ((0, 0), 0), ((), 4), ((), 3), ((1,), 2), ((), 1), ((), 0)] * 6,
            [((1, 0), 0), ((), 0), ((0,), 1), ((), 0)] * 5]
    observed = [w for prompt in walk for w in prompt]
    step = T.step_counts(observed, nodes, 3)  # (counted at every position: the walk, not these, gives tau)
    index = {tuple(p): i for i, p in enumerate(step["paths"])}
    step["walk"] = dict(lengths=[len(w) for w in walk], best=[index[p] if p else -1 for p, _ in observed],
                        lookup={"3": [k for _, k in observed]})
    folder = tmp_path / "heads"
    folder.mkdir()
    (folder / "acceptance.json").write_text(json.dumps(dict(roots=10, paths=nodes, counts=[5, 3, 2, 1], step=step)))
    assert T.step_walk(step, 3) == walk and T.step_walk(step, 4) is None
    assert T.step_walk(step) == [[(p, 0) for p, _ in prompt] for prompt in walk]
    for n in (3, 4):
        head = H.WithLookup(randomize(make_head("hydra", TINY), 1), H.NGram(TINY.vocab_size, n))
        tree, choice = G.resolve_tree(model, head, folder, "auto", "cpu")
        c = choice
        assert tree is not None or n == 4  # (n = 4: the chain's hits unknown, its nodes paid for)
        for cand in c["candidates"]:
            head_paths, chain = T.split_chain(cand["paths"])
            walked = T.walk_tau(walk, [({tuple(p) for p in head_paths}, chain)])[0]
            assert (cand["tau"] == pytest.approx(walked)) == (n == 3), (n, cand, walked)


def test_auto_tree_for_the_ngram_drafter_weighs_its_measured_chain(tmp_path, monkeypatch):
    """The n-gram drafter has no acceptance.json: `auto` weighs its chain's hits as bench.py
    --acceptance measured them beside the shipped heads of the base model (pooled), and chooses a
    chain as deep as the costs pay for, or plain decoding where rows are dear; for another base
    model, with nothing measured, chain4 (not a trained head's tree16)."""
    import json
    from pathlib import Path
    import checkpoint
    from heads import NGram
    model, head = tiny_model(), NGram(TINY.vocab_size, 3)
    shipped = sorted((Path(costs.__file__).parent / "heads").glob("*/acceptance.json"))
    steps = [json.loads(f.read_text())["step"]["lookup"] for f in shipped]
    assert len(steps) == 3 and costs.ngram_acceptance(3, "ckpt/other") is None and costs.ngram_acceptance(5) is None
    roots = sum(s["roots"] for s in steps)
    hits = [sum(c) / roots for c in zip(*(s["counts"]["3"] for s in steps))]
    acc = costs.ngram_acceptance(3)
    assert acc["roots"] == roots and [c / roots for c in acc["counts"]] == pytest.approx(hits)
    # measured at every position (bench.py --acceptance since 2026-12-07): each depth's tau walked, not summed
    tau = [T.walk_tau(acc["walk"], [({(0,) * i for i in range(1, j + 1)}, 0)])[0] for j in range(len(hits) + 1)]
    assert tau == sorted(tau) and tau[8] < 1 + sum(hits) - 0.1  # the roots' counts overrate the chain
    chosen = {}
    for per_row in (0.02e-3, 1.5e-3, 5e-3):  # a row nearly free, dear, dearer than the chain's hits pay for
        f = lambda N: 10e-3 + per_row * (N - 1)
        monkeypatch.setattr(costs, "step_costs", lambda m, h, c, rows=costs.ROWS, depths=costs.DEPTHS, trees=(), **k:
                            ({N: f(N) for N in rows}, {d: 0.05e-3 * d for d in depths},
                             {"ar": 10e-3, "spec": [f(len(t) + 1) + 0.05e-3 * len(t) for t in trees]} if trees else {}))
        monkeypatch.setattr(checkpoint, "CACHE_DIR", tmp_path / f"cache{per_row}")
        tree, choice = G.resolve_tree(model, head, "ngram", "auto", "cpu")
        # the best chain depth by brute force, with the same costs (0: plain decoding); within costs.TIE of
        # it, a tie, the shorter chain wins
        speed = lambda j: tau[j] * f(1) / (f(j + 1) + 0.05e-3 * j)
        best = max(range(len(hits) + 1), key=speed)
        got = len(tree) if tree else 0
        assert tree == ([[0] * j for j in range(1, got + 1)] if got else None)
        assert got <= best and speed(got) >= (1 - costs.TIE) * speed(best), (got, best)
        if got:
            assert choice["tau"] == pytest.approx(tau[got])
        chosen[per_row] = (got, best)
    (cheap, cheap_best), (mid, _), (dear, _) = chosen.values()  # deeper as rows get cheap
    assert cheap_best == len(hits) == 8 and cheap > mid > 0 and dear == 0, chosen
    monkeypatch.setattr(costs, "ngram_acceptance", lambda n, checkpoint=None: None)
    assert G.resolve_tree(model, head, "ngram", "auto", "cpu")[0] == "chain4"


def test_step_acceptance_predicts_what_each_subtree_accepts(default_model, tmp_path):
    """bench.py --acceptance notes, at each step of a big tree, the deepest head node and the lookup
    tokens the base accepted. Over a decode they add up to what the step accepted; and since a node's
    draft and its verdict depend on its ancestors only, at a root they say what any subtree of the
    big tree accepts there: checked at the first step of three prompts (the same root for every
    tree). The shipped EAGLE head with the lookup chain, fp32."""
    import json
    import bench
    model, tok = default_model
    head = G.load_heads("heads/eagle-smollm2", model, None, 3)
    big = T.load_tree("tree16")
    f = tmp_path / "prompt.jsonl"

    def first_step(text, tree):
        draft, accept, depth, nodes, scratch = sp.speculator(model, head, tree)
        sp.setup_caches(model, head, 512, scratch)
        with torch.inference_mode():
            _, state = sp.start(model, head, torch.tensor(tok.encode(tok.chat([{"role": "user", "content": text}]))),
                               depth, dict(temperature=0.0))
            return int(sp.spec_step(model, draft, accept, *state)[1])

    # at a root (the accepted paths there: (0, 2), (0, 0, 0, 0) and (0, 0, 1))
    subtrees = (T.load_tree("chain4"), [[0], [1], [0, 0]], [[0], [0, 2]], [[0], [0, 0], [0, 0, 1]], [[1], [1, 0]])
    for text in ("List the days of the week: Monday, Tuesday, Wednesday,", "What is the capital of France?",
                 "Name three primary colors."):
        f.write_text(json.dumps({"prompt": text}) + "\n")
        one = bench.step_acceptance(model, tok, head, big, f, 2, 256)   # one step: the first
        assert one["roots"] == 1 and sorted(map(tuple, one["paths"])) == sorted(map(tuple, big))
        best = max([tuple(p) for p, c in zip(one["paths"], one["counts"]) if c], key=len, default=())
        k = sum(c > 0 for c in one["lookup"]["counts"]["3"])
        assert len(best) >= 2
        for sub in subtrees:
            in_sub = max(d for d in range(len(best) + 1) if d == 0 or list(best[:d]) in sub)
            assert first_step(text, sub) == 1 + max(in_sub, min(k, max(map(len, sub)))), (text, sub, best, k)

    # over a decode: as many steps, and every accepted token counted once, by the head or the chain
    text = "Write the multiplication table of 3 from 3 x 1 to 3 x 10."
    f.write_text(json.dumps({"prompt": text}) + "\n")
    big = big + [[-1] + [0] * 7]  # and the lookup chain deeper than the head's tree, as --acceptance measures it
    acc = bench.step_acceptance(model, tok, head, big, f, 48, 256)
    draft, accept, depth, nodes, scratch = sp.speculator(model, head, big)
    sp.setup_caches(model, head, G.cache_size(256, 48, nodes, model.args.max_seq_len), scratch)
    ids, counts = tok.encode(tok.chat([{"role": "user", "content": text}])), []

    def step(*state):
        out = sp.spec_step(model, draft, accept, *state)
        counts.append(int(out[1]))
        return out

    with torch.inference_mode():
        first, state = sp.start(model, head, torch.tensor(ids), depth, dict(temperature=0.0))
        sp.decode(step, state, first, 48, tok.eos_id, span=(sp.live_span(model, nodes), len(ids)))
    hits = acc["lookup"]["counts"]["3"]
    assert acc["roots"] == len(counts) and sum(hits) > 0
    assert sum(c - 1 for c in counts) == sum(acc["counts"]) - sum(acc["both"]["3"]) + sum(hits)

    # every position a root: walking them gives each subtree's decode, step for step, prompt by prompt
    texts = (text, "List the days of the week: Monday, Tuesday, Wednesday,")
    f.write_text("".join(json.dumps({"prompt": t}) + "\n" for t in texts))
    walk = T.step_walk(bench.step_acceptance(model, tok, head, big, f, 48, 256), 3)

    def decoded(tree):  # (tokens, steps) over both prompts
        draft, accept, depth, nodes, scratch = sp.speculator(model, head, tree)
        sp.setup_caches(model, head, G.cache_size(256, 48, nodes, model.args.max_seq_len), scratch)
        tokens = steps = 0
        for t in texts:
            ids = tok.encode(tok.chat([{"role": "user", "content": t}]))
            with torch.inference_mode():
                first, state = sp.start(model, head, torch.tensor(ids), depth, dict(temperature=0.0))
                out, k = sp.decode(lambda *s: sp.spec_step(model, draft, accept, *s), state, first, 48, tok.eos_id,
                                   span=(sp.live_span(model, nodes), len(ids)))
            tokens, steps = tokens + len(out) - 1, steps + k
        return tokens, steps
    assert len(walk) == 2 and decoded(big)[0] == sum(map(len, walk))
    for sub in (big, [[-1] + [0] * 7, [0]], [[-1, 0, 0], [0], [1], [0, 0]], T.load_tree("chain4")):
        tokens, steps = decoded(sub)
        head_paths, chain = T.split_chain(sub)
        assert T.walk_tau(walk, [({tuple(p) for p in head_paths}, chain or max(map(len, sub)))]) == \
            [pytest.approx(tokens / steps)], sub
