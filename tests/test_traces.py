"""The Azure trace loader, its compact figures, the committed JSON and samples drawn from it."""
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from labkit import traces
from labkit.errors import LabError

ROOT = Path(__file__).resolve().parents[1]
CSV_DIR = Path(__file__).resolve().parents[2] / "shared" / "data" / "azure-llm-inference-2023"
CSVS = {"code": ("AzureLLMInferenceTrace_code.csv", 8819), "conv": ("AzureLLMInferenceTrace_conv.csv", 19366)}
needs_csvs = pytest.mark.skipif(not all((CSV_DIR / f).is_file() for f, _ in CSVS.values()),
                                reason=f"the Azure trace CSVs are not at {CSV_DIR}")
GOOD = "TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.9951690,396,109\n"


@pytest.fixture(scope="module")
def real():
    return {name: traces.load_trace(CSV_DIR / file) for name, (file, _) in CSVS.items()}


# ---------------------------------------------------------------- the real CSVs
@needs_csvs
@pytest.mark.parametrize("name", list(CSVS))
def test_real_trace_loads_every_request(real, name):
    trace, rows = real[name], CSVS[name][1]  # data rows: the file's lines minus the header
    summary = traces.summarise(trace)
    assert len(trace) == summary["count"] == rows
    assert trace.arrival_s[0] == 0 and np.all(np.diff(trace.arrival_s) >= 0)
    for key in ("prompt_tokens", "output_tokens"):
        assert sum(summary[key]["histogram"]["counts"]) == rows
        assert summary[key]["max"] == getattr(trace, key).max()
        assert summary[key]["p50"] == np.median(getattr(trace, key))
    assert summary["arrival_rate_per_s"] == pytest.approx((rows - 1) / trace.arrival_s.max(), rel=1e-5)


@needs_csvs
@pytest.mark.parametrize("name", list(CSVS))
def test_committed_figures_are_what_the_csvs_give_now(real, name):
    committed = traces.load_summary(name)
    provenance = committed.pop("provenance")
    assert committed == json.loads(json.dumps(traces.summarise(real[name])))
    assert provenance["rows"] == CSVS[name][1] and provenance["source_file"] == CSVS[name][0]


@needs_csvs
def test_the_script_rederives_the_committed_files(tmp_path):
    subprocess.run([sys.executable, str(ROOT / "scripts" / "derive_trace_figures.py"), str(CSV_DIR),
                    "--out", str(tmp_path)], check=True, capture_output=True)
    for name in CSVS:
        fresh, committed = (json.loads(p.read_text()) for p in (tmp_path / f"{name}.json", traces.DATA_DIR / f"{name}.json"))
        for summary in (fresh, committed):  # the command and date say when and how, not what
            del summary["provenance"]["command"], summary["provenance"]["derived_on"]
        assert fresh == committed
    assert (tmp_path / "README.md").read_text().count("Splitwise") == 1


def test_committed_figures_are_small_attributed_and_not_the_csvs():
    for name in traces.SUMMARIES:
        path = traces.DATA_DIR / f"{name}.json"
        assert path.stat().st_size < 8000
        provenance = traces.load_summary(name)["provenance"]
        assert provenance["licence"] == "CC-BY-4.0" and "Splitwise" in provenance["attribution"]
        assert provenance["command"].startswith("python scripts/derive_trace_figures.py") and provenance["derived_on"]
    assert not list(traces.DATA_DIR.glob("*.csv"))
    readme = (traces.DATA_DIR / "README.md").read_text()
    assert "CC-BY-4.0" in readme and "Patel" in readme and "AzureLLMInferenceDataset2023.md" in readme


def test_unknown_summary_lists_the_known_ones():
    with pytest.raises(LabError, match="code, conv"):
        traces.load_summary("chat")


# ---------------------------------------------------------------- errors
def write(tmp_path, text):
    path = tmp_path / "trace.csv"
    path.write_text(text)
    return path


def test_a_small_file_loads(tmp_path):
    trace = traces.load_trace(write(tmp_path, GOOD))
    assert trace.prompt_tokens.tolist() == [374, 396] and trace.output_tokens.tolist() == [44, 109]
    assert trace.arrival_s.tolist() == pytest.approx([0.0, 4.314579])
    assert trace.requests.shape == (2, 3) and trace.source == "trace.csv"


def test_missing_file(tmp_path):
    with pytest.raises(LabError, match="not found"):
        traces.load_trace(tmp_path / "nope.csv")


@pytest.mark.parametrize("text, line, message", [
    ("", None, "empty"),
    ("time,prompt,output\n2023-11-16 18:15:46.6805900,374,44\n", 1, "expected the header"),
    ("TIMESTAMP,ContextTokens,GeneratedTokens\n", None, "no requests"),
    (GOOD + "2023-11-16 18:15:51.0,396\n", 4, "3 comma-separated fields"),
    (GOOD + "2023-11-16 18:15:51.0,396,12,7\n", 4, "3 comma-separated fields"),
    (GOOD + "yesterday,396,12\n", 4, "not a timestamp"),
    (GOOD + "2023-11-16 18:15:51.0,abc,12\n", 4, "ContextTokens"),
    (GOOD + "2023-11-16 18:15:51.0,396,-3\n", 4, "GeneratedTokens"),
    (GOOD + "2023-11-16 18:15:51.0,3.5,12\n", 4, "whole number"),
])
def test_malformed_files_name_the_line(tmp_path, text, line, message):
    with pytest.raises(LabError, match=message) as caught:
        traces.load_trace(write(tmp_path, text))
    if line is not None:
        assert f"line {line}:" in str(caught.value)


# ---------------------------------------------------------------- figures and samples
def test_log_bin_edges():
    edges = traces.log_bin_edges(14050)
    assert edges[:10].tolist() == [0, 1, 2, 3, 4, 5, 6, 8, 10, 13]
    assert np.all(np.diff(edges) > 0) and edges[-1] > 14050 and edges[-2] <= 14050
    assert traces.log_bin_edges(0).tolist() == [0, 1]


def test_samples_follow_the_histograms():
    summary = traces.load_summary("conv")
    sample = traces.sample_requests(summary, 20000, seed=1)
    assert traces.SAMPLED_LABEL in sample.source and "seed 1" in sample.source
    for key in ("prompt_tokens", "output_tokens"):
        values = getattr(sample, key)
        edges = summary[key]["histogram"]["edges"]
        counts, _ = np.histogram(values, bins=edges)
        expected = np.array(summary[key]["histogram"]["counts"]) / summary["count"]
        assert np.abs(counts / len(values) - expected).max() < 0.02  # bin by bin
        assert values.min() >= edges[0] and values.max() < edges[-1]
    assert len(sample) / sample.arrival_s[-1] == pytest.approx(summary["arrival_rate_per_s"], rel=0.05)


def test_samples_repeat_with_the_seed():
    summary = traces.load_summary("code")
    a, b = traces.sample_requests(summary, 100, seed=3), traces.sample_requests(summary, 100, seed=3)
    assert np.array_equal(a.requests, b.requests)
    with pytest.raises(LabError):
        traces.sample_requests(summary, 0)
