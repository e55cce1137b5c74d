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
