"""What each lesson's charts show, as plain data: lists of numbers keyed by name.

Views (`labkit.views`) only turn these into traces, so every number on a chart comes from here,
and everything here comes from `roofline` (predicted) or `sweeps` records (measured). No plotly,
no widgets, no torch: this package is testable headless and importable on a GPU image.

  points   for every lesson: grids, measured points as series, what to say about a point
  phases   lesson 01: the roofline's curve, both phases on it, the predicted lines (plan, kernels
           in turn, cache tiers) measured points are drawn against
  prefill  lessons 02 and 03: prefill's two terms, FlashAttention
  decode   lessons 02 and 04: the breakdown of one step, decode's cache read and batching
  serving  lessons 05-07: schedulers, chunked prefill, workload shapes

The notebooks and views call `explore.<name>`: the names below.
"""
from __future__ import annotations

from .decode import (batches_through_ridge, breakdown_bars, breakdown_line, breakdown_setting, cache_share_curves,
                     chapter_decode_choices, context_prediction, decode_readout, read_sizes_line, regime_bands,
                     throughput_prediction, throughput_series)
from .phases import (decode_prediction, fix_lists, phase_points, prefill_prediction, roofline_curve, tier_marks,
                     with_plan_and_tiers)
from .points import (HOST_BOUND_NOTE, IN_TURN_LABEL, IN_TURN_PARTS, L2_RESIDENT_NOTE, PLAN_LABEL, above_roof_note,
                     as_sample, efficiency_sentence, in_turn_parts, log_grid, measured_series, moment_note,
                     over_roof_note, point_notes, point_summary, recorded_series, reveal, roof_phrase, spread)
from .prefill import (attention_traffic, growth, growth_line, histogram, memory_series, prefill_cost_table,
                      prefill_split_prediction, prefill_terms, share_curves)
from .serving import (batching_bars, batching_line, chunk_view, interference_bars, interference_rows,
                      interference_series, lever_rows, measured_split, predicted_split, scaled_balance, scaled_shapes,
                      served_lines, split_dtype, split_extremes, split_extremes_line, step_time_curves)
