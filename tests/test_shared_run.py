"""shared_run.SharedRun: one measurement for several readers (lesson 06's answer and timeline)."""
from labkit import shared_run


def test_two_readers_share_one_run_and_a_reader_that_asks_again_runs_it_again():
    calls = []

    def run(size, scale=1):
        calls.append((size, scale))
        return {"run": len(calls)}

    shared = shared_run.SharedRun(run)
    assert not shared.has_fresh("answer") and shared.runs == 0  # nothing ran on construction
    assert shared.read("answer", 4, scale=2) == {"run": 1}
    assert shared.has_fresh("timeline") and not shared.has_fresh("answer")
    assert shared.read("timeline", 4, scale=2) == {"run": 1}  # the answer's run, not a second one
    assert calls == [(4, 2)] and shared.runs == 1
    assert shared.read("timeline", 4, scale=2) == {"run": 2}  # a cell run again measures again
    assert shared.read("answer", 4, scale=2) == {"run": 2}  # and the answer follows the new run
    assert calls == [(4, 2)] * 2


def test_a_run_that_fails_leaves_the_last_result_for_the_readers_that_have_not_had_it():
    results = iter([{"run": 1}, ValueError("out of memory")])

    def run():
        result = next(results)
        if isinstance(result, Exception):
            raise result
        return result

    shared = shared_run.SharedRun(run)
    assert shared.read("timeline") == {"run": 1}
    try:
        shared.read("timeline")
    except ValueError:
        pass
    else:
        raise AssertionError("the failing run's error must reach the reader")
    assert shared.runs == 1 and shared.read("answer") == {"run": 1}


def test_shared_points_share_each_point_and_keep_points_apart():
    calls = []

    def measure(**values):
        calls.append(values)
        return {**values, "run": len(calls)}

    points = shared_run.SharedPoints(measure)
    answer, slider = points.reader("answer"), points.reader("slider")
    assert answer(batch=1) == {"batch": 1, "run": 1} and answer(batch=16) == {"batch": 16, "run": 2}
    assert slider(batch=1)["run"] == 1 and slider(batch=4)["run"] == 3 and slider(batch=16)["run"] == 2
    assert slider(batch=1)["run"] == 4  # moved back: measured again
    assert points.read("answer", batch=1)["run"] == 4  # the latest of that point
    assert calls == [{"batch": 1}, {"batch": 16}, {"batch": 4}, {"batch": 1}]


def test_a_reader_is_the_run_as_one_reader_reads_it():
    calls = []
    shared = shared_run.SharedRun(lambda progress=None: calls.append(progress) or len(calls))
    answer, chart = shared.reader("answer"), shared.reader("chart")
    assert answer() == 1 and chart(progress="bar") == 1 and calls == [None]  # the answer's run
    assert chart(progress="bar") == 2 and calls == [None, "bar"]  # asked again: run again, its arguments passed
