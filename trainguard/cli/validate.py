"""``trainguard validate``: check a job file as a launch would, print the plan, launch nothing.

For pre-commit hooks and CI steps before a paid run: exit 0 with the plan (checks, the runs they
launch, shared runs, drills, an estimate of the time) when the job file is valid here, exit 2
with every problem named (file, key, fix) when it is not.
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from trainguard.cli.args import nonempty_path, only_names

__all__ = ["add_parser", "run"]


def add_parser(sub: Any) -> None:
    validate = sub.add_parser(
        "validate",
        help="check a job file as a launch would and print the plan; launches nothing",
        description="Load and validate a job file the way `trainguard check` would before its first "
        "run (schema, placeholders rendered, paths, drills, the working directory), print the plan "
        "(checks, the runs they launch, shared runs, drills, an estimate of the time) and launch "
        "nothing. Exit 0 when valid, 2 with every problem named when not (docs/cli.md).",
    )
    validate.add_argument("config", metavar="CONFIG", type=nonempty_path,
                          help="job file, or a directory holding trainguard.yaml")
    validate.add_argument("--only", metavar="NAME", action="append",
                          help="plan only this check (repeatable), as `trainguard check --only`")
    validate.add_argument("--json", action="store_true", help="print the plan as JSON")


def run(args: argparse.Namespace) -> int:
    from trainguard.session.plan import make_plan
    from trainguard.session.session import session_settings

    plan = make_plan(args.config, session_settings(), only=only_names(args.only))
    if args.json:
        print(json.dumps(plan.as_dict(), indent=2))
    else:
        print(f"VALID: {plan.job_file.path}")
        for line in plan.lines():
            print(line)
    return 0
