"""Charts and the lessons' widgets. Needs plotly and ipywidgets (the Jupyter side only).

Figures are built from `labkit.explore` data. Every lesson widget is a `LessonWidget`: controls
in, one labkit call per change, figures out, the error line under the charts, a status line; a
lesson's own widget only names its controls, its call and its figures. Every widget is
constructible headless (tests build them with no browser) and shows errors as one line under
itself instead of a traceback.

  base      the colours, a live chart (`LiveFigure`), the error line, the one widget base, the
            predict-first widget, the controls
  measured  every lesson's measured-beside-predicted chart, `SliderLab` and `MeasureLab`
  prefill   lessons 01-03: the roofline, prefill's two terms, FlashAttention
  decode    lessons 02 and 04: where a step's time goes, decode's cache read
  serving   lessons 05-07: batching, chunked prefill, workload shapes
  _plotly   plotly and ipywidgets, imported once (without the checker that cost 3-5 s a kernel start)

The notebooks call `views.<name>`: the names below.
"""
from __future__ import annotations

from ._plotly import widgets
from .base import (ATTENTION, IN_TURN, LINEAR, MEASURED, NOISY, PLAN, PREDICTED, TIER, ErrorLine, LessonWidget,
                   LiveFigure, Predict, after_estimate, int_slider, progress, table, table_html, toggle)
from .decode import (BreakdownLab, breakdown_figure, cache_share_figure, decode_readout_figure, draw_decode,
                     set_breakdown, set_decode_readout, throughput_figure)
from .measured import (MeasureLab, SliderLab, add_band, add_recorded, add_tier_marks, measured_vs_predicted_figure,
                       set_measured)
from .prefill import (ToggleView, cost_bars_figure, error_histogram_figure, memory_figure, prefill_split_figure,
                      prefill_terms_figure, roofline_figure, set_share_curves, share_figure, traffic_figure)
from .serving import (BatchingLab, ChunkLab, SplitLab, batching_figure, interference_bars_figure, interference_figure,
                      set_batching, set_interference, set_interference_bars, set_split, split_figure, split_labels,
                      step_time_figure)
