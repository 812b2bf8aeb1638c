"""Run a lowcomm strategy inside Hugging Face ``Trainer.train()`` with one callback.

    from transformers import Trainer, TrainingArguments
    from lowcomm_kernels.integrations.huggingface import LowCommCallback

    callback = LowCommCallback("streaming", sync_every=100, num_fragments=4, fragment_sync_delay=5)
    args = TrainingArguments("out", max_steps=1000, use_cpu=True, ddp_backend="gloo")
    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[callback])
    trainer.train()  # under torchrun: one replica per rank, synchronised by the strategy

What the callback does, event by event:

- ``on_init_end`` (the end of ``Trainer(...)``): refuses the settings that contradict one full
  replica per rank or that the next step would silently switch off (``fp16``/``bf16`` autocast,
  ``torch_compile``, FSDP, DeepSpeed), then marks the model as already prepared for Accelerate
  (``_is_accelerate_prepared``, Accelerate's guard against wrapping a model twice). Under
  ``torchrun`` the Trainer would otherwise wrap the model in ``DistributedDataParallel``, which
  all-reduces the gradients of every step: with a lowcomm strategy each rank trains its own replica
  and only the strategy communicates. The data loader is still sharded by rank.
- ``on_train_begin``: builds the strategy from the model and the Trainer's optimizer (the torch
  optimizer inside Accelerate's wrapper) and enters it (``with strategy:``), which hooks the
  optimizer's step. The strategy therefore advances once per *optimizer* step: with
  ``gradient_accumulation_steps = k`` it counts optimizer steps, not micro-batches, and
  ``sync_every`` and the other schedule knobs are in optimizer steps (``state.global_step``). When
  the Trainer resumes from ``<output_dir>/checkpoint-N``, this rank's strategy, model and optimizer
  state are restored from ``lowcomm-rank{rank}.pt`` in that folder.
- ``on_save``: writes this rank's ``save_checkpoint`` (strategy, model and optimizer state: the
  replicas differ between syncs, so the Trainer's single ``model.safetensors`` is rank 0's) into
  the Trainer's checkpoint folder as ``lowcomm-rank{rank}.pt``.
- ``on_train_end``: leaves the strategy (draining in-flight collectives), applies every in-flight
  sync now (``finish()``) and releases the model (``close()``). ``callback.strategy`` stays
  readable afterwards (``.metrics``).

The ranks' parameters are identical right after a sync of every fragment (e.g. after DiLoCo's
steps ``sync_every``, ``2·sync_every``, ...), not in between: end on such a step (``max_steps`` a
multiple of ``sync_every`` for DiLoCo) when the final model should be the global one.

``transformers`` is an optional dependency (``pip install 'lowcomm-kernels[hf]'``); this module
imports it, the rest of the package never does.
"""

from __future__ import annotations

import inspect
import os
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from ..runtime import LOSCAR, CoCoDC, DiLoCo, Strategy, StreamingDiLoCo

try:
    from transformers import TrainerCallback
    from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR
except ImportError as e:  # pragma: no cover - exercised in a subprocess without transformers
    raise ImportError(
        "lowcomm_kernels.integrations.huggingface needs transformers and accelerate: "
        "pip install 'lowcomm-kernels[hf]'"
    ) from e

__all__ = ["METHODS", "LowCommCallback", "checkpoint_file"]

#: method name -> strategy class (the names the ``lowcomm`` CLI uses, plus the classes' own)
METHODS: dict[str, type[Strategy]] = {
    "diloco": DiLoCo,
    "streaming": StreamingDiLoCo,
    "streaming_diloco": StreamingDiLoCo,
    "cocodc": CoCoDC,
    "loscar": LOSCAR,
}

StrategyFactory = Callable[[nn.Module, torch.optim.Optimizer], Strategy]

_PREPARED = "_is_accelerate_prepared"  # Accelerate's own double-wrap guard (Accelerator.prepare_model)


def checkpoint_file(folder: str | os.PathLike, rank: int) -> str:
    """Where ``LowCommCallback`` keeps ``rank``'s strategy state inside a Trainer checkpoint folder."""
    return os.path.join(folder, f"lowcomm-rank{rank}.pt")


def _keywords(cls: type[Strategy]) -> tuple[set[str], set[str]]:
    """(every keyword the strategy's constructors accept, the ones without a default)."""
    known: set[str] = set()
    required: set[str] = set()
    for i, klass in enumerate(k for k in cls.__mro__ if issubclass(k, Strategy)):
        for p in inspect.signature(klass.__init__).parameters.values():
            if p.kind is p.KEYWORD_ONLY:
                known.add(p.name)
                if i == 0 and p.default is p.empty:
                    required.add(p.name)
    return known, required


def _torch_optimizer(opt: object) -> torch.optim.Optimizer:
    """The torch optimizer that actually steps: Accelerate wraps it (``AcceleratedOptimizer``), and
    the wrapper's ``step`` calls the inner one, whose step hooks drive the strategy."""
    while isinstance(getattr(opt, "optimizer", None), torch.optim.Optimizer):
        opt = opt.optimizer  # type: ignore[attr-defined]
    if not isinstance(opt, torch.optim.Optimizer):
        raise TypeError(f"the Trainer's optimizer is not a torch.optim.Optimizer: {type(opt).__name__}")
    return opt


class LowCommCallback(TrainerCallback):
    """A ``transformers.TrainerCallback`` that trains under a lowcomm strategy (see the module doc).

    Parameters
    ----------
    method:
        ``'diloco'``, ``'streaming'`` (or ``'streaming_diloco'``), ``'cocodc'`` or ``'loscar'``,
        with that strategy's keyword arguments in ``strategy_kwargs`` (``sync_every=``, ``wan=``,
        ``process_group=`` ...); or a callable ``(model, optimizer) -> Strategy`` that builds the
        strategy itself (then no keyword arguments).
    save_checkpoints:
        write each rank's strategy state into the Trainer's checkpoints (``on_save``) and restore
        it when the Trainer resumes; default True.

    Pass it to ``Trainer(callbacks=[...])``: it must see the model when the Trainer is built.
    """

    def __init__(
        self,
        method: str | StrategyFactory,
        *,
        save_checkpoints: bool = True,
        **strategy_kwargs: Any,
    ) -> None:
        if not isinstance(save_checkpoints, bool):
            raise TypeError(f"save_checkpoints must be a bool, got {type(save_checkpoints).__name__}")
        if isinstance(method, str):
            if method not in METHODS:
                raise ValueError(
                    f"method must be one of {tuple(METHODS)} or a callable (model, optimizer) -> "
                    f"Strategy, got {method!r}"
                )
            cls = METHODS[method]
            known, required = _keywords(cls)
            known -= {"model", "inner_optimizer"}
            unknown = sorted(set(strategy_kwargs) - known)
            if unknown:
                raise TypeError(
                    f"{cls.__name__} has no keyword argument {unknown[0]!r} (method={method!r}); "
                    f"it takes {sorted(known)}"
                )
            missing = sorted(required - set(strategy_kwargs))
            if missing:
                raise TypeError(f"method={method!r} needs {', '.join(f'{m}=' for m in missing)}")
            self.factory: StrategyFactory = lambda model, opt: cls(model, opt, **strategy_kwargs)
            self.method = method
        elif callable(method):
            if strategy_kwargs:
                raise TypeError(
                    f"method is a strategy factory, so keyword arguments ({sorted(strategy_kwargs)}) "
                    "belong in the factory itself"
                )
            self.factory = method
            self.method = getattr(method, "__name__", type(method).__name__)
        else:
            raise TypeError(
                f"method must be a method name {tuple(METHODS)} or a callable (model, optimizer) -> "
                f"Strategy, got {type(method).__name__}"
            )
        self.save_checkpoints = save_checkpoints
        self.strategy: Strategy | None = None
        self._marked: nn.Module | None = None  # the model seen at Trainer construction
        self._active = False

    # ----- Trainer construction ------------------------------------------------------------------
    def on_init_end(self, args, state, control, model: nn.Module | None = None, **kwargs: Any) -> None:
        refused = [
            ("fp16", bool(args.fp16), "autocast"),
            ("bf16", bool(args.bf16), "autocast"),
            ("torch_compile", bool(args.torch_compile), "compilation"),
            ("fsdp", bool(args.fsdp), "sharding"),
            ("deepspeed", bool(args.deepspeed), "sharding"),
        ]
        for name, on, what in refused:
            if on:
                raise ValueError(
                    f"TrainingArguments.{name} is set, which LowCommCallback does not support: every rank "
                    f"trains a full replica that Accelerate must not wrap, and its {what} would be "
                    "switched off or contradict that. Unset it (or convert / compile the model yourself "
                    "before building the Trainer)."
                )
        if model is None:
            raise ValueError("LowCommCallback: the Trainer has no model (model_init is not supported)")
        # Accelerate returns a model carrying this mark from prepare() unchanged: no DDP wrapper
        setattr(model, _PREPARED, True)
        self._marked = model

    # ----- training ------------------------------------------------------------------------------
    def on_train_begin(self, args, state, control, model: nn.Module | None = None, **kwargs: Any) -> None:
        if self._active:  # a previous train() stopped by an exception never reached on_train_end
            self._release(drain=False)
        if model is None or model is not self._marked:
            raise RuntimeError(
                "LowCommCallback did not see this model when the Trainer was built (trainer.add_callback "
                "after construction, or model_init), so the Trainer may have wrapped it in "
                "DistributedDataParallel, which averages every step's gradients. Pass the callback as "
                "Trainer(..., callbacks=[LowCommCallback(...)])."
            )
        if not (dist.is_available() and dist.is_initialized()):
            raise ValueError(
                "LowCommCallback: torch.distributed is not initialised. Launch the script with torchrun "
                "(TrainingArguments then initialises it; on CPUs use ddp_backend='gloo'), or call "
                "dist.init_process_group(...) before trainer.train() (a group of size 1 is fine)."
            )
        optimizer = kwargs.get("optimizer")
        if optimizer is None:
            raise RuntimeError("LowCommCallback: the Trainer has no optimizer at on_train_begin")
        strategy = self.factory(model, _torch_optimizer(optimizer))
        if not isinstance(strategy, Strategy):
            raise TypeError(
                f"the strategy factory returned a {type(strategy).__name__}, not a lowcomm Strategy"
            )
        self.strategy = strategy
        if state.global_step > 0:  # the Trainer resumed from checkpoint-<global_step>
            self._resume(args, state.global_step)
        strategy.__enter__()
        self._active = True

    def on_save(self, args, state, control, **kwargs: Any) -> None:
        if not (self.save_checkpoints and self._active and self.strategy is not None):
            return
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        os.makedirs(folder, exist_ok=True)
        self.strategy.save_checkpoint(checkpoint_file(folder, dist.get_rank()))

    def on_train_end(self, args, state, control, **kwargs: Any) -> None:
        if self._active:
            self._release(drain=True)

    # ----- helpers -------------------------------------------------------------------------------
    def _resume(self, args, step: int) -> None:
        assert self.strategy is not None
        if not self.save_checkpoints:
            return
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{step}")
        path = checkpoint_file(folder, dist.get_rank())
        if not os.path.isfile(path):
            raise FileNotFoundError(
                f"the Trainer resumes at step {step} but {path} does not exist: LowCommCallback reads "
                "each rank's strategy state from the checkpoint folder in args.output_dir that the "
                "Trainer wrote at that step (resume_from_checkpoint elsewhere, or a checkpoint written "
                "without the callback, cannot restore it; pass save_checkpoints=False to start the "
                "strategy afresh)"
            )
        self.strategy.load_checkpoint(path)

    def _release(self, drain: bool) -> None:
        strategy = self.strategy
        assert strategy is not None
        self._active = False
        if drain:
            strategy.__exit__(None, None, None)
            strategy.finish()
        else:
            strategy.__exit__(RuntimeError, None, None)  # unhook only: nothing more is collective
        strategy.close()
