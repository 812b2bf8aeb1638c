"""Runtime tests over real gloo process groups, and the helpers they share: ``rt_common`` (model,
data, inner step), ``rt_sim`` (the float64 simulator), ``rt_workers`` / ``rt_faults`` / ``rt_chaos``
(functions run on spawned ranks, loaded by file path; they import these helpers as
``tests.runtime.*``, which resolves because the spawned ranks inherit the parent's ``sys.path``)."""
