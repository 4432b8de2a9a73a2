"""Grade the exercises by running the course's tests on the code in a folder.

    python exercises/grade.py                 # every exercise, on this copy
    python exercises/grade.py 3 5             # only these
    python exercises/grade.py --root DIR      # grade another copy (e.g. a student's)

Two grades, one report. In the reference checkout (the instructor's: it holds tests/oracles.py) this is the
OFFICIAL grade (exercises/official.py): only the bodies of the copy's EXERCISE regions are read, put into this
checkout's code, and this checkout's own tests run on them on inputs drawn at grading time, with the official
checks (speed) on top. In a student copy it is the SELF-CHECK: the copy's own tests against the values recorded
in tests/goldens.pt; it says so, and that it is not the grade.

For each exercise, the tests listed in exercises/table.py (pytest node ids) are run
in ONE pytest call; one line per exercise says passed or
FAILED (with the hint naming the classic mistakes), then one line per failing check:
the test's name and what it found different. An exercise whose tests stop in another
exercise that is still blank says "BLOCKED ... blocked by exercise N" (the sheet,
exercises/README.md, gives the order). Exits 1 unless every graded exercise passes. Nothing here checks an answer
itself: the tests do.

An exercise's grade is its own. In a student copy, a check of exercise N that also runs a written exercise M
(table.DEPENDS) and fails while M fails its own checks says so ("... your exercise M, which fails its own
checks"): fix M first. Where the instructor's references are at hand (tests/course_references.py: the reference
checkout, which also grades a student's copy with --root), the failing check runs again with M's reference in
place of the student's; what it says then is N's grade, and a check that passes only with the reference says
"also fails with your exercise M".
"""
import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import official  # noqa: E402
from course_error import CourseError  # noqa: E402
from table import DEPENDS, EXERCISES, blank_exercises  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SELF_CHECK = ("self-check: this copy's own tests, against the values recorded in tests/goldens.pt; it is NOT the "
              "grade (the instructor grades the code of your exercise regions with the course's own tests, on "
              "inputs drawn at grading time, and checks speed where the sheet says vectorised)")


def node_of(case):
    """junit <testcase> -> the table's node id form: tests/test_x.py::test_name[param]."""
    return case.get("classname").replace(".", "/") + ".py::" + case.get("name")


def matches(node, table_id):
    """A table id without [param] covers every parametrisation of that test."""
    return node == table_id or ("[" not in table_id and node.startswith(table_id + "["))


def references_dir(root=None):
    """This checkout's tests/ when it holds tests/course_references.py (the reference checkout, whose tests the
    official grade runs); None in a copy. Never the graded copy's own: a copy holds none, and one planted there
    is not the course's."""
    d = ROOT / "tests"
    return d if official.is_reference(ROOT) and (d / "course_references.py").is_file() else None


def run_tests(root, node_ids, timeout=900, references=None, seed=None):
    """Run the tests in root -> ({node: (outcome, message)}, {test file: import error}, pytest's output tail,
    {node: exercises whose reference it ran}).

    One pytest call over the tests' files with -k selecting their names (not the node ids
    themselves: one node id in a file that does not import would stop pytest before any
    test runs); a file that does not import leaves the other files' tests running.
    references {table id: [exercise, ...]}: in those tests, those exercises are the references.
    seed: the official grade's COURSE_GRADING_SEED (fresh inputs, expected values computed on them)."""
    files = sorted({n.split("::")[0] for n in node_ids if (Path(root) / n.split("::")[0]).is_file()})
    names = sorted({n.split("::")[1].split("[")[0] for n in node_ids})
    if not files:                                             # (pytest with no file would run every test)
        return {}, {}, "none of the test files exist in this copy", {}
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "report.xml"
        cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--tb=line",
               "--continue-on-collection-errors", f"--junitxml={xml}", "-o", "junit_family=xunit1",
               "-k", " or ".join(names), *files]
        env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1", COURSE_GRADING="1")
        for var in ("COURSE_REFERENCES", "COURSE_GRADING_SEED", "RECORD_GOLDENS"):
            env.pop(var, None)
        if seed:
            env["COURSE_GRADING_SEED"] = str(seed)
        log = Path(tmp) / "references.log"
        if references:
            env.update(COURSE_REFERENCES=json.dumps(references), COURSE_REFERENCES_LOG=str(log),
                       PYTHONPATH=os.pathsep.join(filter(None, [str(references_dir(root)),
                                                                env.get("PYTHONPATH")])))
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
        used = {}
        for line in (log.read_text().splitlines() if log.exists() else []):
            node, n = json.loads(line)
            used.setdefault(node, set()).add(n)
    return results, broken, (proc.stdout + proc.stderr)[-2000:], used


def one_line(msg, width=220):
    """A failing test's message -> its first line, plainly: what the assertion says differs."""
    lines = [l.strip() for l in msg.strip().splitlines() if l.strip()] or ["(no message)"]
    first = lines[0]
    for prefix in ("AssertionError: ", "E   "):
        first = first[len(prefix):] if first.startswith(prefix) else first
    first = " ".join(first.split())
    return first if len(first) <= width else first[:width - 3] + "..."


BLANK = re.compile(r"NotImplementedError: Exercise (\d+) ")


def with_references(root, numbers, results, seed=None):
    """Run again, with the references of the exercises each depends on (those written, not blank), the failing
    checks of the exercises in numbers -> ({node: (outcome, message)} of that run, {node: exercises it reached})."""
    blank = blank_exercises(root)
    if references_dir(root) is None:                         # a student copy: no references to run
        return {}, {}
    plan = {}
    for n in (n for n in numbers if n not in blank):         # (a blank exercise's checks fail at its raise)
        written = [d for d in DEPENDS.get(n, []) if d not in blank]
        for table_id in (EXERCISES[n]["tests"] + EXERCISES[n].get("official", [])) if written else []:
            if any(matches(node, table_id) and outcome != "passed" for node, (outcome, _) in results.items()):
                plan[table_id] = written
    if not plan:
        return {}, {}
    again, _, _, used = run_tests(root, list(plan), references=plan, seed=seed)
    again = {node: res for node, res in again.items() if any(matches(node, t) for t in plan)}  # (-k selects more)
    for node in again:                                        # a check that reached none: all it was given
        used.setdefault(node, set(next(d for t, d in plan.items() if matches(node, t))))
    return again, used


def mine(exercises):
    return f"your exercise{'s' if len(exercises) > 1 else ''} {', '.join(map(str, sorted(exercises)))}"


def grade(root, numbers, seed=None):
    """-> [(n, passed, lines)], the notes to print first and the pytest output tail: the exercise's line, then one
    line per failing check. In the reference checkout the official grade (exercises/official.py), else the
    self-check."""
    if official.is_reference(ROOT):
        with tempfile.TemporaryDirectory() as tmp:
            tree = Path(tmp) / "graded"
            problems = official.grading_tree(root, tree)
            ids = [t for n in numbers for t in EXERCISES[n]["tests"] + EXERCISES[n].get("official", [])]
            seed = official.calibrated_seed(ids, seed)
            report, tail = grade_in(tree, numbers, problems, seed)
        return report, official.notes(root) + [f"official grade: the course's own tests on the code of your "
                                               f"exercise regions, inputs drawn now (seed {seed})"], tail
    problems = {n: f"{rel} is missing from this copy (it holds this exercise's code): restore it from the hand-out"
                for n in numbers for rel in EXERCISES[n]["regions"] if not (Path(root) / rel).is_file()}
    report, tail = grade_in(root, numbers, problems)
    return report, [SELF_CHECK], tail


def grade_in(root, numbers, problems, seed=None):
    """grade() in the folder whose tests run: the graded copy (self-check) or the grading tree (official)."""
    blank = blank_exercises(root)
    deps = {d for n in numbers for d in DEPENDS.get(n, []) if d not in blank} if references_dir(root) is None else ()
    ids = [t for n in [*numbers, *sorted(set(deps) - set(numbers))] for t in EXERCISES[n]["tests"]
           + (EXERCISES[n].get("official", []) if seed else [])]
    results, broken, tail, _ = run_tests(root, list(dict.fromkeys(ids)), seed=seed)
    again, used = with_references(root, numbers, results, seed)
    own_fail = {d for d in deps if any(outcome != "passed" for node, (outcome, _) in results.items()
                                       for t in EXERCISES[d]["tests"] if matches(node, t))}
    report = []
    for n in numbers:
        ex = EXERCISES[n]
        n_ok, n_all, failing, theirs = 0, 0, [], {}
        if n in problems:                                     # a missing file, markers that differ
            head = f"exercise {n:2d}  FAILED  {ex['title']}  (not graded: {problems[n]})"
            report.append((n, False, [head]))
            continue
        for table_id in ex["tests"] + (ex.get("official", []) if seed else []):
            got = [(node, res) for node, res in results.items() if matches(node, table_id)]
            if not got:                                       # not collected: its file did not import, or no such test
                why = broken.get(table_id.split("::")[0])
                got = [(table_id, ("failed", f"not run: its file did not import: {why}" if why else
                                   "not run: no such test in this copy"))]
            for node, (outcome, msg) in got:
                if node in again:                             # graded with the references of what it depends on
                    if again[node][0] == "passed":
                        theirs[node.split("::")[-1]] = used[node]
                    outcome, msg = again[node]
                n_all += 1
                n_ok += outcome == "passed"
                if outcome != "passed":
                    failing.append((node.split("::")[-1], one_line(msg)))
        ok = n_ok == n_all
        also = sorted(set().union(*theirs.values())) if theirs else []
        note = (f"  also fails with {mine(also)}: {', '.join(theirs)} pass{'es' if len(theirs) == 1 else ''} "
                f"with the reference "
                f"exercise{'s' if len(also) > 1 else ''} {', '.join(map(str, also))}, fail with yours "
                f"(python exercises/grade.py {' '.join(map(str, also))} says what is wrong there)") if also else ""
        blank_in = [{int(m) for m in BLANK.findall(msg)} for _, msg in failing]   # the exercises each check hit blank
        blockers = sorted(set().union(*blank_in) - {n}) if failing else []
        head = f"exercise {n:2d}  {{}}  {ex['title']}  ({n_ok} of {n_all} checks pass)"
        if ok:
            lines = [head.format("passed") + note]
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
            lines += [f"    {name}: passes with the reference exercise {', '.join(map(str, sorted(d)))}; also fails "
                      f"with {mine(d)}" for name, d in theirs.items()]
            lines += [f"    these checks also run your exercise {d}, which fails its own checks: the fault may be "
                      f"there (python exercises/grade.py {d})" for d in DEPENDS.get(n, []) if d in own_fail]
        report.append((n, ok, lines))
    return report, tail


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("numbers", type=int, nargs="*", metavar="N", help="exercises to grade (default: all)")
    p.add_argument("--root", default=str(ROOT), help="the project copy to grade (default: the one holding this file)")
    p.add_argument("--show-pytest", action="store_true", help="print the tail of pytest's output too")
    p.add_argument("--seed", type=int, default=None, help="the official grade's seed (default: drawn now; give the "
                                                          "one a grade printed to grade the same inputs again)")
    args = p.parse_args(argv)
    numbers = args.numbers or sorted(EXERCISES)
    unknown = [n for n in numbers if n not in EXERCISES]
    if unknown:
        raise CourseError(f"no exercise {unknown}; the exercises are {sorted(EXERCISES)}")
    root = Path(args.root).resolve()
    if not (root / "tests").is_dir():
        raise CourseError(f"{root} has no tests/ folder: is it a copy of the project?")
    t0 = time.time()
    report, head, tail = grade(root, numbers, args.seed)
    print("\n".join(head))
    for _, _, lines in report:
        print("\n".join(lines))
    n_ok = sum(ok for _, ok, _ in report)
    print(f"{n_ok}/{len(report)} exercises passed in {time.time() - t0:.0f}s ({root})")
    if args.show_pytest:
        print(tail)
    sys.exit(0 if n_ok == len(report) else 1)


if __name__ == "__main__":
    main()
