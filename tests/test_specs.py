"""Specs: every number has a source, unknown names list the known ones, config.json is read offline."""
import dataclasses
import json

import pytest

from labkit import roofline as r
from labkit.specs import GPUS, MODELS, SpecError, get_gpu, get_model, model_from_config

# memory_name is a word, not a number; bandwidth_by_working_set is a calibration's, empty on a datasheet.
NUMERIC_GPU_FIELDS = [f.name for f in dataclasses.fields(GPUS["H100-SXM"])
                      if f.name not in ("name", "sources", "kind", "memory_name", "bandwidth_by_working_set")]


@pytest.mark.parametrize("name", list(GPUS))
def test_every_gpu_number_has_a_source(name):
    gpu = GPUS[name]
    for field in NUMERIC_GPU_FIELDS:
        assert gpu.sources.get(field), f"{name}.{field} has no source"


@pytest.mark.parametrize("name", list(MODELS))
def test_every_model_has_a_source_and_consistent_heads(name):
    model = MODELS[name]
    assert model.source
    assert model.n_heads % model.n_kv_heads == 0


def test_published_parameter_counts():
    # Totals as Meta publishes them (safetensors index "total_size" / 2 bytes for bf16).
    assert r.param_count(get_model("llama-3.1-70b")) == 70_553_706_496
    assert r.param_count(get_model("llama-3.1-405b")) == 405_853_388_800
    assert r.param_count(get_model("llama-3.2-1b")) == 1_235_814_400
    assert r.param_count(get_model("llama-3.2-3b")) == 3_212_749_824


def test_names_are_case_insensitive():
    assert get_gpu("h200") is GPUS["H200"]
    assert get_model("LLAMA-3.1-8B") is MODELS["llama-3.1-8b"]


def test_unknown_names_list_the_known_ones():
    with pytest.raises(SpecError, match="known: H100-SXM"):
        get_gpu("B200")
    with pytest.raises(SpecError, match="llama-3.1-8b"):
        get_model("gpt-5")


def test_missing_peak_is_an_error_not_a_guess():
    with pytest.raises(SpecError, match="no fp8"):
        get_gpu("A100-80GB").peak_flops_per_s("fp8")
    with pytest.raises(SpecError, match="unknown dtype"):
        get_gpu("H100-SXM").peak_flops_per_s("fp4")


def _write(tmp_path, content):
    path = tmp_path / "config.json"
    path.write_text(content if isinstance(content, str) else json.dumps(content))
    return path


def test_hf_config_round_trip(tmp_path):
    config = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "intermediate_size": 14336, "vocab_size": 128256,
              "rope_theta": 500000.0, "tie_word_embeddings": False}
    model = get_model(str(_write(tmp_path, config)))
    assert r.param_count(model) == r.param_count(get_model("llama-3.1-8b"))
    assert model.head_dim == 128


@pytest.mark.parametrize("content,message", [
    ("{not json", "not readable JSON"),
    ("[1, 2]", "must hold a JSON object"),
    ({"hidden_size": 64}, "lacks num_hidden_layers"),
    ({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 3, "num_key_value_heads": 2,
      "intermediate_size": 8, "vocab_size": 10}, "multiple of num_key_value_heads"),
    ({"hidden_size": "64", "num_hidden_layers": 2, "num_attention_heads": 4,
      "intermediate_size": 8, "vocab_size": 10}, "positive integers"),
    ({"hidden_size": 64, "num_hidden_layers": -1, "num_attention_heads": 4,
      "intermediate_size": 8, "vocab_size": 10}, "num_hidden_layers must be a positive integer"),
    # the key named as the file names it (it said n_layers), and a float is not an integer
    ({"hidden_size": 64, "num_hidden_layers": 4.0, "num_attention_heads": 4,
      "intermediate_size": 8, "vocab_size": 10}, "num_hidden_layers must be a positive integer.*got 4.0"),
    # a null or a list failed with "float() argument must be ..." naming no key; NaN and inf were taken
    *[({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 8,
        "vocab_size": 10, key: value}, f"{key} must be a finite positive number")
      for key, value in (("rope_theta", None), ("rope_theta", [1]), ("rope_theta", float("nan")),
                         ("rms_norm_eps", float("inf")), ("rms_norm_eps", 0))],
])
def test_malformed_config_gives_a_clear_error(tmp_path, content, message):
    with pytest.raises(SpecError, match=message):
        model_from_config(_write(tmp_path, content))


def test_missing_config_file(tmp_path):
    with pytest.raises(SpecError, match="not found"):
        get_model(str(tmp_path / "nope.json"))


@pytest.mark.parametrize("name, preset", [
    ("NVIDIA H100 80GB HBM3", "H100-SXM"), ("NVIDIA H100 PCIe", "H100-PCIe"), ("NVIDIA H200", "H200"),
    ("NVIDIA H100 NVL", None), ("NVIDIA H200 NVL", None), ("NVIDIA GH200 480GB", None),
    ("NVIDIA L40S", None), ("NVIDIA L4", "L4"), ("NVIDIA A100-SXM4-80GB", "A100-80GB"),
    ("NVIDIA A100-SXM4-40GB", "A100-40GB"), ("Tesla T4", "T4"), ("NVIDIA GeForce RTX 4090", "RTX-4090"),
    ("NVIDIA B200", None), ("", None),
])
def test_a_device_name_finds_its_preset_or_none(name, preset):
    from labkit.specs import preset_for_device_name
    spec = preset_for_device_name(name)
    assert (spec.name if spec else None) == preset


def test_every_device_name_pattern_names_a_preset():
    from labkit.specs import PRESET_BY_DEVICE_NAME
    assert {preset for _, preset in PRESET_BY_DEVICE_NAME} <= set(GPUS)


def test_each_gpu_preset_has_its_l2_with_a_source_or_says_it_has_none():
    """The GPU check flags timings whose working set could stay in L2: it needs the L2 of the
    preset (from a whitepaper) or, where no document states it, the device's own figure."""
    from labkit.specs import GPU_L2_BYTES, L2_UNKNOWN, l2_bytes_of
    assert l2_bytes_of(get_gpu("H100-SXM")) == 50 * 2**20 and "whitepaper" in get_gpu("H100-SXM").sources["cache_levels"]
    assert l2_bytes_of(get_gpu("A100-80GB")) == 40 * 2**20
    for name, gpu in GPUS.items():
        assert (l2_bytes_of(gpu) is None) == (name not in GPU_L2_BYTES), name
        assert gpu.sources["cache_levels"] == (GPU_L2_BYTES[name][1] if name in GPU_L2_BYTES else L2_UNKNOWN)
        assert gpu.memory_name in ("HBM", "GDDR6", "GDDR6X") and gpu.bandwidth_by_working_set == ()


def test_a_spec_read_back_from_json_keeps_tuples():
    spec = dataclasses.replace(get_gpu("H100-SXM"), bandwidth_by_working_set=[[2**20, 5e12], [2**30, 3e12]])
    assert spec.bandwidth_by_working_set == ((2**20, 5e12), (2**30, 3e12)) and hash(spec)


def test_a_configs_name_that_is_not_a_string_falls_back_to_the_file_name(tmp_path):
    """`_name_or_path: {"a": 1}` became the model name "{'a': 1}"."""
    config = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 8,
              "vocab_size": 10, "_name_or_path": {"a": 1}}
    assert model_from_config(_write(tmp_path, config)).name == "config"
