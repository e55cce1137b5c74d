"""Numbers the README states are computed by labkit."""
from pathlib import Path

from labkit import roofline
from labkit.explore import lab_settings
from labkit.specs import get_model

README = (Path(__file__).parent.parent / "README.md").read_text()


def test_workshop_cache_figure_is_labkit_s():
    cpu = lab_settings("cpu")
    batch, context = cpu["batch"][1], cpu["context"][1]
    cache = roofline.kv_cache_bytes(get_model(cpu["model"]), context, batch, cpu["cache_dtype"])
    assert f"batch {batch} ×\n  {context:,} tokens" in README or f"batch {batch} × {context:,} tokens" in README
    assert f"adds {cache / 1e9:.1f} GB of KV cache" in README
