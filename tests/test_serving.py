"""A request served for real: one prefill, then n - 1 decode steps, timed apart."""
import pytest

from labkit import serving
from labkit.errors import LabError


def test_a_request_is_one_prefill_then_n_minus_one_decode_steps():
    out = serving.serve_request("lab-tiny", 64, 5, device="cpu")
    assert out["prefill_s"] > 0 and out["decode_s"] > 0 and out["device"] == "cpu"
    assert out["prefill_share"] + out["decode_share"] == pytest.approx(1)
    assert out["itl_s"] == pytest.approx(out["decode_s"] / 4)


def test_a_one_token_answer_has_no_decode_steps():
    out = serving.serve_request("lab-tiny", 32, 1, batch=2, device="cpu")
    assert out["itl_s"] is None and out["decode_s"] < out["prefill_s"] + 0.05


@pytest.mark.parametrize("bad", [dict(prompt_tokens=0), dict(output_tokens=-1), dict(batch=1.5)])
def test_bad_shapes_are_refused(bad):
    with pytest.raises(LabError):
        serving.serve_request(**{"model": "lab-tiny", "prompt_tokens": 8, "output_tokens": 2, **bad})


def test_shapes_served_in_turns_share_a_slow_spell(monkeypatch):
    """Two identical shapes, and the memory slow (decode twice as long) for the first six
    requests: served one shape after the other, the first would be timed inside the spell and
    confirmed there, the second after it, and their shares would differ. In turns both see the
    spell and both see its end, so both report the same split."""
    from labkit import timing
    clock = {"now": 0.0, "requests": 0}
    monkeypatch.setattr(timing.time, "perf_counter", lambda: clock["now"])

    def served(model, prompt_tokens, output_tokens, batch, device):
        decode_s = 0.1 * (2 if clock["requests"] < 6 else 1)
        clock["requests"] += 1
        clock["now"] += 0.1 + decode_s
        return {"model": model, "device": "cpu", "device_name": "a CPU", "prompt_tokens": prompt_tokens,
                "output_tokens": output_tokens, "batch": batch, "prefill_s": 0.1, "decode_s": decode_s}

    monkeypatch.setattr(serving, "serve_request", served)
    done = []
    shape = {"prompt_tokens": 100, "output_tokens": 10}
    first, second = serving.serve_shapes("lab-tiny", [shape, shape], "cpu", lambda d, t: done.append((d, t)))
    assert first["decode_s"] == second["decode_s"] == pytest.approx(0.1)
    assert first["prefill_share"] == second["prefill_share"] == pytest.approx(0.5)
    assert not first["noisy"] and not second["noisy"] and first["itl_s"] == pytest.approx(0.1 / 9)
    assert first["prefill_share_range"] == pytest.approx((0.5, 0.5))  # fastest and second fastest agree
    assert done[-1] == (2, 2) and all(d <= t == 2 for d, t in done)


def test_a_share_s_range_runs_from_fastest_to_second_fastest_calls():
    from labkit.timing import Timing
    low, high = serving.share_range(Timing((0.1, 0.3, 0.12)), Timing((0.5, 0.4, 0.9)))
    assert low == pytest.approx(0.1 / (0.1 + 0.5)) and high == pytest.approx(0.12 / (0.12 + 0.4))
    assert serving.share_range(Timing((0.2,)), Timing((0.2,))) == (0.5, 0.5)  # one call: no range


def test_shared_serving_serves_once_for_two_readers_and_again_for_a_reader_that_asks_twice(monkeypatch):
    """Lesson 07's reveal and chart read one serving (the same runs, one wait); a reader that asks
    a second time (a cell run again) gets a new serving, which the other reader then shows."""
    calls = []

    def served(model, shapes, device, progress, batch):
        calls.append((model, len(shapes), device, batch))
        if progress:
            progress(len(shapes), len(shapes))
        return [{"serving": len(calls)}]

    monkeypatch.setattr(serving, "serve_shapes", served)
    shared = serving.SharedServing("lab-tiny", [{"prompt_tokens": 8, "output_tokens": 2}], "cpu")
    done = []
    assert shared.read("reveal") == [{"serving": 1}]
    assert shared.read("chart", lambda d, t: done.append((d, t))) == [{"serving": 1}]  # the reveal's runs
    assert done == [(1, 1)] and shared.servings == 1  # the bar completes at once
    assert shared.read("chart") == [{"serving": 2}]  # run again: measured again
    assert shared.read("reveal") == [{"serving": 2}]  # and the answer follows the chart's new runs
    assert calls == [("lab-tiny", 1, "cpu", 1)] * 2
