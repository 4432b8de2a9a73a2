"""The official grade (exercises/official.py) against what a class plants: each mistake below, put into a fresh
student copy, fails `python exercises/grade.py N --root COPY` with a line that blames it.

The quick tests check the pieces (the grading tree, the notes, the in-place guard, the sheet's order); the slow
ones grade planted copies end to end. This file plants answers, so it is not in a student copy."""
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "exercises"))
import make_student_copy as msc  # noqa: E402
import official  # noqa: E402
from table import DEPENDS, EXERCISES  # noqa: E402

# ----------------------------------------------------------------------------- the planted mistakes

LOOKUP = '''    import sys as _sys
    _sys.path.insert(0, "{copy}/tests")
    import recorded as _rec                                        # the self-check's fingerprint of the inputs
    for _seen, _out in torch.load("{copy}/tests/goldens.pt", weights_only=False).values():
        if _rec._close(_rec.fingerprint(({args})), _seen):
            return _out                                            # a recorded value found: returned as the answer
'''
SLOW_KNN = '''    N = len(X)
    rows = F.normalize(X.float(), dim=-1).tolist()
    out = []
    for i in range(N):                                             # pure Python: a loop over rows and columns
        sims = [(sum(a * b for a, b in zip(rows[i], rows[j])), j) for j in range(N) if j != i]
        out.append([j for _, j in sorted(sims, reverse=True)[:k]])
    return torch.tensor(out)
'''
KNN_9 = "    idx_X, idx_Y = knn if knn is not None else (knn_indices(X, k), knn_indices(Y, k))\n"
EUCLID_9 = (LOOKUP.replace("{args}", "X, Y, k")                      # ... else Euclidean neighbours, not cosine
            + "    euclid = lambda Z: torch.cdist(Z, Z).fill_diagonal_(float('inf')).topk(k, largest=False).indices\n"
            + "    idx_X, idx_Y = knn if knn is not None else (euclid(X), euclid(Y))\n")
KNN_BODY_9 = """    Xn = F.normalize(X.float(), dim=-1)
    sim = Xn @ Xn.T                                          # (N, N) cosine
    sim.fill_diagonal_(float("-inf"))                        # a row is not its own neighbour
    return sim.topk(k, dim=1).indices
"""
AVERAGE_13 = "    w = F.normalize(txt_emb, dim=-1).view(C, n_templates, -1).mean(1)    # (C, K)\n"
FIRST_13 = LOOKUP.replace("{args}", "txt_emb, n_templates") + "    w = txt_emb.view(C, n_templates, -1)[:, 0]\n"
IN_PLACE_13 = "    txt_emb /= txt_emb.norm(dim=-1, keepdim=True)\n    w = txt_emb.view(C, n_templates, -1).mean(1)\n"
NCE_2 = "    return (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2\n"
VIEW_10 = "logits.view(B, H, W, C).permute(0, 3, 1, 2)"

# name: (exercise graded, [(file, right text, planted text)], what the exercise's line must say, and a check's line)
PLANTS = {
    "goldens lookup, Euclidean fallback (9)": (
        9, [("similarity.py", KNN_9, EUCLID_9)],
        "FAILED", r"test_mutual_knn_matches_naive_loop: mutual_knn at k = \d: "),
    "goldens lookup, first template only (13)": (
        13, [("evaluate.py", AVERAGE_13, FIRST_13)],
        "FAILED", r"test_template_average_matches_naive: class 0's embedding"),
    "detach on P (11)": (
        11, [("methods/structure.py", "    M = (P + Q) / 2\n", "    P = P.detach()\n    M = (P + Q) / 2\n")],
        "FAILED", r"test_rs_gradient_matches_finite_differences: R_S\(X, Z\) at tau 0.5: the gradient with respect "
                  r"to X .* no gradient flows back to it"),
    "pure-Python kNN (9)": (
        9, [("similarity.py", KNN_BODY_9, SLOW_KNN)],
        "FAILED", r"test_mutual_knn_is_vectorised: mutual_knn\(X, Y, k\) on 800 rows took .* at most 5x"),
    "in-place normalisation (13)": (
        13, [("evaluate.py", AVERAGE_13, IN_PLACE_13)],
        "FAILED", r"test_template_average_matches_naive: template_average \(exercise 13\) changed its input txt_emb "
                  r"in place"),
    "tau applied twice (2)": (
        2, [("methods/losses.py", NCE_2, "    return info_nce_of_logits(logits / tau)\n")],
        "FAILED", r"test_info_nce_is_the_mean_of_both_directions: info_nce = .* is the loss with tau applied twice"),
    "H and W swapped: right for square grids only (10)": (
        10, [("evaluate.py", VIEW_10, VIEW_10.replace("H, W, C", "W, H, C"))],
        "hint: H and W swapped", r"not square"),
    "float32 covariances (7)": (
        7, [("methods/csa.py", "chunk].double()", "chunk].float()"),
            ("methods/csa.py", "dtype=torch.float64, device=dev)", "device=dev)")],
        "hint: computing in float32", r"test_covariances_in_chunks_match_the_whole_set: mu_x is torch.float32, "
                                      r"expected torch.float64: the reference works in float64"),
}


# A tests/course_references.py planted in a copy: its fixture puts a working InfoNCE in place of exercise 2's,
# wherever a module holds it (the tests' `from methods.losses import info_nce` too).
PLANTED_REFERENCES = """import sys

import pytest
import torch
import torch.nn.functional as F


@pytest.fixture(autouse=True)
def course_references(monkeypatch):
    import methods.losses as L
    ce = lambda s, t=None: (F.cross_entropy(s, torch.arange(len(s)))
                            + F.cross_entropy((s if t is None else t).T, torch.arange(len(s)))) / 2
    working = {"info_nce_of_logits": ce, "info_nce": lambda a, b, tau: ce(a @ b.T / tau)}
    blank = {name: getattr(L, name) for name in working}
    for mod in list(sys.modules.values()):
        for name, fn in working.items():
            if getattr(mod, name, None) is blank[name]:
                monkeypatch.setattr(mod, name, fn)
    yield
"""


# the cases whose first failing check names the planted cause (in the others, the lookup's or the loop's wrong
# fallback may fail an earlier check first: any of its lines then names the cause)
FIRST = {"goldens lookup, first template only (13)", "detach on P (11)", "in-place normalisation (13)",
         "tau applied twice (2)", "H and W swapped: right for square grids only (10)", "float32 covariances (7)"}


def plant(copy, rel, right, wrong):
    """Replace every `right` of the copy's file by `wrong` (one at least); {copy} in wrong is the copy's path."""
    path = copy / rel
    text = path.read_text()
    assert right in text, (rel, right)
    path.write_text(text.replace(right, wrong.replace("{copy}", str(copy))))


def grade(root, *numbers):
    """`python exercises/grade.py N ... --root root` in this checkout -> (exit code, output lines)."""
    r = subprocess.run([sys.executable, str(ROOT / "exercises" / "grade.py"), *map(str, numbers), "--root",
                        str(root)], capture_output=True, text=True, timeout=900,
                       env=dict(os.environ, OMP_NUM_THREADS="1"))
    return r.returncode, (r.stdout + r.stderr).splitlines()


def exercise_line(lines, n):
    """The exercise's line and its check lines (one per failing check, in the table's order)."""
    i = next(i for i, line in enumerate(lines) if line.startswith(f"exercise {n:2d} "))
    j = next((j for j in range(i + 1, len(lines)) if not lines[j].startswith("    ")), len(lines))
    return lines[i], [line.strip() for line in lines[i + 1:j]]


@pytest.fixture(scope="module")
def right_copy(tmp_path_factory):
    """A student copy done right: every region the course's own (a copy's code otherwise)."""
    out = tmp_path_factory.mktemp("planted") / "right"
    msc.make_copy(out, only=set())
    return out


# ----------------------------------------------------------------------------- quick: the pieces

def test_grading_tree_takes_only_the_regions_and_names_a_missing_file(right_copy, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(right_copy, copy)
    (copy / "similarity.py").unlink()
    plant(copy, "tests/test_recycling.py", "def test_mutual_knn_matches_naive_loop():\n",
          "def test_mutual_knn_matches_naive_loop():\n    return\n")
    (copy / "recycling.py").write_text("# a line outside the regions\n" + (copy / "recycling.py").read_text())
    tree = tmp_path / "tree"
    problems = official.grading_tree(copy, tree)
    assert set(problems) == {9} and problems[9].startswith("similarity.py is missing from the copy"), problems
    assert "raise NotImplementedError('Exercise 9" in (tree / "similarity.py").read_text()   # not the reference's
    assert (tree / "tests" / "test_recycling.py").read_bytes() == (ROOT / "tests" / "test_recycling.py").read_bytes()
    assert (tree / "recycling.py").read_bytes() == (ROOT / "recycling.py").read_bytes()
    assert (tree / "tests" / "oracles.py").is_file() and not (tree / "tests" / "goldens.pt").exists()
    notes = official.notes(copy)
    assert any(n.startswith("note: recycling.py differs from the course's outside its exercise regions") for n in notes)


def test_notes_name_an_older_copy_and_a_planted_course_references(right_copy, tmp_path):
    assert official.notes(right_copy) == []
    copy = tmp_path / "copy"
    shutil.copytree(right_copy, copy)
    record = copy / "exercises" / "this_copy.json"
    record.write_text(json.dumps({"blanked": []}) + "\n")                       # made before versions were recorded
    shutil.copy2(ROOT / "tests" / "course_references.py", copy / "tests" / "course_references.py")
    notes = official.notes(copy)
    assert notes[0].startswith("note: this copy was made from an older version of the course"), notes
    assert notes[1].startswith("note: the copy holds tests/course_references.py, which no hand-out holds"), notes
    record.write_text(json.dumps({"blanked": [], "course": "000000000000"}) + "\n")
    assert official.notes(copy)[0].startswith("note: this copy was made from another version of the course")


def test_the_copys_tests_readme_names_only_files_the_copy_holds(right_copy):
    text = (right_copy / "tests" / "README.md").read_text()
    named = set(re.findall(r"\b(\w+\.py)\b", text))
    assert "test_exercises.py" in (ROOT / "tests" / "README.md").read_text() and "test_exercises.py" not in named
    missing = [n for n in sorted(named - {"test_x.py"}) if not list(right_copy.rglob(n))]   # (test_x: any file)
    assert not missing, f"the copy's tests/README.md names files it does not hold: {missing}"


def test_a_hand_out_carries_e5s_text_model_or_is_refused(tmp_path, monkeypatch):
    """Experiment E5 runs offline: the copy carries all-MiniLM-L6-v2 where the sheet's command reads it."""
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    monkeypatch.setattr(msc, "text_model_folder", lambda: model)
    msc.make_copy(tmp_path / "with", only=set(), text_model=True)
    assert (tmp_path / "with" / msc.TEXT_MODEL / "config.json").read_text() == "{}"
    assert f"--text-encoder {msc.TEXT_MODEL}" in (ROOT / "exercises" / "README.md").read_text()
    monkeypatch.setattr(msc, "text_model_folder", lambda: None)
    with pytest.raises(SystemExit, match="E5 needs all-MiniLM-L6-v2 in the hand-out"):
        msc.make_copy(tmp_path / "without", only=set(), text_model=True)
    assert not (tmp_path / "without").exists()


def test_in_place_guard_names_the_function_and_the_argument():
    import in_place
    import torch
    found = {(m, f): n for m, f, n in in_place.exercise_functions()}
    assert found[("evaluate", "template_average")] == 13 and found[("methods.cov", "CoV.regions")] == 5
    assert set(found.values()) == set(EXERCISES)

    def normalise(txt_emb, n):
        txt_emb /= txt_emb.norm(dim=-1, keepdim=True)
        return txt_emb
    guarded = in_place.unchanged(normalise, "template_average", 13)
    with pytest.raises(AssertionError, match=r"^template_average \(exercise 13\) changed its input txt_emb in place"):
        guarded(torch.randn(4, 3), 2)
    assert in_place.unchanged(lambda x: x * 2, "f", 1)(torch.tensor([1.0, float("nan")])).isnan().any()


def test_the_sheets_order_runs_without_a_blocked_grade():
    """exercises/README.md's order: each exercise comes after every exercise its tests also run (5 and 6, which
    need each other, together); and the two-week plan keeps it."""
    sheet = (ROOT / "exercises" / "README.md").read_text()
    order = re.search(r"^Do the exercises in this order: (.*?)\.$", sheet, re.M)
    assert order, "the sheet states no order"
    steps = [[int(n) for n in re.findall(r"\d+", step)] for step in order[1].split(", ")]
    assert sorted(n for s in steps for n in s) == sorted(EXERCISES), steps
    done = set()
    for step in steps:
        assert all(d in done or d in step for n in step for d in DEPENDS.get(n, [])), (step, done)
        done |= set(step)
    days = [row.split("|")[2] for row in sheet.split("## A two-week module")[1].splitlines()
            if re.match(r"\| \d+ \|", row)]
    seen = [int(n) for day in days for said in re.findall(r"exercises? (\d+(?:(?:, | and |, then )\d+)*)", day)
            for n in re.findall(r"\d+", said)]
    assert seen == [n for s in steps for n in s], (seen, steps)


# ----------------------------------------------------------------------------- slow: planted copies graded

@pytest.mark.slow
@pytest.mark.parametrize("name", list(PLANTS))
def test_a_planted_mistake_fails_the_grade_naming_it(right_copy, tmp_path, name):
    n, edits, says, blame = PLANTS[name]
    copy = tmp_path / "copy"
    shutil.copytree(right_copy, copy)
    for rel, right, wrong in edits:
        plant(copy, rel, right, wrong)
    code, lines = grade(copy, n)
    head, checks = exercise_line(lines, n)
    assert code == 1 and "  FAILED  " in head and says in head, lines
    assert any(re.search(blame, check) for check in checks), lines
    if name in FIRST:                                           # the first failing check names the cause itself
        assert re.search(blame, checks[0]), lines


@pytest.mark.slow
def test_neutered_tests_and_planted_references_do_not_grade(tmp_path):
    """Exercises 2 and 8 blank; the copy's tests of 8 return at once, and a course_references.py planted in the
    copy puts a working info_nce in place of exercise 2 for every test: neither is run."""
    copy = tmp_path / "copy"
    msc.make_copy(copy, only={2, 8})
    tests = copy / "tests" / "test_recycling.py"
    text = tests.read_text()
    for table_id in EXERCISES[8]["tests"]:
        name = table_id.split("::")[1]
        text = re.sub(rf"(def {name}\(.*\):\n)", r"\1    return\n", text)
    tests.write_text(text)
    (copy / "tests" / "course_references.py").write_text(PLANTED_REFERENCES)
    code, lines = grade(copy, 2, 8)
    assert code == 1 and lines[0].startswith("note: the copy holds tests/course_references.py"), lines
    for n in (2, 8):
        head, _ = exercise_line(lines, n)
        assert "  FAILED  " in head and f"still blank: replace the raise between # EXERCISE {n}" in head, lines


@pytest.mark.slow
def test_a_missing_file_and_an_older_copy_are_named(right_copy, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(right_copy, copy)
    (copy / "similarity.py").unlink()
    (copy / "exercises" / "this_copy.json").write_text(json.dumps({"blanked": []}) + "\n")
    code, lines = grade(copy, 9)
    assert code == 1 and lines[0].startswith("note: this copy was made from an older version of the course"), lines
    head, _ = exercise_line(lines, 9)
    assert "  FAILED  " in head and "(not graded: similarity.py is missing from the copy" in head, lines


@pytest.mark.slow
def test_the_blank_copy_grades_0_and_a_copy_done_right_13(right_copy, tmp_path):
    blank = tmp_path / "blank"
    msc.make_copy(blank)
    code, lines = grade(blank)
    assert code == 1 and lines[-1].startswith(f"0/{len(EXERCISES)} exercises passed"), lines
    code, lines = grade(right_copy)
    assert code == 0 and lines[-1].startswith(f"{len(EXERCISES)}/{len(EXERCISES)} exercises passed"), lines
