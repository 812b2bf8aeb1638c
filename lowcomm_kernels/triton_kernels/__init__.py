"""Triton backend: one module per op, each with ``_<op>_kernel`` (``@triton.jit``) and a
``launch_<op>`` launcher that writes into buffers the caller provides. The reductions
(``launch_fragment_norms``, ``launch_taylor_norms``) also allocate a small float64 scratch of
per-program partial sums, and ``launch_topk_encode`` an int32 row of selected indices per chunk; the
other launchers allocate nothing. Every launch runs inside
``_launch.on_device(t)``, on the data's device and that device's current stream, whatever device
is current; no launcher reads device data on the host.

The op modules in ``lowcomm_kernels.ops`` register these launchers by name and import them when
a ``triton`` launch runs, so importing the package never imports Triton. Kernels are plain
``@triton.jit`` functions launched directly, not ``torch.library.triton_op``: on CPU under
``TRITON_INTERPRET=1`` a ``triton_op`` breaks ``opcheck`` and ``torch.compile`` (docs/design.md);
the ops layer registers the ops with ``custom_op`` instead.

``TRITON_INTERPRET`` is read by Triton when a kernel is *decorated*, i.e. when one of these
modules is first imported: set it before that.
"""
