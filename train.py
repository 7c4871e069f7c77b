"""Train draft heads (Medusa, Hydra, EAGLE) for a frozen base model, on text the base model wrote itself
(distill.py makes it).

    python train.py --head medusa --data data/selfdistill.npz --out heads/medusa-smollm2
    python train.py --head eagle --data data/selfdistill.npz --out heads/eagle-smollm2 --resume
    python train.py --head eagle --init heads/eagle-smollm2 ...       # fine-tune saved heads on more data
    python train.py --head eagle --draft_vocab 8192 --context ...     # 8,192 frequent tokens + the context's others

A head learns from the base model's own greedy answers (what greedy speculative decoding must reproduce).
The data file keeps only token ids; the base model's hidden states are recomputed from them while
training, one frozen forward a batch, or once into a cache (--features).
"""
import argparse
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch import Tensor
from tqdm import tqdm

from checkpoint import DEFAULT_NAME, HeadError, save_heads
from distill import read_data
from generate import check_device, load_heads, load_model
from heads import Eagle, Hydra, Medusa, set_draft_vocab
from model import ModelArgs
from trees import MEDUSA_TREES, best_paths, lookup_counts, prefix_counts, tree_tau

RANKS = 10  # held-out ranks are told apart up to here: Medusa's trees take a head's top 10 at most


# ---------------------------------------------------------------- heads and their training forward

class NoCache(nn.Module):
    """Stands in for a KVCache while training: the layer attends over the sequence it is given."""

    def update(self, cache_pos, k, v):
        return k, v


class StepCache(nn.Module):
    """EAGLE's training-time test: step j's rows attend over the keys and values of steps 0 .. j,
    kept here as a KV cache keeps them at decode time."""

    def __init__(self):
        super().__init__()
        self.k, self.v = [], []

    def update(self, cache_pos, k, v):
        self.k.append(k)
        self.v.append(v)
        return torch.cat(self.k, 2), torch.cat(self.v, 2)


def run_layer(layer, x, freqs_cis, step: int = 0):
    """x: [B, T, dim] -> [B, T, dim]: a CachedLayer's Block (the very weights heads.py runs at decode
    time) over whole sequences, with no cache (step 0: causal) or with a StepCache holding the earlier
    steps (step j: row t sits at position t + j and sees the step-0 rows 0 .. t and its own rows of
    steps 1 .. j, as the draft of depth j+1 from root t does)."""
    T = x.shape[1]
    causal = torch.ones(T, T, dtype=torch.bool, device=x.device).tril()
    eye = torch.eye(T, dtype=torch.bool, device=x.device)
    mask = torch.cat([causal] + [eye] * step, 1)                               # [T, (step+1) T]
    return layer.block(x, freqs_cis[step:step + T], mask[None, None], torch.arange(T, device=x.device))


def make_head(args, base, d2t):
    """A fresh head for `base`, its output layers over the draft vocab d2t [V'] (None: the full vocab)."""
    a = base.args
    W = base.output.weight if d2t is None else base.output.weight[d2t]   # [V', dim]
    if args.head == "medusa":
        head = Medusa(a.dim, W.shape[0], args.num_heads, args.num_layers, lm_head=not args.shared_lm_head)
        if head.lm_head:
            # as Medusa does: every lm_head starts as the base's, so with its zero-initialised ResBlocks a
            # head starts out predicting the base's next token, a far better start than random
            for seq in head.medusa_head:
                seq[-1].weight.data.copy_(W)
    elif args.head == "hydra":
        prefix = ModelArgs(**{**a.to_dict(), "n_layer": 1}) if args.hydra_prefix else None
        head = Hydra(a.dim, W.shape[0], args.num_heads, args.num_layers, grounded=True, prefix_args=prefix,
                     lm_head=not args.shared_lm_head)
        with torch.no_grad():
            for k in range(args.num_heads):
                # the same start as Medusa's: the first block's residual passes the hidden state through
                # (and drops the embeddings) and the lm_head is the base's
                res = head.hydra_mlp[k][1].res_connection
                res.weight.zero_()
                res.weight[:, :a.dim] = torch.eye(a.dim)
                res.bias.zero_()
                if head.hydra_lm_head is not None:
                    head.hydra_lm_head[k][1].weight.copy_(W)
                    head.hydra_lm_head[k][1].bias.zero_()
            if head.prefix is not None:
                # Hydra++'s prefix layer starts as the identity (zero output projections)
                head.prefix.block.attention.wo.weight.zero_()
                head.prefix.block.feed_forward.w2.weight.zero_()
                head.prefix.block.attention.kv_cache = NoCache()
    else:
        head = Eagle(a, bias=True)  # fc and the decoder layer from scratch, as EAGLE trains them (head_trunk gives it a StepCache)
    return head if d2t is None else set_draft_vocab(head, base, d2t)


def num_heads(head, args) -> int:
    """Heads to score: EAGLE's draft steps (--unroll), else Medusa's / Hydra's heads."""
    return max(1, args.unroll) if isinstance(head, Eagle) else head.num_heads


def head_trunk(head, base, args, h, tokens, train: bool):
    """What the heads read at position t: [B, T or T-1, dim]. Medusa and Hydra: the base hidden state
    h_t (Hydra++: after its causal prefix layer and norm). EAGLE: its prediction of h_{t+1}, from row t =
    (h_t + noise, token t+1) and the rows before it; with --unroll U, [U, B, T-1, dim]: step j's
    prediction of h_{t+j+1} from its own step j-1 prediction and token t+j+1 (the draft from root t
    at depth j+1; EAGLE-3's training-time test, HASS's context alignment)."""
    if args.head == "eagle":
        f = h[:, :-1].float()                                                   # [B, T-1, dim]
        if train and args.noise:
            # EAGLE's noise exactly: U(-noise/2, noise/2) * 512 / T on the input features only
            f = f + (torch.rand_like(f) - 0.5) * (args.noise * 512 / h.shape[1])
        attn, keep = head.layer.block.attention, head.layer.block.attention.kv_cache
        attn.kv_cache = StepCache()
        outs = []
        for j in range(max(1, args.unroll)):
            nxt = F.pad(tokens[:, j + 1:], (0, j))                          # token t+j+1, 0 past the end
            outs.append(run_layer(head.layer, head.rows(base, f, nxt), base.freqs_cis, step=j))
            f = outs[-1]
        attn.kv_cache = keep
        return outs[0] if args.unroll <= 1 else torch.stack(outs)
    if args.head == "hydra" and head.prefix is not None:
        return head.prefix_norm(run_layer(head.prefix, h.float(), base.freqs_cis))
    return h


def head_outputs(head, base, args, k: int, feats, tokens, answer, h, W):
    """Head k at every position t whose target, token t+k+2, is an answer token (the base's own next
    token is t+1; head 0 predicts one past it). feats: head_trunk's output.
    Returns (logits [N, V'], targets [N] full-vocab ids, sel bool [B, T-k-2], extra loss or None)."""
    n = tokens.shape[1] - k - 2
    sel = answer[:, k + 2:]                                                     # [B, n]
    if args.head == "eagle" and args.unroll > 1:
        feats = feats[k]                             # draft step k: predicts h_{t+k+1}, then token t+k+2
    x = feats[:, :n][sel]                                                       # [N, dim]
    extra = None
    if args.head == "medusa":
        y = head.medusa_head[k](x)
        logits = y if head.lm_head else F.linear(y, W)
    elif args.head == "hydra":
        # teacher forcing: the true tokens t+1 .. t+k+1 stand where decoding has the drafted path
        embs = [base.tok_embeddings(tokens[:, j:n + j][sel]).float() for j in range(1, k + 2)]
        y = head.hydra_mlp[k](torch.cat([x.float()] + embs, -1))
        logits = head.hydra_lm_head[k](y) if head.hydra_lm_head is not None else F.linear(y, W)
    else:
        logits = F.linear(x, W)        # the base's lm_head on the predicted feature t+1 -> token t+2
        extra = F.smooth_l1_loss(x.float(), h[:, k + 1:n + k + 1][sel].float())  # to the true h_{t+k+1}
    return logits, tokens[:, k + 2:][sel], sel, extra


def context_vocab(tokens, t2d):
    """--context: the batch's tokens outside the draft vocab, which Drafter.note_context adds to the draft
    at inference once they are in the context. Returns oov [U] token ids and seen [B, T, U]: token u
    is in the context of the draft from position t (the tokens up to t+1, the root, are known then)."""
    B, T = tokens.shape
    out = t2d[tokens] < 0                                                      # [B, T]
    oov = tokens[out].unique()                                                 # [U], sorted
    U = oov.shape[0]
    idx = torch.where(out, torch.searchsorted(oov, tokens), U)                 # [B, T], U: in the vocab
    pos = torch.arange(T, device=tokens.device).expand(B, T)
    first = torch.full((B, U + 1), T, device=tokens.device).scatter_reduce(1, idx, pos, "amin")[:, :U]
    return oov, first[:, None, :] <= torch.arange(T, device=tokens.device)[None, :, None] + 1


def run_batch(head, base, args, tokens, answer, W, t2d, train: bool, h=None):
    """One batch: the base's hidden states (frozen, no grad, computed once for every head, or given:
    h [B, T, dim] from the features cache), then each head's loss and the rank of its target where it
    predicts an answer token. With train, backpropagates one head at a time, so that only one [N, V'] logits
    tensor lives at once. tokens, answer: [B, T] (answer[b, t]: token t is a self-distilled answer token);
    W [V', dim]: the base's lm_head rows of the draft vocab. Returns (weighted loss, ranks [P, K]): at each of
    the P roots whose head-0 target is an answer token, the rank of head k's target in its draft (0: its top-1;
    RANKS: not in its top RANKS or not in the draft at all; -1: no target, past the answer's end)."""
    T = tokens.shape[1]
    amp = torch.autocast(tokens.device.type, dtype=torch.bfloat16, enabled=args.bf16)  # the heads'
    if h is None:
        with torch.no_grad():
            h = base(tokens, torch.arange(T, device=tokens.device), return_hidden=True)[2]    # [B, T, dim]
    h = h.to(W.dtype)
    teacher = args.targets == "teacher" or (args.targets == "auto" and args.head in ("hydra", "eagle"))
    with amp, torch.set_grad_enabled(train):
        trunk = head_trunk(head, base, args, h, tokens, train)
    # a shared trunk (EAGLE's layer, Hydra++'s prefix) is cut off here and backpropagated once at the end
    leaf = trunk.detach().requires_grad_() if train and trunk.requires_grad else trunk
    K = num_heads(head, args)
    Vd, seen = W.shape[0], None
    if args.context:  # score the context's tokens outside the vocab as decoding does, with their lm_head rows
        oov, seen = context_vocab(tokens, t2d)
        W = torch.cat([W, base.output.weight[oov]])                             # [V' + U, dim]
        t2d = t2d.clone().index_put_((oov,), torch.arange(Vd, W.shape[0], device=W.device))
    total = 0.0
    ranks = torch.full((K,) + answer[:, 2:].shape, -1, dtype=torch.long, device=tokens.device)  # [K, B, T-2]
    for k in range(K):
        with amp, torch.set_grad_enabled(train):
            logits, targets, sel, extra = head_outputs(head, base, args, k, leaf, tokens, answer, h, W)
            if logits.shape[0] == 0:
                continue
            logits = logits.float()
            tgt = targets if t2d is None else t2d[targets]                      # draft ids, -1: not in it
            if seen is not None:
                # a context token not yet seen at t is not in the draft: -1e4, not -inf, keeps kl_div finite
                hide = F.pad(~seen[:, :tokens.shape[1] - k - 2][sel], (Vd, 0))   # [N, V' + U]
                logits = logits.masked_fill(hide, -1e4)
                tgt = tgt.masked_fill(hide.gather(1, tgt.clamp(min=0)[:, None])[:, 0], -1)
            logp = F.log_softmax(logits, -1)                                    # [N, V'(+U)]
            if teacher:
                # KL(base || head) to the base's distribution at t+k+1 (the soft cross-entropy less the
                # base's entropy: the same gradient, and 0 at a perfect match); with a draft vocab, that
                # distribution renormalised over it
                with torch.no_grad():
                    z = F.linear(h[:, k + 1:T - 1][sel], W).float()
                    logp_base = F.log_softmax(z if seen is None else z.masked_fill(hide, -1e4), -1)  # [N, V'(+U)]
                loss = F.kl_div(logp, logp_base, log_target=True, reduction="batchmean")
            else:
                ok = tgt >= 0
                loss = F.nll_loss(logp[ok], tgt[ok]) if bool(ok.any()) else logp.sum() * 0
            if extra is not None:  # EAGLE: regression 1.0, classification 0.1 as in the paper
                loss = args.v_weight * extra + args.p_weight * loss
            w = args.head_decay ** k  # Medusa's lambda_k = 0.8^k (EAGLE-3's for its steps): far heads are less certain
        if train:
            (w * loss).backward()
        total += w * loss.item()
        with torch.no_grad():
            at = logits.gather(1, tgt.clamp(min=0)[:, None])                    # [N, 1]
            r = torch.where(tgt >= 0, ((logits >= at).sum(-1) - 1).clamp(max=RANKS), RANKS)  # ties rank it lower
            ranks[k, :, :sel.shape[1]][sel] = r
    if leaf is not trunk and leaf.grad is not None:
        trunk.backward(leaf.grad)
    return total, ranks.permute(1, 2, 0)[answer[:, 2:]]                        # [P, K]


def hit_rates(ranks, top: int) -> list:
    """Per head, the fraction of its targets in its top `top`. ranks: [P, K] from run_batch."""
    return [round(float((r[r >= 0] < top).float().mean()), 4) if bool((r >= 0).any()) else 0.0 for r in ranks.T]


# ---------------------------------------------------------------- training

def make_batch(seqs, plens, ids, B: int, device, feats=None, offsets=None):
    """Right-padded [B, T] tokens and answer mask; missing rows (a short last batch) are all padding.
    With feats (the features cache) and its sequence offsets, also their hidden states [B, T, dim], else None."""
    T = max(len(seqs[i]) for i in ids)
    tokens = torch.zeros(B, T, dtype=torch.long)
    answer = torch.zeros(B, T, dtype=torch.bool)
    h = None if feats is None else torch.zeros(B, T, feats.shape[1], dtype=torch.float16)
    for r, i in enumerate(ids):
        s = seqs[i]
        tokens[r, :len(s)] = torch.from_numpy(s.astype(np.int64))
        answer[r, plens[i]:len(s)] = True
        if h is not None:
            h[r, :len(s)] = torch.from_numpy(np.array(feats[offsets[i]:offsets[i] + len(s)]))
    return tokens.to(device), answer.to(device), None if h is None else h.to(device)


def cached_features(path, base, seqs, plens, B: int, device):
    """The base's hidden states (after the final norm) at every token of the data, [total, dim] float16
    (exact for bf16 values), computed once and kept in `path` (.npy, ~1 KB a token: not for the repo) so
    that every later run, of any head, skips the frozen base forward, most of a training step's cost."""
    total, dim = sum(len(s) for s in seqs), base.args.dim
    path = Path(path)
    if path.exists():
        feats = np.load(path, mmap_mode="r")
        if feats.shape == (total, dim):
            return feats
        print(f"note: {path} holds {feats.shape}, this data needs {(total, dim)}: recomputing it", file=sys.stderr)
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in seqs])])
    tmp = path.with_name(path.name + ".tmp.npy")
    feats = np.lib.format.open_memmap(tmp, mode="w+", dtype=np.float16, shape=(total, dim))
    order = sorted(range(len(seqs)), key=lambda i: len(seqs[i]))  # little padding
    base.setup_caches(B, max(len(s) for s in seqs))
    with torch.no_grad():
        for j in tqdm(range(0, len(order), B), desc=f"features -> {path}", dynamic_ncols=True):
            ids = order[j:j + B]
            tokens, _, _ = make_batch(seqs, plens, ids, B, device)
            h = base(tokens, torch.arange(tokens.shape[1], device=device), return_hidden=True)[2].float()
            if not torch.isfinite(h.half()).all():
                raise ValueError("hidden states overflow float16: train without --features")
            for r, i in enumerate(ids):
                feats[offsets[i]:offsets[i + 1]] = h[r, :len(seqs[i])].half().cpu().numpy()
    feats.flush()
    del feats
    os.replace(tmp, path)
    return np.load(path, mmap_mode="r")


def epoch_batches(lengths, train_ids, B: int, seed: int, epoch: int) -> list:
    """This epoch's batches: shuffled, then sorted by length within windows of 32 batches (little
    padding, still random), in shuffled order. Depends only on (seed, epoch): --resume finds its place."""
    g = torch.Generator().manual_seed(seed * 100_003 + epoch)
    order = [train_ids[i] for i in torch.randperm(len(train_ids), generator=g).tolist()]
    batches = []
    for w in range(0, len(order), 32 * B):
        window = sorted(order[w:w + 32 * B], key=lambda i: lengths[i])
        batches += [window[j:j + B] for j in range(0, len(window), B)]
    return [batches[i] for i in torch.randperm(len(batches), generator=g).tolist()]


def lr_at(step: int, total: int, warmup: int, lr: float, min_ratio: float = 0.1) -> float:
    # linear warmup, then cosine down to min_ratio * lr
    if step < warmup:
        return lr * (step + 1) / warmup
    p = (step - warmup) / max(1, total - warmup)
    return lr * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * p)))


def lookup_acceptance(seqs, plens, ids, ns=(1, 2, 3, 4), depth: int = 8) -> dict:
    """How prompt lookup (--lookup N) fares on these sequences' answers: for each N, at how many
    roots its chain's first j tokens are right (trees.lookup_counts), for --tree auto."""
    roots = sum(len(seqs[i]) - 1 - plens[i] for i in ids)
    counts = {str(n): [sum(c) for c in zip(*[lookup_counts([int(x) for x in seqs[i]], plens[i], n, depth)
                                              for i in ids])] for n in ns}
    return {"roots": roots, "counts": counts}


def draft_vocab(seqs, plens, ids, V: int, size: int):
    """The `size` most frequent answer tokens of the training split (FR-Spec / EAGLE-3): d2t [V'] maps a
    draft id to its token (ascending ids), t2d [V] maps back (-1: not in the draft vocab)."""
    if not 0 < size < V:
        raise ValueError(f"--draft_vocab must be between 1 and the vocab size {V}, got {size}")
    counts = np.zeros(V, np.int64)
    for i in ids:
        counts += np.bincount(seqs[i][plens[i]:].astype(np.int64), minlength=V)
    d2t = torch.from_numpy(np.sort(np.argsort(-counts, kind="stable")[:size]))
    t2d = torch.full((V,), -1, dtype=torch.long)
    t2d[d2t] = torch.arange(size)
    return d2t, t2d


def init_from(head, folder, base, kind: str, d2t):
    """Start from a saved head's weights (fine-tuning on more data, say) with a fresh optimizer and
    schedule. Its draft vocab is this data's: a head with its own lm_head must have been saved with the same one."""
    cfg = Path(folder) / "config.json"
    if cfg.exists() and json.loads(cfg.read_text()).get("quantization"):
        raise ValueError(f"--init: {folder} holds int8 heads (quantize.py): start from their float source")
    try:
        old = load_heads(folder, base, kind)
    except HeadError as e:
        raise ValueError(f"--init: {e}") from None
    old_d2t = old.d2t
    own_rows = any("lm_head" in k for k in old.state_dict()) or isinstance(old, Medusa) and old.lm_head
    same_vocab = old_d2t is None and d2t is None or (
        old_d2t is not None and d2t is not None and torch.equal(old_d2t.cpu(), d2t.cpu()))
    if own_rows and not same_vocab:
        raise ValueError(f"--init: {folder} has its own lm_head over another draft vocab than this data gives: "
                         "train it from scratch, or use --shared_lm_head")
    sd = {k: v.float() for k, v in old.state_dict().items()}
    mine = head.state_dict()
    if isinstance(head, Hydra) and head.prefix is not None and old.prefix is None:
        # Hydra grows into Hydra++: the new prefix layer keeps its identity start (zero output
        # projections), so training begins from the saved heads reading the (renormed) hidden states
        sd.update({k: v for k, v in mine.items() if k.startswith("prefix")})
    if sd.keys() != mine.keys() or any(sd[k].shape != mine[k].shape for k in sd):
        raise ValueError(f"--init: {folder} holds a {kind} head of another shape (heads, layers, lm_head) "
                         "than these settings make: give the settings it was trained with")
    head.load_state_dict(sd)


# what a checkpoint's run must share with the run that resumes it
RESUME_KEYS = ("head", "init", "num_heads", "num_layers", "shared_lm_head", "hydra_prefix", "unroll", "draft_vocab", "context", "targets",
               "data", "checkpoint", "batch_size", "max_len", "holdout", "seed", "epochs", "steps", "lr", "warmup")


@dataclass
class Run:
    """What a training run works on, fixed by setup: the frozen base, the data split, the head, its optimizer."""
    base: nn.Module
    base_name: str
    seqs: list              # token sequences, cut to --max_len
    plens: list             # their prompt lengths
    offsets: np.ndarray     # where each uncut sequence starts in --features
    feats: object           # the cached base features (--features) or None
    train_ids: list
    hold_ids: list          # held out: the last sequences of the data
    head: nn.Module
    t2d: object             # the draft vocab's map from token ids (--draft_vocab) or None
    W: Tensor               # [V', dim] the frozen lm_head rows the heads' logits use
    opt: torch.optim.Optimizer
    lr: float
    total: int              # optimizer steps in the schedule
    per_epoch: int
    init_record: object     # --init's train_record.json


def check_args(args):
    if args.unroll < 1 or args.unroll > 1 and args.head != "eagle":
        raise ValueError(f"--unroll {args.unroll}: give EAGLE 1 or more draft steps to train (other heads: leave it out)")
    if args.tree_size < 1:
        raise ValueError(f"--tree_size {args.tree_size}: the fitted tree needs at least 1 node")
    if args.context and (not args.draft_vocab or args.head != "eagle" and not args.shared_lm_head):
        raise ValueError("--context needs --draft_vocab and a head that shares the base lm_head "
                         "(EAGLE, or --shared_lm_head): only those draft the context's tokens")


def setup(args, device) -> Run:
    """The frozen base, the data (checked against it) and its held-out split, a fresh head (or --init's)
    and its optimizer."""
    # --bf16: the frozen base runs in bf16 (as decoding with --dtype bfloat16 does; its static cache
    # takes one dtype, so no autocast there) and the heads under autocast with fp32 weights
    base, _ = load_model(args.checkpoint, device, torch.bfloat16 if args.bf16 else torch.float32)
    base.requires_grad_(False)
    base_name = args.checkpoint or DEFAULT_NAME
    seqs, plens, _, meta = read_data(args.data)
    if "spec_bench" in str(meta.get("prompts", "")).lower():
        raise ValueError(f"{args.data} answers Spec-Bench prompts: never train on the evaluation set")
    if meta.get("vocab_size") != base.args.vocab_size:
        raise ValueError(f"{args.data} holds tokens of a vocab of {meta.get('vocab_size')}, the base model has "
                         f"{base.args.vocab_size}: make the data with this base model")
    if meta.get("base_model") != base_name:
        print(f"warning: {args.data} was written by {meta.get('base_model')}, training for {base_name}",
              file=sys.stderr)
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in seqs])])  # of the uncut sequences, for --features
    feats = cached_features(args.features, base, seqs, plens, args.batch_size, device) if args.features else None
    seqs = [s[:args.max_len] for s in seqs]
    plens = [min(int(p), len(s)) for p, s in zip(plens, seqs)]
    N = len(seqs)
    n_hold = max(1, round(N * args.holdout)) if N > 1 and args.holdout > 0 else 0
    train_ids, hold_ids = list(range(N - n_hold)), list(range(N - n_hold, N))
    if not train_ids:
        raise ValueError(f"{args.data} holds no sequences: make data with `distill.py generate`")
    d2t = t2d = None
    if args.draft_vocab:
        d2t, t2d = draft_vocab(seqs, plens, train_ids, base.args.vocab_size, args.draft_vocab)
        d2t, t2d = d2t.to(device), t2d.to(device)
    head = make_head(args, base, d2t).to(device)
    init_file = Path(args.init or ".") / "train_record.json"
    init_record = json.loads(init_file.read_text()) if args.init and init_file.exists() else None  # OUT may be INIT
    if args.init and not args.resume:
        init_from(head, args.init, base, args.head, d2t)
    W = base.output.weight if d2t is None else base.output.weight[d2t]          # [V', dim], frozen
    lr = args.lr or {"medusa": 1e-3, "hydra": 1e-3, "eagle": 3e-4}[args.head]
    opt = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=lr, betas=(0.9, 0.95),
                            weight_decay=args.weight_decay)
    per_epoch = math.ceil(len(train_ids) / args.batch_size)
    return Run(base, base_name, seqs, plens, offsets, feats, train_ids, hold_ids, head, t2d, W, opt, lr,
               args.steps or args.epochs * per_epoch, per_epoch, init_record)


def resume(args, run: Run, ckpt_path: Path) -> tuple:
    """(step, seconds spent, losses) where the run starts: --resume's checkpoint, or the beginning."""
    if not args.resume:
        if ckpt_path.exists():
            print(f"note: starting over, {ckpt_path} will be overwritten (--resume continues it)", file=sys.stderr)
        return 0, 0.0, []
    if not ckpt_path.exists():
        raise ValueError(f"--resume: no checkpoint {ckpt_path}")
    ckpt = torch.load(ckpt_path, map_location=run.W.device, weights_only=True)
    # a switch added after the checkpoint was made was off then
    made = {k: ckpt["args"].get(k, False if isinstance(vars(args).get(k), bool) else None) for k in RESUME_KEYS}
    differ = [k for k in RESUME_KEYS if made[k] != vars(args).get(k)]
    if differ:
        raise ValueError(f"--resume: {ckpt_path} was made with other settings ("
                         + ", ".join(f"--{k} {made[k]}" for k in differ) + "): use those")
    run.head.load_state_dict(ckpt["head"])
    run.opt.load_state_dict(ckpt["opt"])
    torch.set_rng_state(ckpt["rng"])
    print(f"resuming {ckpt_path} at step {ckpt['step']} of {run.total}", file=sys.stderr)
    return ckpt["step"], ckpt["elapsed"], ckpt["losses"]


def save_checkpoint(args, run: Run, ckpt_path: Path, step: int, elapsed: float, losses: list):
    ckpt_path.parent.mkdir(parents=True, exist_ok=True)
    state = {"step": step, "elapsed": elapsed, "losses": losses,
             "head": run.head.state_dict(), "opt": run.opt.state_dict(), "rng": torch.get_rng_state(),
             "args": {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, type(None)))}}
    torch.save(state, ckpt_path.with_name("ckpt.pt.tmp"))
    os.replace(ckpt_path.with_name("ckpt.pt.tmp"), ckpt_path)


def train_loop(args, run: Run, ckpt_path: Path, step: int, elapsed: float, losses: list) -> tuple:
    """Optimizer steps from `step` to the schedule's end (or --stop_after, --minutes, Ctrl-C), saving a
    checkpoint every --save_every steps and at the end. Returns (step, seconds spent, time up)."""
    B, K, device = args.batch_size, num_heads(run.head, args), run.W.device
    # the frozen forward writes a cache; one, sized for the longest (and the positions of --unroll's steps)
    run.base.setup_caches(B, max(len(s) for s in run.seqs) + max(0, args.unroll))
    stop_at = min(run.total, args.stop_after) if args.stop_after else run.total
    recent = []  # (hits1, counts) of the last steps, for the progress bar
    bar = tqdm(total=run.total, initial=step, desc=f"train {args.head}", dynamic_ncols=True)
    t0, batches, time_up = time.perf_counter(), None, False
    run.head.train()
    try:
        while step < stop_at:
            if batches is None or step % run.per_epoch == 0:
                batches = epoch_batches([len(s) for s in run.seqs], run.train_ids, B, args.seed, step // run.per_epoch)
            at = step
            if args.minutes:  # a time budget: the schedule runs over whichever of steps or time ends first
                at = max(step, int(run.total * (elapsed + time.perf_counter() - t0) / (60 * args.minutes)))
                if at >= run.total:
                    time_up = True
                    break
            tokens, answer, h = make_batch(run.seqs, run.plens, batches[step % run.per_epoch], B, device, run.feats,
                                           run.offsets)
            for g in run.opt.param_groups:
                g["lr"] = lr_at(at, run.total, args.warmup, run.lr)
            loss, ranks = run_batch(run.head, run.base, args, tokens, answer, run.W, run.t2d, train=True, h=h)
            if args.grad_clip:
                torch.nn.utils.clip_grad_norm_(run.head.parameters(), args.grad_clip)
            run.opt.step()
            run.opt.zero_grad(set_to_none=True)
            step += 1
            losses.append(loss)
            recent = (recent + [((ranks == 0).sum(0).tolist(), (ranks >= 0).sum(0).tolist())])[-50:]
            acc = [sum(r[0][k] for r in recent) / max(1, sum(r[1][k] for r in recent)) for k in range(K)]
            bar.update(1)
            bar.set_postfix(loss=f"{sum(losses[-50:]) / len(losses[-50:]):.3f}", top1=" ".join(f"{a:.2f}" for a in acc))
            if args.save_every and step % args.save_every == 0:
                save_checkpoint(args, run, ckpt_path, step, elapsed + time.perf_counter() - t0, losses)
    except KeyboardInterrupt:
        print(f"\ninterrupted at step {step}", file=sys.stderr)
    bar.close()
    elapsed += time.perf_counter() - t0
    save_checkpoint(args, run, ckpt_path, step, elapsed, losses)
    return step, elapsed, time_up


def held_out(args, run: Run) -> Tensor:
    """The rank of the true token in each head's logits at every held-out answer position: [P, K]
    (-1 where a head has no target there)."""
    run.head.eval()
    ranks = [torch.zeros(0, num_heads(run.head, args), dtype=torch.long)]
    with torch.no_grad():
        for j in range(0, len(run.hold_ids), args.batch_size):
            tokens, answer, h = make_batch(run.seqs, run.plens, run.hold_ids[j:j + args.batch_size], args.batch_size,
                                           run.W.device, run.feats, run.offsets)
            ranks.append(run_batch(run.head, run.base, args, tokens, answer, run.W, run.t2d, train=False, h=h)[1].cpu())
    return torch.cat(ranks)


def train(args):
    """Trains --head on --data, then writes OUT: the head in its official layout, acceptance.json (what
    `--tree auto` weighs), tree.json (a static tree fit to the held-out ranks) and train_record.json."""
    device = check_device(args.device)
    check_args(args)
    torch.manual_seed(args.seed)
    run = setup(args, device)
    out = Path(args.out)
    ckpt_path = out / "ckpt.pt"
    step, elapsed, losses = resume(args, run, ckpt_path)
    step, elapsed, time_up = train_loop(args, run, ckpt_path, step, elapsed, losses)
    if time_up:
        print(f"--minutes {args.minutes}: the time was up at step {step} of {run.total}", file=sys.stderr)
    elif step < run.total:
        print(f"stopped at step {step} of {run.total}; {ckpt_path} saved: continue with the same command and --resume",
              file=sys.stderr)
    ranks = held_out(args, run)                                                   # [P, K]
    counts = (ranks >= 0).sum(0).tolist()
    top1, top5 = hit_rates(ranks, 1), hit_rates(ranks, 5)
    # a static tree fit to these heads, as Medusa fit mc_sim_7b_63 to vicuna-7b's: --tree OUT/tree.json
    prefixes = prefix_counts(ranks, RANKS)
    paths = best_paths(prefixes, args.tree_size)
    tree = {"size": len(paths), "heldout_tau": round(tree_tau(ranks, paths), 3),
            "heldout_tau_mc_sim_7b_63": round(tree_tau(ranks, MEDUSA_TREES["mc_sim_7b_63"]), 3)}
    save_heads(run.head, out, base_model=run.base_name, dtype=getattr(torch, args.save_dtype))
    # what `--tree auto` weighs against this machine's step costs (trees.choose_tree): how many
    # held-out roots start with each of the most frequent index paths
    top = best_paths(prefixes, 512)
    (out / "acceptance.json").write_text(json.dumps(
        {"roots": int(ranks.shape[0]), "paths": top, "counts": [prefixes[tuple(p)] for p in top],
         "lookup": lookup_acceptance(run.seqs, run.plens, run.hold_ids)}) + "\n")
    if paths:
        (out / "tree.json").write_text(json.dumps(paths))
    else:  # no head ever drafted a held-out token right: no tree, and none left from an earlier run
        (out / "tree.json").unlink(missing_ok=True)
    record = train_record(args, run, step, elapsed, losses, counts, top1, top5, tree)
    (out / "train_record.json").write_text(json.dumps(record, indent=1))
    print(f"saved {out} (step {step}); held-out top-1 per head {top1}, top-5 {top5}; expected tau of "
          f"tree.json ({len(paths)} nodes) {tree['heldout_tau']}, of mc_sim_7b_63 {tree['heldout_tau_mc_sim_7b_63']}",
          file=sys.stderr)
    return {**record, "losses": losses}


def train_record(args, run: Run, step, elapsed, losses, counts, top1, top5, tree) -> dict:
    lengths = [len(s) for s in run.seqs]
    n_curve = min(20, len(losses))
    chunk = len(losses) / max(1, n_curve)
    return {
        "base_model": run.base_name, "head": args.head, "num_heads": num_heads(run.head, args),
        "data": str(args.data), "data_sequences": len(run.seqs), "data_tokens": int(sum(lengths)),
        "data_answer_tokens": int(sum(l - p for l, p in zip(lengths, run.plens))),
        "train_sequences": len(run.train_ids), "heldout_sequences": len(run.hold_ids),
        "steps": step, "total_steps": run.total, "time_s": round(elapsed, 1),
        "loss_curve": [round(sum(losses[int(i * chunk):int((i + 1) * chunk)]) / max(1, int((i + 1) * chunk) - int(i * chunk)), 4)
                       for i in range(n_curve)],
        "heldout": {"positions": counts, "top1": top1, "top5": top5},
        "tree": tree,   # tree.json's expected tau on the held-out text, and mc_sim_7b_63's
        "draft_vocab": args.draft_vocab or None,
        "context": args.context,   # held-out accuracy also counts the context's tokens outside the vocab
        # --init: how the heads it started from were trained (their own record)
        "init": run.init_record,
        "args": {k: v for k, v in vars(args).items() if isinstance(v, (str, int, float, bool, type(None)))},
    }


# ---------------------------------------------------------------- CLI

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--head", required=True, choices=["medusa", "hydra", "eagle"])
    p.add_argument("--data", default="data/selfdistill.npz")
    p.add_argument("--out", required=True, help="heads folder: official layout, train_record.json, ckpt.pt")
    p.add_argument("--checkpoint", default=None, help="base model (default: the embedded SmolLM2-135M-Instruct)")
    p.add_argument("--num_heads", type=int, default=4, help="Medusa/Hydra heads (the named trees are 4 deep)")
    p.add_argument("--num_layers", type=int, default=1, help="Medusa ResBlocks / Hydra MLP blocks per head")
    p.add_argument("--shared_lm_head", action="store_true",
                   help="Medusa, Hydra: heads share the base's lm_head (as MLC-LLM's Medusa), a fraction of the size")
    p.add_argument("--hydra_prefix", action="store_true", help="Hydra++: a decoder layer over the hidden states first")
    p.add_argument("--targets", default="auto", choices=["auto", "tokens", "teacher"],
                   help="tokens: cross-entropy to the data's tokens; teacher: to the base's distribution; "
                        "auto: tokens for Medusa, teacher for Hydra and EAGLE")
    p.add_argument("--head_decay", type=float, default=0.8, help="head k's loss weight is head_decay^k")
    p.add_argument("--noise", type=float, default=0.2, help="EAGLE: uniform input noise U(-n/2, n/2) * 512 / T")
    p.add_argument("--v_weight", type=float, default=1.0, help="EAGLE: feature regression (smooth L1) weight")
    p.add_argument("--p_weight", type=float, default=0.1, help="EAGLE: token loss weight")
    p.add_argument("--unroll", type=int, default=1, help="EAGLE: train U draft steps, each from the previous "
                   "step's own predicted features (training-time test); held-out accuracy per step")
    p.add_argument("--tree_size", type=int, default=63, help="nodes of the static tree fit to the heads' "
                   "held-out ranks, written to OUT/tree.json")
    p.add_argument("--draft_vocab", type=int, default=0, help="predict over the V' most frequent tokens (0: all)")
    p.add_argument("--context", action="store_true", help="with --draft_vocab and a shared lm_head: also predict "
                   "the tokens outside the vocab that the context holds so far, as decoding drafts them")
    p.add_argument("--batch_size", type=int, default=8, help="sequences a step")
    p.add_argument("--max_len", type=int, default=1024, help="longer sequences are cut")
    p.add_argument("--epochs", type=int, default=1)
    p.add_argument("--steps", type=int, default=0, help="total steps (0: --epochs over the data)")
    p.add_argument("--lr", type=float, default=None, help="default 1e-3 (Medusa, Hydra), 3e-4 (EAGLE)")
    p.add_argument("--warmup", type=int, default=100, help="linear warmup steps, then cosine to lr/10")
    p.add_argument("--weight_decay", type=float, default=0.0)
    p.add_argument("--grad_clip", type=float, default=1.0)
    p.add_argument("--holdout", type=float, default=0.05, help="the last fraction of sequences, for accuracy")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--bf16", action="store_true", help="the base in bfloat16, the heads under bfloat16 autocast "
                                                       "(their weights stay fp32)")
    p.add_argument("--save_dtype", default="bfloat16", choices=["bfloat16", "float32"],
                   help="the saved heads' weights (training keeps fp32)")
    p.add_argument("--save_every", type=int, default=500, help="checkpoint every N steps (and at the end)")
    p.add_argument("--resume", action="store_true", help="continue from OUT/ckpt.pt")
    p.add_argument("--init", default=None, help="start from this saved heads folder's weights (a new optimizer "
                                                "and schedule): fine-tune a head on more data")
    p.add_argument("--features", default=None, help="cache of the base's hidden states over the data (.npy, made "
                   "on first use, ~1 KB a token): later runs of any head skip the base forward")
    p.add_argument("--minutes", type=float, default=0, help="a time budget: stop after this many minutes, the "
                   "lr schedule running over whichever of the steps or the time ends first")
    p.add_argument("--stop_after", type=int, default=0, help="stop (checkpointed) after step N; --resume later")

    args = p.parse_args(argv)
    try:
        return train(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
