"""distill.py on a tiny random base model (conftest's `tiny`): batched self-distillation equals
unbatched greedy decoding, the data file appends and resumes, prompts files (but the benchmark) and
--openers give the prompts, files merge, and document-task prompts quote the data's answers or given
documents."""
import json
import shutil

import numpy as np
import pytest
import torch

import distill
from generate import load_model
from conftest import DATA
import speculate


pytestmark = pytest.mark.usefixtures("one_thread")


def greedy(model, prompt, max_new_tokens, eos_id):
    """The engine's own unbatched greedy decoding: speculate.prefill, ar_step, decode."""
    model.setup_caches(1, len(prompt) + max_new_tokens)
    with torch.inference_mode():
        first, h = speculate.prefill(model, torch.tensor(prompt))
        state = (first, torch.tensor(len(prompt)))
        return speculate.decode(lambda t, p: speculate.ar_step(model, t, p), state, int(first), max_new_tokens, eos_id)[0]


def test_batched_generation_equals_unbatched(tiny):
    model, _ = load_model(str(tiny))
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(0, 256, (n,), generator=g).tolist() for n in (3, 17, 9, 30, 1)]
    new = 40
    ref = [greedy(model, p, new, None) for p in prompts]
    # a stop token that row 0 emits in the middle, to see rows stop at their own first stop token
    stop = ref[0][5]
    ref_stop = [greedy(model, p, new, stop) for p in prompts]
    assert len(ref_stop[0]) == ref[0].index(stop) + 1 < new
    for B in (5, 8):  # a full batch, and one filled up with dummy rows
        model.setup_caches(B, 30 + new)
        step = lambda tok, pos, valid, temp: distill.batch_step(model, tok, pos, valid, temp)
        with torch.inference_mode():
            assert distill.generate_batch(model, step, prompts, new, set(), 0.0) == ref
            assert distill.generate_batch(model, step, prompts, new, {stop}, 0.0) == ref_stop


def test_data_file(tiny, dataset, tmp_path, capsys):
    model, tok = load_model(str(tiny))
    seqs, plens, sources, meta = distill.read_data(dataset)
    with np.load(dataset) as z:
        assert z["tokens"].dtype == np.uint16
    answers = [len(s) - p for s, p in zip(seqs, plens)]
    assert sum(answers) >= 1500 and meta["prompts"] == "invented" and (sources == -1).all()
    user = tok.encode("<|im_start|>user\n", bos=False)
    prompts = [s[:p].tolist() for s, p in zip(seqs, plens)]
    assert len(set(map(tuple, prompts))) == len(prompts), "invented prompts repeat"
    for s, p in zip(seqs, prompts):
        assert p[:len(user)] == user and tok.decode(p).endswith("<|im_start|>assistant\n")
        # the batched, left-padded answer is what the engine's unbatched greedy decoding says
        assert s[len(p):].tolist() == greedy(model, p, 48, tok.eos_id)

    # rerunning with a higher target appends; with a reached target changes nothing
    copy = tmp_path / "copy.npz"
    shutil.copy(dataset, copy)
    distill.main(["generate", "--checkpoint", str(tiny), "--out", str(copy), "--tokens", "2000", *DATA])
    more, more_plens, _, _ = distill.read_data(copy)
    assert len(more) > len(seqs) and sum(len(s) - p for s, p in zip(more, more_plens)) >= 2000
    assert all(np.array_equal(a, b) for a, b in zip(seqs, more))
    assert len({tuple(s[:p].tolist()) for s, p in zip(more, more_plens)}) == len(more)
    before = copy.read_bytes()
    distill.main(["generate", "--checkpoint", str(tiny), "--out", str(copy), "--tokens", "2000", *DATA])
    assert copy.read_bytes() == before
    assert "already holds" in capsys.readouterr().err


def test_data_from_prompts_file(tiny, tmp_path, capsys):
    _, tok = load_model(str(tiny))
    texts = ["Name a river.", "What is two plus two?", "Write a haiku about rain.", "Spell cat."]
    sharegpt = {"id": "a1", "conversations": [{"from": "gpt", "value": "Hi!"}, {"from": "human", "value": texts[3]},
                                              {"from": "gpt", "value": "C-A-T."}, {"from": "human", "value": "no"}]}
    path = tmp_path / "prompts.jsonl"
    path.write_text(json.dumps({"question_id": 1, "turns": [texts[0], "and another?"]}) + "\n"
                    + json.dumps({"prompt": texts[1]}) + "\n\n" + json.dumps(texts[2]) + "\n"
                    + json.dumps(sharegpt) + "\n")
    out = tmp_path / "mine.npz"
    distill.main(["generate", "--checkpoint", str(tiny), "--prompts", str(path), "--out", str(out), *DATA])
    assert "ran out of prompts" in capsys.readouterr().err
    seqs, plens, sources, meta = distill.read_data(out)
    assert sources.tolist() == [0, 1, 2, 3] and meta["prompts"] == str(path)
    for s, p, text in zip(seqs, plens, texts):
        assert s[:p].tolist() == tok.encode(tok.chat([{"role": "user", "content": text}]), bos=False)

    # the evaluation set is refused, under its own path or a copy
    copy = tmp_path / "spec_bench.jsonl"
    shutil.copy(path, copy)
    for bad in [copy] + ([distill.BENCHMARK] if distill.BENCHMARK.exists() else []):
        with pytest.raises(SystemExit):
            distill.main(["generate", "--checkpoint", str(tiny), "--prompts", str(bad), "--out", str(tmp_path / "x.npz")])
        assert "Spec-Bench evaluation set" in capsys.readouterr().err
        assert not (tmp_path / "x.npz").exists()


def test_data_with_openers(tiny, tmp_path, capsys):
    """--openers: every invented user turn starts with one of the file's lines; the answers are greedy."""
    model, tok = load_model(str(tiny))
    openers = ["Name a", "Write a poem about"]
    path = tmp_path / "openers.txt"
    path.write_text("# a comment\n" + "\n\n".join(openers) + "\n")
    out = tmp_path / "open.npz"
    distill.main(["generate", "--checkpoint", str(tiny), "--openers", str(path), "--out", str(out), "--tokens", "300", *DATA])
    seqs, plens, sources, meta = distill.read_data(out)
    assert meta["prompts"] == f"invented, openers {path}" and (sources == -1).all()
    starts = set()
    for s, p in zip(seqs, plens):
        text = tok.decode(s[:p].tolist())
        user = text.split("<|im_start|>user\n", 1)[1]
        starts |= {o for o in openers if user.startswith(o)}
        assert any(user.startswith(o) for o in openers), text
        assert s[p:].tolist() == greedy(model, s[:p].tolist(), 48, tok.eos_id)
    assert starts == set(openers)

    (tmp_path / "empty.txt").write_text("# nothing\n\n")
    for argv, msg in [(["--openers", str(tmp_path / "empty.txt")], "holds no line"),
                      (["--openers", str(tmp_path / "none.txt")], "cannot read --openers"),
                      (["--openers", str(path), "--prompts", str(path)], "leave out --prompts")]:
        with pytest.raises(SystemExit):
            distill.main(["generate", "--checkpoint", str(tiny), "--out", str(tmp_path / "x.npz"), *argv])
        assert msg in capsys.readouterr().err


def test_merge(tiny, dataset, tmp_path):
    out = tmp_path / "merged.npz"
    distill.main(["merge", str(out), str(dataset), str(dataset)])
    seqs, plens, sources, meta = distill.read_data(dataset)
    both, both_plens, both_sources, both_meta = distill.read_data(out)
    assert len(both) == 2 * len(seqs) and all(np.array_equal(a, b) for a, b in zip(seqs + seqs, both))
    assert both_plens.tolist() == 2 * plens.tolist() and both_meta["base_model"] == meta["base_model"]


def test_document_tasks(tiny, dataset, tmp_path):
    """`distill.py tasks`: prompts that quote the data's answers, never those of its last sequences
    (the held-out ones once merged behind), and that `distill.py generate` answers."""
    out = tmp_path / "tasks.jsonl"
    distill.main(["tasks", "--data", str(dataset), "--checkpoint", str(tiny), "--out", str(out), "--n", "40",
                "--min_doc", "8", "--max_doc", "30", "--skip_last", "0.3"])
    prompts = [json.loads(line)["prompt"] for line in out.read_text().splitlines()]
    assert len(prompts) == 40 and prompts == sorted(prompts, key=len)
    _, tok = load_model(str(tiny))
    seqs, plens, _, _ = distill.read_data(dataset)
    answers = [tok.decode([int(t) for t in s[p:] if t != tok.eos_id]) for s, p in zip(seqs, plens)]
    use = len(seqs) - int(np.ceil(0.3 * len(seqs)))
    norm = lambda t: " ".join(t.split())
    kinds = set()
    for text in prompts:
        # its template: the one whose fixed text around the first field fits best
        fits = [t for _, t in distill.TASKS if text.startswith(t.split("{")[0]) and text.endswith(t.split("}")[-1])]
        template = max(fits, key=lambda t: len(t.split("{")[0]) + len(t.split("}")[-1]))
        kinds.add(template)
        quoted = norm(text[len(template.split("{")[0]):])[:8]
        # the document starts like an answer before the skipped tail
        assert any(norm(a).startswith(quoted) for a in answers[:use]), text
    assert len(kinds) >= 5
    data = tmp_path / "tasks.npz"
    distill.main(["generate", "--checkpoint", str(tiny), "--prompts", str(out), "--out", str(data), *DATA[:4],
                "--max_prompt_tokens", "200"])
    got, got_plens, sources, _ = distill.read_data(data)
    assert len(got) >= 30 and all(p < len(s) for s, p in zip(got, got_plens))


def test_document_tasks_from_docs(tiny, tmp_path, capsys):
    """`distill.py tasks --docs`: text in another language becomes translate-to-English prompts of
    sentences from it; English text gets the document tasks that need no question; no prompt twice."""
    de = ("Der Befehl zeigt alle Pakete an, die installiert sind. Er liest dazu die Datenbank.\n\n"
          "Wenn die Variable gesetzt ist, wird sie benutzt. Sonst gilt der Standardwert des Systems.")
    en = ("The command lists every package that is installed. It reads the database to do so.\n\n"
          "When the variable is set, it is used instead. Otherwise the system default applies.")
    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"text": de, "language": "German"}) + "\n" + json.dumps({"text": en}) + "\n")
    out = tmp_path / "tasks.jsonl"
    distill.main(["tasks", "--docs", str(docs), "--checkpoint", str(tiny), "--out", str(out), "--n", "30",
                "--min_doc", "8", "--max_doc", "40"])
    prompts = [json.loads(line)["prompt"] for line in out.read_text().splitlines()]
    assert len(prompts) == len(set(prompts)) == 30
    norm = lambda t: " ".join(t.split())
    german = [p for p in prompts if p.startswith(("Translate German to English: ", "Translate to English: "))]
    assert all(norm(p.split(": ", 1)[1]) in norm(de) for p in german)
    english = [p for p in prompts if p not in german]
    assert german and english
    for text in english:  # a template that needs no question, quoting a stretch of the English text
        template = max((t for _, t in distill.TASKS if text.startswith(t.split("{")[0])), key=lambda t: len(t.split("{")[0]))
        assert "{question}" not in template and template.endswith(("{doc}", "{sentences}"))
        assert norm(text[len(template.split("{")[0]):]) in norm(en), text
    docs.write_text('{"text": "fine"}\n["not a document"]\n')
    with pytest.raises(SystemExit):
        distill.main(["tasks", "--docs", str(docs), "--checkpoint", str(tiny), "--out", str(out), "--n", "3"])
    assert capsys.readouterr().err.strip().splitlines()[-1].endswith(':2: want {"text": "...", "language": "..."} a line')
