"""labkit.sizes: the cache dtypes each device's lab offers, and why the CPU's offers no fp8 (its
figures pinned to the recording they quote)."""
import json
import re
from pathlib import Path

import pytest

from labkit import dtypes, sizes
from labkit.errors import LabError

ROOT = Path(__file__).resolve().parent.parent


def test_every_offered_dtype_is_a_cache_dtype_and_none_is_both_offered_and_refused():
    for device, offered in sizes.CACHE_DTYPES.items():
        assert set(offered) <= set(dtypes.CACHE_DTYPES), device
        assert not set(offered) & set(sizes.NOT_OFFERED.get(device, {})), device
    assert "fp8" in sizes.CACHE_DTYPES["cuda"] and "fp8" not in sizes.CACHE_DTYPES["cpu"]


def test_a_dtype_not_offered_is_refused_saying_why_and_what_is():
    with pytest.raises(LabError, match=r"the CPU path offers no fp8 KV cache.*offered here: fp32, bf16, int8"):
        sizes.check_offered("cpu", "fp8")
    for device, offered in sizes.CACHE_DTYPES.items():
        for cache_dtype in offered:
            sizes.check_offered(device, cache_dtype)  # no error


def test_the_fp8_reason_quotes_its_recording():
    """The figures in the CPU's fp8 reason are bench-cpu-15's: the fp8 point's bracketed roof
    fraction and its step time over fp32's, measured and predicted, to two places."""
    why = sizes.NOT_OFFERED["cpu"]["fp8"]
    path = re.search(r"data/recordings/[\w.-]+\.json", why).group(0)
    recording = json.loads((ROOT / path).read_text())
    fp8 = next(row for row in recording["tables"]["cache_dtype"] if row["point"].endswith("cache fp8"))
    ratio = recording["ratios"]["step_fp8_over_fp32"]
    assert fp8["point"].startswith("decode B=16, S=4,096") and "B = 16, S = 4,096" in why
    assert f"{fp8['bracketed_roof_fraction']:.2f} of its roof" in why
    assert f"a step {ratio['measured']:.2f} of fp32's where the roofline predicts {ratio['predicted']:.2f}" in why
    assert recording["provenance"]["device_name"].startswith("Intel(R) Xeon") and recording["provenance"]["threads"] == 2
