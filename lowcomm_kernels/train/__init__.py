"""The CLI's training harness: tiny LLaMA-style byte LM, corpora, worker launcher, reports.

Modules: ``model`` (TinyLlama), ``corpus`` (stdlib / user text, file-level split), ``spec``
(TrainSpec: every knob), ``worker`` (the per-rank loop and the data-parallel baseline),
``strategies`` (runtime strategy factory, metrics), ``launcher`` (spawn + progress),
``report`` (table, JSON, plots), ``logreg`` (LOSCAR's logistic-regression task),
``studies`` (the open-question experiments), ``profile`` (timeline picture).
"""
