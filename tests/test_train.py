"""train.py on a tiny random base model (conftest's `tiny`, and `dataset`, the text it wrote itself):
each head type trains (loss falls), saves in its official layout, loads back with heads.load_heads and
drafts for greedy speculative decoding that equals autoregressive decoding; --resume continues a run
exactly; the draft vocabulary is stored."""
import json

import numpy as np
import pytest
import torch
from safetensors.torch import load_file

import distill
import generate
import heads
import train
from generate import load_model
from conftest import TINY_VOCAB
import speculate
import checkpoint


pytestmark = pytest.mark.usefixtures("one_thread")


def train_args(tiny, dataset, out, kind, *extra):
    return ["--head", kind, "--checkpoint", str(tiny), "--data", str(dataset), "--out", str(out),
            "--batch_size", "4", "--warmup", "3", "--save_every", "0", "--lr", "3e-3", *extra]


def speculative_equals_autoregressive(model, head, prompt, new, drafted=None, **spec):
    """drafted: a list that collects every step's draft tokens."""
    eos = None
    draft, accept, depth, nodes, scratch = speculate.speculator(model, head, **spec)
    if drafted is not None:
        inner = draft

        def draft(*state):
            tokens, tree = inner(*state)
            drafted.append(tokens)
            return tokens, tree
    speculate.setup_caches(model, head, len(prompt) + new + nodes, scratch)
    sampling = dict(temperature=0.0, top_k=0, top_p=1.0)
    prompt = torch.tensor(prompt)
    with torch.inference_mode():
        first, state = speculate.start(model, head, prompt, depth, sampling)
        out, steps = speculate.decode(lambda *s: speculate.spec_step(model, draft, accept, *s), state, first, new, eos)
        first, state = speculate.start(model, None, prompt, 0, sampling)
        ref, _ = speculate.decode(lambda t, p: speculate.ar_step(model, t, p), state, first, new, eos)
    assert out == ref
    return (len(out) - 1) / steps


@pytest.mark.parametrize("kind,extra", [("medusa", []), ("medusa", ["--shared_lm_head"]), ("hydra", []),
                                        ("hydra", ["--hydra_prefix"]), ("eagle", []), ("eagle", ["--bf16"]),
                                        ("eagle", ["--unroll", "3"])],
                         ids=["medusa", "medusa-shared-lm-head", "hydra", "hydra++", "eagle", "eagle-bf16",
                              "eagle-unroll"])
def test_train_head(tiny, dataset, tmp_path, kind, extra):
    out = tmp_path / kind
    record = train.main(train_args(tiny, dataset, out, kind, "--steps", "30", *extra))
    losses = record["losses"]
    assert len(losses) == 30 and np.mean(losses[-5:]) < 0.85 * np.mean(losses[:5]), losses
    saved = json.loads((out / "train_record.json").read_text())
    assert saved["steps"] == 30 and saved["heldout_sequences"] >= 1 and saved["base_model"] == str(tiny)
    K = 4 if kind != "eagle" else 3 if "--unroll" in extra else 1
    assert len(saved["heldout"]["top1"]) == K and all(0 <= a <= b <= 1 for a, b in
                                                      zip(saved["heldout"]["top1"], saved["heldout"]["top5"]))

    model, _ = load_model(str(tiny))
    head = generate.load_heads(out, model)
    assert type(head).__name__.lower() == kind
    trained = torch.load(out / "ckpt.pt", weights_only=True)["head"]
    loaded = head.state_dict()
    # saved in bf16 (--save_dtype's default), loaded in the base's fp32
    assert set(loaded) == set(trained) and all(torch.equal(loaded[k], trained[k].bfloat16().float()) for k in loaded)

    seqs, plens, _, _ = distill.read_data(dataset)
    taus = [speculative_equals_autoregressive(model, head, seqs[i][:plens[i]].tolist(), 40, tree="tree10")
            for i in (-1, -2)]
    if kind == "eagle":
        speculative_equals_autoregressive(model, head, seqs[-1][:plens[-1]].tolist(), 40, dynamic=(3, 3, 8))
    assert max(taus) > 1.5, taus  # trained heads do get drafts accepted on the model's own text
    # the static tree fit to the held-out ranks: the best of its size there, so no worse than
    # mc_sim_7b_63 (63 nodes too), and it drafts for decoding like any tree
    fit = saved["tree"]
    assert fit["size"] == len(json.loads((out / "tree.json").read_text())) > 0
    assert fit["heldout_tau"] >= fit["heldout_tau_mc_sim_7b_63"] > 1, fit
    speculative_equals_autoregressive(model, head, seqs[-1][:plens[-1]].tolist(), 40, tree=str(out / "tree.json"))
    # what --tree auto reads: the same counts, so the same expected tau for the fitted tree
    acc = json.loads((out / "acceptance.json").read_text())
    counts = {tuple(p): c for p, c in zip(acc["paths"], acc["counts"])}
    paths = json.loads((out / "tree.json").read_text())
    assert 1 + sum(counts[tuple(p)] for p in paths) / acc["roots"] == pytest.approx(fit["heldout_tau"], abs=1e-3)
    # and prompt lookup's acceptance on the same held-out answers: j right tokens imply j - 1
    lk = acc["lookup"]
    for n, c in lk["counts"].items():
        assert len(c) == 8 and all(a >= b for a, b in zip(c, c[1:])) and c[0] <= lk["roots"], (n, c)
    assert lk["counts"]["3"][0] > 0


def test_tree_size_is_checked(tiny, dataset, tmp_path, capsys):
    with pytest.raises(SystemExit):
        train.main(train_args(tiny, dataset, tmp_path / "x", "medusa", "--steps", "1", "--tree_size", "0"))
    assert "--tree_size 0: the fitted tree needs at least 1 node" in capsys.readouterr().err


def test_unrolled_steps_are_the_draft(tiny):
    """--unroll's step j at row t is what decoding drafts at depth j+1 from root t: the same rows,
    positions and attention, run here through the head's own KV cache as heads.py runs it."""
    model, _ = load_model(str(tiny))
    torch.manual_seed(1)
    head = heads.Eagle(model.args)
    T, U = 24, 3
    tokens = torch.randint(0, model.args.vocab_size, (1, T))
    model.setup_caches(1, T + U)
    args = type("A", (), {"head": "eagle", "unroll": U, "noise": 0.0})()
    with torch.no_grad():
        h = model(tokens, torch.arange(T), return_hidden=True)[2]                # [1, T, dim]
        steps = train.head_trunk(head, model, args, h, tokens, train=False)       # [U, 1, T-1, dim]
        assert steps.shape == (U, 1, T - 1, model.args.dim)
        head.setup_caches(T + U)
        for t in (0, 5, T - U - 1):
            out = head.layer.catch_up(head.rows(model, h[0, :t + 1], tokens[0, 1:t + 2]), torch.tensor(0))
            x = out[t:t + 1]
            torch.testing.assert_close(x[0], steps[0, 0, t], atol=1e-4, rtol=1e-4)
            for j in range(1, U):
                pos = torch.tensor([t + j])
                mask = (torch.arange(head.cache_len) <= t + j)[None]             # prefix 0..t, then the chain
                x = head.layer(head.rows(model, x, tokens[0, t + j + 1:t + j + 2]), pos, pos, mask)
                torch.testing.assert_close(x[0], steps[j, 0, t], atol=1e-4, rtol=1e-4)
    # and unrolling leaves step 0 as it was
    args.unroll = 1
    with torch.no_grad():
        torch.testing.assert_close(train.head_trunk(head, model, args, h, tokens, train=False)[0], steps[0, 0])


def test_resume_continues_exactly(tiny, dataset, tmp_path, capsys):
    full, split = tmp_path / "full", tmp_path / "split"
    train.main(train_args(tiny, dataset, full, "eagle", "--steps", "12"))
    train.main(train_args(tiny, dataset, split, "eagle", "--steps", "12", "--stop_after", "5"))
    assert "--resume" in capsys.readouterr().err
    assert torch.load(split / "ckpt.pt", weights_only=True)["step"] == 5
    # a checkpoint from before a switch existed (--context here) resumes as if it were off
    ckpt = torch.load(split / "ckpt.pt", weights_only=True)
    del ckpt["args"]["context"]
    torch.save(ckpt, split / "ckpt.pt")
    record = train.main(train_args(tiny, dataset, split, "eagle", "--steps", "12", "--resume"))
    assert record["steps"] == 12 and len(record["losses"]) == 12
    a = torch.load(full / "ckpt.pt", weights_only=True)["head"]
    b = torch.load(split / "ckpt.pt", weights_only=True)["head"]
    assert all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
    with pytest.raises(SystemExit):
        train.main(train_args(tiny, dataset, split, "eagle", "--steps", "20", "--resume"))
    assert "--steps 12" in capsys.readouterr().err


def test_time_budget_stops_and_saves(tiny, dataset, tmp_path, capsys, monkeypatch):
    """--minutes: the run stops once its time is up, far short of --steps, anneals the lr over the
    time, evaluates and saves the heads."""
    lrs = []
    real_lr_at = train.lr_at
    monkeypatch.setattr(train, "lr_at", lambda *a, **k: lrs.append(real_lr_at(*a, **k)) or lrs[-1])
    record = train.main(train_args(tiny, dataset, tmp_path / "t", "medusa", "--steps", "1000000", "--minutes", "0.03"))
    assert "the time was up" in capsys.readouterr().err
    assert 3 < record["steps"] < 1000000 and (tmp_path / "t" / checkpoint.MEDUSA_FILES[0]).exists()
    assert lrs[-1] < 0.5 * max(lrs)  # the cosine ran down with the time, not with the million steps


@pytest.mark.parametrize("kind,extra", [("medusa", []), ("hydra", ["--shared_lm_head"]), ("eagle", []),
                                        ("eagle", ["--context"])])
def test_draft_vocab(tiny, dataset, tmp_path, kind, extra):
    out = tmp_path / "dv"
    record = train.main(train_args(tiny, dataset, out, kind, "--steps", "20", "--draft_vocab", "64", *extra))
    assert np.mean(record["losses"][-5:]) < np.mean(record["losses"][:5])
    f = {"medusa": checkpoint.MEDUSA_FILES, "hydra": checkpoint.HYDRA_FILES, "eagle": checkpoint.EAGLE_FILES}[kind][0]
    sd = load_file(out / f)
    d2t = sd.pop("d2t") + torch.arange(64)  # EAGLE-3's layout: offsets
    assert d2t.shape == (64,) and torch.equal(d2t, d2t.sort().values)
    if kind == "medusa":
        assert sd["0.1.weight"].shape == (64, 64)  # head 0's lm_head over the draft vocab
    if kind == "hydra":
        assert not any(k.startswith("hydra_lm_head") for k in sd)  # the base's lm_head, shared
    assert json.loads((out / "config.json").read_text())["draft_vocab_size"] == 64
    # the most frequent answer tokens of the training split
    seqs, plens, _, _ = distill.read_data(dataset)
    n_train = len(seqs) - record["heldout_sequences"]
    counts = np.bincount(np.concatenate([s[p:] for s, p in zip(seqs[:n_train], plens[:n_train])]).astype(np.int64),
                         minlength=TINY_VOCAB)
    assert counts[d2t.numpy()].min() >= np.delete(counts, d2t.numpy()).max()

    # loaded back, it drafts only draft-vocab (and context) tokens, and decoding stays exact
    model, _ = load_model(str(tiny))
    head = generate.load_heads(out, model)
    assert torch.equal(head.d2t, d2t)
    prompt = seqs[-1][:plens[-1]].tolist()
    drafted = []
    speculative_equals_autoregressive(model, head, prompt, 40, drafted, tree="tree10")
    if kind == "eagle":
        speculative_equals_autoregressive(model, head, prompt, 40, drafted, dynamic=(3, 3, 8))
    assert len(drafted) > 3
    # drafts come from the draft vocab and, for heads that share the base's lm_head, from the
    # context's tokens: the prompt (but its first) and each step's root (t[0]) as it is accepted
    allowed = set(d2t.tolist()) | (set(prompt[1:]) if kind != "medusa" else set())
    for t in drafted:
        allowed |= {t[0].item()} if kind != "medusa" else set()
        assert set(t[1:].tolist()) <= allowed


def test_context_vocab_is_what_decoding_drafts(tiny, dataset, tmp_path, capsys):
    """--context trains over the tokens outside the draft vocab that Drafter.note_context has added by the
    time the draft from position t runs (the sequence up to t+1, the root); the set is the same, root by
    root, and such targets count as hits when predicted."""
    seqs, plens, _, _ = distill.read_data(dataset)
    V = TINY_VOCAB
    t2d = torch.full((V,), -1)
    d2t = torch.arange(0, V, 3)                         # a third of the vocab: many tokens outside it
    t2d[d2t] = torch.arange(len(d2t))
    tokens = torch.zeros(2, 60, dtype=torch.long)
    for r in range(2):
        s = torch.from_numpy(seqs[r][:60].astype(np.int64))
        tokens[r, :len(s)] = s
    oov, seen = train.context_vocab(tokens, t2d)
    assert seen.shape == (2, 60, len(oov)) and bool((t2d[oov] < 0).all())
    model, _ = load_model(str(tiny))
    head = heads.set_draft_vocab(heads.Eagle(model.args), model, d2t)
    for r in range(2):
        for t in (0, 5, 30, 58):
            head.note_context(model, tokens[r, :t + 2], reset=True)
            assert set(head.ctx_ids[:int(head.ctx_n)].tolist()) == set(oov[seen[r, t]].tolist()), (r, t)
    assert seen[:, 58].any() and not seen[:, 0].all()

    # trained with it, a head hits targets outside its vocab that the vocab alone must miss
    out = tmp_path / "ctx"
    small = ["--draft_vocab", "16", "--holdout", "0.3"]
    plain = train.main(train_args(tiny, dataset, tmp_path / "plain", "hydra", "--steps", "30", "--shared_lm_head", *small))
    ctx = train.main(train_args(tiny, dataset, out, "hydra", "--steps", "30", "--shared_lm_head", "--context", *small))
    assert np.mean(ctx["losses"][-5:]) < np.mean(ctx["losses"][:5])
    assert ctx["heldout"]["positions"] == plain["heldout"]["positions"] and ctx["context"]
    assert ctx["heldout"]["top1"][0] > plain["heldout"]["top1"][0] + 0.1, (ctx["heldout"], plain["heldout"])  # measured 0.86, 0.58
    with pytest.raises(SystemExit):
        train.main(train_args(tiny, dataset, tmp_path / "d", "medusa", "--steps", "1", "--context", *small))
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith("error: --context needs")


def test_features_cache(tiny, dataset, tmp_path):
    """--features: the base's hidden states cached on disk give the training run without it, and the
    cache is remade when the data changes."""
    feats = tmp_path / "h.npy"
    plain = train.main(train_args(tiny, dataset, tmp_path / "a", "hydra", "--steps", "8"))
    cached = train.main(train_args(tiny, dataset, tmp_path / "b", "hydra", "--steps", "8", "--features", str(feats)))
    seqs, _, _, _ = distill.read_data(dataset)
    assert np.load(feats, mmap_mode="r").shape == (sum(map(len, seqs)), 64)
    np.testing.assert_allclose(cached["losses"], plain["losses"], rtol=2e-3)
    assert cached["heldout"]["top1"] == plain["heldout"]["top1"]
    again = train.main(train_args(tiny, dataset, tmp_path / "c", "hydra", "--steps", "8", "--features", str(feats)))
    assert again["losses"] == cached["losses"]  # read back, not recomputed
    np.save(feats, np.zeros((3, 64), np.float16))  # stale: another data file's
    train.main(train_args(tiny, dataset, tmp_path / "d", "hydra", "--steps", "1", "--features", str(feats)))
    assert np.load(feats, mmap_mode="r").shape == (sum(map(len, seqs)), 64)


def test_init_continues_from_saved_heads(tiny, dataset, tmp_path, capsys):
    """--init: a fresh run starts from saved heads (in bf16), so its first losses are those where the
    first run ended, not a random head's; a head of another shape is refused in one line."""
    first = train.main(train_args(tiny, dataset, tmp_path / "a", "eagle", "--steps", "30"))
    scratch = train.main(train_args(tiny, dataset, tmp_path / "b", "eagle", "--steps", "3", "--seed", "1"))
    more = train.main(train_args(tiny, dataset, tmp_path / "c", "eagle", "--steps", "3", "--seed", "1",
                                 "--init", str(tmp_path / "a")))
    assert np.mean(more["losses"]) < 0.9 * np.mean(scratch["losses"]), (more["losses"], scratch["losses"])
    assert more["losses"][0] < 1.2 * np.mean(first["losses"][-5:])
    record = json.loads((tmp_path / "c" / "train_record.json").read_text())
    assert record["init"]["steps"] == 30 and record["args"]["init"] == str(tmp_path / "a")
    with pytest.raises(SystemExit):
        train.main(train_args(tiny, dataset, tmp_path / "d", "medusa", "--steps", "1", "--shared_lm_head",
                              "--init", str(tmp_path / "m")))
    assert "--init" in capsys.readouterr().err
    train.main(train_args(tiny, dataset, tmp_path / "m", "medusa", "--steps", "1", "--num_heads", "2"))
    with pytest.raises(SystemExit):
        train.main(train_args(tiny, dataset, tmp_path / "d", "medusa", "--steps", "1", "--init", str(tmp_path / "m")))
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: --init") and "another shape" in last
    cfg = json.loads((tmp_path / "a" / "config.json").read_text())  # int8 heads (quantize.py): not a start
    (tmp_path / "a" / "config.json").write_text(json.dumps({**cfg, "quantization": {"mode": "int8"}}))
    with pytest.raises(SystemExit):
        train.main(train_args(tiny, dataset, tmp_path / "d", "eagle", "--steps", "1", "--init", str(tmp_path / "a")))
    last = capsys.readouterr().err.strip().splitlines()[-1]
    assert last.startswith("error: --init") and "int8 heads" in last
    with pytest.raises(SystemExit):
        train.main(train_args(tiny, dataset, tmp_path / "d", "medusa", "--steps", "1", "--unroll", "3"))
    assert capsys.readouterr().err.strip().startswith("error: --unroll 3")


def test_hydra_grows_into_hydra_plus_plus(tiny, dataset, tmp_path):
    """--hydra_prefix --init a Hydra head: its weights carry over, and the new prefix layer starts
    as the identity (zero output projections), to be trained from there."""
    train.main(train_args(tiny, dataset, tmp_path / "h", "hydra", "--steps", "5"))
    train.main(train_args(tiny, dataset, tmp_path / "hpp", "hydra", "--hydra_prefix", "--epochs", "0",
                          "--init", str(tmp_path / "h")))
    model, _ = load_model(str(tiny))
    old = generate.load_heads(tmp_path / "h", model).state_dict()
    new = generate.load_heads(tmp_path / "hpp", model).state_dict()
    assert set(new) - set(old) and all(k.startswith("prefix") for k in set(new) - set(old))
    assert all(torch.equal(old[k], new[k]) for k in old)
    assert not new["prefix.block.attention.wo.weight"].any() and not new["prefix.block.feed_forward.w2.weight"].any()
