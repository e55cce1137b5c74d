"""Static vs continuous batching, simulated one model pass at a time.

The question: *decode reads every weight to emit one token per sequence, so how many
sequences share each read?* Static batching is a bus that leaves only when every passenger has
reached their stop; continuous batching is a taxi rank that refills a seat the moment it frees.

The model of a pass (the lab's convention, shared with `labkit.workloads`):

    requests     rows of (arrival_s, prompt_tokens P, output_tokens n), in any order
    prefill      a request's prompt pass emits its first token; costs prefill_time_s(P)
    decode       every later token costs one pass; the pass emitting token k + 1 attends over
                 P + k keys; a pass over B sequences holding T keys in all costs
                 step_time_s(B, T)
    static       take up to max_batch waiting requests; one prefill pass for them all, then
                 decode passes until the longest is done. Finished sequences ride along as
                 padding (computed, cache still growing) until the batch leaves.
    continuous   before every pass, admit waiting requests into free slots; their prefills
                 join that pass (decode stalls meanwhile: no chunked prefill), and a finished
                 sequence frees its slot for the next pass.

Slot utilisation = tokens emitted / (max_batch × passes): a slot-pass is useful when it emits
a token. For one full static batch this is exactly mean(n) / max(n), the chapter's estimate.

`step_time_s` and `prefill_time_s` take numpy arrays (they are called once per run of passes,
not once per pass): a measured table, a recording, or the roofline (`roofline_step_time`).
"""
from __future__ import annotations

import bisect
import heapq
from dataclasses import dataclass

import numpy as np

from . import roofline as r
from .errors import LabError, whole_number
from .roofline import CHAPTER, CHAPTER_BANDWIDTH_EFFICIENCY, CHAPTER_MFU, Counting
from .specs import HardwareSpec, ModelSpec
from .units import machine_of


@dataclass(frozen=True, eq=False)
class BatchingResult:
    """One policy's run. Per-request arrays are in the caller's request order."""

    policy: str
    max_batch: int
    arrival_s: np.ndarray  # (n,)
    first_token_s: np.ndarray  # (n,) when prefill emitted the first token
    finish_s: np.ndarray  # (n,) when the last token was emitted
    output_tokens: np.ndarray  # (n,)
    completions: np.ndarray  # (n,) how many times each request finished: 1 in a correct run
    slot_passes: int  # max_batch × passes run
    useful_slot_passes: int  # tokens emitted

    def summary(self) -> dict:
        """Total time, throughput, slot utilisation, TTFT (mean/p50/p99) and mean ITL; keys carry
        units. ITL is token-weighted: all gaps between successive tokens, averaged."""
        total = float(self.finish_s.max() - self.arrival_s.min())
        ttft = self.first_token_s - self.arrival_s
        gaps = int((self.output_tokens - 1).sum())
        return {
            "policy": self.policy, "max_batch": self.max_batch, "requests": len(self.arrival_s),
            "output_tokens": int(self.output_tokens.sum()), "total_time_s": total,
            "throughput_tokens_per_s": float(self.output_tokens.sum() / total) if total > 0 else None,
            "slot_utilisation": self.useful_slot_passes / self.slot_passes,
            "ttft_mean_s": float(ttft.mean()), "ttft_p50_s": float(np.quantile(ttft, 0.50)),
            "ttft_p99_s": float(np.quantile(ttft, 0.99)),
            "itl_mean_s": float((self.finish_s - self.first_token_s).sum() / gaps) if gaps else None,
        }


def static_utilisation_estimate(output_tokens) -> float:
    """The chapter's estimate for a static batch: mean output length / max output length."""
    n = np.asarray(output_tokens, dtype=float)
    return float(n.mean() / n.max())


# ---------------------------------------------------------------- the two policies
def simulate_static(requests, max_batch: int, step_time_s, prefill_time_s=None) -> BatchingResult:
    """Static batching: a batch forms from whoever is waiting when the GPU frees (it does not wait
    to fill up) and leaves only when its longest request is done. `prefill_time_s` None = free."""
    arrival, prompt, output, order = _requests(requests)
    max_batch = _check_max_batch(max_batch)
    prefilled = _prefill_prefix_s(prefill_time_s, prompt[order])
    first, finish, done = np.zeros(len(order)), np.zeros(len(order)), np.zeros(len(order), np.int64)
    t, i, passes = 0.0, 0, 0
    while i < len(order):
        t = max(t, arrival[order[i]])
        j = min(i + max_batch, int(np.searchsorted(arrival[order], t, side="right")))
        batch = order[i:j]
        t += prefilled[j] - prefilled[i]
        first[batch] = t
        longest = int(output[batch].max())
        # decode pass k (1 … longest-1) emits token k+1 for every row, each attending P + k keys
        keys = prompt[batch].sum() + len(batch) * np.arange(1, longest)
        elapsed = np.concatenate([[0.0], np.cumsum(_times(step_time_s, len(batch), keys))])
        finish[batch] = t + elapsed[output[batch] - 1]
        done[batch] += 1
        t, i, passes = t + elapsed[-1], j, passes + longest
    return BatchingResult("static", max_batch, arrival, first, _finite(finish), output, done,
                          max_batch * passes, int(output.sum()))


def simulate_continuous(requests, max_batch: int, step_time_s, prefill_time_s=None) -> BatchingResult:
    """Continuous batching: a freed slot is refilled at the next pass. Event-driven: between
    admissions and completions the batch is fixed, so a run of passes is timed in one call."""
    arrival, prompt, output, order = _requests(requests)
    rank = _TaxiRank(_check_max_batch(max_batch), prompt, output, step_time_s)
    prefilled = _prefill_prefix_s(prefill_time_s, prompt[order])
    sorted_arrival = arrival[order].tolist()
    i = 0
    while rank.finished < len(order):
        waiting = bisect.bisect_right(sorted_arrival, rank.t, lo=i) - i
        admit = min(waiting, rank.max_batch - rank.active)
        if admit:
            rank.admit_pass(order[i:i + admit].tolist(), prefilled[i + admit] - prefilled[i])
            i += admit
        elif rank.active:
            free = rank.active < rank.max_batch and i < len(order)
            rank.decode_run(sorted_arrival[i] if free else None)
        else:
            rank.t = sorted_arrival[i]  # idle until the next request arrives
    return BatchingResult("continuous", rank.max_batch, arrival, np.array(rank.first), _finite(np.array(rank.finish)),
                          output, np.array(rank.done), rank.max_batch * rank.passes, rank.useful)


def compare(requests, max_batch: int, step_time_s, prefill_time_s=None) -> dict:
    """Both policies' summaries side by side, plus continuous / static throughput."""
    static = simulate_static(requests, max_batch, step_time_s, prefill_time_s).summary()
    continuous = simulate_continuous(requests, max_batch, step_time_s, prefill_time_s).summary()
    return {"static": static, "continuous": continuous,
            "throughput_ratio": continuous["throughput_tokens_per_s"] / static["throughput_tokens_per_s"]}


class _TaxiRank:
    """The continuous batcher's state, in plain Python numbers (fast for thousands of events):
    the clock, passes run, active sequences and the keys they hold in all, and a heap of
    (pass at which a sequence emits its last token, request). Every active sequence emits one
    token per pass, so a request prefilled in pass a with n tokens finishes in pass a + n - 1."""

    def __init__(self, max_batch: int, prompt: np.ndarray, output: np.ndarray, step_time_s):
        self.max_batch, self.step_time_s = max_batch, step_time_s
        self.prompt, self.output = prompt.tolist(), output.tolist()
        self.t, self.passes, self.active, self.keys, self.useful, self.finished = 0.0, 0, 0, 0, 0, 0
        self.leaving: list[tuple[int, int]] = []
        n = len(self.prompt)
        self.first, self.finish, self.done = [0.0] * n, [0.0] * n, [0] * n

    def admit_pass(self, new: list[int], prefill_s: float) -> None:
        """One pass: the newcomers' prefills plus one decode token for every active sequence."""
        decode_s = float(_times(self.step_time_s, self.active, self.keys)) if self.active else 0.0
        self.t += prefill_s + decode_s
        self.keys += self.active  # each active sequence now holds one more key
        for request in new:
            self.first[request] = self.t
            self.keys += self.prompt[request] + 1
            heapq.heappush(self.leaving, (self.passes + self.output[request] - 1, request))
        self.active += len(new)
        self._advance(1)

    def decode_run(self, next_arrival: float | None) -> None:
        """Decode passes with a fixed batch until a sequence finishes or, if a slot is free and
        `next_arrival` is given, until the pass during which that request arrives."""
        runs = self.leaving[0][0] - self.passes + 1
        keys = self.keys + self.active * np.arange(runs)
        elapsed = np.cumsum(_times(self.step_time_s, self.active, keys))
        if next_arrival is not None:
            runs = min(runs, int(np.searchsorted(elapsed, next_arrival - self.t)) + 1)
        self.t += float(elapsed[runs - 1])
        self.keys += self.active * runs
        self._advance(runs)

    def _advance(self, runs: int) -> None:
        """Count `runs` passes of the current batch, then let out whoever emitted their last token."""
        self.passes += runs
        self.useful += self.active * runs
        while self.leaving and self.leaving[0][0] < self.passes:
            _, request = heapq.heappop(self.leaving)
            self.finish[request] = self.t
            self.done[request] += 1
            self.keys -= self.prompt[request] + self.output[request]
            self.active -= 1
            self.finished += 1


# ---------------------------------------------------------------- time functions from the roofline
def roofline_step_time(model: ModelSpec, hardware: HardwareSpec, dtype: str = "bf16", cache_dtype: str = "bf16",
                       counting: Counting = CHAPTER, mfu: float = CHAPTER_MFU,
                       bandwidth_efficiency: float = CHAPTER_BANDWIDTH_EFFICIENCY):
    """`step_time_s(B, T)` equal to `roofline.predicted_decode_step_s(model, B, T / B, …)`, taking
    numpy arrays. A pass's FLOPs and bytes are affine in B and T: FLOPs = B f0 + T f1 (f0 = 2N,
    f1 = 4 L H dh), bytes = weights + T × KV bytes per token."""
    f0 = r.decode_flops_per_step(model, 1, 0, counting)
    f1 = r.decode_flops_per_step(model, 1, 1, counting) - f0
    weights, per_key = r.weight_bytes(model, dtype, counting.params), r.kv_bytes_per_token(model, cache_dtype)

    def step_time_s(batch, total_context_tokens):
        flops = np.multiply(batch, f0, dtype=float) + np.multiply(total_context_tokens, f1, dtype=float)
        nbytes = weights + np.multiply(total_context_tokens, per_key, dtype=float)
        return np.maximum(r.compute_time_s(flops, hardware, dtype, mfu),
                          r.memory_time_s(nbytes, hardware, bandwidth_efficiency))
    return step_time_s


def roofline_prefill_time(model: ModelSpec, hardware: HardwareSpec, dtype: str = "bf16",
                          counting: Counting = CHAPTER, mfu: float = CHAPTER_MFU,
                          bandwidth_efficiency: float = CHAPTER_BANDWIDTH_EFFICIENCY):
    """`prefill_time_s(P)`: `roofline.predicted_prefill_time_s` for one prompt, over arrays."""
    def one(prompt_tokens):
        return r.predicted_prefill_time_s(model, int(prompt_tokens), hardware, 1, dtype, counting, mfu,
                                          bandwidth_efficiency)
    return np.vectorize(one, otypes=[float])


# ---------------------------------------------------------------- checks
def _requests(requests):
    """Arrival, prompt and output arrays (caller's order) and the arrival order (stable)."""
    rows = np.asarray(requests, dtype=float)
    if rows.ndim != 2 or rows.shape[1] != 3 or len(rows) == 0:
        raise LabError(f"requests must be rows of (arrival_s, prompt_tokens, output_tokens), got shape {rows.shape}")
    arrival, prompt, output = rows.T
    if not np.all(np.isfinite(arrival)) or arrival.min() < 0:
        raise LabError("arrival times must be finite and >= 0 seconds")
    for name, column in (("prompt_tokens", prompt), ("output_tokens", output)):
        if np.any(column != np.round(column)) or column.min() < 1:
            raise LabError(f"{name} must be whole numbers >= 1")
    return arrival, prompt.astype(np.int64), output.astype(np.int64), np.argsort(arrival, kind="stable")


def _check_max_batch(max_batch) -> int:
    return whole_number("max_batch", max_batch)


def _times(fn, *args) -> np.ndarray:
    """Call a time function on arrays; it must broadcast and return times >= 0 (NaN fails here,
    infinity in `_finite`). One reduction per call: this runs once per simulated event."""
    try:
        times = np.asarray(fn(*args), dtype=float)
        shape = np.shape(args[-1])
        if times.shape != shape:
            times = np.broadcast_to(times, shape)
    except (TypeError, ValueError) as err:
        raise LabError(f"a time function must accept numpy arrays and broadcast (wrap a scalar one "
                       f"in numpy.vectorize): {err}") from None
    if times.size and not times.min() >= 0:
        raise LabError("a time function returned a negative or NaN time")
    return times


def _prefill_prefix_s(prefill_time_s, prompts: np.ndarray) -> np.ndarray:
    """Running total of prefill times in arrival order, so any run of requests sums in O(1)."""
    times = np.zeros(len(prompts)) if prefill_time_s is None else _times(prefill_time_s, prompts)
    return np.concatenate([[0.0], np.cumsum(times)])


def _finite(finish_s: np.ndarray) -> np.ndarray:
    if not np.all(np.isfinite(finish_s)):
        raise LabError("a time function returned an infinite time")
    return finish_s


# ---------------------------------------------------------------- time functions from measurements
def step_time_from_records(records) -> "MeasuredStepTime":
    """`step_time_s(B, T)` from measured decode points (`sweeps.decode_sweep` records, or the
    points of a GPU recording): each needs `batch`, `context_tokens` and `time_s`, and all must
    share one device and cache dtype. Between measured points the time is interpolated linearly,
    first along the context per sequence S = T / B, then along the batch; outside them it is
    extended along the nearest two points (a decode step is close to affine in B and S), and
    never below the fastest point measured."""
    return MeasuredStepTime(records)


def prefill_time_from_records(records):
    """`prefill_time_s(P)` from measured prefill points (`prompt_tokens`, `time_s`, batch 1):
    linear between them, extended along the last two outside. Past the longest prompt this
    ignores attention's quadratic growth, so it underestimates very long prompts."""
    rows = _measured(records, ("prompt_tokens",), "prefill")
    prompts = np.array(sorted({row[0] for row in rows}), dtype=float)
    times = np.array([np.median([t for p, t in rows if p == x]) for x in prompts])

    def prefill_time_s(prompt_tokens):  # below the shortest prompt: at least its time per token
        x = np.asarray(prompt_tokens, dtype=float)
        line = _extend(x, prompts, times)
        return np.where(x < prompts[0], np.maximum(line, times[0] * x / prompts[0]), line)
    return prefill_time_s


class MeasuredStepTime:
    """A measured decode step-time table (batches x contexts) as a `step_time_s(B, T)` function.
    `label` names where the points came from (device, dtype), for chart legends."""

    def __init__(self, records):
        rows = _measured(records, ("batch", "context_tokens"), "decode")
        self.batches = np.array(sorted({b for b, _, _ in rows}), dtype=float)
        self.contexts = np.array(sorted({s for _, s, _ in rows}), dtype=float)
        table = {}
        for b, s, t in rows:
            table.setdefault((b, s), []).append(t)
        missing = [(b, s) for b in self.batches for s in self.contexts if (b, s) not in table]
        if missing:
            raise LabError(f"decode points must form a full batch x context grid; missing {missing[:3]}")
        self.table_s = np.array([[np.median(table[b, s]) for s in self.contexts] for b in self.batches])
        self.floor_s = float(self.table_s.min())
        first = records[0]
        self.label = f"{machine_of(first)}, {first.get('cache_dtype', '?')} cache"

    def __call__(self, batch, total_context_tokens):
        batch, tokens = np.broadcast_arrays(np.asarray(batch, dtype=float), np.asarray(total_context_tokens, dtype=float))
        per_sequence = tokens / np.maximum(batch, 1)
        along_context = np.stack([_extend(per_sequence, self.contexts, row) for row in self.table_s])  # (nb, ...)
        return np.maximum(_extend_rows(batch, self.batches, along_context), self.floor_s)


def _measured(records, keys, phase):
    """(key values..., time_s) tuples from records of one phase, device and cache dtype."""
    records = list(records or [])
    if not records:
        raise LabError(f"no measured {phase} points: run a sweep or load a recording first")
    kinds = {(rec.get("device_name", rec.get("device")), rec.get("cache_dtype")) for rec in records}
    if len(kinds) > 1:
        raise LabError(f"measured points from different devices or cache dtypes: {sorted(map(str, kinds))}")
    try:
        return [(*(float(rec[k]) for k in keys), float(rec["time_s"])) for rec in records]
    except (KeyError, TypeError, ValueError) as err:
        raise LabError(f"a measured {phase} point needs {', '.join(keys)} and time_s: {err}") from None


def _segment(x, xs):
    """Index i of the segment xs[i] .. xs[i+1] used for x (the end segments extend outward),
    and the weight of xs[i+1]. A single point gives weight 0 (a constant)."""
    if len(xs) == 1:
        return np.zeros(np.shape(x), dtype=int), np.zeros(np.shape(x))
    i = np.clip(np.searchsorted(xs, x, side="right") - 1, 0, len(xs) - 2)
    return i, (x - xs[i]) / (xs[i + 1] - xs[i])


def _extend(x, xs, ys):
    """Piecewise-linear y(x) through (xs, ys), extended linearly beyond both ends."""
    i, w = _segment(x, xs)
    ys = np.asarray(ys, dtype=float)
    upper = ys[np.minimum(i + 1, len(ys) - 1)]
    return ys[i] + w * (upper - ys[i])


def _extend_rows(x, xs, rows):
    """Like `_extend` across the first axis of `rows` (one row per xs), elementwise in x."""
    i, w = _segment(x, xs)
    lower = np.take_along_axis(rows, i[None], 0)[0]
    upper = np.take_along_axis(rows, np.minimum(i + 1, len(xs) - 1)[None], 0)[0]
    return lower + w * (upper - lower)


def as_backlog(rows):
    """The same requests, all waiting at t = 0: a saturated server, where throughput is capacity."""
    rows = np.array(rows, dtype=float)
    rows[:, 0] = 0.0
    return rows
