"""The start-up hook in real Python processes: inert without its spec, chains the sitecustomize
that would have run without it, arms only the named rank's first process, and (disk_full) makes
writes under the checkpoint directory fail with the kernel's ENOSPC while open and truncate work.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

from trainguard.faults.hook import pull_trigger, read_events
from trainguard.launch.hook import ENV_SPEC, HOOK_DIR, hook_env

PROBE = textwrap.dedent(
    """
    import builtins, io, json, os, sys, threading
    print(json.dumps({
        "torch": "torch" in sys.modules,
        "loaded": "_trainguard_fault_agent" in sys.modules,
        "agent": getattr(sys.modules.get("_trainguard_fault_agent"), "_agent", None) is not None,
        "thread": any(t.name == "trainguard-fault-hook" for t in threading.enumerate()),
        "open_patched": builtins.open is not io.FileIO.__init__ and builtins.open.__module__ != "io"
                        and getattr(builtins.open, "__qualname__", "") != "open",
        "chained": os.environ.get("CHAINED_MARK", ""),
    }))
    """
)


def _chain_dir(tmp_path: Path) -> Path:
    chain = tmp_path / "chain"
    chain.mkdir()
    (chain / "sitecustomize.py").write_text(
        "import os, sys\nos.environ['CHAINED_MARK'] = 'ran'\n"
        "print('existing sitecustomize ran', file=sys.stderr)\n"
    )
    return chain


def _run(code: str, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    full = {k: v for k, v in os.environ.items() if k not in (ENV_SPEC, "PYTHONPATH", "RANK")}
    full.update(env)
    return subprocess.run([sys.executable, "-c", code, *args], env=full, capture_output=True,
                          text=True, timeout=60, check=False)


def _spec(tmp_path: Path, **extra: object) -> dict[str, object]:
    return {"fault": "disk_full", "mode": "hook", "rank": None,
            "trigger": str(tmp_path / "trigger"), "events": str(tmp_path / "events.jsonl"),
            "dir": str(tmp_path / "ckpt"), **extra}


def test_inert_without_the_env_var_but_chains_the_existing_sitecustomize(tmp_path: Path) -> None:
    chain = _chain_dir(tmp_path)
    done = _run(PROBE, {"PYTHONPATH": f"{HOOK_DIR}{os.pathsep}{chain}"})
    assert done.returncode == 0, done.stderr
    probe = json.loads(done.stdout)
    assert probe == {"torch": False, "loaded": False, "agent": False, "thread": False,
                     "open_patched": False, "chained": "ran"}
    assert "existing sitecustomize ran" in done.stderr


def test_armed_hook_chains_too_and_never_imports_torch(tmp_path: Path) -> None:
    chain = _chain_dir(tmp_path)
    env = hook_env(_spec(tmp_path), {"PYTHONPATH": str(chain)})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(HOOK_DIR), str(chain)]
    done = _run(PROBE, env)
    assert done.returncode == 0, done.stderr
    probe = json.loads(done.stdout)
    assert probe["chained"] == "ran" and probe["agent"] and probe["thread"]
    assert probe["open_patched"] and not probe["torch"]
    assert [e["event"] for e in read_events(tmp_path / "events.jsonl")] == ["armed"]


def test_arms_only_the_named_rank(tmp_path: Path) -> None:
    env = hook_env(_spec(tmp_path, rank=0))
    other = _run(PROBE, {**env, "RANK": "1"})
    target = _run(PROBE, {**env, "RANK": "0"})
    assert not json.loads(other.stdout)["agent"]
    assert json.loads(target.stdout)["agent"]


def test_oom_arms_only_the_first_process_disk_full_every_process(tmp_path: Path) -> None:
    code = (
        "import subprocess, sys\n"
        f"subprocess.run([sys.executable, '-c', {PROBE!r}], check=True)\n"
    )
    oom = {"fault": "oom", "mode": "raise", "rank": 0, "trigger": str(tmp_path / "t"),
           "events": str(tmp_path / "oom.jsonl")}
    done = _run(code, {**hook_env(oom), "RANK": "0"})
    assert done.returncode == 0, done.stderr
    assert not json.loads(done.stdout)["agent"]  # the child (a DataLoader worker, say): inert
    assert [e["event"] for e in read_events(tmp_path / "oom.jsonl")] == ["armed"]
    # a checkpoint writer in a child process finds the disk as full as its parent does
    done = _run(code, hook_env(_spec(tmp_path)))
    assert json.loads(done.stdout)["agent"]
    assert len(read_events(tmp_path / "events.jsonl")) == 2


def test_a_broken_spec_does_not_stop_the_job(tmp_path: Path) -> None:
    done = _run("print('job ran')", {"PYTHONPATH": str(HOOK_DIR), ENV_SPEC: "{not json"})
    assert done.returncode == 0 and done.stdout.strip() == "job ran"
    assert "trainguard fault hook not armed" in done.stderr


WRITER = textwrap.dedent(
    """
    import os, sys, time
    ckpt, trigger, outside = sys.argv[1], sys.argv[2], sys.argv[3]
    def attempt(label, fn):
        try:
            fn()
            print(label, "ok")
        except OSError as exc:
            print(label, "errno", exc.errno)
    with open(os.path.join(ckpt, "ckpt.bin"), "wb") as f:
        f.write(b"x" * 1000)
    log = open(os.path.join(ckpt, "train.log"), "w")  # open before the fault
    fd = os.open(os.path.join(ckpt, "raw.bin"), os.O_WRONLY | os.O_CREAT)
    open(trigger, "w").close()
    time.sleep(0.2)  # the hook polls every 15 ms
    def overwrite():
        with open(os.path.join(ckpt, "ckpt.bin"), "wb") as f:
            f.write(b"y" * 1000)
    attempt("overwrite", overwrite)
    print("size after", os.path.getsize(os.path.join(ckpt, "ckpt.bin")))
    def new_file():
        with open(os.path.join(ckpt, "new.bin"), "xb") as f:
            f.write(b"z")
    attempt("new file", new_file)
    print("new exists", os.path.exists(os.path.join(ckpt, "new.bin")))
    def flush_log():
        log.write("step 3"); log.flush()
    attempt("already open", flush_log)
    attempt("os.write", lambda: os.write(fd, b"abc"))
    attempt("read", lambda: open(os.path.join(ckpt, "ckpt.bin"), "rb").read())
    attempt("outside", lambda: open(outside, "wb").write(b"fine"))
    os.unlink(trigger)  # the fault cleared: writes work again
    time.sleep(0.1)
    def rewrite():
        with open(os.path.join(ckpt, "ckpt.bin"), "wb") as f:
            f.write(b"w" * 10)
    attempt("after clear", rewrite)
    """
)


def test_disk_full_hook_fails_writes_with_enospc_but_not_open_or_truncate(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    trigger = tmp_path / "trigger"
    done = _run(WRITER, hook_env(_spec(tmp_path)), str(tmp_path / "ckpt"), str(trigger),
                str(tmp_path / "outside.bin"))
    assert done.returncode == 0, done.stderr
    lines = dict(line.rsplit(" ", 1) for line in done.stdout.splitlines()
                 if not line.endswith((" ok",)) and " errno " not in line)
    out = done.stdout.splitlines()
    assert "overwrite errno 28" in out
    assert lines["size after"] == "0"  # truncated by the open, as on a full disk
    assert "new file errno 28" in out and lines["new exists"] == "True"
    assert "already open errno 28" in out
    assert "os.write errno 28" in out
    assert "read ok" in out and "outside ok" in out
    assert "after clear ok" in out
    events = read_events(tmp_path / "events.jsonl")
    assert {e["event"] for e in events} >= {"armed", "triggered", "enospc", "cleared"}


def test_pull_trigger_names_the_target_process(tmp_path: Path) -> None:
    pull_trigger(tmp_path / "t", 1234)
    assert (tmp_path / "t").read_text() == "1234"
    pull_trigger(tmp_path / "u")
    assert (tmp_path / "u").read_text() == ""


def test_an_oom_trigger_naming_another_process_never_fires(tmp_path: Path) -> None:
    """A restarted attempt finds the first attempt's trigger: it names a dead pid, not its own."""
    trigger = tmp_path / "t"
    pull_trigger(trigger, 1)
    oom = {"fault": "oom", "mode": "raise", "rank": None, "trigger": str(trigger),
           "events": str(tmp_path / "oom.jsonl")}
    done = _run("import time; time.sleep(0.3); print('survived')", hook_env(oom))
    assert done.returncode == 0 and done.stdout.strip() == "survived", done.stderr
    assert [e["event"] for e in read_events(tmp_path / "oom.jsonl")] == ["armed"]


def test_crash_loop_arms_in_a_child_process_too(tmp_path: Path) -> None:
    """torchrun's worker is a child of torchrun's agent, the rank's first Python: crash_loop's
    hook arms there as well (its trigger names the pids that raise), where oom's stays inert."""
    code = f"import subprocess, sys\nsubprocess.run([sys.executable, '-c', {PROBE!r}], check=True)\n"
    loop = {"fault": "crash_loop", "mode": "raise", "rank": None, "trigger": str(tmp_path / "t"),
            "events": str(tmp_path / "loop.jsonl"), "step": 5}
    done = _run(code, hook_env(loop))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["agent"]
    assert [e["event"] for e in read_events(tmp_path / "loop.jsonl")] == ["armed", "armed"]


TRAINING_THREAD = textwrap.dedent(
    """
    import json, os, sys, threading, time
    from trainguard.faults.hook import pull_trigger
    from trainguard.launch.hook import mark_training_thread
    seen = {}
    def train():
        mark_training_thread()
        pull_trigger(__import__("pathlib").Path(sys.argv[1]), [1, os.getpid()])  # the drill names this pid
        try:
            for _ in range(500):
                time.sleep(0.01)
        except RuntimeError as exc:
            seen["error"] = f"{type(exc).__mro__[1].__name__}: {exc}"
    t = threading.Thread(target=train, name="TrainingThread")
    t.start(); t.join()
    time.sleep(0.1)  # the main thread is not interrupted
    print(json.dumps(seen))
    """
)


def test_crash_loop_raise_lands_in_the_marked_training_thread(tmp_path: Path) -> None:
    """A Ray Train worker runs its train function in a thread of its own: once marked, the raise
    goes there (the main thread goes on), when the trigger names this process among others."""
    loop = {"fault": "crash_loop", "mode": "raise", "rank": None, "trigger": str(tmp_path / "t"),
            "events": str(tmp_path / "loop.jsonl"), "step": 5}
    done = _run(TRAINING_THREAD, hook_env(loop), str(tmp_path / "t"))
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == {
        "error": "RuntimeError: trainguard crash_loop drill: error raised at step 5 (how: raise) on rank 0"}
    events = read_events(tmp_path / "loop.jsonl")
    assert [e["event"] for e in events] == ["armed", "training_thread", "triggered", "raised"], events
    assert events[1]["thread"] == "TrainingThread"
