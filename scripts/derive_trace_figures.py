"""Derive the committed figures of the Azure LLM inference trace (2023) from its two CSVs.

    python scripts/derive_trace_figures.py [CSV_DIR] [--out OUT_DIR]

CSV_DIR defaults to ../shared/data/azure-llm-inference-2023 (relative to the repository root)
and OUT_DIR to data/azure-llm-inference-2023. Writes code.json and conv.json (`labkit.traces.
summarise` of each CSV plus provenance) and a README.md with the attribution the licence asks
for. The CSVs themselves are never copied: only these few-KB figures are committed.
"""
from __future__ import annotations

import argparse
import datetime
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from labkit import traces  # noqa: E402

DEFAULT_CSV_DIR = ROOT.parent / "shared" / "data" / "azure-llm-inference-2023"
DEFAULT_OUT_DIR = ROOT / "data" / "azure-llm-inference-2023"
FILES = {"code": "AzureLLMInferenceTrace_code.csv", "conv": "AzureLLMInferenceTrace_conv.csv"}
SERVICES = {"code": "a code-completion service", "conv": "a conversation service"}
LICENCE = "CC-BY-4.0"
ATTRIBUTION = ("P. Patel, E. Choukse, C. Zhang, A. Shah, Í. Goiri, S. Maleki, R. Bianchini, "
               "\"Splitwise: Efficient generative LLM inference using phase splitting\", ISCA 2024")
SOURCE = ("Azure/AzurePublicDataset on GitHub, AzureLLMInferenceDataset2023.md "
          "(sampled from Azure LLM inference services on 2023-11-11)")


def derive(csv_dir: Path, command: str, today: str) -> dict[str, dict]:
    """Summary + provenance for each CSV in `csv_dir`, keyed "code" and "conv"."""
    figures = {}
    for name, file_name in FILES.items():
        trace = traces.load_trace(csv_dir / file_name)
        summary = traces.summarise(trace)
        summary["provenance"] = {
            "source_file": file_name, "service": SERVICES[name], "rows": len(trace),
            "first_timestamp_in_file": trace.start_timestamp, "source": SOURCE,
            "licence": LICENCE, "attribution": ATTRIBUTION, "command": command, "derived_on": today,
        }
        figures[name] = summary
    return figures


def readme(figures: dict[str, dict], command: str, today: str) -> str:
    """The data folder's README: what the files are, where they came from, how to cite them."""
    rows = "\n".join(_row(name, s) for name, s in figures.items())
    return f"""# Azure LLM inference trace 2023 — derived figures

Compact figures derived from the Azure LLM inference trace 2023, for the lessons on workload
shapes and batching. Only these figures are in the project; the CSVs are not (read them with
`labkit.traces.load_trace(path)` from wherever you keep them).

- Source: {SOURCE}.
- Licence: Creative Commons Attribution 4.0 ({LICENCE}). The figures here are a derived work
  under the same licence.
- Attribution: {ATTRIBUTION}.
- Timestamps in the files start at {figures['code']['provenance']['first_timestamp_in_file']} (code)
  and {figures['conv']['provenance']['first_timestamp_in_file']} (conv).

## How they were derived

`{command}` on {today}: `labkit.traces.load_trace` reads each CSV, `labkit.traces.summarise`
reduces it to a request count, duration, arrival and token rates, inter-arrival gaps, and for
prompt (`ContextTokens`) and output (`GeneratedTokens`) lengths the mean, quantiles
(p10–p99, linear interpolation), max and a histogram with bin edges at 10^(k/10) tokens. Floats
keep 6 significant digits. `tests/test_traces.py` re-derives them from the CSVs when present and
requires equality with these files.

| file | service | requests | arrivals per s | prompt p50 / p99 | output p50 / p99 |
|---|---|---|---|---|---|
{rows}

`labkit.traces.sample_requests(load_summary("conv"), n, seed)` draws synthetic requests from
these histograms, labelled "{traces.SAMPLED_LABEL}" (prompt and output lengths independently).
"""


def to_json(summary: dict) -> str:
    """Indented JSON with each list of numbers on one line, so a histogram is one line of diff."""
    text = json.dumps(summary, indent=1, ensure_ascii=False)
    return re.sub(r"\[[\d\s.,eE+-]*\]", lambda m: json.dumps(json.loads(m.group(0))), text) + "\n"


def _row(name: str, s: dict) -> str:
    p, o = s["prompt_tokens"], s["output_tokens"]
    return (f"| {name}.json | {s['provenance']['service']} | {s['count']:,} | {s['arrival_rate_per_s']:.2f} "
            f"| {p['p50']:,.0f} / {p['p99']:,.0f} | {o['p50']:,.0f} / {o['p99']:,.0f} |")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("csv_dir", nargs="?", type=Path, default=DEFAULT_CSV_DIR)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT_DIR)
    args = parser.parse_args(argv)
    command = " ".join(["python scripts/derive_trace_figures.py", *(argv if argv is not None else sys.argv[1:])])
    today = datetime.date.today().isoformat()
    figures = derive(args.csv_dir, command.strip(), today)
    args.out.mkdir(parents=True, exist_ok=True)
    for name, summary in figures.items():
        (args.out / f"{name}.json").write_text(to_json(summary))
    (args.out / "README.md").write_text(readme(figures, command.strip(), today))
    print(f"wrote {', '.join(f'{n}.json' for n in figures)} and README.md to {args.out}")


if __name__ == "__main__":
    main()
