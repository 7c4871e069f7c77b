"""Draft heads that read the base model's last hidden states: Medusa, Hydra (and Hydra++), EAGLE.

Every head answers the decode loop the same way, so the loop never asks which one it has:
  begin(base, h, next_tokens, n, P, L=None) -> (logits [1, V], state [1, *])
      h: [R, dim] base hidden states (after the final norm) of the last accepted path, at positions
      P-n .. P-1 (rows past n are stale); next_tokens: [R] the token after each row, so that
      next_tokens[n-1] is the tree root. Returns the root's child logits and the root's state.
      L: the head's cache slots [0, L) this step touches (None: all), so that a draft's attention
      costs what the live prefix costs, as verification's does (live_span).
  expand(base, depth, parent_state [F, *], tokens [F], attn) -> (logits [F or 1, V], state [F, *])
      the child logits of F tree nodes at `depth` given their tokens and their parents' states.
      Logits of one row mean "the same for every node" (Medusa's heads ignore the path).
  prefill(base, h [T, dim], next_tokens [T]) fills a head's own cache (EAGLE, Hydra++) with the prompt
      and starts its context tokens (a draft vocab's, below).
draft_static / draft_dynamic below turn those into a token tree with static shapes.
"""
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor

from model import Block, KVCache, ModelArgs, RMSNorm, precompute_freqs_cis
from trees import Tree, dynamic_select, split_chain, top_indices, tree_buffers


def last_row(x: Tensor, n: Tensor) -> Tensor:
    # x: [R, *] -> [1, *], row n-1 (n a long tensor: no host sync)
    return x.index_select(0, (n - 1).reshape(1))


# A draft vocabulary (FR-Spec, EAGLE-3): a head's logits cover only V' frequent tokens, since on a
# small model the lm_head is most of a draft step. Verification stays over the full vocabulary.
# The frequent tokens of the training text miss the rare ones that an answer copies from its prompt
# (names, numbers, code identifiers; docs/speed.md), so a head that shares the base's lm_head also drafts over the
# context's tokens outside its vocab: up to CTX of them, added as they appear (prompt, then
# accepted tokens); their logits come from the base's lm_head rows like the others'.
CTX = 512


def set_draft_vocab(head, base, d2t: Tensor):
    """d2t: [V'] token id of each draft id. Heads that share the base's lm_head use its d2t rows."""
    dev, W = base.output.weight.device, base.output.weight
    head.register_buffer("d2t", d2t.to(dev), persistent=False)
    head.draft_lm = nn.Linear(W.shape[1], len(d2t), bias=False, device="meta")     # the draft vocab's rows:
    del head.draft_lm.weight                                                       # a buffer, so that heads
    head.draft_lm.register_buffer("weight", W.detach()[head.d2t], persistent=False)  # train and save without it
    known = torch.zeros(base.args.vocab_size + 1, dtype=torch.bool, device=dev)   # [V + 1], the last a sink
    known[head.d2t] = True
    head.register_buffer("in_draft", known, persistent=False)
    head.register_buffer("known", known.clone(), persistent=False)                # in the vocab or the context
    head.register_buffer("ctx_ids", torch.zeros(CTX + 1, dtype=torch.long, device=dev), persistent=False)
    head.register_buffer("ctx_w", W.new_zeros(CTX + 1, W.shape[1]), persistent=False)  # [CTX + 1, dim], the last a sink
    head.register_buffer("ctx_n", torch.zeros((), dtype=torch.long, device=dev), persistent=False)
    return head


class Drafter(nn.Module):
    """What every drafter answers besides begin, expand and prefill (module docstring), so that the
    drafting loops and the tuner never ask which one they have: how deep it drafts, whether its
    expand attends its own cache, its prompt-lookup branch, and its draft vocabulary (set_draft_vocab)."""
    needs_attn = False  # expand attends the head's own cache over the tree's nodes (EAGLE: draft_attn)
    max_depth = None    # the deepest tree level it drafts (Medusa's and Hydra's heads); None: any
    lookup = 0          # the n-gram length of its prompt-lookup branch (WithLookup); 0: none

    def __init__(self):
        super().__init__()
        self.register_buffer("d2t", None, persistent=False)  # the draft vocab's token ids (set_draft_vocab)

    def setup_caches(self, max_seq_len: int):
        pass

    def chain(self, base, h, next_tokens, n, P, depth: int, L=None):
        """The prompt-lookup branch's proposal, [depth] tokens (WithLookup)."""
        raise ValueError("the tree names a prompt-lookup chain: give --lookup N")

    def note_context(self, base, tokens: Tensor, valid: Optional[Tensor] = None, reset: bool = False):
        """Adds the tokens [T] (where valid [T]) outside the draft vocab to the context's tokens; reset:
        a new prompt. Static shapes, no host sync (it runs inside the compiled step)."""
        if self.d2t is None:
            return
        if reset:
            self.known.copy_(self.in_draft)
            self.ctx_n.zero_()
        V, T = self.known.shape[0] - 1, tokens.shape[0]
        if T <= 64:  # a step's few tokens, pairwise, which inductor fuses (a sort and a cumsum are aten calls)
            upto = torch.ones(T, T, dtype=torch.bool, device=tokens.device).tril()    # [i, j]: j <= i
            first = ~((tokens[:, None] == tokens[None, :]) & upto.tril(-1)).any(1) & (tokens >= 0)
        else:  # a prompt's first occurrences: O(T log T), no [V] buffer
            s, order = tokens.sort(stable=True)
            first = torch.empty_like(tokens, dtype=torch.bool).scatter_(0, order, torch.cat([s[:1] >= 0, s[1:] != s[:-1]]))
        new = ~self.known[tokens] & first & (True if valid is None else valid)
        slot = self.ctx_n + ((new[None, :] & upto).sum(1) if T <= 64 else new.cumsum(0)) - 1
        new &= slot < CTX
        slot = torch.where(new, slot, CTX)                            # the rest go to the sinks
        self.ctx_ids.index_copy_(0, slot, tokens)
        self.ctx_w.index_copy_(0, slot, base.output.weight[tokens])
        self.known.index_fill_(0, torch.where(new, tokens, V), True)
        self.ctx_n.add_(new.sum())

    def shared_logits(self, base, x: Tensor) -> Tensor:
        """The base's lm_head over x, restricted to the draft vocab and the context's tokens where it has one."""
        if self.d2t is None:
            return base.output(x)
        # ctx_w changes every step, so it is no frozen constant that a GEMM kernel prepacks: a multiply
        # and sum streams it once, where a matmul packed it again each call
        ctx = (x[..., None, :].float() * self.ctx_w[:CTX].float()).sum(-1).to(x.dtype)
        ctx = ctx.masked_fill(torch.arange(CTX, device=x.device) >= self.ctx_n, float("-inf"))
        return torch.cat([self.draft_lm(x), ctx], -1)  # [*, V' + CTX] (int8 heads: the rows in int8)

    def token_ids(self, idx: Tensor) -> Tensor:
        """Indices into the head's logits -> token ids."""
        return idx if self.d2t is None else torch.cat([self.d2t, self.ctx_ids[:CTX]])[idx]


# ---------------------------------------------------------------- Medusa

class ResBlock(nn.Module):
    def __init__(self, dim: int):
        super().__init__()
        self.linear = nn.Linear(dim, dim)
        nn.init.zeros_(self.linear.weight)  # starts as the identity, as Medusa does

    def forward(self, x: Tensor) -> Tensor:
        return x + F.silu(self.linear(x))


class Medusa(Drafter):
    """Medusa-1: head k = ResBlock^L then its own Linear(dim, vocab) (or the base lm_head when
    lm_head=False, as MLC-LLM shares it); head k predicts the token k+1 steps past the root."""

    def __init__(self, dim: int, vocab_size: int, num_heads: int, num_layers: int = 1, lm_head: bool = True):
        super().__init__()
        self.num_heads = num_heads
        self.medusa_head = nn.ModuleList(
            nn.Sequential(*[ResBlock(dim) for _ in range(num_layers)],
                          *([nn.Linear(dim, vocab_size, bias=False)] if lm_head else []))
            for _ in range(num_heads))
        self.lm_head = lm_head

    @property
    def max_depth(self) -> int:
        return self.num_heads

    def prefill(self, base, h, next_tokens):
        self.note_context(base, next_tokens, reset=True)

    def head_logits(self, base, k: int, x: Tensor) -> Tensor:
        y = self.medusa_head[k](x)
        return y if self.lm_head else self.shared_logits(base, y)

    def begin(self, base, h, next_tokens, n, P, L=None):
        x = last_row(h, n)
        return self.head_logits(base, 0, x), x

    def expand(self, base, depth, parent_state, tokens, attn):
        return self.head_logits(base, depth, parent_state[:1]), parent_state


# ---------------------------------------------------------------- EAGLE and Hydra++ share a cached layer

class CachedLayer(nn.Module):
    """One decoder layer with its own static KV cache, run over rows at given positions/slots."""

    def __init__(self, args: ModelArgs, input_norm: bool = True):
        super().__init__()
        self.args = args
        self.block = Block(args)
        if not input_norm:
            self.block.attention_norm = nn.Identity()
        self.max_seq_len = 0

    def setup_caches(self, max_seq_len: int):
        a, w = self.args, self.block.ffn_norm.weight  # (a norm: the head's linears may be int8)
        self.max_seq_len = max_seq_len
        self.block.attention.kv_cache = KVCache(1, a.n_kv_head, max_seq_len, a.head_dim, w.dtype, w.device)
        self.register_buffer("freqs_cis", precompute_freqs_cis(a, max_seq_len, w.device), persistent=False)

    def forward(self, x: Tensor, positions: Tensor, slots: Tensor, mask: Tensor) -> Tensor:
        # x: [R, dim]; positions, slots: [R]; mask: bool [R, L]: attention reads the first L slots
        return self.block(x[None], self.freqs_cis[positions], mask[None, None], slots)[0]

    def catch_up(self, x: Tensor, P_minus_n: Tensor, L=None) -> Tensor:
        # rows of the accepted path at positions P-n+j, written at the same slots, causal; L: see begin
        pos = P_minus_n + torch.arange(x.shape[0], device=x.device)
        mask = torch.arange(self.max_seq_len, device=x.device)[:L][None, :] <= pos[:, None]
        return self(x, pos, pos, mask)


class Eagle(Drafter):
    """EAGLE-1/2 draft model: fc(cat(embed(token), feature)) then one Llama decoder layer (input
    norm skipped) with its own KV cache; logits through the base model's lm_head. Row t of its cache
    holds (feature_t, token_{t+1}); its output at t is the predicted feature_{t+1}."""
    needs_attn = True

    def __init__(self, args: ModelArgs, bias: bool = True):
        super().__init__()
        self.args = args
        self.fc = nn.Linear(2 * args.dim, args.dim, bias=bias)
        self.layer = CachedLayer(args, input_norm=False)

    def setup_caches(self, max_seq_len: int):
        self.layer.setup_caches(max_seq_len)

    @property
    def cache_len(self) -> int:
        return self.layer.max_seq_len

    def rows(self, base, feats, tokens):
        e = base.tok_embeddings(tokens)
        return self.fc(torch.cat([e, feats.to(e.dtype)], -1))

    def prefill(self, base, h, next_tokens):
        # the prompt's rows but the last, which the first step's begin() writes
        self.note_context(base, next_tokens, reset=True)
        self.layer.catch_up(self.rows(base, h[:-1], next_tokens[:-1]), torch.zeros((), dtype=torch.long))

    def begin(self, base, h, next_tokens, n, P, L=None):
        out = self.layer.catch_up(self.rows(base, h, next_tokens), P - n, L)
        x = last_row(out, n)
        return self.shared_logits(base, x), x

    def expand(self, base, depth, parent_state, tokens, attn):
        out = self.layer(self.rows(base, parent_state, tokens), *attn)
        return self.shared_logits(base, out), out


# ---------------------------------------------------------------- Hydra

class HydraBlock(nn.Module):
    """Hydra's ResBlock: the first block of head i reads i+1 token embeddings beside the hidden
    state, and a linear residual brings it back to dim."""

    def __init__(self, dim: int, num_condition: int = 0):
        super().__init__()
        self.linear = nn.Linear(dim * (num_condition + 1), dim)
        self.res_connection = nn.Linear(dim * (num_condition + 1), dim) if num_condition else nn.Identity()
        nn.init.zeros_(self.linear.weight)

    def forward(self, x: Tensor) -> Tensor:
        return self.res_connection(x) + F.silu(self.linear(x))


class Hydra(Drafter):
    """Hydra: sequentially dependent heads; head i reads the hidden state and the embeddings of
    the root and the i tokens drafted before it (grounded). Hydra++ (prefix=True) first runs one
    extra decoder layer (and final norm) over the base hidden states, with its own KV cache.
    lm_head=False: the heads share the base's lm_head (as MLC-LLM's Medusa does), a fraction of the size."""
    # (needs_attn False: its prefix layer runs over accepted rows only, never over tree nodes)

    def __init__(self, dim: int, vocab_size: int, num_heads: int, num_layers: int = 1,
                 grounded: bool = True, prefix_args: Optional[ModelArgs] = None, dropout: float = 0.0,
                 lm_head: bool = True):
        super().__init__()
        self.num_heads, self.grounded = num_heads, grounded
        # Dropout slots (a no-op in eval) keep the official key names: hydra_mlp.{i}.{2j+1}, hydra_lm_head.{i}.1
        self.hydra_mlp = nn.ModuleList(
            nn.Sequential(*[m for j in range(num_layers)
                            for m in (nn.Dropout(dropout), HydraBlock(dim, i + 1 if grounded and j == 0 else 0))])
            for i in range(num_heads))
        self.hydra_lm_head = nn.ModuleList(nn.Sequential(nn.Dropout(dropout), nn.Linear(dim, vocab_size))
                                           for _ in range(num_heads)) if lm_head else None
        self.prefix = CachedLayer(prefix_args) if prefix_args else None
        self.prefix_norm = RMSNorm(dim, prefix_args.norm_eps) if prefix_args else None

    @property
    def max_depth(self) -> int:
        return self.num_heads

    def setup_caches(self, max_seq_len: int):
        if self.prefix:
            self.prefix.setup_caches(max_seq_len)

    def prefill(self, base, h, next_tokens):
        self.note_context(base, next_tokens, reset=True)
        if self.prefix:
            self.prefix.catch_up(h[:-1].to(self.prefix_norm.weight.dtype), torch.zeros((), dtype=torch.long))

    def begin(self, base, h, next_tokens, n, P, L=None):
        if self.prefix:
            h = self.prefix_norm(self.prefix.catch_up(h.to(self.prefix_norm.weight.dtype), P - n, L))
        return self.expand(base, 0, last_row(h, n), last_row(next_tokens, n), None)

    def expand(self, base, depth, parent_state, tokens, attn):
        # parent_state: [F, dim * (depth + 1)] = hidden and the path's embeddings above this node
        x = torch.cat([parent_state, base.tok_embeddings(tokens).to(parent_state.dtype)], -1) \
            if self.grounded else parent_state
        y = self.hydra_mlp[depth](x)
        return (self.hydra_lm_head[depth](y) if self.hydra_lm_head is not None else self.shared_logits(base, y)), x


# ---------------------------------------------------------------- context n-gram (prompt lookup)

class NGram(Drafter):
    """Prompt lookup, the baseline every trained head must beat: no weights; match the last g
    tokens (g = n, n-1, ..., 1, the longest that matches) earlier in the context and propose what
    followed the latest match. One branch only, so use it with a chain tree (chain4)."""

    def __init__(self, vocab_size: int, n: int = 3, max_depth: int = 16):
        super().__init__()
        self.vocab_size, self.n, self.max_depth = vocab_size, n, max_depth
        self.register_buffer("ids", torch.zeros(0, dtype=torch.long), persistent=False)  # .to(device) moves it

    def setup_caches(self, max_seq_len: int):
        self.ids = torch.zeros(max_seq_len, dtype=torch.long, device=self.ids.device)  # token at each position

    def prefill(self, base, h, next_tokens):
        self.ids[1: len(next_tokens) + 1] = next_tokens

    def begin(self, base, h, next_tokens, n, P, L=None):
        R = next_tokens.shape[0]
        # rows past n land beyond the root at P: stale, and never matched (windows end before P)
        self.ids.index_copy_(0, P - n + 1 + torch.arange(R, device=P.device), next_tokens)
        start = torch.full_like(P, -1)
        for g in range(1, self.n + 1):  # a longer match overrides a shorter one
            key = self.ids[(P - g + 1 + torch.arange(g, device=P.device)).clamp(min=0)]     # [g]
            windows = self.ids[:L].unfold(0, g, 1)                                          # [L-g+1, g]
            s = torch.arange(windows.shape[0], device=P.device)
            hit = (windows == key).all(-1) & (s + g <= P) & (P - g + 1 >= 0)
            start = torch.where(hit.any(), torch.where(hit, s + g, -1).max(), start)
        # (torch.minimum, not clamp(0, P): torch 2.11's compiler read a tensor bound of clamp on the host)
        cont = self.ids[torch.minimum((start + torch.arange(self.max_depth, device=P.device)).clamp(min=0), P)]
        cont = torch.where(start >= 0, cont, -1)[None]                                    # -1: no proposal
        return self.expand(base, 0, cont, None, None)

    def expand(self, base, depth, state, tokens, attn):
        # one row for every node: the continuation's token at this depth gets all the mass
        vocab = torch.arange(self.vocab_size, device=state.device)
        return (vocab == state[0, depth]).float()[None], state      # all zeros when there is no proposal (-1)


class WithLookup(Drafter):
    """A head plus prompt lookup: its tree (static or dynamic) gets one more branch from the root, a
    chain as deep as the tree whose tokens are the NGram drafter's proposal (chain). The head never
    expands that branch, so it costs only its verification (depth more tree nodes); where the context
    repeats itself (the default model's answers often do), the chain wins. Everything else is the head's."""

    def __init__(self, head: Drafter, ngram: NGram):
        super().__init__()
        self.head, self.ngram, self.lookup = head, ngram, ngram.n

    needs_attn = property(lambda self: self.head.needs_attn)
    max_depth = property(lambda self: self.head.max_depth)
    cache_len = property(lambda self: self.head.cache_len)

    def setup_caches(self, max_seq_len: int):
        self.head.setup_caches(max_seq_len)
        self.ngram.setup_caches(max_seq_len)

    def prefill(self, base, h, next_tokens):
        self.head.prefill(base, h, next_tokens)
        self.ngram.prefill(base, h, next_tokens)

    def chain(self, base, h, next_tokens, n, P, depth: int, L=None):
        # where there is no proposal, token 0: harmless, verification checks every token
        return self.ngram.begin(base, h, next_tokens, n, P, L)[1][0, :depth].clamp(min=0)

    def begin(self, base, h, next_tokens, n, P, L=None):
        return self.head.begin(base, h, next_tokens, n, P, L)

    def expand(self, base, depth, parent_state, tokens, attn):
        return self.head.expand(base, depth, parent_state, tokens, attn)

    def note_context(self, base, tokens, valid=None, reset=False):
        self.head.note_context(base, tokens, valid, reset)

    def token_ids(self, idx):
        return self.head.token_ids(idx)


# ---------------------------------------------------------------- drafting a tree

@dataclass
class StaticPlan:
    """How to draft a fixed tree depth by depth, precomputed in Python once."""
    tree: Tree
    child_parent_row: list   # per depth d >= 1: [n_d] row of each node's parent among the expanded rows of d-1
    child_choice: list       # per depth d >= 1: [n_d] which of the parent's top-k the node takes
    topk: list               # per depth d >= 1: int
    expand_nodes: list       # per depth d >= 1: [F_d] nodes at depth d that have children
    expand_parent_row: list  # per depth d >= 1: [F_d] their parents' rows among the expanded rows of d-1
    expand_offset: list      # per depth d >= 1: [F_d] their index among the nodes of depth d
    lookup: int = 0          # the prompt-lookup chain's depth (WithLookup): its node is the last of those depths
    paths: tuple = ()        # each node's index path, root () first; the lookup chain's start past every head choice


def static_plan(paths: list, lookup: bool = False) -> StaticPlan:
    """paths: Medusa-style index paths; a node at depth d takes choice path[-1] of its parent's top-k.
    lookup: add a chain from the root for WithLookup's proposal, as deep as the path [-1, 0, ...] in
    paths says (trees.split_chain), else as deep as the tree."""
    paths, C = split_chain([list(p) for p in paths])
    if C and not lookup:
        raise ValueError("the tree names a prompt-lookup chain (a path [-1, ...]): give --lookup N, or drop it")
    paths = [tuple(p) for p in paths]
    depth = max(map(len, paths), default=0)
    c = max((p[0] for p in paths), default=-1) + 1     # a choice no head node takes: sorts last at every depth
    lookup = (C or depth) if lookup else 0
    chain = [(c,) + (0,) * k for k in range(lookup)]
    tree = tree_buffers(paths + chain)
    paths = [()] + sorted(paths + chain, key=lambda p: (len(p), p))  # tree_buffers' node order
    node = {p: i for i, p in enumerate(paths)}
    plan = StaticPlan(tree, [None], [None], [None], [None], [None], [None], lookup, tuple(paths))
    rows = [()]  # the expanded nodes of the previous depth, in row order
    for d in range(1, depth + 1):
        nodes = [p for p in paths if len(p) == d and p not in chain]
        parents_of = {p[:-1] for p in paths if len(p) == d + 1}
        plan.child_parent_row.append(torch.tensor([rows.index(p[:-1]) for p in nodes]))
        plan.child_choice.append(torch.tensor([p[-1] for p in nodes]))
        plan.topk.append(max(p[-1] for p in nodes) + 1)
        expanded = [p for p in nodes if p in parents_of]
        plan.expand_nodes.append(torch.tensor([node[p] for p in expanded], dtype=torch.long))
        plan.expand_parent_row.append(torch.tensor([rows.index(p[:-1]) for p in expanded], dtype=torch.long))
        plan.expand_offset.append(torch.tensor([nodes.index(p) for p in expanded], dtype=torch.long))
        rows = expanded
    return plan


def plan_to(plan: StaticPlan, device) -> StaticPlan:
    mv = lambda xs: [x.to(device) if isinstance(x, Tensor) else x for x in xs]
    return StaticPlan(plan.tree.to(device), mv(plan.child_parent_row), mv(plan.child_choice), plan.topk,
                      mv(plan.expand_nodes), mv(plan.expand_parent_row), mv(plan.expand_offset), plan.lookup,
                      plan.paths)


def draft_attn(head, P, n, depth: int, D: int, nodes: Tensor, anc: Tensor, L=None):
    """Attention inputs for expanding tree nodes in a head's own cache (EAGLE): node i of depth d
    sits at position P+d-1 and scratch slot S0+i, after the catch-up rows; it sees the
    accepted prefix [0, P) and the scratch slots of its ancestors (the root's row is in the prefix).
    nodes: [F] node ids (>= 1); anc: bool [F, M] ancestors-or-self among node ids 0..M-1; L: as begin's."""
    if not head.needs_attn:
        return None
    dev = nodes.device
    S0 = P - n + D + 1
    M = anc.shape[1]
    j = torch.arange(head.cache_len, device=dev)[:L] - S0         # slot -> node id
    scratch = (j > 0) & (j < M)                                   # the root's row is in the prefix
    mask = (j < P - S0)[None, :] | (anc[:, j.clamp(0, M - 1)] & scratch[None, :])
    return (P + depth - 1).expand(nodes.shape[0]), S0 + nodes, mask


def head_slots(L, D: int, M: int):
    """The head's cache slots a step touches when verification attends the base's first L: the
    catch-up's D+1 rows from P-n < L, then M scratch slots (L + D + 1 + M is at most the head's cache,
    which setup_caches sizes so)."""
    return None if L is None else L + D + 1 + M


def draft_static(head, base, plan: StaticPlan, h, next_tokens, n, P, L=None):
    """Tokens for every node of a fixed tree. L: the base's live cache slots (None: all).
    Returns (draft_tokens [N], tree)."""
    tree, D, depth = plan.tree, plan.tree.depth, len(plan.topk) - 1  # the tree's depth, the head's
    L = head_slots(L, D, tree.num_nodes)
    root = last_row(next_tokens, n)                               # [1]
    if plan.lookup:
        chain = head.chain(base, h, next_tokens, n, P, plan.lookup, L)  # [C]
    head.note_context(base, next_tokens, torch.arange(next_tokens.shape[0], device=n.device) < n)
    logits, state = head.begin(base, h, next_tokens, n, P, L)    # [1, V], [1, *]
    out = [root]
    for d in range(1, depth + 1):
        top = top_indices(logits, plan.topk[d])                   # [rows or 1, topk]
        rows = plan.child_parent_row[d] if top.shape[0] > 1 else torch.zeros_like(plan.child_parent_row[d])
        tokens = head.token_ids(top[rows, plan.child_choice[d]])  # [n_d]
        out += [tokens, chain[d - 1:d]] if plan.lookup >= d else [tokens]
        if d < depth:
            nodes = plan.expand_nodes[d]
            attn = draft_attn(head, P, n, d, D, nodes, tree.tree_mask[nodes], L)
            logits, state = head.expand(base, d, state[plan.expand_parent_row[d]], tokens[plan.expand_offset[d]], attn)
    return torch.cat(out + [chain[depth:]] if plan.lookup > depth else out), tree  # the chain past the head's depth


def draft_dynamic(head, base, h, next_tokens, n, P, top_k: int, depth: int, total_tokens: int, L=None):
    """EAGLE-2's dynamic tree: expand the top_k best frontier nodes by cumulative log-prob for
    `depth` levels, then keep the best total_tokens - 1 of all drafted nodes. Static shapes.
    Pool node j (0-based) has id j+1 (0 is the root) for the head's scratch slots.
    A WithLookup head adds its prompt-lookup chain, `depth` nodes deep, after the selected nodes."""
    chain = None
    M = top_k + (depth - 1) * top_k * top_k
    L = head_slots(L, depth, M + 1)
    if head.lookup:
        chain = head.chain(base, h, next_tokens, n, P, depth, L)  # [depth]
    root = last_row(next_tokens, n)
    head.note_context(base, next_tokens, torch.arange(next_tokens.shape[0], device=n.device) < n)
    logits, state = head.begin(base, h, next_tokens, n, P, L)
    logp = torch.log_softmax(logits.float(), -1)                 # [1, V]
    scores, tokens = logp[0].topk(top_k)                          # [k]
    tokens = head.token_ids(tokens)
    dev = scores.device
    pool_scores, pool_tokens, pool_parents = [scores], [tokens], [torch.full((top_k,), -1, device=dev)]
    ids = torch.arange(1, top_k + 1, device=dev)                  # frontier ids
    anc = F.one_hot(ids, M + 1).bool()                            # [k, M+1] ancestors-or-self
    state = state.expand(top_k, *state.shape[1:])
    for d in range(1, depth):
        attn = draft_attn(head, P, n, d, depth, ids, anc, L)
        logits, st = head.expand(base, d, state, tokens, attn)   # [k or 1, V]
        cand = scores[:, None] + torch.log_softmax(logits.float(), -1)  # [k, V]
        cs, ct = cand.topk(top_k, dim=-1)                         # [k, k]
        ct = head.token_ids(ct)
        start = top_k + (d - 1) * top_k * top_k                   # pool index of the first new node
        pool_scores.append(cs.flatten())
        pool_tokens.append(ct.flatten())
        pool_parents.append((ids - 1).repeat_interleave(top_k))
        scores, best = cs.flatten().topk(top_k)
        row = best // top_k
        tokens, ids = ct.flatten()[best], start + 1 + best
        anc = anc[row] | F.one_hot(ids, M + 1).bool()
        state = st[row]
    return dynamic_select(torch.cat(pool_scores), torch.cat(pool_parents), torch.cat(pool_tokens),
                          total_tokens, depth, root[0], chain)
