"""Measure prefill and decode on the real model and put each point beside the roofline.

    measure_prefill("lab-cpu", prompt_tokens=2048)          # one point, a flat dict
    decode_sweep("lab-cpu", batches=[1, 8], contexts=[256, 4096], cache_dtypes=["fp32", "int8"])

Every point says what ran (phase, device, model, shapes, dtypes), how long it took (time_s: the
median on CUDA, the confirmed fastest call on a CPU — see `_time`; also median, min, max, spread,
noisy), what the roofline predicts on THIS machine's calibrated ceilings
(`calibrate.load_or_calibrate`, mfu = efficiency = 1) at the bandwidth of the point's working set
(working_set_bytes: the weights and the cache it reads or writes; roof_bandwidth_bytes_per_s and
roof_tier, from `roofline.roof_at_working_set`), how close it came (roof_fraction; residual =
measured / predicted - 1), and the chapter's planning fraction for its bound (plan_fraction:
0.40 of peak FLOP/s, 0.75 of bandwidth). On CUDA, l2_resident flags a working set under
roofline.L2_FLUSH_FACTOR x the L2, which back-to-back calls may read from the L2. FLOPs use KERNEL counting (causal attention, matmul
weights, the head once per sequence in prefill): what the kernels really execute. Bytes count
the matmul weights in the compute dtype (the embedding is a lookup of B rows, not a read of
the table) plus the cache written (prefill) or read (decode).

Decode points do not run a long prefill first: the cache is filled with random values of the
cache dtype (`KVCache.fill_random`), which a decode step reads exactly like real ones. Every
timed step appends a token and the lengths are then reset, so each sample reads the same
cache. Built models (random weights) are kept in a small LRU, so moving a slider re-times a
point without rebuilding the model. A CPU process that has built no model for REST_AFTER_S gives
them back (`rest`), with their caches and the freed memory it kept for speed: a lesson left open
in one tab does not hold memory another lesson's kernel needs.
"""
from __future__ import annotations

import dataclasses
import gc
import numbers
import threading
from collections import OrderedDict

import torch

from . import backend, calibrate, cpu_memory, measure, roofline, sizes
from .errors import FootprintError, LabError
from .model import Llama
from .roofline import KERNEL, Counting
from .specs import ModelSpec, get_model, l2_bytes_of

DEFAULT_MODEL = "lab-cpu"
# CPU: each point takes about CPU_BUDGET_S in all, warm-up included (a slider must respond), and
# up to CPU_MAX_BUDGET_S while a busy machine keeps its fastest call from being confirmed.
CPU_BUDGET_S = 2.0
CPU_MAX_BUDGET_S = 5.0
CPU_MAX_SAMPLES = 50
CUDA_WARMUP, CUDA_REPEATS, CUDA_BUDGET_S = 2, 10, 2.0
_MODELS: OrderedDict = OrderedDict()
MAX_MODELS = 2  # each holds its weights and its last KV cache
# A CPU process at rest this long (no model asked for) lets its models go (`rest`). Why: a learner
# opens lesson after lesson and each keeps its own kernel. Under a JupyterHub rehearsal on the
# 2-core EPYC VM (two learners, 4 GiB each), a kernel of a lesson on lab-cpu held 0.9-1.3 GB at
# rest after measuring (lessons 02, 05, 06, 07); with lessons 01-05 open one learner's cgroup
# reached 4,092 MiB of its 4,096, and lesson 06 stalled. A process after `rest`: 366 MB, against
# 605 MB with lab-cpu built and a decode point measured (284 MB with labkit imported). The cost
# comes at the next point: rebuilding lab-cpu took 0.3 s, and the page faults of a new cache
# ~0.3 s a 256 MiB (fresh) against 0.05 s (memory kept).
REST_AFTER_S = 120.0
_rest_timer: threading.Timer | None = None
_timer_lock = threading.Lock()  # the countdown
_models_lock = threading.Lock()  # _MODELS, which `rest` empties from the countdown's thread


# ------------------------------------------------------------------ models and caches
def get_built_model(model: ModelSpec | str = DEFAULT_MODEL, device: str | None = None) -> Llama:
    """The model for (spec, device), built once with seeded random weights and kept in an LRU."""
    spec = get_model(model) if isinstance(model, str) else model
    chosen = backend.choose_device(device)
    key = (spec, chosen.device, chosen.compute_dtype)
    if chosen.device == "cpu":
        _rest_later()
    with _models_lock:
        if key in _MODELS:
            _MODELS.move_to_end(key)
            return _MODELS[key]
        while len(_MODELS) >= MAX_MODELS:  # free the oldest before allocating the new one
            _MODELS.popitem(last=False)
            if chosen.device == "cuda":
                torch.cuda.empty_cache()  # so the footprint check sees the freed memory as free
        built = Llama(spec, batch=1, max_tokens=16, device=chosen.device, compute_dtype=chosen.compute_dtype)
        _warm_up(built)
        _MODELS[key] = built
        return built


def _rest_later():
    """(Re)start the countdown to `rest`: REST_AFTER_S from now, on a daemon thread (never keeps a
    process alive). Each model asked for restarts it, so a sweep never rests between its points."""
    global _rest_timer
    with _timer_lock:
        if _rest_timer is not None:
            _rest_timer.cancel()
        _rest_timer = threading.Timer(REST_AFTER_S, rest)
        _rest_timer.daemon = True
        _rest_timer.start()


def rest() -> int:
    """Let the CPU models of the LRU go (their weights, packed copies and KV caches) and hand the
    freed heap back to the OS (`cpu_memory.hand_back`). Returns how many models went. Safe while
    a measurement runs: whoever holds a model keeps it; the next `get_built_model` builds it again.
    CUDA models stay (a GPU's memory is not what a learner's cgroup limits)."""
    with _models_lock:
        gone = [key for key, built in _MODELS.items() if built.device.type == "cpu"]
        for key in gone:
            del _MODELS[key]
    gc.collect()  # a model's tensors may sit in reference cycles (the Llama and its cache)
    cpu_memory.hand_back()
    return len(gone)


def _warm_up(built: Llama):
    """One tiny prefill and decode step, untimed, so no lesson's first point pays the process's
    one-time costs (thread pools started, BLAS and attention kernels dispatched the first time,
    Triton's compilation on CUDA). `_time` warms up before every point as well; this one covers the
    point long enough (>= CPU_BUDGET_S / 2) to be measured by its first call alone."""
    tokens = _random_tokens(built.spec, (1, 8), built.device)
    built.prefill(tokens)
    built.decode_step(tokens[:, -1])
    built.cache.set_lengths(0)


def ensure_cache(model: Llama, batch: int, tokens: int, cache_dtype: str, prefill_tokens: int):
    """Reuse the model's cache if it has this batch and dtype and room for `tokens`, else replace
    it (the footprint check counts activations for `prefill_tokens` per sequence); a cache dtype
    this device's lab does not offer is refused first (`sizes.check_offered`). The measurements
    here and `breakdown`'s take their caches from it."""
    sizes.check_offered(model.device.type, cache_dtype)
    cache = model.cache
    if not _reusable(cache, batch, tokens, cache_dtype):
        cache = model.setup_cache(batch, tokens, cache_dtype, prefill_tokens)
    elif prefill_tokens > 1:  # the cache stays, the prefill's activations are new
        model.check_prefill(batch, prefill_tokens)
    return cache


def _reusable(cache, batch: int, tokens: int, cache_dtype: str) -> bool:
    """Whether `cache` serves `batch` sequences of up to `tokens` tokens in `cache_dtype` as it is."""
    return (cache is not None and cache.batch == batch and cache.cache_dtype == cache_dtype
            and cache.max_tokens >= tokens)


def fitting_batches(model: ModelSpec | str, batches, context_tokens: int, cache_dtype: str,
                    device: str | None = None) -> list[int]:
    """The batches of `batches` at which `measure_decode` over `context_tokens` would find room
    for its cache (`Llama.check_cache`, or the model's cache already big enough), in order. For a
    chart's first points (a slider's `prime`): lesson 01 primes its decode chart up to batch 64 at
    8,192 tokens, whose 8B cache (69 GB beside 16 GB of weights) an H100 does not hold; the chart
    starts with the points that fit, and a learner who moves the slider there is told why not."""
    built = get_built_model(model, device)
    sizes.check_offered(built.device.type, cache_dtype)
    fit = []
    for batch in batches:
        if not _reusable(built.cache, batch, context_tokens + 1, cache_dtype):
            try:
                built.check_cache(batch, context_tokens + 1, cache_dtype, 1)
            except FootprintError:
                continue
        fit.append(batch)
    return fit


# ------------------------------------------------------------------ timing
def _time(fn, device: str, repeats: int | None):
    """CUDA: measure.time_fn with warm-up (autotuning, clocks) and a 2 s budget; the median.

    CPU: measure.time_on_a_quiet_cpu — an untimed warm-up call, then the fastest call once a
    second one confirms it, within CPU_BUDGET_S (up to CPU_MAX_BUDGET_S while unconfirmed, then
    flagged noisy), timed again after a quiet moment where other processes kept the cores busy
    meanwhile. `repeats` caps the number of calls."""
    if device == "cuda":
        return measure.time_fn(fn, device, CUDA_WARMUP, repeats or CUDA_REPEATS, CUDA_BUDGET_S)
    most = max(2, repeats or CPU_MAX_SAMPLES)
    return measure.time_on_a_quiet_cpu(fn, CPU_BUDGET_S, CPU_MAX_BUDGET_S, min(3, most), most)


def _point(phase, model: Llama, timing, flops, bytes_moved, work=None, **shape) -> dict:
    """The flat dict every measurement returns (units in the keys). The working set is the bytes
    the step moves (`bytes_moved`: each weight and cache byte once), and the roof is the
    calibrated one at that working set. With `work` (a decode step's `decode_work_by_category`),
    also its kernels in turn on that roof (`roofline.in_turn_time_s`): in_turn_predicted_time_s
    and in_turn_roof_fraction, with the work itself (work_by_category) for `bracketed`."""
    device, dtype = model.device.type, model.compute_dtype
    hardware, _ = calibrate.load_or_calibrate(device)
    roof = roofline.roof_at_working_set(hardware, bytes_moved)
    predicted_s = roofline.roofline_time_s(flops, bytes_moved, roof, dtype)
    rates = measure.achieved(flops, bytes_moved, timing)
    bound = roofline.bound_by(flops, bytes_moved, roof, dtype)
    in_turn = {}
    if work is not None:
        in_turn_s = roofline.in_turn_time_s(work, roof, dtype)
        in_turn = {"work_by_category": work, "in_turn_predicted_time_s": in_turn_s,
                   "in_turn_roof_fraction": in_turn_s / timing.estimate_s}
    return {
        "phase": phase, "device": device, "device_name": backend.device_name(device),
        "hardware": hardware.name, "model": model.spec.name, **shape, "compute_dtype": dtype,
        # what ran the timed calls: the decode path's name, or the ops' ("+graph" for a replayed prefill)
        "kernels": model.decode_path.name if phase == "decode" else model.prefill_graph.name,
        "time_s": timing.estimate_s, "estimator": timing.estimator, "time_median_s": timing.median_s,
        "time_min_s": timing.min_s, "time_max_s": timing.max_s, "spread": timing.spread, "noisy": timing.noisy,
        # CPU: other processes' share of the cores while it was timed, and whether that passed the limit
        "others_busy_share": timing.others_busy_share, "disturbed": timing.disturbed,
        "samples": len(timing.samples_s), "flops": flops, "bytes": bytes_moved,
        "predicted_time_s": predicted_s, "bound": bound,
        # the chapter's planning line: 40 % of peak FLOP/s, 75 % of the bandwidth (at this working set)
        "planned_time_s": roofline.roofline_time_s(flops, bytes_moved, roof, dtype, roofline.CHAPTER_MFU,
                                                   roofline.CHAPTER_BANDWIDTH_EFFICIENCY),
        "working_set_bytes": bytes_moved, "roof_bandwidth_bytes_per_s": roof.memory_bandwidth_bytes_per_s,
        "roof_tier": roofline.memory_tier(bytes_moved, hardware),
        "achieved_flops_per_s": rates["achieved_flops_per_s"],
        "achieved_bytes_per_s": rates["achieved_bytes_per_s"],
        "roof_fraction": measure.roof_fraction(flops, bytes_moved, timing, roof, dtype),
        "plan_fraction": roofline.chapter_plan_fraction(bound),
        "residual": timing.estimate_s / predicted_s - 1.0,
        "host_bound": timing.host_bound,  # CUDA: the GPU waited for the host's launches (None on a CPU)
        # CUDA: small enough that back-to-back calls may read it from the L2 (None on a CPU)
        "l2_resident": roofline.l2_resident(bytes_moved, l2_bytes_of(hardware)) if device == "cuda" else None,
        **in_turn,
    }


# ------------------------------------------------------------------ one point
def measure_prefill(model: ModelSpec | str = DEFAULT_MODEL, prompt_tokens: int = 1024, batch: int = 1,
                    device: str | None = None, counting: Counting = KERNEL, repeats: int | None = None,
                    cache_dtype: str | None = None) -> dict:
    """Time one prefill of `batch` random prompts of `prompt_tokens` tokens (cache in the
    compute dtype unless `cache_dtype` is given) and compare it with the calibrated roofline."""
    built = get_built_model(model, device)
    spec, dtype = built.spec, built.compute_dtype
    check_shape(spec, batch, prompt_tokens, "prompt_tokens", low=1)
    cache_dtype = cache_dtype or dtype
    ensure_cache(built, batch, prompt_tokens, cache_dtype, prompt_tokens)
    tokens = _random_tokens(spec, (batch, prompt_tokens), built.device)
    with built.prefill_graph.repeating():  # on CUDA the repeats replay a CUDA graph (graphed_prefill)
        timing = _time(lambda: built.prefill(tokens), built.device.type, repeats)
    flops = roofline.prefill_flops(spec, prompt_tokens, batch, counting)
    bytes_moved = roofline.prefill_bytes(spec, prompt_tokens, batch, dtype, cache_dtype, counting.params)
    point = _point("prefill", built, timing, flops, bytes_moved, prompt_tokens=prompt_tokens,
                   batch=batch, cache_dtype=cache_dtype)
    point.update(counting=f"{counting.attention}/{counting.params}",
                 tokens_per_s=batch * prompt_tokens / timing.estimate_s, prefill_reason=built.prefill_graph.reason)
    return point


def measure_decode(model: ModelSpec | str = DEFAULT_MODEL, batch: int = 1, context_tokens: int = 1024,
                   cache_dtype: str = "bf16", device: str | None = None, repeats: int | None = None,
                   capacity: int | None = None) -> dict:
    """Time one decode step of `batch` sequences over `context_tokens` cached tokens each.
    `capacity` (>= context_tokens + 1) sizes a new cache so a sweep can reuse it."""
    built = get_built_model(model, device)
    spec, dtype = built.spec, built.compute_dtype
    check_shape(spec, batch, context_tokens, "context_tokens", low=0)
    cache = ensure_cache(built, batch, max(capacity or 0, context_tokens + 1), cache_dtype, 1)  # no prefill
    if cache.filled_tokens < context_tokens:  # fill the whole cache once; later contexts reuse it
        cache.fill_random(cache.max_tokens - 1)
    cache.set_lengths(context_tokens, active=True)  # active even at context 0
    tokens = _random_tokens(spec, (batch,), built.device)

    def step():  # one token per sequence, then back to the same context length
        built.decode_step(tokens)
        cache.set_lengths(context_tokens, active=True)

    timing = _time(step, built.device.type, repeats)
    flops = roofline.decode_flops_per_step(spec, batch, context_tokens, KERNEL)
    bytes_moved = roofline.decode_bytes_per_step(spec, batch, context_tokens, dtype, cache_dtype, "matmul")
    share = roofline.cache_share(spec, batch, context_tokens, dtype, cache_dtype, "matmul")
    work = roofline.decode_work_by_category(spec, batch, context_tokens, dtype, cache_dtype, KERNEL)
    point = _point("decode", built, timing, flops, bytes_moved, work, context_tokens=context_tokens,
                   batch=batch, cache_dtype=cache_dtype)
    point.update(cache_share=share, regime=roofline.decode_regime(share),
                 tokens_per_s=batch / timing.estimate_s, decode_reason=built.decode_path.reason)
    return point


def bracketed(measure_point, device: str, working_set_bytes: int | None = None) -> dict:
    """measure_point() (a point of `measure_prefill`/`measure_decode`) between two readings of
    the bandwidth roof at `working_set_bytes` (`calibrate.bandwidth_now`; give the point's own,
    from `decode_working_set_bytes`/`prefill_working_set_bytes`, or the memory's is read), with
    four keys added: both readings; bracketed_roof_fraction, the roof fraction with the faster
    reading as the bandwidth (the best rate seen is the roof; the FLOP peak stays the
    calibration's); and bracketed_predicted_time_s, the roofline's time on that roof. On a shared
    machine they say how close a point came to the roof of its own moment and tier; roof_fraction
    and predicted_time_s, against the calibration, move with the neighbours' load."""
    before = calibrate.bandwidth_now(device, working_set_bytes)
    point = measure_point()
    after = calibrate.bandwidth_now(device, working_set_bytes)
    hardware, _ = calibrate.load_or_calibrate(device)
    now = dataclasses.replace(hardware, memory_bandwidth_bytes_per_s=max(before, after))
    fraction = measure.roof_fraction(point["flops"], point["bytes"], point["time_s"], now, point["compute_dtype"])
    point.update(bandwidth_before_bytes_per_s=before, bandwidth_after_bytes_per_s=after,
                 bracketed_roof_fraction=fraction,
                 bracketed_predicted_time_s=roofline.roofline_time_s(point["flops"], point["bytes"], now,
                                                                     point["compute_dtype"]))
    if "work_by_category" in point:  # a decode step: its kernels in turn on the same roof
        in_turn_s = roofline.in_turn_time_s(point["work_by_category"], now, point["compute_dtype"])
        point.update(bracketed_in_turn_predicted_time_s=in_turn_s, bracketed_in_turn_fraction=in_turn_s / point["time_s"])
    return point


def decode_working_set_bytes(model: ModelSpec | str = DEFAULT_MODEL, batch: int = 1, context_tokens: int = 1024,
                             cache_dtype: str = "bf16", device: str | None = None) -> int:
    """What one `measure_decode` step reads, bytes (its working_set_bytes), before running it:
    the matmul weights in the device's compute dtype and the cache, for `sweeps.bracketed`."""
    spec = get_model(model) if isinstance(model, str) else model
    dtype = backend.choose_device(device).compute_dtype
    return roofline.decode_bytes_per_step(spec, batch, context_tokens, dtype, cache_dtype, KERNEL.params)


def prefill_working_set_bytes(model: ModelSpec | str = DEFAULT_MODEL, prompt_tokens: int = 1024, batch: int = 1,
                              device: str | None = None, cache_dtype: str | None = None) -> int:
    """What one `measure_prefill` pass moves, bytes (its working_set_bytes): the matmul weights and
    the cache written, in the device's compute dtype unless `cache_dtype` is given."""
    spec = get_model(model) if isinstance(model, str) else model
    dtype = backend.choose_device(device).compute_dtype
    return roofline.prefill_bytes(spec, prompt_tokens, batch, dtype, cache_dtype or dtype, KERNEL.params)


def check_shape(spec: ModelSpec, batch, tokens, name: str, low: int):
    """Refuse a batch below 1 or a token count outside low..max context, or either not an integer,
    saying what is allowed (here and in `breakdown`): a slider set past the range would otherwise fail deep in torch or, on
    a tiny model, run a prefill of a million tokens for many minutes."""
    if not _is_integer(batch) or batch < 1:
        raise LabError(f"batch must be an integer >= 1, got {batch!r}")
    if not _is_integer(tokens) or not low <= tokens <= spec.max_context:
        raise LabError(f"{name} must be an integer in {low:,}..{spec.max_context:,} "
                       f"(the max context of {spec.name}), got {tokens!r}")


def _is_integer(value) -> bool:
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def _random_tokens(spec: ModelSpec, shape, device):
    g = torch.Generator().manual_seed(0)
    return torch.randint(0, spec.vocab_size, shape, generator=g).to(device)


def with_moment(point: dict, far_below: float = roofline.FAR_FROM_ROOF) -> dict:
    """A CPU point bound by memory and far from its calibrated roof (a fraction under `far_below`,
    `roofline.FAR_FROM_ROOF` for a slider's point, `SWEEP_FAR_FROM_ROOF` in a sweep, or over 1),
    with the bandwidth at its working set read just after it (`calibrate.bandwidth_now`, 0.15-0.4 s
    for lab-cpu's working sets) and its fraction of that: moment_bandwidth_bytes_per_s,
    moment_roof_fraction. Other points as they are.

    Why: a shared machine's memory changes speed under the lab. On the 2-core EPYC VM the same
    64 MiB buffer read at 65-113 GB/s within 4 s, and 128 MiB at 46-58 GB/s one minute and 84-96
    another, so a lesson's point at 0.41 of its calibrated roof could be a slow step or a
    calibration from a faster moment. The second reading tells which (`explore.moment_note`). Where
    its buffers would not fit (a 1 GiB limit, lesson 05's 64 x 4,096-token cache), it is not read."""
    return {**point, **moment(point.get("device"), point.get("bound"), point.get("roof_fraction"),
                              point.get("working_set_bytes"), point.get("achieved_bytes_per_s"), far_below)}


def moment(device, bound, fraction, working_set_bytes, achieved_bytes_per_s,
           far_below: float = roofline.FAR_FROM_ROOF) -> dict:
    """`with_moment`'s reading for a run of `fraction` of its roof: moment_bandwidth_bytes_per_s and
    moment_roof_fraction for a CPU run bound by memory under `far_below` or over 1, else {}
    (nothing read). A measured point and a breakdown (`breakdown._split`) both ask it."""
    if device != "cpu" or bound != "memory" or fraction is None or far_below <= fraction <= 1.0:
        return {}
    try:
        now = calibrate.bandwidth_now("cpu", working_set_bytes)
    except FootprintError:  # its two buffers of the working set have no room: the point stands without it
        return {}
    return {"moment_bandwidth_bytes_per_s": now, "moment_roof_fraction": achieved_bytes_per_s / now}


def bind_prefill(model: ModelSpec | str = DEFAULT_MODEL, **fixed):
    """measure(**slider_values) -> measure_prefill(model, **fixed, **slider_values), for a view
    (`with_moment`: a point far from its roof is judged by the bandwidth of its moment too)."""
    return lambda **values: with_moment(measure_prefill(model, **{**fixed, **values}))


def bind_decode(model: ModelSpec | str = DEFAULT_MODEL, **fixed):
    """measure(**slider_values) -> measure_decode(model, **fixed, **slider_values), for a view
    (`with_moment`, as `bind_prefill`)."""
    return lambda **values: with_moment(measure_decode(model, **{**fixed, **values}))


# ------------------------------------------------------------------ sweeps
def prefill_sweep(model: ModelSpec | str = DEFAULT_MODEL, prompts=(256, 1024, 2048, 4096), batch: int = 1,
                  device: str | None = None, progress=None) -> list[dict]:
    """measure_prefill at each prompt length; progress(done, total) after each point. Each point
    far from its roof (under `roofline.SWEEP_FAR_FROM_ROOF`) is judged by its moment too (`with_moment`), as a slider's is: a lesson's
    fixed chart says in its hover which was off, the calibration or the step."""
    points = []
    for i, prompt_tokens in enumerate(prompts):
        points.append(with_moment(measure_prefill(model, prompt_tokens, batch, device), roofline.SWEEP_FAR_FROM_ROOF))
        if progress:
            progress(i + 1, len(prompts))
    return points


def decode_sweep(model: ModelSpec | str = DEFAULT_MODEL, batches=(1, 8, 32, 64), contexts=(256, 2048, 8192),
                 cache_dtypes=("bf16",), device: str | None = None, progress=None, rounds: int = 1) -> list[dict]:
    """measure_decode over the grid cache_dtypes x batches x contexts. One cache per
    (dtype, batch), sized for the longest context and filled once, serves every context. Each
    point far from its roof is judged by its moment too (`with_moment`, as `prefill_sweep`).

    `rounds` > 1 times the grid that many times, every other pass in reverse order, and keeps each
    point's fastest: a ratio of two points (lesson 04's longest context over none) is then not
    one moment of the machine against another. On the 2-core EPYC VM, whose memory's rate moves
    within seconds, batch 1 at 8,192 tokens over none once read 0.92x in one pass where 1.6-1.9x
    is usual. progress(done, total) counts every timing."""
    grid = [(d, b, s) for d in cache_dtypes for b in batches for s in sorted(contexts)]
    capacity = max(contexts) + 1
    passes = [range(len(grid)) if r % 2 == 0 else range(len(grid) - 1, -1, -1) for r in range(rounds)]
    best: dict[int, dict] = {}
    for done, i in enumerate((i for order in passes for i in order), 1):
        cache_dtype, batch, context_tokens = grid[i]
        point = with_moment(measure_decode(model, batch, context_tokens, cache_dtype, device, capacity=capacity),
                            roofline.SWEEP_FAR_FROM_ROOF)
        if i not in best or point["time_s"] < best[i]["time_s"]:
            best[i] = point
        if progress:
            progress(done, len(grid) * rounds)
    return [best[i] for i in range(len(grid))]
