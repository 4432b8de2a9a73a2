"""Grade the exercises by running the project's own tests on the code in a folder.

    python exercises/grade.py                 # every exercise, on this copy
    python exercises/grade.py 3 5             # only these
    python exercises/grade.py --root DIR      # grade another copy (e.g. a student's)

For each exercise, the tests listed in exercises/table.py (pytest node ids) are run
in ONE pytest call inside the graded folder; one line per exercise says passed or
FAILED (with the hint naming the classic mistakes), then one line per failing check:
the test's name and what it found different. An exercise whose tests stop in another
exercise that is still blank says "BLOCKED ... blocked by exercise N" (the sheet,
exercises/README.md, gives the order). Exits 1 unless every graded exercise passes. Nothing here checks an answer
itself: the tests do.
"""
import argparse
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(1, str(Path(__file__).resolve().parents[1]))    # the project: infra.errors
from table import EXERCISES  # noqa: E402

from infra.errors import RunError  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def node_of(case):
    """junit <testcase> -> the table's node id form: tests/test_x.py::test_name[param]."""
    return case.get("classname").replace(".", "/") + ".py::" + case.get("name")


def matches(node, table_id):
    """A table id without [param] covers every parametrisation of that test."""
    return node == table_id or ("[" not in table_id and node.startswith(table_id + "["))


def run_tests(root, node_ids, timeout=900):
    """Run the tests in root -> ({node: (outcome, message)}, {test file: import error}, pytest's output tail).

    One pytest call over the tests' files with -k selecting their names (not the node ids
    themselves: one node id in a file that does not import would stop pytest before any
    test runs); a file that does not import leaves the other files' tests running."""
    files = sorted({n.split("::")[0] for n in node_ids if (Path(root) / n.split("::")[0]).is_file()})
    names = sorted({n.split("::")[1].split("[")[0] for n in node_ids})
    if not files:                                             # (pytest with no file would run every test)
        return {}, {}, "none of the test files exist in this copy"
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "report.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=line",
               "--continue-on-collection-errors", f"--junitxml={xml}", "-o", "junit_family=xunit1",
               "-k", " or ".join(names), *files]
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
        proc = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True, timeout=timeout)
        results, broken = {}, {}
        if xml.exists():
            for case in ET.parse(xml).getroot().iter("testcase"):
                bad = next((c for c in case if c.tag in ("failure", "error")), None)
                skipped = next((c for c in case if c.tag == "skipped"), None)
                if not case.get("classname"):                 # a test file that did not import
                    lines = ([l[1:].strip() for l in (bad.text or "").splitlines() if l.startswith("E ")]
                             if bad is not None else [])
                    broken[case.get("name").replace(".", "/") + ".py"] = " ".join(lines[-4:]) or "collection failure"
                elif bad is not None:
                    results[node_of(case)] = ("failed", (bad.get("message") or bad.text or "").strip())
                elif skipped is not None:
                    results[node_of(case)] = ("failed", "skipped: " + (skipped.get("message") or "").strip())
                else:
                    results[node_of(case)] = ("passed", "")
    return results, broken, (proc.stdout + proc.stderr)[-2000:]


def one_line(msg, width=220):
    """A failing test's message -> its first line, plainly: what the assertion says differs."""
    lines = [l.strip() for l in msg.strip().splitlines() if l.strip()] or ["(no message)"]
    first = lines[0]
    for prefix in ("AssertionError: ", "E   "):
        first = first[len(prefix):] if first.startswith(prefix) else first
    first = " ".join(first.split())
    return first if len(first) <= width else first[:width - 3] + "..."


BLANK = re.compile(r"NotImplementedError: Exercise (\d+) ")


def grade(root, numbers):
    """-> [(n, passed, lines)] and the pytest output tail: the exercise's line, then one line per failing check."""
    ids = [t for n in numbers for t in EXERCISES[n]["tests"]]
    results, broken, tail = run_tests(root, list(dict.fromkeys(ids)))
    report = []
    for n in numbers:
        ex = EXERCISES[n]
        n_ok, n_all, failing = 0, 0, []
        for table_id in ex["tests"]:
            got = [(node, res) for node, res in results.items() if matches(node, table_id)]
            if not got:                                       # not collected: its file did not import, or no such test
                why = broken.get(table_id.split("::")[0])
                got = [(table_id, ("failed", f"not run: its file did not import: {why}" if why else
                                   "not run: no such test in this copy"))]
            for node, (outcome, msg) in got:
                n_all += 1
                n_ok += outcome == "passed"
                if outcome != "passed":
                    failing.append((node.split("::")[-1], one_line(msg)))
        ok = n_ok == n_all
        blank_in = [{int(m) for m in BLANK.findall(msg)} for _, msg in failing]   # the exercises each check hit blank
        blockers = sorted(set().union(*blank_in) - {n}) if failing else []
        head = f"exercise {n:2d}  {{}}  {ex['title']}  ({n_ok} of {n_all} checks pass)"
        if ok:
            lines = [head.format("passed")]
        elif any(n in b for b in blank_in):
            lines = [head.format("FAILED") + f"  still blank: replace the raise between # EXERCISE {n} and "
                                             f"# END EXERCISE {n} in {', '.join(ex['regions'])}"]
        elif all(blank_in):                                   # every failing check stopped in another's blank
            lines = [head.format("BLOCKED") + f"  blocked by exercise {', '.join(map(str, blockers))}: its tests "
                     f"run that code too; finish it, then grade this one again (the order is in exercises/README.md)"]
        else:
            lines = [head.format("FAILED") + f"  hint: {ex['hint']}"]
            lines += [f"    {name}: " + (f"blocked by exercise {', '.join(map(str, sorted(b)))}" if b else msg)
                      for (name, msg), b in zip(failing, blank_in)]
        report.append((n, ok, lines))
    return report, tail


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("numbers", type=int, nargs="*", metavar="N", help="exercises to grade (default: all)")
    p.add_argument("--root", default=str(ROOT), help="the project copy to grade (default: the one holding this file)")
    p.add_argument("--show-pytest", action="store_true", help="print the tail of pytest's output too")
    args = p.parse_args(argv)
    numbers = args.numbers or sorted(EXERCISES)
    unknown = [n for n in numbers if n not in EXERCISES]
    if unknown:
        raise RunError(f"no exercise {unknown}; the exercises are {sorted(EXERCISES)}")
    root = Path(args.root).resolve()
    if not (root / "tests").is_dir():
        raise RunError(f"{root} has no tests/ folder: is it a copy of the project?")
    t0 = time.time()
    report, tail = grade(root, numbers)
    for _, _, lines in report:
        print("\n".join(lines))
    n_ok = sum(ok for _, ok, _ in report)
    print(f"{n_ok}/{len(report)} exercises passed in {time.time() - t0:.0f}s ({root})")
    if args.show_pytest:
        print(tail)
    sys.exit(0 if n_ok == len(report) else 1)


if __name__ == "__main__":
    main()
