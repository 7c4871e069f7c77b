"""The engine on a GPU: greedy speculative output equals greedy autoregressive output with the shipped
heads on the default model (fp32), eager and compiled as CUDA graphs. Skipped where no CUDA device is
found (CI); TREESPEC_TEST_DEVICE=cpu runs the same checks on the CPU."""
import copy
import os

import pytest
import torch

from generate import load_heads
import speculate as sp

DEVICE = os.environ.get("TREESPEC_TEST_DEVICE", "cuda")
pytestmark = pytest.mark.skipif(DEVICE.startswith("cuda") and not torch.cuda.is_available(),
                                reason="no CUDA device (TREESPEC_TEST_DEVICE=cpu runs these on the CPU)")

PROMPTS = ["Write a Python function that checks whether a number is prime.",
           "Explain in two sentences why the sky is blue."]
MAX_NEW = 48


@pytest.fixture(scope="module")
def smol(default_model):
    """The default model (fp32) on DEVICE, its prompts and their greedy autoregressive references."""
    model, tok = default_model
    model = copy.deepcopy(model).to(DEVICE)
    prompts = [torch.tensor(tok.encode(tok.chat([{"role": "user", "content": p}])), device=DEVICE) for p in PROMPTS]
    refs = []
    for prompt in prompts:
        sp.setup_caches(model, None, len(prompt) + MAX_NEW + 1)
        with torch.inference_mode():
            first, state = sp.start(model, None, prompt, 0, dict(temperature=0.0))
            refs.append(sp.decode(lambda t, p: sp.ar_step(model, t, p), state, first, MAX_NEW, tok.eos_id)[0])
    return model, tok, prompts, refs


def spec_outputs(model, tok, head, prompts, tree, dynamic, compile_mode=None):
    """Greedy speculative outputs and tau over the prompts, with one cache for all (one graph)."""
    draft, accept, depth, nodes, scratch = sp.speculator(model, head, tree, dynamic)
    sp.setup_caches(model, head, max(len(p) for p in prompts) + MAX_NEW + nodes, scratch)
    step = lambda h, t, n, P: sp.spec_step(model, draft, accept, h, t, n, P)
    if compile_mode:
        step = sp.compile_step(step, DEVICE, compile_mode)
    outs, tokens, steps = [], 0, 0
    for prompt in prompts:
        with torch.inference_mode():
            first, state = sp.start(model, head, prompt, depth, dict(temperature=0.0))
            out, k = sp.decode(step, state, first, MAX_NEW, tok.eos_id)
            outs.append(out)
        tokens, steps = tokens + len(out) - 1, steps + k
    return outs, tokens / steps


@pytest.mark.parametrize("name,tree,dynamic,lookup", [
    ("medusa", "mc_sim_7b_63", None, 0),
    ("hydra", "mc_sim_7b_63", None, 0),
    ("eagle", None, (10, 6, 60), 0),
    ("eagle", None, (10, 6, 60), 3),
])
def test_shipped_heads_on_device_decode_exactly(smol, name, tree, dynamic, lookup):
    model, tok, prompts, refs = smol
    head = load_heads(f"heads/{name}-smollm2", model, None, lookup).to(DEVICE)
    outs, tau = spec_outputs(model, tok, head, prompts, tree, dynamic)
    print(f"{DEVICE} {name}{' + lookup' if lookup else ''}: tau {tau:.2f}")
    assert outs == refs
    assert tau >= 1.3  # drafts were accepted: paths of several tokens were verified and compacted


def test_compiled_steps_on_device_equal_autoregressive(smol, monkeypatch, no_recompiles):
    """The autoregressive step and EAGLE's dynamic-tree step compiled (fullgraph; on CUDA as CUDA
    graphs, reduce-overhead): two prompts through one graph each."""
    import torch._dynamo
    model, tok, prompts, refs = smol
    mode = "reduce-overhead" if DEVICE.startswith("cuda") else "default"
    head = load_heads("heads/eagle-smollm2", model).to(DEVICE)
    outs, tau = spec_outputs(model, tok, head, prompts, None, (10, 6, 60), mode)
    assert outs == refs
    assert tau >= 1.3
    sp.setup_caches(model, None, max(len(p) for p in prompts) + MAX_NEW + 1)
    ar = sp.compile_step(lambda t, p: sp.ar_step(model, t, p), DEVICE, mode)
    for prompt, ref in zip(prompts, refs):
        with torch.inference_mode():
            first, state = sp.start(model, None, prompt, 0, dict(temperature=0.0))
            assert sp.decode(ar, state, first, MAX_NEW, tok.eos_id)[0] == ref
