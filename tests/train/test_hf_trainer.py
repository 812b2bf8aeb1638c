"""LowCommCallback: a real Hugging Face Trainer under torchrun (2 gloo ranks) with a real strategy.

Run under ``torchrun``, this file is also the worker: it trains a tiny random ``LlamaForCausalLM``
(nothing downloaded) with ``Trainer`` + ``LowCommCallback`` and writes what each rank saw (a hash of
its parameters after every optimizer step, the strategy's syncs, the logged losses) to JSON, which
the tests read. Under DDP the ranks' parameters would be identical after every step; with the
callback they are identical only right after a sync.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
ENV = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
SEQ = 32
TEXT = b"the quick brown fox jumps over the lazy dog. " * 200


# ----- the worker (torchrun runs this file) ----------------------------------------------------------
def worker(argv: list[str]) -> None:
    import torch.distributed as dist
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from lowcomm_kernels.integrations.huggingface import LowCommCallback
    from lowcomm_kernels.runtime.base import tensor_hash

    p = argparse.ArgumentParser()
    p.add_argument("--out", required=True)
    p.add_argument("--tag", default="run")
    p.add_argument("--method", default="diloco")
    p.add_argument("--kwargs", default='{"sync_every": 4}')
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--grad-accum", type=int, default=2)
    p.add_argument("--save-steps", type=int, default=8)
    p.add_argument("--resume", type=int, default=0, help="resume from checkpoint-N of --out")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    text = torch.tensor(list(TEXT), dtype=torch.long)

    class Windows(torch.utils.data.Dataset):
        def __len__(self) -> int:
            return 512

        def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
            s = (i * 7) % (text.numel() - SEQ)
            x = text[s : s + SEQ]
            return {"input_ids": x, "labels": x}  # the model shifts the labels itself

    class Probe(TrainerCallback):
        def __init__(self) -> None:
            self.hashes: dict[int, int] = {}

        def on_step_end(self, args, state, control, model=None, **kwargs):
            flat = torch.cat([q.detach().reshape(-1) for q in model.parameters()])
            self.hashes[state.global_step] = tensor_hash(flat)

    torch.manual_seed(int(os.environ["RANK"]))  # different inits: the strategy starts all from rank 0's
    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=64,
        intermediate_size=172,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=SEQ,
    )
    model = LlamaForCausalLM(cfg)
    args = TrainingArguments(
        output_dir=a.out,
        max_steps=a.steps,
        per_device_train_batch_size=8,
        gradient_accumulation_steps=a.grad_accum,
        learning_rate=3e-3,
        use_cpu=True,
        ddp_backend="gloo",
        logging_steps=1,
        save_strategy="steps",
        save_steps=a.save_steps,
        report_to=[],
        disable_tqdm=True,
        seed=0,
    )
    callback = LowCommCallback(a.method, **json.loads(a.kwargs))
    probe = Probe()
    trainer = Trainer(model=model, args=args, train_dataset=Windows(), callbacks=[callback, probe])
    resume = os.path.join(a.out, f"checkpoint-{a.resume}") if a.resume else None
    trainer.train(resume_from_checkpoint=resume)
    strategy = callback.strategy
    assert strategy is not None
    rank = dist.get_rank()
    report = {
        "wrapped": type(trainer.model_wrapped).__name__,
        "strategy_steps": strategy.step_count,
        "apply_steps": [s.apply_step for s in strategy.metrics.syncs],
        "hashes": probe.hashes,
        "final_hash": tensor_hash(torch.cat([q.detach().reshape(-1) for q in model.parameters()])),
        "losses": [e["loss"] for e in trainer.state.log_history if "loss" in e],
    }
    with open(os.path.join(a.out, f"{a.tag}-rank{rank}.json"), "w") as f:
        json.dump(report, f)
    # the Trainer never destroys the group it made; one left to interpreter shutdown can abort the
    # process after a good run (SIGABRT, "terminate called without an active exception")
    dist.destroy_process_group()


# ----- the tests -----------------------------------------------------------------------------------
def torchrun(*args: str) -> None:
    exe = shutil.which("torchrun") or str(Path(sys.executable).parent / "torchrun")
    if not Path(exe).exists():
        pytest.skip("torchrun is not on PATH")
    cmd = [exe, "--standalone", "--nproc_per_node", "2", __file__, *args]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=ENV, cwd=ROOT)
    assert proc.returncode == 0, _failure_summary(proc.stdout + proc.stderr)


def _failure_summary(output: str) -> str:
    """What a failed torchrun printed, shortened: its tail ends with the launcher's summary, so the
    failing rank's own words (a traceback, a C++ ``terminate called ... what(): ...``) are picked
    out of the rest first."""
    clues = ("Traceback", "Error", "terminate called", "what()", "Abort", "Signal", "Exception")
    lines = [ln for ln in output.splitlines() if any(c in ln for c in clues) and "lighthouse" not in ln]
    return "\n".join(lines[:60])[-6000:] + "\n----- tail -----\n" + output[-3000:]


def reports(out: Path, tag: str) -> list[dict]:
    found = []
    for r in range(2):
        rep = json.loads((out / f"{tag}-rank{r}.json").read_text())
        rep["hashes"] = {int(k): v for k, v in rep["hashes"].items()}
        found.append(rep)
    return found


@pytest.mark.slow
def test_trainer_runs_diloco_with_local_replicas_syncs_and_resumable_checkpoints(tmp_path):
    pytest.importorskip("transformers", reason="transformers is not installed (the hf extra)")
    # DiLoCo, sync_every=4, 12 optimizer steps of 2 accumulated micro-batches; checkpoints at 8 and 12
    torchrun("--out", str(tmp_path), "--tag", "full")
    r0, r1 = reports(tmp_path, "full")
    for rep in (r0, r1):
        assert rep["wrapped"] == "LlamaForCausalLM"  # not DistributedDataParallel
        assert rep["strategy_steps"] == 12  # optimizer steps, not the 24 micro-batches
        assert rep["apply_steps"] == [4, 8, 12]
        assert sorted(rep["hashes"]) == list(range(1, 13))
    synced = [s for s in range(1, 13) if r0["hashes"][s] == r1["hashes"][s]]
    assert synced == [4, 8, 12]  # identical right after each sync, different replicas in between
    assert r0["final_hash"] == r1["final_hash"]
    losses = r0["losses"]
    assert len(losses) == 12 and losses[-1] < losses[0] - 1.0  # the sentence is learnable in 12 steps
    for step in (8, 12):
        for r in range(2):
            assert (tmp_path / f"checkpoint-{step}" / f"lowcomm-rank{r}.pt").is_file()

    # resume from checkpoint-8: each rank restores its own replica and the strategy's state, and
    # the last 4 steps retrace the uninterrupted run bit for bit
    torchrun("--out", str(tmp_path), "--tag", "resumed", "--resume", "8")
    q0, q1 = reports(tmp_path, "resumed")
    for rep, full in ((q0, r0), (q1, r1)):
        assert rep["strategy_steps"] == 12
        assert rep["apply_steps"] == [12]
        assert {s: rep["hashes"][s] for s in range(9, 13)} == {s: full["hashes"][s] for s in range(9, 13)}
        assert rep["final_hash"] == full["final_hash"]


# ----- bad input (in process, no process group needed) ----------------------------------------------
@pytest.fixture(scope="module")
def hf():
    return pytest.importorskip(
        "lowcomm_kernels.integrations.huggingface", reason="transformers is not installed"
    )


def test_unknown_method_is_named(hf):
    with pytest.raises(ValueError, match=r"method must be one of .*'diloco'.* got 'dilocoo'"):
        hf.LowCommCallback("dilocoo", sync_every=4)


def test_unknown_and_missing_keywords_are_named(hf):
    with pytest.raises(TypeError, match="DiLoCo has no keyword argument 'sync_evry'"):
        hf.LowCommCallback("diloco", sync_evry=4)
    with pytest.raises(TypeError, match="method='streaming' needs .*fragment_sync_delay=.*sync_every="):
        hf.LowCommCallback("streaming", num_fragments=2)
    with pytest.raises(TypeError, match="belong in the factory"):
        hf.LowCommCallback(lambda model, opt: None, sync_every=4)
    with pytest.raises(TypeError, match="method must be a method name"):
        hf.LowCommCallback(3)
    with pytest.raises(TypeError, match="save_checkpoints must be a bool"):
        hf.LowCommCallback("diloco", sync_every=4, save_checkpoints="yes")
    assert hf.LowCommCallback("loscar", density=0.1, local_steps=4, overlap_steps=1).method == "loscar"


def tiny_trainer(tmp_path, callbacks, **arg_overrides):
    from transformers import LlamaConfig, LlamaForCausalLM, Trainer, TrainingArguments

    cfg = LlamaConfig(
        vocab_size=256,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=SEQ,
    )
    x = torch.tensor(list(TEXT[:SEQ]), dtype=torch.long)
    data = [{"input_ids": x, "labels": x}] * 4
    args = TrainingArguments(
        output_dir=str(tmp_path), max_steps=2, use_cpu=True, report_to=[], disable_tqdm=True, **arg_overrides
    )
    return Trainer(model=LlamaForCausalLM(cfg), args=args, train_dataset=data, callbacks=callbacks)


def test_settings_that_contradict_local_replicas_are_refused_at_construction(hf, tmp_path):
    with pytest.raises(ValueError, match="TrainingArguments.torch_compile is set"):
        tiny_trainer(tmp_path, [hf.LowCommCallback("diloco", sync_every=2)], torch_compile=True)


def test_train_without_torch_distributed_says_how_to_launch(hf, tmp_path):
    import torch.distributed as dist

    assert not dist.is_initialized()
    trainer = tiny_trainer(tmp_path, [hf.LowCommCallback("diloco", sync_every=2)])
    with pytest.raises(ValueError, match="torch.distributed is not initialised.*torchrun"):
        trainer.train()


def test_callback_added_after_construction_is_refused(hf, tmp_path):
    trainer = tiny_trainer(tmp_path, [])
    trainer.add_callback(hf.LowCommCallback("diloco", sync_every=2))
    with pytest.raises(RuntimeError, match="did not see this model.*callbacks=\\[LowCommCallback"):
        trainer.train()


def test_missing_transformers_names_the_extra():
    code = (
        "import sys; sys.modules['transformers'] = None\n"
        "try:\n"
        "    import lowcomm_kernels.integrations.huggingface\n"
        "except ImportError as e:\n"
        "    print(e)\n"
        "import lowcomm_kernels, lowcomm_kernels.integrations  # neither needs transformers\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=ENV)
    assert proc.returncode == 0, proc.stderr
    assert "pip install 'lowcomm-kernels[hf]'" in proc.stdout


if __name__ == "__main__":
    worker(sys.argv[1:])
