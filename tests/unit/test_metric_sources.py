"""``job.metrics`` sources: the regex forms with an implicit step, the trainer form, their
errors, the launcher's step counting, and the sample records' reader."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from trainguard.config import MetricFile, MetricRegex, MetricTrainer, parse_config
from trainguard.errors import ConfigError
from trainguard.launch import LineMetric, MetricParser
from trainguard.launch.hook import ENV_RUN_SPEC, ENV_SPEC, HOOK_DIR, hook_env, run_hook_env
from trainguard.launch.samples import SampleBatch, read_samples

HEAD = "job:\n  name: j\n  command: python train.py --steps {steps}\n"


def _job(metrics: str, extra: str = ""):
    return parse_config(f"{HEAD}{extra}  metrics:\n{metrics}", path=Path("trainguard.yaml")).job


@pytest.mark.parametrize(("source", "kind", "check"), [
    (r"'step (?P<step>\d+) loss (?P<value>\S+)'", str, None),
    ("{file: 'm-{rank}.jsonl'}", MetricFile, None),
    (r"{regex: 'loss (?P<value>\S+)', step: count, every: 10}", MetricRegex, ("count", 10)),
    (r"{regex: 'loss (?P<value>\S+)'}", MetricRegex, ("count", 1)),
    (r"{regex: 'it (?P<step>\d+) loss (?P<value>\S+)'}", MetricRegex, ("step", 1)),
    (r"{regex: 'gs=(?P<global_step>\d+) loss=(?P<value>\S+)', step: global_step}", MetricRegex,
     ("global_step", 1)),
    ("{trainer: huggingface}", MetricTrainer, ("huggingface", "loss")),
    ("{trainer: lightning, key: train_loss}", MetricTrainer, ("lightning", "train_loss")),
])
def test_each_metric_source_form_loads(source: str, kind: type, check: tuple | None) -> None:
    job = _job(f"    loss: {source}\n")
    loaded = job.metrics["loss"]
    assert isinstance(loaded, kind)
    if isinstance(loaded, MetricRegex):
        assert (loaded.step_group, loaded.every) == check
    if isinstance(loaded, MetricTrainer):
        assert (loaded.trainer, loaded.key_for("loss")) == check
    assert job.record_samples is True


@pytest.mark.parametrize("source", [r"{regex: 'loss (?P<value>\S+)', step: count}",
                                    r"{regex: 'loss (?P<value>\S+)'}"])
def test_counted_steps_and_resume_args_are_refused_at_load(source: str) -> None:
    """A resumed run counts its lines from 1 again while it continues at step k + 1: smoke and
    resume would fail a job that resumes exactly, so the pair is refused where it is written
    (issue 24); without resume_args the same source loads."""
    with pytest.raises(ConfigError) as info:
        _job(f"    loss: {source}\n", extra="  resume_args: --resume\n")
    message = str(info.value)
    assert "job.metrics.loss.step: " in message and "job.resume_args is set" in message
    for alternative in ("(?P<step>\\d+)", "`step: <group>`", "{file: metrics.jsonl}", "{trainer: huggingface}",
                        "remove job.resume_args"):
        assert alternative in message, (alternative, message)
    assert _job(f"    loss: {source}\n").metrics["loss"].step_group == "count"
    stepped = _job(r"    loss: {regex: 'it (?P<step>\d+) loss (?P<value>\S+)'}" + "\n", extra="  resume_args: --resume\n")
    assert stepped.resume_args == ["--resume"]


@pytest.mark.parametrize(("source", "key", "words"), [
    (r"{regex: 'loss (\S+)', step: count}", "job.metrics.loss",
     ["lacks the named group(s) value", r"write it as (?P<value>\S+)"]),
    (r"{regex: 'loss (?P<value>\S+)', step: foo}", "job.metrics.loss",
     ["step: 'foo' names no group of regex", "(its groups: value)", "write `step: count`"]),
    (r"{regex: 'gs=(?P<global_stp>\d+) (?P<value>\S+)', step: global_step}", "job.metrics.loss",
     ["(did you mean 'global_stp'?)"]),
    (r"{regex: 'gs=(?P<gs>\d+) (?P<value>\S+)', step: gs, every: 2}", "job.metrics.loss",
     ["every: 2 applies to `step: count` only"]),
    (r"{regex: 'loss (?P<value>\S+', step: count}", "job.metrics.loss",
     ["is not a valid regular expression"]),
    (r"{regex: 'loss (?P<value>\S+)', setp: count}", "job.metrics.loss.setp",
     ["unknown key 'setp' (did you mean 'step'?)", "allowed here: regex, step, every"]),
    ("{trainer: lightnin}", "job.metrics.loss",
     ["unknown trainer 'lightnin' (did you mean 'lightning'?)", "known: huggingface, lightning"]),
    ("{trainer: hf}", "job.metrics.loss", ["(did you mean 'huggingface'?)"]),
    ("{trainer: huggingface, keys: eval_loss}", "job.metrics.loss.keys",
     ["unknown key 'keys' (did you mean 'key'?)", "allowed here: trainer, key"]),
    ("{trainr: huggingface}", "job.metrics.loss.trainr",
     ["unknown key 'trainr' (did you mean 'trainer'?)", "allowed here: trainer, key"]),
    ("{path: m.jsonl}", "job.metrics.loss", ["a metric mapping needs `file`, `regex` or `trainer`"]),
    (r"{trainer: huggingface, regex: 'x (?P<value>\S+)'}", "job.metrics.loss",
     ["give one of regex, trainer, not several"]),
    (r"'loss (?P<value>\S+)'", "job.metrics.loss",
     ["lacks the named group(s) step", "step: count}"]),
])
def test_a_wrong_metric_source_names_its_key_and_the_fix(source: str, key: str, words: list[str]) -> None:
    with pytest.raises(ConfigError) as info:
        _job(f"    loss: {source}\n")
    message = str(info.value)
    assert f"{key}: " in message, message
    for word in words:
        assert word in message, (word, message)


def test_trainer_sources_are_for_command_jobs() -> None:
    text = ("job:\n  name: rj\n  kind: ray_train\n  train_func: 'train:train_func'\n"
            "  config: {steps: '{steps}'}\n  scaling: {num_workers: 2}\n"
            "  metrics: {loss: {trainer: huggingface}}\n")
    with pytest.raises(ConfigError, match=r"job.metrics.loss: .*start-up hook of `kind: command` jobs"):
        parse_config(text, path=Path("trainguard.yaml"))


def test_record_samples_can_be_turned_off() -> None:
    assert _job("    loss: {trainer: lightning}\n", "  record_samples: false\n").record_samples is False


def test_implicit_steps_are_counted_per_rank_and_a_group_can_hold_the_step() -> None:
    parser = MetricParser({
        "loss": LineMetric(r"'loss': (?P<value>[^,}]+)", "count", 10),
        "acc": LineMetric(r"gs=(?P<global_step>\d+) acc=(?P<value>\S+)", "global_step"),
        "plain": r"step (?P<step>\d+) plain (?P<value>\S+)",
    })
    lines = [(0, "{'loss': 6.1, 'grad_norm': 1.0}"), (1, "{'loss': 6.3}"), (0, "{'loss': nan}"),
             (0, "{'eval_loss': 5.0}"), (0, "{'loss': ---}"), (0, "{'loss': 5.9}"),
             (1, "gs=40 acc=0.5"), (0, "step 7 plain 1.5")]
    points = [p for rank, line in lines for p in parser.parse(line, rank=rank, t=0.0)]
    got = [(p.name, p.rank, p.step, p.value) for p in points]
    assert got[0] == ("loss", 0, 10, 6.1) and got[1] == ("loss", 1, 10, 6.3)
    assert got[2][:3] == ("loss", 0, 20)  # nan is a value; eval_loss is not 'loss'
    # a matching line whose value is no number still takes its step: the next one is step 40
    assert got[3:] == [("loss", 0, 40, 5.9), ("acc", 1, 40, 0.5), ("plain", 0, 7, 1.5)]
    assert MetricParser({"loss": LineMetric(r"loss (?P<value>\S+)", "count")}).parse(
        "loss 1", rank=0, t=0.0)[0].step == 1  # a new parser (a new attempt) counts from 1


def test_the_run_hook_env_shares_the_fault_hooks_pythonpath_entry(tmp_path: Path) -> None:
    fault = hook_env({"trigger": str(tmp_path / "t")}, {"PYTHONPATH": "/job/src"})
    both = {**fault, **run_hook_env({"metrics_dir": str(tmp_path)}, fault)}
    assert both["PYTHONPATH"].split(os.pathsep) == [str(HOOK_DIR), "/job/src"]
    assert json.loads(both[ENV_SPEC])["trigger"] == str(tmp_path / "t")
    assert json.loads(both[ENV_RUN_SPEC]) == {"metrics_dir": str(tmp_path)}


def test_read_samples_gives_each_ranks_batches_in_order(tmp_path: Path) -> None:
    folder = tmp_path / "trainguard-samples"
    folder.mkdir()
    line = {"loader": 0, "dataset": "TensorDataset(8)", "iter": 0, "batch": 0, "indices": [3, 1]}
    (folder / "rank1.jsonl").write_text(json.dumps(line) + "\n" + json.dumps({**line, "batch": 1})
                                        + "\n" + '{"loader": 0, "iter"')  # cut short by a kill
    (folder / "rank0.jsonl").write_text(json.dumps({**line, "indices": [0, 2]}) + "\n")
    (folder / "notes.txt").write_text("not a rank file")
    samples = read_samples(tmp_path)
    assert list(samples) == [0, 1]
    assert samples[0] == [SampleBatch(0, "TensorDataset(8)", 0, 0, [0, 2])]
    assert [b.batch for b in samples[1]] == [0, 1]
    assert read_samples(tmp_path / "nothing-here") == {}
