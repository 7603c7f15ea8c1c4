"""RESULTS.md is shared by the benchmarks: each writes its own section between its own markers."""

import re
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def write_section(name: str, text: str, path: Path = RESULTS):
    """Replaces section `name` of RESULTS.md (or appends it), keeping every other section as it is."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    old = (
        path.read_text()
        if path.exists()
        else "# Benchmark results\n\nEach section is written by the benchmark it names; rerun it to refresh.\n"
    )
    block = f"{start}\n{text.strip()}\n{end}"
    if start in old:
        new = re.sub(re.escape(start) + ".*?" + re.escape(end), lambda _: block, old, flags=re.S)
    else:
        new = old.rstrip() + "\n\n" + block + "\n"
    path.write_text(new)
