"""Real traffic: the Azure LLM inference trace (2023), its compact figures, and samples from them.

The question: *what prompt and output lengths does real traffic have?* Not the mean — the
distribution, because prefill cost is set by the long tail. The trace's CSV files
(`TIMESTAMP,ContextTokens,GeneratedTokens`, one row per request) are CC-BY-4.0 data published
in Azure/AzurePublicDataset (Patel et al., "Splitwise", ISCA 2024). The project never ships
them: `load_trace` reads them from a path the user gives, `summarise` reduces one to a few KB
of figures, and `scripts/derive_trace_figures.py` commits those figures under
data/azure-llm-inference-2023/, where `load_summary` finds them. `sample_requests` draws
synthetic requests from the committed histograms for machines without the CSVs.
"""
from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .errors import LabError, whole_number

HEADER = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
QUANTILES = (0.10, 0.25, 0.50, 0.75, 0.90, 0.95, 0.99)
BINS_PER_DECADE = 10  # histogram edges at 10^(k/10), rounded to whole tokens
SIGNIFICANT_DIGITS = 6  # floats in a summary, so the committed JSON stays small and stable
DATA_DIR = Path(__file__).resolve().parents[1] / "data" / "azure-llm-inference-2023"
SUMMARIES = ("code", "conv")  # the committed summaries: code completion and conversation
SAMPLED_LABEL = "drawn from the trace's histograms"


@dataclass(frozen=True, eq=False)
class Trace:
    """Requests in file order: prompt and output lengths (tokens) and arrival times in seconds
    after the earliest request. `source` says where they came from (a file, or a sample)."""

    prompt_tokens: np.ndarray  # (n,) int64
    output_tokens: np.ndarray  # (n,) int64
    arrival_s: np.ndarray  # (n,) float64, >= 0
    source: str
    start_timestamp: str | None = None  # the earliest request's TIMESTAMP, when read from a file

    def __len__(self) -> int:
        return len(self.prompt_tokens)

    @property
    def requests(self) -> np.ndarray:
        """(n, 3) rows of (arrival_s, prompt_tokens, output_tokens), as `labkit.batching` takes them."""
        return np.column_stack([self.arrival_s, self.prompt_tokens, self.output_tokens]).astype(float)


# ---------------------------------------------------------------- loading a CSV
def load_trace(path: str | Path) -> Trace:
    """Read one Azure trace CSV. A missing file, a wrong header or a malformed row raises
    LabError naming the file and the line (1 = the header)."""
    path = Path(path)
    if not path.is_file():
        raise LabError(f"trace file {str(path)!r} not found (give the path of an Azure trace CSV, "
                       f"e.g. AzureLLMInferenceTrace_conv.csv)")
    try:
        lines = path.read_text(encoding="utf-8-sig").splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise LabError(f"trace file {str(path)!r} is not readable text: {err}") from None
    _check_header(path, lines)
    stamps, prompts, outputs = [], [], []
    for number, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        stamp, prompt, output = _parse_row(path, number, line)
        stamps.append(stamp), prompts.append(prompt), outputs.append(output)
    if not stamps:
        raise LabError(f"trace file {str(path)!r} has a header but no requests")
    stamps = np.array(stamps, dtype="datetime64[ns]")
    ns = stamps.astype(np.int64)
    return Trace(np.array(prompts, dtype=np.int64), np.array(outputs, dtype=np.int64),
                 (ns - ns.min()) / 1e9, source=path.name, start_timestamp=str(stamps.min()))


def _check_header(path: Path, lines: list[str]) -> None:
    if not lines:
        raise LabError(f"trace file {str(path)!r} is empty; expected the header {','.join(HEADER)}")
    found = tuple(cell.strip() for cell in lines[0].split(","))
    if found != HEADER:
        raise LabError(f"trace file {str(path)!r} line 1: expected the header {','.join(HEADER)}, "
                       f"found {lines[0].strip()!r}")


def _parse_row(path: Path, number: int, line: str) -> tuple[np.datetime64, int, int]:
    where = f"trace file {str(path)!r} line {number}"
    cells = [cell.strip() for cell in line.split(",")]
    if len(cells) != 3:
        raise LabError(f"{where}: expected 3 comma-separated fields, found {len(cells)}: {line.strip()!r}")
    try:
        stamp = np.datetime64(cells[0].replace(" ", "T"), "ns")
    except ValueError:
        raise LabError(f"{where}: {cells[0]!r} is not a timestamp like 2023-11-16 18:17:03.9799600") from None
    if np.isnat(stamp):
        raise LabError(f"{where}: the timestamp is empty or NaT")
    counts = []
    for name, cell in zip(HEADER[1:], cells[1:]):
        if not (cell.isascii() and cell.isdigit()):
            raise LabError(f"{where}: {name} must be a non-negative whole number, found {cell!r}")
        counts.append(int(cell))
    return stamp, counts[0], counts[1]


# ---------------------------------------------------------------- compact figures
def summarise(trace: Trace) -> dict:
    """Count, duration, arrival and token rates, inter-arrival gaps, and for prompt and output
    lengths the mean, quantiles, max and a log-spaced histogram. JSON-ready; floats rounded to
    6 significant digits."""
    arrivals = np.sort(trace.arrival_s)
    duration = float(arrivals[-1] - arrivals[0])
    per_s = (lambda x: _round(x / duration)) if duration > 0 else (lambda x: None)
    gaps = np.diff(arrivals)
    return {
        "count": len(trace),
        "duration_s": _round(duration),
        # (n - 1) gaps in `duration`: the reciprocal of the mean gap between arrivals
        "arrival_rate_per_s": per_s(len(trace) - 1),
        "prompt_tokens_per_s": per_s(int(trace.prompt_tokens.sum())),
        "output_tokens_per_s": per_s(int(trace.output_tokens.sum())),
        "interarrival_s": _quantiles(gaps) if len(gaps) else None,
        "prompt_tokens": _lengths(trace.prompt_tokens),
        "output_tokens": _lengths(trace.output_tokens),
        # Samples draw the two lengths independently; this says how much pairing they lose.
        "log_length_correlation": _log_correlation(trace.prompt_tokens, trace.output_tokens),
    }


def _round(x: float) -> float:
    return float(f"{float(x):.{SIGNIFICANT_DIGITS}g}")


def _quantiles(values: np.ndarray) -> dict:
    figures = {"mean": _round(values.mean())}
    figures.update({f"p{round(q * 100)}": _round(np.quantile(values, q)) for q in QUANTILES})
    figures["max"] = _round(values.max())
    return figures


def _lengths(tokens: np.ndarray) -> dict:
    figures = _quantiles(tokens)
    edges = log_bin_edges(int(tokens.max()))
    counts, _ = np.histogram(tokens, bins=edges)
    figures["histogram"] = {"edges": [int(e) for e in edges], "counts": [int(c) for c in counts]}
    return figures


def log_bin_edges(max_tokens: int, per_decade: int = BINS_PER_DECADE) -> np.ndarray:
    """Whole-token edges 0, 1, 2, 3, 4, 5, 6, 8, 10, 13, 16, 20, 25, … (10^(k/10) rounded, duplicates
    dropped), the last one above `max_tokens`. Bin i holds lengths in [edges[i], edges[i+1])."""
    top = math.ceil(per_decade * math.log10(max_tokens + 1))  # 10^(top/per_decade) > max_tokens
    edges = np.unique(np.round(10.0 ** (np.arange(top + 1) / per_decade)).astype(np.int64))
    edges = np.concatenate([[0], edges])  # a bin for zero-length requests
    return edges if edges[-1] > max_tokens else np.append(edges, max_tokens + 1)


def _log_correlation(prompt: np.ndarray, output: np.ndarray) -> float | None:
    x, y = np.log1p(prompt), np.log1p(output)
    if len(x) < 2 or x.std() == 0 or y.std() == 0:
        return None
    return _round(np.corrcoef(x, y)[0, 1])


# ---------------------------------------------------------------- committed figures and samples
def load_summary(name: str) -> dict:
    """The committed summary `name` ("code" or "conv") from data/azure-llm-inference-2023/,
    with its provenance (source file, rows, command, date, licence, attribution)."""
    if name not in SUMMARIES:
        raise LabError(f"unknown trace summary {name!r}; known: {', '.join(SUMMARIES)}")
    path = DATA_DIR / f"{name}.json"
    if not path.is_file():
        raise LabError(f"{path} is missing; run scripts/derive_trace_figures.py to derive it")
    return json.loads(path.read_text())


def sample_requests(summary: dict, n: int, seed: int = 0) -> Trace:
    """`n` synthetic requests drawn from a summary's histograms: a bin by its count, then a whole
    length log-uniformly inside the bin. Prompt and output lengths are drawn independently (the
    pairing is lost); arrivals are a Poisson process at the summary's arrival rate."""
    whole_number("n", n)
    rng = np.random.default_rng(seed)
    prompts = _draw_lengths(rng, summary["prompt_tokens"]["histogram"], n)
    outputs = _draw_lengths(rng, summary["output_tokens"]["histogram"], n)
    rate = summary.get("arrival_rate_per_s")
    arrivals = np.cumsum(rng.exponential(1.0 / rate, n)) if rate else np.zeros(n)
    origin = summary.get("provenance", {}).get("source_file", "a summary")
    return Trace(prompts, outputs, arrivals - arrivals[0],
                 source=f"{SAMPLED_LABEL} ({origin}, seed {seed}); lengths drawn independently, "
                        f"Poisson arrivals at {rate} per s")


def _draw_lengths(rng: np.random.Generator, histogram: dict, n: int) -> np.ndarray:
    edges = np.asarray(histogram["edges"], dtype=np.int64)
    counts = np.asarray(histogram["counts"], dtype=float)
    if len(edges) != len(counts) + 1 or counts.sum() <= 0:
        raise LabError("a histogram needs one more edge than counts and at least one count")
    bins = rng.choice(len(counts), size=n, p=counts / counts.sum())
    low, high = edges[bins], edges[bins + 1]
    # Log-uniform inside [low, high), floored to whole tokens; the [0, 1) bin is exactly 0.
    log_low = np.log(np.maximum(low, 1))
    drawn = np.floor(np.exp(log_low + rng.random(n) * (np.log(high) - log_low)))
    return np.clip(drawn, low, high - 1).astype(np.int64)


def first_or_sampled(trace_dir, name: str, n: int, seed: int = 0):
    """The first `n` requests of the Azure trace CSV `name` ("conv" | "code") under `trace_dir`,
    or, when that file is not there, `n` requests drawn from the committed summary's histograms.
    Returns (Trace, a sentence saying which)."""
    whole_number("the number of requests", n)  # a negative n would slice all but the last -n
    path = Path(trace_dir) / f"AzureLLMInferenceTrace_{name}.csv"
    if path.is_file():
        trace = load_trace(path)
        first = Trace(trace.prompt_tokens[:n], trace.output_tokens[:n], trace.arrival_s[:n], trace.source,
                             trace.start_timestamp)
        return first, f"{name}: the first {len(first):,} requests of {path.name} (real arrivals and lengths)"
    sample = sample_requests(load_summary(name), n, seed)
    return sample, (f"{name}: {path} not found, so {n:,} requests were {SAMPLED_LABEL} "
                    f"(committed figures in data/azure-llm-inference-2023/; lengths drawn independently)")
