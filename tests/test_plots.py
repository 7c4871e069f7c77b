"""bench.py --json records and plots.py's PNGs from them (the README's figures are made this way)."""
import argparse
import json
import subprocess
import sys


import bench
import plots
from conftest import ROOT


def bench_args(**kw):
    a = dict(device="cpu", dtype="bfloat16", max_new_tokens=64, heads="heads/eagle-smollm2", lookup=3)
    return argparse.Namespace(**{**a, **kw})


def test_json_to_png(tmp_path):
    cats = {c: dict(q=1, tokens=60 + i, steps=30, tau=(60 + i) / 30) for i, c in enumerate(["writing", "coding", "all"])}
    bench.write_json(tmp_path / "tau.json", "spec_bench", bench_args(), tree="tree16", nodes=20,
                     questions_per_category=1, speed=False, categories=cats)
    bench.write_json(tmp_path / "tau2.json", "spec_bench", bench_args(heads="ngram", lookup=0), tree="chain4",
                     nodes=5, questions_per_category=1, speed=False, categories=cats)
    engines = [dict(name="ours, compiled", tree=None, nodes=1, tok_s=80.0, tau=1.0, vs_first=1.0, vs_compiled_ar=1.0)]
    engines += [dict(name=f"spec {t}", tree=t, nodes=n, tok_s=r * 80, tau=2.0, vs_first=r, vs_compiled_ar=r)
                for t, n, r in [("chain4", 9, 0.8), ("tree16", 20, 0.6)]]
    bench.write_json(tmp_path / "speed.json", "speed", bench_args(), prompt_tokens=40, runs=3, engines=engines)
    bench.write_json(tmp_path / "rows.json", "rows", bench_args(), verify_s={1: 0.01, 8: 0.014, 64: 0.09},
                     draft_s={1: 0.002, 2: 0.004})
    timed = {c: {**v, "speedup": 1.2} for c, v in cats.items()}
    bench.write_json(tmp_path / "sb.json", "spec_bench", bench_args(checkpoint="ckpt/smollm2-int8"), tree="auto",
                     nodes=9, questions_per_category=2, speed=True, categories=timed,
                     trees=[dict(tree="auto", nodes=9, categories=timed), dict(tree="tree16", nodes=20, categories=timed)])
    rec = json.loads((tmp_path / "speed.json").read_text())
    assert rec["kind"] == "speed" and rec["machine"] and rec["date"] and rec["command"].startswith("python")

    out = tmp_path / "img"
    plots.main([str(tmp_path / f) for f in ("tau.json", "tau2.json", "speed.json", "rows.json", "sb.json")]
               + ["--out", str(out)])
    assert plots.label(json.loads((tmp_path / "sb.json").read_text())) == "eagle + lookup on int8, auto"
    for name in ("tau_per_category.png", "speedup_vs_tree.png", "rows_cost.png", "speedup_per_category.png"):
        png = (out / name).read_bytes()
        assert png[:8] == b"\x89PNG\r\n\x1a\n" and len(png) > 10_000


def test_bad_file_is_one_line(tmp_path):
    bad = tmp_path / "x.json"
    bad.write_text("{not json")
    r = subprocess.run([sys.executable, "plots.py", str(bad), "--out", str(tmp_path)], cwd=ROOT,
                       capture_output=True, text=True)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"error: {bad} is not a result file of bench.py --json: give the files it wrote"]
