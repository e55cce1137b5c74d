"""A stand-in for torch.cuda's graph API, for the CUDA-graph tests on a CPU."""
import contextlib


class FakeCuda:
    """torch.cuda's graph API on a CPU: streams do nothing; "capture" runs the body once;
    replay does nothing, so a replay returns what the capture computed."""

    class Stream:
        def wait_stream(self, other):
            pass

    class CUDAGraph:
        replays = 0

        def replay(self):
            FakeCuda.CUDAGraph.replays += 1

    def __init__(self, fail_capture=False):
        self.fail_capture = fail_capture

    def current_stream(self):
        return FakeCuda.Stream()

    def stream(self, stream):
        return contextlib.nullcontext()

    @contextlib.contextmanager
    def graph(self, graph):
        if self.fail_capture:
            raise RuntimeError("operation not permitted when stream is capturing\nmore")
        yield
