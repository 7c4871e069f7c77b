"""Token trees for speculative decoding: static (Medusa) and dynamic (EAGLE-2) tree
buffers, and tree verification (greedy, typical, lossless sampling).

Conventions: a tree has N nodes, node 0 is the root = the last emitted token, which is
not yet in the KV cache. Parents precede children (nodes are sorted by depth).
logits[i] from the base model's one forward over the tree is the distribution of the
token that FOLLOWS node i. draft_tokens[i] is the token of node i.

Everything below the "per decode step" line is pure tensor code with static shapes and
no host syncs, so it traces under torch.compile(fullgraph=True).
"""
import json
import os
from dataclasses import dataclass, fields
from typing import Optional

import torch
from torch import Tensor


# Medusa's medusa_choices format: a node is its index path from the root, [0, 1] = top-1
# of head 1, then top-2 of head 2. The root is implicit.
MEDUSA_TREES = {
    # FasterDecoding/Medusa medusa/model/medusa_choices.py, found by simulation for vicuna-7b
    "mc_sim_7b_63": [
        [0], [0, 0], [1], [0, 1], [2], [0, 0, 0], [1, 0], [0, 2], [3], [0, 3], [4], [0, 4],
        [2, 0], [0, 5], [0, 0, 1], [5], [0, 6], [6], [0, 7], [0, 1, 0], [1, 1], [7], [0, 8],
        [0, 0, 2], [3, 0], [0, 9], [8], [9], [1, 0, 0], [0, 2, 0], [1, 2], [0, 0, 3], [4, 0],
        [2, 1], [0, 0, 4], [0, 0, 5], [0, 0, 0, 0], [0, 1, 1], [0, 0, 6], [0, 3, 0], [5, 0],
        [1, 3], [0, 0, 7], [0, 0, 8], [0, 0, 9], [6, 0], [0, 4, 0], [1, 4], [7, 0], [0, 1, 2],
        [2, 0, 0], [3, 1], [2, 2], [8, 0], [0, 5, 0], [1, 5], [1, 0, 1], [0, 2, 1], [9, 0],
        [0, 6, 0], [0, 0, 0, 1], [1, 6], [0, 7, 0],
    ],
    # small trees for CPU runs and tests
    "chain4": [[0], [0, 0], [0, 0, 0], [0, 0, 0, 0]],
    "tree10": [[0], [1], [2], [0, 0], [0, 1], [1, 0], [0, 0, 0], [0, 0, 1], [0, 0, 0, 0]],
    "tree16": [
        [0], [1], [2], [3], [0, 0], [0, 1], [0, 2], [1, 0], [1, 1], [2, 0],
        [0, 0, 0], [0, 0, 1], [0, 1, 0], [1, 0, 0], [0, 0, 0, 0],
    ],
}


@dataclass
class Tree:
    tree_mask: Tensor                     # bool [N, N]; [i, j] = j is i or an ancestor of i
    positions: Tensor                     # long [N]; depth of node, root 0
    parents: Tensor                       # long [N]; root -1
    retrieve_indices: Tensor              # long [L, D+1]; root-first paths, -1 padded
    tree_indices: Optional[Tensor] = None  # long [N]; static trees: index into candidates

    @property
    def depth(self) -> int:  # D, static: from a shape, so it is an int under compile
        return self.retrieve_indices.shape[1] - 1

    @property
    def num_nodes(self) -> int:
        return self.parents.shape[0]

    def to(self, device) -> "Tree":
        buffers = {f.name: getattr(self, f.name) for f in fields(self)}
        return Tree(**{k: v if v is None else v.to(device) for k, v in buffers.items()})


LOOKUP_MAX = 16  # the deepest prompt-lookup chain (heads.NGram's proposal)


def split_chain(paths: list) -> tuple:
    """A tree's index paths -> (the head's paths, the depth of the prompt-lookup chain it names with
    a path [-1, 0, ..., 0], or None where it names none: then a lookup chain is as deep as the tree)."""
    chain = [len(p) for p in paths if p[0] == -1]
    return [p for p in paths if p[0] != -1], (chain[0] if chain else None)


def load_tree(name_or_path: str) -> list:
    """A named tree from MEDUSA_TREES or a JSON file holding a list of index paths; one path may
    be [-1, 0, ..., 0], the prompt-lookup chain (with --lookup) as deep as it is long (split_chain)."""
    bad = (f"unknown tree {name_or_path!r}: give one of {', '.join(MEDUSA_TREES)} "
           f"or a JSON file of index paths")
    if name_or_path in MEDUSA_TREES:
        return [list(p) for p in MEDUSA_TREES[name_or_path]]
    if not os.path.isfile(name_or_path):
        raise ValueError(bad)
    try:
        with open(name_or_path) as f:
            paths = json.load(f)
    except (OSError, ValueError) as e:
        raise ValueError(f"{bad} ({e})") from None
    ok = isinstance(paths, list) and len(paths) > 0 and all(
        isinstance(p, list) and len(p) > 0 and all(type(c) is int and c >= 0 for c in p[1:])
        and type(p[0]) is int and p[0] >= -1 for p in paths)
    if not ok:
        raise ValueError(f"{bad} (want a non-empty list of non-empty lists of ints >= 0)")
    chains = [p for p in paths if p[0] == -1]
    if len(chains) > 1 or any(any(p[1:]) or len(p) > LOOKUP_MAX for p in chains) or len(chains) == len(paths):
        raise ValueError(f"{name_or_path}: one path [-1, 0, ..., 0] at most, at most {LOOKUP_MAX} long, "
                         "beside the head's paths (it is the prompt-lookup chain)")
    return paths



def prefix_counts(ranks: Tensor, top: int = 10) -> dict:
    """{index path: how many roots' ranks start with it}. ranks: [P, K] long, at P roots the rank
    of the true token in head k's draft, given the true tokens before it as an accepted path has
    them (< 0 or >= top: a miss)."""
    counts = {}
    for row in ranks.tolist():
        path = ()
        for r in row:
            if r < 0 or r >= top:
                break
            path += (r,)
            counts[path] = counts.get(path, 0) + 1
    return counts


def lookup_counts(seq: list, start: int, n: int = 3, depth: int = 4) -> list:
    """Prompt lookup (heads.NGram) replayed on a known sequence: at each root t >= start (seq[t]
    just emitted), the chain it proposes (what followed the latest earlier match of the longest of
    the last n..1 tokens) and how many of its first `depth` tokens are right. Returns [c_1..c_depth]:
    how many roots get at least j right, over len(seq) - 1 - start roots."""
    last = [dict() for _ in range(n + 1)]        # g -> {g tokens: where the latest match ends}
    hits = [0] * depth
    for t in range(len(seq) - 1):
        for g in range(1, n + 1):                # matches end before t: the g-grams ending at t - 1
            if t - g >= 0:
                last[g][tuple(seq[t - g:t])] = t - 1
        if t < start:
            continue
        end = next((last[g].get(tuple(seq[t - g + 1:t + 1])) for g in range(n, 0, -1)
                    if t - g + 1 >= 0 and tuple(seq[t - g + 1:t + 1]) in last[g]), None)
        if end is None:
            continue
        for j in range(depth):                   # the engine reads past the root as the root itself
            if t + 1 + j >= len(seq) or seq[min(end + 1 + j, t)] != seq[t + 1 + j]:
                break
            hits[j] += 1
    return hits


def best_paths(counts: dict, size: int, max_depth: int = 0) -> list:
    """The `size` most frequent paths (at most max_depth long, 0: any), ties to the shorter: a
    prefix is at least as frequent as its extensions, so they are a tree, and the best one of
    `size` nodes (and that depth) for these ranks."""
    ok = [p for p in counts if not max_depth or len(p) <= max_depth]
    return [list(p) for p in sorted(ok, key=lambda p: (-counts[p], len(p), p))[:size]]


def best_subtrees(values: dict, size: int, max_depth: int = 0) -> list:
    """The best tree of each size: [k] -> (value, paths) for the tree of exactly k nodes (index paths
    at most max_depth long, 0: any, every parent in it) whose values sum highest (None: no tree of k
    nodes). A knapsack over the tree, child by child (values need not shrink with depth: a node's
    worth can be what the lookup branch does not already get)."""
    ok = sorted(p for p in values if (not max_depth or len(p) <= max_depth))
    children = {}
    for p in ok:
        children.setdefault(p[:-1], []).append(p)

    def solve(p):  # [k] -> (value, paths) of the best k nodes under p, p itself counted as one
        best = [(values.get(p, 0.0), [p] if p else [])]
        for c in children.get(p, []):
            sub, merged = solve(c), list(best) + [None] * size
            for i, b in enumerate(best):
                for j, s in enumerate(sub, 1):
                    if b is not None and s is not None and i + j <= size and \
                            (merged[i + j] is None or b[0] + s[0] > merged[i + j][0]):
                        merged[i + j] = (b[0] + s[0], b[1] + s[1])
            best = merged[:size + 1]
            while best[-1] is None:
                best.pop()
        return best
    return [(v, sorted(ps, key=lambda p: (len(p), p))) if ps is not None else None
            for v, ps in ((b or (None, None)) for b in solve(()))]


def fit_tree(ranks: Tensor, size: int, top: int = 10) -> list:
    """Medusa's tree search (it simulated head accuracies for vicuna-7b to get mc_sim_7b_63), on
    measured ranks instead (see prefix_counts). A node, an index path, is accepted at a root iff
    the root's ranks start with it, so a tree's expected tau is 1 + the sum over its nodes of the
    fraction of roots that start so (tree_tau), and the `size` most frequent prefixes maximise it.
    Returns index paths."""
    return best_paths(prefix_counts(ranks, top), size)


def step_counts(observed: list, paths: list, n: int) -> dict:
    """Acceptance as the step sees it (bench.py acceptance), in acceptance.json's layout.
    observed: per step of a tree of index paths `paths`, (the index path of the deepest head node the
    base accepted, () if none; how many of the lookup chain's tokens it accepted, n its n-gram
    length). Returns dict(roots, paths: every path of the tree, counts: roots whose accepted path
    starts with each path, both: those of them whose lookup chain was right as deep too,
    lookup: dict(roots, counts {n: [roots with j right, j = 1..]}))."""
    counts, both = {tuple(p): 0 for p in paths}, {tuple(p): 0 for p in paths}
    depth = max([len(p) for p, _ in observed] + [k for _, k in observed] + [1])
    hits = [0] * depth
    for path, k in observed:
        for d in range(1, len(path) + 1):
            counts[path[:d]] = counts.get(path[:d], 0) + 1
            both[path[:d]] = both.get(path[:d], 0) + (k >= d)
        for j in range(k):
            hits[j] += 1
    paths = sorted(counts, key=lambda p: (-counts[p], len(p), p))
    return dict(roots=len(observed), paths=[list(p) for p in paths], counts=[counts[p] for p in paths],
                both={str(n): [both[p] for p in paths]}, lookup=dict(roots=len(observed), counts={str(n): hits}))


def walk_tau(walk: list, trees: list) -> list:
    """Tokens a step of each tree, walked through known text: decoding accepts, at a root, the deeper
    of the head's accepted path within the tree and the lookup chain's right tokens (as deep as the
    chain), then roots at the token after them. walk: per prompt, per position of its greedy text
    (each a root, bench.py acceptance), (the deepest path of a big tree the base accepts there,
    as a tuple; how many of the lookup chain's tokens are right). trees: [(the head's index paths,
    a set of tuples within the big tree; the lookup chain's depth)]. Counting hits at the roots of
    one tree's decode overrates another tree's: its roots fall elsewhere, and hits come in runs
    (a repeated span), which a stronger tree crosses in fewer steps (docs/speed.md)."""
    seen = sorted({p for prompt in walk for p, _ in prompt}, key=lambda p: (len(p), p))
    index = {p: i for i, p in enumerate(seen)}
    best = torch.tensor([index[p] for prompt in walk for p, _ in prompt], dtype=torch.long)   # [M]
    k = torch.tensor([j for prompt in walk for _, j in prompt], dtype=torch.long)             # [M]
    lengths = torch.tensor([len(w) for w in walk], dtype=torch.long)
    ends = lengths.cumsum(0).repeat_interleave(lengths)                                      # [M] its prompt's end
    M, taus, C = best.shape[0], [], 256  # C trees at a time: [C, M] longs, 19 MB for 9,145 positions
    for lo in range(0, len(trees), C):   # [C, M] accepted tokens a step
        chunk = trees[lo:lo + C]
        within = torch.tensor([[max(d for d in range(len(p) + 1) if d == 0 or p[:d] in nodes) for p in seen]
                               for nodes, _ in chunk], dtype=torch.long)                       # [C, P]
        chain = torch.tensor([c for _, c in chunk], dtype=torch.long)[:, None]
        jump = torch.minimum(torch.arange(M) + 1 + torch.maximum(within[:, best], k.minimum(chain)), ends)
        jump = torch.cat([jump, torch.full((len(chunk), 1), M)], 1)                             # [C, M+1]
        at, steps = torch.zeros(len(chunk), dtype=torch.long), torch.zeros(len(chunk), dtype=torch.long)
        while (at < M).any():
            steps += at < M
            at = jump.gather(1, at[:, None])[:, 0]
        taus += (M / steps.clamp(min=1)).tolist()
    return taus


def step_walk(step: dict, n: int = 0) -> Optional[list]:
    """bench.py acceptance's positions (its step's "walk") as walk_tau takes them: per prompt, per
    position (the deepest accepted head path, () for none; the right tokens of the n-gram lookup
    chain of length n, 0 for n = 0). None where nothing was walked, or not with that lookup."""
    w, paths = step.get("walk"), [tuple(p) for p in step["paths"]] + [()]  # best -1: ()
    if not w or not sum(w["lengths"]) or (n and str(n) not in w.get("lookup", {})):
        return None
    ks = w["lookup"][str(n)] if n else None
    out, at = [], 0
    for length in w["lengths"]:
        out.append([(paths[w["best"][i]], ks[i] if ks else 0) for i in range(at, at + length)])
        at += length
    return out


def interpolate(costs: dict, n: int) -> float:
    """costs {N: seconds} measured at some N, read at n: piecewise linear, extended past the ends."""
    xs = sorted(costs)
    if len(xs) == 1:
        return costs[xs[0]]
    i = max(1, min(len(xs) - 1, next((j for j, x in enumerate(xs) if x >= n), len(xs) - 1)))
    x0, x1 = xs[i - 1], xs[i]
    return costs[x0] + (costs[x1] - costs[x0]) * (n - x0) / (x1 - x0)


PLAIN = dict(paths=None, nodes=1, depth=0, chain=0, tau=1.0, speedup=1.0)  # choose_tree's plain decoding


def choose_tree(counts: dict, roots: int, t_verify: dict, t_draft: dict, max_nodes: int = 64,
                lookup: bool = False, lookup_hits: Optional[list] = None, both: Optional[dict] = None,
                overhead: tuple = (0.0, 0.0), walk: Optional[list] = None) -> dict:
    """The static tree that maximises expected tokens per second (Sequoia's objective) on this
    machine: for every size n and depth limit d, the best tree (best_subtrees) has expected tau
    1 + sum(counts) / roots and costs t_draft[depth] + t_verify(nodes) a step, against
    t_verify(1) a token for plain decoding. counts, roots: the head's prefix counts over `roots`
    roots (held-out: prefix_counts; measured in the step: step_counts). t_verify {N: s}: a base forward over N tree rows;
    t_draft {depth: s}: the head's draft of that many levels (both read by `interpolate`). lookup: a prompt-lookup chain at
    least as deep as the tree rides along (deeper, as far as lookup_hits reach: a chain's nodes cost no
    draft level, and where the context repeats itself it runs past the head's): its nodes are paid for, and with lookup_hits [b_1, b_2, ...] (the
    fraction of roots where its first j tokens are right, lookup_counts) counted too, as if the two
    branches erred independently: a step gets j tokens past the root unless both miss there, so
    tau = 1 + sum_j (1 - (1 - a_j)(1 - b_j)), a_j the tree's fraction of roots accepted to depth j
    (without lookup_hits the choice is conservative; with them the candidates are still the head's
    most frequent prefixes, so the brute-force optimum is promised only without). both {path: roots}:
    measured jointly (step_counts), how many of a path's roots the lookup chain got as deep too; then
    no independence is assumed: tau = 1 + sum_j b_j + sum over the tree's paths of (counts - both) / roots.
    overhead (o_ar, o_spec): seconds a decode step costs beyond its forwards (the loop's host sync,
    sampling or acceptance, compaction), added to plain decoding's step and to every tree's.
    walk (walk_tau's, over the big tree whose steps gave the counts): then every tree the counts
    propose is weighed at its tau walked through the text, at each chain depth.
    Returns dict(paths (None: plain decoding; with lookup, the chain's path [-1, 0, ...] last),
    nodes, depth (the head's), chain (the lookup chain's depth), tau, speedup: predicted, against plain
    decoding), plus `candidates`, the best of each size of the head's tree."""
    t_ar = interpolate(t_verify, 1) + overhead[0]
    best = dict(PLAIN)
    joint = lookup and lookup_hits and both is not None
    # a tree of the most frequent paths is best for counts alone (a prefix is as frequent as its
    # extensions), so only those enter the knapsack; joint counts cover the measured tree's paths only
    pool = counts if joint else {tuple(p): counts[tuple(p)] for p in best_paths(counts, max_nodes - 1)}
    worth = {p: c - (both.get(p, 0) if joint else 0) for p, c in pool.items()}
    pending = []  # (the tree's size and depth, paths, nodes, depth, chain, tau)
    for d in range(1, max(t_draft) + 1):
        trees = best_subtrees(worth, max_nodes - 1, d)
        for n in range(1, max_nodes):
            if n >= len(trees):  # no more distinct paths this shallow
                break
            if trees[n] is None:
                continue
            paths = [list(p) for p in trees[n][1]]
            depth = max(len(p) for p in paths)
            if depth != d:  # depth < d: the same tree as under a smaller limit
                continue
            if joint:  # tau to the tree's depth, the lookup chain as deep as the tree
                tau_d = 1 + sum(lookup_hits[:depth]) + trees[n][0] / roots
            elif lookup and lookup_hits:
                a = [sum(counts[tuple(p)] for p in paths if len(p) == j) / roots for j in range(1, depth + 1)]
                b = list(lookup_hits[:depth]) + [0.0] * (depth - len(lookup_hits))
                tau_d = 1 + sum(1 - (1 - x) * (1 - y) for x, y in zip(a, b))
            else:
                tau_d = 1 + sum(counts[tuple(p)] for p in paths) / roots
            # past the tree's depth only the chain gets tokens: b_j more each, j up to the chain's depth
            for chain in range(depth, max(depth, len(lookup_hits or ())) + 1) if lookup else (0,):
                if n + 1 + chain > max_nodes:
                    break
                tau = tau_d + sum(lookup_hits[depth:chain]) if chain > depth else tau_d
                pending.append(((n, d), paths, n + 1 + chain, depth, chain, tau))
    if walk is not None and pending:
        taus = walk_tau(walk, [({tuple(p) for p in c[1]}, c[4]) for c in pending])
        pending = [(*c[:5], tau) for c, tau in zip(pending, taus)]
    tops = {}  # the best chain for each tree
    for size, paths, nodes, depth, chain, tau in pending:
        speedup = tau * t_ar / (interpolate(t_draft, depth) + interpolate(t_verify, nodes) + overhead[1])
        if size not in tops or speedup > tops[size]["speedup"]:
            tops[size] = dict(paths=paths + ([[-1] + [0] * (chain - 1)] if lookup else []), nodes=nodes,
                              depth=depth, chain=chain, tau=tau, speedup=speedup)
    candidates = list(tops.values())
    for top in candidates:
        if top["speedup"] > best["speedup"]:
            best = top
    return {**best, "candidates": candidates}


def tree_tau(ranks: Tensor, paths: list) -> float:
    """Expected tokens a step (counting the bonus token) of a static tree at roots whose heads
    rank the true tokens so (ranks as in fit_tree): 1 + the mean accepted depth."""
    nodes = {tuple(p) for p in paths}
    total = 0
    for row in ranks.tolist():
        d = 0
        while d < len(row) and tuple(row[:d + 1]) in nodes:
            d += 1
        total += d
    return 1 + total / max(1, ranks.shape[0])


def tree_buffers(paths: list, topk: Optional[int] = None) -> Tree:
    """Static tree buffers from Medusa-style index paths (built once, Python is fine).
    retrieve_indices has one row per leaf, leaves in node order."""
    paths = sorted((tuple(p) for p in paths), key=lambda p: (len(p), p))
    if not paths:
        raise ValueError("tree has no paths")
    if len(set(paths)) != len(paths):
        raise ValueError("tree has a duplicate path")
    if any(len(p) == 0 for p in paths):
        raise ValueError("tree path is empty (the root is implicit)")
    node = {(): 0}
    for i, p in enumerate(paths):
        node[p] = i + 1
    for p in paths:
        if p[:-1] not in node:
            raise ValueError(f"tree path {list(p)} has no parent {list(p[:-1])}")
    n = len(paths) + 1
    depth = len(paths[-1])
    max_choice = max(c for p in paths for c in p)
    topk = max_choice + 1 if topk is None else topk
    if topk <= max_choice:
        raise ValueError(f"topk={topk} but the tree uses choice index {max_choice}")

    tree_mask = torch.zeros(n, n, dtype=torch.bool)
    positions = torch.zeros(n, dtype=torch.long)
    parents = torch.full((n,), -1, dtype=torch.long)
    tree_indices = torch.zeros(n, dtype=torch.long)
    tree_mask[0, 0] = True
    for p, i in node.items():
        if i == 0:
            continue
        for k in range(len(p) + 1):
            tree_mask[i, node[p[:k]]] = True
        positions[i] = len(p)
        parents[i] = node[p[:-1]]
        tree_indices[i] = 1 + (len(p) - 1) * topk + p[-1]
    is_parent = {p[:-1] for p in paths}
    rows = [[node[p[:k]] for k in range(len(p) + 1)] for p in paths if p not in is_parent]
    retrieve_indices = torch.tensor([r + [-1] * (depth + 1 - len(r)) for r in rows], dtype=torch.long)
    return Tree(tree_mask, positions, parents, retrieve_indices, tree_indices)


# ---------------------------------------------------------------- per decode step

def tree_from_parents(parents: Tensor, depth: int) -> Tree:
    """Tree buffers from a parent array (root -1, parents[i] < i), static shapes.
    depth must be >= the tree's depth. retrieve_indices: one row PER NODE, [N, depth+1]."""
    n = parents.shape[0]
    node = torch.arange(n, device=parents.device)
    # anc[:, k] = k-th ancestor of each node, -1 above the root; `depth` gathers, unrolled
    anc = [node]
    for _ in range(depth):
        a = anc[-1]
        anc.append(torch.where(a >= 0, parents[a.clamp(min=0)], -1))
    anc = torch.stack(anc, 1)                                     # [N, D+1]
    tree_mask = (anc[:, :, None] == node[None, None, :]).any(1)   # [N, N]
    positions = (anc >= 0).sum(1) - 1                             # [N]
    # reverse each ancestor list so the root comes first
    k = positions[:, None] - torch.arange(depth + 1, device=parents.device)[None, :]  # [N, D+1]
    retrieve_indices = torch.where(k >= 0, anc.gather(1, k.clamp(min=0)), -1)
    return Tree(tree_mask, positions, parents, retrieve_indices)


def dynamic_select(scores: Tensor, parents: Tensor, tokens: Tensor, total_tokens: int,
                   depth: int, root_token: Tensor, chain: Optional[Tensor] = None) -> tuple:
    """EAGLE-2 reranking: keep the best total_tokens - 1 of a pool of M expanded draft
    nodes and make a tree of them under the root.
    scores [M]: cumulative draft log-prob; parents [M]: pool index, -1 = child of the root,
    parents precede children in the pool; tokens [M]; root_token: scalar.
    chain [c <= depth]: tokens of one more branch from the root, placed after the kept nodes
    (a prompt-lookup proposal). Returns draft_tokens [total_tokens + c] (root first) and Tree.

    Cumulative log-probs never increase along a path, and a stable descending sort puts
    a parent before an equal-scored child (it has the smaller pool index), so the kept
    set is ancestor-closed. If the scores break that anyway, a kept node whose parent was
    dropped hangs from its nearest kept ancestor (or the root): its token is still
    verified against the base model at its new parent, so the output stays correct."""
    m = scores.shape[0]
    k = total_tokens - 1
    assert 0 < k <= m, f"pool of {m} nodes cannot fill a tree of {total_tokens}"
    keep = torch.sort(scores, descending=True, stable=True).indices[:k]
    keep = torch.sort(keep).values                                # [k], pool order
    kept = torch.zeros(m, dtype=torch.bool, device=scores.device).scatter(0, keep, True)
    # nearest kept ancestor, -1 = the root
    a = parents
    for _ in range(depth):
        a = torch.where((a >= 0) & ~kept[a.clamp(min=0)], parents[a.clamp(min=0)], a)
    new_index = torch.zeros(m, dtype=torch.long, device=scores.device)
    new_index = new_index.scatter(0, keep, torch.arange(1, k + 1, device=scores.device))
    a = a[keep]
    tree_parents = torch.where(a >= 0, new_index[a.clamp(min=0)], 0)  # [k]
    tree_parents = torch.cat([tree_parents.new_full((1,), -1), tree_parents])
    root = torch.as_tensor(root_token, device=tokens.device).to(tokens.dtype).reshape(1)
    draft_tokens = torch.cat([root, tokens[keep]])
    if chain is not None:  # node total_tokens hangs from the root, each later one from the one before
        c = chain.shape[0]
        tree_parents = torch.cat([tree_parents, tree_parents.new_zeros(1),
                                  torch.arange(total_tokens, total_tokens + c - 1, device=scores.device)])
        draft_tokens = torch.cat([draft_tokens, chain.to(draft_tokens.dtype)])
    return draft_tokens, tree_from_parents(tree_parents, depth)


def medusa_draft_tokens(root_token: Tensor, topk_tokens: Tensor, tree_indices: Tensor) -> Tensor:
    """Static tree tokens: root_token scalar, topk_tokens [K, TOPK] (head d's top choices)."""
    candidates = torch.cat([root_token.reshape(1), topk_tokens.flatten().to(root_token.dtype)])
    return candidates[tree_indices]                               # [N]


def logits_to_probs(logits: Tensor, temperature: float = 1.0, top_k: int = 0,
                    top_p: float = 1.0) -> Tensor:
    """The processed target distribution [..., V]; temperature 0 = one-hot argmax.
    The autoregressive sampler uses the same function, so both sample the same thing."""
    if temperature == 0:
        return torch.nn.functional.one_hot(logits.argmax(-1), logits.shape[-1]).to(logits.dtype)
    logits = logits / temperature
    if top_k > 0:
        pivot = torch.topk(logits, min(top_k, logits.shape[-1]), dim=-1).values[..., -1:]
        logits = torch.where(logits < pivot, -float("inf"), logits)
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        p = torch.softmax(sorted_logits, dim=-1)
        # drop a token once the mass before it reaches top_p; the top token always stays
        drop = (p.cumsum(-1) - p) >= top_p
        sorted_logits = sorted_logits.masked_fill(drop, -float("inf"))
        logits = torch.full_like(logits, -float("inf")).scatter(-1, order, sorted_logits)
    return torch.softmax(logits, dim=-1)


def sample(probs: Tensor, generator: Optional[torch.Generator] = None) -> Tensor:
    """Categorical sample over the last dim with no host sync: argmax(p / Exp(1)).
    A generator does not compile; under torch.compile pass None and seed globally."""
    q = torch.empty_like(probs).exponential_(1, generator=generator)
    return (probs / q.clamp(min=1e-30)).argmax(-1)  # clamp: an Exp draw of 0 would give 0/0


def _accept_along(target: Tensor, draft_tokens: Tensor, retrieve_indices: Tensor,
                  alive: Optional[Tensor] = None) -> tuple:
    """Longest retrieve row whose every draft token equals target[] at its parent.
    target [N]: the token the base model emits after each node."""
    idx = retrieve_indices.clamp(min=0)                           # [L, D+1]
    ok = (draft_tokens[idx[:, 1:]] == target[idx[:, :-1]]) & (retrieve_indices[:, 1:] >= 0)
    if alive is not None:
        ok = ok & alive[idx[:, 1:]]
    lengths = all_before(ok).sum(1)                               # [L]
    best = lengths.argmax(0, keepdim=True)                        # [1]; first row on ties
    accept_length, path = _path(idx, lengths, best)
    return accept_length, path, target[path[-1:]].squeeze(0)


def all_before(ok: Tensor) -> Tensor:
    """ok [L, D] bool -> [L, D]: ok at this column and every one before it. A tree's few columns in
    turn, which inductor fuses (a cumprod is an aten call)."""
    cols = [ok[:, :1]]
    for d in range(1, ok.shape[1]):
        cols.append(cols[-1] & ok[:, d:d + 1])
    return torch.cat(cols, 1)


def _path(idx: Tensor, lengths: Tensor, best: Tensor) -> tuple:
    # best is [1], not 0-dim: indexing with a 0-dim tensor reads it as a Python int (a sync)
    accept_length = lengths[best].squeeze(0)
    # entries past accept_length repeat the last accepted node, so all are valid ids
    j = torch.arange(idx.shape[1], device=idx.device)
    path = idx[best].squeeze(0)[torch.minimum(j, accept_length)]  # [D+1]
    return accept_length, path


def kernel(op: str) -> bool:
    """Whether cpu_kernels.py has loaded its op treespec::op (it builds them for bf16 on a CPU)."""
    return hasattr(torch.ops.treespec, op)


def top_indices(logits: Tensor, k: int) -> Tensor:
    """logits.topk(k).indices, largest first; bf16 on a CPU with the engine's kernels built: their topk
    op (the earlier index first among equals, where torch's order is unspecified; NaNs passed over),
    several times faster over a draft's row (docs/speed.md)."""
    if (logits.dtype == torch.bfloat16 and logits.device.type == "cpu" and logits.shape[-1] % 16 == 0
            and k <= min(64, logits.shape[-1]) and kernel("topk")):
        return torch.ops.treespec.topk(logits, k)
    return logits.topk(k, dim=-1).indices


def argmax(logits: Tensor) -> Tensor:
    """logits.argmax(-1) (the first of equal maxima). bf16 on a CPU with the engine's kernels built:
    their argmax op. Else a max and a min, which inductor fuses, where its CPU argmax reduction runs one
    element at a time (docs/speed.md). (A NaN row gives the last token, not NaN's; the op passes NaNs over.)"""
    if (logits.dtype == torch.bfloat16 and logits.device.type == "cpu" and logits.shape[-1] % 16 == 0
            and kernel("argmax")):
        return torch.ops.treespec.argmax(logits)
    V = logits.shape[-1]
    i = torch.arange(V, device=logits.device, dtype=torch.int32)
    return torch.where(logits == logits.amax(-1, keepdim=True), i, V - 1).amin(-1).long()


def greedy_accept(logits: Tensor, draft_tokens: Tensor, retrieve_indices: Tensor) -> tuple:
    """Longest path whose draft tokens all equal the base argmax at their parent.
    logits [N, V], draft_tokens [N], retrieve_indices [L, D+1].
    Returns (accept_length: long scalar, path [D+1] root first, next_token: long scalar)."""
    return _accept_along(argmax(logits), draft_tokens, retrieve_indices)


def typical_accept(logits: Tensor, draft_tokens: Tensor, retrieve_indices: Tensor,
                   temperature: float, posterior_threshold: float = 0.09,
                   posterior_alpha: float = 0.3,
                   generator: Optional[torch.Generator] = None) -> tuple:
    """Medusa's typical acceptance. LOSSY: it does not keep the base model's distribution.
    A draft token is accepted if its prob under softmax(logits/T) at its parent exceeds
    min(posterior_threshold, posterior_alpha * exp(-entropy)). Of the longest accepted
    paths the most likely wins; the bonus token is sampled from softmax(logits/T) at the
    last accepted node. temperature 0 is greedy_accept."""
    if temperature == 0:
        return greedy_accept(logits, draft_tokens, retrieve_indices)
    probs = torch.softmax(logits.float() / temperature, dim=-1)   # [N, V]
    entropy = -(probs * torch.log(probs + 1e-5)).sum(-1)          # [N], Medusa's epsilon
    threshold = torch.clamp(posterior_alpha * torch.exp(-entropy), max=posterior_threshold)
    idx = retrieve_indices.clamp(min=0)
    parent, child = idx[:, :-1], idx[:, 1:]                      # [L, D]
    p = probs[parent, draft_tokens[child]]                        # [L, D]
    ok = (p > threshold[parent]) & (retrieve_indices[:, 1:] >= 0)
    accepted = all_before(ok)                                     # [L, D]
    lengths = accepted.sum(1)                                     # [L]
    likelihood = torch.where(accepted, torch.log(p), 0.0).sum(1)  # log 0 * 0 would be nan
    best = torch.where(lengths == lengths.max(), likelihood, -float("inf")).argmax(0, keepdim=True)
    accept_length, path = _path(idx, lengths, best)
    return accept_length, path, sample(probs[path[-1:]], generator).squeeze(0)


def sample_accept(logits: Tensor, draft_tokens: Tensor, tree: Tree, temperature: float,
                  top_k: int = 0, top_p: float = 1.0,
                  generator: Optional[torch.Generator] = None) -> tuple:
    """Lossless tree speculative sampling for deterministic (top-k) drafts, the rule of
    SpecInfer / EAGLE: at a node with target p, try its children in node order, accept
    child x with prob p(x) / (mass left), else zero p(x) and try the next; if all fail,
    sample the bonus token from what is left of p. Emitted tokens follow the target
    exactly (target = logits_to_probs(logits, temperature, top_k, top_p)).

    Done in closed form: by telescoping, child j of that loop is accepted with prob
    p(x_j), and the leftover sample is p restricted to the non-children, so the loop is
    the same as drawing y ~ p at the node and moving to the first child whose token is y
    (y itself is the bonus if there is none). One independent y per node, drawn up front,
    then the walk is greedy_accept with y in place of the argmax: no loop over siblings.
    A child that repeats an earlier sibling's token is never accepted (its p was zeroed)."""
    probs = logits_to_probs(logits.float(), temperature, top_k, top_p)  # [N, V]
    y = sample(probs, generator)                                  # [N]
    n = draft_tokens.shape[0]
    earlier = torch.ones(n, n, dtype=torch.bool, device=y.device).tril(-1)
    same = (tree.parents[:, None] == tree.parents[None, :]) & (draft_tokens[:, None] == draft_tokens[None, :])
    alive = ~(same & earlier).any(1)                              # [N]
    return _accept_along(y, draft_tokens, tree.retrieve_indices, alive)


def emitted_tokens(draft_tokens: Tensor, accept_length: Tensor, path: Tensor,
                   next_token: Tensor) -> tuple:
    """The tokens a step emits: accepted draft tokens after the root, then next_token.
    Takes an accept triple as is: emitted_tokens(draft_tokens, *greedy_accept(...)).
    Returns (tokens [D+1], count = accept_length + 1); entries past count are copies of
    next_token (don't-care, but valid ids)."""
    j = torch.arange(path.shape[0], device=path.device)
    tokens = torch.where(j < accept_length, draft_tokens[path.roll(-1)], next_token.to(draft_tokens.dtype))
    return tokens, accept_length + 1                              # [D+1], scalar
