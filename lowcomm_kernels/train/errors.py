"""The harness's input errors (a leaf module: the model, the spec and the command line all raise them).

- :class:`SpecError`: a bad knob of a :class:`~lowcomm_kernels.train.spec.TrainSpec` or
  :class:`~lowcomm_kernels.train.model.ModelConfig`. Its message marks each knob as ``<field>``, so
  that Python callers read the field names and the command line reads the flags the user typed.
- :class:`UsageError`: bad command-line input, printed as one line on stderr with exit code 2.
"""

from __future__ import annotations

import re
from collections.abc import Mapping

_FIELD = re.compile(r"<([\w.]+)>")


class SpecError(ValueError):
    """A bad knob. ``template`` names knobs as ``<field>``; ``str()`` shows the field names and
    :meth:`render` the names a front end gives them (e.g. ``{"fragment_sync_delay": "--delay"}``)."""

    def __init__(self, template: str) -> None:
        super().__init__(template)
        self.template = template

    def render(self, names: Mapping[str, str] | None = None) -> str:
        names = names or {}
        return _FIELD.sub(lambda m: names.get(m[1], m[1]), self.template)

    def __str__(self) -> str:
        return self.render()


class UsageError(Exception):
    """Bad command-line input: printed as one line on stderr, exit code 2."""
