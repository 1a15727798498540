"""The start-up hook's run agent in real processes: the Hugging Face and Lightning Trainers'
per-step training loss at full precision (through the runner, as a job file asks for it), the
sample indices of each DataLoader batch, and jobs the agent must leave alone."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml

from tests.helpers import report_evidence
from trainguard.config import parse_config
from trainguard.config.checks import SmokeCheck
from trainguard.launch import RunResult
from trainguard.launch.hook import ENV_RUN_SPEC, ENV_SPEC, STEPS_DIR, hook_env, run_hook_env
from trainguard.launch.samples import read_samples
from trainguard.run.runner import JobRunner

OFFLINE = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}

HF_TRAIN = textwrap.dedent(
    """
    import argparse, json, os
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments

    class RandomIds(torch.utils.data.Dataset):  # no tokenizer: random token ids
        def __init__(self):
            self.ids = torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(0))
        def __len__(self):
            return len(self.ids)
        def __getitem__(self, i):
            return {"input_ids": self.ids[i], "labels": self.ids[i]}

    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int)
    p.add_argument("--out")
    a = p.parse_args()
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=64, n_positions=16, n_embd=16, n_layer=1, n_head=2,
                        bos_token_id=0, eos_token_id=0)
    args = TrainingArguments(output_dir=a.out, max_steps=a.steps, logging_steps=2,
                             gradient_accumulation_steps=2, per_device_train_batch_size=4,
                             use_cpu=True, report_to=[], save_strategy="no", disable_tqdm=True,
                             seed=0, learning_rate=1e-3)
    trainer = Trainer(model=GPT2LMHeadModel(config), args=args, train_dataset=RandomIds())
    trainer.train()
    if trainer.is_world_process_zero():
        with open(os.path.join(a.out, "log_history.json"), "w") as f:
            json.dump(trainer.state.log_history, f)
    # a job that leaves its gloo group to the interpreter's exit may abort there ("terminate called
    # without an active exception", pytorch#190489): it did in 2 of 4 runs on a loaded machine.
    # Destroying the group first still aborted once in a loaded run (session 16): the rest of the
    # interpreter's teardown is skipped; what this test reads (the hook's records) is written
    if torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    import sys
    sys.stdout.flush(); sys.stderr.flush()
    os._exit(0)
    """
)

LIGHTNING_TRAIN = textwrap.dedent(
    """
    import argparse, importlib, json, pickle
    import torch

    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int)
    p.add_argument("--out")
    p.add_argument("--package")
    a = p.parse_args()
    pl = importlib.import_module(a.package)

    class Model(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = torch.nn.Linear(8, 1)
            self.raw = []  # every micro-batch's loss as training_step computed it
        def training_step(self, batch, batch_idx):
            x, y = batch
            loss = torch.nn.functional.mse_loss(self.net(x), y)
            self.raw.append(loss.item())
            self.log("train_mse", loss, on_step=True)
            return loss
        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    data = torch.utils.data.TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
    loader = torch.utils.data.DataLoader(data, batch_size=4, shuffle=True)
    model = Model()
    trainer = pl.Trainer(max_steps=a.steps, accelerator="cpu", devices=1, accumulate_grad_batches=2,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False)
    # ddp_spawn pickles the Trainer with its callbacks: the recorder must survive that
    mine = [c for c in pickle.loads(pickle.dumps(trainer.callbacks)) if type(c).__name__ == "TrainguardRecorder"]
    assert len(mine) == 1, trainer.callbacks
    trainer.fit(model, loader)
    with open(a.out + "/raw.json", "w") as f:
        json.dump(model.raw, f)
    """
)

NO_TORCH = textwrap.dedent(
    """
    import json, os, sys
    print(json.dumps({"agent": "_trainguard_run_agent" in sys.modules, "torch": "torch" in sys.modules,
                      "spec": json.loads(os.environ["TRAINGUARD_RUN_HOOK"])}), flush=True)
    for i in range(int(sys.argv[1])):
        print(f"train loss {1.0 / (i + 1)}", flush=True)
    """
)


def _run_job(tmp_path: Path, script: str, command: str, metrics: dict, *, steps: int = 4,
             world_size: int = 1, **job: object) -> RunResult:
    (tmp_path / "train.py").write_text(script)
    path = tmp_path / "trainguard.yaml"
    path.write_text(yaml.safe_dump({"job": {
        "name": "hook", "command": command, "metrics": metrics, "timeout": 180, "stall_timeout": 120,
        "world_size": world_size, "env": OFFLINE, **job}}))
    job_file = parse_config(path.read_text(), path=path)
    runner = JobRunner(job_file)
    try:
        request = runner.request_for(SmokeCheck(steps=steps), world_size=world_size)
        return runner.run(request, label="hook")
    finally:
        runner.close()


def _steps(result: RunResult, name: str = "loss") -> dict[int, dict[int, float]]:
    out: dict[int, dict[int, float]] = {}
    for p in result.points:
        if p.name == name:
            out.setdefault(p.step, {})[p.rank] = p.value
    return out


@pytest.mark.slow  # the HF example's clean test reads the Trainer's loss through the hook end to end
def test_hugging_face_trainer_loss_per_step_on_every_rank(tmp_path: Path) -> None:
    pytest.importorskip("transformers")
    result = _run_job(
        tmp_path, HF_TRAIN,
        f"{sys.executable} train.py --steps {{steps}} --out {{checkpoint_dir}}",
        {"loss": {"trainer": "huggingface"}, "lr": {"trainer": "huggingface", "key": "learning_rate"}},
        world_size=2,
    )
    assert result.ok, result.reason + result.stderr_tail
    losses = _steps(result)
    assert sorted(losses) == [1, 2, 3, 4] and all(sorted(r) == [0, 1] for r in losses.values())
    assert losses[1][0] != losses[1][1]  # each rank's local loss, not a reduced one
    history = json.loads((Path(report_evidence(result)["checkpoint_dir"]) / "log_history.json").read_text())
    logged = {h["step"]: h["loss"] for h in history if "loss" in h}
    assert sorted(logged) == [2, 4]
    for step, value in logged.items():  # the Trainer's log: mean over 2 steps and over the ranks
        mine = math.fsum(v for s in (step - 1, step) for v in losses[s].values()) / 4
        assert abs(mine - value) < 1e-6, (step, mine, value)
    assert sorted(_steps(result, "lr")) == [2, 4]
    # the sample indices each rank's batches held: 4 steps x 2 micro-batches (accelerate reads
    # one batch ahead), the two ranks' shards disjoint
    samples = read_samples(result.run_dir)
    assert sorted(samples) == [0, 1]
    assert all(len(batches) >= 8 and all(len(b.indices) == 4 for b in batches) for batches in samples.values())
    assert not {i for b in samples[0][:8] for i in b.indices} & {i for b in samples[1][:8] for i in b.indices}
    # the step records: accelerate's optimizer wraps the torch one (one line per step, not two),
    # DDP's "module." left out of the names, the ranks' parameters and gradients alike (DDP
    # broadcast the first and averaged the second)
    records = [[json.loads(line) for line in (result.run_dir / STEPS_DIR / f"rank{r}.jsonl").read_text().splitlines()]
               for r in (0, 1)]
    steps = [[r for r in lines if r["k"] == "step"] for lines in records]
    assert [[s["n"] for s in mine] for mine in steps] == [[1, 2, 3, 4]] * 2
    assert [lines[0]["rank"] for lines in records] == [0, 1] and records[0][0]["world"] == 2
    assert all(s["backward"] == 2 for mine in steps for s in mine)
    assert [[s["param"], s["grad"]] for s in steps[0]] == [[s["param"], s["grad"]] for s in steps[1]]
    assert "transformer.wte.weight" in steps[0][0]["param"]
    assert not any(name.startswith("module.") for name in steps[0][0]["param"])


@pytest.mark.parametrize("package", [
    "lightning.pytorch",
    # the same callback through the older package name: another 8 s of imports
    pytest.param("pytorch_lightning", marks=pytest.mark.slow),
])
def test_lightning_trainer_loss_per_step(tmp_path: Path, package: str) -> None:
    pytest.importorskip(package)
    result = _run_job(
        tmp_path, LIGHTNING_TRAIN,
        f"{sys.executable} train.py --steps {{steps}} --out {{checkpoint_dir}} --package {package}",
        {"loss": {"trainer": "lightning"}, "mse": {"trainer": "lightning", "key": "train_mse"}},
        distributed_env=False,
    )
    assert result.ok, result.reason + result.stderr_tail
    raw = json.loads((Path(report_evidence(result)["checkpoint_dir"]) / "raw.json").read_text())
    assert len(raw) == 8  # 4 optimizer steps of 2 micro-batches
    losses = {s: r[0] for s, r in _steps(result).items()}
    assert sorted(losses) == [1, 2, 3, 4]
    for step, value in losses.items():
        assert abs(value - (raw[2 * step - 2] + raw[2 * step - 1]) / 2) < 1e-6, (step, value, raw)
    # a logged key: what self.log recorded at that step (the step's last micro-batch)
    assert {s: r[0] for s, r in _steps(result, "mse").items()} == pytest.approx(
        {s: raw[2 * s - 1] for s in (1, 2, 3, 4)}, abs=1e-6)
    # the step records: Lightning runs forward and backward inside optimizer.step(closure), and
    # the record is made after the closure: the step's gradients are in it
    lines = (result.run_dir / STEPS_DIR / "rank0.jsonl").read_text().splitlines()
    steps = [r for r in map(json.loads, lines) if r["k"] == "step"]
    assert [s["n"] for s in steps] == [1, 2, 3, 4] and all(s["backward"] == 2 for s in steps)
    for s in steps:
        assert set(s["param"]) == {"net.weight", "net.bias"}
        assert all(s["grad"][n] is not None and s["grad"][n][1] > 0 for n in s["param"])
    assert len({s["param"]["net.weight"][0] for s in steps}) == 4


LOADERS = textwrap.dedent(
    """
    import json, sys
    import torch
    from torch.utils.data import BatchSampler, DataLoader, RandomSampler, TensorDataset

    data = TensorDataset(torch.arange(40))
    def sampler():
        return RandomSampler(data, generator=torch.Generator().manual_seed(7))
    twin = BatchSampler(sampler(), 4, False)
    expected = {"fresh": [list(twin) for _ in range(2)], "persistent": [], "cut": []}
    twin = BatchSampler(sampler(), 4, False)
    expected["persistent"] = [list(twin) for _ in range(2)]
    expected["cut"] = list(BatchSampler(sampler(), 4, False))[:2]

    seen = {}
    fresh = DataLoader(data, batch_size=4, sampler=sampler(), num_workers=2)
    seen["fresh"] = [[b[0].tolist() for b in fresh] for _ in range(2)]
    persistent = DataLoader(data, batch_size=4, sampler=sampler(), num_workers=2, persistent_workers=True)
    seen["persistent"] = [[b[0].tolist() for b in persistent] for _ in range(2)]
    cut = DataLoader(data, batch_size=4, sampler=sampler(), num_workers=2, prefetch_factor=4)
    seen["cut"] = []
    for batch in cut:
        seen["cut"].append(batch[0].tolist())
        if len(seen["cut"]) == 2:
            break  # the workers were asked for more batches than were taken
    print(json.dumps({"expected": expected, "seen": seen}))
    """
)


def _hooked(code: str, spec: dict, *args: str, env: dict | None = None) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k not in (ENV_SPEC, ENV_RUN_SPEC, "PYTHONPATH", "RANK")}
    full.update(env or {})
    full.update(run_hook_env(spec, full))
    return subprocess.run([sys.executable, "-c", code, *args], env=full, capture_output=True, text=True,
                          timeout=120, check=False)


def test_sample_indices_of_every_batch_once_in_the_samplers_order(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    done = _hooked(LOADERS, {"samples_dir": str(tmp_path / "trainguard-samples")})
    assert done.returncode == 0, done.stderr
    out = json.loads(done.stdout)
    assert out["seen"] == out["expected"]  # the hook changed nothing the job sees
    batches = read_samples(tmp_path)[0]
    got: dict[int, dict[int, list]] = {}
    for b in batches:
        got.setdefault(b.loader, {}).setdefault(b.iter, []).append(b.indices)
        assert b.dataset == "TensorDataset(40)"
        assert b.batch == len(got[b.loader][b.iter]) - 1
    expected = out["expected"]
    assert got[0] == dict(enumerate(expected["fresh"]))
    assert got[1] == dict(enumerate(expected["persistent"]))  # one iterator reset: iter 1
    assert got[2] == {0: expected["cut"]}  # what was yielded, not what the workers prefetched


def test_an_agent_that_cannot_write_tells_once_and_the_job_goes_on(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    code = ("import torch\nfrom torch.utils.data import DataLoader\n"
            "print(sum(len(b) for b in DataLoader(list(range(10)), batch_size=2)))\n")
    done = _hooked(code, {"samples_dir": str(blocker / "trainguard-samples")})
    assert done.returncode == 0 and done.stdout.strip() == "10", done.stderr
    assert done.stderr.count("trainguard run hook: recording sample indices failed") == 1, done.stderr


def test_a_job_without_torch_runs_with_the_hook_and_counts_its_steps(tmp_path: Path) -> None:
    result = _run_job(tmp_path, NO_TORCH, f"{sys.executable} train.py {{steps}}",
                      {"loss": {"regex": r"train loss (?P<value>\S+)", "step": "count"}}, steps=3)
    assert result.ok, result.reason + result.stderr_tail
    assert {s: r[0] for s, r in _steps(result).items()} == pytest.approx({1: 1.0, 2: 0.5, 3: 1 / 3})
    probe = json.loads((result.run_dir / "rank0.stdout.log").read_text().splitlines()[0])
    assert probe["agent"] and not probe["torch"]
    assert probe["spec"]["samples_dir"] == str(result.run_dir / "trainguard-samples")
    assert read_samples(result.run_dir) == {}


def test_the_hook_stays_off_without_trainer_sources_or_sample_records(tmp_path: Path) -> None:
    probe = "import os, sys; print(os.environ.get('TRAINGUARD_RUN_HOOK'), '_trainguard_run_agent' in sys.modules)"
    script = f"{probe}\nprint('step 1 loss 0.5')\n"
    result = _run_job(tmp_path, script, f"{sys.executable} train.py {{steps}}",
                      {"loss": r"step (?P<step>\d+) loss (?P<value>\S+)"}, steps=1, record_samples=False,
                      record_steps=False)
    assert result.ok, result.reason
    assert (result.run_dir / "rank0.stdout.log").read_text().splitlines()[0] == "None False"


def test_the_fault_and_run_agents_both_load_in_one_process(tmp_path: Path) -> None:
    fault = {"fault": "disk_full", "mode": "hook", "rank": None, "trigger": str(tmp_path / "trigger"),
             "events": str(tmp_path / "events.jsonl"), "dir": str(tmp_path / "ckpt")}
    code = "import sys; print(sorted(m for m in sys.modules if m.startswith('_trainguard')))"
    done = _hooked(code, {"samples_dir": str(tmp_path / "s")}, env=hook_env(fault))
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["['_trainguard_fault_agent',", "'_trainguard_run_agent']"]


STATEFUL = textwrap.dedent(
    """
    import json
    import torch
    from torch.utils.data import DataLoader, RandomSampler, TensorDataset
    from torchdata.stateful_dataloader import StatefulDataLoader

    data = TensorDataset(torch.arange(40))
    def loader(cls, **kw):
        return cls(data, batch_size=4, sampler=RandomSampler(data, generator=torch.Generator().manual_seed(3)),
                   num_workers=2, **kw)
    yielded = {"first": [], "resumed": [], "unordered": []}
    first = loader(StatefulDataLoader)
    for batch in first:
        yielded["first"].append(batch[0].tolist())
        if len(yielded["first"]) == 3:
            state = first.state_dict()  # the workers have prefetched batches past this one
            break
    resumed = loader(StatefulDataLoader)
    resumed.load_state_dict(state)
    yielded["resumed"] = [b[0].tolist() for b in resumed]
    yielded["unordered"] = [b[0].tolist() for b in loader(DataLoader, in_order=False)]
    print(json.dumps(yielded))
    """
)


def test_a_stateful_loader_with_workers_resumed_mid_epoch_records_what_it_yields(tmp_path: Path) -> None:
    """torchdata's StatefulDataLoader with 2 workers, its state taken while the workers had
    prefetched ahead and restored into a new loader: the records pair each yielded batch with
    its indices (the resumed loader's first batch is the 4th of the epoch, not a prefetched
    one). A loader with workers and in_order=False is not recorded: never a wrong pairing."""
    pytest.importorskip("torchdata", reason="needs torchdata (the fsdp extra)")
    done = _hooked(STATEFUL, {"samples_dir": str(tmp_path / "trainguard-samples")})
    assert done.returncode == 0, done.stderr
    yielded = json.loads(done.stdout)
    batches = read_samples(tmp_path)[0]
    by_loader: dict[int, list[list]] = {}
    for b in batches:
        by_loader.setdefault(b.loader, []).append(b.indices)
    assert by_loader[0] == yielded["first"] and by_loader[1] == yielded["resumed"]
    assert len(yielded["first"]) + len(yielded["resumed"]) == 10  # the epoch, each batch once
    assert 2 not in by_loader and len(yielded["unordered"]) == 10


def test_a_record_is_parsed_once_until_it_changes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A check reads one run's records for its accounting, replay and diagnosis: parsed once; a
    record that grew (a run still writing) is read again."""
    from trainguard.launch import samples

    folder = tmp_path / "trainguard-samples"
    folder.mkdir()
    line = {"loader": 0, "dataset": "D(8)", "iter": 0, "batch": 0, "indices": [0, 1]}
    record = folder / "rank0.jsonl"
    record.write_text(json.dumps(line) + "\n")
    parsed: list[Path] = []
    real = samples._parse_batches
    monkeypatch.setattr(samples, "_parse_batches", lambda path, root: parsed.append(path) or real(path, root))
    first, second = read_samples(tmp_path), read_samples(tmp_path)
    assert first == second and [b.indices for b in first[0]] == [[0, 1]] and len(parsed) == 1
    first[0].clear()  # a caller's list is its own
    assert len(read_samples(tmp_path)[0]) == 1
    with record.open("a") as f:
        f.write(json.dumps(line | {"batch": 1, "indices": [2, 3]}) + "\n")
    assert [b.indices for b in read_samples(tmp_path)[0]] == [[0, 1], [2, 3]] and len(parsed) == 2
