"""labkit.graphed_decode: the step it captures equals the eager step (on the CPU, in Triton's
interpreter), its capture/replay/fallback logic with a stand-in for torch.cuda, and on a GPU the
real graph against the eager step."""

import labkit  # noqa: E402,F401 — before triton: chooses Triton's interpreter where there is no NVIDIA driver

import pytest  # noqa: E402
import torch  # noqa: E402

from labkit import cuda_graphs, decode_paths, graphed_decode  # noqa: E402
from labkit.model import Llama  # noqa: E402
from labkit.specs import get_model  # noqa: E402

from graph_util import FakeCuda  # noqa: E402

CUDA = torch.cuda.is_available()
DEVICE = "cuda" if CUDA else "cpu"
TINY = get_model("lab-tiny")


def tokens_for(seed, *shape):
    return torch.randint(0, TINY.vocab_size, shape, generator=torch.Generator().manual_seed(seed)).to(DEVICE)


def two_models(cache_dtype="fp32", mixed=True, kernels="torch"):
    """Identical models (one seed) with the same prompts: row 1 free, rows 0 and 2 of different
    lengths when `mixed` (continuous batching), else equal. The torch ops (the numpy step off)
    run the graph logic's tests fast on a CPU; the Triton ops are what CUDA captures."""
    models = [Llama(TINY, batch=3, max_tokens=24, cache_dtype=cache_dtype, device=DEVICE, compute_dtype="fp32",
                    kernels=kernels, seed=5) for _ in range(2)]
    for model in models:
        model.decode_path = decode_paths.EagerDecode(model)  # the layer-by-layer step, as on CUDA
        model.prefill_slot(0, tokens_for(1, 4))
        model.prefill_slot(2, tokens_for(2, 7 if mixed else 4))
    return models


@pytest.mark.parametrize("kernels, cache_dtype, mixed", [
    pytest.param("triton", "fp32", True, marks=pytest.mark.triton),
    pytest.param("triton", "int8", False, marks=pytest.mark.triton),
    ("torch", "fp32", False), ("torch", "int8", True)])
def test_the_captured_formulation_equals_the_eager_step(kernels, cache_dtype, mixed):
    """What the graph captures (positions and lengths from the device, the capacity as the longest
    row) gives the eager step's logits and writes the same K/V, step after step."""
    graphed, eager = two_models(cache_dtype, mixed, kernels)
    for i in range(2):
        step = tokens_for(10 + i, 3)
        cache = graphed.cache
        got = graphed.decode_layers(step, cache, graphed_decode.device_plan(cache))
        cache.advance()
        want = eager.decode_step(step)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5, msg=f"step {i}")
    torch.testing.assert_close(graphed.cache.k.float(), eager.cache.k.float(), atol=1e-5, rtol=1e-5)
    assert graphed.cache.host_lengths == eager.cache.host_lengths


def test_capture_then_replay_with_the_model_bookkeeping(monkeypatch):
    monkeypatch.setattr(cuda_graphs, "cuda", FakeCuda())
    graphed, eager = two_models()
    graphed.decode_path = graphed_decode.GraphedDecode(graphed)
    step = tokens_for(20, 3)
    torch.testing.assert_close(graphed.decode_step(step), eager.decode_step(step), atol=1e-5, rtol=1e-5)
    assert graphed.decode_path.name == "torch+graph" and graphed.decode_path.off is None
    assert graphed.cache.host_lengths == eager.cache.host_lengths == [5, 0, 8]
    replays = FakeCuda.CUDAGraph.replays
    graphed.decode_step(step)  # same cache: no new capture, one more replay
    assert FakeCuda.CUDAGraph.replays == replays + 1
    first = graphed.decode_path.graph
    graphed.setup_cache(3, 24, "fp32")  # a new cache: the old graph (it points into the old one) is dropped
    assert graphed.decode_path.graph is None and graphed.decode_path.key is None
    graphed.prefill_slot(0, tokens_for(1, 4))
    graphed.decode_step(step)  # ... and the new cache is captured on its first step
    assert graphed.decode_path.graph is not None and graphed.decode_path.graph is not first
    key = graphed.decode_path.key
    assert key[:3] == (3, "fp32", tuple(graphed.cache.k.shape)) and graphed.cache.k.data_ptr() in key[3]


def test_a_graph_belongs_to_the_cache_it_was_captured_for(monkeypatch):
    """A step on another cache passed in is captured anew (its addresses differ); each cache's
    step still equals the eager one's."""
    monkeypatch.setattr(cuda_graphs, "cuda", FakeCuda())
    graphed, eager = two_models()
    graphed.decode_path = graphed_decode.GraphedDecode(graphed)
    other, other_eager = graphed.make_cache(2, 16, "fp32"), eager.make_cache(2, 16, "fp32")
    for model, cache in ((graphed, other), (eager, other_eager)):
        model.prefill(tokens_for(3, 2, 5), cache)
    step, pair = tokens_for(21, 3), tokens_for(22, 2)
    torch.testing.assert_close(graphed.decode_step(step), eager.decode_step(step), atol=1e-5, rtol=1e-5)
    first = graphed.decode_path.graph
    torch.testing.assert_close(graphed.decode_step(pair, other), eager.decode_step(pair, other_eager),
                               atol=1e-5, rtol=1e-5)
    assert graphed.decode_path.graph is not first and other.k.data_ptr() in graphed.decode_path.key[3]
    assert other.host_lengths == other_eager.host_lengths == [6, 6]
    assert graphed.cache.host_lengths == eager.cache.host_lengths == [5, 0, 8]


def test_a_failed_capture_falls_back_to_the_eager_step_and_says_why(monkeypatch):
    monkeypatch.setattr(cuda_graphs, "cuda", FakeCuda(fail_capture=True))
    graphed, eager = two_models()
    graphed.decode_path = graphed_decode.GraphedDecode(graphed)
    for i in range(2):
        step = tokens_for(30 + i, 3)
        torch.testing.assert_close(graphed.decode_step(step), eager.decode_step(step), atol=1e-5, rtol=1e-5)
    assert graphed.decode_path.off.startswith("capture failed: RuntimeError: operation not permitted")
    assert "CUDA graph off, capture failed" in graphed.decode_path.reason and graphed.decode_path.name == "torch"


def test_a_replay_that_differs_from_the_eager_step_turns_graphs_off(monkeypatch):
    class BakedIn(graphed_decode.GraphedDecode):  # the captured step computes something else
        calls = 0

        def _body(self, cache):
            self.calls += 1
            return super()._body(cache) + (1.0 if self.calls == graphed_decode.WARMUP_STEPS + 1 else 0.0)

    monkeypatch.setattr(cuda_graphs, "cuda", FakeCuda())
    graphed, eager = two_models()
    graphed.decode_path = BakedIn(graphed)
    step = tokens_for(40, 3)
    torch.testing.assert_close(graphed.decode_step(step), eager.decode_step(step), atol=1e-5, rtol=1e-5)
    assert graphed.decode_path.off.startswith("the replay differs from the eager run")
    assert graphed.decode_path.graph is None and graphed.decode_path.name == "torch"


def test_graphs_only_on_cuda_with_the_triton_ops(monkeypatch):
    cpu = Llama(TINY, batch=1, max_tokens=8, device="cpu", compute_dtype="fp32")
    assert graphed_decode.applies(cpu) == (False, "no CUDA graph (not on CUDA)")
    assert not isinstance(cpu.decode_path, graphed_decode.GraphedDecode)
    if CUDA:
        graphed = Llama(TINY, batch=1, max_tokens=8, device="cuda")
        assert isinstance(graphed.decode_path, graphed_decode.GraphedDecode)
        assert graphed.decode_path.reason == "not on the CPU; decode step as a CUDA graph once captured"
        monkeypatch.setenv("LABKIT_CUDA_GRAPHS", "0")
        off = Llama(TINY, batch=1, max_tokens=8, device="cuda")
        assert isinstance(off.decode_path, decode_paths.EagerDecode)
        assert "LABKIT_CUDA_GRAPHS=0" in off.decode_path.reason


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("cache_dtype", ["bf16", "fp8", "int8"])
def test_a_real_cuda_graph_replays_the_eager_step(cache_dtype, monkeypatch):
    graphed = Llama(TINY, batch=3, max_tokens=24, cache_dtype=cache_dtype, device="cuda", seed=5)
    monkeypatch.setenv("LABKIT_CUDA_GRAPHS", "0")
    eager = Llama(TINY, batch=3, max_tokens=24, cache_dtype=cache_dtype, device="cuda", seed=5)
    for model in (graphed, eager):
        model.prefill_slot(0, tokens_for(1, 4))
        model.prefill_slot(2, tokens_for(2, 7))
    for i in range(4):
        step = tokens_for(50 + i, 3)
        torch.testing.assert_close(graphed.decode_step(step).float(), eager.decode_step(step).float(),
                                   atol=2e-2, rtol=2e-2, msg=f"step {i}")
    assert graphed.decode_path.name == "triton+graph", graphed.decode_path.reason
    assert graphed.cache.lengths.tolist() == graphed.cache.host_lengths == [8, 0, 11]
