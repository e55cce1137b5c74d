"""What a list of timed calls says: a robust estimate, its spread, and whether to trust it.

Pure Python (no torch), so the lessons' prose can quote its thresholds through `claims`.

On a CPU the same cores also run the learner's browser, JupyterLab's server and whatever else
is open, and any of them can stall one of the two threads a product is split over. Such noise
only ever adds time, so a CPU measurement (`time_until_stable`) takes the fastest call as its
estimate, as `timeit` does, and keeps sampling until a second call has come within
CONFIRM_TOLERANCE of it: a fastest call seen twice is the machine's speed, not luck in one
sample. A measurement whose budget ran out before that is flagged noisy. On CUDA the events
time the GPU's own work, which other processes barely touch, and the median is the estimate.
"""
from __future__ import annotations

import dataclasses
import math
import os
import statistics
import time
from dataclasses import dataclass
from typing import Callable

from . import cpu_info
from .errors import LabError

# A run whose samples spread by more than a quarter of their median is flagged noisy: another
# process, frequency scaling or a cold cache moved the result more than a lesson claim can bear.
NOISY_SPREAD = 0.25
MIN_SAMPLES = 3  # a budget stops timing early, but never below this many samples
# On CUDA, a run whose host spent at least this fraction of the GPU's time just issuing the work
# was host-bound: the GPU waited for Python to launch kernels, so its time says how fast the host
# launches, not how fast the GPU computes or reads (a decode step of many small kernels at batch 1).
HOST_BOUND_FRACTION = 0.9
# From this many samples on, `spread` uses the 10th-90th percentile range, which one outlier
# cannot move; below it those percentiles are mere interpolations of the extremes.
PERCENTILE_SAMPLES = 10
# "fastest" estimate (CPU): the fastest call counts once another call came within this fraction of it.
CONFIRM_TOLERANCE = 0.10
MAX_SAMPLE_S = 1e9  # about 30 years
# Other processes (the learner's browser drawing a chart, JupyterLab's server, a VM's neighbours
# through steal time) kept more than this share of all cores busy while a CPU figure was timed:
# the figure is a shared machine's, even when its fastest call was confirmed (a steady load slows
# every call alike, and on 2 cores a product split over both waits for the one that was stalled).
# On the 2-core EPYC VM, lesson 01 run in Chromium timed lab-cpu's prefill of 1,088 tokens at 87
# and 93 ms with others at 11.5 and 13.8 % of the cores, 65-66 ms at 4-5 % and from a terminal.
OTHERS_BUSY_LIMIT = 0.08
# /proc/stat counts in 10 ms ticks: a share is judged over at least this much wall time, so a
# short figure is not "busy" for one tick of a kernel thread (2 %  of 2 cores over 0.25 s).
BUSY_WINDOW_S = 0.25
# CPU: a point (`sweeps`) is timed once a moment is quiet (the browser no longer drawing the last
# chart after "Run All", or the chart a slider just redrew), waiting up to this long for one, and
# timed again after another if other processes kept the cores busy meanwhile (`Timing.disturbed`);
# a calibration waits as long for a quiet moment before it starts. LABKIT_QUIET_WAIT_S sets it
# (`quiet_wait_s`); 0 turns the waiting off, for a machine shared on purpose (the test suite's
# parallel workers, a workshop server with several learners a core), where no quiet moment comes
# and each point would wait in vain.
QUIET_WAIT_S = 2.0
# A machine that gave no quiet moment in a whole wait is busy for a while (a neighbour's job, a
# video call): the figures of the next QUIET_RETRY_AFTER_S are timed once, flagged, not waited for.
QUIET_RETRY_AFTER_S = 60.0
_last_vain_wait = [-math.inf]  # time.monotonic() when a wait last ended without a quiet moment


@dataclass(frozen=True)
class Timing:
    """Seconds per call for each timed call; the statistics are computed, never stored."""

    samples_s: tuple[float, ...]
    calls_per_sample: int = 1  # >1: each sample is the mean of that many back-to-back calls (CUDA)
    host_s: tuple[float, ...] = ()  # CUDA: per call, the host's time to issue it (launches, Python)
    # "median" (CUDA events, which other processes cannot slow) or "fastest" (a shared CPU: the
    # fastest call, once confirmed by a second one within CONFIRM_TOLERANCE).
    estimator: str = "median"
    # CUDA: how the samples were taken ("events": back-to-back calls between two events; "cuda
    # graph": launches replayed from a graph, so no host cost; "L2 flushed": the L2 emptied
    # before each call), and whether the L2 was flushed (None: not a CUDA timing).
    method: str | None = None
    l2_flushed: bool | None = None
    # CPU: the share of all cores other processes kept busy while these calls ran (`time_until_stable`;
    # None on CUDA, or where the OS does not say)
    others_busy_share: float | None = None

    def __post_init__(self):
        # NaN passes `<= 0` and inf would make the median and spread meaningless: refuse both.
        # Above MAX_SAMPLE_S a sample is a unit error, and its statistics could overflow to inf.
        if not self.samples_s or not all(math.isfinite(s) and 0 < s <= MAX_SAMPLE_S for s in self.samples_s):
            raise LabError(f"a Timing needs positive, finite samples of at most {MAX_SAMPLE_S:.0e} s, "
                           f"got {self.samples_s!r}")
        if self.estimator not in ("median", "fastest"):
            raise LabError(f"estimator must be 'median' or 'fastest', got {self.estimator!r}")

    @property
    def estimate_s(self) -> float:
        """The time a measurement reports: the median, or the fastest call (see `estimator`)."""
        return self.min_s if self.estimator == "fastest" else self.median_s

    @property
    def confirmed(self) -> bool:
        """Did a second call come within CONFIRM_TOLERANCE of the fastest one?"""
        return len(self.samples_s) >= 2 and self.second_fastest_s <= (1 + CONFIRM_TOLERANCE) * self.min_s

    @property
    def second_fastest_s(self) -> float:
        """The second fastest call (the fastest where there is one): what confirms the fastest."""
        return sorted(self.samples_s)[:2][-1]

    @property
    def median_s(self) -> float:
        return statistics.median(self.samples_s)

    @property
    def host_bound(self) -> bool | None:
        """CUDA: did issuing the work take (nearly) as long as the GPU's time for it? None on
        the CPU, where the host does the work itself."""
        if not self.host_s:
            return None
        return statistics.median(self.host_s) >= HOST_BOUND_FRACTION * self.median_s

    @property
    def min_s(self) -> float:
        return min(self.samples_s)

    @property
    def max_s(self) -> float:
        return max(self.samples_s)

    @property
    def spread(self) -> float:
        """Relative spread: (p90 - p10) / median from PERCENTILE_SAMPLES samples on,
        else (max - min) / median. 0 for a single sample."""
        if len(self.samples_s) >= PERCENTILE_SAMPLES:
            deciles = statistics.quantiles(self.samples_s, n=10, method="inclusive")
            return (deciles[-1] - deciles[0]) / self.median_s
        return (self.max_s - self.min_s) / self.median_s

    @property
    def disturbed(self) -> bool:
        """CPU: did other processes keep more than OTHERS_BUSY_LIMIT of the cores busy meanwhile?"""
        return self.others_busy_share is not None and self.others_busy_share > OTHERS_BUSY_LIMIT

    @property
    def noisy(self) -> bool:
        """Too noisy to build a conclusion on: a median whose samples spread by more than
        NOISY_SPREAD, or a fastest call that no second call confirmed."""
        if self.estimator == "fastest":
            return not self.confirmed
        return self.spread > NOISY_SPREAD

    @property
    def how_timed(self) -> str:
        """How this figure was timed (`calls_phrase`), or why it is noisy: a fastest call that no
        second came near, or a median whose samples spread too wide."""
        calls = len(self.samples_s)
        if self.noisy and self.estimator == "fastest":
            return f"noisy: no second of {calls} calls came within {CONFIRM_TOLERANCE:.0%} of the fastest"
        if self.noisy:
            return f"noisy: spread {self.spread:.0%} over {calls} samples"
        return calls_phrase(self.estimator, calls, self.spread, self.median_s / self.min_s) + (
            f"; {busy_phrase(self.others_busy_share)}" if self.disturbed else "")

    def to_dict(self) -> dict:
        """JSON-ready summary, units in the keys."""
        return {"estimate_s": self.estimate_s, "estimator": self.estimator,
                "median_s": self.median_s, "min_s": self.min_s, "max_s": self.max_s,
                "spread": self.spread, "noisy": self.noisy, "samples_s": list(self.samples_s),
                "calls_per_sample": self.calls_per_sample,
                "host_median_s": statistics.median(self.host_s) if self.host_s else None,
                "host_bound": self.host_bound, "method": self.method, "l2_flushed": self.l2_flushed,
                "others_busy_share": self.others_busy_share}


def busy_phrase(share: float) -> str:
    """What a disturbed figure's status line says of the machine's load (a tenth of a percent near
    the limit, so a share just past 8 % does not read as 8 %)."""
    digits = 0 if share >= 0.095 else 1
    return f"other programs (a browser drawing?) kept {share:.{digits}%} of the cores busy while it was timed"


def calls_phrase(estimator: str, calls: int, spread: float, median_over_fastest: float | None = None) -> str:
    """How a figure was timed, for a status line or a chart's hover: "median of 9 samples, spread
    5%" or "fastest of 50 calls, their median 1.05× as long".

    Why not the spread for the fastest call: a few calls stalled by the browser redrawing push
    the 90th percentile, and so the spread, to 1,000 % and more (seen in lesson 01 on 2 cores)
    while the fastest call, the figure, stays right. How far the middle call lies from the fastest
    says how busy the machine was without reading as an error of the figure."""
    if estimator != "fastest":
        return f"median of {calls} samples, spread {spread:.0%}"
    if median_over_fastest is None or not math.isfinite(median_over_fastest):
        return f"fastest of {calls} calls"
    return f"fastest of {calls} calls, their median {median_over_fastest:.2f}× as long"


def time_until_stable(fn: Callable[[], object], budget_s: float, max_budget_s: float,
                      min_samples: int = 3, max_samples: int = 50) -> Timing:
    """CPU timing that survives a busy machine: `sample_until_stable` of one call's seconds,
    with the share of the cores other processes kept busy meanwhile (`Timing.disturbed`)."""
    load = cpu_info.load_snapshot()
    timing = sample_until_stable(lambda: {"call": call_seconds(fn)}, budget_s, max_budget_s,
                                 min_samples, max_samples)["call"]
    return dataclasses.replace(timing, others_busy_share=cpu_info.others_busy_share(load, BUSY_WINDOW_S))


def quiet_wait_s() -> float:
    """QUIET_WAIT_S, or LABKIT_QUIET_WAIT_S where set (a LabError if it is not a number >= 0)."""
    raw = os.environ.get("LABKIT_QUIET_WAIT_S")
    if raw is None:
        return QUIET_WAIT_S
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not 0 <= value <= 600:
        raise LabError(f"LABKIT_QUIET_WAIT_S must be seconds from 0 to 600, got {raw!r}")
    return value


def time_on_a_quiet_cpu(fn: Callable[[], object], budget_s: float, max_budget_s: float,
                        min_samples: int = 3, max_samples: int = 50) -> Timing:
    """`time_until_stable` once a moment is quiet (`wait_for_quiet`, up to `quiet_wait_s()`), and
    where other processes kept the cores busy meanwhile all the same (the browser drawing
    throughout: a steady load slows every call alike, so the fastest call is confirmed and still
    the shared machine's), the same again after another quiet moment. The quiet run's figure is
    kept; failing that, the faster of the two (a load only adds time), still `disturbed`."""
    wait_s = quiet_wait_s()
    waiting = wait_s > 0 and time.monotonic() - _last_vain_wait[0] >= QUIET_RETRY_AFTER_S
    if waiting and not wait_for_quiet(wait_s):
        _last_vain_wait[0], waiting = time.monotonic(), False
    timing = time_until_stable(fn, budget_s, max_budget_s, min_samples, max_samples)
    if not timing.disturbed or not waiting:
        return timing
    if not wait_for_quiet(wait_s):
        _last_vain_wait[0] = time.monotonic()
        return timing
    again = time_until_stable(fn, budget_s, max_budget_s, min_samples, max_samples)
    return again if not again.disturbed or again.estimate_s < timing.estimate_s else timing


def wait_for_quiet(max_wait_s: float, window_s: float = 0.1) -> bool:
    """Wait, up to `max_wait_s`, for a `window_s` in which other processes kept at most
    OTHERS_BUSY_LIMIT of the cores busy (a browser done drawing the last chart). True once one
    came; False if none did, or the OS does not say, or `max_wait_s` is 0 (no waiting)."""
    if max_wait_s <= 0:
        return False
    deadline = time.monotonic() + max_wait_s
    while True:
        load = cpu_info.load_snapshot()
        time.sleep(window_s)
        share = cpu_info.others_busy_share(load)
        if share is None:
            return False
        if share <= OTHERS_BUSY_LIMIT:
            return True
        if time.monotonic() >= deadline:
            return False


def sample_until_stable(sample: Callable[[], dict[str, float]], budget_s: float, max_budget_s: float,
                        min_samples: int = 3, max_samples: int = 50) -> dict[str, Timing]:
    """Repeat `sample()` (seconds by name, e.g. {"prefill": …, "decode": …} from one served
    request) on a busy CPU: `sample_in_turns` of that one sampler."""
    return sample_in_turns([sample], budget_s, max_budget_s, min_samples, max_samples)[0]


def sample_in_turns(samples: list[Callable[[], dict[str, float]]], budget_s: float, max_budget_s: float,
                    min_samples: int = 3, max_samples: int = 50,
                    after_round: Callable[[list[dict[str, Timing]]], None] | None = None
                    ) -> list[dict[str, Timing]]:
    """Time several samplers in turns on a busy CPU, so things to be compared with each other
    (six request shapes, say) are timed across the same moments: a slow spell of the machine (a
    neighbour, the memory's rate moving, the browser drawing) lands on all of them, not on
    whichever was being timed just then. Each sampler gets its own budget and the same rules:
    one untimed warm-up call (first-touch page faults, a cold cache, a thread pool waking up),
    then calls until
      * the fastest of each of its names is confirmed (`Timing.confirmed`),
      * at least `min_samples` are in (2 for a call longer than a third of `budget_s`, so a long
        point stays near its budget), and
      * a quarter of `budget_s` is spent on it or `max_samples` are in (short calls are cheap: a
        3 ms step gets dozens of tries at a quiet moment).
    An unconfirmed sampler goes on until one more call would pass `max_budget_s` of its time, and
    is then flagged noisy. A round gives every sampler about a `min_samples`-th of that quarter
    budget (at least one call, at most a `min_samples`-th of `max_samples`), and the rounds go on
    until every sampler is done in the same round: one that is done gets one call a round while
    the others finish (up to its `max_samples` and hard limit), and a new fastest call among those
    puts it back to work until that is confirmed too. `after_round(timings)` is told each round's
    timings (a progress bar). Returns, per sampler, a Timing with the "fastest" estimator per name."""
    if not 0 < budget_s <= max_budget_s or min_samples < 2 or max_samples < min_samples or not samples:
        raise LabError(f"need at least one sampler, 0 < budget_s <= max_budget_s and 2 <= min_samples <= "
                       f"max_samples, got {len(samples)}, {budget_s}, {max_budget_s}, {min_samples}, {max_samples}")
    slice_s, slice_calls = budget_s / 4 / min_samples, max(1, max_samples // min_samples)
    spent_s = [call_seconds(sample) for sample in samples]  # the warm-ups: untimed, but spent
    last_s = [0.0] * len(samples)  # each sampler's latest call, wall clock
    collected: list[dict[str, list[float]]] = [{} for _ in samples]

    def count(i: int) -> int:  # calls of sampler i so far
        return len(next(iter(collected[i].values()), []))

    def enough(i: int) -> bool:  # its minimum number of calls is in
        return count(i) >= (2 if last_s[i] > budget_s / 3 else min_samples)

    def spent_out(i: int) -> bool:
        """No more calls: max_samples are in, or one more would pass the hard limit (once the
        minimum is in); confirmed or not, what it has then is its result."""
        return count(i) >= max_samples or (spent_s[i] + last_s[i] > max_budget_s and enough(i))

    timings: list[dict[str, Timing]] = []
    done = [False] * len(samples)
    while True:
        for i in range(len(samples)):
            # One call a round once done: enough to see the moments the others are timed in, too
            # few to use up max_samples while they finish (a new fastest would then go unconfirmed).
            round_s, calls = 0.0, 1 if done[i] else slice_calls
            for _ in range(min(calls, max_samples - count(i)) if not spent_out(i) else 0):
                start_s = time.perf_counter()
                for name, seconds in samples[i]().items():
                    collected[i].setdefault(name, []).append(seconds)
                last_s[i] = time.perf_counter() - start_s
                spent_s[i] += last_s[i]
                round_s += last_s[i]
                if round_s >= slice_s or spent_s[i] + last_s[i] > max_budget_s:
                    break
        timings = [{name: Timing(tuple(v), estimator="fastest") for name, v in values.items()}
                   for values in collected]
        if after_round:
            after_round(timings)
        # Every sampler goes on until all are done, so each one's fastest call comes from the
        # same stretch of time as the others'.
        done = [spent_out(i) or (enough(i) and all(t.confirmed for t in timings[i].values())
                                 and spent_s[i] >= budget_s / 4) for i in range(len(samples))]
        if all(done):
            return timings


def call_seconds(fn) -> float:
    """Seconds one call of fn() took, by the wall clock (perf_counter)."""
    start_s = time.perf_counter()
    fn()
    return time.perf_counter() - start_s
