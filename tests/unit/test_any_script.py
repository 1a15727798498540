"""Scripts with no option for their number of steps (``job.stop_after_steps``, docs/any-script.md):
trainguard ends each run itself after the check's steps. The stop condition on built snapshots,
the job-file rules, what init writes, and the checks on a real epoch-based script
(tests/data/jobs/epoch_train.py): clean it passes smoke, canary and determinism; unseeded it
fails determinism; saving only at an epoch's end, the resume check says there is no checkpoint."""

from __future__ import annotations

import re
import shutil
import sys
import textwrap
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from trainguard.config import parse_config
from trainguard.config.scaffold import InitChoices, draft_job, render_job_file
from trainguard.config.scriptscan import scan_script
from trainguard.errors import ConfigError
from trainguard.launch import Launcher, LaunchSpec, MetricPoint
from trainguard.launch.stops import (
    SILENT_RANK_WAIT_MAX_S,
    Progress,
    Snapshot,
    StepsDone,
    ended_by_trainguard,
    first_stop,
    stop_conditions,
)
from trainguard.session import check

JOBS = Path(__file__).resolve().parents[1] / "data" / "jobs"


@pytest.fixture
def jobs(tmp_path: Path) -> Path:
    """A private copy of the toy jobs (their run directories land next to the job files)."""
    return Path(shutil.copytree(JOBS, tmp_path / "jobs"))


# -- the stop condition -------------------------------------------------------------------------


def progress(*steps: tuple[int, int]) -> dict[int, int]:
    """Each rank's highest step after the ``(rank, step)`` lines, as the launcher's Progress keeps it."""
    seen = Progress(final_step=5)
    for rank, step in steps:
        seen.record(MetricPoint("loss", step, 1.0, rank, 0.5))
    return seen.last_step


def snapshot(last_step: dict[int, int]) -> Snapshot:
    return Snapshot(now=1.0, exit_codes={0: None, 1: None}, job_time=1.0, last_step=last_step)


def test_the_run_ends_once_every_rank_that_prints_is_past_the_final_step() -> None:
    # rank 1 at step 5 may still print step 5's other lines: not yet; a step 6 line from each: done
    assert StepsDone(5).check(snapshot(progress((0, 6), (1, 5)))) is None
    stop = StepsDone(5).check(snapshot(progress((0, 6), (1, 6), (0, 7))))
    assert stop is not None and stop.outcome == "ok"
    assert stop.reason == "ended by trainguard after step 5"
    assert ended_by_trainguard(stop.evidence) == 5
    # no line at all: nothing to end on
    assert StepsDone(5).check(snapshot({})) is None


def test_a_running_rank_that_printed_nothing_is_waited_for_as_long_as_the_printers_took_to_start() -> None:
    # rank 0's first line came 2.0 s after the launch, its step 5 at 2.4 s: rank 1, running and
    # silent, may only have started late; it is waited for until 2.4 + 2.0 s
    kept = [MetricPoint("loss", step, 1.0, 0, 1.9 + 0.1 * step) for step in range(1, 6)]
    state = Snapshot(now=4.0, exit_codes={0: None, 1: None}, job_time=4.0, last_step={0: 6}, points=kept)
    assert StepsDone(5).check(state) is None
    stop = StepsDone(5).check(replace(state, now=4.6))
    assert stop is not None and stop.evidence["ended_by_trainguard"] == {
        "after_step": 5, "ranks_seen": [0], "silent_ranks": [1], "waited_for_them_s": 2.0}
    # one that has exited is not waited for; nor is any longer than SILENT_RANK_WAIT_MAX_S
    assert StepsDone(5).check(replace(state, exit_codes={0: None, 1: 0})) is not None
    slow = [replace(p, t=p.t + 100.0) for p in kept]
    assert StepsDone(5).check(replace(state, points=slow, now=102.4 + SILENT_RANK_WAIT_MAX_S - 0.1)) is None
    assert StepsDone(5).check(replace(state, points=slow, now=102.4 + SILENT_RANK_WAIT_MAX_S + 0.1)) is not None


@pytest.mark.slow  # a real 2-rank launch (3 s, mostly sleeping)
@pytest.mark.timeout(120)
def test_a_second_rank_that_starts_printing_after_the_first_is_past_the_step_is_waited_for(tmp_path: Path) -> None:
    # two ranks that share no collective, rank 1's start-up 0.8 s longer than rank 0's 2 s: rank 0
    # is past step 5 before rank 1 printed anything; the run still holds both ranks' steps 1..5
    spec = LaunchSpec([sys.executable, str(JOBS / "epoch_train.py"), "--start-delay", "2", "0.8"],
                      run_dir=tmp_path / "run", world_size=2, timeout=60, final_step=5, end_after_final_step=True,
                      metric_regexes={"loss": r"\| step (?P<step>\d+) \| loss (?P<value>\S+)"})
    result = Launcher(spec).run()
    assert result.outcome == "ok", result.reason
    assert result.evidence["ended_by_trainguard"]["ranks_seen"] == [0, 1], result.evidence
    steps = {rank: sorted(p.step for p in result.points if p.rank == rank) for rank in (0, 1)}
    assert steps == {0: [1, 2, 3, 4, 5], 1: [1, 2, 3, 4, 5]}


def test_the_condition_is_asked_only_for_a_job_trainguard_ends_and_after_the_jobs_own_end() -> None:
    names = [type(c).__name__ for c in stop_conditions(timeout=9.0, stall_timeout=5.0, end_after_step=5)]
    assert names.index("StepsDone") == names.index("AllRanksExited") + 1
    assert "StepsDone" not in [type(c).__name__ for c in stop_conditions(timeout=9.0, stall_timeout=5.0)]
    # a rank that crashed as the others passed the step is the job's failure, not trainguard's end
    crashed = Snapshot(now=1.0, exit_codes={0: None, 1: 3}, exit_seen_at={1: 0.9}, job_time=1.0,
                       last_step={0: 6, 1: 6})
    stop = first_stop(stop_conditions(timeout=9.0, stall_timeout=5.0, end_after_step=5), crashed)
    assert stop is not None and stop.outcome == "failed" and ended_by_trainguard(stop.evidence) is None


# -- the job file ---------------------------------------------------------------------------------


def job_text(command: str, **job: object) -> str:
    return yaml.safe_dump({"job": {"name": "e", "command": command, "metrics": {"loss": r"step (?P<step>\d+) loss (?P<value>\S+)"},
                                   **job}, "checks": {"smoke": {"steps": 5}}})


def test_a_command_without_steps_names_stop_after_steps_as_the_fix_and_accepts_it() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(job_text("python train.py"), path="jobs/trainguard.yaml")
    assert "checks.smoke.steps" in str(info.value) and "add `stop_after_steps: true` under job" in str(info.value)
    assert parse_config(job_text("python train.py", stop_after_steps=True)).job.stop_after_steps


def test_stop_after_steps_beside_a_steps_placeholder_is_refused_naming_both() -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(job_text("python train.py --steps {steps}", stop_after_steps=True), path="jobs/trainguard.yaml")
    assert "job.stop_after_steps" in str(info.value)
    assert "Fix: remove one: `stop_after_steps: true` or the {steps} placeholder" in str(info.value)


def test_init_ends_the_runs_of_an_argparse_script_without_a_steps_option() -> None:
    source = textwrap.dedent('''\
        import argparse
        parser = argparse.ArgumentParser()
        parser.add_argument("--epochs", type=int, default=40)
        parser.add_argument("--seed", type=int, default=1)
        args = parser.parse_args()
        for epoch in range(args.epochs):
            for step in range(100):
                print(f"step {step} loss {1.0 / (step + 1)}")
        ''')
    text = render_job_file(draft_job(scan_script(source, "train.py"), "train.py", InitChoices()))
    job = parse_config(text).job
    assert job.stop_after_steps and "{steps}" not in " ".join(job.command)
    assert "--seed" in job.command


# -- real runs of an epoch-based script ----------------------------------------------------------


def test_an_epoch_script_trainguard_ends_passes_smoke_canary_and_determinism(jobs: Path) -> None:
    report = check(jobs / "epochs.trainguard.yaml")
    assert [(c.name, c.status) for c in report.checks] == [
        ("smoke", "passed"), ("canary", "passed"), ("determinism", "passed")], [c.summary for c in report.checks]
    smoke = report.checks[0]
    assert "ended by trainguard after step 12" in smoke.summary
    assert smoke.evidence.to_dict()["ended_by_trainguard"] == 12
    assert "all 12 steps" in report.checks[2].summary


def test_an_unseeded_epoch_script_fails_determinism(jobs: Path) -> None:
    report = check(jobs / "epochs_nondet.trainguard.yaml")
    assert report.checks[0].status == "failed" and "loss differs from step 1" in report.checks[0].summary


def test_resume_without_a_checkpoint_before_the_end_is_an_error_naming_the_key_and_fix(jobs: Path) -> None:
    report = check(jobs / "epochs_nockpt.trainguard.yaml")
    result = report.checks[0]
    assert result.status == "error"
    assert "epochs_nockpt.trainguard.yaml: checks.resume.after_step" in result.summary
    assert "wrote no checkpoint" in result.summary and "Fix: make the script save every few steps" in result.summary


def test_init_reads_a_loss_padded_to_a_width_whatever_its_digits() -> None:
    # word_language_model prints `loss {:5.2f}`: `loss  6.42` as well as `loss 11.23`; the regex
    # init wrote matched only the two-digit lines, so "every step" was one line an epoch
    source = textwrap.dedent('''\
        import argparse
        parser = argparse.ArgumentParser()
        parser.add_argument("--epochs", type=int, default=40)
        args = parser.parse_args()
        for batch in range(100):
            cur_loss = 1.0
            print("| {:5d} batches | loss {:5.2f} | ppl {:8.2f}".format(batch, cur_loss, 2.0))
        ''')
    text = render_job_file(draft_job(scan_script(source, "main.py"), "main.py", InitChoices()))
    regex = parse_config(text).job.metric_line_regexes[0]
    for line, value in (("|     3 batches | loss  6.42 | ppl     2.00", "6.42"), ("|    12 batches | loss 11.23 | ppl 2.00", "11.23")):
        found = re.search(regex, line)
        assert found is not None and found["value"] == value, (regex, line)


def job_of(source: str, script: str = "main.py") -> tuple[str, str]:
    """The job file init writes for ``source`` and its loss metric's regex."""
    text = render_job_file(draft_job(scan_script(source, script), script, InitChoices()))
    return text, parse_config(text).job.metric_line_regexes[0]


def test_init_keeps_the_loss_regex_off_the_test_loss_line() -> None:
    # time_sequence_prediction prints 'loss:' in its LBFGS closure and 'test loss:' after each
    # step: `loss: (?P<value>...)` matched both, so a test loss was counted as a training step
    source = textwrap.dedent('''\
        import argparse
        parser = argparse.ArgumentParser()
        parser.add_argument("--steps", type=int, default=15)
        args = parser.parse_args()
        for i in range(args.steps):
            print('STEP: ', i)
            def closure():
                loss = criterion(out, target)
                print('loss:', loss.item())
                return loss
            with torch.no_grad():
                loss = criterion(pred, test_target)
                print('test loss:', loss.item())
        ''')
    _, regex = job_of(source, "train.py")
    found = re.search(regex, "loss: 0.5012")
    assert found is not None and found["value"] == "0.5012", regex
    assert re.search(regex, "test loss: 0.0123") is None, regex


def test_init_follows_a_print_interval_passed_to_the_function_that_prints() -> None:
    # gat/main.py prints in train_iter(..., print_every) `if epoch % print_every == 0` and passes
    # args.val_every (default 20): a loss line every 20 epochs unless --val-every 1
    source = textwrap.dedent('''\
        import argparse
        def train_iter(epoch, model, optimizer, print_every=10):
            loss_train = 1.0 / epoch
            if epoch % print_every == 0:
                print(f'Epoch: {epoch:04d} loss_train: {loss_train:.4f}')
        parser = argparse.ArgumentParser()
        parser.add_argument('--epochs', type=int, default=300)
        parser.add_argument('--val-every', type=int, default=20)
        args = parser.parse_args()
        for epoch in range(args.epochs):
            train_iter(epoch + 1, None, None, args.val_every)
        ''')
    text, _ = job_of(source)
    assert "--val-every 1" in " ".join(parse_config(text).job.command), text


def test_init_guesses_no_flags_for_a_script_that_reads_no_arguments() -> None:
    # Lightning's examples/pytorch/basics/transformer.py reads no command line (Trainer(max_epochs
    # =20) in the code): init passed it guessed --steps/--ckpt-dir/--seed, which it ignored, so a
    # smoke "run of 5 steps" was 20 epochs; now trainguard ends the runs itself
    source = textwrap.dedent('''\
        import lightning as L
        class LanguageModel(L.LightningModule):
            def training_step(self, batch, batch_idx):
                loss = self.model(batch)
                self.log("train_loss", loss)
                return loss
        def main():
            L.seed_everything(42)
            trainer = L.Trainer(max_epochs=20)
            trainer.fit(LanguageModel())
        if __name__ == "__main__":
            main()
        ''')
    text = render_job_file(draft_job(scan_script(source, "transformer.py"), "transformer.py", InitChoices()))
    job = parse_config(text).job
    assert job.stop_after_steps and job.command == ["python", "transformer.py"], job.command
    assert "reads no command-line arguments" in text
    # one that reads sys.argv itself keeps the guessed flags, marked as guesses
    argv = source.replace("def main():", "import sys\ndef main():\n    print(sys.argv)")
    guessed = parse_config(render_job_file(draft_job(scan_script(argv, "t.py"), "t.py", InitChoices()))).job
    assert "{steps}" in " ".join(guessed.command) and not guessed.stop_after_steps


def test_init_says_when_the_loss_line_comes_only_every_k_steps_by_a_number_in_the_code() -> None:
    # Lightning's examples/fabric/language_model/train.py: `if batch_idx % 200 == 0: print(...)`;
    # init wrote the regex as if each step had its line, and the checks waited for lines that
    # come every 200 steps
    source = textwrap.dedent('''\
        def train_epoch(fabric, model, optimizer, train_dataloader, epoch):
            for batch_idx, batch in enumerate(train_dataloader):
                loss = model(batch)
                if batch_idx % 200 == 0:
                    fabric.print(f"epoch: {epoch} - iteration: {batch_idx} - loss {loss.item():.4f}")
        ''')
    text, _ = job_of(source, "train.py")
    assert "prints its loss line (line 5) only every 200 steps, a number in its code" in text, text
