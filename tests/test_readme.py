"""Numbers the README states are computed by labkit."""
from pathlib import Path

from labkit import roofline
from labkit.sizes import lab_settings
from labkit.specs import get_model

README = (Path(__file__).parent.parent / "README.md").read_text()


def test_workshop_cache_figure_is_labkit_s():
    cpu = lab_settings("cpu")
    batch, context = cpu["batch"][1], cpu["context"][1]
    cache = roofline.kv_cache_bytes(get_model(cpu["model"]), context, batch, cpu["cache_dtype"])
    assert f"batch {batch} ×\n  {context:,} tokens" in README or f"batch {batch} × {context:,} tokens" in README
    assert f"adds {cache / 1e9:.1f} GB of KV cache" in README


def test_every_command_line_in_the_readme_parses():
    """Each `python -m labkit ...` line of the README is accepted by the CLI's parser as written
    (parsed, not run): a renamed flag fails here before a reader meets it."""
    import shlex

    from labkit import cli
    lines = [line.split("#", 1)[0].strip() for line in README.splitlines()
             if line.startswith("python -m labkit ")]
    assert len(lines) >= 8, lines
    for line in lines:
        cli.build_parser().parse_args(shlex.split(line)[3:])  # exits (SystemExit 2) on a bad flag


def test_the_timing_figures_are_labkit_s():
    from labkit import sweeps, timing
    assert f"within {timing.CONFIRM_TOLERANCE:.0%}".replace("%", " %") in README
    assert f"in about {sweeps.CPU_BUDGET_S:.0f} s and at most {sweeps.CPU_MAX_BUDGET_S:.0f} s a pass" in README
    assert f"for about {sweeps.CPU_BUDGET_S:.0f} s (up to {sweeps.CPU_MAX_BUDGET_S:.0f} s a pass while the machine is busy)" in README
    # a disturbed point: a quiet wait, a pass, another wait and another pass
    assert f"at most about {2 * (timing.QUIET_WAIT_S + sweeps.CPU_MAX_BUDGET_S):.0f} s" in README
    assert "for the next minute" in README and timing.QUIET_RETRY_AFTER_S == 60
    assert f"past {timing.OTHERS_BUSY_LIMIT:.0%}".replace("%", " %") in README
    assert f"(waiting up to {timing.QUIET_WAIT_S:.0f} s)" in README


def test_the_calibration_figures_are_labkit_s():
    from labkit import calibrate
    assert (f"from {calibrate.SMALLEST_WORKING_SET // 2**20} MiB to\n{calibrate.WORKING_SET_FACTOR}× the last-level cache"
            in README)


def test_the_cpu_prefill_growth_the_readme_names_is_labkit_s():
    from labkit.model import CPU_PREFILL_GROWTH
    flowed = " ".join(README.split())  # as a reader reads it, whatever the line breaks
    assert f"on the CPU at {CPU_PREFILL_GROWTH:g} times what `labkit.roofline.activation_bytes` counts" in flowed


def test_the_memory_the_readme_says_the_cpu_keeps_back_and_an_import_takes_is_labkit_s():
    from labkit.backend import CPU_WORKING_BYTES
    from labkit.import_room import IMPORT_BYTES
    from labkit.units import format_bytes
    flowed = " ".join(README.split())
    assert f"every check on the CPU keeps {format_bytes(CPU_WORKING_BYTES)} back for what no footprint counts" in flowed
    assert f"(loading it takes about {format_bytes(IMPORT_BYTES)}, `labkit.import_room`)" in flowed
