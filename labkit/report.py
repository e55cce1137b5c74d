"""`make report`: each lesson as one static HTML file that needs no network.

A pre-run lesson's sliders and live charts are widgets. nbconvert's HTML draws widgets only by
loading a widget manager from a CDN, and even online that manager cannot draw a chart held in an
ipywidgets Output (plotly's renderer is a JupyterLab extension): the measured-vs-predicted charts,
the reason to pre-run on a GPU, came out blank. `static_widgets`, an nbconvert preprocessor,
replaces each widget output with what it showed: the controls' settings as one line, each chart as
a static plotly chart, and the status or error line under it; it drops the widget state. It turns
every other plotly chart (plotly's JSON mime type, which nbconvert cannot draw) into the same static
chart, and inlines plotly.js once per page, before its first chart.

`ReportExporter` is nbconvert's HTML exporter (the `lab` template) with that preprocessor and
without the template's scripts from cdnjs.cloudflare.com: require.js (no output here uses it),
MathJax and mermaid (no lesson has LaTeX or a mermaid diagram; tests/test_report.py checks). The
page then loads nothing from another host. `make report` runs
`jupyter nbconvert --to labkit.report.ReportExporter`. Jupyter side only; needs plotly.
"""
from __future__ import annotations

import html

import jinja2
import plotly.io as pio
from nbconvert import HTMLExporter
from nbformat.v4 import new_markdown_cell, new_output
from traitlets import default

from . import cpu_info
from .recordings import git_commit

WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
WIDGET_STATE = "application/vnd.jupyter.widget-state+json"
PLOTLY = "application/vnd.plotly.v1+json"
PLOTLYJS_MARK = "window.PlotlyConfig"  # in every inline copy of plotly.js plotly writes (to_html, notebook renderer)

TEMPLATE_NAME = "labkit_report.html.j2"
TEMPLATE = """{%- extends 'index.html.j2' -%}
{%- block html_head_js_requirejs -%}{%- endblock html_head_js_requirejs -%}
{%- block html_head_js_mathjax -%}{%- endblock html_head_js_mathjax -%}
{%- block html_head_js_mermaidjs -%}{%- endblock html_head_js_mermaidjs -%}
{%- block jupyter_widgets -%}{%- endblock jupyter_widgets -%}
"""


class ReportExporter(HTMLExporter):
    """nbconvert's HTML with `static_widgets` applied and no script from another host."""

    export_from_notebook = None  # not offered in JupyterLab's "Save and Export Notebook As"

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.register_preprocessor(static_widgets, enabled=True)
        self.register_preprocessor(add_provenance, enabled=True)

    # A handout, not a notebook: no "In [3]:" beside the code, no "Out[3]:" beside a chart.
    @default("exclude_input_prompt")
    def _exclude_input_prompt_default(self):
        return True

    @default("exclude_output_prompt")
    def _exclude_output_prompt_default(self):
        return True

    @default("template_file")
    def _template_file_default(self):
        return TEMPLATE_NAME

    @default("extra_loaders")
    def _extra_loaders_default(self):
        return [jinja2.DictLoader({TEMPLATE_NAME: TEMPLATE})]


def add_provenance(nb, resources):
    """nbconvert preprocessor: one line above the lesson saying when it ran (papermill's start), with
    which parameters, at which commit of the lab, on which CPU; the charts name the device they
    measured on. A handout read later must say where its numbers come from (a report had only the
    calibration's date, which can be older than the measurements)."""
    run = nb.metadata.get("papermill", {})
    when = str(run.get("start_time") or "an unrecorded date").replace("T", " ")[:19]
    params = ", ".join(f"{k} = {v!r}" for k, v in (run.get("parameters") or {}).items()) or "the lesson's own"
    commit = git_commit() or "unknown"
    line = (f"*Run {when} UTC with parameters {params}, the lab at commit {commit[:12]}, on a machine whose "
            f"CPU is {cpu_info.cpu_identity()}; each chart names the device it measured on. The text keeps "
            "the chapter's figures (an H100), whatever the parameters.*")
    nb.cells.insert(0, new_markdown_cell(line))
    return nb, resources


def static_widgets(nb, resources):
    """nbconvert preprocessor: every widget output -> a display_data of static HTML (or nothing,
    for a widget that shows nothing); every plotly chart -> static HTML; plotly.js on the page once,
    before the first chart; the notebook's widget state removed."""
    states = nb.metadata.get("widgets", {}).get(WIDGET_STATE, {}).get("state", {})
    page_has_plotlyjs = False  # plotly.js must be on the page before the first chart's script
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        outputs = []
        for output in cell.outputs:
            data = output.get("data", {})
            if WIDGET_VIEW in data:
                pieces = shown_by(data[WIDGET_VIEW].get("model_id", ""), states)
                if pieces:
                    outputs.append(new_output("display_data", data={"text/html": to_html(pieces, not page_has_plotlyjs)}))
                    page_has_plotlyjs = page_has_plotlyjs or any(kind == "chart" for kind, _ in pieces)
            elif PLOTLY in data:  # a chart shown outside a widget; any HTML copy of it is replaced
                output["data"] = {"text/html": to_html([("chart", data[PLOTLY])], not page_has_plotlyjs)}
                output["metadata"] = {}
                outputs.append(output)
                page_has_plotlyjs = True
            elif PLOTLYJS_MARK in str(data.get("text/html", "")):  # plotly's notebook renderer's plotly.js
                if not page_has_plotlyjs:
                    outputs.append(output)
                page_has_plotlyjs = True
            else:
                outputs.append(output)
        cell.outputs = outputs
    nb.metadata.pop("widgets", None)
    return nb, resources


def shown_by(model_id: str, states: dict) -> list[tuple[str, object]]:
    """What widget `model_id` and its children show, in page order: ("setting", "name: value"),
    ("chart", plotly figure dict) and ("html", an HTML widget's value)."""
    pieces: list[tuple[str, object]] = []
    _walk(model_id, states, pieces, seen=set())
    return pieces


def _walk(model_id, states, pieces, seen):
    if model_id in seen or model_id not in states:
        return
    seen.add(model_id)
    state = states[model_id].get("state", {})
    name = state.get("_model_name", "")
    if name == "OutputModel":
        pieces.extend(("chart", out["data"][PLOTLY]) for out in state.get("outputs", [])
                      if PLOTLY in out.get("data", {}))
    elif name == "HTMLModel" and state.get("value"):
        pieces.append(("html", state["value"]))
    elif not state.get("description"):
        pass  # a control with no name is no setting: a Predict's answer, which its reveal shows
    elif name.endswith("SliderModel") and "value" in state:
        pieces.append(("setting", f"{state['description']}: {state['value']}"))
    elif "_options_labels" in state and state.get("index") is not None:  # toggle buttons, dropdowns
        pieces.append(("setting", f"{state['description']}: {state['_options_labels'][state['index']]}"))
    for child in state.get("children", []):
        _walk(str(child).removeprefix("IPY_MODEL_"), states, pieces, seen)


def to_html(pieces: list[tuple[str, object]], include_plotlyjs: bool) -> str:
    """The pieces as one HTML fragment; plotly.js inlined with the first chart if asked; no MathJax."""
    parts, settings = [], [text for kind, text in pieces if kind == "setting"]
    if settings:
        parts.append(f"<p><em>settings when the notebook finished:</em> {html.escape(' · '.join(settings))}</p>")
    for kind, value in pieces:
        if kind == "chart":
            figure = {key: value[key] for key in ("data", "layout") if key in value}
            parts.append(pio.to_html(figure, include_plotlyjs=include_plotlyjs, include_mathjax=False,
                                     full_html=False, config=value.get("config"), validate=False))
            include_plotlyjs = False
        elif kind == "html":
            parts.append(f"<div>{value}</div>")  # an HTML widget's value is HTML labkit wrote
    return "\n".join(parts)
