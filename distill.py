"""Self-distilled training data for the draft heads: the base model answers prompts, or invents them.

    python distill.py generate --out data/selfdistill.npz --tokens 1000000   # the model invents its prompts
    python distill.py generate --prompts prompts.jsonl --out data/mine.npz   # or answers yours (turns[0] / prompt)
    python distill.py tasks --data data/invented.npz --out tasks.jsonl       # prompts quoting its answers: summarize...
    python distill.py merge data/all.npz A.npz B.npz                         # one file from parallel runs

Self-distillation: a head is right when it guesses what the base model will say, so it learns from the
base model's own greedy answers (what greedy speculative decoding must reproduce), not from human text.
The data file keeps only token ids (a few MB, kept in the repo; data/README.md has the format); train.py
reads it with read_data and recomputes the base model's hidden states from it.
"""
import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from checkpoint import DEFAULT_NAME
from generate import check_device, load_model
from speculate import compile_step
from trees import logits_to_probs, sample

ROOT = Path(__file__).resolve().parent
BENCHMARK = ROOT.parent / "shared" / "data" / "spec_bench.jsonl"


# ---------------------------------------------------------------- the data file

def read_data(path):
    """-> (sequences: list of int arrays, prompt_lens [N], sources [N], meta dict).
    Sequence i is prompt + answer; its first prompt_lens[i] tokens are the prompt (no loss there);
    sources[i] is the line of the prompts file it answers (-1: a prompt the model invented)."""
    try:
        with np.load(path) as z:
            tokens, offsets = z["tokens"], z["offsets"]
            seqs = [tokens[offsets[i]:offsets[i + 1]] for i in range(len(offsets) - 1)]
            return seqs, z["prompt_lens"].astype(np.int64), z["sources"].astype(np.int64), json.loads(str(z["meta"]))
    except (OSError, KeyError, ValueError) as e:
        raise ValueError(f"cannot read the data file {path} ({type(e).__name__}: {e}): make it with `distill.py generate`") from None


def write_data(path, seqs, prompt_lens, sources, meta):
    """One .npz: the concatenated ids (uint16 when the vocab fits), offsets [N+1], prompt_lens, sources, meta."""
    dtype = np.uint16 if meta["vocab_size"] <= 1 << 16 else np.uint32
    tokens = np.concatenate(seqs).astype(dtype) if seqs else np.zeros(0, dtype)
    offsets = np.concatenate([[0], np.cumsum([len(s) for s in seqs])]).astype(np.int64)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with open(tmp, "wb") as f:  # a file object: np.savez would append .npz to a name
        np.savez_compressed(f, tokens=tokens, offsets=offsets, prompt_lens=np.asarray(prompt_lens, np.int32),
                            sources=np.asarray(sources, np.int32), meta=np.array(json.dumps(meta)))
    os.replace(tmp, path)  # a kill mid-write leaves the previous file whole


def merge_data(args):
    """One file from several (say, two `generate` runs on two cores with --seed 0 and --seed 7777, whose
    invented prompts then differ): sequences in the order of the inputs, so the last file holds the held-out ones."""
    seqs, plens, sources, meta = [], [], [], None
    for f in args.inputs:
        s, p, src, m = read_data(f)
        if meta and (m.get("base_model"), m.get("vocab_size")) != (meta.get("base_model"), meta.get("vocab_size")):
            raise ValueError(f"{f} was made by {m.get('base_model')}, {args.inputs[0]} by {meta.get('base_model')}: "
                             "merge data of one base model only")
        meta = meta or m
        seqs, plens, sources = seqs + s, plens + list(p), sources + list(src)
    write_data(args.out, seqs, plens, sources, {**meta, "merged_from": [str(f) for f in args.inputs]})
    n = sum(len(s) - p for s, p in zip(seqs, plens))
    print(f"{args.out}: {len(seqs)} sequences, {n} answer tokens", file=sys.stderr)


# ---------------------------------------------------------------- prompts

def check_not_benchmark(path):
    p = Path(path)
    same = BENCHMARK.exists() and p.exists() and os.path.samefile(p, BENCHMARK)
    if same or "spec_bench" in p.name.lower():
        raise ValueError(f"{path} is the Spec-Bench evaluation set: heads trained on its prompts would be measured "
                         "on their own training data. Give other prompts, or none to let the model invent them")


def read_jsonl(path, what: str):
    """(line number, object) for each non-blank line of a JSONL file that is not the benchmark."""
    check_not_benchmark(path)
    try:
        lines = Path(path).read_text(encoding="utf-8").splitlines()
    except OSError as e:
        raise ValueError(f"cannot read the {what} file {path}: {e.strerror}") from None
    for i, line in enumerate(lines, 1):
        if line.strip():
            try:
                yield i, json.loads(line)
            except ValueError:
                raise ValueError(f"{path}:{i}: not a line of JSON") from None


def read_prompts(path) -> list:
    """A JSONL file: {"turns": [first user turn, ...]} (Spec-Bench / MT-bench; turns[0] is used),
    {"conversations": [{"from": "human", "value": ...}, ...]} (ShareGPT; its first human turn),
    {"prompt": "..."} or a bare JSON string a line."""
    prompts = []
    for i, obj in read_jsonl(path, "prompts"):
        if isinstance(obj, str):
            prompts.append(obj)
        elif isinstance(obj, dict) and isinstance(obj.get("turns"), list) and obj["turns"]:
            prompts.append(str(obj["turns"][0]))
        elif isinstance(obj, dict) and isinstance(obj.get("prompt"), str):
            prompts.append(obj["prompt"])
        elif isinstance(obj, dict) and (human := [t.get("value") for t in obj.get("conversations") or []
                                                  if isinstance(t, dict) and t.get("from") == "human"]):
            prompts.append(str(human[0]))
        else:
            raise ValueError(f'{path}:{i}: want {{"turns": ["..."]}}, {{"prompt": "..."}} or a ShareGPT record '
                             '({"conversations": [{"from": "human", "value": "..."}]}) a line')
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


def user_turn(tokenizer):
    """(prefix ids, stop ids) for the model to write a user message itself: the chat template rendered
    up to where the user's text goes ('...<|im_start|>user\\n'), and the tokens that end a turn."""
    mark = "\x00MESSAGE\x00"
    text = tokenizer.chat([{"role": "user", "content": mark}])
    head, tail = text.split(mark, 1)
    prefix = tokenizer.encode(head, bos=False) if head else []
    stop = {tokenizer.eos_id} - {None}
    end = tokenizer.encode(tail, bos=False) if tail else []
    # the template's end-of-turn marker, when it is one special token (<|im_end|>, <|eot_id|>)
    if end and (t := tokenizer.decode(end[:1])).startswith("<") and t.endswith(">") and len(t) > 2:
        stop.add(end[0])
    if not prefix:  # no template: write a document from its start
        prefix = [tokenizer.bos_id if tokenizer.bos_id is not None else tokenizer.eos_id]
    return prefix, stop


def encode_prompt(tokenizer, text: str) -> list:
    # as generate.py feeds a prompt: the chat template, no extra bos
    return tokenizer.encode(tokenizer.chat([{"role": "user", "content": text}]), bos=False)


# Prompts that quote a document, so that the heads also learn to copy from a long context (summaries,
# extraction, questions on a passage, translation), which invented chat turns never do. {doc}: a
# stretch of an answer the model wrote; {question}: the user turn that answer replied to.
TASKS = [
    (3, "Summarize: {doc}"),
    (3, "Summarize the following text in a few sentences.\n\n{doc}"),
    (2, "Write a short summary of this article:\n\n{doc}"),
    (3, "{doc}\n\nUsing the passage above, answer the question: {question}"),
    (2, "Read the text and answer the question.\n\nText: {doc}\n\nQuestion: {question}"),
    (2, "Extract the key points of the following text as a bulleted list.\n\n{doc}"),
    (1, "List every name, number and date that the following text mentions.\n\n{doc}"),
    (1, "Give the following text a title, then list its three main ideas.\n\n{doc}"),
    (1, "Rewrite the following text in simpler words.\n\n{doc}"),
    (1, "Fix any mistakes in the following text and return the corrected text.\n\n{doc}"),
    (1, "Translate English to French: {sentences}"),
    (1, "Translate English to German: {sentences}"),
    (1, "Translate to Spanish: {sentences}"),
]


# Text in another language, from --docs: translate it to English, as Spec-Bench's WMT task does.
TRANSLATE = [
    (3, "Translate {language} to English: {sentences}"),
    (1, "Translate to English: {sentences}"),
]


def cut_at_sentence(text: str) -> str:
    cut = max(text.rfind(". "), text.rfind(".\n"), text.rfind("\n"))
    return text[:cut + 1].strip() if cut > len(text) // 2 else text


def read_docs(path) -> list:
    """A JSONL file of documents: {"text": "...", "language": "German"} a line (language: English if absent)."""
    docs = []
    for i, obj in read_jsonl(path, "documents"):
        if not isinstance(obj, dict) or not isinstance(obj.get("text"), str):
            raise ValueError(f'{path}:{i}: want {{"text": "...", "language": "..."}} a line')
        docs.append((obj["text"], str(obj.get("language") or "English")))
    if not docs:
        raise ValueError(f"{path} holds no documents")
    return docs


def make_tasks(args):
    """A prompts JSONL (for `distill.py generate --prompts`) of document tasks. The documents are the answers
    in a data file, from all but its last --skip_last sequences, so that when the answers to these prompts
    are merged in front of that file, the held-out sequences (the last ones) stay unseen as documents too;
    or, with --docs, text that the model did not write (English: the TASKS that need no question;
    another language: translate it to English)."""
    _, tokenizer = load_model(args.checkpoint, "cpu")
    g = np.random.default_rng(args.seed)
    if args.docs:
        docs = read_docs(args.docs)
        source = f"the {len(docs)} documents of {args.docs}"
    else:
        seqs, plens, _, meta = read_data(args.data)
        head, tail = tokenizer.chat([{"role": "user", "content": "\x00"}]).split("\x00", 1)
        use = len(seqs) - math.ceil(len(seqs) * args.skip_last)
        if use <= 0:
            raise ValueError(f"{args.data} holds no sequences to take documents from")
        source = f"the first {use} sequences of {args.data}"

    def document():
        """-> (doc: min_doc..max_doc tokens cut at a sentence end, a run of 1-3 sentences, question, language)"""
        n = int(g.integers(args.min_doc, args.max_doc + 1))
        if args.docs:
            text, language = docs[int(g.integers(len(docs)))]
            paras = text.split("\n\n")
            start = int(g.integers(len(paras)))
            ids = tokenizer.encode("\n\n".join(paras[start:]), bos=False)
            doc = tokenizer.decode(ids[:n]).strip()
            doc = cut_at_sentence(doc) if n < len(ids) else doc
            # translation: sentences from within one paragraph, as a WMT line is one sentence or two
            sentences = paras[start].split(". ")
            k = int(g.integers(len(sentences)))
            sentences = ". ".join(sentences[k:k + int(g.integers(1, 3))]).strip()
            return doc, sentences, "", language
        i = int(g.integers(use))
        answer = [int(t) for t in seqs[i][plens[i]:] if int(t) != meta.get("eos_id")]
        if len(answer) < args.min_doc:
            return "", "", "", "English"
        doc = tokenizer.decode(answer[:n]).strip()
        doc = cut_at_sentence(doc) if n < len(answer) else doc
        question = tokenizer.decode([int(t) for t in seqs[i][:plens[i]]])
        question = question[len(head):len(question) - len(tail)] if question.startswith(head) and question.endswith(tail) else ""
        sentences = " ".join(doc.replace("\n", " ").split(". ")[:int(g.integers(1, 4))]).strip()
        return doc, sentences, question.strip(), "English"

    rows, seen, tries = [], set(), 0
    while len(rows) < args.n:
        tries += 1
        if tries > 100 * args.n:
            raise ValueError(f"{source} give fewer than --n {args.n} distinct prompts with documents of at "
                             f"least --min_doc {args.min_doc} tokens: ask for fewer, or give more text")
        doc, sentences, question, language = document()
        if not doc:
            continue
        tasks = TRANSLATE if language != "English" else TASKS
        weights = np.array([w for w, _ in tasks], float)
        template = tasks[g.choice(len(tasks), p=weights / weights.sum())][1]
        if ("{question}" in template and not question) or ("{sentences}" in template and len(sentences) < 40):
            continue
        row = template.format(doc=doc, question=question, sentences=sentences, language=language)
        if row not in seen:  # man pages share boilerplate paragraphs
            seen.add(row)
            rows.append(row)
    rows.sort(key=len)  # batches of like lengths: little left padding in `generate`
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text("".join(json.dumps({"prompt": r}) + "\n" for r in rows), encoding="utf-8")
    print(f"{args.out}: {len(rows)} document-task prompts from {source}", file=sys.stderr)


# ---------------------------------------------------------------- batched generation

def pick(logits, temperature, top_k: int = 0, top_p: float = 1.0):
    """logits: [B, V] -> tokens [B]. temperature (0: greedy): a float, or under compile a float tensor []
    so that sampled user turns and greedy answers share one graph (eager, sampling costs many times what
    greedy does: only the float skips it)."""
    if not isinstance(temperature, torch.Tensor):
        return logits.argmax(-1) if temperature == 0 else sample(logits_to_probs(logits, temperature, top_k, top_p))
    probs = logits_to_probs(logits / temperature.clamp(min=1e-4), 1.0, top_k, top_p)
    return torch.where(temperature > 0, sample(probs), logits.argmax(-1))


def batch_step(model, tokens, pos, valid, temperature, top_k: int = 0, top_p: float = 1.0):
    """One decode step for a batch. tokens: [B] each row's last token, not yet in the cache; pos: [1]
    its slot, the same for every row; valid: bool [B, S] the slots that are not left padding.
    Returns the next tokens [B]. Static shapes: it compiles once."""
    S = valid.shape[1]
    mask = valid & (torch.arange(S, device=valid.device) <= pos)                    # [B, S]
    logits = model(tokens[:, None], pos, mask[:, None, None, :])[:, -1].float()      # [B, V]
    return pick(logits, temperature, top_k, top_p)


def generate_batch(model, step, prompts, max_new_tokens: int, stop_ids, temperature: float,
                   top_k: int = 0, top_p: float = 1.0):
    """Left-padded batched generation over the model's cache of [B, S] (model.setup_caches(B, S)).
    prompts: up to B lists of ids; step(tokens, pos, valid, temperature: float): batch_step bound to
    the model (maybe compiled). Returns each row's new tokens, cut after its first stop token.
    All rows share positions: a row padded by p sits p positions later than it would alone, which RoPE
    does not see (attention scores depend on relative positions only) as long as padding is masked."""
    B, S = model.max_batch, model.max_seq_len
    dev = model.output.weight.device
    n = len(prompts)
    rows = list(prompts) + [prompts[0]] * (B - n)  # a full batch: the compiled step has one static shape
    L = max(len(r) for r in rows)
    if L + max_new_tokens > S:
        raise ValueError(f"a prompt of {L} tokens plus {max_new_tokens} new ones does not fit the cache of {S}")
    idx = torch.tensor([[0] * (L - len(r)) + list(r) for r in rows], device=dev)    # [B, L]
    first = torch.tensor([L - len(r) for r in rows], device=dev)                     # [B] first real slot
    slot = torch.arange(S, device=dev)
    valid = slot[None, :] >= first[:, None]                                          # [B, S]
    t = torch.arange(L, device=dev)
    # Prefill: query t sees the row's real slots <= t. A padding query sees only itself, so that no
    # softmax row is empty: some attention kernels give NaN there, and NaN values cached at padding
    # slots would leak into real rows through 0 * NaN even where they are masked.
    causal = slot[None, None, :] <= t[None, :, None]                                # [1, L, S]
    mask = causal & (valid[:, None, :] | (slot[None, None, :] == t[None, :, None]))  # [B, L, S]
    temp = float(temperature)
    tok = pick(model(idx, t, mask[:, None])[:, -1].float(), temp, top_k, top_p)      # [B]
    stop = torch.tensor(sorted(stop_ids), dtype=torch.long, device=dev)
    out, done = [tok], torch.isin(tok, stop)
    for i in range(1, max_new_tokens):
        if bool(done[:n].all()):  # one host sync a step, small beside the step itself
            break
        tok = step(tok, torch.tensor([L + i - 1], device=dev), valid, temp)
        out.append(tok)
        done |= torch.isin(tok, stop)
    new = torch.stack(out, 1)[:n].tolist()                                           # [n, new]
    return [r[: next((j + 1 for j, x in enumerate(r) if x in stop_ids), len(r))] for r in new]


def read_openers(path) -> list:
    """--openers: one beginning of a user turn a line (blank lines and '#' comments skipped)."""
    check_not_benchmark(path)
    try:
        lines = Path(path).read_text().splitlines()
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read --openers {path}: {e}") from None
    openers = [l.strip() for l in lines if l.strip() and not l.lstrip().startswith("#")]
    if not openers:
        raise ValueError(f"--openers {path} holds no line: give one beginning of a user turn a line")
    return openers


def resume_data(out: Path, meta: dict) -> tuple:
    """(sequences, prompt lengths, sources) already in out, which must have been made alike; empty lists
    where there is no such file."""
    if not out.exists():
        return [], [], []
    seqs, plens, sources, old = read_data(out)
    for key in ("base_model", "vocab_size", "prompts", "temperature"):
        if old.get(key) != meta[key]:
            raise ValueError(f"{out} was made with {key} {old.get(key)!r}, not {meta[key]!r}: "
                             "give another --out to start a new file")
    return list(seqs), list(plens), list(sources)


def given_prompts(texts: list, sources: list, tokenizer, max_prompt_tokens: int) -> tuple:
    """([(source index, prompt ids)] of the texts not answered yet, how many were too long)."""
    todo, skipped, used = [], 0, set(sources)
    for i, text in enumerate(texts):
        if i in used:
            continue
        ids = encode_prompt(tokenizer, text)
        if len(ids) > max_prompt_tokens:
            skipped += 1
            continue
        todo.append((i, ids))
    return todo, skipped


def invent_prompts(model, step, tokenizer, args, openers, seen: set) -> tuple:
    """The model writes a batch of user turns at --prompt_temperature (each from a random opener, with
    --openers); each new one becomes a chat prompt. Returns ([(-1, prompt ids)], tokens written)."""
    B = args.batch_size
    prefix, user_stop = user_turn(tokenizer)
    starts = [[]] * B
    if openers:
        starts = [tokenizer.encode(openers[i], bos=False) for i in torch.randint(len(openers), (B,)).tolist()]
    rows = generate_batch(model, step, [prefix + s for s in starts], args.max_user_tokens, user_stop,
                          args.prompt_temperature, 0, args.top_p)
    fresh = []
    for s, r in zip(starts, rows):
        text = tokenizer.decode(s + [t for t in r if t not in user_stop]).strip()
        ids = encode_prompt(tokenizer, text) if text else None
        if ids and len(ids) <= args.max_prompt_tokens and tuple(ids) not in seen:
            seen.add(tuple(ids))
            fresh.append((-1, ids))
    return fresh, sum(map(len, rows))


def make_data(args):
    device = check_device(args.device)
    if args.openers and args.prompts:
        raise ValueError("--openers starts the user turns the model invents: leave out --prompts")
    prompt_texts = read_prompts(args.prompts) if args.prompts else None  # refuse bad files before loading
    openers = read_openers(args.openers) if args.openers else None
    model, tokenizer = load_model(args.checkpoint, device, getattr(torch, args.dtype))
    meta = {"format": 1, "base_model": args.checkpoint or DEFAULT_NAME, "vocab_size": model.args.vocab_size,
            "eos_id": tokenizer.eos_id,
            "prompts": str(args.prompts) if args.prompts else f"invented, openers {args.openers}" if openers else "invented",
            "temperature": args.temperature, "prompt_temperature": args.prompt_temperature, "top_p": args.top_p,
            "max_new_tokens": args.max_new_tokens, "dtype": args.dtype}
    out = Path(args.out)
    seqs, plens, sources = resume_data(out, meta)  # resume: append to what is there
    have = sum(len(s) - p for s, p in zip(seqs, plens))  # answer tokens: what the heads learn to predict
    if have >= args.tokens:
        print(f"{out} already holds {have} answer tokens (>= --tokens {args.tokens})", file=sys.stderr)
        return

    B = args.batch_size
    model.setup_caches(B, args.max_prompt_tokens + args.max_new_tokens)
    step = lambda tokens, pos, valid, temp: batch_step(model, tokens, pos, valid, temp, 0, args.top_p)
    if args.compile:
        compiled = compile_step(step, device)
        # the temperature as a tensor: one graph for sampled user turns and greedy answers
        step = lambda tokens, pos, valid, temp: compiled(tokens, pos, valid, torch.tensor(temp, device=device))
    stop = {tokenizer.eos_id} - {None}
    torch.manual_seed(args.seed + len(seqs))  # a resumed run draws new prompts
    seen = {tuple(np.asarray(s[:p]).tolist()) for s, p in zip(seqs, plens)}  # no prompt twice
    todo, skipped = [], 0
    if prompt_texts is not None:
        todo, skipped = given_prompts(prompt_texts, sources, tokenizer, args.max_prompt_tokens)
    elif len(user_turn(tokenizer)[0]) + args.max_user_tokens > model.max_seq_len:
        raise ValueError("--max_user_tokens does not fit: raise --max_prompt_tokens")

    bar = tqdm(total=args.tokens, initial=have, unit="tok", desc=f"data -> {out}", dynamic_ncols=True)
    t0, made, user_tokens, stale = time.perf_counter(), 0, 0, 0
    try:
        with torch.inference_mode():
            while have < args.tokens:
                if prompt_texts is not None:
                    if not todo:
                        print(f"\nran out of prompts in {args.prompts} at {have} answer tokens", file=sys.stderr)
                        break
                    batch, todo = todo[:B], todo[B:]
                else:
                    while len(todo) < B:
                        fresh, n = invent_prompts(model, step, tokenizer, args, openers, seen)
                        user_tokens += n
                        stale = 0 if fresh else stale + 1
                        if stale >= 20:
                            raise ValueError("the model wrote no new usable user turn in 20 batches: "
                                             "raise --prompt_temperature or --max_prompt_tokens")
                        todo += fresh
                    batch, todo = todo[:B], todo[B:]
                answers = generate_batch(model, step, [p for _, p in batch], args.max_new_tokens, stop,
                                         args.temperature, 0, args.top_p)
                for (src, p), a in zip(batch, answers):
                    seqs.append(np.asarray(p + a))
                    plens.append(len(p))
                    sources.append(src)
                    have += len(a)
                    made += len(a)
                write_data(out, seqs, plens, sources, meta)  # after every batch: a kill loses one batch
                rate = made / (time.perf_counter() - t0)
                bar.update(sum(map(len, answers)))
                bar.set_postfix(seqs=len(seqs), tok_s=f"{rate:.1f}")
    except KeyboardInterrupt:
        print(f"\nstopped; {out} keeps what was made: rerun the same command to continue", file=sys.stderr)
    bar.close()
    dt = time.perf_counter() - t0
    print(f"{made} answer tokens in {dt:.1f} s: {made / max(dt, 1e-9):.1f} tok/s "
          f"({(made + user_tokens) / max(dt, 1e-9):.1f} tok/s counting the {user_tokens} tokens of invented user "
          f"turns); {out}: {len(seqs)} sequences, {have} answer tokens"
          + (f"; skipped {skipped} prompts over --max_prompt_tokens" if skipped else ""), file=sys.stderr)


# ---------------------------------------------------------------- CLI

def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("generate", help="self-distilled training text: the base model answers prompts (or invents them)")
    d.add_argument("--out", default="data/selfdistill.npz", help="the .npz to write; an existing one is appended to")
    d.add_argument("--prompts", default=None, help="JSONL of prompts ({'turns': [...]} uses turns[0], or "
                                                   "{'prompt': ...}); default: the model invents them")
    d.add_argument("--tokens", type=int, default=1_000_000, help="stop once the file holds this many answer tokens")
    d.add_argument("--checkpoint", default=None, help="base model (default: the embedded SmolLM2-135M-Instruct)")
    d.add_argument("--batch_size", type=int, default=16)
    d.add_argument("--max_new_tokens", type=int, default=512, help="answer length cap")
    d.add_argument("--max_prompt_tokens", type=int, default=256, help="longer prompts are skipped")
    d.add_argument("--max_user_tokens", type=int, default=128, help="length cap of an invented user turn")
    d.add_argument("--temperature", type=float, default=0.0, help="answers: 0 = greedy, what greedy decoding says")
    d.add_argument("--prompt_temperature", type=float, default=1.0, help="invented user turns")
    d.add_argument("--openers", default=None, help="a text file, one beginning of a user turn a line: each "
                   "invented turn starts with a random one (steers the prompts toward kinds of task)")
    d.add_argument("--top_p", type=float, default=1.0, help="nucleus sampling where sampling")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--device", default="cpu")
    d.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    d.add_argument("--compile", action="store_true", help="compile the batched decode step (static shapes)")

    k = sub.add_parser("tasks", help="document-task prompts (summarize, answer from a passage, extract, "
                                     "translate) over the answers of a data file, for `generate --prompts`")
    k.add_argument("--data", default="data/selfdistill.npz", help="data file whose answers are the documents")
    k.add_argument("--docs", default=None, help='instead: a JSONL of documents, {"text": ..., "language": ...} a line '
                                               "(English: summarize, extract...; another language: translate it)")
    k.add_argument("--out", required=True, help="the prompts JSONL to write")
    k.add_argument("--n", type=int, default=1000, help="how many prompts")
    k.add_argument("--min_doc", type=int, default=64, help="shortest document, tokens")
    k.add_argument("--max_doc", type=int, default=448, help="longest document, tokens")
    k.add_argument("--skip_last", type=float, default=0.1, help="fraction of the last sequences not used")
    k.add_argument("--checkpoint", default=None, help="base model, for its tokenizer and chat template")
    k.add_argument("--seed", type=int, default=0)

    m = sub.add_parser("merge", help="join data files of parallel `generate` runs (each with its own --seed) into one")
    m.add_argument("out")
    m.add_argument("inputs", nargs="+")

    args = p.parse_args(argv)
    try:
        return {"generate": make_data, "tasks": make_tasks, "merge": merge_data}[args.command](args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


if __name__ == "__main__":
    main()
