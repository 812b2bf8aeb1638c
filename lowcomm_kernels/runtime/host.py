"""Reading small device results on the host without stalling the compute stream.

``DeviceToHost(t)`` enqueues a copy of a small tensor into pinned host memory on the current stream
and records an event; ``values()`` waits for that event only (the work enqueued up to the copy,
usually long finished when the value is needed) and returns Python floats. On the CPU it is the
tensor itself. Every host read of a device value in the runtime's sync path goes through this or
through ``Handle.host_values()``; ``tests/runtime/test_host_reads.py`` checks that.
"""

from __future__ import annotations

import torch


class DeviceToHost:
    def __init__(self, t: torch.Tensor) -> None:
        self._event = None
        if t.device.type == "cuda":
            self._host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
            self._host.copy_(t, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record(torch.cuda.current_stream(t.device))
        else:
            self._host = t

    def values(self) -> list[float]:
        if self._event is not None:
            self._event.synchronize()
        return self._host.reshape(-1).tolist()
