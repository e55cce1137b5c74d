"""labkit.recordings: provenance on every file, atomic writes, never an overwrite."""
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime, timedelta, timezone

import numpy as np
import pytest
import torch

from labkit import recordings
from labkit.errors import LabError


@pytest.fixture(autouse=True)
def cache_dir(monkeypatch, tmp_path):
    monkeypatch.setenv("LABKIT_CACHE_DIR", str(tmp_path / "cache"))


def test_provenance_names_device_date_and_software():
    info = recordings.provenance("cpu")
    assert info["device"] == "cpu" and info["device_name"]
    date = datetime.fromisoformat(info["date"])
    assert date.utcoffset() == timedelta(0)  # ISO-8601 in UTC
    assert abs(datetime.now(timezone.utc) - date) < timedelta(minutes=1)
    assert info["torch"] == torch.__version__ and info["numpy"] == np.__version__
    assert info["python"] == f"{sys.version_info.major}.{sys.version_info.minor}.{sys.version_info.micro}"
    assert info["threads"] == torch.get_num_threads()
    assert 1 <= info["usable_cores"] <= info["cpu_count"]
    assert info["command"] == " ".join(sys.argv)
    assert info["driver"] is None  # no CUDA driver for a CPU recording
    for key in ("triton", "platform", "hostname", "git_commit", "cuda_runtime"):
        assert key in info


def test_provenance_takes_the_commit_from_the_environment_when_given(monkeypatch):
    """A tree copied to a GPU machine travels without .git: LABKIT_GIT_COMMIT names its commit."""
    monkeypatch.setenv("LABKIT_GIT_COMMIT", "0123abc")
    assert recordings.provenance("cpu")["git_commit"] == "0123abc"
    assert recordings.provenance("cpu")["git_changed_files"] is None  # what differed there is not known
    monkeypatch.delenv("LABKIT_GIT_COMMIT")
    assert recordings.provenance("cpu")["git_commit"] != "0123abc"


def test_provenance_names_the_files_that_differ_from_the_commit(monkeypatch):
    """A figure taken with uncommitted changes says which tracked files they were ([]: none)."""
    outputs = {"rev-parse": "0123abc", "status": "M labkit/bench.py\n M labkit/cli.py"}
    monkeypatch.setattr(recordings, "run_command", lambda args: outputs[args[3]])
    assert recordings.provenance("cpu")["git_changed_files"] == ["labkit/bench.py", "labkit/cli.py"]
    outputs["status"] = None  # git prints nothing for a clean tree
    assert recordings.provenance("cpu")["git_changed_files"] == []
    outputs["rev-parse"] = None  # not a git checkout
    assert recordings.provenance("cpu")["git_changed_files"] is None


def test_provenance_takes_a_command_and_a_torch_device():
    info = recordings.provenance(torch.device("cpu"), command="make gpu-check")
    assert info["command"] == "make gpu-check" and info["device"] == "cpu"


def test_writing_twice_keeps_both(tmp_path):
    first = recordings.write_recording(tmp_path, "decode-sweep", {"device": "cpu", "phase": "decode", "x": 1})
    second = recordings.write_recording(tmp_path, "decode-sweep", {"device": "cpu", "phase": "decode", "x": 2})
    third = recordings.write_recording(tmp_path, "decode-sweep.json", {"device": "cpu", "x": 3})
    assert [p.name for p in (first, second, third)] == ["decode-sweep.json", "decode-sweep-2.json",
                                                         "decode-sweep-3.json"]
    assert [json.loads(p.read_text())["x"] for p in (first, second, third)] == [1, 2, 3]
    record = json.loads(first.read_text())
    assert list(record)[0] == "provenance"
    assert record["provenance"]["device"] == "cpu" and "date" in record["provenance"]
    assert sorted(os.listdir(tmp_path)) == ["decode-sweep-2.json", "decode-sweep-3.json", "decode-sweep.json"]


def test_a_given_provenance_is_kept(tmp_path):
    given = {"device": "cuda", "date": "2026-01-01T00:00:00+00:00", "device_name": "NVIDIA H200"}
    path = recordings.write_recording(tmp_path, "r", {"provenance": given, "time_s": 0.5})
    assert json.loads(path.read_text()) == {"provenance": given, "time_s": 0.5}


def test_a_recording_without_device_or_date_is_refused(tmp_path):
    with pytest.raises(LabError, match="device"):
        recordings.write_recording(tmp_path, "r", {"time_s": 1.0})
    with pytest.raises(LabError, match="date"):
        recordings.write_recording(tmp_path, "r", {"provenance": {"device": "cpu"}})
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("name", ["../escape", "a/b", "", ".hidden"])
def test_names_must_be_plain_file_names(tmp_path, name):
    with pytest.raises(LabError, match="plain file name"):
        recordings.write_recording(tmp_path, name, {"device": "cpu"})


def test_numpy_and_tuples_are_written_as_json(tmp_path):
    payload = {"device": "cpu", "n": np.int64(3), "t": np.float32(0.5), "shape": (2, 3), "a": np.arange(3)}
    record = json.loads(recordings.write_recording(tmp_path, "r", payload).read_text())
    assert (record["n"], record["t"], record["shape"], record["a"]) == (3, 0.5, [2, 3], [0, 1, 2])


def test_concurrent_writers_never_overwrite_each_other(tmp_path):
    given = {"device": "cpu", "date": "2026-01-01T00:00:00+00:00"}
    with ThreadPoolExecutor(8) as pool:
        paths = list(pool.map(lambda i: recordings.write_recording(tmp_path, "run", {"provenance": given, "i": i}),
                              range(16)))
    assert len(set(paths)) == 16
    assert sorted(json.loads(p.read_text())["i"] for p in paths) == list(range(16))
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]  # no temporary files left


def test_without_hard_links_it_still_never_overwrites(tmp_path, monkeypatch):
    def no_links(src, dst):
        raise PermissionError("hard links not supported here")

    monkeypatch.setattr(recordings.os, "link", no_links)
    first = recordings.write_recording(tmp_path, "r", {"device": "cpu", "x": 1})
    second = recordings.write_recording(tmp_path, "r", {"device": "cpu", "x": 2})
    assert (first.name, second.name) == ("r.json", "r-2.json")
    assert [json.loads(p.read_text())["x"] for p in (first, second)] == [1, 2]
    assert sorted(os.listdir(tmp_path)) == ["r-2.json", "r.json"]


def test_write_json_atomic_replaces_whole_files(tmp_path):
    path = tmp_path / "sub" / "c.json"
    recordings.write_json_atomic(path, {"v": 1})
    recordings.write_json_atomic(path, {"v": 2})
    assert json.loads(path.read_text()) == {"v": 2}
    assert os.listdir(path.parent) == ["c.json"]


def test_load_filters_by_phase_and_skips_unreadable_files(tmp_path):
    recordings.write_recording(tmp_path, "prefill", {"device": "cpu", "phase": "prefill", "x": 1})
    recordings.write_recording(tmp_path, "decode", {"device": "cpu", "phase": "decode", "x": 2})
    (tmp_path / "broken.json").write_text('{"provenance": ')
    (tmp_path / "foreign.json").write_text('{"x": 1}')
    (tmp_path / "no-date.json").write_text('{"provenance": {"device": "cpu"}}')
    (tmp_path / "notes.txt").write_text("not a recording")
    with pytest.warns(UserWarning, match="skipped recording"):
        everything = recordings.load_recordings(tmp_path)
    assert [r["x"] for r in everything] == [2, 1]  # sorted by file name
    assert sorted(os.path.basename(p) for p, _ in everything.skipped) == ["broken.json", "foreign.json",
                                                                          "no-date.json"]
    with pytest.warns(UserWarning):
        decode = recordings.load_recordings(tmp_path, phase="decode")
    assert len(decode) == 1 and decode[0]["x"] == 2 and decode[0]["_path"].endswith("decode.json")
    assert decode[0]["provenance"]["device"] == "cpu"


def test_loading_an_empty_or_missing_directory_gives_nothing(tmp_path):
    assert recordings.load_recordings(tmp_path) == []
    assert recordings.load_recordings(tmp_path / "missing") == []
