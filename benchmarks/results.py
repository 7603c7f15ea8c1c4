"""What the benchmarks share: RESULTS.md (each writes its own section between its own markers), running a script
as a user does (its wall time and the peak RSS of its process alone) and mean ± std over seeds."""

import os
import re
import statistics
import subprocess
import sys
import textwrap
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

RESULTS = Path(__file__).resolve().parent / "RESULTS.md"


def wrap_prose(text: str, width: int = 120) -> str:
    """Prose lines wrapped at `width`, as the rest of RESULTS.md; table rows, headings and code stay as they are."""
    out, fence = [], False
    for line in text.split("\n"):
        fence ^= line.startswith("```")
        if fence or len(line) <= width or line.startswith(("|", "#", "<!--", "```")):
            out.append(line)
        else:
            indent = "  " if line.startswith("- ") else ""
            out += textwrap.wrap(line, width, subsequent_indent=indent, break_long_words=False, break_on_hyphens=False)
    return "\n".join(out)


def write_section(name: str, text: str, path: Path = RESULTS):
    """Replaces section `name` of RESULTS.md (or appends it), keeping every other section as it is."""
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    old = (
        path.read_text()
        if path.exists()
        else "# Benchmark results\n\nEach section is written by the benchmark it names; rerun it to refresh.\n"
    )
    block = f"{start}\n{wrap_prose(text.strip())}\n{end}"
    if start in old:
        new = re.sub(re.escape(start) + ".*?" + re.escape(end), lambda _: block, old, flags=re.S)
    else:
        new = old.rstrip() + "\n\n" + block + "\n"
    path.write_text(new)


def start(command: list[str], cwd: Path, threads: int | None = None) -> subprocess.Popen:
    """Starts `command` in `cwd` (progress bars off; OMP_NUM_THREADS=threads when given)."""
    env = {**os.environ, "TQDM_DISABLE": "1", **({"OMP_NUM_THREADS": str(threads)} if threads else {})}
    proc = subprocess.Popen(command, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    proc.started = time.time()
    return proc


def finish(proc: subprocess.Popen) -> dict:
    """Waits for a started command (exits with its output's end if it failed); its wall time, the peak resident
    memory of that process alone (its own rusage) and its output."""
    out = proc.stdout.read()
    _, status, usage = os.wait4(proc.pid, 0)  # ru_maxrss in KiB on Linux
    proc.returncode = os.waitstatus_to_exitcode(status)
    if proc.returncode != 0:
        sys.exit(f"{' '.join(proc.args)} failed:\n{out[-3000:]}")
    print(out.strip().splitlines()[-1])
    return {"wall_s": time.time() - proc.started, "peak_rss_gb": usage.ru_maxrss / 2**20, "out": out}


def run(script: str, flags: list[str], cwd: Path) -> dict:
    """Runs one of the project's scripts as a user does (a subprocess) and waits for it."""
    return finish(start([sys.executable, str(ROOT / script), *flags], cwd))


def mean_std(values: list[float], fmt: str) -> str:
    """'mean ± sample std' of the values (± 0 for one)."""
    sd = statistics.stdev(values) if len(values) > 1 else 0.0
    return f"{statistics.mean(values):{fmt}} ± {sd:{fmt}}"
