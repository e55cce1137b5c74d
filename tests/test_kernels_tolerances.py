"""kernels.tolerances: the one table the kernel tests and the GPU check read, pinned to the values
both used before they shared it."""
import pytest

from kernels import tolerances as t


def test_float_tolerances_by_dtype():
    assert t.float_tolerance("fp32") == (1e-4, 1e-4)
    assert t.float_tolerance("fp16") == (2e-3, 2e-3)
    assert t.float_tolerance("bf16") == (1.6e-2, 1.6e-2)


@pytest.mark.parametrize("q, cache, expected", [
    ("fp16", "fp16", (2e-3, 2e-3)), ("fp16", "fp32", (2e-3, 2e-3)),  # float caches: q's own entry
    ("fp16", "int8", (5e-3, 5e-3)), ("fp16", "fp8", (5e-3, 5e-3)),  # quantised: widened
    ("bf16", "int8", (1.6e-2, 1.6e-2)),  # bf16's own entry is already wider
    ("fp32", "int8", (1e-4, 1e-4)),  # fp32 q: p @ V stays in fp32
])
def test_decode_attention_tolerance(q, cache, expected):
    assert t.decode_attention_tolerance(q, cache) == expected


def test_quantiser_code_tolerances():
    assert t.kv_quant_code_tolerance("int8", compiled=False) == (0.0, 0.0)
    assert t.kv_quant_code_tolerance("int8", compiled=True) == (1.0, 0.0)
    assert t.kv_quant_code_tolerance("fp8", compiled=True) == (2 ** -9, 2 ** -3)
    assert t.INT8_SCALES == (0.0, 1e-6)
    with pytest.raises(ValueError, match="expected int8 or fp8"):
        t.kv_quant_code_tolerance("bf16", compiled=True)
