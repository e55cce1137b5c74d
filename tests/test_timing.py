"""The CPU timing that survives a busy machine (`labkit.timing`), and the conclusions the
lessons draw from its points (noisy ones left out)."""
from __future__ import annotations

import itertools

import pytest

from labkit import explore, timing
from labkit.errors import LabError
from labkit.timing import Timing


class Scripted:
    """A callable whose calls 'take' the scripted seconds in turn (the warm-up is call 0); the
    clock is patched so no test sleeps."""

    def __init__(self, monkeypatch, seconds):
        self.seconds, self.calls, self.now = list(seconds), 0, 0.0
        monkeypatch.setattr(timing.time, "perf_counter", lambda: self.now)

    def __call__(self):
        self.now += self.seconds[min(self.calls, len(self.seconds) - 1)]
        self.calls += 1


def test_the_fastest_call_is_the_estimate_once_a_second_call_confirms_it():
    t = Timing((0.30, 0.10, 0.105, 0.5), estimator="fastest")
    assert t.estimate_s == 0.10 and t.confirmed and not t.noisy
    assert t.median_s == pytest.approx(0.2025)  # kept, but not what the point reports


def test_a_fastest_call_no_other_came_near_is_noisy():
    t = Timing((0.10, 0.13, 0.5), estimator="fastest")
    assert not t.confirmed and t.noisy
    assert Timing((0.10,), estimator="fastest").noisy  # one call confirms nothing


def test_the_median_estimator_is_unchanged():
    t = Timing((1.0, 3.0, 2.0))
    assert t.estimate_s == 2.0 and t.noisy == (t.spread > timing.NOISY_SPREAD)
    with pytest.raises(LabError):
        Timing((1.0,), estimator="mean")


def test_the_warm_up_is_not_a_sample_and_a_quiet_run_stops_once_confirmed(monkeypatch):
    # The warm-up is slow (cold caches), then two calls agree: stop at min_samples.
    fn = Scripted(monkeypatch, [1.0, 0.05, 0.30, 0.051])
    t = timing.time_until_stable(fn, budget_s=0.2, max_budget_s=2.0)
    assert t.samples_s == pytest.approx((0.05, 0.30, 0.051))  # the warm-up's 1.0 is not among them
    assert t.estimate_s == pytest.approx(0.05) and not t.noisy


def test_short_calls_keep_sampling_for_a_quarter_of_the_budget(monkeypatch):
    fn = Scripted(monkeypatch, [0.01] * 200)
    t = timing.time_until_stable(fn, budget_s=0.4, max_budget_s=1.0)
    assert len(t.samples_s) >= 9 and sum(t.samples_s) + 0.01 >= 0.1


def test_a_busy_machine_is_sampled_up_to_the_hard_limit_then_flagged(monkeypatch):
    # Every call slower than the last: the fastest is never confirmed.
    fn = Scripted(monkeypatch, [0.1] + [0.1 * 1.5 ** i for i in range(40)])
    t = timing.time_until_stable(fn, budget_s=0.5, max_budget_s=3.0)
    assert t.noisy and len(t.samples_s) == 7
    assert fn.now - t.samples_s[-1] + t.samples_s[-2] <= 3.0  # the last call was expected to fit
    assert fn.now + t.samples_s[-1] > 3.0  # and one more would not


def test_long_calls_need_only_two_samples(monkeypatch):
    fn = Scripted(monkeypatch, [1.0, 1.0, 1.02])
    t = timing.time_until_stable(fn, budget_s=2.0, max_budget_s=5.0)
    assert len(t.samples_s) == 2 and not t.noisy


def test_sample_until_stable_waits_for_every_name(monkeypatch):
    clock = itertools.count()
    monkeypatch.setattr(timing.time, "perf_counter", lambda: next(clock) * 0.001)
    decode = iter([9.0, 1.0, 2.0, 3.0, 1.05, 7.0, 7.0])
    ts = timing.sample_until_stable(lambda: {"prefill": 0.5, "decode": next(decode)}, 0.001, 10.0)
    assert ts["prefill"].confirmed and ts["decode"].confirmed
    assert ts["decode"].samples_s == pytest.approx((1.0, 2.0, 3.0, 1.05))  # the warm-up's 9.0 is not a sample


class Clock:
    """A patched perf_counter that only the scripted samplers move."""

    def __init__(self, monkeypatch):
        self.now = 0.0
        monkeypatch.setattr(timing.time, "perf_counter", lambda: self.now)


def test_samplers_in_turns_are_timed_across_the_same_moments(monkeypatch):
    clock, log = Clock(monkeypatch), []

    def sampler(name, seconds):
        def sample():
            clock.now += seconds
            log.append(name)
            return {"t": seconds}
        return sample

    # Budget 1.0 s: a round gives each about 0.083 s, so one call of each; three rounds (min_samples)
    # after the two warm-ups, then both are confirmed and a quarter budget (0.25 s) is spent.
    out = timing.sample_in_turns([sampler("a", 0.1), sampler("b", 0.1)], 1.0, 5.0)
    assert log == ["a", "b"] * 4
    assert [len(t["t"].samples_s) for t in out] == [3, 3] and not any(t["t"].noisy for t in out)


def test_a_sampler_in_turns_keeps_its_own_budget_and_noisy_flag(monkeypatch):
    clock, rounds = Clock(monkeypatch), []
    slower = itertools.count()

    def quiet():
        clock.now += 0.1
        return {"t": 0.1}

    def busy():  # every call slower than the last: never confirmed
        seconds = 0.1 * 1.5 ** next(slower)
        clock.now += seconds
        return {"t": seconds}

    quiet_out, busy_out = timing.sample_in_turns([quiet, busy], 1.0, 3.0, after_round=rounds.append)
    assert not quiet_out["t"].noisy  # done after three rounds, and still timed while the busy one goes on:
    assert len(quiet_out["t"].samples_s) == len(busy_out["t"].samples_s) == len(rounds) > 3
    busy_s = busy_out["t"].samples_s  # on alone up to its own limit (its warm-up took 0.1 s):
    assert busy_out["t"].noisy and 0.1 + sum(busy_s[:-1]) + busy_s[-2] <= 3.0  # the last call was expected to fit
    assert 0.1 + sum(busy_s) + busy_s[-1] > 3.0  # one more would not


def test_short_calls_in_turns_take_several_a_round(monkeypatch):
    clock, log = Clock(monkeypatch), []

    def short():
        clock.now += 0.01
        log.append("short")
        return {"t": 0.01}

    def long():
        clock.now += 0.5
        log.append("long")
        return {"t": 0.5}

    short_out, long_out = timing.sample_in_turns([short, long], 1.2, 5.0, max_samples=30)
    assert log[2:12] == ["short"] * 10 and log[12] == "long"  # a round: ~0.1 s of short calls, at most 30 / 3
    # A long call needs two; the long one is still called while the short one finishes.
    assert len(short_out["t"].samples_s) == 30 and len(long_out["t"].samples_s) == 3


def test_a_done_sampler_gets_one_call_a_round_and_a_new_fastest_puts_it_back_to_work(monkeypatch):
    clock, slower, cheap_calls = Clock(monkeypatch), itertools.count(), itertools.count()

    def cheap():  # 10 ms a call, 5 ms from its 40th call on: the machine got faster
        seconds = 0.005 if next(cheap_calls) >= 40 else 0.01
        clock.now += seconds
        return {"t": seconds}

    def busy():
        seconds = 0.1 * 1.2 ** next(slower)
        clock.now += seconds
        return {"t": seconds}

    rounds = []
    cheap_out, busy_out = timing.sample_in_turns([cheap, busy], 1.2, 6.0, max_samples=300,
                                                 after_round=lambda t: rounds.append(len(t[0]["t"].samples_s)))
    assert busy_out["t"].noisy and not cheap_out["t"].noisy
    steps = [b - a for a, b in zip(rounds, rounds[1:])]
    assert steps[:2] == [10, 10] and 1 in steps  # a round's slice of calls until done, then one a round
    assert cheap_out["t"].estimate_s == pytest.approx(0.005)  # the new fastest, confirmed by calls of its own
    assert steps[steps.index(1):].count(1) < len(steps[steps.index(1):])  # back to a slice after it


def test_sample_in_turns_needs_a_sampler():
    with pytest.raises(LabError):
        timing.sample_in_turns([], 1.0, 2.0)


@pytest.mark.parametrize("args", [(0, 1), (2, 1), (1, 2, 1), (1, 2, 3, 2)])
def test_sample_until_stable_refuses_nonsense_budgets(args):
    with pytest.raises(LabError):
        timing.time_until_stable(lambda: None, *args)


# ------------------------------------------------------------------ conclusions drawn from points
PREDICTED = {"prompt_tokens": [512, 2304, 4096], "predicted_time_s": [1.0, 6.0, 15.0],
             "linear_only_s": [1.0, 4.5, 8.0]}


def _rec(p, t, noisy=False, disturbed=False):
    return {"prompt_tokens": p, "time_s": t, "noisy": noisy, "disturbed": disturbed, "device": "cpu",
            "device_name": "a CPU"}


@pytest.mark.parametrize("flag", ["noisy", "disturbed"])
def test_growth_leaves_points_timed_on_a_busy_machine_out(flag):
    records = [_rec(512, 5.0, **{flag: True}), _rec(2304, 6.0), _rec(4096, 15.0)]
    g = explore.growth(records, "prompt_tokens", PREDICTED)
    assert (g["from"], g["to"], g["measured_ratio"], g["left_out"]) == (2304, 4096, 2.5, 1)
    assert "(1 point(s) timed on a busy machine left out)" in explore.growth_line(g)


def test_growth_with_too_few_clean_points_concludes_nothing():
    g = explore.growth([_rec(512, 1.0), _rec(4096, 9.0, noisy=True)], "prompt_tokens", PREDICTED)
    assert g["measured_ratio"] is None
    assert explore.growth_line(g).startswith("Too few trustworthy points")


def test_growth_line_states_the_ratios():
    g = explore.growth([_rec(512, 1.0), _rec(4096, 15.1)], "prompt_tokens", PREDICTED)
    assert explore.growth_line(g) == ("On a CPU: P from 512 to 4,096 is 8.0× the tokens; measured time 15.1×; "
                                      "predicted 15.0× with attention, 8.0× without.")


def test_growth_line_gives_each_ends_fraction_of_its_roof_when_they_differ():
    """The growth measured below the formula's because the shortest prompt ran further below its
    roof: a sentence, on a line of its own, names both fractions and works the predicted ratio
    through them."""
    g = explore.growth([{**_rec(512, 1.0), "roof_fraction": 0.51}, {**_rec(4096, 14.1), "roof_fraction": 0.57}],
                       "prompt_tokens", PREDICTED)
    assert explore.growth_line(g).endswith("8.0× without.\nThe prefill at P = 512 ran at 0.51 of its roof and the one "
                                           "at P = 4,096 at 0.57, which scales the predicted 15× by 0.51 ÷ 0.57 "
                                           "to ≈ 13.4×.")


def test_split_extremes_skip_noisy_shapes():
    split = {"titles": ["Chat", "RAG (noisy)", "Classification"], "names": ["Chat", "RAG", "Classification"],
             "noisy": [False, True, False], "prefill_pct": [20.0, 99.0, 80.0]}
    ends = explore.split_extremes(split)
    assert (ends["decode_heaviest"], ends["prefill_heaviest"], ends["left_out"]) == ("Chat", "Classification", 1)
    assert explore.split_extremes_line(split) == ("Furthest towards decode: Chat (20% prefill). Furthest towards "
                                                  "prefill: Classification (80% prefill) (1 noisy shape(s) left out).")


def test_a_noisy_shape_is_ranked_when_its_whole_range_keeps_its_place():
    """Unconfirmed, chat's share may lie anywhere from 15 to 18 %: below every other shape's range,
    so it still leans furthest towards decode. An unconfirmed RAG whose range meets the agent
    loop's is left out: the two could swap."""
    split = {"titles": ["Chat (noisy)", "RAG (noisy)", "Agent", "Classification"],
             "names": ["Chat", "RAG", "Agent", "Classification"], "noisy": [True, True, False, False],
             "prefill_pct": [16.0, 50.0, 49.0, 84.0],
             "prefill_pct_range": [(15.0, 18.0), (47.0, 56.0), (48.0, 51.0), (83.0, 86.0)]}
    ends = explore.split_extremes(split)
    assert ends["order"] == ["Chat", "Agent", "Classification"] and ends["left_out_names"] == ["RAG"]
    assert explore.split_extremes_line(split).startswith("Furthest towards decode: Chat (16% prefill).")
    split["prefill_pct_range"][0] = (15.0, 48.5)  # now it could pass the agent loop
    assert explore.split_extremes(split)["left_out_names"] == ["Chat", "RAG"]


def test_batches_through_ridge_measure_the_mark_or_leave_it_alone():
    assert explore.batches_through_ridge([1, 16, 64], 125.2, 256) == [1, 16, 64, 126, 189]
    assert explore.batches_through_ridge([1, 16, 64], 40.0, 256) == [1, 16, 64]  # already inside
    assert explore.batches_through_ridge([1, 16, 64], 300.0, 256) == [1, 16, 64]  # too far: not drawn
    assert explore.batches_through_ridge([1, 16, 64], None, 256) == [1, 16, 64]
    assert explore.batches_through_ridge([1, 16, 64], 200.0, 256) == [1, 16, 64, 200, 256]


def test_point_summary_gives_numbers_and_how_they_were_timed():
    point = {"time_s": 0.0094, "predicted_time_s": 0.004, "tokens_per_s": 1812.4, "roof_fraction": 0.38,
             "bound": "memory", "device_name": "a CPU", "samples": 12, "estimator": "fastest", "noisy": False,
             "spread": 0.35, "time_min_s": 0.0094, "time_median_s": 0.0103}
    line = explore.point_summary(point)
    # in short lines (one of ~80 words was hard to read): the figures, then how they were timed
    assert line == ("measured 9.40 ms (1,812 tokens/s); predicted 4.00 ms; 0.38 of the memory-bound roof "
                    "(bandwidth; the chapter plans 0.75)\non a CPU; fastest of 12 calls, their median 1.10× as long")
    noted = explore.point_summary({**point, "roof_fraction": 1.4, "time_s": 0.0029})
    assert noted.count("\n") == 2 and noted.split("\n")[2] == explore.point_notes({**point, "roof_fraction": 1.4})[0]
    # the tier whose bandwidth the roof is, and a compute-bound point against peak FLOP/s and 40 %
    assert "0.38 of the memory-bound roof (L3 bandwidth; the chapter plans 0.75)" in explore.point_summary(
        {**point, "roof_tier": "L3", "plan_fraction": 0.75})
    assert "0.45 of the compute-bound roof (peak FLOP/s; the chapter plans 0.40)" in explore.point_summary(
        {**point, "bound": "compute", "roof_fraction": 0.45})
    assert "e+" not in line
    assert "noisy" in explore.point_summary({**point, "noisy": True})


def test_how_a_figure_was_timed_reads_as_the_machines_load_not_an_error_of_the_figure():
    """A fastest call says how far the median call lay from it, not the samples' spread, which a few
    stalled calls blow up (1,075 % seen in lesson 01 with the browser busy) while the figure holds;
    a median keeps its spread; a recording without a median says only how many calls."""
    from labkit.timing import calls_phrase
    assert calls_phrase("fastest", 50, 10.75, 1.0512) == "fastest of 50 calls, their median 1.05× as long"
    # a median within half a percent of the fastest read "1× as long", as if rounded away: two decimals
    assert calls_phrase("fastest", 3, 0.01, 1.0031) == "fastest of 3 calls, their median 1.00× as long"
    assert calls_phrase("median", 9, 0.05) == "median of 9 samples, spread 5%"
    assert calls_phrase("fastest", 3, 0.2) == calls_phrase("fastest", 3, 0.2, float("nan")) == "fastest of 3 calls"


def test_a_cpu_timing_records_the_share_of_the_cores_others_kept_busy(monkeypatch):
    """A steady load slows every call alike, so a confirmed fastest call can still be a busy
    machine's: time_until_stable records what other processes used meanwhile (over at least
    BUSY_WINDOW_S), and past OTHERS_BUSY_LIMIT the timing says it was disturbed."""
    windows = []
    monkeypatch.setattr(timing.cpu_info, "load_snapshot", lambda: "start")
    monkeypatch.setattr(timing.cpu_info, "others_busy_share",
                        lambda start, min_wall_s=0.0: windows.append((start, min_wall_s)) or 0.4)
    t = timing.time_until_stable(Scripted(monkeypatch, [1.0, 0.05, 0.30, 0.051]), budget_s=0.2, max_budget_s=2.0)
    assert windows == [("start", timing.BUSY_WINDOW_S)]
    assert t.others_busy_share == 0.4 and t.disturbed and not t.noisy  # confirmed, and still a busy machine's
    assert t.how_timed.endswith("; other programs (a browser drawing?) kept 40% of the cores busy while it was timed")
    assert t.to_dict()["others_busy_share"] == 0.4
    quiet = Timing((0.1, 0.1), estimator="fastest", others_busy_share=timing.OTHERS_BUSY_LIMIT)
    assert not quiet.disturbed and "busy" not in quiet.how_timed
    assert not Timing((0.1, 0.1)).disturbed  # CUDA, or an OS that does not say: None


@pytest.mark.parametrize("shares, waited, quiet", [
    ([0.5, 0.02], 2, True),  # the second window is quiet
    ([0.5] * 50, 3, False),  # never quiet: gives up once the wait is over (windows of 0.1 s, a wait of 0.25)
    ([None], 1, False),  # the OS does not say
])
def test_wait_for_quiet_waits_for_one_quiet_window_at_most_its_limit(monkeypatch, shares, waited, quiet):
    clock, seen = [0.0], []
    monkeypatch.setattr(timing.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(timing.time, "sleep", lambda s: clock.__setitem__(0, clock[0] + s))
    monkeypatch.setattr(timing.cpu_info, "load_snapshot", lambda: None)
    monkeypatch.setattr(timing.cpu_info, "others_busy_share", lambda start: seen.append(1) or shares[len(seen) - 1])
    assert timing.wait_for_quiet(0.25, window_s=0.1) is quiet
    assert len(seen) == waited


def test_point_summary_says_when_other_programs_were_busy_while_it_was_timed():
    point = {"time_s": 0.083, "predicted_time_s": 0.045, "device_name": "a CPU", "samples": 3,
             "estimator": "fastest", "spread": 0.01, "noisy": False, "others_busy_share": 0.16, "disturbed": True}
    assert explore.point_summary(point).endswith(
        "; other programs (a browser drawing?) kept 16% of the cores busy while it was timed: its time is partly theirs")
    assert "busy" not in explore.point_summary({**point, "others_busy_share": 0.02, "disturbed": False})
    assert "kept 8.3% of the cores" in explore.point_summary({**point, "others_busy_share": 0.083})
    label = explore.measured_series([{**point, "prompt_tokens": 1088}], "prompt_tokens")["label"][0]
    assert label.endswith("<br>other programs (a browser drawing?) kept 16% of the cores busy while it was timed")


def test_the_measured_split_names_the_model_machine_and_batch_once():
    served = {"model": "lab-cpu", "device": "cpu", "device_name": "AMD EPYC 9R14 96-Core Processor", "batch": 1,
              "prompt_tokens": 250, "output_tokens": 38, "prefill_share": 0.17, "decode_share": 0.83,
              "prefill_s": 0.0175, "decode_s": 0.083, "noisy": False}
    split = explore.measured_split([served], ["Chat"])
    assert split["label"] == "lab-cpu measured on AMD EPYC 9R14 96-Core, batch 1"  # no "(cpu)" after the name
    assert split["prefill_pct"] == [17.0] and split["shapes"] == ["250 / 38"]
