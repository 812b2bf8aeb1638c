"""The CLI's training harness: tiny LLaMA-style byte LM, corpora, worker runs, reports.

Modules: ``presets`` (every preset: run lengths per command), ``args`` (command-line arguments to
TrainSpecs and the output folder), ``errors`` (SpecError, UsageError), ``model`` (TinyLlama),
``corpus`` (stdlib / user text, file-level split), ``spec`` (TrainSpec: every knob), ``worker`` (one
run on one rank, and the data-parallel baseline), ``strategies`` (runtime strategy factory, comm
totals), ``runner`` (specs on worker processes through ``runtime.launch``, progress bars),
``report`` (table, JSON, plots), ``logreg`` (LOSCAR's logistic-regression task), ``studies`` (the
open-question experiments), ``profile`` (timeline picture), ``commands`` (what each CLI command runs).
"""
