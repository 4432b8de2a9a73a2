"""The official grade: the course's own tests, from the instructor's checkout, run on a copy's exercise regions only.

    python exercises/grade.py --root ~/students/alice      # in the reference checkout (it holds tests/oracles.py)

A student copy holds its own tests and recorded values (tests/goldens.pt) for the student's self-check; a class
can edit both, and a function can look a recorded value up instead of computing it. So the official grade reads
nothing of the copy but the bodies of its EXERCISE regions:

1. grading_tree: a temporary copy of THIS checkout in which each region's body is the copy's. Nothing else of the
   copy is imported or run: not its tests, not its tests/course_references.py, not its conftest.py, not the code
   around its regions. A region file missing from the copy, or whose markers differ from the course's, leaves its
   exercises blank there and says why (problems).
2. grade.py runs the tests of exercises/table.py there, and each exercise's `official` checks (a speed bound
   against the course's own function: tests/test_official.py, which no copy holds), with COURSE_GRADING_SEED set
   to a seed drawn now: the tests that compare with a recorded value draw their inputs with every seed moved by
   it (tests/conftest.py), and tests/recorded.py computes the expected value with the reference's loop on those
   inputs. No value stored in a hand-out was made on them.
3. calibrated_seed: the course's own regions must pass those tests at the seed (a test may check its inputs'
   own properties: "three different figures"), else another seed is drawn.

course_version names what the course asks (the markers of every region, the table's tests); a copy records it
when it is made (exercises/this_copy.json), and a copy made from another version is told so before its grade.
"""
import hashlib
import json
import os
import random
import shutil
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import make_student_copy as msc  # noqa: E402
from course_error import CourseError  # noqa: E402
from table import COPY_RECORD, EXERCISES  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
NOT_IN_TREE = {Path("tests/goldens.pt")}          # the grade computes every expected value: no stored one to read


def is_reference(root=ROOT):
    """The instructor's checkout: it holds the graded tests' loops (tests/oracles.py) and is no copy."""
    return (Path(root) / "tests" / "oracles.py").is_file() and not (Path(root) / COPY_RECORD).is_file()


def region_files():
    return sorted({r for ex in EXERCISES.values() for r in ex["regions"]})


def markers(text, where):
    """The marker text of each region of a file, in order: [(n, text)] (what the course asks, not the answers)."""
    return [(n, words) for n, _, _, _, words in msc.find_regions(text.split("\n"), where)]


def course_version(root=ROOT):
    """A short name of what the course asks: every region's marker text and the tests that grade each exercise."""
    h = hashlib.sha256()
    for rel in region_files():
        h.update(json.dumps([rel, markers((Path(root) / rel).read_text(), rel)]).encode())
    h.update(json.dumps({n: ex["tests"] + ex.get("official", []) for n, ex in EXERCISES.items()}).encode())
    return h.hexdigest()[:12]


def notes(copy):
    """Lines printed before the grade: what in the copy the grade reads differently from what a student may think."""
    if Path(copy).resolve() == ROOT:                  # the reference graded: nothing to say about a copy
        return []
    out = []
    record = Path(copy) / COPY_RECORD
    made = json.loads(record.read_text()).get("course") if record.is_file() else None
    if made != course_version():
        said = f"its {COPY_RECORD} records {made or 'no version'}" if record.is_file() else f"no {COPY_RECORD}"
        out.append(f"note: this copy was made from {'an older' if made is None else 'another'} version of the course "
                   f"({said}; this course is {course_version()}): it is graded against this version's tests")
    if (Path(copy) / "tests" / "course_references.py").is_file():
        out.append("note: the copy holds tests/course_references.py, which no hand-out holds: the grade ignores it, "
                   "as it ignores every test of the copy (it runs the course's own)")
    for rel in region_files():
        mine, ref = Path(copy) / rel, ROOT / rel
        if mine.is_file() and outside(mine.read_text()) != outside(ref.read_text()):
            out.append(f"note: {rel} differs from the course's outside its exercise regions: the grade takes only "
                       f"the regions (code you added around them, a helper or an import, is not there)")
    return out


def outside(text):
    """A file's lines outside its regions' bodies (the markers kept), without trailing whitespace."""
    lines = text.split("\n")
    try:
        drop = {i for _, s, e, _, _ in msc.find_regions(lines) for i in range(s, e)}
    except ValueError:
        return None
    return [line.rstrip() for i, line in enumerate(lines) if i not in drop]


def grading_tree(copy, tree):
    """Write into tree this checkout with the copy's region bodies -> {exercise: why it cannot be graded}."""
    problems = {}
    for path in sorted(ROOT.rglob("*")):              # all of this checkout: its tests, loops and references too
        rel = path.relative_to(ROOT)
        if any(part in msc.SKIP_DIRS for part in rel.parts) or rel in NOT_IN_TREE or path.is_dir():
            continue
        (tree / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / rel, tree / rel)
    for rel in region_files():
        ref_text = (ROOT / rel).read_text()
        ref_lines = ref_text.split("\n")
        numbers = sorted({n for n, _ in markers(ref_text, rel)})
        mine = Path(copy) / rel
        if not mine.is_file():
            why = f"{rel} is missing from the copy (it holds this exercise's code): restore it from the hand-out"
        else:
            try:
                got = mine.read_text().split("\n")
                regions = msc.find_regions(got, rel)
                why = None if [(n, w) for n, *_, w in regions] == markers(ref_text, rel) else (
                    f"{rel}'s exercise markers differ from the course's: restore the marker lines as the hand-out "
                    f"has them (a copy of another course version is told so above)")
            except ValueError as e:
                why = f"{rel}: {e}"
        if why:                                       # its exercises stay blank in the tree, for the reason given
            problems.update({n: why for n in numbers})
            (tree / rel).write_text(msc.blank(ref_text, where=rel))
            continue
        for (_, s, e, *_), (_, rs, re_, *_) in reversed(list(zip(regions, msc.find_regions(ref_lines, rel)))):
            ref_lines[rs:re_] = got[s:e]
        (tree / rel).write_text("\n".join(ref_lines))
    return problems


def recorded_tests(ids, root=ROOT):
    """The table ids among ids whose test compares with a recorded value (their inputs move with the seed)."""
    import ast
    calling = set()
    for rel in sorted({i.split("::")[0] for i in ids}):
        src = (Path(root) / rel).read_text()
        calling |= {f"{rel}::{node.name}" for node in ast.parse(src).body if isinstance(node, ast.FunctionDef)
                    and 'expected("' in ast.get_source_segment(src, node)}
    return [i for i in ids if i.split("[")[0] in calling]


def calibrated_seed(ids, given=None, tries=8):
    """A seed drawn now at which the course's own regions pass every test among ids that moves with it."""
    moved = recorded_tests(ids)
    rng = random.SystemRandom()
    for _ in range(1 if given else tries):
        seed = given or rng.randrange(1, 10 ** 6)
        if not moved:
            return seed
        names = sorted({i.split("::")[1].split("[")[0] for i in moved})
        files = sorted({i.split("::")[0] for i in moved})
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x", "-k",
                            " or ".join(names), *files], cwd=ROOT, capture_output=True, text=True, timeout=900,
                           env=dict(os.environ, COURSE_GRADING_SEED=str(seed), PYTHONDONTWRITEBYTECODE="1"))
        if r.returncode == 0:
            return seed
        if given:
            raise CourseError(f"the course's own code fails its tests at --seed {seed}: "
                              f"{r.stdout.strip().splitlines()[-1]}")
    raise CourseError(f"no seed of {tries} drawn lets the course's own code pass its tests "
                      f"(run the tests in {ROOT} with COURSE_GRADING_SEED set)")
