"""Build the wheel and prove its only top-level package is ``trainguard``.

plugins/ and fixtures/ are mapped into the package (``trainguard.plugins``,
``trainguard.fixtures``) by setuptools' package-dir; a generic top-level ``plugins`` or
``fixtures`` module in site-packages would shadow other projects' modules. Also checks the
pytest11 entry points and the console script.

Usage: python ci/dist_check.py [--wheel-dir DIR]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

REQUIRED_FILES = {
    "trainguard/__init__.py",
    "trainguard/py.typed",
    "trainguard/plugins/plugin.py",
    "trainguard/fixtures/__init__.py",
    "trainguard/launch/launcher.py",
}
REQUIRED_ENTRY_POINTS = (
    "trainguard = trainguard.plugins.plugin",
    "trainguard_fixtures = trainguard.fixtures",
    "trainguard = trainguard.cli:entry",
)


def build_wheel(out_dir: Path) -> Path:
    root = Path(__file__).resolve().parent.parent
    subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
         "-w", str(out_dir), str(root)],
        check=True,
    )
    wheels = sorted(out_dir.glob("trainguard-*.whl"))
    if not wheels:
        raise SystemExit(f"dist check: no wheel was built in {out_dir}")
    return wheels[-1]


def source_files() -> set[str]:
    """Every module of the source tree, as the wheel should name it (catches a subpackage
    that setup.py's discovery misses)."""
    root = Path(__file__).resolve().parent.parent
    mapping = {"trainguard": "trainguard", "plugins": "trainguard/plugins", "fixtures": "trainguard/fixtures"}
    out = set()
    for src, dest in mapping.items():
        for path in (root / src).rglob("*.py"):
            if "__pycache__" not in path.parts:
                out.add(f"{dest}/{path.relative_to(root / src).as_posix()}")
    return out


def check_wheel(wheel: Path) -> list[str]:
    problems = []
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        top = {n.split("/", 1)[0] for n in names}
        packages = {t for t in top if not t.endswith((".dist-info", ".data"))}
        if packages != {"trainguard"}:
            problems.append(f"top-level entries other than trainguard: {sorted(packages - {'trainguard'})}")
        missing = (REQUIRED_FILES | source_files()) - set(names)
        if missing:
            problems.append(f"missing from the wheel: {sorted(missing)}")
        entry = next((n for n in names if n.endswith(".dist-info/entry_points.txt")), None)
        text = zf.read(entry).decode() if entry else ""
        for needed in REQUIRED_ENTRY_POINTS:
            if needed not in text:
                problems.append(f"entry point missing: {needed!r}")
        if any("/tests/" in n or n.startswith("tests/") for n in names):
            problems.append("tests/ leaked into the wheel")
    return problems


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheel-dir", help="keep the wheel here (default: a temp dir)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(args.wheel_dir or tmp)
        out.mkdir(parents=True, exist_ok=True)
        wheel = build_wheel(out)
        problems = check_wheel(wheel)
    if problems:
        for p in problems:
            print(f"dist check FAILED: {p}")
        return 1
    print(f"dist check passed: {wheel.name} holds only the trainguard package")
    return 0


if __name__ == "__main__":
    sys.exit(main())
