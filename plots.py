"""Plots of bench.py's JSON results (`bench.py ... --json FILE`), for the README and docs/.

    python plots.py docs/results/tau-*.json              # tau per Spec-Bench category, one bar per run
    python plots.py docs/results/speed-*.json            # speed-up over compiled AR against tree nodes
    python plots.py docs/results/rows-*.json             # cost of N verified rows against one row
    python plots.py FILE... --out docs/img

Each kind of result goes into one PNG in --out: `tau_per_category.png` (spec_bench runs of tau),
`speedup_per_category.png` (spec_bench runs with --speed: each tree's speed-up), `speedup_vs_tree.png`
(speed runs), `rows_cost.png` (`bench.py rows` runs); the runs' dates and machines go in the titles and legends.
matplotlib is for plots only (requirements-plots.txt), never imported by the engine.
"""
import argparse
import json
import sys
from pathlib import Path


def label(r: dict) -> str:
    heads = Path(r["heads"]).name.removesuffix("-smollm2") if r.get("heads") else "AR"
    base = f" on {Path(r['checkpoint']).name.removeprefix('smollm2-')}" if r.get("checkpoint") else ""
    return heads + (" + lookup" if r.get("lookup") else "") + base + (f", {r['tree']}" if r.get("tree") else "")


def short(machine: str) -> str:
    return machine.replace("Intel(R) Xeon(R) Processor", "Xeon").replace("family 6 model ", "model ")


def save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def tau_per_category(runs: list, out: Path) -> Path:
    import matplotlib.pyplot as plt
    cats = list(runs[0]["categories"])
    width = 0.8 / len(runs)
    fig, ax = plt.subplots(figsize=(max(8, len(cats) * 0.75) + 2, 4))
    for i, r in enumerate(runs):
        xs = [j + (i - (len(runs) - 1) / 2) * width for j in range(len(cats))]
        ax.bar(xs, [r["categories"].get(c, {}).get("tau", 0) for c in cats], width,
               label=f"{label(r)} ({r['questions_per_category']} a category, {short(r['machine'])})")
    ax.set_xticks(range(len(cats)), cats, rotation=40, ha="right")
    ax.set_ylabel("tau (tokens per step)")
    ax.set_title(f"Spec-Bench, {runs[0]['max_new_tokens']} new tokens, greedy, {runs[0]['dtype']} "
                 f"({', '.join(sorted({r['date'] for r in runs}))})", fontsize=9)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(axis="y", alpha=0.3)
    return save(fig, out / "tau_per_category.png")


def speedup_per_category(runs: list, out: Path) -> Path:
    """Spec-Bench speed runs (--speed): one panel a machine, one bar per tree of each of its runs,
    speculative over AR tokens/s."""
    import matplotlib.pyplot as plt
    machines = sorted({r["machine"] for r in runs}, key=lambda m: max(r["date"] for r in runs if r["machine"] == m),
                      reverse=True)  # the newest first
    cats = list(runs[0]["categories"])
    fig, axes = plt.subplots(len(machines), 1, figsize=(max(8, len(cats) * 0.75) + 3, 2.6 * len(machines) + 0.6),
                             sharex=True, sharey=True, squeeze=False)
    for ax, m in zip(axes[:, 0], machines):
        mine = [r for r in runs if r["machine"] == m]
        series = [(f"{label({**r, 'tree': t['tree']})} ({t['nodes']} nodes), {r['questions_per_category']} a category",
                   t["categories"]) for r in mine
                  for t in r.get("trees") or [dict(tree=r["tree"], nodes=r["nodes"], categories=r["categories"])]]
        width = 0.8 / len(series)
        for i, (name, cs) in enumerate(series):
            xs = [j + (i - (len(series) - 1) / 2) * width for j in range(len(cats))]
            ax.bar(xs, [cs.get(c, {}).get("speedup", 0) for c in cats], width, label=name)
        ax.axhline(1.0, color="gray", lw=1, ls="--")
        ax.set_title(f"{short(m)} ({', '.join(sorted({r['date'] for r in mine}))})", fontsize=9)
        ax.set_ylabel("vs compiled AR")
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
        ax.grid(axis="y", alpha=0.3)
    axes[-1, 0].set_xticks(range(len(cats)), cats, rotation=40, ha="right")
    fig.suptitle(f"Spec-Bench speed-up over compiled AR decoding, {runs[0]['max_new_tokens']} new tokens, greedy, "
                 f"{runs[0]['dtype']}, compiled", fontsize=10)
    return save(fig, out / "speedup_per_category.png")


def dates(runs: list) -> str:
    ds = sorted({r["date"] for r in runs})
    return ds[0] if len(ds) == 1 else f"{ds[0]} to {ds[-1]}"


def speedup_vs_tree(runs: list, out: Path) -> Path:
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(9.5, 4))
    runs = [r for r in runs if any(e["tree"] for e in r["engines"])]  # (not autoregressive runs alone)
    for r in runs:
        pts = sorted((e["nodes"], e["vs_compiled_ar"], e["tree"]) for e in r["engines"] if e["tree"])
        ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=f"{label({**r, 'tree': None})}, {short(r['machine'])}")
        for x, y, tree in pts:
            ax.annotate(tree, (x, y), textcoords="offset points", xytext=(4, 4), fontsize=7)
    ax.axhline(1.0, color="gray", lw=1, ls="--", label="compiled AR decoding")
    ax.set_xscale("log", base=2)
    nodes = sorted({e["nodes"] for r in runs for e in r["engines"] if e["tree"]})
    ax.set_xticks(nodes, [str(n) for n in nodes])
    ax.minorticks_off()
    ax.set_xlabel("verified tree nodes")
    ax.set_ylabel("speed-up over compiled AR decoding")
    ax.set_title(f"story prompt, {runs[0]['max_new_tokens']} new tokens, {runs[0]['dtype']}, compiled, "
                 f"{runs[0]['threads']} threads ({dates(runs)})", fontsize=9)
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    ax.grid(alpha=0.3)
    return save(fig, out / "speedup_vs_tree.png")


def rows_cost(runs: list, out: Path) -> Path:
    import matplotlib.pyplot as plt
    fig, ax = plt.subplots(figsize=(7, 4))
    for r in runs:
        v = {int(n): t for n, t in r["verify_s"].items()}
        ax.plot(list(v), [t / v[1] for t in v.values()], "o-", label=f"{short(r['machine'])}, {r['dtype']}, {r['date']}")
    ax.plot([1, 64], [1, 64], color="gray", lw=1, ls=":", label="N one-row forwards")
    ax.axhline(1.0, color="gray", lw=1, ls="--", label="one row (the memory bound)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log", base=2)
    ns = [n for n in (1, 2, 4, 8, 16, 32, 64) if any(str(n) in r["verify_s"] for r in runs)]  # (every size: unreadable)
    ax.set_xticks(ns, [str(n) for n in ns])
    ax.set_yticks(ns, [f"{n}x" for n in ns])
    ax.minorticks_off()
    ax.set_xlabel("tree rows verified in one base forward (512-token prefix)")
    ax.set_ylabel("time / time of one row")
    ax.set_title("compiled base forward over N rows", fontsize=9)
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    return save(fig, out / "rows_cost.png")


PLOTS = {"spec_bench": tau_per_category, "speed": speedup_vs_tree, "rows": rows_cost}


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("files", nargs="+", help="JSON files written by bench.py --json")
    p.add_argument("--out", default="docs/img", help="folder for the PNGs")
    args = p.parse_args(argv)
    try:
        import matplotlib
        matplotlib.use("Agg")
    except ImportError:
        print("error: plots need matplotlib: pip install -r requirements-plots.txt", file=sys.stderr)
        sys.exit(2)
    runs = {}
    for f in args.files:
        try:
            r = json.loads(Path(f).read_text())
            runs.setdefault(r["kind"], []).append(r)
        except (OSError, ValueError, KeyError, TypeError):
            print(f"error: {f} is not a result file of bench.py --json: give the files it wrote", file=sys.stderr)
            sys.exit(2)
    unknown = set(runs) - set(PLOTS)
    if unknown:
        print(f"error: no plot for results of kind {', '.join(sorted(unknown))}: give spec_bench, speed or rows runs",
              file=sys.stderr)
        sys.exit(2)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    # Spec-Bench runs that timed the trees draw speed-ups; the others (tau only) draw tau
    spec_bench = runs.pop("spec_bench", [])
    runs["spec_bench"] = [r for r in spec_bench if not r.get("speed")]
    timed = [r for r in spec_bench if r.get("speed")]
    for kind, rs in runs.items():
        if rs:
            print(PLOTS[kind](rs, out))
    if timed:
        print(speedup_per_category(timed, out))


if __name__ == "__main__":
    main()
