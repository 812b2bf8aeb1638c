"""The tasks the harness trains, each with its data, model, runs on worker processes and its
``lowcomm compare --task`` command.

- ``lm``: the byte-level language model (``--task lm``, the default): the corpus checked against the
  specs, the runs launched through ``train.runner`` (each rank runs ``train.worker``) and their table,
  JSON and plots. Its model and data live in ``train.model`` and ``train.corpus``, which the
  fault-injection runs, the studies and the simulator's check share.
- ``mlp``: a one-hidden-layer MLP on scikit-learn's bundled digits (``--task mlp``), non-convex.
- ``logreg``: LOSCAR's convex setting, logistic regression with heterogeneous workers (``--task logreg``).
- ``common``: what the small tasks share: one spawn for many runs with a progress bar, the loss of
  the worker-averaged and of each worker's own parameters, and refusing the LM's flags.
"""
