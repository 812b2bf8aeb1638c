"""The Streaming DiLoCo paper's simulation setting and its published table (Douillard et al. 2025,
arXiv 2501.18512 v1, Table 4 in the supplementary material, and §3.1).

The setting, as the paper states it: models of 1B / 10B / 100B parameters with 24 / 48 / 108 layers
and pure-compute step times of 0.1 / 0.8 / 4.9 s; H = 100 for DiLoCo and every streaming variant;
fragments of 3 layers (8 / 16 / 36 fragments) in the strided pattern, its default; the overlapped
variants with τ = 1 (the paper's example and its main experiments); the FP4 variant in E3M0
(4 bits per value and no scales: the wire "fp4_e3m0_noscale"). The simulator models only the link
between datacentres, with no latency term.

What the paper does not state and we chose (docs/simulator.md gives the evidence for each): two
replicas (its LLM experiments'); gradients and outer gradients travel in bf16 (16 bits per value);
its step times are taken as given (its text names MFU 40 % in one place and 60 % in another).
"""

from __future__ import annotations

from .link import Link
from .methods import Method
from .workload import Workload

MODELS = {  # name -> (parameters, layers, step seconds)
    "1B": (1e9, 24, 0.1),
    "10B": (10e9, 48, 0.8),
    "100B": (100e9, 108, 4.9),
}

#: the five methods of the paper's table, in its order: our name -> (its name, the method)
METHODS = {
    "data-parallel": ("Data-Parallel", Method("data-parallel", wire="bf16")),
    "diloco": ("Vanilla DiLoCo", Method("diloco", sync_every=100, wire="bf16")),
    "streaming": ("Streaming DiLoCo", Method("streaming", sync_every=100, wire="bf16")),
    "streaming-overlap": (
        "Streaming DiLoCo w/ overlapped com.",
        Method("streaming", sync_every=100, overlap=1, wire="bf16"),
    ),
    "streaming-overlap-fp4": (
        "Streaming DiLoCo w/ overlapped FP4 com.",
        Method("streaming", sync_every=100, overlap=1, wire="fp4_e3m0_noscale"),
    ),
}

#: Gbit/s to reach a compute utilisation of 50 / 80 / 90 / 95 / 99 %, as published (Table 4)
PUBLISHED = {
    ("1B", "data-parallel"): (86.8, 152.6, 184.2, 222.3, 569.0),
    ("1B", "diloco"): (1.4, 6.2, 13.3, 23.3, 86.8),
    ("1B", "streaming"): (1.4, 5.2, 9.1, 16.0, 28.1),
    ("1B", "streaming-overlap"): (1.4, 4.3, 6.2, 9.1, 11.0),
    ("1B", "streaming-overlap-fp4"): (0.4, 0.9, 1.7, 2.0, 3.0),
    ("10B", "data-parallel"): (104.8, 222.3, 222.3, 268.3, 471.5),
    ("10B", "diloco"): (1.7, 7.5, 16.0, 33.9, 104.8),
    ("10B", "streaming"): (1.7, 5.2, 9.1, 13.3, 19.3),
    ("10B", "streaming-overlap"): (1.7, 3.6, 5.2, 6.2, 7.5),
    ("10B", "streaming-overlap-fp4"): (0.4, 0.9, 1.4, 1.4, 1.7),
    ("100B", "data-parallel"): (184.2, 323.8, 390.7, 390.7, 471.5),
    ("100B", "diloco"): (3.0, 11.0, 23.3, 49.4, 184.2),
    ("100B", "streaming"): (2.4, 6.2, 9.1, 11.0, 19.3),
    ("100B", "streaming-overlap"): (1.7, 3.6, 4.3, 5.2, 5.2),
    ("100B", "streaming-overlap-fp4"): (0.5, 0.9, 1.1, 1.1, 1.4),
}


def workload(model: str) -> Workload:
    params, layers, step_s = MODELS[model]
    return Workload.uniform(model, params, layers, step_s)


def link(gbps: float = 1.0) -> Link:
    return Link(gbps, latency_s=0.0, replicas=2)
