"""The run agent's step records (docs/step-records.md) in real processes: one line per optimizer
step with the learning rates, the backward calls and the fingerprints of parameters, gradients
and optimizer state; checkpoint saves and restores; the property the reader relies on (a resumed
process's first step shows the state the uninterrupted run had at that step); closures
(Lightning's: tests/unit/test_run_hook.py), a GradScaler's skipped step, the size cap, a job the agent must never break, the
records off (``record_steps: false``, the profile's timed runs). Lines are parsed here as JSON:
the reader of the records is not this test's subject."""

from __future__ import annotations

import itertools
import json
import os
import struct
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.helpers import load_hook_module
from trainguard.config import parse_config
from trainguard.config.checks import ProfileCheck, SmokeCheck
from trainguard.launch.hook import ENV_RUN_SPEC, ENV_SPEC, STEPS_DIR, run_hook_env
from trainguard.launch.pace import read_pace
from trainguard.profiling.measure import measure_size
from trainguard.run.runner import JobRunner

torch = pytest.importorskip("torch")

LOOP = textwrap.dedent(
    """
    import argparse, json, torch
    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int)
    p.add_argument("--save-at", type=int, default=0)
    p.add_argument("--ckpt", default="")
    p.add_argument("--resume", action="store_true")
    a = p.parse_args()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Dropout(0.2), torch.nn.Linear(16, 1))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    g = torch.Generator().manual_seed(1)
    data = torch.utils.data.TensorDataset(torch.randn(64, 6, generator=g), torch.randn(64, 1, generator=g))
    batches = iter(torch.utils.data.DataLoader(data, batch_size=4))  # before the RNG is restored
    start = 0
    if a.resume:
        ck = torch.load(a.ckpt, weights_only=True)
        model.load_state_dict(ck["model"]); opt.load_state_dict(ck["optimizer"])
        sched.load_state_dict(ck["scheduler"]); torch.set_rng_state(ck["rng"]); start = ck["step"]
        for _ in range(2 * start):
            next(batches)
    lrs = []
    for step in range(start + 1, a.steps + 1):
        for _ in range(2):  # gradient accumulation 2
            x, y = next(batches)
            (torch.nn.functional.mse_loss(model(x), y) / 2).backward()
        lrs.append(sched.get_last_lr()[0])
        opt.step(); opt.zero_grad(); sched.step()
        if step == a.save_at:
            torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "scheduler": sched.state_dict(),
                        "rng": torch.get_rng_state(), "step": step}, a.ckpt)
    print(json.dumps(lrs))
    """
)

SCALER = textwrap.dedent(
    """
    import torch
    torch.manual_seed(0)
    for fused in (False, True):  # a fused optimizer's step runs even when the scaler skips it
        m = torch.nn.Linear(4, 1)
        opt = torch.optim.Adam(m.parameters(), lr=0.1, fused=fused)
        scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
        for i in range(3):
            scaler.scale(m(torch.randn(2, 4)).sum()).backward()
            if i == 1:
                m.weight.grad[0, 0] = float("inf")  # planted: the scaler skips this step
            scaler.step(opt); scaler.update(); opt.zero_grad()

    # FSDP2 on one rank: DTensor parameters, gradients and optimizer state
    import sys, torch.distributed as dist
    from torch.distributed.fsdp import fully_shard
    dist.init_process_group("gloo", store=dist.FileStore(sys.argv[1], 1), rank=0, world_size=1)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Linear(8, 1))
    fully_shard(m)
    opt = torch.optim.Adam(m.parameters(), lr=0.1)
    for _ in range(2):
        m(torch.randn(2, 4)).sum().backward(); opt.step(); opt.zero_grad()

    # an optimizer stepping inside another (ZeRO's wrapper keeps no state of its own)
    from torch.distributed.optim import ZeroRedundancyOptimizer
    m = torch.nn.Linear(4, 1)
    opt = ZeroRedundancyOptimizer(m.parameters(), optimizer_class=torch.optim.Adam, lr=0.1)
    for _ in range(3):
        m(torch.randn(2, 4)).sum().backward(); opt.step(); opt.zero_grad()
    dist.destroy_process_group()

    # torch.compile: the RNG is read at the first module call without a global module hook
    # (torch.compile warns about those on every call of a compiled module)
    m = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Dropout(0.5), torch.nn.Linear(8, 1))
    compiled = torch.compile(m, backend="aot_eager")
    opt = torch.optim.SGD(m.parameters(), lr=0.1)
    for _ in range(2):
        compiled(torch.randn(2, 4)).sum().backward(); opt.step(); opt.zero_grad()
    """
)

# every save and restore the agent knows, once each (DCP's own torch.save/torch.load calls, and
# async_save's call of save, are DCP's business: not lines)
CHECKPOINTS = textwrap.dedent(
    """
    import random, sys, numpy as np, torch, torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from safetensors.torch import save_file, load_file
    from torchdata.stateful_dataloader import StatefulDataLoader
    out = sys.argv[1]
    dist.init_process_group("gloo", store=dist.FileStore(out + "/store", 1), rank=0, world_size=1)
    random.seed(1); np.random.seed(2)
    m = torch.nn.Linear(4, 2); opt = torch.optim.Adam(m.parameters(), lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, 1); scaler = torch.amp.GradScaler("cpu")
    loader = StatefulDataLoader(list(range(8)), batch_size=2)
    it = iter(loader); next(it)
    m(torch.randn(1, 4)).sum().backward(); opt.step()
    m2 = torch.nn.Linear(2, 1); opt2 = torch.optim.AdamW(m2.parameters(), lr=0.5)
    get_state_dict(m2, opt2)  # steps opt2 once, with lr 0, to make its state: not a training step
    msd, osd = get_state_dict(m, opt)
    dcp.save({"model": msd, "optim": osd, "loader": loader.state_dict()}, checkpoint_id=out + "/dcp")
    dcp.async_save({"model": msd}, checkpoint_id=out + "/async").result()
    save_file(m.state_dict(), out + "/model.safetensors")
    torch.save({"scaler": scaler.state_dict(), "sched": sched.state_dict(), "np": np.random.get_state(),
                "py": random.getstate(), "cuda": [torch.get_rng_state()]}, out + "/extra.pt")
    torch.save(opt.state_dict(), out + "/optimizer.pt")
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=out + "/dcp")
    set_state_dict(m, opt, model_state_dict=state["model"], optim_state_dict=state["optim"])
    load_file(out + "/model.safetensors")
    extra = torch.load(out + "/extra.pt", weights_only=False)
    scaler.load_state_dict(extra["scaler"]); sched.load_state_dict(extra["sched"])
    np.random.set_state(extra["np"]); random.setstate(extra["py"])
    loader.load_state_dict(loader.state_dict())
    dist.destroy_process_group()
    """
)

# the agent fails inside its record (an optimizer whose state it cannot read); the job's own
# exceptions on the patched paths reach the job unchanged
BROKEN = textwrap.dedent(
    """
    import torch
    class Odd(torch.optim.SGD):
        @property
        def state(self):
            return self._hidden
        @state.setter
        def state(self, value):
            self._hidden = value
    m = torch.nn.Linear(2, 1)
    opt = Odd(m.parameters(), lr=0.1)
    opt._hidden = None  # the agent's .get on it raises; SGD itself never reads it (no momentum)
    try:
        torch.load("/nonexistent/ckpt.pt")
    except FileNotFoundError:
        print("job saw FileNotFoundError")
    for _ in range(3):
        m(torch.ones(1, 2)).sum().backward()
        try:
            opt.step()
        except Exception as exc:
            print("step raised", type(exc).__name__)
            raise
        opt.zero_grad()
    print("done", float(m.weight.sum()))
    """
)


def _hooked(code: str, steps_dir: Path, *args: str, cap: int | None = None,
            cwd: Path | None = None, pace_dir: Path | None = None) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k not in (ENV_SPEC, ENV_RUN_SPEC, "PYTHONPATH", "RANK")}
    env.update({"OMP_NUM_THREADS": "1"})
    spec: dict[str, Any] = {"steps_dir": str(steps_dir)}
    if cap is not None:
        spec["steps_cap"] = cap
    if pace_dir is not None:
        spec["pace_dir"] = str(pace_dir)
    env.update(run_hook_env(spec, env))
    done = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True,
                          timeout=120, check=False, cwd=cwd)
    assert done.returncode == 0, done.stderr
    return done


def _lines(steps_dir: Path, rank: int = 0) -> list[dict[str, Any]]:
    path = steps_dir / f"rank{rank}.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _steps(lines: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [r for r in lines if r["k"] == "step"]


def test_a_plain_loop_one_line_per_step_and_a_resume_shows_the_uninterrupted_runs_state(tmp_path: Path) -> None:
    ckpt = str(tmp_path / "ck.pt")
    first = _hooked(LOOP, tmp_path / "a", "--steps", "5", "--save-at", "2", "--ckpt", ckpt, pace_dir=tmp_path / "pace")
    # beside the step records, each step's clocks (stragglers named, trainguard.launch.pace)
    assert len(read_pace(tmp_path / "pace")[0]) == 5
    _hooked(LOOP, tmp_path / "again", "--steps", "5")
    _hooked(LOOP, tmp_path / "resumed", "--steps", "5", "--resume", "--ckpt", ckpt)
    lines = _lines(tmp_path / "a")
    assert lines[0]["k"] == "meta" and lines[0]["rank"] == 0 and lines[0]["cap"] == 64 * 1024 * 1024
    steps = _steps(lines)
    assert [s["n"] for s in steps] == [1, 2, 3, 4, 5] and {s["opt"] for s in steps} == {0}
    assert [s["groups"][0]["lr"] for s in steps] == pytest.approx(json.loads(first.stdout))
    assert steps[0]["groups"][0]["betas"] == [0.9, 0.999]
    assert {s["backward"] for s in steps} == {2}
    names = ["0.weight", "0.bias", "2.weight", "2.bias"]
    for s in steps:
        assert list(s["param"]) == names and all(s["grad"][n] is not None for n in names)
        assert s["scaler"] is None and len(s["rng"]["cpu"]) == 16
    assert steps[0]["optim"] == {} and set(steps[1]["optim"]) == set(names)  # Adam's state after its first step
    for before, after in itertools.pairwise(steps):
        assert all(before["param"][n][0] != after["param"][n][0] for n in names)
        assert before["rng"]["cpu"] != after["rng"]["cpu"]  # dropout drew from it
    same_seed = _steps(_lines(tmp_path / "again"))
    assert [s["param"] for s in same_seed] == [s["param"] for s in steps]
    assert [s["rng"]["cpu"] for s in same_seed] == [s["rng"]["cpu"] for s in steps]

    save = next(r for r in lines if r["k"] == "save")
    assert save["how"] == "torch.save" and save["path"] == ckpt and save["whole"] is None
    assert save["keys"] == {"model": "model", "optimizer": "optimizer", "scheduler": "scheduler", "rng": "rng",
                            "step": "value"}
    assert lines.index(save) == lines.index(steps[1]) + 1  # written after step 2, before step 3

    resumed = _lines(tmp_path / "resumed")
    restores = [(r["call"], r["target"]) for r in resumed if r["k"] == "restore"]
    assert restores == [("torch.load", "torch"), ("Module.load_state_dict", "Sequential"),
                        ("Optimizer.load_state_dict", "Adam"), ("LRScheduler.load_state_dict", "LambdaLR"),
                        ("torch.set_rng_state", "torch")]
    assert next(r for r in resumed if r["k"] == "restore")["path"] == ckpt
    after = _steps(resumed)
    assert [s["n"] for s in after] == [1, 2, 3]
    for got, want in zip(after, steps[2:]):  # the resumed process's step n is the uninterrupted run's 2 + n
        for key in ("param", "optim", "grad", "groups", "backward"):
            assert got[key] == want[key], key
        # numpy's and Python's generators, never seeded, start from OS entropy in each process
        assert got["rng"]["cpu"] == want["rng"]["cpu"] and got["rng"]["python"] != want["rng"]["python"]


def test_a_skipped_step_a_dtensor_and_a_wrapped_optimizer(tmp_path: Path) -> None:
    """A step the scaler skips is a line with its scale; a DTensor's local shard is recorded with
    its placement; an optimizer stepping inside another gives one line, with its state."""
    done = _hooked(SCALER, tmp_path / "steps", str(tmp_path / "store"))
    steps = _steps(_lines(tmp_path / "steps"))
    assert [(s["opt"], s["n"]) for s in steps] == [(0, 1), (0, 2), (0, 3), (1, 1), (1, 2), (1, 3), (2, 1), (2, 2),
                                                   (3, 1), (3, 2), (3, 3), (4, 1), (4, 2)]
    assert "global hooks" not in done.stderr
    assert steps[11]["rng"]["cpu"] != steps[12]["rng"]["cpu"] and set(steps[12]["param"]) == {
        "0.weight", "0.bias", "2.weight", "2.bias"}  # named in the model, not its compiled wrapper
    wrapped = steps[8:11]
    assert wrapped[0]["optim"] == {} and all(set(s["optim"]) == {"weight", "bias"} for s in wrapped[1:])
    assert wrapped[1]["optim"] != wrapped[2]["optim"]
    sharded = steps[6:8]
    assert all(s["placement"] == dict.fromkeys(["0.weight", "0.bias", "1.weight", "1.bias"], "(Shard(dim=0),)")
               for s in sharded)
    assert sharded[0]["param"] != sharded[1]["param"] and set(sharded[1]["optim"]) == set(sharded[1]["param"])
    assert all(g is not None for g in sharded[0]["grad"].values())
    assert "placement" not in steps[0]
    for run in (steps[:3], steps[3:6]):  # plain, then fused
        assert [s["scaler"] for s in run] == [{"scale": 1024.0, "skipped": False}, {"scale": 1024.0, "skipped": True},
                                              {"scale": 512.0, "skipped": False}]
        assert run[1]["grad"]["weight"][1] == "inf"
        assert run[2]["param"] == run[1]["param"]  # the skipped step changed nothing
        assert run[1]["param"] != run[0]["param"]


def test_the_cap_ends_the_step_lines_with_one_truncated_line(tmp_path: Path) -> None:
    code = LOOP.replace("print(json.dumps(lrs))", "torch.save(model.state_dict(), 'last.pt')")
    _hooked(code, tmp_path / "steps", "--steps", "8", cap=4000, cwd=tmp_path)
    lines = _lines(tmp_path / "steps")
    kinds = [r["k"] for r in lines]
    assert kinds.count("truncated") == 1 and kinds[-1] == "save"  # a save after the cap is still written
    cut = kinds.index("truncated")
    assert "step" not in kinds[cut:] and 0 < kinds.count("step") < 8
    assert lines[cut]["bytes"] <= 4000
    assert lines[-1]["whole"] == "model" and lines[-1]["keys"]["0.weight"] == "value"


def test_an_agent_that_fails_says_so_once_and_the_job_runs_as_without_it(tmp_path: Path) -> None:
    done = _hooked(BROKEN, tmp_path / "steps")
    assert done.stdout.splitlines()[0] == "job saw FileNotFoundError"
    assert done.stdout.splitlines()[-1].startswith("done") and "step raised" not in done.stdout
    assert done.stderr.count("trainguard run hook: recording an optimizer step failed") == 1, done.stderr


def _fingerprint_module() -> Any:
    return load_hook_module("_trainguard_step_values", "_tg_step_values_under_test")


def test_saves_and_restores_name_their_keys_owners_and_calls(tmp_path: Path) -> None:
    pytest.importorskip("safetensors")
    pytest.importorskip("torchdata")
    _hooked(CHECKPOINTS, tmp_path / "steps", str(tmp_path))
    steps = _steps(_lines(tmp_path / "steps"))
    assert [(s["opt"], s["n"], s["groups"][0]["lr"]) for s in steps] == [(0, 1, 0.1)]  # DCP's state step is none
    lines = [{k: v for k, v in r.items() if k != "t"} for r in _lines(tmp_path / "steps") if r["k"] != "step"]
    saves = [(r["how"], os.path.basename(r["path"]), r["keys"], r["whole"]) for r in lines if r["k"] == "save"]
    assert saves == [
        ("dcp", "dcp", {"model": "model", "optim": "optimizer", "loader": "loader"}, None),
        ("dcp_async", "async", {"model": "model"}, None),
        ("safetensors", "model.safetensors", {"weight": "value", "bias": "value"}, "model"),
        ("torch.save", "extra.pt", {"scaler": "scaler", "sched": "scheduler", "np": "rng", "py": "rng", "cuda": "value"},
         None),
        ("torch.save", "optimizer.pt", {"state": "value", "param_groups": "value"}, "optimizer"),
    ]
    restores = [(r["call"], r["target"], r["by"]) for r in lines if r["k"] == "restore"]
    assert restores == [
        ("dcp.load", "dcp", "__main__"), ("dcp.set_state_dict", "Linear", "__main__"),
        ("Optimizer.load_state_dict", "Adam", "torch.distributed.checkpoint.state_dict"),
        ("Module.load_state_dict", "Linear", "torch.distributed.checkpoint.state_dict"),
        ("safetensors.load_file", "safetensors", "__main__"), ("torch.load", "torch", "__main__"),
        ("GradScaler.load_state_dict", "GradScaler", "__main__"), ("LRScheduler.load_state_dict", "StepLR", "__main__"),
        ("numpy.random.set_state", "numpy.random", "__main__"), ("random.setstate", "random", "__main__"),
        ("DataLoader.load_state_dict", "StatefulDataLoader", "__main__"),
    ]
    assert [(r["call"], r["by"]) for r in lines if r["k"] == "seed"] == [("random.seed", "__main__"),
                                                                         ("numpy.random.seed", "__main__")]


def _expected_fp(tensor: Any, width: Any) -> str:
    """The format's fp computed in Python: the sum of the row-major bytes as 64-bit
    little-endian words, the last word padded with zero bytes."""
    data = tensor.contiguous().view(width).reshape(-1).numpy().tobytes()
    data += bytes(-len(data) % 8)
    return format(sum(struct.unpack(f"<{len(data) // 8}q", data)) % 2**64, "016x")


@pytest.mark.parametrize("batched", [True, False], ids=["numpy batch", "torch per tensor"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16", "float64", "int64", "bool"])
def test_a_fingerprint_sums_the_bits_and_changes_with_any_one_bit(dtype: str, batched: bool) -> None:
    """Both ways the agent fingerprints (CPU tensors in one numpy batch; one by one with torch
    ops, as on a GPU) give the format's values, whatever the tensor's size, layout and dtype."""
    import numpy

    agent = _fingerprint_module()
    np = numpy if batched else None
    width = {"float32": torch.int32, "bfloat16": torch.int16, "float16": torch.int16, "float64": torch.int64,
             "int64": torch.int64, "bool": torch.uint8}[dtype]
    generator = torch.Generator().manual_seed(3)
    small = (torch.randn(5, 7, generator=generator) * 3).to(getattr(torch, dtype))
    large = (torch.randn(67, 65, generator=generator) * 3).to(getattr(torch, dtype))  # 4355: an odd size
    huge = (torch.randn(2 * agent.DIRECT_FROM + 2, generator=generator) * 3).to(getattr(torch, dtype))  # read in place
    cases = [small, small.t(), small[0], small[1, 2], large, large.t(), large[1:], small[:0],  # non-contiguous,
             huge, huge[2:], huge[1:-1].view(2, -1).t()]
    prints = agent.fingerprints(torch, cases, np)  # 0-dim, at an offset, empty
    for tensor, (fp, ss) in zip(cases, prints):
        assert fp == _expected_fp(tensor, width)
        assert ss == pytest.approx(float((tensor.double() ** 2).sum()), rel=1e-5)
    assert agent.fingerprints(torch, cases, np) == prints  # (batched: the buffers kept, filled again)
    for i in (0, 4, 8, 9, 10):
        for where in (11, -1):  # one bit of one element: in a word, in the last word
            flipped = cases[i].clone(memory_format=torch.contiguous_format)
            flipped.view(width).view(-1)[where] ^= 1
            assert agent.fingerprints(torch, [flipped], np)[0][0] != prints[i][0]


def test_tensors_past_the_batchs_bound_are_read_in_place_with_the_same_fingerprints() -> None:
    """A float32 tensor that would take a layout's batch past ``BATCH_BYTES`` is read in place:
    the batch holds the others only, and every fingerprint is the format's."""
    import numpy as np

    agent = _fingerprint_module()
    agent.BATCH_BYTES = 4096  # (this test's own copy of the module)
    generator = torch.Generator().manual_seed(4)
    tensors = [torch.randn(n, generator=generator) for n in (700, 600, 100, 4)]  # 2800 + 2400 bytes: the second is past it
    layout = agent._Layout(torch, np, tensors)
    assert layout.direct == [1] and sorted(layout.sources) == [0, 2, 3]
    for tensor, (fp, ss) in zip(tensors, agent.fingerprints(torch, tensors, np)):
        assert fp == _expected_fp(tensor, torch.int32)
        assert ss == pytest.approx(float((tensor.double() ** 2).sum()), rel=1e-6)


def test_a_step_plan_writes_what_the_fingerprints_one_by_one_give() -> None:
    """The agent's fast way (a :class:`StepPlan`: one batch of fingerprints, the JSON text filled
    in one formatting) writes the values the format defines, computed here one tensor at a time;
    a gradient gone lays it out again, and a NaN is written as the string "nan"."""
    import numpy as np

    agent = _fingerprint_module()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(70, 130), torch.nn.LayerNorm(130), torch.nn.Linear(130, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=0.01)
    for _ in range(2):
        model(torch.randn(4, 70)).sum().backward()
        opt.step()
    opt.state[model[2].bias]["extra"] = torch.ones(3)  # one parameter with more state than the others
    named = [(n, p) for n, p in model.named_parameters()]
    plan = agent.StepPlan(opt, named)
    tensors = plan.tensors(opt)
    assert plan.usable and plan.cpu and not plan.uniform and tensors is not None
    got = {key: json.loads(text) for key, text in plan.texts(*agent.raw_prints(torch, tensors, np, cpu=True)).items()}
    for name, p in named:
        for kind, tensor in (("param", p), ("grad", p.grad)):
            fp, ss = agent.fingerprints(torch, [tensor])[0]  # (torch ops, one tensor)
            assert got[kind][name][0] == fp and got[kind][name][1] == pytest.approx(ss, rel=1e-6)
        keys = sorted(opt.state[p])
        parts = [(k, int(fp, 16), ss) for k, (fp, ss) in zip(keys, agent.fingerprints(torch, [opt.state[p][k] for k in keys]))]
        assert got["optim"][name][0] == agent.combined(parts)[0]
        assert got["optim"][name][1] == pytest.approx(agent.combined(parts)[1], rel=1e-6)
    model[0].weight.grad = None
    assert plan.tensors(opt) is None  # laid out again by the agent
    plan = agent.StepPlan(opt, named)
    model[0].bias.grad[3] = float("nan")
    texts = plan.texts(*agent.raw_prints(torch, plan.tensors(opt), np, cpu=True))
    assert texts["grad"]["0.weight"] is None and texts["grad"]["0.bias"][1] == "nan"


def test_a_step_line_formatted_directly_is_what_the_json_encoder_writes(tmp_path: Path) -> None:
    """A plain step record's line is formatted directly (no dict rebuilt, no encoder over it
    all): the same bytes as the encoder's line of the record, its plan's JSON texts last; the
    rng's text follows a changed rng; the invariants' fields go after the plain ones."""
    values = _fingerprint_module()
    run_agent = load_hook_module("_trainguard_run_agent", "_tg_run_agent_under_test")
    steps = load_hook_module("_trainguard_step_agent", "_tg_step_agent_under_test")
    agent = steps.StepAgent(None, {"steps_dir": str(tmp_path)}, run_agent.JsonlWriter, values)
    record: dict[str, Any] = {
        "k": "step", "opt": 1, "n": 7, "t": 1234.000123456789,
        "groups": [{"lr": 3e-4, "betas": [0.9, 0.999], "amsgrad": False, "weight_decay": 0}, {"lr": "nan"}],
        "backward": 2, "rng": {"cpu": "00ff00ff00ff00ff", "cuda": None, "numpy": None, "python": "12"},
        "param": values.Raw('{"w":["00000000000000ff",1.5],"b":["0000000000000001",2]}'),
        "grad": values.Raw('{"w":null,"b":["0000000000000001",2]}'), "optim": values.Raw('{"b":["0000000000000002",0.5]}'),
        "scaler": None}

    def encoder_line(rec: dict[str, Any]) -> bytes:
        raw = [k for k, v in rec.items() if type(v) is values.Raw]
        ordered = {**{k: v for k, v in rec.items() if k not in raw}, **{k: json.loads(rec[k]) for k in raw}}
        return (json.dumps(ordered, separators=(",", ":")) + "\n").encode()

    for rng, scaler in ((record["rng"], None), ({**record["rng"], "cuda": ["ab"]}, {"scale": 65536.0, "skipped": True})):
        record.update(rng=rng, scaler=scaler)
        assert agent._encode(record) == encoder_line(record)
    # the invariants' fields after the plain ones (a job that clips every step), and a step that
    # did not read the optimizer state: still formatted directly, still the encoder's bytes
    record["clip"] = {"calls": 1, "scaled": False}
    record["carried"] = ["w"]
    assert agent._encode(record) == encoder_line(record)
    record["optim"] = None
    assert agent._encode(record) == encoder_line(record)
    calls = []
    agent._step_line = lambda rec, extra: calls.append(extra) or b""
    agent._encode(record)
    assert calls == [("clip", "carried")]
    # a Raw among the fields after the plain ones: the encoder's way
    record["placement"] = values.Raw('{"w":"shard(0)"}')
    agent._encode(record)
    assert calls == [("clip", "carried")]


def test_sums_of_squares_are_written_with_nine_significant_digits() -> None:
    """``ss`` is written with 9 significant digits (cheaper than Python's shortest repr; the
    reader compares sums of squares within a relative 1e-3 at the least), by the plan and by
    the general way alike; ``fp`` stays exact."""
    import numpy as np

    agent = _fingerprint_module()
    torch.manual_seed(1)
    model = torch.nn.Sequential(torch.nn.Linear(9, 33), torch.nn.Linear(33, 2))
    opt = torch.optim.Adam(model.parameters(), lr=0.01)
    for _ in range(2):
        model(torch.randn(4, 9)).sum().backward()
        opt.step()
    plan = agent.StepPlan(opt, list(model.named_parameters()))
    tensors = plan.tensors(opt)
    assert tensors is not None
    fps, squares = agent.raw_prints(torch, tensors, np, cpu=True)
    texts = plan.texts(fps, squares)
    written = [v for kind in ("param", "grad") for v in json.loads(texts[kind]).values()]
    assert [int(fp, 16) for fp, _ in written] == fps[:len(written)]
    assert [ss for _, ss in written] == [float(f"{ss:.9g}") for ss in squares[:len(written)]]
    assert any(repr(ss) != f"{ss:.9g}" for ss in squares)  # (digits were dropped)
    assert [ss for _, ss in agent.fingerprints(torch, tensors, np)] == [float(f"{ss:.9g}") for ss in squares]


def test_pythons_generator_read_in_place_prints_as_its_getstate() -> None:
    import random

    agent = _fingerprint_module()
    prints = agent.RngPrints()
    generator = random.Random(5)
    module = type("random", (), {"_inst": generator, "getstate": generator.getstate})
    for draw in (lambda: None, generator.random, lambda: generator.gauss(0, 1), lambda: generator.seed(7)):
        draw()
        assert prints.python(module) == agent.python_rng_print(generator.getstate())
    assert prints.python_in_place


SPAWNED = textwrap.dedent(
    """
    import multiprocessing, torch
    def train():
        model = torch.nn.Linear(3, 1)
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(4):
            model(torch.randn(2, 3)).sum().backward(); opt.step(); opt.zero_grad()
    if __name__ == "__main__":
        child = multiprocessing.get_context("spawn").Process(target=train)
        child.start(); child.join()
        assert child.exitcode == 0
    """
)


def test_held_step_lines_are_written_before_an_exit_without_exit_handlers(tmp_path: Path) -> None:
    """Step lines are written a few together: a Ray Train worker, whose process ends without
    exit handlers, writes them with the run agent's ``flush`` at the end of its function; a
    multiprocessing child (it ends with ``os._exit``) at its finalizers."""
    end = "import os, _trainguard_run_agent; _trainguard_run_agent.flush(); os._exit(0)"
    _hooked(LOOP.replace("print(json.dumps(lrs))", end), tmp_path / "steps", "--steps", "5")
    assert [s["n"] for s in _steps(_lines(tmp_path / "steps"))] == [1, 2, 3, 4, 5]
    # a job that ends with os._exit itself (to skip gloo's teardown): the agent writes first
    _hooked(LOOP.replace("print(json.dumps(lrs))", "import os; os._exit(0)"), tmp_path / "exits", "--steps", "5")
    assert [s["n"] for s in _steps(_lines(tmp_path / "exits"))] == [1, 2, 3, 4, 5]
    (tmp_path / "spawned.py").write_text(SPAWNED)
    env = {k: v for k, v in os.environ.items() if k not in (ENV_SPEC, ENV_RUN_SPEC, "PYTHONPATH", "RANK")}
    env.update(run_hook_env({"steps_dir": str(tmp_path / "spawned")}, env), OMP_NUM_THREADS="1")
    subprocess.run([sys.executable, "spawned.py"], env=env, cwd=tmp_path, check=True, timeout=120)
    assert [s["n"] for s in _steps(_lines(tmp_path / "spawned"))] == [1, 2, 3, 4]


def test_rng_states_gathered_one_per_rank_are_rng() -> None:
    """The digits example saves ``rng`` as a list of per-rank dicts (torch, numpy, python): its
    checkpoint holds RNG state, so a resume that sets none is the resume's fault, not the save's."""
    agent = _fingerprint_module()
    per_rank = {"torch": torch.get_rng_state(), "numpy": {"keys": torch.zeros(3)}, "python": {"version": 3}}
    assert agent.owner_of([per_rank, dict(per_rank)]) == "rng"
    assert agent.owner_of([per_rank, {"weight": torch.zeros(2)}]) == "value"
    assert agent.owner_of([]) == "value"
    # Lightning's checkpoint: one state dict per optimizer and per scheduler, its rng_states
    assert agent.owner_of([{"state": {}, "param_groups": []}]) == "optimizer"
    assert agent.owner_of([{"last_epoch": 5, "base_lrs": [0.1]}]) == "scheduler"
    assert agent.owner_of({"torch": torch.get_rng_state(), "python": (3, (1,) * 625, None), "torch.cuda": []}) == "rng"


def test_names_lose_the_wrappers_prefixes() -> None:
    agent = _fingerprint_module()
    assert agent.clean_name("module._orig_mod.layers.0._fsdp_wrapped_module.weight") == "layers.0.weight"
    assert agent.clean_name("blocks.0._checkpoint_wrapped_module.attn.module.w") == "blocks.0.attn.module.w"
    assert agent.clean_name("module._forward_module.net.weight") == "net.weight"  # Lightning on DDP


def test_parameters_no_module_holds_are_named_by_the_module_tensor_over_their_elements() -> None:
    """torch's TP + DDP recipe puts in the module, at each forward, other objects over the elements
    of the parameters the optimizer holds (a new Parameter, then a DTensor as a plain attribute):
    the name is the module's for the same storage, offset, shape and dtype; a tensor of its own
    (a head made anew after the optimizer) keeps no name."""
    import torch

    values = _fingerprint_module()
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 1))
    held = [model[0].weight, model[0].bias, model[1].weight]
    with torch.no_grad():
        model[0].weight = torch.nn.Parameter(held[0].detach())  # a new object over the same elements
        del model[0].bias
        model[0].bias = held[1].detach().view(3)  # a plain attribute over them
        model[1].weight = torch.nn.Parameter(held[2].detach().clone())  # elements of its own
    names = values.names_by_storage([model, model[0]], held)
    assert names == {id(held[0]): "0.weight", id(held[1]): "0.bias"}
    assert values.storage_key(held[1][:2]) != values.storage_key(held[1])  # a view of fewer elements


def _job(tmp_path: Path, **job: object) -> JobRunner:
    tmp_path.mkdir()
    (tmp_path / "train.py").write_text(LOOP.replace("print(json.dumps(lrs))", "")
                                       .replace("opt.step(); opt.zero_grad(); sched.step()",
                                                "opt.step(); opt.zero_grad(); sched.step(); print(f'step {step} loss 1.0', flush=True)"))
    path = tmp_path / "trainguard.yaml"
    path.write_text(yaml.safe_dump({"job": {
        "name": "steps", "command": f"{sys.executable} train.py --steps {{steps}}", "timeout": 120,
        "metrics": {"loss": r"step (?P<step>\d+) loss (?P<value>\S+)"}, "record_samples": False,
        "env": {"OMP_NUM_THREADS": "1"}, **job}}))
    return JobRunner(parse_config(path.read_text(), path=path))


def test_a_profile_run_records_no_steps_nor_a_job_with_record_steps_off(tmp_path: Path) -> None:
    # (a command job's runs record them by default: the Trainer tests of test_run_hook.py read them)
    runner = _job(tmp_path / "on")
    try:
        _, profiled = measure_size(runner, ProfileCheck(steps=2, warmup_steps=0), 1, seed=0)
        assert profiled.ok, profiled.reason
        assert not (profiled.run_dir / STEPS_DIR).exists()
    finally:
        runner.close()
    runner = _job(tmp_path / "off", record_steps=False)
    try:
        result = runner.run(runner.request_for(SmokeCheck(steps=2)), label="off")
        assert result.ok, result.reason
        assert not (result.run_dir / STEPS_DIR).exists()
    finally:
        runner.close()
