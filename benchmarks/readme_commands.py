"""Run every command of the README and the docs as written; check what they say it gives.

The ``bash`` blocks of ``README.md`` and of every page under ``docs/`` are read
here, not copied: each command (a line with its ``\\`` continuations) that
starts a run (``flwr run``, ``python -m flwr_prox_strategies...``) is run from
the checkout with ``bash``, after the ``export`` lines of its block, exactly as
a user pastes it. A command found on several pages (the README's and the
getting-started page's main job) runs once. The comment above a
command carries its expectation on a line of its own::

    # expect: rounds 30, final-accuracy 0.93..0.97, to-target <= 12, time ~40 s

``key lo..hi`` is a band, ``key <= x`` / ``key >= x`` a bound, ``key x`` an exact
value, ``time ~N s`` the wall time on 2 cores (shown beside the measured one, not
checked: it depends on the machine). The keys are in :data:`METRICS`. A command
whose run fails, whose results are missing, or whose figure is outside what the
page says, is marked FAIL and makes the script exit 1: a broken command never
ends looking like success. A command that cannot run here says why on a comment
line of its own, ``# not run here: <reason>``.

Not run here: the test-suite command (``--with-tests`` adds it; CI runs it), and
the commands that need a deployment set up by hand (a named federation,
``/abs/path`` placeholders, a SuperLink killed mid-run); ``tests/system`` runs those
(TLS and a named federation: ``test_tls.py``; resume after a SuperLink crash:
``test_loopback.py``).

Usage::

    python benchmarks/readme_commands.py            # all, about 25 min on 2 cores
    python benchmarks/readme_commands.py --list     # the commands and expectations
    python benchmarks/readme_commands.py --only 1 8 # some of them (numbers from --list)

It prints one markdown table (``benchmarks/README.md`` quotes it) and writes it,
with every command's log, to ``--out``.
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNS = re.compile(r"(^|&&\s*|\s)(flwr run|python -m flwr_prox_strategies)\b")
NEEDS_SETUP = (
    "/abs/path",  # placeholders for the user's folders
    "flwr run . mine",  # named federations in $FLWR_HOME
    "flwr run . secure",
)


@dataclass
class Command:
    """One command of a page, with the comment above it."""

    number: int
    page: str
    line: int
    text: str
    comment: list[str]
    exports: list[str]
    expect: str = ""
    not_run: str = ""
    also_at: list[str] = field(default_factory=list)

    @property
    def run_key(self) -> tuple[tuple[str, ...], str]:
        """What the command runs: its environment and its run, without an install.

        ``pip install ... && X=1 flwr run ...``, ``X=1 flwr run ...`` and
        ``export X=1`` then ``flwr run ...`` run the same thing: once is enough.
        """
        text = " ".join(self.text.replace("\\\n", " ").split())
        text = re.sub(r"^pip install .*?&&\s*", "", text)
        env = [e.removeprefix("export ").split("#")[0].strip() for e in self.exports]
        while match := re.match(r"([A-Z_]+=\S+)\s+", text):
            env.append(match.group(1))
            text = text[match.end() :]
        return tuple(sorted(set(env))), text

    @property
    def where(self) -> str:
        return ", ".join([f"{self.page}:{self.line}", *self.also_at])

    @property
    def runnable(self) -> bool:
        return (
            bool(RUNS.search(self.text))
            and not self.not_run
            and not any(marker in self.text for marker in NEEDS_SETUP)
        )

    @property
    def is_tests(self) -> bool:
        return "pytest" in self.text

    @property
    def short(self) -> str:
        overrides = re.search(r"overrides='([^']*)'", self.text)
        if overrides:
            return overrides.group(1) or "(defaults)"
        if "flwr run" in self.text:
            return "flwr run . (defaults)"
        return re.sub(r"\s+", " ", self.text.replace("\\\n", " "))[:70]


@dataclass
class Check:
    """One expectation: a metric and the test its value must pass."""

    key: str
    text: str
    passes: Callable[[float], bool]


@dataclass
class Outcome:
    """What one command gave."""

    seconds: float
    metrics: dict[str, float] = field(default_factory=dict)
    error: str = ""
    failed: list[str] = field(default_factory=list)


def pages(root: Path = ROOT) -> list[Path]:
    """The README, then the docs pages in order of their paths."""
    docs = sorted(p for p in (root / "docs").rglob("*.md") if "_build" not in p.parts)
    return [root / "README.md", *docs]


def commands(page_paths: list[Path]) -> list[Command]:
    """Every command in the pages' bash blocks, numbered in order; one per text."""
    found: list[Command] = []
    for path in page_paths:
        for command in page_commands(path):
            twin = next((c for c in found if c.run_key == command.run_key), None)
            if twin is not None:
                twin.also_at.append(f"{command.page}:{command.line}")
                if command.expect and command.expect != twin.expect:
                    raise ValueError(
                        f"{command.page}:{command.line} expects {command.expect!r}, "
                        f"{twin.page}:{twin.line} {twin.expect!r}: one command, "
                        "one expectation"
                    )
                continue
            command.number = len(found) + 1
            found.append(command)
    return found


def page_commands(path: Path) -> list[Command]:
    """The commands of one page's bash blocks."""
    page = str(path.relative_to(ROOT)) if path.is_relative_to(ROOT) else str(path)
    found: list[Command] = []
    lines = path.read_text().splitlines()
    in_block, comment, exports = False, [], []
    i = 0
    while i < len(lines):
        raw = lines[i]
        stripped = raw.strip()
        if stripped.startswith("```"):
            in_block = stripped == "```bash" and not in_block
            comment, exports = [], []
            i += 1
            continue
        if not in_block:
            i += 1
            continue
        if stripped.startswith("#"):
            comment.append(stripped.lstrip("#").strip())
        elif stripped.startswith("export "):
            exports.append(stripped)
        elif stripped:
            start = i
            text = [raw]
            while text[-1].rstrip().endswith("\\") and i + 1 < len(lines):
                i += 1
                text.append(lines[i])
            body = "\n".join(text).split("  # ")[0].rstrip()
            expect = " ".join(
                c.split(":", 1)[1].strip() for c in comment if c.startswith("expect:")
            )
            not_run = " ".join(
                c.split(":", 1)[1].strip()
                for c in comment
                if c.startswith("not run here:")
            )
            found.append(
                Command(
                    0,
                    page,
                    start + 1,
                    body,
                    [c for c in comment if not c.startswith("expect:")],
                    list(exports),
                    expect,
                    not_run,
                )
            )
            comment = []
        else:
            comment = []
        i += 1
    return found


# The figures a command's expectation may name, and where they come from.
METRICS = {
    "rounds": "rounds with a central evaluation after round 0 (results.json)",
    "final-accuracy": "central test accuracy after the last round (P-FedAvg launcher: the lowest server's)",
    "best-accuracy": "best central test accuracy over the rounds",
    "to-target": "first round at the config's target_accuracy",
    "central-loss": "central test loss after the last round",
    "max-epsilon": "largest client epsilon after the last round (DP-SGD)",
    "retired": "clients retired after spending their budget (DP-SGD)",
    "personal-accuracy": "mean personalised accuracy over the clients, last round",
    "jobs": "jobs of a sweep (summary.csv)",
    "min-final-accuracy": "lowest final accuracy over a sweep's jobs",
    "max-final-accuracy": "highest final accuracy over a sweep's jobs",
    "min-final-accuracy-fedprox": "lowest final accuracy over a sweep's FedProx jobs",
    "min-final-accuracy-fedavg": "lowest final accuracy over a sweep's FedAvg jobs",
    "consensus-distance": "P-FedAvg launcher: sum_i ||x_i - mean||^2 after the last round",
    "speed-up": "the communication model's expected speed-up (topology command)",
    "search-best": "a search's best objective value (search.json)",
    "search-trials": "a search's trials (search.json)",
}
_NUMBER = r"-?\d+(?:\.\d+)?(?:e-?\d+)?"


def checks(expect: str) -> tuple[list[Check], str]:
    """Parse ``key lo..hi, key <= x, key x, time ~N s``; return the checks and time."""
    found, seconds = [], ""
    for part in filter(None, (p.strip() for p in expect.split(","))):
        time_match = re.fullmatch(r"time ~\s*(\d+(?:\.\d+)?)\s*(s|min)", part)
        if time_match:
            seconds = part.removeprefix("time ").strip()
            continue
        match = re.fullmatch(
            rf"([a-z-]+)\s+(?:({_NUMBER})\.\.({_NUMBER})|(<=|>=)\s*({_NUMBER})|({_NUMBER}))",
            part,
        )
        if not match or match.group(1) not in METRICS:
            raise ValueError(
                f"cannot read the expectation {part!r} (keys: {sorted(METRICS)})"
            )
        key, lo, hi, op, bound, exact = match.groups()
        if lo is not None:
            low, high = float(lo), float(hi)
            found.append(
                Check(key, f"{lo}..{hi}", lambda v, a=low, b=high: a <= v <= b)
            )
        elif op == "<=":
            limit = float(bound)
            found.append(Check(key, f"<= {bound}", lambda v, b=limit: v <= b))
        elif op == ">=":
            limit = float(bound)
            found.append(Check(key, f">= {bound}", lambda v, b=limit: v >= b))
        else:
            value = float(exact)
            found.append(Check(key, exact, lambda v, x=value: v == x))
    return found, seconds


def run_metrics(results: dict) -> dict[str, float]:
    """The :data:`METRICS` of one run's ``results.json``."""
    summary = results["summary"]
    rounds = [r for r in results["rounds"] if "central" in r and r["round"] > 0]
    metrics: dict[str, float] = {"rounds": float(len(rounds))}
    for key, name in (
        ("final-accuracy", "final-accuracy"),
        ("best-accuracy", "best-accuracy"),
        ("to-target", "rounds-to-target"),
        ("max-epsilon", "final-epsilon-max"),
        ("personal-accuracy", "final-personal-accuracy-mean"),
    ):
        if summary.get(name) is not None:
            metrics[key] = float(summary[name])
    if rounds:
        metrics["central-loss"] = float(rounds[-1]["central"]["loss"])
    trained = [r["train"] for r in results["rounds"] if "train" in r]
    if trained and "dp-clients-retired" in trained[-1]:
        metrics["retired"] = float(trained[-1]["dp-clients-retired"])
    return metrics


def sweep_metrics(csv_path: Path) -> dict[str, float]:
    """The sweep's job count and the range of its final accuracies."""
    with open(csv_path) as handle:
        rows = list(csv.DictReader(handle))
    finals = [float(r["final-accuracy"]) for r in rows if r.get("final-accuracy")]
    metrics = {
        "jobs": float(len(rows)),
        "min-final-accuracy": min(finals, default=float("nan")),
        "max-final-accuracy": max(finals, default=float("nan")),
    }
    for strategy in {str(r["strategy"]) for r in rows if r.get("strategy")}:
        mine = [
            float(r["final-accuracy"])
            for r in rows
            if r.get("strategy") == strategy and r.get("final-accuracy")
        ]
        if mine:  # min-final-accuracy-fedprox, ...
            metrics[f"min-final-accuracy-{strategy.lower()}"] = min(mine)
    return metrics


def deploy_metrics(results: dict) -> tuple[dict[str, float], str]:
    """P-FedAvg's launcher: its rounds and the servers' lowest final accuracy."""
    final = results["summary"]["final-accuracy"]
    metrics = {"rounds": float(len(results["rounds"]))}
    if final and all(f is not None for f in final):
        metrics["final-accuracy"] = float(min(final))
    distances = [r.get("consensus-distance") for r in results["rounds"]]
    if distances and distances[-1] is not None:
        metrics["consensus-distance"] = float(distances[-1])
    return metrics, "" if results["summary"]["complete"] else "a server did not finish"


def last_match(pattern: str, output: str) -> str | None:
    found = re.findall(pattern, output)
    return found[-1].strip() if found else None


def measure(command: Command, log_file: Path) -> Outcome:
    """Run ``command`` with bash from the checkout; read what it produced."""
    script = "\n".join(["set -e", *command.exports, command.text])
    start = time.monotonic()
    with open(log_file, "w") as sink:
        proc = subprocess.Popen(
            ["bash", "-c", script],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        assert proc.stdout is not None
        for line in _progress(proc.stdout, sink):
            print(f"    {line}", flush=True)
        code = proc.wait()
    output = log_file.read_text()
    outcome = Outcome(seconds=time.monotonic() - start)
    if code != 0:
        outcome.error = f"exit {code}"
        return outcome
    results = last_match(r"Results: (\S+results\.json)", output)
    deployed = last_match(r"\[pfedavg-deploy\] results: (\S+results\.json)", output)
    summary = last_match(r"(\S+summary\.csv)", output)
    speed_up = last_match(r"expected speed-up: (\d+(?:\.\d+)?)", output)
    if deployed:
        outcome.metrics, outcome.error = deploy_metrics(
            json.loads(Path(deployed).read_text())
        )
    elif summary:  # before results: in-process jobs print their own 'Results:'
        outcome.metrics = sweep_metrics(ROOT / summary)  # relative to the run's cwd
        searched = last_match(r"(\S+search\.json)", output)
        if searched:
            found = json.loads((ROOT / searched).read_text())
            outcome.metrics["search-trials"] = float(len(found["trials"]))
            if found["best"]:
                outcome.metrics["search-best"] = float(found["best"]["value"])
    elif results:
        data = json.loads(Path(results).read_text())
        if not data["summary"].get("complete") and not data["summary"].get(
            "stopped-early"
        ):
            outcome.error = "results.json not complete"
        outcome.metrics = run_metrics(data)
    elif speed_up:
        outcome.metrics = {"speed-up": float(speed_up)}
    else:
        outcome.error = "no results.json, summary.csv or speed-up in its output"
    return outcome


def _progress(stream, sink) -> Iterator[str]:
    """Copy the output to the log; yield the lines worth showing live."""
    for line in stream:
        sink.write(line)
        if re.search(
            r"\[progress\]|Finished:|Results:|summary\.csv|speed-up|Error|Traceback",
            line,
        ):
            yield re.sub(r"\x1b\[[0-9;]*m", "", line.rstrip())


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--pages",
        type=Path,
        nargs="+",
        help="Markdown pages to read (default: README.md and docs/**/*.md)",
    )
    parser.add_argument("--list", action="store_true", help="list, run nothing")
    parser.add_argument("--only", type=int, nargs="+", help="command numbers")
    parser.add_argument("--with-tests", action="store_true")
    parser.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/readme")
    args = parser.parse_args()
    chosen = [
        c
        for c in commands(args.pages or pages())
        if c.runnable
        and (args.with_tests or not c.is_tests)
        and (not args.only or c.number in args.only)
    ]
    missing = [c for c in chosen if not c.expect]
    if missing:
        sys.exit(
            "commands without an '# expect:' (or '# not run here:') line: "
            + ", ".join(f"{c.where} ({c.short})" for c in missing)
        )
    if args.list:
        for c in chosen:
            print(f"{c.number:>3}  {c.where}  {c.short}\n       expect: {c.expect}")
        return
    args.out.mkdir(parents=True, exist_ok=True)
    rows = []
    for c in chosen:
        wanted, seconds = checks(c.expect)
        print(f"[{c.number}] {c.where}: {c.short}", flush=True)
        outcome = measure(c, args.out / f"command-{c.number}.log")
        for check in wanted:
            value = outcome.metrics.get(check.key)
            if value is None or not check.passes(value):
                outcome.failed.append(check.key)
        ok = not outcome.error and not outcome.failed
        measured = ", ".join(
            f"{k} {v:.4g}"
            for k, v in outcome.metrics.items()
            if any(w.key == k for w in wanted)
        )
        rows.append(
            (
                c,
                ", ".join(f"{w.key} {w.text}" for w in wanted),
                measured or "-",
                f"{outcome.seconds:.0f} s" + (f" (page: {seconds})" if seconds else ""),
                "ok" if ok else f"FAIL: {outcome.error or ', '.join(outcome.failed)}",
            )
        )
        print(f"    -> {rows[-1][2]}; {rows[-1][3]}; {rows[-1][4]}", flush=True)
    table = [
        "| # | where | command | expected | measured | time | |",
        "|---|---|---|---|---|---|---|",
        *(
            f"| {c.number} | {c.where} | `{c.short}` | {exp} | {got} | {secs} | {ok} |"
            for c, exp, got, secs, ok in rows
        ),
    ]
    text = "\n".join(table)
    (args.out / "readme_commands.md").write_text(text + "\n")
    print(text)
    if any(row[4] != "ok" for row in rows):
        sys.exit(1)


if __name__ == "__main__":
    main()
