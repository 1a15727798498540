"""The launcher shim of :mod:`tests.backends.wrapped`: ``wrapped_shim.py -- CMD ARGS...`` appends
one JSON line (the rank, its pid, the command) to ``$WRAPPED_LOG``, then execs the command in
the same process, so the rank's pid, output and exit are the command's."""

import json
import os
import sys

argv = sys.argv[sys.argv.index("--") + 1:]
if argv and argv[0] in ("python", "python3"):
    argv[0] = sys.executable  # the interpreter trainguard runs the shim with
with open(os.environ["WRAPPED_LOG"], "a", encoding="utf-8") as log:
    log.write(json.dumps({"rank": os.environ.get("RANK"), "pid": os.getpid(), "argv": argv}) + "\n")
os.execvp(argv[0], argv)
