"""Checkpoints as trainers write them: which one is the newest complete one, what it holds, how two
compare (trainguard.unit.checkpoints).

Every checkpoint here is a real one built in tmp_path with the formats' own writers: Hugging Face
Trainer directories (safetensors, sharded with their index, optimizer.pt, scheduler.pt,
rng_state.pth, trainer_state.json, a training_args.bin that needs full unpickling), Lightning
``.ckpt`` dicts and ``torch.distributed.checkpoint`` directories saved in this one process. Each
detection is shown on a planted defect and on the clean case.
"""

from __future__ import annotations

import json
import os
import pickle
import random
import time
import warnings
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

from trainguard.unit.checkpoints import (
    COMPONENTS,
    checkpoint_inventory,
    classify_key,
    compare_checkpoint_dirs,
    describe_candidates,
    latest_complete_checkpoint,
    read_checkpoint,
)
from trainguard.unit.checkpoints.safetensors_file import load_safetensors, read_safetensors_file

_DTYPE_CODES = {torch.float32: "F32", torch.float64: "F64", torch.float16: "F16", torch.bfloat16: "BF16",
                torch.int64: "I64", torch.int32: "I32", torch.uint8: "U8", torch.bool: "BOOL"}


def save_safetensors(tensors: dict[str, torch.Tensor], path: Path) -> None:
    """With the ``safetensors`` package when installed (the format's own writer), else written
    here from the format's description, so these tests run without it."""
    try:
        from safetensors.torch import save_file
    except ImportError:
        header: dict[str, Any] = {}
        chunks, offset = [], 0
        for name, tensor in tensors.items():
            raw = tensor.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
            header[name] = {"dtype": _DTYPE_CODES[tensor.dtype], "shape": list(tensor.shape),
                            "data_offsets": [offset, offset + len(raw)]}
            chunks.append(raw)
            offset += len(raw)
        text = json.dumps(header).encode()
        text += b" " * (-len(text) % 8)
        path.write_bytes(len(text).to_bytes(8, "little") + text + b"".join(chunks))
    else:
        save_file(tensors, str(path))


class TrainingArgumentsLike:
    """Stands for transformers' TrainingArguments: pickled by reference, so it loads only with
    full unpickling."""

    def __init__(self, output_dir: str) -> None:
        self.output_dir = output_dir


def trained(steps: int = 3, seed: int = 0) -> tuple[torch.nn.Module, Any, Any]:
    """A small model after ``steps`` Adam steps with a StepLR schedule."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
    optimizer = torch.optim.Adam(model.parameters(), lr=0.01)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    for _ in range(steps):
        model(torch.randn(5, 4)).pow(2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return model, optimizer, scheduler


def rng_states() -> dict[str, Any]:
    random.seed(1)
    np.random.seed(1)
    torch.manual_seed(1)
    return {"python": random.getstate(), "numpy": np.random.get_state(), "cpu": torch.random.get_rng_state()}


def hf_checkpoint(output_dir: Path, step: int, *, shards: int = 1, optimizer_delta: float = 0.0,
                  trainer_state: bool = True, args: bool = True) -> Path:
    """``output_dir/checkpoint-<step>/`` as the Trainer writes it."""
    model, optimizer, scheduler = trained()
    folder = output_dir / f"checkpoint-{step}"
    folder.mkdir(parents=True)
    tensors = {k: v.contiguous() for k, v in model.state_dict().items()}
    if shards == 1:
        save_safetensors(tensors, folder / "model.safetensors")
    else:
        names = sorted(tensors)
        weight_map = {}
        for i in range(shards):
            shard = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            part = {n: tensors[n] for n in names[i::shards]}
            save_safetensors(part, folder / shard)
            weight_map.update(dict.fromkeys(part, shard))
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {"total_size": 1}, "weight_map": weight_map}))
    state = optimizer.state_dict()
    if optimizer_delta:
        state["state"][0]["exp_avg"] += optimizer_delta
    torch.save(state, folder / "optimizer.pt")
    torch.save(scheduler.state_dict(), folder / "scheduler.pt")
    torch.save(rng_states(), folder / "rng_state.pth")
    if args:
        torch.save(TrainingArgumentsLike(str(output_dir)), folder / "training_args.bin")
    if trainer_state:
        (folder / "trainer_state.json").write_text(json.dumps({
            "best_global_step": None, "best_metric": None,
            "best_model_checkpoint": str(folder), "epoch": 0.5, "global_step": step,
            "log_history": [{"epoch": 0.1, "grad_norm": 1.5, "learning_rate": 0.01, "loss": 2.25,
                             "step": step}],
            "logging_steps": 1, "max_steps": 20, "num_input_tokens_seen": 0, "save_steps": 5,
            "stateful_callbacks": {"TrainerControl": {"args": {"should_save": True}, "attributes": {}}},
            "total_flos": 10.0, "train_batch_size": 4,
        }))
    return folder


def lightning_checkpoint(path: Path, *, scheduler_steps: int = 3, run_dir: Path | None = None) -> Path:
    """A ``.ckpt`` with the keys Lightning's Trainer saves (ModelCheckpoint's paths included)."""
    model, optimizer, _ = trained()
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=2)
    for _ in range(scheduler_steps):
        scheduler.step()
    where = str(run_dir or path.parent)
    callback = "ModelCheckpoint{'monitor': None, 'mode': 'min', 'every_n_train_steps': 5, 'train_time_interval': None}"
    torch.save({
        "epoch": 0, "global_step": 10, "pytorch-lightning_version": "2.6.6",
        "state_dict": {f"net.{k}": v for k, v in model.state_dict().items()},
        "loops": {"fit_loop": {
            "state_dict": {},
            "epoch_loop.state_dict": {"_batches_that_stepped": 10},
            "epoch_loop.batch_progress": {"total": {"ready": 10, "completed": 10}, "is_last_batch": False},
            "epoch_progress": {"total": {"ready": 1, "completed": 0}},
        }},
        "callbacks": {callback: {
            "monitor": None, "best_model_score": None, "best_model_path": f"{where}/epoch=0-step=10.ckpt",
            "current_score": None, "dirpath": where, "best_k_models": {f"{where}/epoch=0-step=10.ckpt": 0.5},
            "kth_best_model_path": "", "kth_value": 0.5, "last_model_path": f"{where}/last.ckpt",
        }},
        "optimizer_states": [optimizer.state_dict()],
        "lr_schedulers": [scheduler.state_dict()],
        "hparams_name": "kwargs", "hyper_parameters": {"lr": 0.01, "out_dir": where},
    }, path)
    return path


def dcp_checkpoint(directory: Path, *, optimizer_delta: float = 0.0, with_metadata: bool = True) -> Path:
    """A ``torch.distributed.checkpoint`` directory saved by this one process."""
    import torch.distributed.checkpoint as dcp

    model, optimizer, scheduler = trained()
    optim = optimizer.state_dict()
    if optimizer_delta:
        optim["state"][1]["exp_avg_sq"] += optimizer_delta
    state = {"model": model.state_dict(), "optimizer": optim, "lr_scheduler": scheduler.state_dict(),
             "train_state": {"step": 10, "saved_at": time.time()}, "dataloader": {"sampler_index": 40}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # "assuming the intent is to save in a single process"
        dcp.save(state, checkpoint_id=str(directory), no_dist=True)
    if not with_metadata:
        (directory / ".metadata").unlink()
    return directory


# --------------------------------------------------------------------------------------------
# latest_complete_checkpoint
# --------------------------------------------------------------------------------------------


def test_latest_checkpoint_skips_half_written_hugging_face_directories(tmp_path: Path) -> None:
    out = tmp_path / "out"
    hf_checkpoint(out, 5)
    ten = hf_checkpoint(out, 10)
    half = hf_checkpoint(out, 15, trainer_state=False)  # killed before trainer_state.json
    torn = hf_checkpoint(out, 20, shards=2)  # its index names a shard that is not there
    (torn / "model-00002-of-00002.safetensors").unlink()
    hf_checkpoint(out / "tmp-checkpoint-25", 25)  # a staging directory
    assert latest_complete_checkpoint(out) == ten
    listing = describe_candidates(out)
    assert "checkpoint-15/ (incomplete: no trainer_state.json" in listing
    assert "model-00002-of-00002.safetensors, which is missing" in listing
    # clean: once the Trainer has written its state, the newer one is complete
    (half / "trainer_state.json").write_text(json.dumps({"global_step": 15}))
    assert latest_complete_checkpoint(out) == half


def _accelerate_state(path: Path, files: list[str]) -> Path:
    """A step folder as accelerate's ``save_state`` writes it, file after file, no marker."""
    path.mkdir(parents=True)
    for name in files:
        _accelerate_file(path / name)
    return path


def _accelerate_file(path: Path) -> None:
    if path.suffix == ".safetensors":
        save_file({"w": torch.ones(2)}, str(path))
    else:
        torch.save({"w": torch.ones(2)}, path)


def test_a_step_folder_cut_short_mid_save_is_not_the_latest(tmp_path: Path) -> None:
    """accelerate writes model, optimizer, scheduler, sampler and RNG files one after the other
    and no marker: a kill after the first leaves step_20/ with the model alone, and resuming from
    it loads half a state. It lacks files step_10/ holds, so step_10/ is the latest complete one."""
    full = ["model.safetensors", "optimizer.bin", "scheduler.bin", "random_states_0.pkl"]
    out = tmp_path / "out"
    _accelerate_state(out / "step_5", full)
    ten = _accelerate_state(out / "step_10", full)
    torn = _accelerate_state(out / "step_20", full[:1])
    assert latest_complete_checkpoint(out) == ten
    assert "step_20/ (incomplete: no optimizer.bin, random_states_0.pkl, scheduler.bin, which step_10/ holds" in describe_candidates(out)
    # clean: once its save finishes, the newest is complete; a file named by its own step counts alike
    for name in full[1:]:
        _accelerate_file(torn / name)
    assert latest_complete_checkpoint(out) == torn
    _accelerate_state(out / "step_30", [*full, "ema_30.pt"])
    last = _accelerate_state(out / "step_40", [*full, "ema_40.pt"])
    assert latest_complete_checkpoint(out) == last


def test_latest_checkpoint_of_lightning_dcp_and_plain_files(tmp_path: Path) -> None:
    lightning = tmp_path / "lightning"
    lightning.mkdir()
    step10 = lightning_checkpoint(lightning / "epoch=0-step=10.ckpt")
    torn = lightning / "epoch=0-step=20.ckpt"
    torn.write_bytes(step10.read_bytes()[:-200])  # written in place and cut short
    (lightning / ".last.ckpt.tmp").write_bytes(b"partial")
    assert latest_complete_checkpoint(lightning) == step10
    last = lightning / "last.ckpt"
    last.write_bytes(step10.read_bytes())
    os.utime(last, (time.time() + 5, time.time() + 5))
    assert latest_complete_checkpoint(lightning) == last  # last.ckpt: written after the newest step

    dcp_root = tmp_path / "dcp"
    ten = dcp_checkpoint(dcp_root / "step-10")
    dcp_checkpoint(dcp_root / "step-20", with_metadata=False)  # the coordinator never finished
    assert latest_complete_checkpoint(dcp_root) == ten

    plain = tmp_path / "plain"
    plain.mkdir()
    for step in (5, 10, 15):
        torch.save({"step": step}, plain / f"ckpt_{step:06d}.pt")
    (plain / "ckpt_000020.pt").write_bytes(b"")  # empty
    assert latest_complete_checkpoint(plain) == plain / "ckpt_000015.pt"
    assert latest_complete_checkpoint(tmp_path / "nothing") is None
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "log.txt").write_text("x")
    assert latest_complete_checkpoint(empty) is None
    assert describe_candidates(empty) == "no checkpoint (only log.txt)"


# --------------------------------------------------------------------------------------------
# classify_key, checkpoint_inventory
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(("key", "component"), [
    ("model.safetensors:h.0.attn.c_attn.weight", "model"),
    ("state_dict.net.0.weight", "model"),
    ("model.fc1.bias", "model"),
    ("optimizer.pt:state.0.exp_avg", "optimizer"),
    ("optimizer_states.0.param_groups.0.lr", "optimizer"),
    ("scheduler.pt:last_epoch", "scheduler"),
    ("lr_schedulers.0._step_count", "scheduler"),
    ("rng_state.pth:cpu", "rng"),
    ("rng_state_1.pth:numpy.1", "rng"),
    ("rng.torch", "rng"),
    ("sampler.start_index", "data"),
    ("batch_in_epoch", "data"),
    ("loops.fit_loop.state_dict.combined_loader.0.index", "data"),
    ("loops.fit_loop.epoch_loop.batch_progress.total.ready", "counters"),
    ("global_step", "counters"),
    ("trainer_state.json:global_step", "counters"),
    ("iter_num", "counters"),
    ("trainer_state.json:log_history.0.step", "other"),
    ("hyper_parameters.lr", "other"),
])
def test_classify_key(key: str, component: str) -> None:
    assert component in COMPONENTS
    assert classify_key(key) == component


def test_inventory_of_a_hugging_face_checkpoint(tmp_path: Path) -> None:
    folder = hf_checkpoint(tmp_path / "out", 10)
    inventory = checkpoint_inventory(tmp_path / "out")  # the folder of checkpoints: its newest
    assert inventory.path == folder
    assert sorted(inventory.files) == ["model.safetensors", "optimizer.pt", "rng_state.pth",
                                       "scheduler.pt", "trainer_state.json"]
    assert "pickled TrainingArguments" in inventory.skipped["training_args.bin"]
    for component in ("model", "optimizer", "scheduler", "rng", "counters"):
        assert inventory.has(component), component
    assert not inventory.has("data") and inventory.missing == ["data"]
    assert inventory.details["optimizer"] == "state for 4 parameters (step, exp_avg, exp_avg_sq)"
    assert inventory.details["rng"] == "python, numpy, cpu"
    assert "trainer_state.json:best_model_checkpoint" in inventory.metadata
    assert "trainer_state.json:global_step=10" in inventory.details["counters"]


def test_inventory_flags_an_optimizer_without_per_parameter_state(tmp_path: Path) -> None:
    model, optimizer, _ = trained(steps=0)  # saved before the first step: no moments yet
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "iter_num": 0,
                "model_args": {"n_layer": 2}, "config": {"out_dir": str(tmp_path)}}, tmp_path / "ckpt.pt")
    planted = checkpoint_inventory(tmp_path / "ckpt.pt")
    assert planted.details["optimizer"] == "param_groups only, no per-parameter state"
    assert planted.missing == ["scheduler", "rng", "data"]  # nanoGPT's checkpoint
    assert planted.summary().endswith("; lacks scheduler, rng, data")
    model, optimizer, _ = trained(steps=2)
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict()}, tmp_path / "ckpt.pt")
    clean = checkpoint_inventory(tmp_path / "ckpt.pt")
    assert clean.details["optimizer"].startswith("state for 4 parameters")


def test_inventory_of_lightning_and_dcp_checkpoints(tmp_path: Path) -> None:
    ckpt = checkpoint_inventory(lightning_checkpoint(tmp_path / "last.ckpt"))
    for component in ("model", "optimizer", "scheduler", "counters"):
        assert ckpt.has(component), component
    assert ckpt.missing == ["rng", "data"]  # Lightning saves neither
    callback = next(k for k in ckpt.metadata if k.endswith(".dirpath"))
    assert callback.startswith("callbacks.ModelCheckpoint{")
    assert any(k.endswith(".best_k_models") for k in ckpt.metadata)
    assert "hyper_parameters.out_dir" in ckpt.metadata
    dcp = checkpoint_inventory(dcp_checkpoint(tmp_path / "step-10"))
    assert dcp.files == [""] and dcp.missing == ["rng"]
    assert dcp.components["data"] == ["dataloader.sampler_index"]
    assert dcp.components["counters"] == ["train_state.step"]
    assert dcp.details["optimizer"] == "state for 4 parameters (step, exp_avg, exp_avg_sq)"
    assert dcp.metadata == ["train_state.saved_at"]


# --------------------------------------------------------------------------------------------
# compare_checkpoint_dirs
# --------------------------------------------------------------------------------------------


def test_comparison_names_an_optimizer_only_difference(tmp_path: Path) -> None:
    hf_checkpoint(tmp_path / "resumed", 10, optimizer_delta=0.5)
    hf_checkpoint(tmp_path / "reference", 10)
    state = compare_checkpoint_dirs(tmp_path / "resumed", tmp_path / "reference")
    assert state.compared and not state.ok
    assert list(state.by_component) == ["optimizer"]
    assert state.by_component["optimizer"] == ["optimizer.pt:state.0.exp_avg"]
    assert state.summary() == "optimizer (state.0.exp_avg)"
    # the paths in trainer_state.json differ (two output dirs): apart, never a failure
    assert state.metadata_differing == ["trainer_state.json:best_model_checkpoint"]
    assert "training_args.bin" in state.skipped


def test_comparison_passes_equal_state_in_two_directories_and_skips_unsafe_pickles(tmp_path: Path) -> None:
    hf_checkpoint(tmp_path / "resumed", 10)
    hf_checkpoint(tmp_path / "reference", 10)
    state = compare_checkpoint_dirs(tmp_path / "resumed", tmp_path / "reference")
    assert state.compared and state.ok, state.differing
    assert state.compared_keys > 20  # weights, both moments, schedule, RNG, trainer state
    assert state.skipped["training_args.bin"].startswith("the Trainer's arguments")
    assert state.files is not None and state.files[0].endswith("resumed/checkpoint-10")
    evidence = state.as_evidence().to_dict()
    assert evidence["metadata_differing"] == ["trainer_state.json:best_model_checkpoint"]


def test_comparison_of_sharded_safetensors_with_their_index(tmp_path: Path) -> None:
    resumed = hf_checkpoint(tmp_path / "resumed", 10, shards=2)
    hf_checkpoint(tmp_path / "reference", 10, shards=2)
    assert compare_checkpoint_dirs(tmp_path / "resumed", tmp_path / "reference").ok
    shard = resumed / "model-00002-of-00002.safetensors"
    tensors = read_safetensors_file(shard)
    name = sorted(tensors)[0]
    tensors[name] = tensors[name] + 1.0
    save_safetensors(tensors, shard)
    state = compare_checkpoint_dirs(tmp_path / "resumed", tmp_path / "reference")
    assert state.by_component == {"model": [f"model.safetensors:{name}"]}
    # a sharded save compares with an unsharded one: the same keys under model.safetensors
    hf_checkpoint(tmp_path / "unsharded", 10)
    assert compare_checkpoint_dirs(tmp_path / "unsharded", tmp_path / "reference").ok


def test_comparison_of_dcp_directories(tmp_path: Path) -> None:
    dcp_checkpoint(tmp_path / "a" / "step-10")
    dcp_checkpoint(tmp_path / "b" / "step-10")
    clean = compare_checkpoint_dirs(tmp_path / "a", tmp_path / "b")
    assert clean.compared and clean.ok, clean.differing
    assert clean.metadata_differing == ["train_state.saved_at"]  # a time: apart
    dcp_checkpoint(tmp_path / "c" / "step-10", optimizer_delta=1.0)
    planted = compare_checkpoint_dirs(tmp_path / "c", tmp_path / "b")
    assert planted.summary() == "optimizer (state.1.exp_avg_sq)"


def test_comparison_of_lightning_checkpoints_keeps_paths_apart(tmp_path: Path) -> None:
    for run in ("resumed", "reference"):
        (tmp_path / run).mkdir()
        lightning_checkpoint(tmp_path / run / "last.ckpt", run_dir=tmp_path / run)
    clean = compare_checkpoint_dirs(tmp_path / "resumed", tmp_path / "reference")
    assert clean.ok, clean.differing
    assert any(k.endswith(".dirpath") for k in clean.metadata_differing)
    assert any(k.endswith(".best_k_models") for k in clean.metadata_differing)
    lightning_checkpoint(tmp_path / "resumed" / "last.ckpt", run_dir=tmp_path / "resumed",
                         scheduler_steps=1)  # the schedule restarted
    planted = compare_checkpoint_dirs(tmp_path / "resumed", tmp_path / "reference")
    # the schedule also set the optimizer's lr: both show, the schedule by name
    assert planted.summary() == ("optimizer (param_groups.0.lr), "
                                 "scheduler (last_epoch, _step_count, _last_lr.0)"), planted.summary()


def test_comparison_reports_a_missing_checkpoint(tmp_path: Path) -> None:
    (tmp_path / "resumed").mkdir()
    hf_checkpoint(tmp_path / "reference", 10)
    state = compare_checkpoint_dirs(tmp_path / "resumed", tmp_path / "reference")
    assert not state.compared and "resumed run left no complete checkpoint" in state.reason


# --------------------------------------------------------------------------------------------
# Reading safely
# --------------------------------------------------------------------------------------------


def test_own_safetensors_reader_matches_the_package(tmp_path: Path) -> None:
    tensors = {"a": torch.randn(3, 4), "b": torch.arange(6, dtype=torch.int64).reshape(2, 3),
               "c": torch.randn(2).to(torch.bfloat16), "empty": torch.zeros(0, 3)}
    save_safetensors(tensors, tmp_path / "m.safetensors")
    own = read_safetensors_file(tmp_path / "m.safetensors")
    package = load_safetensors(tmp_path / "m.safetensors")
    assert sorted(own) == sorted(package) == sorted(tensors)
    for name, tensor in tensors.items():
        assert torch.equal(own[name], tensor) and own[name].dtype == tensor.dtype
    data = (tmp_path / "m.safetensors").read_bytes()
    (tmp_path / "torn.safetensors").write_bytes(data[:-8])
    with pytest.raises(ValueError, match=r"torn\.safetensors is truncated"):
        read_safetensors_file(tmp_path / "torn.safetensors")


class Boom:
    def __reduce__(self) -> tuple[Any, ...]:
        return (os.system, ("touch boom-ran",))


def test_a_dcp_metadata_file_runs_no_code(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    directory = dcp_checkpoint(tmp_path / "step-10")
    (directory / ".metadata").write_bytes(pickle.dumps(Boom()))
    contents = read_checkpoint(directory)
    assert not (tmp_path / "boom-ran").exists()
    assert contents.parts == {}
    assert "posix.system has no place in a torch.distributed.checkpoint metadata file" in contents.skipped[".metadata"]
    assert checkpoint_inventory(directory).files == []


def test_a_dcp_entry_that_needs_full_unpickling_is_skipped_by_name(tmp_path: Path) -> None:
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dcp.save({"model": {"w": torch.ones(2)}, "args": TrainingArgumentsLike("x")},
                 checkpoint_id=str(tmp_path / "step-1"), no_dist=True)
    contents = read_checkpoint(tmp_path / "step-1")
    assert torch.equal(contents.parts[""]["model"]["w"], torch.ones(2))
    assert "TrainingArgumentsLike" in contents.skipped["args"]


def _finished_run(output_dir: Path, train_loss: float, step_loss: float = 2.25) -> None:
    """What run_clm.py leaves at the end: the final save, save_state and the results files."""
    hf_checkpoint(output_dir, 10)
    final = output_dir / "checkpoint-10"
    for item in final.iterdir():
        item.rename(output_dir / item.name)
    final.rmdir()
    state = json.loads((output_dir / "trainer_state.json").read_text())
    state["log_history"] = [{"loss": step_loss, "step": 10},
                            {"step": 10, "train_loss": train_loss, "train_runtime": 3.2, "total_flos": 10.0}]
    (output_dir / "trainer_state.json").write_text(json.dumps(state))
    for name in ("train_results.json", "all_results.json"):
        (output_dir / name).write_text(json.dumps({"train_loss": train_loss, "train_runtime": 3.2}))


def test_the_run_summary_of_a_resumed_trainer_is_reported_apart_not_as_state(tmp_path: Path) -> None:
    # a resumed run averages only the steps it trained: its train_loss differs after an exact resume
    _finished_run(tmp_path / "resumed", train_loss=6.0029)
    _finished_run(tmp_path / "reference", train_loss=6.0065)
    state = compare_checkpoint_dirs(tmp_path / "resumed", tmp_path / "reference")
    assert state.compared and state.ok, state.differing
    assert {"all_results.json:train_loss", "train_results.json:train_loss",
            "trainer_state.json:log_history.1.train_loss"} <= set(state.metadata_differing)
    # a per-step loss in the log is state: a difference there still counts
    _finished_run(tmp_path / "other", train_loss=6.0065, step_loss=2.5)
    assert not compare_checkpoint_dirs(tmp_path / "other", tmp_path / "reference").ok


def test_a_configuration_string_the_resume_changes_is_reported_apart(tmp_path: Path) -> None:
    # nanoGPT saves its config with the state; the resumed run's says init_from="resume"
    model = {"w": torch.ones(2)}
    torch.save({"model": model, "iter_num": 10, "config": {"init_from": "resume", "n_layer": 2}},
               tmp_path / "resumed.pt")
    torch.save({"model": model, "iter_num": 10, "config": {"init_from": "scratch", "n_layer": 2}},
               tmp_path / "reference.pt")
    (tmp_path / "a").mkdir(), (tmp_path / "b").mkdir()
    (tmp_path / "resumed.pt").rename(tmp_path / "a" / "ckpt.pt")
    (tmp_path / "reference.pt").rename(tmp_path / "b" / "ckpt.pt")
    state = compare_checkpoint_dirs(tmp_path / "a", tmp_path / "b")
    assert state.compared and state.ok, state.differing
    assert state.metadata_differing == ["config.init_from"]
    # a number of the configuration still counts
    torch.save({"model": model, "iter_num": 10, "config": {"init_from": "scratch", "n_layer": 3}},
               tmp_path / "b" / "ckpt.pt")
    assert not compare_checkpoint_dirs(tmp_path / "a", tmp_path / "b").ok


def test_a_comparison_skipped_is_named_and_never_equal(tmp_path: Path) -> None:
    """What a check must not pass on (issue 42): a checkpoint whose one file is over the read
    limit (the comparison was not made at all), one run's checkpoint missing; and what it may:
    neither run left anything like a checkpoint (no state to compare)."""
    from trainguard._internal.readers import ReadLimits, active_limits, use_limits

    for run in ("resumed", "reference"):
        (tmp_path / run).mkdir()
        torch.save({"w": torch.zeros(1000)}, tmp_path / run / "ckpt-step10.pt")
    before = active_limits()
    use_limits(ReadLimits(max_bytes=1000))
    try:
        over = compare_checkpoint_dirs(tmp_path / "resumed", tmp_path / "reference")
    finally:
        use_limits(before)
    assert not over.compared and not over.ok
    assert "bytes, over the limit of 1000 (setting read_max_mb)" in over.uncompared, over.uncompared
    assert over.uncompared_problem("checks.resume", []).startswith("the final state was not compared")
    assert over.uncompared_problem("checks.resume", ["state"]) == ""

    (tmp_path / "empty").mkdir()
    missing = compare_checkpoint_dirs(tmp_path / "empty", tmp_path / "reference")
    assert not missing.absent and missing.uncompared.startswith("the resumed run left no complete checkpoint")

    (tmp_path / "none1").mkdir()
    (tmp_path / "none2").mkdir()
    (tmp_path / "none1" / "log.txt").write_text("step 1\n")
    neither = compare_checkpoint_dirs(tmp_path / "none1", tmp_path / "none2")
    assert neither.absent and neither.uncompared == "" and "neither run left a checkpoint" in neither.note("checks.resume")

    equal = compare_checkpoint_dirs(tmp_path / "resumed", tmp_path / "reference")
    assert equal.compared and equal.ok and equal.uncompared == ""
