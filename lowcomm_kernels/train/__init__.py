"""The CLI's training harness: tiny LLaMA-style byte LM, corpora, worker runs, reports.

Modules: ``presets`` (every preset: run lengths per command), ``args`` (command-line arguments to
TrainSpecs and the output folder), ``errors`` (SpecError, UsageError), ``model`` (TinyLlama),
``corpus`` (stdlib / user text, file-level split), ``spec`` (TrainSpec: every knob), ``worker`` (one
run on one rank, and the data-parallel baseline), ``strategies`` (runtime strategy factory, comm
totals), ``runner`` (specs on worker processes through ``runtime.launch``, progress bars),
``tasks`` (``lm``: the byte LM's runs, table and plots; ``mlp``: the digits MLP; ``logreg``:
LOSCAR's logistic regression; ``common``: what the small tasks share), ``report`` (table, JSON,
plots), ``studies`` (every study by name: its configurations, command and renderer; the CoCoDC
open questions), ``study_cocodc`` and ``study_loscar`` (studies with tables of their own),
``studykit`` (what every study shares), ``profile`` and ``timeline`` (the timeline picture),
``faults`` (``--faults``: torchft replicas), ``render`` (``lowcomm report``), ``commands`` (what
each CLI command runs). No import circle inside the package (tests/test_layers.py).
"""
