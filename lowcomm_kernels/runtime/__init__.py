"""The overlapping runtime: DiLoCo, Streaming DiLoCo, CoCoDC and LOSCAR-SGD as drop-in wrappers
around a model and its inner optimizer (see ``base`` for the loop API, docs/algorithms.md for the maths).

Modules, one concept each: ``fragments`` (flat buffers), ``transport`` (async collectives, WAN
emulation, timeouts), ``compression`` (quantized wire formats: the quantized all-reduce, error
feedback), ``metrics``, ``sinks`` (metrics_callback targets: TensorBoard, logging),
``base`` (hooking, checkpoints, guard), ``dense`` (DiLoCo, Streaming DiLoCo), ``cocodc``,
``loscar``, ``topology`` (regions x data-parallel groups), ``amp`` (GradScaler: counting skipped
steps), ``sharding`` (DTensor / FSDP2 parameters: local shards, replica groups), ``membership``
(whom a strategy syncs with: a fixed process group, or torchft replicas through ``ft``).
"""

from .amp import GradScalerError
from .base import CheckpointError, ConsistencyError, Strategy
from .cocodc import CoCoDC
from .dense import DiLoCo, StreamingDiLoCo
from .fragments import FlatFragments, find_blocks, plan_fragments
from .loscar import LOSCAR
from .metrics import RuntimeMetrics, SyncRecord
from .sinks import LoggingSink, MultiSink, TensorBoardSink
from .topology import region_groups
from .transport import WAN, SyncError, Transport

__all__ = [
    "CheckpointError",
    "CoCoDC",
    "ConsistencyError",
    "DiLoCo",
    "FlatFragments",
    "GradScalerError",
    "LOSCAR",
    "LoggingSink",
    "MultiSink",
    "RuntimeMetrics",
    "Strategy",
    "StreamingDiLoCo",
    "SyncError",
    "SyncRecord",
    "TensorBoardSink",
    "Transport",
    "WAN",
    "find_blocks",
    "plan_fragments",
    "region_groups",
]
