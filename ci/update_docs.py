"""Regenerate the generated parts of the docs from the code (run after changing settings).

docs/markers-and-options.md holds the options table between
``<!-- options-table:start -->`` and ``<!-- options-table:end -->``; tests check it matches
``trainguard.config.settings.options_table()``.

Usage: python ci/update_docs.py
"""

from __future__ import annotations

import re
from pathlib import Path

from trainguard.config.settings import options_table

DOC = Path(__file__).resolve().parent.parent / "docs" / "markers-and-options.md"
START, END = "<!-- options-table:start -->", "<!-- options-table:end -->"


def main() -> None:
    text = DOC.read_text()
    block = f"{START}\n{options_table()}\n{END}"
    new, count = re.subn(re.escape(START) + r".*?" + re.escape(END), lambda _: block, text, flags=re.S)
    if count != 1:
        raise SystemExit(f"{DOC}: expected one {START} ... {END} block, found {count}")
    DOC.write_text(new)
    print(f"updated {DOC}")


if __name__ == "__main__":
    main()
