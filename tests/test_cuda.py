"""The engine on a GPU: greedy speculative output equals greedy autoregressive output with the shipped
heads on the default model (fp32), eager and compiled as CUDA graphs. Skipped where no CUDA device is
found (CI); TREESPEC_TEST_DEVICE=cpu runs the same checks on the CPU."""
import copy
import os

import pytest
import torch

import generate as G
from heads import load_heads

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
        G.setup_caches(model, None, len(prompt) + MAX_NEW + 1)
        with torch.inference_mode():
            first, state = G.start(model, None, prompt, 0, dict(temperature=0.0))
            refs.append(G.decode(lambda t, p: G.ar_step(model, t, p), state, first, MAX_NEW, tok.eos_id))
    return model, tok, prompts, refs


def spec_outputs(model, tok, head, prompts, tree, dynamic, compile_mode=None):
    """Greedy speculative outputs and tau over the prompts, with one cache for all (one graph)."""
    draft, accept, depth, nodes, scratch = G.speculator(model, head, tree, dynamic)
    G.setup_caches(model, head, max(len(p) for p in prompts) + MAX_NEW + nodes, scratch)
    step = lambda h, t, n, P: G.spec_step(model, draft, accept, h, t, n, P)
    if compile_mode:
        step = G.compile_step(step, DEVICE, compile_mode)
    outs, tokens, steps = [], 0, 0
    for prompt in prompts:
        with torch.inference_mode():
            first, state = G.start(model, head, prompt, depth, dict(temperature=0.0))
            outs.append(G.decode(step, state, first, MAX_NEW, tok.eos_id))
        tokens, steps = tokens + len(outs[-1]) - 1, steps + G.decode.steps
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
    G.setup_caches(model, None, max(len(p) for p in prompts) + MAX_NEW + 1)
    ar = G.compile_step(lambda t, p: G.ar_step(model, t, p), DEVICE, mode)
    for prompt, ref in zip(prompts, refs):
        with torch.inference_mode():
            first, state = G.start(model, None, prompt, 0, dict(temperature=0.0))
            assert G.decode(ar, state, first, MAX_NEW, tok.eos_id) == ref
