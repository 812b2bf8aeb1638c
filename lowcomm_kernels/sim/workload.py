"""What one replica computes per inner step: L layers, their parameters, and the step's pure compute time.

A step is the paper's DAG of 3L − 1 compute nodes, run in order on the replica's accelerators:
the forward of layers 1..L, then the backward of layers L..1, each layer's backward w.r.t. its
activations (absent for layer 1: nothing below it needs the gradient) followed by its backward
w.r.t. its weights, after which that layer's gradient (or outer gradient) may be reduced. Every
compute node takes the same time, ``step_s / (3L − 1)``: the forward is a third of the step and the
backward two thirds, as for a dense transformer (2 and 4 FLOPs per parameter and token).
"""

from __future__ import annotations

from dataclasses import dataclass

#: the Kaplan et al. rule: one training token costs 6 FLOPs per parameter (forward 2, backward 4)
FLOPS_PER_PARAM_TOKEN = 6.0
#: the most layers a workload may have (the largest dense models have a few hundred; each layer is
#: one collective per sync in the layerwise simulation)
MAX_LAYERS = 10_000


def _positive(name: str, value: object) -> float:
    if (
        isinstance(value, bool)
        or not isinstance(value, (int, float))
        or not value > 0
        or value == float("inf")
    ):
        raise ValueError(f"{name} must be a finite number > 0, got {value!r}")
    return float(value)


@dataclass(frozen=True)
class Workload:
    """``layer_params[l]``: parameters of layer l (its share of the embeddings included);
    ``step_s``: pure compute seconds of one inner step (forward + backward, no communication)."""

    name: str
    layer_params: tuple[int, ...]
    step_s: float

    def __post_init__(self) -> None:
        if not self.layer_params:
            raise ValueError("a workload needs at least one layer")
        if len(self.layer_params) > MAX_LAYERS:
            raise ValueError(f"layers must be <= {MAX_LAYERS:,}, got {len(self.layer_params):,}")
        for n in self.layer_params:
            if isinstance(n, bool) or not isinstance(n, int) or n < 1:
                raise ValueError(f"layer parameters must be integers >= 1, got {n!r}")
        _positive("step_s", self.step_s)

    @classmethod
    def uniform(cls, name: str, params: float, layers: int, step_s: float) -> Workload:
        """``params`` spread evenly over ``layers`` layers (the paper's assumption)."""
        params = _positive("params", params)
        if isinstance(layers, bool) or not isinstance(layers, int) or not 1 <= layers <= MAX_LAYERS:
            raise ValueError(f"layers must be an integer in [1, {MAX_LAYERS:,}], got {layers!r}")
        if params < layers:
            raise ValueError(f"params={params:g} must be at least layers={layers}")
        base, extra = divmod(int(round(params)), layers)
        return cls(name, tuple(base + (1 if i < extra else 0) for i in range(layers)), step_s)

    @staticmethod
    def step_from_flops(params: float, tokens_per_step: float, peak_flops: float, mfu: float) -> float:
        """Step time by the 6·N·D rule: 6 × params × tokens / (peak FLOP/s × MFU), where peak is the
        whole replica's (all its accelerators)."""
        params = _positive("params", params)
        tokens = _positive("tokens_per_step", tokens_per_step)
        peak = _positive("peak_flops", peak_flops)
        mfu = _positive("mfu", mfu)
        if mfu > 1:
            raise ValueError(f"mfu must be in (0, 1], got {mfu}")
        return FLOPS_PER_PARAM_TOKEN * params * tokens / (peak * mfu)

    @property
    def layers(self) -> int:
        return len(self.layer_params)

    @property
    def params(self) -> int:
        return sum(self.layer_params)

    @property
    def node_s(self) -> float:
        """Seconds of one compute node of the DAG (3L − 1 per step)."""
        return self.step_s / (3 * self.layers - 1)
