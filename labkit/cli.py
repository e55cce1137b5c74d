"""`python -m labkit`: the roofline's predictions, the presets, calibration and real runs.

    python -m labkit predict prefill --model llama-3.1-8b --gpu H100-SXM --prompt 2000 --json
    python -m labkit predict decode --gpu H200 --context 8192 --batch 64 --cache-dtype fp8
    python -m labkit gpus | models | calibrate [--refresh] | measure prefill|decode [--bracket] | bench
    python -m labkit breakdown prefill|decode [--prompt P | --batch B --context S --cache-dtype D] [--json]
    python -m labkit estimates [--room JOURNAL ...] [--json]   the kept "Predict first" answers

Every number comes from `labkit.roofline` (predict), `labkit.calibrate` or `labkit.sweeps`
(measure); this module only parses, validates and prints: rates and times as labkit.units writes
them for the charts too, arguments through labkit.cli_args (shared with the GPU check). `--json`
prints one JSON object on one line, SI units, units in the keys. Bad input prints one line on
stderr and exits with 2.
torch is imported only by the commands that need it, so `predict` answers without loading it.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import warnings
from pathlib import Path

from . import estimates, roofline, sizes
from .cli_args import Parser, UsageError
from .errors import LabError, SpecError
from .specs import DTYPES, GPUS, MODELS, get_gpu, get_model
from .units import format_bytes, format_rate, format_seconds

MAX_BATCH = 4096
COUNTINGS = {"chapter": roofline.CHAPTER, "kernel": roofline.KERNEL}
DEFAULT_TOKENS = 2000  # predict's --prompt and --context: the chapter's chat-length prompt
MIN_EFFICIENCY = 0.01  # --mfu, --bandwidth-efficiency: below 1 % a prediction is no longer a plan
THIS = "this"  # --gpu this: the calibrated roofline of this machine


# ---------------------------------------------------------------- predict
def predict_prefill(args) -> dict:
    """Prefill of `batch` prompts of `prompt` tokens: FLOPs, bytes, time, bound."""
    _only_for("prefill", args)
    model, counting = get_model(args.model), COUNTINGS[args.counting]
    args.prompt = DEFAULT_TOKENS if args.prompt is None else args.prompt
    _in_range("--prompt", args.prompt, 1, model.max_context, model.name)
    _in_range("--batch", args.batch, 1, MAX_BATCH)
    _efficiencies(args)
    hardware, dtypes = _hardware(args)
    p, b = args.prompt, args.batch
    flops = roofline.prefill_flops(model, p, b, counting)
    bytes_moved = roofline.prefill_bytes(model, p, b, dtypes["weight"], dtypes["cache"])
    time_s = _time_s(flops, bytes_moved, hardware, dtypes["compute"], args)
    footprint = roofline.memory_footprint_bytes(model, b, p, dtypes["weight"], dtypes["cache"])
    return {**_header(args, model, hardware, dtypes), "prompt_tokens": p, "batch": b,
            "linear_flops": roofline.prefill_linear_flops(model, p, b, counting.params),
            "attention_flops": roofline.prefill_attention_flops(model, p, b, counting.attention),
            "flops": flops, "attention_share": roofline.attention_share(model, p, counting),
            "crossover_tokens": roofline.crossover_tokens(model, counting),
            "bytes_moved": bytes_moved, "kv_cache_bytes": roofline.kv_cache_bytes(model, p, b, dtypes["cache"]),
            **_roof(flops, bytes_moved, hardware, dtypes["compute"]),
            **time_s, "tokens_per_s": p * b / time_s["time_s"],
            "memory_footprint_bytes": footprint, "memory_bytes": hardware.memory_bytes,
            "fits_in_memory": footprint <= hardware.memory_bytes}


def predict_decode(args) -> dict:
    """One decode step of `batch` sequences with `context` cached tokens each."""
    _only_for("decode", args)
    model, counting = get_model(args.model), COUNTINGS[args.counting]
    args.context = DEFAULT_TOKENS if args.context is None else args.context
    _in_range("--context", args.context, 0, model.max_context, model.name)
    _in_range("--batch", args.batch, 1, MAX_BATCH)
    _efficiencies(args)
    hardware, dtypes = _hardware(args)
    b, s, weight, cache = args.batch, args.context, dtypes["weight"], dtypes["cache"]
    flops = roofline.decode_flops_per_step(model, b, s, counting)
    bytes_moved = roofline.decode_bytes_per_step(model, b, s, weight, cache, counting.params)
    share = roofline.cache_share(model, b, s, weight, cache, counting.params)
    step = _time_s(flops, bytes_moved, hardware, dtypes["compute"], args)
    per_sequence = roofline.tokens_per_s_per_sequence(step["time_s"])
    footprint = roofline.memory_footprint_bytes(model, b, s, weight, cache)
    return {**_header(args, model, hardware, dtypes), "context_tokens": s, "batch": b,
            "kv_bytes_per_token": roofline.kv_bytes_per_token(model, cache),
            "weight_bytes": roofline.weight_bytes(model, weight, counting.params),
            "kv_cache_bytes": roofline.kv_cache_bytes(model, s, b, cache), "bytes_per_step": bytes_moved,
            "flops_per_step": flops, "cache_share": share, "regime": roofline.decode_regime(share),
            **_roof(flops, bytes_moved, hardware, dtypes["compute"]),
            "time_per_step_s": step["time_s"], "compute_time_s": step["compute_time_s"],
            "memory_time_s": step["memory_time_s"], "tokens_per_s_per_sequence": per_sequence,
            "tokens_per_s": per_sequence * b,
            "compute_bound_batch": roofline.decode_compute_bound_batch(
                model, hardware, s, weight, cache, dtypes["compute"], counting),
            "memory_footprint_bytes": footprint, "memory_bytes": hardware.memory_bytes,
            "fits_in_memory": footprint <= hardware.memory_bytes}


def _hardware(args):
    """The GPU preset, or this machine's calibrated roofline; and the dtypes to use on it.
    Dtypes left unset are bf16 on a preset and the backend's compute dtype on `this`
    (fp32 on the CPU, where bf16 matmuls crawl)."""
    if args.gpu.lower() != THIS:
        hardware, default = get_gpu(args.gpu), "bf16"
    else:
        from . import backend, calibrate  # imports torch
        here = backend.choose_device()
        hardware, _ = calibrate.load_or_calibrate(here.device, log=_stderr)
        default = here.compute_dtype
    dtypes = {"weight": args.weight_dtype or default, "cache": args.cache_dtype or default,
              "compute": args.compute_dtype or default}
    try:
        hardware.peak_flops_per_s(dtypes["compute"])  # fail early if the chip has no such path
    except SpecError as err:
        raise SpecError(f"{err}; choose another --compute-dtype") from None
    return hardware, dtypes


def _header(args, model, hardware, dtypes) -> dict:
    counting = COUNTINGS[args.counting]
    return {"model": model.name, "gpu": hardware.name, "gpu_kind": hardware.kind,
            "counting": args.counting, "attention_counting": counting.attention,
            "params_counting": counting.params, "weight_dtype": dtypes["weight"],
            "cache_dtype": dtypes["cache"], "compute_dtype": dtypes["compute"],
            "mfu": args.mfu, "bandwidth_efficiency": args.bandwidth_efficiency}


def _roof(flops, bytes_moved, hardware, dtype) -> dict:
    return {"intensity_flops_per_byte": roofline.intensity_flops_per_byte(flops, bytes_moved),
            "ridge_point_flops_per_byte": roofline.ridge_point_flops_per_byte(hardware, dtype),
            "bound": roofline.bound_by(flops, bytes_moved, hardware, dtype)}


def _time_s(flops, bytes_moved, hardware, dtype, args) -> dict:
    return {"time_s": roofline.roofline_time_s(flops, bytes_moved, hardware, dtype, args.mfu,
                                               args.bandwidth_efficiency),
            "compute_time_s": roofline.compute_time_s(flops, hardware, dtype, args.mfu),
            "memory_time_s": roofline.memory_time_s(bytes_moved, hardware, args.bandwidth_efficiency)}


def _in_range(flag: str, value: int, low: int, high: int, model_name: str | None = None):
    if not low <= value <= high:
        limit = f" (the max context of {model_name})" if model_name else ""
        shown = f"{value:,}" if abs(value) < 10**30 else f"a number of {len(str(abs(value))):,} digits"
        raise SpecError(f"{flag} must be in {low:,}..{high:,}{limit}, got {shown}")


def _efficiencies(args):
    """--mfu and --bandwidth-efficiency, checked before anything is measured or calibrated."""
    for flag, value in (("--mfu", args.mfu), ("--bandwidth-efficiency", args.bandwidth_efficiency)):
        if not MIN_EFFICIENCY <= value <= 1:  # (NaN fails too)
            raise SpecError(f"{flag} must be in {MIN_EFFICIENCY}..1 (a fraction of the roof), got {value}")


# Flags that belong to one phase: given to the other, they would be accepted and silently ignored.
PHASE_FLAGS = {"prompt": ("--prompt", "prefill", "the prompt's tokens"),
               "context": ("--context", "decode", "the tokens each sequence has cached")}


def _only_for(phase: str, args):
    """Refuse a flag given for the other phase (`PHASE_FLAGS`)."""
    for name, (flag, belongs, what) in PHASE_FLAGS.items():
        if belongs != phase and getattr(args, name, None) is not None:
            raise SpecError(f"{flag} ({what}) applies to {belongs}, not to {phase}")


def _weights_fit(model, here):
    """Refuse, before a calibration or a model is built, a model whose weights alone do not fit."""
    from .model import check_weights_fit  # imports torch, as measure and breakdown do anyway
    check_weights_fit(model, here.compute_dtype, here.device)


# ---------------------------------------------------------------- presets, calibrate, measure
def list_gpus(args) -> dict:
    rows = []
    for spec in GPUS.values():
        peaks = {f: getattr(spec, f) for f in ("bf16_flops_per_s", "fp16_flops_per_s", "fp8_flops_per_s",
                                               "int8_ops_per_s", "fp32_flops_per_s")}
        ridge = roofline.ridge_point_flops_per_byte(spec) if spec.bf16_flops_per_s else None
        rows.append({"name": spec.name, **peaks, "memory_bandwidth_bytes_per_s": spec.memory_bandwidth_bytes_per_s,
                     "memory_bytes": spec.memory_bytes, "ridge_point_bf16_flops_per_byte": ridge,
                     "sources": dict(spec.sources)})
    return {"gpus": rows}


def list_models(args) -> dict:
    rows = []
    for spec in MODELS.values():
        rows.append({"name": spec.name, "params": roofline.param_count(spec), "n_layers": spec.n_layers,
                     "hidden_size": spec.hidden_size, "n_heads": spec.n_heads, "n_kv_heads": spec.n_kv_heads,
                     "head_dim": spec.head_dim, "intermediate_size": spec.intermediate_size,
                     "vocab_size": spec.vocab_size, "max_context": spec.max_context,
                     "weight_bf16_bytes": roofline.weight_bytes(spec, "bf16"),
                     "kv_bf16_bytes_per_token": roofline.kv_bytes_per_token(spec, "bf16"),
                     "crossover_tokens_chapter": roofline.crossover_tokens(spec), "source": spec.source})
    return {"models": rows}


def run_calibrate(args) -> dict:
    from . import backend, calibrate  # imports torch
    here = backend.choose_device(args.device)
    spec, info = calibrate.load_or_calibrate(here.device, refresh=args.refresh, log=_stderr)
    fields = ("bf16_flops_per_s", "fp16_flops_per_s", "fp8_flops_per_s", "int8_ops_per_s",
              "fp32_flops_per_s", "memory_bandwidth_bytes_per_s", "memory_bytes")
    return {"device": here.device, "name": spec.name, **{f: getattr(spec, f) for f in fields},
            "copy_bytes_per_s": info["bandwidth"]["copy"]["bytes_per_s"],
            "read_bytes_per_s": info["bandwidth"]["read"]["bytes_per_s"],
            "ridge_point_flops_per_byte": roofline.ridge_point_flops_per_byte(spec, here.compute_dtype),
            "compute_dtype": here.compute_dtype, "elapsed_s": info["elapsed_s"], "date": info["date"],
            "bandwidth_by_working_set": [{"bytes": b, "bytes_per_s": rate} for b, rate in spec.bandwidth_by_working_set],
            "cache_levels": [{"name": name, "bytes": size} for name, size in spec.cache_levels],
            "memory_name": spec.memory_name, "tier_edges": info.get("tier_edges", []),
            "noisy": info.get("noisy", []), "cache_file": info["cache_file"], "cache_status": info["cache_status"],
            "provenance": info}


def _as_root(args) -> str:
    """This --room command for a root shell to expand, to paste: with this Python (sudo's `python`
    is root's, without the lab), -B (root writes no __pycache__ into the lab), the patterns as typed
    (unquoted: root's shell expands them) and --json if asked."""
    command = f"{shlex.quote(sys.executable)} -B -m labkit estimates --room {' '.join(args.room)}"
    return f"sudo sh -c '{command}{' --json' if args.json else ''}'"


def list_estimates(args) -> dict:
    """The learner's kept "Predict first" answers (`labkit.estimates`), oldest first; with --room,
    a workshop room's first answers question by question, from each learner's journal."""
    if args.room:
        journals = []
        for name in args.room:
            path = Path(name)
            try:
                found = path.is_file()
            except OSError as err:  # a home the caller may not enter
                raise UsageError(f"--room: cannot read {name}: {err.strerror or err}") from None
            if not found and any(c in name for c in "*?["):  # the shell left the pattern as typed
                raise UsageError(f"--room: {name} matched no journal; learners' homes are often closed to "
                                 f"other users: let a root shell expand it, {_as_root(args)}")
            if not found:
                raise UsageError(f"--room: no journal at {name} (a learner's ~/.local/share/labkit/estimates.jsonl)")
            journals.append(estimates.read(path))
        return {"journals": len(journals), "unreadable_lines": sum(unreadable for _, unreadable in journals),
                "questions": estimates.room([entries for entries, _ in journals])}
    entries, unreadable = estimates.read()
    return {"journal": str(estimates.journal_path()), "estimates": estimates.kept_rows(entries),
            "unreadable_lines": unreadable}


def run_measure(args) -> dict:
    """One real prefill or decode on this machine, through labkit.sweeps, with its prediction."""
    from . import backend, explore, sizes  # backend imports torch
    here = backend.choose_device(args.device)
    settings = sizes.lab_settings(here.device)
    model = get_model(args.model or settings["model"])
    _only_for(args.phase, args)
    if args.phase == "prefill" and args.cache_dtype is not None:
        raise SpecError("--cache-dtype applies to decode: measure prefill writes its cache in the compute dtype")
    batch = settings["batch"][3] if args.batch is None else args.batch
    _in_range("--batch", batch, 1, MAX_BATCH)
    _weights_fit(model, here)
    try:
        from . import sweeps  # the model and its kernels: only `measure` needs them
    except ModuleNotFoundError as err:
        if err.name != f"{__package__}.sweeps":
            raise
        raise LabError("measure needs labkit.sweeps, which this installation lacks") from None
    if args.phase == "prefill":
        prompt = settings["prompt"][3] if args.prompt is None else args.prompt
        _in_range("--prompt", prompt, 1, model.max_context, model.name)
        run = lambda: sweeps.measure_prefill(model, prompt, batch, here.device)  # noqa: E731
        working_set = lambda: sweeps.prefill_working_set_bytes(model, prompt, batch, here.device)  # noqa: E731
    else:
        context = settings["context"][3] if args.context is None else args.context
        _in_range("--context", context, 0, model.max_context, model.name)
        cache_dtype = args.cache_dtype or settings["cache_dtype"]
        run = lambda: sweeps.measure_decode(model, batch, context, cache_dtype, here.device)  # noqa: E731
        working_set = lambda: sweeps.decode_working_set_bytes(model, batch, context, cache_dtype, here.device)  # noqa: E731
    # --bracket: the bandwidth read just before and after, at the working set the point reads
    point = sweeps.bracketed(run, here.device, working_set()) if args.bracket else run()
    for note in explore.point_notes(point):
        _stderr(f"labkit: note: {note}")
    return point


def run_breakdown(args) -> dict:
    """One real step timed whole and in parts on this machine (labkit.breakdown): products,
    attention, everything else and overhead, each beside its roof, and where the step's fraction
    of peak (prefill) or of bandwidth (decode) comes from."""
    from . import backend, explore, sizes  # backend imports torch
    here = backend.choose_device(args.device)
    settings = sizes.lab_settings(here.device)
    model = get_model(args.model or settings["model"])
    _only_for(args.phase, args)
    batch = settings["batch"][3] if args.batch is None else args.batch
    _in_range("--batch", batch, 1, MAX_BATCH)
    _weights_fit(model, here)
    from . import breakdown  # the model and its kernels: only `breakdown` and `measure` need them
    if args.phase == "prefill":
        prompt = settings["prompt"][3] if args.prompt is None else args.prompt
        _in_range("--prompt", prompt, 1, model.max_context, model.name)
        result = breakdown.prefill_breakdown(model, prompt, batch, here.device, args.cache_dtype)
    else:
        context = settings["context"][3] if args.context is None else args.context
        _in_range("--context", context, 0, model.max_context, model.name)
        result = breakdown.decode_breakdown(model, batch, context, args.cache_dtype or settings["cache_dtype"],
                                            here.device)
    return {**result, "summary": explore.breakdown_line(result)}


def run_bench(args) -> dict:
    """`make bench`: issue 13's tables, each point bracketed, written as one recording (labkit.bench)."""
    from . import bench  # the model, torch and the calibration: only `bench` needs them
    _in_range("--rounds", args.rounds, 1, sizes.MAX_BENCH_ROUNDS)
    path, payload = bench.run_bench(args.device, args.out or bench.DEFAULT_OUT, args.model, log=_stderr,
                                    rounds=args.rounds)
    return {"recording": str(path), "device": payload["device"], "model": payload["model"], "rounds": payload["rounds"],
            "tables": payload["tables"], "ratios": payload["ratios"], "targets": payload["targets"], "load_average": payload["load_average"],
            "others_busy_share": payload["others_busy_share"]}


def _spread(fractions: list) -> str:
    """The lowest and highest of some fractions, as percentages: "45-67%", or "57%" where they
    round alike."""
    known = [f for f in fractions if f is not None]
    if not known:
        return "-"
    low, high = f"{min(known):.0%}", f"{max(known):.0%}"
    return low if low == high else f"{low[:-1]}-{high}"


def _moment_changes(changed: list) -> str:
    """" (1 of 3 changed)": how many rounds the memory changed speed during (`bench.moment_changed`)."""
    n = sum(1 for c in changed if c)
    return f" ({n} of {len(changed)} changed)" if n else ""


def _stderr(message: str):
    print(message, file=sys.stderr)


# ---------------------------------------------------------------- output
def _display(key: str, value) -> str:
    """A value in display units, chosen by the unit named in its key."""
    if value is None:
        return "—"
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, str):
        return value
    words = key.split("_")
    if key.endswith("_flops_per_byte"):
        return f"{value:,.1f} FLOP/byte"
    for rate, unit in (("_bytes_per_s", "B/s"), ("_flops_per_s", "FLOP/s"), ("_ops_per_s", "OP/s")):
        if key.endswith(rate):
            return format_rate(value, unit)
    if key.endswith("_per_s") or "_per_s_" in key:  # tokens per second (per sequence)
        return f"{value:,.1f}"
    if "bytes" in words:
        return _binary(value)
    if "flops" in words:
        return format_rate(value, "FLOP")
    if key.endswith("_s"):
        return format_seconds(value)
    if key.endswith(("share", "fraction")):
        return f"{value:.1%}"
    if isinstance(value, int) or abs(value) >= 1000:
        return f"{value:,.0f}"
    return f"{value:.4g}"


def _binary(value: float) -> str:
    return format_bytes(value, decimals=2)


def _label(key: str) -> str:
    """"time_per_step_s" -> "time per step": the unit is shown with the value instead."""
    for unit in ("_flops_per_byte", "_bytes", "_s"):
        if key.endswith(unit) and not key.endswith("_per_s"):
            key = key[: -len(unit)]
            break
    return key.replace("_", " ")


def _target_figures(target: dict) -> str:
    """A `bench.targets` entry's figures in one line: fractions, shares of the prediction (on the
    calibration, and on the brackets), or how far off the prediction each ratio is."""
    if "fractions" in target:
        ceilings = target.get("in_turn_ceilings", {})
        return ", ".join(f"{k} {v:.2f}" + (f" (in turn at most {ceilings[k]:.2f})" if ceilings.get(k, 1) < 0.995 else "")
                         for k, v in target["fractions"].items()) or "no point measured"
    if "of_predicted" in target:
        return ", ".join(f"{v:.2f} on the {'calibration' if k == 'predicted' else 'brackets'}"
                         for k, v in target["of_predicted"].items())
    return "; ".join(f"{name.removeprefix('step_').replace('_', ' ')} " + ", ".join(
        f"{v:+.0%} on the {'calibration' if k == 'predicted' else 'brackets'}" for k, v in off.items())
        for name, off in target["off_predicted"].items())


def _print_pairs(result: dict):
    scalars = {_label(k): (k, v) for k, v in result.items() if not isinstance(v, (dict, list))}
    width = max(map(len, scalars), default=0)
    for label, (key, value) in scalars.items():
        print(f"{label:<{width}}  {_display(key, value)}")


def _print_rows(rows: list[dict], columns: list[str]):
    cells = [[_display(c, row[c]) if c != "name" else row[c] for c in columns] for row in rows]
    header = [c.replace("_", " ") for c in columns]
    widths = [max(len(x) for x in col) for col in zip(header, *cells)]
    for line in (header, *cells):
        print("  ".join(cell.rjust(w) if i else cell.ljust(w) for i, (cell, w) in enumerate(zip(line, widths))))


def _print_human(command: str, result: dict):
    if command == "gpus":
        _print_rows(result["gpus"], ["name", "bf16_flops_per_s", "fp8_flops_per_s", "fp32_flops_per_s",
                                     "memory_bandwidth_bytes_per_s", "memory_bytes", "ridge_point_bf16_flops_per_byte"])
        sources = sorted({row["sources"]["bf16_flops_per_s"] for row in result["gpus"]})
        print("sources:\n  " + "\n  ".join(sources))
    elif command == "models":
        _print_rows(result["models"], ["name", "params", "n_layers", "hidden_size", "n_heads", "n_kv_heads",
                                       "max_context", "weight_bf16_bytes", "kv_bf16_bytes_per_token"])
        print("sources:\n  " + "\n  ".join(f"{r['name']}: {r['source']}" for r in result["models"]))
    elif command == "calibrate":
        _print_pairs(result)
        print("bandwidth roof by working set (the fastest of read, GEMV and copy):")
        _print_rows([{"working_set_bytes": p["bytes"], "roof_bytes_per_s": p["bytes_per_s"]}
                     for p in result["bandwidth_by_working_set"]], ["working_set_bytes", "roof_bytes_per_s"])
        for edge in result["tier_edges"]:
            print(f"{edge['label']} from ~{_binary(edge['bytes'])} (the OS reports a {_binary(edge['cache_bytes'])} {edge['from']})")
    elif command == "bench":
        columns = ("point", "time_s", "predicted_time_s", "tokens_per_s", "roof_fraction", "bracketed_roof_fraction",
                   "bracketed_rounds", "bracketed_in_turn_fraction", "roof_tier", "skipped")
        from .bench import NOISY_SPREAD  # timing's, through bench (loaded already: the bench ran)
        print(f"each point: its median of {result['rounds']} rounds; bracketed rounds: the lowest and highest "
              "bracketed roof fraction of its rounds (and how many of them the memory changed speed during: "
              f"its readings before and after more than {NOISY_SPREAD:.0%} apart); bracketed in turn: a decode "
              "step's fraction of the roof of its kernels one after another, each at its own roof, on the "
              "bracketed bandwidth")
        for name, rows in result["tables"].items():
            print(f"{name}:")
            rows = [{**r, "bracketed_rounds": _spread(r["rounds_bracketed_roof_fraction"])
                     + _moment_changes(r.get("rounds_moment_changed") or [])}
                    if r.get("rounds_bracketed_roof_fraction") else r for r in rows]
            shown = [c for c in columns if any(c in r for r in rows)]
            _print_rows([{c: r.get(c) for c in shown} for r in rows], shown)
        for name, ratio in result["ratios"].items():
            moment = (f", {ratio['predicted_bracketed']:.2f} on the points' bracketed roofs"
                      if "predicted_bracketed" in ratio else "")
            print(f"{name.replace('_', ' ')}: measured {ratio['measured']:.2f}, predicted {ratio['predicted']:.2f} "
                  f"on the calibration{moment}")
        print("issue 13's targets (a report: the bench itself passes or fails nothing):")
        for target in result["targets"].values():
            print(f"  {'met' if target['met'] else 'NOT met'}: {target['what']}: {_target_figures(target)}")
        print(f"recording: {result['recording']}")
    elif command == "estimates" and "questions" in result:  # --room
        print(f"{result['journals']:,} learners' journals; each learner's first answer to each question:")
        for line in estimates.room_lines(result["questions"]) or ["no answers in them yet"]:
            print(f"  {line}")
        if result["unreadable_lines"]:
            print(f"({result['unreadable_lines']:,} line(s) could not be read, left as they are)")
    elif command == "estimates":
        if result["estimates"]:
            _print_rows(result["estimates"], ["day", "compared", "yours", "formula", "lab_answer", "how", "yours_over_lab"])
        else:
            print("no estimates kept yet: commit one in a lesson's \"Predict first\" box")
        print(f"journal: {result['journal']}"
              + (f" ({result['unreadable_lines']} line(s) could not be read, left as they are)"
                 if result["unreadable_lines"] else ""))
    elif command == "breakdown":
        _print_rows(result["categories"], ["name", "time_s", "share", "roof_time_s", "roof_fraction", "flops",
                                           "bytes", "contributed_fraction"])
        if result.get("gpu_kernels"):  # CUDA: the kernels the parts are made of, the longest first
            _print_rows([{**k, "name": k["name"][:72]} for k in result["gpu_kernels"]],
                        ["name", "category", "time_s", "calls_per_step"])
        _print_pairs({k: v for k, v in result.items() if k != "summary"})
        print(result["summary"])
    else:
        _print_pairs(result)


# ---------------------------------------------------------------- the parser
def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="python -m labkit", description="Prefill vs decode: roofline predictions and measurements.")
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND", parser_class=Parser)
    predict = commands.add_parser("predict", help="the roofline's prediction for a prefill or a decode step")
    phases = predict.add_subparsers(dest="phase", required=True, metavar="PHASE", parser_class=Parser)
    for name, handler, help_text in (("prefill", predict_prefill, "one prefill pass"),
                                     ("decode", predict_decode, "one decode step")):
        sub = phases.add_parser(name, help=help_text)
        _add_predict_options(sub)
        sub.set_defaults(handler=handler)
    for name, handler, help_text in (("gpus", list_gpus, "GPU presets with key numbers and sources"),
                                     ("models", list_models, "model presets with key numbers and sources")):
        sub = commands.add_parser(name, help=help_text)
        sub.add_argument("--json", action="store_true", help="one JSON object on stdout")
        sub.set_defaults(handler=handler)
    kept = commands.add_parser("estimates", help="your committed \"Predict first\" answers, kept across sessions")
    kept.add_argument("--room", nargs="+", metavar="JOURNAL",
                      help="a workshop room's answers from learners' journals, e.g. "
                           "/home/*/.local/share/labkit/estimates.jsonl: each learner's first answer")
    kept.add_argument("--json", action="store_true", help="one JSON object on stdout")
    kept.set_defaults(handler=list_estimates)
    calibrate = commands.add_parser("calibrate", help="measure this machine's roofline (cached)")
    calibrate.add_argument("--refresh", action="store_true", help="measure again even if cached")
    calibrate.add_argument("--device", choices=("cpu", "cuda"), help="default: CUDA if present (or LABKIT_DEVICE)")
    calibrate.add_argument("--json", action="store_true", help="one JSON object on stdout")
    calibrate.set_defaults(handler=run_calibrate)
    measure = commands.add_parser("measure", help="a real prefill or decode on this machine")
    measure.add_argument("phase", choices=("prefill", "decode"))
    _add_measure_options(measure)
    measure.set_defaults(handler=run_measure)
    parts = commands.add_parser("breakdown", help="where one real step's time goes: products, attention, "
                                                  "everything else, overhead, each beside its roof (CPU)")
    parts.add_argument("phase", choices=("prefill", "decode"))
    _add_measure_options(parts, bracket=False)
    parts.set_defaults(handler=run_breakdown)
    bench = commands.add_parser("bench", help="issue 13's tables measured with the bracket, into one recording")
    bench.add_argument("--device", choices=("cpu", "cuda"), help="default: CUDA if present (or LABKIT_DEVICE)")
    bench.add_argument("--model", help="default: lab-cpu on the CPU, llama-3.1-8b on CUDA")
    bench.add_argument("--out", help="folder for the recording (default: data/recordings); never overwrites")
    bench.add_argument("--rounds", type=int, default=sizes.BENCH_ROUNDS,
                       help=f"times each table is measured, one whole pass after another, 1..{sizes.MAX_BENCH_ROUNDS} "
                            f"(default {sizes.BENCH_ROUNDS}); each point shows its median round")
    bench.add_argument("--json", action="store_true", help="one JSON object on stdout")
    bench.set_defaults(handler=run_bench)
    return parser


def _add_predict_options(sub):
    sub.add_argument("--model", default="llama-3.1-8b", help="preset name or path to a config.json")
    sub.add_argument("--gpu", default="H100-SXM", help=f"preset name, or '{THIS}' for this machine's calibrated roofline")
    sub.add_argument("--prompt", type=int, help=f"prompt tokens P (prefill; default {DEFAULT_TOKENS:,})")
    sub.add_argument("--context", type=int, help=f"cached tokens S per sequence (decode; default {DEFAULT_TOKENS:,})")
    sub.add_argument("--batch", type=int, default=1, help=f"sequences B, 1..{MAX_BATCH}")
    sub.add_argument("--weight-dtype", choices=DTYPES, help="default bf16 (this machine: its compute dtype)")
    sub.add_argument("--cache-dtype", choices=roofline.CACHE_DTYPES, help="default as --weight-dtype")
    sub.add_argument("--compute-dtype", choices=DTYPES, help="whose peak applies; default as --weight-dtype")
    sub.add_argument("--counting", choices=tuple(COUNTINGS), default="chapter",
                     help="chapter: full P x P attention, all parameters; kernel: causal, matmul parameters")
    sub.add_argument("--mfu", type=float, default=roofline.CHAPTER_MFU, help=f"fraction of peak FLOP/s, {MIN_EFFICIENCY}..1")
    sub.add_argument("--bandwidth-efficiency", type=float, default=roofline.CHAPTER_BANDWIDTH_EFFICIENCY,
                     help=f"fraction of memory bandwidth, {MIN_EFFICIENCY}..1")
    sub.add_argument("--json", action="store_true", help="one JSON object on stdout")


def _add_measure_options(sub, bracket: bool = True):
    sub.add_argument("--model", help="default: lab-cpu on the CPU, llama-3.1-8b on CUDA")
    sub.add_argument("--device", choices=("cpu", "cuda"), help="default: CUDA if present (or LABKIT_DEVICE)")
    sub.add_argument("--prompt", type=int, help="prompt tokens P (prefill); default: the lab's slider default")
    sub.add_argument("--context", type=int, help="cached tokens S per sequence (decode)")
    sub.add_argument("--batch", type=int, help=f"sequences B, 1..{MAX_BATCH}")
    sub.add_argument("--cache-dtype", choices=roofline.CACHE_DTYPES, help="default: fp32 on the CPU, bf16 on CUDA")
    if bracket:
        sub.add_argument("--bracket", action="store_true",
                         help="measure the memory bandwidth just before and after, and add the roof fraction "
                              "against it (a shared machine's bandwidth drifts; ~1 s more on a CPU)")
    sub.add_argument("--json", action="store_true", help="one JSON object on stdout")


def _warning_line(message, category, filename, lineno, file=None, line=None):
    """A labkit warning as the one line it is ("labkit: could not cache ..."), not Python's
    "file:line: UserWarning:" followed by the line of labkit's source that raised it."""
    print(message, file=file or sys.stderr)


def main(argv: list[str] | None = None) -> int:
    """Run one command; 0 on success, 2 on bad input (one line on stderr, no traceback)."""
    with warnings.catch_warnings():
        warnings.showwarning = _warning_line
        return _run(argv)


def _run(argv: list[str] | None) -> int:
    try:
        args = build_parser().parse_args(argv)
        result = args.handler(args)
    except (UsageError, LabError, ValueError) as err:
        print(f"labkit: error: {err}", file=sys.stderr)
        return 2
    except SystemExit as stop:  # --help
        return stop.code if isinstance(stop.code, int) else 0
    try:
        if args.json:
            print(json.dumps(result, default=str))
        else:
            _print_human(args.command, result)
        sys.stdout.flush()
    except BrokenPipeError:  # `... | head`: the reader left; not an error of ours
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    return 0
