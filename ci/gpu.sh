#!/usr/bin/env bash
# The GPU tests (tests/gpu, marked `gpu`) in one short call on a lent GPU machine, with a summary
# for the issue's note: versions, the GPU, each test's result and time (docs/gpu.md).
#
#   bash ci/gpu.sh [OUTDIR]        # OUTDIR defaults to $OUT, else /tmp/trainguard-gpu
#
# Such a machine has its own Python with torch and no network: the packages trainguard needs
# beyond it travel as wheels in .whl/ (pydantic and its parts; trainguard's own wheel, built
# here by `python -m pip wheel --no-deps -w .whl .`), installed into a private folder. Without a
# GPU every test skips, saying why: that is the dry run, with the venv that has everything
# (`PYTHON=.venv/bin/python TRAINGUARD_WHEELS=none bash ci/gpu.sh`; the wheels are for 3.12).
# TRAINGUARD_GPU_K='expr' runs only the tests pytest's -k selects (a rerun of the failures).
# Two phases: the tests that share the device run 4 at a time; those that take the whole
# device's memory (tests/gpu/test_whole_device.py) and the step records' overhead timing run alone
# after them. TRAINGUARD_GPU_TESTS='FILE ...' runs only those files of tests/gpu (issue 50's call:
# the step records, invariants and nanoGPT files), the whole budget in the first phase but the
# timing. nanoGPT's test needs its train.py, model.py and configurator.py: shared/nanoGPT/ (never
# committed) or TRAINGUARD_NANOGPT_DIR; without them it skips, saying so.
set -uo pipefail
out="${1:-${OUT:-/tmp/trainguard-gpu}}"
mkdir -p "$out" && out="$(cd "$out" && pwd)" || exit 2
cd "$(dirname "$0")/.." || exit 2
py="$(command -v "${PYTHON:-python3}")" || { echo "gpu.sh: no ${PYTHON:-python3}" >&2; exit 2; }
case $py in /*) ;; *) py="$PWD/$py" ;; esac
wheels="${TRAINGUARD_WHEELS:-.whl}"
site="${TRAINGUARD_SITE:-/tmp/trainguard-site}"
budget="${TRAINGUARD_GPU_BUDGET_S:-290}"   # the whole script stays inside 5 minutes
started=$(date +%s)
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1

if compgen -G "$wheels/*.whl" >/dev/null; then
    "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
        --target "$site" "$wheels"/*.whl || { echo "gpu.sh: installing $wheels/*.whl failed" >&2; exit 2; }
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
fi
# The tests run from a copy of tests/ and pyproject.toml (its pytest settings) beside each other:
# from the checkout, its trainguard/ folder (which lacks plugins/ and fixtures/, mapped in by the
# install) would shadow the installed package.
tree=/tmp/trainguard-gpu-tree
rm -rf "$tree" && mkdir -p "$tree/tests/benchmarks" && cp pyproject.toml "$tree/" \
    && cp -r tests/conftest.py tests/helpers.py tests/gpu "$tree/tests/" \
    && cp tests/benchmarks/cause_table.py "$tree/tests/benchmarks/" || exit 2
if [[ -z "${TRAINGUARD_NANOGPT_DIR:-}" && -f shared/nanoGPT/train.py ]]; then
    export TRAINGUARD_NANOGPT_DIR="$PWD/shared/nanoGPT"
fi
if [[ "$wheels" == none ]]; then  # the dry run: this checkout's trainguard, installed editable
    :
elif ! (cd "$tree" && "$py" -c "import trainguard.plugins.plugin") 2>"$out/import-error.txt"; then
    echo "gpu.sh: trainguard does not import with $py (see $out/import-error.txt); build its wheel" \
         "into $wheels with: python -m pip wheel --no-deps -w $wheels ." >&2
    exit 2
fi
rm -f "$out/import-error.txt"

# what the machine is: for the summary, and NVML's view of a CUDA process (its pid must be
# visible for per-process GPU memory)
"$py" ci/gpu_summary.py facts >"$out/facts.json" 2>"$out/facts.err" || true

phase() {  # phase NAME SECONDS PYTEST-ARGS...
    local name=$1 seconds=$2; shift 2
    [[ -n "${TRAINGUARD_GPU_K:-}" ]] && set -- "$@" -k "$TRAINGUARD_GPU_K"  # a rerun of some tests
    timeout -k 10 "$seconds" "$py" -m pytest -p no:cacheprovider -m gpu -rs -v \
        --basetemp "/tmp/trainguard-gpu-$name" --junitxml "$out/junit-$name.xml" "$@" >>"$out/pytest.log" 2>&1
    echo "phase $name: exit $?" >>"$out/pytest.log"
}
left() { echo $(( budget - ($(date +%s) - started) )); }
cd "$tree" || exit 2
timing=tests/gpu/test_step_records_gpu.py::test_the_agents_overhead_on_a_cuda_step_of_tens_of_milliseconds
if [[ -n "${TRAINGUARD_GPU_TESTS:-}" ]]; then  # only these files; the timing alone after them
    read -ra files <<<"$TRAINGUARD_GPU_TESTS"
    phase selected "$(( $(left) - 60 ))" "${files[@]}" --deselect "$timing" -n 4 --dist loadgroup
    [[ " ${files[*]} " == *" tests/gpu/test_step_records_gpu.py "* ]] && phase alone "$(left)" "$timing"
else
    phase shared "$(( $(left) - 130 ))" tests/gpu --ignore tests/gpu/test_whole_device.py --deselect "$timing" \
        -n 4 --dist loadgroup
    phase whole-device "$(left)" tests/gpu/test_whole_device.py "$timing"
fi
cd - >/dev/null || exit 2
# the runs' logs and reports (no checkpoints), for a failure's evidence
find /tmp/trainguard-gpu-* -type f \( -name '*.log' -o -name '*.json' -o -name '*.jsonl' -o -name '*.md' \
    -o -name '*.yaml' \) -size -4M 2>/dev/null | tar czf "$out/runs.tgz" -T - 2>/dev/null
"$py" ci/gpu_summary.py summary "$out" $(( $(date +%s) - started ))
