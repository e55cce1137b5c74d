"""labkit.graphed_prefill: which prefills are captured (inside a timing loop, a repeated one, up to
MAX_TOKENS tokens; never outside one, never chunked prefill's successive chunks), replay and
fallback, with a stand-in for torch.cuda on a CPU; on a GPU the real graph against eager prefills,
new token values included."""

import labkit  # noqa: E402,F401 — before triton: chooses Triton's interpreter where there is no NVIDIA driver

import pytest  # noqa: E402
import torch  # noqa: E402

from labkit import cuda_graphs, graphed_prefill, sweeps  # noqa: E402
from labkit.clock import Clock  # noqa: E402
from labkit.model import Llama  # noqa: E402
from labkit.specs import get_model  # noqa: E402

from graph_util import FakeCuda  # noqa: E402

CUDA = torch.cuda.is_available()
TINY = get_model("lab-tiny")


def tokens_for(seed, *shape, device="cpu"):
    return torch.randint(0, TINY.vocab_size, shape, generator=torch.Generator().manual_seed(seed)).to(device)


def two_models(monkeypatch, fake=None, batch=2):
    """(graphed, eager): identical CPU models (one seed, torch ops), the first with its prefill graph
    allowed against `fake` (a stand-in for torch.cuda), the second eager as on the CPU."""
    monkeypatch.setattr(cuda_graphs, "cuda", fake or FakeCuda())
    models = [Llama(TINY, batch=batch, max_tokens=32, cache_dtype="fp32", device="cpu", compute_dtype="fp32",
                    kernels="torch", seed=3) for _ in range(2)]
    models[0].prefill_graph.allowed = True
    return models


def test_in_a_timing_loop_a_prefill_is_captured_the_second_time_then_replayed(monkeypatch):
    graphed, eager = two_models(monkeypatch)
    tokens = tokens_for(1, 2, 6)
    want = eager.prefill(tokens)
    path, replays = graphed.prefill_graph, FakeCuda.CUDAGraph.replays
    with path.repeating():
        torch.testing.assert_close(graphed.prefill(tokens), want)  # first: eager, remembered
        assert path.graph is None and path.name == "torch" and FakeCuda.CUDAGraph.replays == replays
        assert path.reason == "eager prefill: a CUDA graph is captured when the same prefill comes again"
        torch.testing.assert_close(graphed.prefill(tokens), want)  # second: captured (one checking replay), replayed
        assert path.graph is not None and path.name == "torch+graph" and FakeCuda.CUDAGraph.replays == replays + 2
        graph = path.graph
        torch.testing.assert_close(graphed.prefill(tokens), want)  # third: the same graph replayed
        assert path.graph is graph and FakeCuda.CUDAGraph.replays == replays + 3
    # the loop's end drops the graph; its last prefill's name and reason stay for the point
    assert path.graph is None and path.name == "torch+graph"
    assert path.reason == "prefill replayed as a CUDA graph (captured when the same prefill came again)"
    # the bookkeeping stays outside the graph: lengths set at every call, the cache as the eager one's
    assert graphed.cache.host_lengths == eager.cache.host_lengths == [6, 6]
    torch.testing.assert_close(graphed.cache.k, eager.cache.k)


def test_outside_a_timing_loop_nothing_is_captured_even_when_a_call_repeats(monkeypatch):
    """Lesson 06's warm-up call and its first chunk can share a key: a capture there would land
    inside the timeline it measures."""
    graphed, eager = two_models(monkeypatch)
    tokens = tokens_for(8, 2, 5)
    for _ in range(3):
        torch.testing.assert_close(graphed.prefill(tokens), eager.prefill(tokens))
    path = graphed.prefill_graph
    assert path.graph is None and path.seen is None and path.name == "torch"
    assert path.reason == "eager prefill: a CUDA graph replays only a timing loop's repeated prefill"


def test_chunked_prefill_and_other_shapes_run_eagerly_and_drop_the_graph(monkeypatch):
    """Chunks at successive starts are different calls (their starts are baked in): never captured.
    Another call after a graph drops it (its memory), and is itself only remembered."""
    graphed, eager = two_models(monkeypatch)
    tokens = tokens_for(2, 2, 5)  # (not a chunk's shape: the stand-in's replay would return its logits)
    with graphed.prefill_graph.repeating():
        for _ in range(2):
            graphed.prefill(tokens)
        assert graphed.prefill_graph.graph is not None
        for model in (graphed, eager):
            model.cache.set_lengths(0)
        for start in (0, 4, 8):  # three chunks of one prompt
            chunk = tokens_for(10 + start, 2, 4)
            torch.testing.assert_close(graphed.prefill(chunk, start=start), eager.prefill(chunk, start=start))
            assert graphed.prefill_graph.graph is None and graphed.prefill_graph.name == "torch"
        assert graphed.cache.host_lengths == [12, 12]
        graphed.prefill_slot(1, tokens_for(5, 3))  # a slot's prefill: its rows are in the key
        graphed.prefill_slot(0, tokens_for(5, 3))
        assert graphed.prefill_graph.graph is None


def test_only_prefills_up_to_max_tokens_are_captured(monkeypatch):
    graphed, _ = two_models(monkeypatch)
    monkeypatch.setattr(graphed_prefill, "MAX_TOKENS", 8)
    for shape, captured in (((2, 5), False), ((2, 4), True)):  # 10 tokens, then 8
        tokens = tokens_for(3, *shape)
        with graphed.prefill_graph.repeating():
            for _ in range(3):
                graphed.prefill(tokens)
            assert (graphed.prefill_graph.graph is not None) == captured, shape
        assert ("over 8 tokens" in graphed.prefill_graph.reason) != captured, graphed.prefill_graph.reason


def test_a_failed_capture_turns_prefill_graphs_off_and_says_why(monkeypatch):
    graphed, eager = two_models(monkeypatch, FakeCuda(fail_capture=True))
    tokens = tokens_for(4, 2, 5)
    want = eager.prefill(tokens)
    with graphed.prefill_graph.repeating():
        for _ in range(3):
            torch.testing.assert_close(graphed.prefill(tokens), want)
    path = graphed.prefill_graph
    assert path.off.startswith("capture failed: RuntimeError: operation not permitted") and path.graph is None
    assert path.reason.startswith("eager prefill: CUDA graph off, capture failed") and path.name == "torch"


def test_a_replay_that_differs_from_the_eager_run_turns_prefill_graphs_off(monkeypatch):
    graphed, eager = two_models(monkeypatch)
    runs = []
    layers = graphed.prefill_layers

    def baked_in(*args):  # the captured run (the second of the capture) computes something else
        runs.append(1)
        return layers(*args) + (1.0 if len(runs) == 3 else 0.0)

    monkeypatch.setattr(graphed, "prefill_layers", baked_in)
    tokens = tokens_for(6, 2, 5)
    want = eager.prefill(tokens)
    with graphed.prefill_graph.repeating():
        for _ in range(2):
            torch.testing.assert_close(graphed.prefill(tokens), want)
    assert graphed.prefill_graph.off.startswith("the replay differs from the eager run by up to 1")
    assert graphed.prefill_graph.name == "torch"


def test_the_breakdown_clock_keeps_prefills_eager(monkeypatch):
    graphed, _ = two_models(monkeypatch)
    graphed.clock = Clock()
    tokens = tokens_for(7, 2, 5)
    with graphed.prefill_graph.repeating():
        for _ in range(3):
            graphed.prefill(tokens)
        assert graphed.prefill_graph.graph is None and graphed.prefill_graph.seen is None


def test_on_the_cpu_prefill_points_say_eager_and_why():
    model = Llama(TINY, batch=1, max_tokens=8, device="cpu", compute_dtype="fp32")
    assert not model.prefill_graph.allowed
    assert model.prefill_graph.reason == "eager prefill: no CUDA graph (not on CUDA)"
    point = sweeps.measure_prefill("lab-tiny", prompt_tokens=16, device="cpu", repeats=2)
    assert point["kernels"] == "torch" and point["prefill_reason"] == "eager prefill: no CUDA graph (not on CUDA)"


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA GPU")
@pytest.mark.parametrize("cache_dtype", ["bf16", "fp8", "int8"])
def test_a_real_cuda_graph_replays_eager_prefills(cache_dtype, monkeypatch):
    """Replays with new token values (the graph reads its static copy) give the eager logits and
    cache, for a whole prompt and for a chunk after a cached prefix (start > 0, the prefix read back)."""
    graphed = Llama(TINY, batch=2, max_tokens=64, cache_dtype=cache_dtype, device="cuda", seed=5)
    monkeypatch.setenv("LABKIT_CUDA_GRAPHS", "0")
    eager = Llama(TINY, batch=2, max_tokens=64, cache_dtype=cache_dtype, device="cuda", seed=5)
    for start in (0, 16):
        with graphed.prefill_graph.repeating(), eager.prefill_graph.repeating():
            for i in range(4):
                tokens = tokens_for(20 + i, 2, 16, device="cuda")
                got, want = graphed.prefill(tokens, start=start), eager.prefill(tokens, start=start)
                torch.testing.assert_close(got.float(), want.float(), atol=2e-2, rtol=2e-2,
                                           msg=f"start {start}, call {i}")
                torch.testing.assert_close(graphed.cache.k.float(), eager.cache.k.float(), atol=2e-2, rtol=2e-2)
        assert graphed.prefill_graph.name == "triton+graph", graphed.prefill_graph.reason
        assert eager.prefill_graph.name == "triton" and "LABKIT_CUDA_GRAPHS=0" in eager.prefill_graph.reason
        assert graphed.cache.lengths.tolist() == graphed.cache.host_lengths == [start + 16] * 2
