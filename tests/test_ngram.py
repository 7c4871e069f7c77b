"""The context n-gram drafter (prompt lookup): what it proposes, and that speculative decoding
with it is exact and, on repetitive text, accepts long paths."""
import pytest
import torch

from generate import load_heads
from heads import NGram, WithLookup
from model import Transformer
from test_speculative import TINY
import speculate as sp


def proposal(ngram, context, depth=4):
    # context: the tokens at positions 0..P (the last is the root); returns the proposed chain
    S = 64
    ngram.setup_caches(S)
    ctx = torch.tensor(context)
    P = torch.tensor(len(context) - 1)
    ngram.ids[: len(context)] = ctx
    logits, state = ngram.begin(None, None, ctx[-1:], torch.tensor(1), P)
    out = [int(logits.argmax()) if logits.max() > 0 else -1]
    for d in range(1, depth):
        logits, state = ngram.expand(None, d, state, None, None)
        out.append(int(logits.argmax()) if logits.max() > 0 else -1)
    return out


def test_proposes_what_followed_the_latest_longest_match():
    ng = NGram(vocab_size=50, n=3)
    # "7 8 9" occurred twice; the latest is followed by 20 21 ...; a 1-gram "9" match elsewhere loses
    assert proposal(ng, [1, 7, 8, 9, 10, 11, 9, 5, 7, 8, 9, 20, 21, 22, 3, 7, 8, 9])[:3] == [20, 21, 22]
    # only a 1-gram matches: the token after the latest earlier "4"
    assert proposal(ng, [4, 30, 31, 32, 5, 6, 4])[:3] == [30, 31, 32]
    # nothing matches: no proposal
    assert proposal(ng, [1, 2, 3, 4]) == [-1, -1, -1, -1]


@pytest.mark.parametrize("seed", range(3))
def test_lookup_counts_replay_the_drafter(seed):
    """trees.lookup_counts (what --tree auto expects of the lookup branch) against NGram itself."""
    from trees import lookup_counts
    g = torch.Generator().manual_seed(seed)
    seq = torch.randint(0, 6, (40,), generator=g).tolist()       # a small vocab: many matches, some long
    ng, depth, start = NGram(vocab_size=6, n=3), 4, 5
    want = [0] * depth
    for t in range(start, len(seq) - 1):
        right = 0
        for a, b in zip(proposal(ng, seq[:t + 1], depth), seq[t + 1:]):
            if a != b:
                break
            right += 1
        for j in range(right):
            want[j] += 1
    assert lookup_counts(seq, start, 3, depth) == want and want[0] > 0


def speculative_tau(model, tok, head, tree, text, n=64, dynamic=None):
    """Greedy speculative decoding of a chat prompt; asserts it equals autoregressive decoding; -> tau."""
    draft, accept, depth, nodes, scratch = sp.speculator(model, head, tree, dynamic)
    prompt = torch.tensor(tok.encode(tok.chat([{"role": "user", "content": text}])))
    S = len(prompt) + n + nodes
    with torch.inference_mode():
        sp.setup_caches(model, None, S)
        first, state = sp.start(model, None, prompt, 0, dict(temperature=0.0))
        ref, _ = sp.decode(lambda t, p: sp.ar_step(model, t, p), state, first, n, tok.eos_id)
        sp.setup_caches(model, head, S, scratch)
        first, state = sp.start(model, head, prompt, depth, dict(temperature=0.0))
        out, steps = sp.decode(lambda h, t, k, P: sp.spec_step(model, draft, accept, h, t, k, P), state, first, n, tok.eos_id)
    assert out == ref
    return (len(out) - 1) / steps


DAYS = "List the days of the week, each with one sentence about it."


def test_greedy_speculative_with_ngram_equals_autoregressive(default_model):
    model, tok = default_model
    head = load_heads("ngram", model)
    taus = [speculative_tau(model, tok, head, "chain4", text) for text in [DAYS, "What is 12 times 13?"]]
    assert taus[0] > 2.0, taus  # the list repeats itself: long chains are accepted


def test_lookup_branch_joins_the_tree():
    from heads import static_plan
    from trees import load_tree
    paths = load_tree("tree10")
    plain, plan = static_plan(paths), static_plan(paths, lookup=True)
    D = plain.tree.depth
    assert plan.tree.num_nodes == plain.tree.num_nodes + D and plan.tree.depth == D
    # the chain: the last node of every depth, each the child of the one above, the first the root's
    last = [int((plan.tree.positions == d).nonzero().max()) for d in range(1, D + 1)]
    assert [int(plan.tree.parents[i]) for i in last] == [0] + last[:-1]
    # the head's own nodes are expanded as before
    assert [len(x) for x in plan.expand_nodes[1:]] == [len(x) for x in plain.expand_nodes[1:]]


def test_lookup_chain_deeper_than_the_tree():
    """A path [-1, 0, ...] makes the chain that deep: past the head's depth the chain's nodes are the
    only ones, each the child of the one above, and the draft fills them with the lookup's proposal."""
    from heads import draft_static, static_plan
    from test_speculative import make_head
    paths = [[0], [1], [0, 0], [-1, 0, 0, 0, 0]]
    plan = static_plan(paths, lookup=True)
    assert plan.lookup == 5 and plan.tree.depth == 5 and plan.tree.num_nodes == 1 + 3 + 5 and len(plan.topk) == 3
    chain = [i for i in range(plan.tree.num_nodes) if plan.paths[i][:1] == (2,)]
    assert [int(plan.tree.parents[i]) for i in chain] == [0] + chain[:-1]
    assert plan.tree.positions[chain].tolist() == [1, 2, 3, 4, 5]
    with pytest.raises(ValueError, match="give --lookup N"):
        static_plan(paths)
    ctx = torch.tensor([1, 7, 8, 9, 20, 21, 22, 23, 24, 25, 5, 7, 8, 9])  # after "7 8 9": 20 21 22 23 24
    L, S = len(ctx), 64
    base = Transformer(TINY).eval()
    base.setup_caches(1, S)
    head = WithLookup(make_head("medusa", TINY, seed=1), NGram(TINY.vocab_size, 3)).eval()
    head.setup_caches(S + 64)
    h = torch.randn(L - 1, TINY.dim)
    with torch.no_grad():
        head.prefill(base, h, ctx[1:])
        tokens, tree = draft_static(head, base, plan, h[-1:], ctx[-1:], torch.tensor(1), torch.tensor(L - 1))
    assert tokens[chain].tolist() == [20, 21, 22, 23, 24]


@pytest.mark.parametrize("kind", ["medusa", "eagle"])
def test_head_with_lookup_equals_autoregressive(default_model, kind):
    """A random head (its drafts almost never accepted) plus the lookup branch: exact, and the branch
    alone gets long paths accepted on repetitive text."""
    from test_speculative import make_head
    model, tok = default_model
    head = WithLookup(make_head(kind, model.args, seed=1), NGram(model.args.vocab_size, 3)).to(model.output.weight.dtype)
    assert speculative_tau(model, tok, head, "tree10", DAYS) > 2.0
    assert speculative_tau(model, tok, head, [[0], [1], [0, 0], [-1] + [0] * 6], DAYS) > 2.0  # a chain 7 deep
    if kind == "eagle":  # an EAGLE-2 dynamic tree of 16 nodes plus the 4-node chain
        assert speculative_tau(model, tok, head, None, DAYS, dynamic=(4, 4, 16)) > 2.0


def test_lookup_chain_joins_a_dynamic_tree():
    """The chain hangs from the root after the dynamic tree's nodes, carrying the lookup's proposal."""
    from heads import draft_dynamic
    from test_speculative import make_head
    ctx = torch.tensor([1, 7, 8, 9, 20, 21, 22, 23, 5, 7, 8, 9])  # after "7 8 9": 20 21 22 23
    L, S = len(ctx), 64
    base = Transformer(TINY).eval()
    base.setup_caches(1, S)
    head = WithLookup(make_head("eagle", TINY, seed=1), NGram(TINY.vocab_size, 3)).eval()
    head.setup_caches(S + 64)
    torch.manual_seed(0)
    h = torch.randn(L - 1, TINY.dim)  # the prompt is ctx[:-1]; the root ctx[-1] sits at P = L - 1
    with torch.no_grad():
        head.prefill(base, h, ctx[1:])
        tokens, tree = draft_dynamic(head, base, h[-1:], ctx[-1:], torch.tensor(1), torch.tensor(L - 1),
                                     top_k=3, depth=4, total_tokens=10)
    assert tokens.shape == (14,) and tree.num_nodes == 14 and int(tokens[0]) == 9
    assert tree.parents[10:].tolist() == [0, 10, 11, 12] and tree.positions[10:].tolist() == [1, 2, 3, 4]
    assert tokens[10:].tolist() == [20, 21, 22, 23]
    assert tree.retrieve_indices[13].tolist() == [0, 10, 11, 12, 13]
