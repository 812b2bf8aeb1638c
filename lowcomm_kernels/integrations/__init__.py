"""Integrations with other libraries, one module each, above the runtime.

Each module imports its optional dependency when it is itself imported (``import lowcomm_kernels``
never does), and says which extra to install when the dependency is missing:

- ``huggingface``: ``LowCommCallback``, a ``transformers.TrainerCallback`` that runs any strategy
  inside ``Trainer.train()`` (``pip install 'lowcomm-kernels[hf]'``).
"""
