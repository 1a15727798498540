"""Step records written by hand in the run agent's format (docs/step-records.md), for the tests of
the reader and of the first divergence: the lines a run of a small model would leave, with one
quantity changed where a test plants a defect."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from trainguard.launch.hook import SAMPLES_DIR, STEPS_DIR

PARAMS = ("fc1.weight", "fc1.bias", "fc2.weight")


def fp(value: int) -> list[Any]:
    """A fingerprint as the agent writes it: 16 hex digits and a sum of squares."""
    return [f"{value % 2**64:016x}", float(value % 1000) / 7.0]


@dataclass(frozen=True)
class Step:
    """One step line's content, each field a seed of its fingerprints (equal seeds, equal prints)."""

    n: int
    lr: float = 1e-3
    param: int = 0
    grad: int = 0
    optim: int = 0
    rng: str = "00000000000000aa"
    numpy: str | None = None
    scale: float | None = None
    #: the scaler skipped the step (with ``scale``)
    skipped: bool = False
    opt: int = 0
    #: parameter name -> a seed replacing the step's for that one parameter
    param_of: Mapping[str, int] = field(default_factory=dict)
    optim_of: Mapping[str, int] = field(default_factory=dict)
    grad_of: Mapping[str, int] = field(default_factory=dict)
    no_optim: bool = False
    #: parameters without a gradient at this step (``null``)
    no_grad: tuple[str, ...] = ()
    #: parameter name -> its DTensor placement (``"(Shard(dim=0),)"``)
    placement: Mapping[str, str] = field(default_factory=dict)
    #: the invariants' step fields (written when set): gradients carried into the step, modules in
    #: eval mode in it, its clip calls ``(calls, scaled)``
    carried: tuple[str, ...] | None = None
    eval_in_step: tuple[str, ...] = ()
    clip: tuple[int, int] | None = None

    def line(self) -> dict[str, Any]:
        extra: dict[str, Any] = {"placement": dict(self.placement)} if self.placement else {}
        if self.carried is not None:
            extra["carried"] = list(self.carried)
        if self.eval_in_step:
            extra["eval_in_step"] = list(self.eval_in_step)
        if self.clip is not None:
            extra["clip"] = {"calls": self.clip[0], "scaled": self.clip[1]}
        return {**extra,
            "k": "step", "opt": self.opt, "n": self.n, "t": 1.0 + self.n,
            "groups": [{"lr": self.lr, "betas": [0.9, 0.999], "weight_decay": 0.01, "foreach": None}],
            "backward": 1,
            "rng": {"cpu": self.rng, "cuda": None, "numpy": self.numpy, "python": "00000000000000bb"},
            "param": {p: fp(self.param_of.get(p, 1000 * self.param + i)) for i, p in enumerate(PARAMS)},
            "grad": {p: None if p in self.no_grad else fp(self.grad_of.get(p, 2000 * self.grad + i + 7))
                     for i, p in enumerate(PARAMS)},
            "optim": {} if self.no_optim else {p: fp(self.optim_of.get(p, 3000 * self.optim + i + 3))
                                                 for i, p in enumerate(PARAMS)},
            "scaler": None if self.scale is None else {"scale": self.scale, "skipped": self.skipped},
        }


def trajectory(first: int, last: int, *, lr: Any = None, **changes: Any) -> list[Step]:
    """Steps ``first``..``last`` of a run whose state at reference step s is seeded by s (so a
    resumed run's step n is reference step n + offset: pass ``shift``); ``lr``: step -> lr."""
    shift = changes.pop("shift", 0)
    out = []
    for n in range(first, last + 1):
        s = n + shift
        out.append(Step(n, lr=lr(s) if lr else 1e-3 * 0.9 ** s, param=s, grad=s, optim=s,
                        rng=f"{s:016x}", **changes))
    return out


def write_rank(run_dir: Path, rank: int, steps: Iterable[Step], *, extra: Iterable[Mapping[str, Any]] = (),
               before: Iterable[Mapping[str, Any]] = ()) -> Path:
    """``rank{rank}.jsonl`` under the run's step records: a meta line, ``before``, the steps,
    then ``extra``."""
    folder = run_dir / STEPS_DIR
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / f"rank{rank}.jsonl"
    lines = [{"k": "meta", "rank": rank, "world": 1, "pid": 1, "torch": "2.13.0", "cap": 64 * 2**20},
             *before, *(s.line() for s in steps), *extra]
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


def write_samples(run_dir: Path, rank: int, batches: Iterable[list[int]]) -> None:
    """The sample records of one rank: one batch per step, in order."""
    folder = run_dir / SAMPLES_DIR
    folder.mkdir(parents=True, exist_ok=True)
    (folder / f"rank{rank}.jsonl").write_text("".join(
        json.dumps({"loader": 0, "dataset": "TensorDataset(64)", "iter": 0, "batch": i, "indices": b}) + "\n"
        for i, b in enumerate(batches)))


def save(*owners: str, how: str = "torch.save", path: str = "/ck/last.pt") -> dict[str, Any]:
    """A save line holding one key per owner (``model`` -> key ``model``)."""
    return {"k": "save", "t": 0.5, "how": how, "path": path, "keys": {o: o for o in owners}, "whole": None}


def restore(*calls: str, by: str = "__main__", path: str | None = None) -> list[dict[str, Any]]:
    return [{"k": "restore", "t": 0.6, "call": c, "target": c.split(".")[0], "path": path, "by": by} for c in calls]


def changed(steps: list[Step], n: int, **fields: Any) -> list[Step]:
    """``steps`` with step ``n`` (and the ones after it, for a field that carries: lr, param)
    changed."""
    return [replace(s, **fields) if s.n == n else s for s in steps]


def params_line(groups: Iterable[Iterable[str]] = (PARAMS,), *, opt: int = 0, n: int = 1,
                dtype: str = "float32", shared: Iterable[str] = ()) -> dict[str, Any]:
    """The agent's ``params`` line: each param group's names (and dtypes), those another optimizer holds."""
    listed = [list(g) for g in groups]
    return {"k": "params", "opt": opt, "n": n, "groups": listed, "dtypes": [[dtype] * len(g) for g in listed],
            "shared": list(shared)}


def model_line(trainable: Iterable[str] = PARAMS, *, grad: Iterable[str] = (), frozen: Iterable[str] = (),
               watched: int = 1, opt: int = 0, n: int = 1) -> dict[str, Any]:
    """The agent's ``model`` line: the trainable and frozen parameters, those outside the
    optimizer with a gradient, the watched (dropout, norm) modules."""
    return {"k": "model", "opt": opt, "n": n, "trainable": list(trainable), "frozen": list(frozen),
            "grad": list(grad), "watched": watched}
