import itertools
import json
import math
import os
import random

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import trees as T  # the repo root is on sys.path (conftest.py)

FAST = settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.too_slow])


# ------------------------------------------------------------------ random trees

@st.composite
def parent_arrays(draw, max_nodes=24):
    """Random tree as a parent array: root -1, parents[i] < i (not sorted by depth)."""
    n = draw(st.integers(1, max_nodes))
    return [-1] + [draw(st.integers(0, i - 1)) for i in range(1, n)]


def paths_of(parents):
    """Medusa index paths of a parent array: a child's choice = its rank among siblings."""
    paths, rank = {0: ()}, {}
    for i in range(1, len(parents)):
        p = parents[i]
        rank[p] = rank.get(p, -1) + 1
        paths[i] = paths[p] + (rank[p],)
    return [list(paths[i]) for i in range(1, len(parents))]


def ancestors(parents, i):
    out = [i]
    while parents[out[-1]] >= 0:
        out.append(parents[out[-1]])
    return out[::-1]  # root first


def check_tree(t, parents):
    """mask, positions and retrieve rows agree with the parent pointers."""
    n = len(parents)
    assert t.tree_mask.shape == (n, n) and t.tree_mask.dtype == torch.bool
    assert t.parents.tolist() == parents
    for i in range(n):
        anc = ancestors(parents, i)
        assert t.positions[i].item() == len(anc) - 1
        assert set(torch.nonzero(t.tree_mask[i]).flatten().tolist()) == set(anc)
    for row in t.retrieve_indices.tolist():
        k = row.index(-1) if -1 in row else len(row)
        assert all(x == -1 for x in row[k:]) and row[0] == 0
        assert row[:k] == ancestors(parents, row[k - 1])


# ------------------------------------------------------------------ static trees

def test_named_trees():
    paths = T.load_tree("mc_sim_7b_63")
    assert len(paths) == 63 and len({tuple(p) for p in paths}) == 63
    t = T.tree_buffers(paths)
    assert t.num_nodes == 64 and t.depth == 4
    assert t.retrieve_indices.shape == (42, 5)  # one row per leaf
    assert t.tree_indices.max().item() < 1 + 4 * 10  # TOPK = 10
    check_tree(t, t.parents.tolist())
    for name, n in [("chain4", 5), ("tree10", 10), ("tree16", 16)]:
        t = T.tree_buffers(T.load_tree(name))
        assert t.num_nodes == n and t.depth == 4
        check_tree(t, t.parents.tolist())
    chain = T.tree_buffers(T.load_tree("chain4"))
    assert chain.retrieve_indices.tolist() == [[0, 1, 2, 3, 4]]
    assert chain.tree_mask.equal(torch.ones(5, 5, dtype=torch.bool).tril())


def test_load_tree_errors(tmp_path):
    with pytest.raises(ValueError, match="unknown tree 'nope': give one of mc_sim_7b_63"):
        T.load_tree("nope")
    f = tmp_path / "t.json"
    f.write_text(json.dumps([[0], [0, 0], [1]]))
    assert T.load_tree(str(f)) == [[0], [0, 0], [1]]
    for bad in ["{not json", json.dumps({"a": 1}), json.dumps([[0], []]), json.dumps([[0.5]]), "[]", "[[0, -1]]"]:
        f.write_text(bad)
        with pytest.raises(ValueError, match="unknown tree"):
            T.load_tree(str(f))
    f.write_text(json.dumps([[0], [1], [-1, 0, 0, 0]]))  # the lookup chain, 4 deep
    assert T.split_chain(T.load_tree(str(f))) == ([[0], [1]], 4)
    assert T.split_chain([[0], [1]]) == ([[0], [1]], None)
    for bad in [[[0], [-1], [-1, 0]], [[0], [-1, 1]], [[-1, 0]], [[0], [-1] + [0] * 16]]:
        f.write_text(json.dumps(bad))
        with pytest.raises(ValueError, match=r"one path \[-1, 0, ..., 0\] at most"):
            T.load_tree(str(f))


def test_tree_buffers_errors():
    with pytest.raises(ValueError, match=r"tree path \[1, 0\] has no parent \[1\]"):
        T.tree_buffers([[0], [1, 0]])
    with pytest.raises(ValueError, match="duplicate"):
        T.tree_buffers([[0], [0]])
    with pytest.raises(ValueError, match="topk"):
        T.tree_buffers([[0], [3]], topk=2)
    with pytest.raises(ValueError, match="no paths"):
        T.tree_buffers([])
    with pytest.raises(ValueError, match="empty"):
        T.tree_buffers([[0], []])


@FAST
@given(parent_arrays())
def test_tree_buffers_matches_paths(parents):
    paths = paths_of(parents)
    if not paths:
        return
    t = T.tree_buffers(paths, topk=30)
    order = sorted(map(tuple, paths), key=lambda p: (len(p), p))
    node = {p: i + 1 for i, p in enumerate(order)} | {(): 0}
    bparents = [-1] + [node[p[:-1]] for p in order]
    check_tree(t, bparents)
    assert all(bparents[i] < i for i in range(1, len(bparents)))
    assert t.positions.tolist() == sorted(t.positions.tolist())  # by depth
    assert t.tree_indices.tolist() == [0] + [1 + (len(p) - 1) * 30 + p[-1] for p in order]
    leaves = [i for i in range(len(bparents)) if i not in bparents]
    assert sorted(r[max(k for k in range(len(r)) if r[k] >= 0)] for r in t.retrieve_indices.tolist()) == leaves


@FAST
@given(parent_arrays(), st.integers(0, 2))
def test_tree_from_parents_bruteforce(parents, extra_depth):
    depth = max(len(ancestors(parents, i)) for i in range(len(parents))) - 1
    t = T.tree_from_parents(torch.tensor(parents), depth + extra_depth)
    check_tree(t, parents)
    assert t.retrieve_indices.shape == (len(parents), depth + extra_depth + 1)
    for i, row in enumerate(t.retrieve_indices.tolist()):  # one row per node, in node order
        assert [x for x in row if x >= 0] == ancestors(parents, i)


@FAST
@given(parent_arrays())
def test_tree_from_parents_equals_tree_buffers(parents):
    paths = paths_of(parents)
    if not paths:
        return
    b = T.tree_buffers(paths)
    d = T.tree_from_parents(b.parents, b.depth)
    assert d.tree_mask.equal(b.tree_mask) and d.positions.equal(b.positions)
    rows = {tuple(r) for r in d.retrieve_indices.tolist()}
    assert {tuple(r) for r in b.retrieve_indices.tolist()} <= rows
    assert len(rows) == b.num_nodes


# ------------------------------------------------------------------ greedy

def greedy_reference(logits, draft, retrieve):
    """Per row: accepted prefix length; best = first row of max length."""
    target = logits.argmax(-1).tolist()
    lengths = []
    for row in retrieve.tolist():
        k = 0
        while k + 1 < len(row) and row[k + 1] >= 0 and draft[row[k + 1]] == target[row[k]]:
            k += 1
        lengths.append(k)
    best = lengths.index(max(lengths))
    row = retrieve[best].tolist()
    acc = lengths[best]
    path = row[:acc + 1] + [row[acc]] * (len(row) - acc - 1)
    return acc, path, target[row[acc]]


@FAST
@given(st.integers(1, 6), st.integers(0, 8), st.integers(0, 2**31))
def test_all_before_is_a_cumulative_and(L, D, seed):
    ok = torch.rand(L, D, generator=torch.Generator().manual_seed(seed)) < 0.7
    assert torch.equal(T.all_before(ok), ok.long().cumprod(1) > 0)


@FAST
@given(parent_arrays(), st.integers(2, 5), st.sampled_from(["random", "none", "all"]),
       st.booleans(), st.integers(0, 2**31))
def test_greedy_accept_bruteforce(parents, vocab, mode, per_node_rows, seed):
    g = torch.Generator().manual_seed(seed)
    n = len(parents)
    paths = paths_of(parents)
    t = T.tree_buffers(paths) if paths else T.tree_from_parents(torch.tensor(parents), 0)
    if per_node_rows:
        t = T.tree_from_parents(t.parents, t.depth)
    logits = torch.randn(n, vocab, generator=g)
    target = logits.argmax(-1)
    draft = torch.randint(0, vocab, (n,), generator=g)
    p = t.parents.clamp(min=0)
    if mode == "none":
        draft = (target[p] + 1) % vocab
    elif mode == "all":
        draft = target[p].clone()
    draft[0] = 7  # the root's token is never checked
    acc, path, nxt = T.greedy_accept(logits, draft, t.retrieve_indices)
    assert acc.dtype == path.dtype == nxt.dtype == torch.long and acc.dim() == nxt.dim() == 0
    assert path.shape == (t.depth + 1,)
    assert (acc.item(), path.tolist(), nxt.item()) == greedy_reference(logits, draft.tolist(), t.retrieve_indices)
    if mode == "none":
        assert acc.item() == 0 and path.tolist() == [0] * (t.depth + 1)
    if mode == "all":  # every node matches: a deepest path is accepted whole
        assert acc.item() == t.depth and t.positions[path[-1]].item() == t.depth


def test_emitted_tokens():
    draft = torch.tensor([9, 5, 6, 7, 8])
    tokens, count = T.emitted_tokens(draft, torch.tensor(2), torch.tensor([0, 2, 3, 3, 3]), torch.tensor(4))
    assert tokens.tolist() == [6, 7, 4, 4, 4] and count.item() == 3
    tokens, count = T.emitted_tokens(draft, torch.tensor(0), torch.tensor([0, 0, 0]), torch.tensor(1))
    assert tokens.tolist() == [1, 1, 1] and count.item() == 1


def test_medusa_draft_tokens():
    t = T.tree_buffers([[0], [1], [0, 0], [0, 1], [1, 0]], topk=3)
    topk = torch.tensor([[10, 11, 12], [20, 21, 22]])
    assert T.medusa_draft_tokens(torch.tensor(5), topk, t.tree_indices).tolist() == [5, 10, 11, 20, 21, 20]


@st.composite
def measured_ranks(draw, top=3):
    """fit_tree's input: [P, K] ranks of the true tokens, few distinct so that paths repeat;
    -1 (no target) and >= top (not drafted) are misses."""
    K, P = draw(st.integers(1, 3)), draw(st.integers(1, 40))
    return torch.tensor([[draw(st.sampled_from([0, 0, 0, 1, 2, -1, top + 2])) for _ in range(K)] for _ in range(P)])


@FAST
@given(measured_ranks(), st.integers(1, 12))
def test_tree_tau_is_what_greedy_acceptance_gives(ranks, size):
    """At each root, heads whose top-3 lists hold the true token at the measured rank, drafted into
    the fitted tree and verified by greedy_accept, accept tree_tau on average."""
    top, (P, K) = 3, ranks.shape
    paths = T.fit_tree(ranks, size, top)
    if not paths:  # nothing was ever drafted right
        assert T.tree_tau(ranks, paths) == 1 and bool(((ranks < 0) | (ranks >= top))[:, 0].all())
        return
    tree = T.tree_buffers(paths, topk=top)
    true = torch.arange(100, 100 + K)                                  # the tokens the base will emit
    accepted = 0
    for row in ranks.tolist():
        lists = torch.arange(K * top).reshape(K, top) + 200            # wrong guesses
        for k, r in enumerate(row):
            if 0 <= r < top:
                lists[k, r] = true[k]
        draft = T.medusa_draft_tokens(torch.tensor(1), lists, tree.tree_indices)
        # the base's next token after each node: the true one while the path so far is right
        target = []
        for i in range(tree.num_nodes):
            d = int(tree.positions[i])
            on_path = all(draft[j] == true[tree.positions[j] - 1] for j in torch.nonzero(tree.tree_mask[i]).flatten().tolist() if j)
            target.append(int(true[d]) if on_path and d < K else 0)
        logits = torch.nn.functional.one_hot(torch.tensor(target), 300).float()
        accepted += int(T.greedy_accept(logits, draft, tree.retrieve_indices)[0])
    assert T.tree_tau(ranks, paths) == pytest.approx(1 + accepted / P)


@FAST
@given(measured_ranks(), st.integers(1, 5))
def test_fit_tree_is_the_best_tree_of_its_size(ranks, size):
    top, K = 3, ranks.shape[1]
    paths = T.fit_tree(ranks, size, top)
    assert len(paths) <= size and len({tuple(p) for p in paths}) == len(paths)
    assert all(p[:-1] in paths for p in paths if len(p) > 1)          # a tree: every parent is in it
    # against every tree of at most `size` nodes with choices < top, at most K deep
    nodes = [p for d in range(1, K + 1) for p in itertools.product(range(top), repeat=d)]
    best = max(T.tree_tau(ranks, [list(p) for p in sub])
               for n in range(size + 1) for sub in itertools.combinations(nodes, n)
               if all(p[:-1] in sub for p in sub if len(p) > 1))
    assert T.tree_tau(ranks, paths) == pytest.approx(best)


def speed_of(counts, roots, paths, t_verify, t_draft, lookup=False):
    """Predicted speed-up of a static tree, straight from its definition."""
    tau = 1 + sum(counts.get(tuple(p), 0) for p in paths) / roots
    depth = max(len(p) for p in paths)
    nodes = len(paths) + 1 + (depth if lookup else 0)
    return tau * T.interpolate(t_verify, 1) / (T.interpolate(t_draft, depth) + T.interpolate(t_verify, nodes))


def test_interpolate_is_the_line_between_timed_sizes_and_past_them():
    timed = {1: 10.0, 4: 13.0, 16: 49.0}
    assert [T.interpolate(timed, N) for N in (1, 3, 4, 5, 16)] == [10.0, 12.0, 13.0, 16.0, 49.0]
    assert T.interpolate(timed, 20) == 61.0 and T.interpolate({8: 2.0}, 3) == 2.0   # extended; one size: flat


def test_choose_tree_follows_the_costs():
    """Plain decoding when verifying rows is dear; bigger, deeper trees as rows and levels get cheap."""
    ranks = torch.tensor([[0, 0, 0, 1]] * 50 + [[0, 1, 0, 0]] * 20 + [[1, 0, 2, 0]] * 20 + [[-1, 0, 0, 0]] * 10)
    counts, roots = T.prefix_counts(ranks, 3), ranks.shape[0]
    dear = T.choose_tree(counts, roots, {1: 1.0, 64: 64.0}, {1: 0.1, 4: 0.4})      # N rows cost N tokens
    assert dear["paths"] is None and dear["speedup"] == 1.0
    chosen = []
    for slope in (1.0, 0.3, 0.1, 0.01, 0.0):                                        # verification gets cheap
        r = T.choose_tree(counts, roots, {1: 1.0, 64: 1.0 + 63 * slope}, {1: 0.02, 4: 0.08})
        chosen.append((r["nodes"], r["depth"]))
        if r["paths"] is not None:
            assert r["speedup"] == pytest.approx(speed_of(counts, roots, r["paths"], {1: 1.0, 64: 1.0 + 63 * slope},
                                                          {1: 0.02, 4: 0.08}))
    assert chosen == sorted(chosen) and chosen[0] == (1, 0) and chosen[-1][1] == 4 and chosen[-1][0] > 5
    shallow = T.choose_tree(counts, roots, {1: 1.0, 64: 1.0}, {1: 0.02, 2: 0.04, 3: 1.0, 4: 2.0})
    assert shallow["depth"] == 2                                                    # deep levels too dear
    # a step's cost beyond its forwards: dear for the tree's step, plain decoding wins; for both, trees
    # pay their fixed cost over more tokens
    t_verify, t_draft = {1: 1.0, 64: 1.0 + 63 * 0.1}, {1: 0.02, 4: 0.08}
    assert T.choose_tree(counts, roots, t_verify, t_draft, overhead=(0.0, 5.0))["paths"] is None
    plain, both = (T.choose_tree(counts, roots, t_verify, t_draft, overhead=o) for o in ((0.0, 0.0), (0.5, 0.5)))
    assert both["speedup"] == pytest.approx(both["tau"] * 1.5 / (T.interpolate(t_draft, both["depth"]) +
                                                               T.interpolate(t_verify, both["nodes"]) + 0.5))
    assert (both["nodes"], both["depth"]) >= (plain["nodes"], plain["depth"]) and both["speedup"] > plain["speedup"]


def test_choose_tree_counts_the_lookup_branch():
    """With the lookup branch's hit rates, a step gets j tokens unless both branches miss there."""
    ranks = torch.tensor([[0, 0, 0, 1]] * 50 + [[0, 1, 0, 0]] * 20 + [[1, 0, 2, 0]] * 20 + [[-1, 0, 0, 0]] * 10)
    counts, roots = T.prefix_counts(ranks, 3), ranks.shape[0]
    t_verify, t_draft = {1: 1.0, 64: 1.5}, {1: 0.02, 4: 0.08}
    paid = T.choose_tree(counts, roots, t_verify, t_draft, lookup=True)
    zero = T.choose_tree(counts, roots, t_verify, t_draft, lookup=True, lookup_hits=[0.0] * 4)
    as_deep = [c for c in zero["candidates"] if c["chain"] == c["depth"]]  # (a deeper chain only costs here)
    assert [c["paths"] for c in as_deep] == [c["paths"] for c in paid["candidates"]]
    assert [c["speedup"] for c in as_deep] == pytest.approx([c["speedup"] for c in paid["candidates"]])
    assert zero["chain"] == zero["depth"] and all(c["chain"] == c["depth"] for c in paid["candidates"])
    hits = [0.5, 0.4, 0.3, 0.2]
    both = T.choose_tree(counts, roots, t_verify, t_draft, lookup=True, lookup_hits=hits)
    for c in both["candidates"]:
        head, chain = T.split_chain(c["paths"])
        assert chain == c["chain"] >= c["depth"] == max(map(len, head)) and c["nodes"] == len(head) + 1 + chain
        a = [sum(counts[tuple(p)] for p in head if len(p) == j) / roots for j in range(1, c["depth"] + 1)]
        assert c["tau"] == pytest.approx(1 + sum(x + y - x * y for x, y in zip(a, hits)) + sum(hits[c["depth"]:chain]))
    assert both["tau"] > paid["tau"] and both["speedup"] > paid["speedup"]
    # verification as cheap as this: the chain goes as deep as the hits reach, past the head's depth
    assert both["chain"] == 4 and all(c["chain"] == 4 for c in both["candidates"])


@FAST
@given(measured_ranks(), st.lists(st.floats(0.0, 2.0), min_size=3, max_size=3), st.floats(0.0, 0.5), st.booleans())
def test_choose_tree_is_the_fastest_tree_by_brute_force(ranks, rows, level, lookup):
    """Against every tree of choices < 3 up to 2 deep and 7 nodes, on made-up costs."""
    ranks = ranks[:, :2]
    top, K = 3, ranks.shape[1]
    t_verify = {1: 1.0, 4: 1.0 + rows[0], 8: 1.0 + rows[0] + rows[1], 16: 1.0 + sum(rows)}
    t_draft = {d: level * d for d in range(1, K + 1)}
    counts, roots = T.prefix_counts(ranks, top), ranks.shape[0]
    r = T.choose_tree(counts, roots, t_verify, t_draft, max_nodes=8, lookup=lookup)
    nodes = [p for d in range(1, K + 1) for p in itertools.product(range(top), repeat=d)]
    best = max([1.0] + [speed_of(counts, roots, [list(p) for p in sub], t_verify, t_draft, lookup)
                        for n in range(1, 8) for sub in itertools.combinations(nodes, n)
                        if all(p[:-1] in sub for p in sub if len(p) > 1)
                        and n + 1 + (max(map(len, sub)) if lookup else 0) <= 8])
    assert r["speedup"] == pytest.approx(best)


def joint_case(observed, rows, level):
    """choose_tree's inputs for steps observed with the lookup chain (n = 3) on trees of choices < 3 up
    to 2 deep, and made-up costs: (nodes, acc, counts, both, hits, t_verify, t_draft)."""
    nodes = [p for d in (1, 2) for p in itertools.product(range(3), repeat=d)]
    acc = T.step_counts(observed, nodes, 3)
    counts = {tuple(p): c for p, c in zip(acc["paths"], acc["counts"])}
    both = {tuple(p): c for p, c in zip(acc["paths"], acc["both"]["3"])}
    hits = [c / acc["roots"] for c in acc["lookup"]["counts"]["3"]]
    t_verify = {1: 1.0, 4: 1.0 + rows[0], 8: 1.0 + rows[0] + rows[1], 16: 1.0 + sum(rows)}
    t_draft = {1: level, 2: 2 * level}
    return nodes, acc, counts, both, hits, t_verify, t_draft


@st.composite
def observed_steps(draw):
    """step_counts' input: per step the accepted head path (choices < 3, at most 2 deep) and how
    many lookup tokens were right (0-3), few distinct so that they repeat."""
    chain = st.sampled_from([(), (0,), (0, 0), (0, 1), (1,), (1, 0), (2,), (0, 2)])
    return draw(st.lists(st.tuples(chain, st.sampled_from([0, 0, 1, 2, 3])), min_size=1, max_size=40))


@FAST
@given(observed_steps(), st.lists(st.floats(0.0, 2.0), min_size=3, max_size=3), st.floats(0.0, 0.5))
def test_choose_tree_with_joint_lookup_counts_is_the_fastest_by_brute_force(observed, rows, level):
    """Measured jointly, a step gets the deeper of the head's accepted path within the tree and the
    lookup chain's right tokens (as deep as the chain, at least the tree's depth): replayed step by
    step, against every tree of choices < 3 up to 2 deep and chain up to 3 deep that fits in 8 rows."""
    nodes, acc, counts, both, hits, t_verify, t_draft = joint_case(observed, rows, level)

    def replayed(sub, chain):
        depth = max(map(len, sub))
        tau = 1 + sum(max(max(d for d in range(len(p) + 1) if p[:d] in sub or d == 0), min(k, chain))
                      for p, k in observed) / len(observed)
        return tau, tau / (T.interpolate(t_draft, depth) + T.interpolate(t_verify, len(sub) + 1 + chain))

    r = T.choose_tree(counts, acc["roots"], t_verify, t_draft, max_nodes=8, lookup=True, lookup_hits=hits, both=both)
    for c in r["candidates"]:
        head, chain = T.split_chain(c["paths"])
        assert (c["tau"], c["speedup"]) == pytest.approx(replayed({tuple(p) for p in head}, chain))
    best = max([1.0] + [replayed(set(sub), chain)[1] for n in range(1, 8) for sub in itertools.combinations(nodes, n)
                        if all(p[:-1] in sub for p in sub if len(p) > 1)
                        for chain in range(max(map(len, sub)), max(max(map(len, sub)), len(hits)) + 1)
                        if n + 1 + chain <= 8])
    assert r["speedup"] == pytest.approx(best)


def replay(walk, nodes, chain):
    """Decoding replayed position by position: tokens a step."""
    tokens = steps = 0
    for prompt in walk:
        i = 0
        while i < len(prompt):
            p, k = prompt[i]
            i += 1 + max(max(d for d in range(len(p) + 1) if d == 0 or p[:d] in nodes), min(k, chain))
            steps += 1
        tokens += len(prompt)
    return tokens / steps


@st.composite
def walks(draw):
    """Per prompt, per position: the accepted head path (choices < 3, at most 2 deep) and the lookup's
    right tokens (0-4), often in runs, as a repeated span gives them."""
    path = st.sampled_from([(), (0,), (0, 0), (0, 1), (1,), (1, 0), (2,), (0, 2)])
    prompt = st.lists(st.tuples(path, st.sampled_from([0, 0, 1, 2, 4])), min_size=1, max_size=30)
    return draw(st.lists(prompt, min_size=1, max_size=3))


@FAST
@given(walks(), st.lists(st.tuples(st.sets(st.sampled_from([(0,), (0, 0), (0, 1), (1,), (1, 0), (2,)])),
                                   st.integers(0, 4)), min_size=1, max_size=5))
def test_walk_tau_is_the_decode_replayed(walk, trees):
    trees = [({p for p in nodes if p[:-1] in nodes or len(p) == 1}, chain) for nodes, chain in trees]
    assert T.walk_tau(walk, trees) == [pytest.approx(replay(walk, *t)) for t in trees]


@FAST
@given(walks(), st.lists(st.floats(0.0, 2.0), min_size=3, max_size=3), st.floats(0.0, 0.5))
def test_choose_tree_walks_each_candidate(walk, rows, level):
    """With positions measured, each candidate tree and chain is weighed at its tau walked through
    the text (not summed from the big tree's roots), and the fastest of them is chosen."""
    nodes, acc, counts, both, hits, t_verify, t_draft = joint_case([w for prompt in walk for w in prompt], rows, level)
    r = T.choose_tree(counts, acc["roots"], t_verify, t_draft, max_nodes=8, lookup=True, lookup_hits=hits,
                      both=both, walk=walk)
    for c in r["candidates"]:
        head, chain = T.split_chain(c["paths"])
        tau = replay(walk, {tuple(p) for p in head}, chain)
        assert c["tau"] == pytest.approx(tau)
        assert c["speedup"] == pytest.approx(tau / (level * c["depth"] + T.interpolate(t_verify, c["nodes"])))
        for deeper in range(chain + 1, min(len(hits), 8 - len(head) - 1) + 1):  # the best chain for this tree
            speed = replay(walk, {tuple(p) for p in head}, deeper) / (level * c["depth"] +
                                                                     T.interpolate(t_verify, len(head) + 1 + deeper))
            assert speed <= c["speedup"] * (1 + 1e-6)
    assert r["speedup"] == pytest.approx(max([1.0] + [c["speedup"] for c in r["candidates"]]))


def test_walk_tau_weighs_a_run_of_lookup_hits_once():
    """A repeated span: from each of its positions the chain is right to its end. Counted at every
    position the chain 4 deep is right 18 times in 26, tau 1.69; walked, the span takes 2 steps
    (4 tokens and the bonus, then 1 and the bonus), and the 26 positions 21 steps."""
    walk = [[((), 0)] * 10 + [((), 4), ((), 4), ((), 4), ((), 3), ((), 2), ((), 1)] + [((), 0)] * 10]
    assert T.walk_tau(walk, [(set(), 4), (set(), 2), (set(), 0)]) == pytest.approx([26 / 21, 26 / 22, 1.0])


# ------------------------------------------------------------------ dynamic trees

@st.composite
def pools(draw):
    """EAGLE-2-like pool: parents precede children, scores = cumulative log-probs. Steps
    are drawn from a few values (including 0) so there are many exact ties."""
    m = draw(st.integers(1, 30))
    parents = [-1] + [draw(st.integers(-1, i - 1)) for i in range(1, m)]
    steps = [draw(st.sampled_from([0.0, -0.5, -1.0, -2.0])) for _ in range(m)]
    scores = []
    for i in range(m):
        scores.append((scores[parents[i]] if parents[i] >= 0 else 0.0) + steps[i])
    total = draw(st.integers(2, m + 1))
    return parents, scores, total


def pool_depth(parents):
    return max(len(ancestors(parents, i)) for i in range(len(parents)))


@FAST
@given(pools(), st.integers(0, 2**31))
def test_dynamic_select(pool, seed):
    parents, scores, total = pool
    m, depth = len(parents), pool_depth(parents)
    tokens = torch.randint(0, 100, (m,), generator=torch.Generator().manual_seed(seed))
    draft, t = T.dynamic_select(torch.tensor(scores), torch.tensor(parents), tokens, total, depth, torch.tensor(3))
    assert draft.shape == (total,) and t.tree_mask.shape == (total, total)
    assert t.retrieve_indices.shape == (total, depth + 1) and draft[0].item() == 3
    # which pool nodes were kept: recover from tokens would be ambiguous, so redo the choice
    keep = sorted(sorted(range(m), key=lambda i: (-scores[i], i))[:total - 1])
    assert sorted(scores[i] for i in keep) == sorted(sorted(scores)[::-1][:total - 1])
    assert all(parents[i] in keep or parents[i] == -1 for i in keep)  # ancestor-closed
    assert draft[1:].tolist() == [tokens[i].item() for i in keep]
    want = [-1] + [keep.index(parents[i]) + 1 if parents[i] >= 0 else 0 for i in keep]
    check_tree(t, want)


def test_dynamic_select_dropped_parent():
    # scores rise along 0 -> 1 and 2 -> 3 -> 4 (a broken drafter): parents 0 and 3 drop
    parents = torch.tensor([-1, 0, -1, 2, 3])
    scores = torch.tensor([-5.0, -0.1, -1.0, -9.0, -0.2])
    tokens = torch.tensor([10, 11, 12, 13, 14])
    draft, t = T.dynamic_select(scores, parents, tokens, 4, 3, torch.tensor(1))
    assert draft.tolist() == [1, 11, 12, 14]
    # 1 hangs from the root, 4 from its nearest kept ancestor 2
    check_tree(t, [-1, 0, 0, 2])
    logits = torch.full((4, 20), -10.0)
    logits[0, 12], logits[2, 14], logits[3, 5] = 10, 10, 10
    acc, path, nxt = T.greedy_accept(logits, draft, t.retrieve_indices)
    assert (acc.item(), path.tolist(), nxt.item()) == (2, [0, 2, 3, 3], 5)


# ------------------------------------------------------------------ typical

def typical_reference(logits, draft, retrieve, temperature, threshold=0.09, alpha=0.3):
    """Medusa's evaluate_posterior on each row, in plain Python loops."""
    probs = torch.softmax(logits.double() / temperature, -1)
    lengths, liks = [], []
    for row in retrieve.tolist():
        k, lik = 0, 0.0
        while k + 1 < len(row) and row[k + 1] >= 0:
            pr = probs[row[k]]
            ent = -(pr * torch.log(pr + 1e-5)).sum().item()
            p = pr[draft[row[k + 1]]].item()
            if not p > min(threshold, alpha * math.exp(-ent)):
                break
            k, lik = k + 1, lik + math.log(p)
        lengths.append(k)
        liks.append(lik)
    best_len = max(lengths)
    return best_len, max((liks[i], -i) for i in range(len(lengths)) if lengths[i] == best_len)


@pytest.mark.parametrize("name", ["tree16", "mc_sim_7b_63"])
def test_typical_accept(name):
    t = T.tree_buffers(T.load_tree(name))
    g = torch.Generator().manual_seed(0)
    n, v = t.num_nodes, 50
    for seed in range(20):
        logits = torch.randn(n, v, generator=g) * (seed % 4)
        draft = torch.randint(0, 6, (n,), generator=g)
        acc, path, nxt = T.typical_accept(logits, draft, t.retrieve_indices, 0.7, generator=g)
        ref_len, (_, neg_row) = typical_reference(logits, draft.tolist(), t.retrieve_indices, 0.7)
        assert acc.item() == ref_len
        assert path[:ref_len + 1].tolist() == t.retrieve_indices[-neg_row, :ref_len + 1].tolist()
        assert 0 <= nxt.item() < v
        # temperature 0 is greedy
        g0 = T.typical_accept(logits, draft, t.retrieve_indices, 0.0)
        g1 = T.greedy_accept(logits, draft, t.retrieve_indices)
        assert all(a.equal(b) for a, b in zip(g0, g1))
    # a confident model whose argmax is the draft along the deepest first path: all accepted
    logits = torch.randn(n, v, generator=g)
    draft = torch.randint(0, v, (n,), generator=g)
    deep = t.retrieve_indices[t.positions[t.retrieve_indices.max(1).values].argmax()]
    for a, b in zip(deep[:-1].tolist(), deep[1:].tolist()):
        logits[a, draft[b]] = 30.0
    acc, path, nxt = T.typical_accept(logits, draft, t.retrieve_indices, 1.0, generator=g)
    assert acc.item() == t.depth and path.tolist() == deep.tolist()


# ------------------------------------------------------------------ sampling

def chi2_pvalue(counts, probs, min_expected=5.0):
    """Pearson chi-square test of counts against probs; cells expected < 5 are pooled
    (the chi-square approximation needs that)."""
    counts, probs = np.asarray(counts, float).ravel(), np.asarray(probs, float).ravel()
    assert abs(probs.sum() - 1) < 1e-6
    n = counts.sum()
    expected = n * probs
    small = expected < min_expected
    obs = np.append(counts[~small], counts[small].sum())
    exp = np.append(expected[~small], expected[small].sum())
    if exp[-1] == 0:
        if obs[-1] > 0:
            return 0.0
        obs, exp = obs[:-1], exp[:-1]
    stat = ((obs - exp) ** 2 / exp).sum()
    dof = len(obs) - 1
    return torch.special.gammaincc(torch.tensor(dof / 2, dtype=torch.float64),
                                   torch.tensor(stat / 2, dtype=torch.float64)).item()


def test_logits_to_probs_and_sample():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    assert T.logits_to_probs(logits, 0.0).tolist() == [[1, 0, 0, 0, 0, 0]]
    assert torch.allclose(T.logits_to_probs(logits, 0.5), torch.softmax(logits / 0.5, -1))
    p = T.logits_to_probs(logits, 1.0, top_k=2)
    assert (p[0, 2:] == 0).all() and torch.allclose(p[0, :2], torch.softmax(logits[0, :2], -1))
    full = torch.softmax(logits, -1)[0]
    p = T.logits_to_probs(logits, 1.0, top_p=0.8)  # keeps the fewest top tokens with mass >= 0.8
    k = int((full.cumsum(0) < 0.8).sum()) + 1
    assert (p[0, k:] == 0).all() and torch.allclose(p[0, :k], full[:k] / full[:k].sum())
    assert T.logits_to_probs(logits, 1.0, top_p=1e-9)[0].tolist() == [1, 0, 0, 0, 0, 0]
    g = torch.Generator().manual_seed(0)
    probs = torch.softmax(torch.randn(6, generator=g), -1)
    x = T.sample(probs.expand(20000, 6), g)
    assert chi2_pvalue(torch.bincount(x, minlength=6), probs) > 1e-4
    assert (T.sample(torch.tensor([[0.0, 0, 1, 0]]).expand(1000, 4), g) == 2).all()


V = 6
TRIALS = 20000  # see test_sample_accept_is_lossless for the tolerance


def target_logits(prefix):
    """A genuine conditional model: logits of the next token depend on the whole prefix."""
    rng = random.Random(repr(tuple(prefix)))
    return torch.tensor([rng.gauss(0.0, 1.2) for _ in range(V)])


STAT_TREE = [[0], [1], [2], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0], [0, 0, 0], [0, 0, 1], [1, 0, 0]]


def step_inputs(prefix, duplicates):
    """Tree, draft tokens and base logits for a decode step whose root ends prefix.
    Draft tokens: siblings' tokens are distinct (a top-k drafter) unless duplicates."""
    t = T.tree_buffers(STAT_TREE)
    rng = random.Random(repr(("draft",) + tuple(prefix)))
    n = t.num_nodes
    draft = [prefix[-1]] + [0] * (n - 1)
    kids = {}
    for i in range(1, n):
        kids.setdefault(t.parents[i].item(), []).append(i)
    for p, ks in kids.items():
        toks = rng.sample(range(V), len(ks))
        if duplicates and len(ks) > 1:
            toks[1] = toks[0]
        for i, x in zip(ks, toks):
            draft[i] = x
    seq = {0: list(prefix)}
    for i in range(1, n):
        seq[i] = seq[t.parents[i].item()] + [draft[i]]
    logits = torch.stack([target_logits(seq[i]) for i in range(n)])
    return t, torch.tensor(draft), logits


def run_ours(prefix, trials, duplicates, temperature=1.0, top_k=0, top_p=1.0, seed=0):
    """Emitted tokens of `trials` independent decode steps: list of [count] lists."""
    t, draft, logits = step_inputs(prefix, duplicates)
    torch.manual_seed(seed)  # vmap draws from the global generator
    step = torch.vmap(lambda lg: T.emitted_tokens(draft, *T.sample_accept(lg, draft, t, temperature, top_k, top_p)),
                      randomness="different")
    tokens, counts = step(logits.expand(trials, *logits.shape))
    return [tok[:c] for tok, c in zip(tokens.tolist(), counts.tolist())]


def run_reference(prefix, trials, duplicates, bug=None, seed=0):
    """The sequential SpecInfer/EAGLE rule in plain Python (try siblings one by one,
    renormalise after a rejection), and deliberately wrong variants of it."""
    t, draft, logits = step_inputs(prefix, duplicates)
    probs = torch.softmax(logits.double(), -1).numpy()
    parents = t.parents.tolist()
    kids = [[j for j in range(len(parents)) if parents[j] == i] for i in range(len(parents))]
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(trials):
        node, emitted = 0, []
        while True:
            p = probs[node].copy()
            nxt = None
            for c in kids[node]:
                x = draft[c].item()
                q = probs[node][x] if bug == "no_renormalise" else p[x] / p.sum()
                if bug == "accept_always" or rng.random() < q:
                    nxt = c
                    break
                p[x] = 0.0
            if nxt is None:
                if bug == "no_residual":
                    p = probs[node]
                emitted.append(int(rng.choice(V, p=p / p.sum())))
                break
            emitted.append(draft[nxt].item())
            node = nxt
        out.append(emitted)
    return out


def first_two(run, prefix, trials, seed=0, **kw):
    """Counts [V, V] of the first two emitted tokens; a step that emits one token is
    followed by a fresh step rooted at it, as the decode loop does."""
    counts = np.zeros((V, V))
    outs = run(prefix, trials, seed=seed, **kw)
    again = {}
    for o in outs:
        if len(o) >= 2:
            counts[o[0], o[1]] += 1
        else:
            again[o[0]] = again.get(o[0], 0) + 1
    for x1, k in again.items():
        for o in run(prefix + [x1], k, seed=seed + 100 + x1, **kw):  # fresh noise
            counts[x1, o[0]] += 1
    return counts


def pair_probs(prefix, temperature=1.0, top_k=0, top_p=1.0):
    p1 = T.logits_to_probs(target_logits(prefix).double(), temperature, top_k, top_p)
    return np.stack([p1[a].item() * T.logits_to_probs(target_logits(prefix + [a]).double(), temperature, top_k, top_p).numpy()
                     for a in range(V)])


# Tolerance: a chi-square test at p > 1e-4 per check. Seeds are fixed, so the outcome is
# deterministic; the bound says a correct sampler would fail one such check for about 1
# in 10^4 seed choices (1M-trial runs of ours give unremarkable p-values), while each
# wrong variant below is off by far more than the noise of even 5000 trials (p < 1e-25),
# so the same check has the power to fail.
@pytest.mark.parametrize("duplicates", [False, True])
def test_sample_accept_is_lossless(duplicates):
    prefix = [3, 1]
    pairs = pair_probs(prefix)
    first = np.bincount([o[0] for o in run_ours(prefix, TRIALS, duplicates, seed=0)], minlength=V)
    assert chi2_pvalue(first, pairs.sum(1)) > 1e-4
    assert chi2_pvalue(first_two(run_ours, prefix, TRIALS, duplicates=duplicates, seed=1), pairs) > 1e-4
    # an independent check of the closed form: the sequential rule, same test
    assert chi2_pvalue(first_two(run_reference, prefix, TRIALS // 4, duplicates=duplicates), pairs) > 1e-4


@pytest.mark.parametrize("bug", ["accept_always", "no_residual", "no_renormalise"])
def test_sample_accept_check_catches_wrong_rules(bug):
    prefix = [3, 1]
    pairs = pair_probs(prefix)
    assert chi2_pvalue(first_two(run_reference, prefix, TRIALS // 4, duplicates=False, bug=bug), pairs) < 1e-6


def test_sample_accept_processed_target():
    # temperature, top-k and top-p change the target; the first token must follow it
    prefix = [0]
    for temperature, top_k, top_p in [(0.6, 3, 1.0), (1.3, 0, 0.7)]:
        want = T.logits_to_probs(target_logits(prefix), temperature, top_k, top_p).numpy()
        outs = run_ours(prefix, TRIALS, False, temperature, top_k, top_p, seed=2)
        assert chi2_pvalue(np.bincount([o[0] for o in outs], minlength=V), want / want.sum()) > 1e-4


def test_sample_accept_temperature_zero_is_greedy():
    g = torch.Generator().manual_seed(0)
    t = T.tree_buffers(T.load_tree("mc_sim_7b_63"))
    accepted = []
    for _ in range(20):
        logits = torch.randn(t.num_nodes, 12, generator=g)
        # siblings get distinct tokens (a head's top-10 of 12), as a real drafter's do
        topk = torch.stack([torch.randperm(12, generator=g)[:10] for _ in range(4)])
        draft = T.medusa_draft_tokens(torch.tensor(0), topk, t.tree_indices)
        a = T.sample_accept(logits, draft, t, 0.0, generator=g)
        b = T.greedy_accept(logits, draft, t.retrieve_indices)
        assert all(x.equal(y) for x, y in zip(a, b))
        accepted.append(a[0].item())
    assert max(accepted) >= 2  # the check is not vacuous


# ------------------------------------------------------------------ compile

def test_per_step_functions_never_read_data():
    """On the meta device there is no data, so any host sync (.item(), a 0-dim tensor
    index, a data-dependent shape) raises: a cheap stand-in for fullgraph compiles."""
    t = T.tree_buffers(T.load_tree("tree16")).to("meta")
    n, v, d = t.num_nodes, 11, t.depth
    logits, draft = torch.randn(n, v, device="meta"), torch.zeros(n, dtype=torch.long, device="meta")
    for out in [T.greedy_accept(logits, draft, t.retrieve_indices),
                T.typical_accept(logits, draft, t.retrieve_indices, 0.7),
                T.sample_accept(logits, draft, t, 0.7, top_k=5, top_p=0.9)]:
        acc, path, nxt = out
        assert acc.shape == nxt.shape == () and path.shape == (d + 1,) and path.dtype == torch.long
        tokens, count = T.emitted_tokens(draft, acc, path, nxt)
        assert tokens.shape == (d + 1,) and count.shape == ()
    m = 12
    scores, parents = torch.zeros(m, device="meta"), torch.zeros(m, dtype=torch.long, device="meta")
    draft, dt = T.dynamic_select(scores, parents, parents, 8, 3, draft[0])
    assert draft.shape == (8,) and dt.tree_mask.shape == (8, 8) and dt.retrieve_indices.shape == (8, 4)
    assert T.medusa_draft_tokens(draft[0], torch.zeros(4, 3, dtype=torch.long, device="meta"),
                                 t.tree_indices).shape == (n,)


def test_dynamo_traces_this_module():
    # dynamo skips any top-level module named `tree` (dm-tree): hence the name trees.py
    import torch._dynamo.trace_rules as rules
    assert not rules.check_file(T.__file__).skipped



@pytest.mark.slow
@pytest.mark.skipif(not os.environ.get("RUN_SLOW"), reason="compiles for about a minute; set RUN_SLOW=1")
def test_compiles_fullgraph():
    t = T.tree_buffers(T.load_tree("tree10"))

    def step(logits, draft_tokens, scores, pool_parents, pool_tokens):
        a = T.greedy_accept(logits, draft_tokens, t.retrieve_indices)
        b = T.sample_accept(logits, draft_tokens, t, 0.8, top_k=4, top_p=0.9)
        c = T.typical_accept(logits, draft_tokens, t.retrieve_indices, 0.8)
        d, dt = T.dynamic_select(scores, pool_parents, pool_tokens, 5, 2, draft_tokens[0])
        e = T.greedy_accept(logits[:5], d, dt.retrieve_indices)
        return a, b, c, e, T.emitted_tokens(draft_tokens, *a)

    args = (torch.randn(10, 16), torch.randint(0, 16, (10,)), torch.tensor([-1.0, -0.5, -2.0, -1.5, -3.0, -0.7]),
            torch.tensor([-1, -1, 0, 1, 1, -1]), torch.arange(6))
    eager = step(*args)
    compiled = torch.compile(step, fullgraph=True)(*args)
    for i in (0, 3, 4):
        assert all(x.equal(y) for x, y in zip(eager[i], compiled[i]))
    assert compiled[1][0] >= 0 and compiled[2][0] >= 0


@settings(max_examples=50, deadline=None)
@given(rows=st.integers(1, 5), V=st.integers(1, 300), levels=st.integers(1, 4), seed=st.integers(0, 2**16))
def test_argmax_is_torchs_first_maximum(rows, V, levels, seed):
    """trees.argmax (the greedy token: a max and a min, or for bf16 the kernels' op once built)
    equals torch's argmax, ties (few distinct values) included, in fp32 and bf16."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, levels, (rows, V), generator=g).float()
    for t in (x, x.bfloat16(), torch.randn(rows, V, generator=g).bfloat16()):
        assert torch.equal(T.argmax(t), t.argmax(-1))
        assert torch.equal(T.argmax(t[0]), t[0].argmax(-1))


def test_argmax_compiled():
    """Compiled (inductor, as the steps compile it), over several rows and one, with ties."""
    x = torch.randint(0, 3, (13, 4099)).bfloat16()
    f = torch.compile(T.argmax, fullgraph=True, dynamic=False)
    assert torch.equal(f(x), x.argmax(-1)) and torch.equal(f(x[:1]), x[:1].argmax(-1))
