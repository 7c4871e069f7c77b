"""Generate text with a Llama-family model from the command line: load the base model (quantized where
its checkpoint is, with this CPU's kernels), the draft heads and the tree (`--tree auto`: the tuner's
choice), then stream the decode loop of speculate.py.

    python generate.py --prompt "What is the capital of France?"            # embedded SmolLM2-135M-Instruct
    python generate.py --compile --dtype bfloat16 --prompt "..."            # compiled decode step
    python generate.py --interactive                                        # chat
"""
import argparse
import sys
import time
from pathlib import Path

import torch

import checkpoint as ckpt
import costs
import cpu_kernels
import quantize
from heads import NGram
from model import Transformer
from speculate import ar_step, decode, live_span, setup_caches, spec_step, speculator, start
from tokenizer import Tokenizer


def load_model(checkpoint=None, device="cpu", dtype=torch.float32):
    """The base model as generation runs it: its checkpoint's weights (checkpoint.py), weight-only
    quantized where the checkpoint is (quantize.py), with this CPU's kernels (cpu_kernels.py).
    checkpoint: None (the embedded default), a folder (ours or HF), a .gguf file or a hub id.
    Returns (Transformer in eval mode, Tokenizer)."""
    folder, args, state = ckpt.resolve(checkpoint)
    with torch.device("meta"):
        model = Transformer(args)
    quant = ckpt.quantization(folder)
    if quant:  # built on the device, in the dtype: the kernels' packed forms depend on both
        state = quantize.install(model, state, quant, device, dtype)
    model = ckpt.assign(model, state, folder).to(device=device, dtype=dtype).eval()
    return cpu_kernels.install(model, device, dtype), Tokenizer(folder)


def load_heads(path, model, head_type=None, lookup: int = 0):
    """A draft head as generation runs it: its official layout (checkpoint.load_heads), int8 where its
    folder is (quantize.py), in the base's dtype, with the base's kernels (cpu_kernels.py).
    path: a heads folder, a hub id or ngram[:N]; lookup: add an N-gram prompt-lookup branch."""
    head, quant = ckpt.load_heads(path, model, head_type, lookup)
    device, dtype = model.output.weight.device, model.output.weight.dtype
    if quant:  # from the stored values (fp32): the stored integers
        quantize.quantize_linears(head, device, dtype)
    return cpu_kernels.install(head.to(device, dtype), device, dtype)


def resolve_tree(model, head, heads_dir, tree, device: str, compile_mode=None, checkpoint=None):
    """--tree as the speculator takes it: `auto` becomes the tree costs.auto_tree chooses (a list of index
    paths), or None where plain decoding is predicted fastest; a head with no measured acceptance
    gets tree16 (the n-gram drafter chain4). Prints what was chosen and the predicted speed-up.
    Returns (the tree, auto's choice or None)."""
    if tree != "auto":
        return tree, None
    folder = Path(str(heads_dir))
    choice = costs.auto_tree(model, head, folder, device, compile_mode, checkpoint)
    if choice is None and isinstance(head, NGram):  # one branch: a chain
        print("--tree auto: no measured acceptance of the n-gram drafter for this base model, so chain4",
              file=sys.stderr)
        return "chain4", choice
    if choice is None:
        print(f"--tree auto: {folder} has no acceptance.json (train.py writes it), so tree16", file=sys.stderr)
        return "tree16", choice
    if choice["paths"] is None:
        timed = [c for c in choice["candidates"] if "overhead" in c]  # (near trees timed whole: at their steps)
        best = max(timed or choice["candidates"], key=lambda c: c["speedup"], default=None)
        near = f" (the best tree, {best['nodes']} nodes, {best['speedup']:.2f}x)" if best else ""
        print(f"--tree auto: plain autoregressive decoding is predicted fastest here{near}", file=sys.stderr)
        return None, choice
    chain = f", a lookup chain {choice['chain']} deep" if choice.get("chain") else ""
    near = f" (of {len(choice['timed'])} near-equal trees timed whole)" if choice.get("timed") else ""
    print(f"--tree auto: {sum(p[0] >= 0 for p in choice['paths'])} paths, {choice['nodes']} verified nodes, "
          f"{choice['depth']} deep{chain}; "
          f"expected tau {choice['tau']:.2f}, predicted {choice['speedup']:.2f}x over autoregressive decoding{near}",
          file=sys.stderr)
    return choice["paths"], choice


class Streamer:
    """Prints text as tokens arrive, holding back bytes of a character that is not complete yet."""

    def __init__(self, tokenizer, file=sys.stdout):
        self.tokenizer, self.file, self.ids, self.printed = tokenizer, file, [], 0

    def __call__(self, new):
        self.ids += [t for t in new if t != self.tokenizer.eos_id]
        text = self.tokenizer.decode(self.ids)
        if not text.endswith("\ufffd"):
            self.file.write(text[self.printed:])
            self.file.flush()
            self.printed = len(text)


def check_device(device: str) -> str:
    try:
        kind = torch.device(device).type
    except RuntimeError:
        raise ValueError(f"unknown device '{device}': use cpu, cuda or cuda:N") from None
    if kind == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"device '{device}' is not available on this machine: use --device cpu")
    if kind not in ("cpu", "cuda"):
        raise ValueError(f"device '{device}' is not supported: use cpu, cuda or cuda:N")
    return device


def cache_size(prompt_len: int, max_new_tokens: int, margin: int, context: int) -> int:
    """Static cache length: room for the prompt, the new tokens and one step's scratch slots,
    rounded up so that nearby prompts share one compiled graph."""
    if max_new_tokens < 1:
        raise ValueError(f"--max_new_tokens must be at least 1, got {max_new_tokens}")
    need = prompt_len + max_new_tokens + margin
    if prompt_len + margin >= context:
        raise ValueError(f"the prompt has {prompt_len} tokens, more than the model's context of {context} "
                         "allows: shorten the prompt")
    if need > context:
        raise ValueError(f"the prompt ({prompt_len} tokens) plus --max_new_tokens {max_new_tokens} exceeds the "
                         f"model's context of {context}: lower --max_new_tokens to at most "
                         f"{context - prompt_len - margin}")
    return min(context, -(-need // 256) * 256)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--prompt", default="What is the capital of France?")
    p.add_argument("--checkpoint", default=None, help="model folder (ours or Hugging Face), .gguf file or hub id; "
                                                       "default: the embedded SmolLM2-135M-Instruct")
    p.add_argument("--no_chat", action="store_true", help="feed the prompt as raw text, without the chat template")
    p.add_argument("--interactive", action="store_true", help="chat in the terminal")
    p.add_argument("--max_new_tokens", type=int, default=256)
    p.add_argument("--temperature", type=float, default=0.0, help="0: greedy")
    p.add_argument("--top_k", type=int, default=0, help="sampling: keep the k most likely tokens (0: all); "
                                                         "with --dynamic_tree: children per frontier node")
    p.add_argument("--top_p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--compile", action="store_true", help="compile the decode step (fullgraph, static shapes)")
    p.add_argument("--compile_mode", default=None, help="torch.compile mode (default: max-autotune-no-cudagraphs "
                                                        "on CPU, reduce-overhead (CUDA graphs) on CUDA)")
    s = p.add_argument_group("speculative decoding")
    s.add_argument("--heads", default=None, help="draft heads: a Medusa, Hydra or EAGLE folder or hub id")
    s.add_argument("--head_type", choices=["medusa", "hydra", "eagle"], default=None, help="default: from the checkpoint")
    s.add_argument("--tree", default="auto", help="static tree: a name (mc_sim_7b_63, tree16, chain4...), a JSON file "
                   "of index paths (with --lookup, a path [-1, 0, ..., 0] sets the lookup chain's depth), "
                   "or auto: the fastest tree here (or plain decoding) from the head's measured "
                   "acceptance and this machine's step costs, timed once and cached")
    s.add_argument("--dynamic_tree", action="store_true", help="EAGLE-2 dynamic tree (--top_k, --depth, --total_tokens)")
    s.add_argument("--lookup", type=int, default=0, metavar="N", help="add a prompt-lookup branch (matching up to "
                   "N tokens of the context, 3 is good) to the head's tree, static or dynamic")
    s.add_argument("--depth", type=int, default=4)
    s.add_argument("--total_tokens", type=int, default=16)
    s.add_argument("--acceptance", default="greedy", choices=["greedy", "typical", "sample"],
                   help="greedy (exact), sample (lossless speculative sampling) or typical (Medusa's, lossy)")
    s.add_argument("--posterior_threshold", type=float, default=0.09)
    s.add_argument("--posterior_alpha", type=float, default=0.3)
    s.add_argument("--compare", action="store_true", help="also decode autoregressively and print both speeds")
    args = p.parse_args(argv)
    try:
        run(args)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    except (KeyboardInterrupt, EOFError):
        print()


def run(args):
    device = check_device(args.device)
    if args.temperature < 0 or not 0 < args.top_p <= 1 or args.top_k < 0:
        raise ValueError("need --temperature >= 0, 0 < --top_p <= 1 and --top_k >= 0")
    torch.manual_seed(args.seed)
    t0 = time.perf_counter()
    model, tokenizer = load_model(args.checkpoint, device, getattr(torch, args.dtype))
    if args.lookup and not args.heads:
        raise ValueError("--lookup adds a branch to a head's tree: give --heads too (or --heads ngram alone)")
    head = load_heads(args.heads, model, args.head_type, args.lookup) if args.heads else None
    print(f"loaded in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    sampling = dict(temperature=args.temperature, top_k=0 if args.dynamic_tree else args.top_k, top_p=args.top_p)
    ar = lambda token, pos, span=None: ar_step(model, token, pos, **sampling, span=span)
    depth, nodes, scratch, step = 0, 1, 0, ar
    tree = args.tree
    if head is not None and not args.dynamic_tree:
        tree, _ = resolve_tree(model, head, args.heads, tree, device,
                               (args.compile_mode or "default") if args.compile else None, args.checkpoint)
        if tree is None:
            head = None
    if head is not None:
        draft, accept, depth, nodes, scratch = speculator(
            model, head, tree, (args.top_k or 8, args.depth, args.total_tokens) if args.dynamic_tree else None,
            args.acceptance, args.temperature, sampling["top_k"], args.top_p, args.posterior_threshold, args.posterior_alpha)
        step = lambda h, t, n, P, span=None: spec_step(model, draft, accept, h, t, n, P, span)
    if args.compile:
        compiled = costs.compiler(model, device, args.compile_mode, args.checkpoint)
        step, ar = compiled(step), compiled(ar)

    messages, cache_len = [], 0
    while True:
        user = input("> ") if args.interactive else args.prompt
        messages.append({"role": "user", "content": user})
        text = user if args.no_chat else tokenizer.chat(messages)
        ids = tokenizer.encode(text, bos=None if args.no_chat else False)
        prompt = torch.tensor(ids, device=device)
        need = cache_size(len(ids), args.max_new_tokens, nodes, model.args.max_seq_len)
        if cache_len < need:  # (auto's timing left caches of its own size)
            setup_caches(model, head, need, scratch)
            cache_len = model.max_seq_len
            span, ar_span = live_span(model, nodes), live_span(model, 1)
            if args.compile:  # compile now, not inside the timed decode (the next prefill overwrites the cache)
                t0 = time.perf_counter()
                with torch.inference_mode():
                    decode(step, start(model, head, prompt, depth, sampling)[1], 0, 2, span=(span, len(ids)))
                    if args.compare and head is not None:
                        decode(ar, start(model, None, prompt, 0, sampling)[1], 0, 2, span=(ar_span, len(ids)))
                print(f"compiled in {time.perf_counter() - t0:.0f} s", file=sys.stderr)
        with torch.inference_mode():
            t0 = time.perf_counter()
            first, state = start(model, head, prompt, depth, sampling)
            ttft = time.perf_counter() - t0
            t1 = time.perf_counter()
            out, steps = decode(step, state, first, args.max_new_tokens, tokenizer.eos_id, Streamer(tokenizer),
                                (span, len(ids)))
            dt = time.perf_counter() - t1
        print(file=sys.stdout)
        rate = (len(out) - 1) / max(dt, 1e-9)
        print(f"time to first token {ttft * 1000:.0f} ms; {len(out) - 1} tokens in {dt:.2f} s: {rate:.1f} tok/s",
              file=sys.stderr)
        if head is not None:
            print(f"tau (mean tokens per step, with the bonus token) {(len(out) - 1) / max(steps, 1):.2f} "
                  f"over {steps} steps", file=sys.stderr)
        if args.compare and head is not None:
            with torch.inference_mode():
                first, state = start(model, None, prompt, 0, sampling)
                t1 = time.perf_counter()
                ref, _ = decode(ar, state, first, args.max_new_tokens, tokenizer.eos_id, span=(ar_span, len(ids)))
                dt_ar = time.perf_counter() - t1
            rate_ar = (len(ref) - 1) / max(dt_ar, 1e-9)
            same = ("identical" if ref == out else "different (when sampling; in bfloat16 also where two tokens "
                    "tie within its rounding: float32 gives identical outputs)")
            print(f"autoregressive {rate_ar:.1f} tok/s; speculative {rate:.1f} tok/s = {rate / rate_ar:.2f}x; "
                  f"outputs {same}", file=sys.stderr)
        if not args.interactive:
            return
        reply = out[:-1] if out[-1] == tokenizer.eos_id else out
        messages.append({"role": "assistant", "content": tokenizer.decode(reply)})


if __name__ == "__main__":
    main()
