#!/usr/bin/env bash
# checks.compat on the digits example, as a user would run it on their own repository
# (docs/compat.md): a temporary git repository holds the example as "base"; a refactor that
# renames the model's output layer is committed on top, and the compat check resumes base's
# checkpoint with the new code. It fails naming the rename; the same check on a compatible
# refactor (the model class moved to a module of its own) passes.
#
#   bash examples/digits/compat_demo.sh            # about a minute on 2 CPU cores
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
trainguard=${TRAINGUARD:-$(command -v trainguard || echo "$here/../../.venv/bin/trainguard")}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
cp -r "$here" "$work/repo" && cd "$work/repo" && rm -rf .trainguard checkpoints
printf 'data/\n.trainguard/\n__pycache__/\n' > .gitignore
cat > compat.trainguard.yaml <<'EOF'
job:
  name: digits-compat
  command: "python train.py --steps {steps} --ckpt-dir {checkpoint_dir} --seed {seed} --num-workers 0"
  resume_args: "--resume"
  env: {OMP_NUM_THREADS: "1"}
  metrics:
    loss: 'step (?P<step>\d+) loss (?P<value>\S+)'
  timeout: 120
checks:
  compat: {base: base, steps: 40, after_step: 5}
EOF
git init -q && git add -A && git -c user.name=demo -c user.email=demo@example.invalid commit -qm base && git tag base

echo "== a refactor that renames the output layer (head -> classifier)"
sed -i 's/self\.head\b/self.classifier/g' digits/model.py
git -c user.name=demo -c user.email=demo@example.invalid commit -qam "rename head"
"$trainguard" check compat.trainguard.yaml --only compat || echo "(failed, as it should: the checkpoint's keys changed)"

echo "== a compatible refactor (the model class moved to digits/mlp.py)"
git checkout -q base -- digits/model.py && git mv digits/model.py digits/mlp.py
printf 'from digits.mlp import DigitsMLP\n\n__all__ = ["DigitsMLP"]\n' > digits/model.py
git add -A && git -c user.name=demo -c user.email=demo@example.invalid commit -qm "move the model"
"$trainguard" check compat.trainguard.yaml --only compat
