"""Compare a TRL run and a posttrain run of TRL's test suite (the JSON files trl_suite_plugin.py writes).

    python scripts/trl_suite/compare.py TRL_JSON POSTTRAIN_JSON... [--failures] [--known FILE] [--check]
                                        [--collected SUMMARY_JSON] [--markdown]
    python scripts/trl_suite/compare.py TRL_JSON --passing-list OUT   (write the TRL-passing node ids)

Prints, per test file: tests collected (on TRL), TRL passes, posttrain passes of those. Only tests that pass on TRL
count. --failures lists each TRL-passing test that fails on posttrain with its first error line. --known FILE names
tests listed as deliberate differences (docs/trl_parity.md; a line may be an fnmatch pattern with `*`); --check
exits 1 if a TRL-passing test outside that list does not pass on posttrain. TRL_JSON may also be a passing list (one
node id a line, as --passing-list writes). Several POSTTRAIN_JSONs (runs of different files) are read as one run.
--collected SUMMARY_JSON takes the collected column from TRL's per-file outcomes (trl_1.16_summary.json), which
counts the tests that do not pass on TRL too.
"""

from __future__ import annotations

import argparse
import fnmatch
import json
import sys
from collections import defaultdict
from pathlib import Path


def load_run(path: str) -> dict:
    text = Path(path).read_text()
    if text.lstrip().startswith("{"):
        return json.loads(text)
    # A passing list: every listed test passed.
    ids = [line.strip() for line in text.splitlines() if line.strip() and not line.startswith("#")]
    return {"tests": {nodeid: {"outcome": "passed", "message": ""} for nodeid in ids}, "collect_errors": {}}


def read_ids(path: str | None) -> dict[str, str]:
    """node id (or fnmatch pattern) -> reason, from a file of `node id  # reason` lines."""
    out = {}
    if path:
        for line in Path(path).read_text().splitlines():
            line = line.strip()
            if line and not line.startswith("#"):
                nodeid, _, reason = line.partition(" # ")
                out[nodeid.strip()] = reason.strip()
    return out


def merge_runs(paths: list[str]) -> dict | None:
    """Several runs (of different test files) as one."""
    if not paths:
        return None
    merged = {"tests": {}, "collect_errors": {}}
    for path in paths:
        run = load_run(path)
        merged["tests"].update(run["tests"])
        merged["collect_errors"].update(run.get("collect_errors", {}))
    return merged


def collected_per_file(summary_path: str) -> dict[str, int]:
    """Tests collected per file on TRL (every outcome but a collection error), from trl_1.16_summary.json."""
    files = json.loads(Path(summary_path).read_text())["files"]
    return {
        file_of(name): sum(n for outcome, n in counts.items() if outcome != "collection error")
        for name, counts in files.items()
    }


def file_of(nodeid: str) -> str:
    path = nodeid.split("::", 1)[0]
    return path[len("tests/") :] if path.startswith("tests/") else path


def table(trl: dict, posttrain: dict | None) -> tuple[list[tuple], list[tuple]]:
    rows: dict[str, list[int]] = defaultdict(lambda: [0, 0, 0])
    failures = []
    post_tests = posttrain["tests"] if posttrain else {}
    for nodeid, result in sorted(trl["tests"].items()):
        row = rows[file_of(nodeid)]
        row[0] += 1
        if result["outcome"] != "passed":
            continue
        row[1] += 1
        if posttrain is None:
            continue
        post = post_tests.get(nodeid)
        if post is not None and post["outcome"] == "passed":
            row[2] += 1
        else:
            if post is None:
                errors = posttrain.get("collect_errors", {})
                message = errors.get(nodeid.split("::", 1)[0]) or "not collected"
                failures.append((nodeid, "collection", message))
            else:
                failures.append((nodeid, post["outcome"], post.get("message", "")))
    return [(name, *counts) for name, counts in sorted(rows.items())], failures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("trl")
    parser.add_argument("posttrain", nargs="*")
    parser.add_argument("--collected", default=None)
    parser.add_argument("--failures", action="store_true")
    parser.add_argument("--known", default=None)
    parser.add_argument("--check", action="store_true")
    parser.add_argument("--passing-list", default=None)
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args(argv)

    trl = load_run(args.trl)
    if args.passing_list:
        ids = sorted(n for n, r in trl["tests"].items() if r["outcome"] == "passed")
        Path(args.passing_list).write_text("\n".join(ids) + "\n")
        print(f"{len(ids)} TRL-passing tests written to {args.passing_list}")
        return 0
    posttrain = merge_runs(args.posttrain)
    rows, failures = table(trl, posttrain)
    if args.collected:
        collected = collected_per_file(args.collected)
        rows = [(name, collected.get(name, n), *rest) for name, n, *rest in rows]
    known = read_ids(args.known)

    header = ("file", "collected", "TRL passes", "posttrain passes")
    total = ["total", 0, 0, 0]
    for row in rows:
        for i in (1, 2, 3):
            total[i] += row[i]
    if args.markdown:
        print("| " + " | ".join(header) + " |")
        print("|" + "---|" * len(header))
        for row in [*rows, tuple(total)]:
            print("| " + " | ".join(str(x) for x in row) + " |")
    else:
        width = max(len(r[0]) for r in [*rows, tuple(total)])
        print(f"{header[0]:<{width}}  {header[1]:>9}  {header[2]:>10}  {header[3]:>16}")
        for row in [*rows, tuple(total)]:
            print(f"{row[0]:<{width}}  {row[1]:>9}  {row[2]:>10}  {row[3] if posttrain else '-':>16}")

    def is_known(nodeid: str) -> bool:
        return nodeid in known or any(fnmatch.fnmatchcase(nodeid, pattern) for pattern in known if "*" in pattern)

    unexpected = [f for f in failures if not is_known(f[0])]
    if args.failures:
        for nodeid, outcome, message in failures:
            tag = "known" if is_known(nodeid) else outcome
            print(f"[{tag}] {nodeid}\n    {message}")
    if posttrain is not None:
        print(
            f"\n{total[3]} of {total[2]} TRL-passing tests pass on posttrain; "
            f"{len(failures) - len(unexpected)} failing ones are listed deliberate differences, "
            f"{len(unexpected)} are not."
        )
    if args.check and unexpected:
        for nodeid, outcome, message in unexpected:
            print(f"UNEXPECTED {outcome}: {nodeid}\n    {message}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
