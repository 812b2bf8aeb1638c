"""``lowcomm simulate``: what the methods buy at 1B–100B parameters over a WAN link, by simulation.

Rooms: ``workload`` (a step's DAG: layers, parameters, step time), ``link`` (the shared link and
the collectives' cost), ``methods`` (each method's syncs, from the runtime's own schedule rules and
wire formats), ``engine`` (the discrete-event simulation), ``search`` (utilisation at a bandwidth,
bandwidth for a utilisation), ``goodput`` (failures), ``paper`` (the Streaming DiLoCo paper's
setting and its published table), ``command`` (the CLI's tables, JSON and plot).
The maths: docs/simulator.md.
"""

from .engine import SimResult, simulate
from .link import Link
from .methods import KINDS, WIRES, Method
from .workload import Workload

__all__ = ["KINDS", "WIRES", "Link", "Method", "SimResult", "Workload", "simulate"]
