"""The in-process half of trainguard's start-up hook: arms one fault inside a rank's Python.

Loaded by the hook's ``sitecustomize.py`` (by file path, standard library only: the job's
interpreter need not have trainguard installed) when ``TRAINGUARD_FAULT_HOOK`` holds a JSON spec.
Nothing here imports torch eagerly; torch is touched only when the fault fires or when the job
imports it itself.

Spec keys: ``fault`` (oom | disk_full | nan | sdc | crash_loop: mode raise only), ``mode``, ``rank`` (int, or null for every rank),
``trigger`` (a file the drill creates once the target rank printed step ``step``; for oom its
content is the target's pid, so a restarted attempt never fires), ``events`` (a JSONL file this
agent appends to), ``step``, and per mode: ``dir`` (disk_full), ``chunk_mb``, ``max_mb``,
``slack_mb``, ``headroom_mb``; ``target`` and ``value`` (nan: ``_trainguard_nan_agent.py``);
``target``, ``mode``, ``bit``, ``index``, ``name``, ``record`` (sdc: ``_trainguard_sdc_agent.py``).

oom, nan and sdc arm only in the first Python process of the rank (it records its pid in
``TRAINGUARD_FAULT_HOOK_PID``): DataLoader workers and spawned children inherit the hook inert.
disk_full arms in every Python process of the rank: a full disk is full for a checkpoint writer
in a child process too. crash_loop arms in every Python process of the rank as well (torchrun's
workers are children of its agent, a Ray worker is no child of the driver): its trigger names the
pids that raise, one a line, so only the process the drill chose fires.

A raise goes to the main thread (a signal handler); crash_loop's goes to the training thread
when the process named one (:func:`mark_training_thread`: a Ray Train worker runs the train
function in a thread of its own), as an asynchronous exception raised at that thread's next Python
instruction.

The file's name is unusual on purpose: the hook directory is first on the rank's PYTHONPATH, so
every module in it is importable by its bare name there.
"""

from __future__ import annotations

import builtins
import contextlib
import importlib.abc
import io
import json
import os
import signal
import sys
import threading
import time
import weakref
from typing import Any

ENV_SPEC = "TRAINGUARD_FAULT_HOOK"
ENV_PID = "TRAINGUARD_FAULT_HOOK_PID"
#: the run's directory, where a fault's agent writes what it did (sdc: its flips)
ENV_RUN_DIR = "TRAINGUARD_RUN_DIR"
POLL_S = 0.015
#: oom mode gpu: how long the ballast keeps taking the blocks a job frees, waiting for it to run out
GPU_GRAB_S = 60.0
#: a real-time signal: no library the job uses is likely to claim it (SIGUSR1/2 often are)
RAISE_SIGNAL = signal.SIGRTMIN + 7 if hasattr(signal, "SIGRTMIN") else signal.SIGUSR2
#: what torch.save to a path raises when the hook fails its write; torch's own messages on
#: ENOSPC vary by version ("unexpected pos ...", "file write failed", "basic_ios::clear")
TORCH_ENOSPC = (
    "[enforce fail at inline_container.cc] . PytorchStreamWriter failed writing file data/0: "
    "file write failed: No space left on device (errno 28; injected by trainguard's disk_full "
    "hook)"
)

_agent: Agent | None = None


def install(raw_spec: str) -> Agent | None:
    """Arm the fault described by ``raw_spec`` in this process (once); None when it is not ours."""
    global _agent
    if _agent is not None:
        return _agent
    spec = json.loads(raw_spec)
    target = spec.get("rank")
    if target is not None and os.environ.get("RANK", "0") != str(target):
        return None
    if spec.get("fault") in ("oom", "nan", "sdc"):
        owner = os.environ.get(ENV_PID)
        if owner and owner != str(os.getpid()):
            return None  # a child of the armed process (DataLoader worker, spawn child): inert
        os.environ[ENV_PID] = str(os.getpid())
    _agent = Agent(spec)
    _agent.arm()
    return _agent


class Agent:
    """One armed fault in this process."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.spec = spec
        self.fault = str(spec.get("fault", ""))
        self.mode = str(spec.get("mode", ""))
        self.trigger = str(spec["trigger"])
        self.events = spec.get("events")
        self.step = spec.get("step")
        self.fired = False
        self._ballast: list[Any] = []
        self._main_ident = threading.main_thread().ident
        #: the thread a raise goes to when it is not the main thread (mark_training_thread)
        self.training_ident: int | None = None
        self._raise_pending = False
        self._dir = os.path.realpath(spec["dir"]) if spec.get("dir") else None
        self._tracked_files: weakref.WeakSet[Any] = weakref.WeakSet()
        self._tracked_fds: dict[int, tuple[int, int]] = {}
        self._lock = threading.Lock()  # the job's threads open files while the poll thread fills
        self._real: dict[str, Any] = {}
        #: nan: the NanHook of _trainguard_nan_agent.py; sdc: the SdcHook of _trainguard_sdc_agent.py
        self.numerics: Any = None

    # -- arming ----------------------------------------------------------------------------

    def arm(self) -> None:
        if self.fault == "nan":  # acts in torch's loss functions and backward: no poll thread
            self.numerics = _sibling("_trainguard_nan_agent").NanHook(self)
            self.event("armed", fault=self.fault, target=self.numerics.target, argv=sys.argv[:3])
            self._when_torch_imported()
            return
        if self.fault == "sdc":  # acts in torch's optimizer, module and gradient hooks
            self.run_dir = os.environ.get(ENV_RUN_DIR)
            self.numerics = _sibling("_trainguard_sdc_agent").SdcHook(self)
            self.event("armed", fault=self.fault, target=self.numerics.target, mode=self.numerics.mode,
                       step=self.numerics.step, argv=sys.argv[:3])
            self._when_torch_imported()
            return
        if self.mode == "raise":  # oom's raise, crash_loop's raise
            # a Python signal handler always runs in the main thread, between bytecodes, and a
            # blocking call (sleep, a wait on a socket) is interrupted for it; an async exception
            # (PyThreadState_SetAsyncExc) would wait for the blocking call to return
            signal.signal(RAISE_SIGNAL, self._raise_in_main)
        if self.fault == "disk_full":
            self._patch_files()
        self.event("armed", fault=self.fault, mode=self.mode, argv=sys.argv[:3])
        threading.Thread(target=self._poll, name="trainguard-fault-hook", daemon=True).start()

    def event(self, name: str, **data: Any) -> None:
        if not self.events:
            return
        self.append(self.events, {"t": time.time(), "pid": os.getpid(), "rank": os.environ.get("RANK"),
                                  "event": name, **data})

    def append(self, path: str, record: dict[str, Any]) -> None:
        """Append ``record`` to the JSONL file ``path`` (one write; nothing raised)."""
        with contextlib.suppress(OSError, ValueError, TypeError):
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            try:
                os.write(fd, (json.dumps(record) + "\n").encode())
            finally:
                os.close(fd)

    def triggered(self) -> bool:
        """Whether the trigger is there for this process (oom: it names this pid; crash_loop: it
        must name it, the drill writes each attempt's pid)."""
        if self.fault not in ("oom", "crash_loop"):
            return os.path.exists(self.trigger)
        try:
            with self._real.get("open", builtins.open)(self.trigger) as f:
                content = f.read().strip()
        except OSError:
            return False
        if self.fault == "crash_loop":
            return str(os.getpid()) in content.split()
        return content == str(os.getpid()) or (content == "" and self.fault == "oom")

    def _poll(self) -> None:
        while True:
            try:
                if self.fault == "disk_full":
                    if self.triggered() and not self.fired:
                        self.fired = True
                        self._fill_open_files()
                        self.event("triggered")
                    elif self.fired and not self.triggered():
                        self.fired = False
                        self.event("cleared")
                elif self.triggered():
                    self.fired = True
                    self.event("triggered")
                    self._fire_oom()
                    return
            except MemoryError:  # the ballast is holding what it got: nothing else to do
                return
            except Exception as exc:  # never kill the job for a bug of ours: say so
                self.event("error", error=f"{type(exc).__name__}: {exc}")
                return
            time.sleep(POLL_S)

    # -- oom ---------------------------------------------------------------------------------

    def _fire_oom(self) -> None:
        in_training_thread = self.fault == "crash_loop" and self.training_ident not in (None, self._main_ident)
        if self.mode == "raise" and in_training_thread:
            self._raise_in_training_thread()
        elif self.mode == "raise":
            self._raise_pending = True
            assert self._main_ident is not None
            signal.pthread_kill(self._main_ident, RAISE_SIGNAL)
        elif self.mode == "gpu":
            self._gpu_ballast()
        elif self.mode == "rlimit":
            self._host_ballast(stop_at_slack=True)
        else:  # "ballast": a cgroup limit was just set above our usage; grow until killed
            self._host_ballast(stop_at_slack=False)

    def _raise_in_main(self, signum: int, frame: Any) -> None:
        if not self._raise_pending:
            return
        self._raise_pending = False
        if self.fault == "crash_loop":
            self.event("raised", error="RuntimeError", thread="MainThread")
            raise RuntimeError(self._crash_loop_message())
        error = _torch_oom_class()
        self.event("raised", error=error.__name__)
        raise error(
            f"trainguard fault drill: torch.OutOfMemoryError injected after step {self.step} "
            f"(oom mode raise) on rank {os.environ.get('RANK', '0')}"
        )

    def _crash_loop_message(self) -> str:
        return (f"trainguard crash_loop drill: error raised at step {self.step} (how: raise) on rank "
                f"{os.environ.get('RANK', '0')}")

    def _raise_in_training_thread(self) -> None:
        """Raise in the marked training thread: an asynchronous exception (a signal handler runs
        only in the main thread), raised at that thread's next Python instruction -- after the
        blocking call it may be in returns. CPython instantiates the class without arguments,
        so the message is the class's own."""
        import ctypes

        message = self._crash_loop_message()

        class TrainguardDrillError(RuntimeError):
            def __init__(self) -> None:
                super().__init__(message)

        ident = self.training_ident
        set_async = ctypes.pythonapi.PyThreadState_SetAsyncExc
        set_async.argtypes = (ctypes.c_ulong, ctypes.py_object)
        hit = set_async(ident, TrainguardDrillError)
        self.event("raised" if hit == 1 else "error", error="RuntimeError", thread=ident,
                   **({} if hit == 1 else {"why": f"no thread {ident} to raise in"}))

    def _host_ballast(self, *, stop_at_slack: bool) -> None:
        """Allocate and touch memory in chunks. cgroup mode: until the kernel kills us (or
        ``max_mb``, a safety net if no limit is in place). rlimit mode: until the address space
        left under RLIMIT_AS is ``slack_mb``, then hold it, so the job's next sizeable
        allocation fails in the job's own code."""
        chunk = int(float(self.spec.get("chunk_mb", 8)) * 2**20)
        cap = int(float(self.spec.get("max_mb", 4096)) * 2**20)
        slack = int(float(self.spec.get("slack_mb", 4)) * 2**20)
        held = 0
        self.event("ballast_start", chunk_mb=chunk / 2**20)
        import resource

        while held < cap:
            if stop_at_slack:
                soft, _ = resource.getrlimit(resource.RLIMIT_AS)
                left = soft - _vm_size() if soft != resource.RLIM_INFINITY else cap
                if left <= slack:
                    break
                size = min(chunk, max(left - slack, 2**16))
            else:
                size = chunk
            try:
                self._ballast.append(b"\x5a" * size)  # bytes repeat touches every page
            except MemoryError:
                if size <= 2**16:
                    break
                chunk = max(size // 4, 2**16)
                continue
            held += size
            if not stop_at_slack:
                time.sleep(0.002)  # let the kernel's reclaim and OOM killer keep up
        self.event("ballast_held", held_mb=round(held / 2**20, 1))

    def _gpu_ballast(self) -> None:
        torch = sys.modules.get("torch")
        if torch is None or not torch.cuda.is_available() or not torch.cuda.is_initialized():
            self.event("gpu_unavailable",
                       reason="torch with an initialized CUDA context is not in this process")
            return
        device = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
        # the job's cached free blocks go back to the device: its next step allocates anew
        # instead of reusing them, and that allocation is the one that fails
        torch.cuda.empty_cache()
        reserved = torch.cuda.memory_reserved(device)
        if self.spec.get("gpu_limit", "fraction") == "fraction":
            total = torch.cuda.get_device_properties(device).total_memory
            headroom = int(float(self.spec.get("headroom_mb", 32)) * 2**20)
            fraction = min(1.0, (reserved + headroom) / total)
            torch.cuda.set_per_process_memory_fraction(fraction, device)
            self.event("gpu_limit", fraction=fraction, reserved_mb=round(reserved / 2**20, 1))
        else:
            free, _ = torch.cuda.mem_get_info(device)
            self.event("gpu_fill", free_mb=round(free / 2**20, 1), reserved_mb=round(reserved / 2**20, 1))
        error = _torch_oom_class()

        def take(start: int) -> int:
            """Allocate chunks from ``start`` bytes down to 512 until each size fails: big ones
            take the device (or the capped fraction), small ones the free blocks left inside
            the segments the job's allocator already holds."""
            taken, chunk = 0, start
            while chunk >= 512:
                try:
                    self._ballast.append(torch.empty(chunk, dtype=torch.uint8, device=device))
                    taken += chunk
                except error:
                    chunk //= 2
            return taken

        held = take(2**30)
        self.event("ballast_held", held_mb=round(held / 2**20, 1), device=device)
        # A job whose steps need no more than they freed reuses its own blocks and would never
        # run out: keep taking every block it frees, until its next allocation fails (the rank
        # dies, and this daemon thread with it) or GPU_GRAB_S pass.
        deadline = time.monotonic() + float(self.spec.get("grab_s", GPU_GRAB_S))
        while time.monotonic() < deadline:
            held += take(2**21)
            time.sleep(0.0005)
        self.event("ballast_grab_ended", held_mb=round(held / 2**20, 1))

    # -- disk_full ---------------------------------------------------------------------------

    def _under(self, path: Any) -> bool:
        if self._dir is None or not isinstance(path, (str, bytes, os.PathLike)):
            return False
        try:
            real = os.path.realpath(os.fsdecode(path))
        except (TypeError, ValueError):
            return False
        return real == self._dir or real.startswith(self._dir + os.sep)

    def _patch_files(self) -> None:
        real_open = builtins.open
        real_os_open = os.open
        real_os_close = os.close
        self._real.update(open=real_open, os_open=real_os_open)
        agent = self

        def open(file: Any, mode: str = "r", *args: Any, **kwargs: Any) -> Any:
            f = real_open(file, mode, *args, **kwargs)
            if isinstance(mode, str) and _fails_writes(mode) and agent._under(file):
                agent._opened(f, file)
            return f

        def os_open(path: Any, flags: int, mode: int = 0o777, *, dir_fd: int | None = None) -> int:
            fd = real_os_open(path, flags, mode, dir_fd=dir_fd)
            if _fails_writes_flags(flags) and dir_fd is None and agent._under(path):
                if agent.triggered():
                    agent._to_dev_full(fd, path, "os.open")
                else:
                    st = os.fstat(fd)
                    with agent._lock:
                        agent._tracked_fds[fd] = (st.st_dev, st.st_ino)
            return fd

        def os_close(fd: int) -> None:
            agent._tracked_fds.pop(fd, None)
            real_os_close(fd)

        open.__doc__ = real_open.__doc__
        builtins.open = open
        io.open = open  # pathlib, os.fdopen and tempfile look it up here
        os.open = os_open  # type: ignore[assignment]
        os.close = os_close
        self._when_torch_imported()

    def _when_torch_imported(self) -> None:
        """Patch torch now if the job has imported it, else the moment it does."""
        if "torch" in sys.modules:
            self._patch_torch(sys.modules["torch"])
        else:
            sys.meta_path.insert(0, _TorchImportHook(self))

    def _opened(self, f: Any, path: Any) -> None:
        if self.triggered():
            self._to_dev_full(f.fileno(), path, "open")
        else:
            with self._lock:
                self._tracked_files.add(f)

    def _to_dev_full(self, fd: int, path: Any, via: str) -> None:
        """Point ``fd`` at /dev/full: the file was created/truncated for real; every write to it
        from now on fails in the kernel with ENOSPC, as on a full disk."""
        full = self._real["os_open"]("/dev/full", os.O_WRONLY | os.O_CLOEXEC)
        try:
            os.dup2(full, fd, inheritable=False)
        finally:
            os.close(full)
        self.event("enospc", path=os.fsdecode(path), via=via)

    def _fill_open_files(self) -> None:
        with self._lock:
            files, fds = list(self._tracked_files), dict(self._tracked_fds)
            self._tracked_files = weakref.WeakSet()
            self._tracked_fds.clear()
        for f in files:
            with contextlib.suppress(OSError, ValueError):
                if not f.closed:
                    self._to_dev_full(f.fileno(), getattr(f, "name", "?"), "already open")
        for fd, ident in fds.items():
            with contextlib.suppress(OSError):
                st = os.fstat(fd)
                if (st.st_dev, st.st_ino) == ident:
                    self._to_dev_full(fd, f"fd {fd}", "already open (os.open)")

    def _patch_torch(self, torch: Any) -> None:
        if self.numerics is not None:
            self.numerics.patch(torch)
            return
        serialization = sys.modules.get("torch.serialization")
        real_save = getattr(torch, "save", None)
        if real_save is None or getattr(real_save, "_trainguard_hook", False):
            return
        agent = self

        def save(obj: Any, f: Any, *args: Any, **kwargs: Any) -> Any:
            # torch writes a path through its C++ PyTorchFileWriter, which no Python patch sees
            if isinstance(f, (str, bytes, os.PathLike)) and agent._under(f) and agent.triggered():
                with agent._real["open"](f, "wb"):  # created/truncated, as torch's writer does
                    pass
                agent.event("enospc", path=os.fsdecode(f), via="torch.save")
                raise RuntimeError(TORCH_ENOSPC)
            return real_save(obj, f, *args, **kwargs)

        save.__doc__ = real_save.__doc__
        save._trainguard_hook = True  # type: ignore[attr-defined]
        torch.save = save
        if serialization is not None and getattr(serialization, "save", None) is real_save:
            setattr(serialization, "save", save)  # noqa: B010
        self.event("torch_patched")


class _TorchImportHook(importlib.abc.MetaPathFinder):
    """Patches ``torch.save`` the moment ``import torch`` finishes (not before: importing torch
    costs seconds and the job may never need it)."""

    def __init__(self, agent: Agent) -> None:
        self.agent = agent

    def find_spec(self, fullname: str, path: Any, target: Any = None) -> Any:
        if fullname != "torch":
            return None
        with contextlib.suppress(ValueError):
            sys.meta_path.remove(self)
        import importlib.util

        spec = importlib.util.find_spec("torch")
        if spec is None or spec.loader is None:
            return spec
        spec.loader = _PatchingLoader(spec.loader, self.agent)
        return spec


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, loader: Any, agent: Agent) -> None:
        self._loader = loader
        self._agent = agent

    def create_module(self, spec: Any) -> Any:
        return self._loader.create_module(spec)

    def exec_module(self, module: Any) -> None:
        module.__loader__ = self._loader  # importlib.resources and friends see torch's own
        self._loader.exec_module(module)
        try:
            self._agent._patch_torch(module)
        except Exception as exc:
            self._agent.event("error", error=f"patching torch ({self._agent.fault}): {exc}")

    def __getattr__(self, name: str) -> Any:
        return getattr(self._loader, name)


def mark_training_thread() -> None:
    """The calling thread runs the job's steps (a Ray Train worker's training thread): the armed
    agent's raise goes there, not to the main thread."""
    if _agent is not None:
        _agent.training_ident = threading.get_ident()
        _agent.event("training_thread", thread=threading.current_thread().name)


def _fails_writes(mode: str) -> bool:
    """Files opened to write new content. 'r+'/'a+' are left alone: they read existing content,
    and /dev/full reads back zeros."""
    if "w" in mode or "x" in mode:
        return True
    return "a" in mode and "+" not in mode


def _fails_writes_flags(flags: int) -> bool:
    access = flags & os.O_ACCMODE
    if access == os.O_WRONLY:
        return True
    created = bool(flags & os.O_CREAT and flags & os.O_EXCL)  # tempfile's files
    return access == os.O_RDWR and (bool(flags & os.O_TRUNC) or created)


def _sibling(name: str) -> Any:
    """The hook directory's module ``name``, loaded by file path (as sitecustomize loads us)."""
    import importlib.util

    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), name + ".py")
    spec = importlib.util.spec_from_file_location(name, path)
    if spec is None or spec.loader is None:
        raise ImportError(f"no {path}")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def _vm_size() -> int:
    with builtins.open("/proc/self/statm") as f:
        return int(f.read().split()[0]) * os.sysconf("SC_PAGE_SIZE")


def _torch_oom_class() -> type[BaseException]:
    try:
        import torch
    except ImportError:
        return MemoryError
    cls = getattr(torch, "OutOfMemoryError", None) or getattr(torch.cuda, "OutOfMemoryError", None)
    return cls if isinstance(cls, type) else MemoryError


__all__ = ["ENV_PID", "ENV_SPEC", "Agent", "install"]
