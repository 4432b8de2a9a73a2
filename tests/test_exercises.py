"""The course (exercises/): the markers agree with the table, and the grader has teeth.

The reference grades all passed; in a fresh student copy EVERY graded test of every exercise
fails, while the rest of the project still imports, no exercise's answer stands anywhere in
it, and align.py refuses a run that needs a blank exercise in one line; one classic mistake
per exercise, patched into a copy, fails with the hint naming it; a cap that forgets the
padding mask fails its grade and changes PAL's retrieval; the reference regions pasted back
grade as passed and align.py gives the reference's metrics there (its paper form, since a copy
has no methods/fast_cap.py). This file plants the answers, so it is not in a student copy."""
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
import grade as grader  # noqa: E402
import make_student_copy as msc  # noqa: E402
import table  # noqa: E402
from table import EXERCISES  # noqa: E402

# One classic mistake per exercise: (file, reference text, mistaken text, words of the hint that name it).
MISTAKES = {
    1: ("evaluate.py", "n_above[j] = ((rows >= g) & ~same).sum(1)", "n_above[j] = ((rows > g) & ~same).sum(1)",
        "ties ranked in favour of the truth"),
    2: ("methods/losses.py", "return (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2",
        "return F.cross_entropy(logits, target)", "one direction only"),
    3: ("methods/pal.py", "alpha = logits.softmax(dim=1)", "alpha = logits.softmax(dim=2)", "softmax over the anchors"),
    4: ("methods/cov.py", 'padding_mode="zeros", align_corners=False)', 'padding_mode="zeros", align_corners=True)',
        "align_corners=True"),
    5: ("methods/cov.py", "l_c = self.spread(attn, img.grid).mean()",
        "l_c = self.spread(threshold_mask(attn, self.eps), img.grid).mean()", "L_conc on the masked attention"),
    6: ("methods/cov.py", "t2i = (best_region * w_ok[None]).sum(-1) / w_ok.sum(-1)[None].clamp_min(1)",
        "t2i = best_region.mean(-1)", "padded words counted in the mean"),
    7: ("methods/csa.py", "x = X[i:i + chunk].double() - mu_x",
        "x = X[i:i + chunk].double() - X[i:i + chunk].double().mean(1, keepdim=True)", "centring with the wrong mean"),
    8: ("recycling.py", "cos = F.normalize(feats, dim=-1) @ F.normalize(W, dim=-1).T",
        "cos = F.normalize(feats, dim=-1) @ W.T", "head rows not normalised"),
    9: ("similarity.py", 'sim.fill_diagonal_(float("-inf"))', "sim = sim", "counted as its own neighbour"),
    10: ("evaluate.py", 'mode="bilinear", align_corners=False)[0].argmax(0)', 'mode="nearest")[0].argmax(0)',
         "nearest instead of bilinear"),
    11: ("methods/structure.py", "return (kl(P, M) + kl(Q, M)) / 2", "return (kl(M, P) + kl(M, Q)) / 2",
         "KL in the wrong direction"),
    12: ("methods/asif.py", "return F.normalize(r.clamp_min(0) ** self.p, dim=-1)",
         "return F.normalize((r ** self.p).clamp_min(0), dim=-1)", "power applied before the top-k / clamp"),
    13: ("evaluate.py", "w = F.normalize(txt_emb, dim=-1).view(C, n_templates, -1).mean(1)",
         "w = txt_emb.view(C, n_templates, -1).mean(1)", "averaging the templates before normalising"),
}


# A cap that forgets the padding mask: every token, padded or not, enters the softmax and the sum.
NO_MASK = ("methods/pal.py", """    R = R.masked_fill(~mask[..., None], 0.0)                                   # padding -> 0
    logits = (R / tau_p).masked_fill(~mask[..., None], float("-inf"))
""", """    logits = R / tau_p
""")
TINY_RUN = ["--epochs", "1", "--eval-images", "50", "--threads", "1", "--no-figures"]


def grade(root, *numbers):
    """Run exercises/grade.py --root root -> (exit code, {exercise: its line}, full output)."""
    r = subprocess.run([sys.executable, str(ROOT / "exercises" / "grade.py"), *map(str, numbers), "--root", str(root)],
                       capture_output=True, text=True, timeout=900, env=dict(os.environ, PYTHONUNBUFFERED="1"))
    lines = {int(l.split()[1]): l for l in r.stdout.splitlines() if l.startswith("exercise ")}
    return r.returncode, lines, r.stdout + r.stderr


def outside_regions(text):
    """The lines of a file outside its exercise regions (markers and their continuation lines kept)."""
    lines = text.split("\n")
    drop = {i for _, s, e, _, _ in msc.find_regions(lines) for i in range(s, e)}
    return [l for i, l in enumerate(lines) if i not in drop]


@pytest.fixture(scope="module")
def student_copy(tmp_path_factory):
    out = tmp_path_factory.mktemp("course") / "student"
    r = subprocess.run([sys.executable, str(ROOT / "exercises" / "make_student_copy.py"), str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    return out


# ----------------------------------------------------------------------------- the table and the markers

def test_markers_and_table_agree():
    assert len(EXERCISES) >= 10
    marked = {}
    for rel in msc.project_files(ROOT):
        if rel.suffix == ".py" and "# EXERCISE" in (text := (ROOT / rel).read_text()):
            for n, start, end, indent, words in msc.find_regions(text.split("\n"), str(rel)):
                assert end > start and words, f"{rel}: exercise {n} region is empty or has no text"
                marked.setdefault(n, set()).add(str(rel))
    assert set(marked) == set(EXERCISES)
    for n, ex in EXERCISES.items():
        assert marked[n] == set(ex["regions"]), n
        assert ex["tests"] and ex["hint"] and ex["title"]
        for node in ex["tests"]:
            path, name = node.split("::")
            assert f"def {name.split('[')[0]}(" in (ROOT / path).read_text(), node


def test_find_regions_rejects_unbalanced_markers_and_keeps_indentation():
    ok = "def f(x):\n    # EXERCISE 2 (Eq. 1): y = 2 x\n    #   shapes (B,)\n    y = 2 * x\n    return y\n    # END EXERCISE 2\n"
    out = msc.blank(ok)
    assert out.split("\n")[3] == "    raise NotImplementedError('Exercise 2 (Eq. 1): y = 2 x shapes (B,)')"
    assert out.split("\n")[:3] == ok.split("\n")[:3] and out.split("\n")[4:] == ok.split("\n")[5:]
    assert msc.blank(ok, only={5}) == ok
    for bad in ("    # EXERCISE 2\n    y = 1\n",                                       # no END
                "    # EXERCISE 2\n    y = 1\n    # END EXERCISE 3\n",                # wrong number
                "    y = 1\n    # END EXERCISE 2\n",                                  # END alone
                "# EXERCISE 2\n# EXERCISE 3\ny = 1\n# END EXERCISE 3\n# END EXERCISE 2\n"):  # nested
        with pytest.raises(ValueError):
            msc.find_regions(bad.split("\n"))


def test_only_blanks_the_chosen_exercises_and_never_overwrites(tmp_path):
    msc.make_copy(tmp_path / "c", only={3})
    pal = (tmp_path / "c" / "methods" / "pal.py").read_text()
    assert pal.count("raise NotImplementedError('Exercise 3") == 2 and "NotImplementedError('Exercise 2" not in pal
    assert (tmp_path / "c" / "methods" / "cov.py").read_text() == (ROOT / "methods" / "cov.py").read_text()
    with pytest.raises(SystemExit):
        msc.make_copy(tmp_path / "c")                          # not empty: a student's work stays
    with pytest.raises(SystemExit):
        msc.make_copy(ROOT / "results" / "copy")               # inside the project


# ----------------------------------------------------------------------------- the grader has teeth

def graded_results(root):
    """{exercise: [(node, outcome, message)]} of every graded test, from one pytest run in root."""
    ids = list(dict.fromkeys(t for ex in EXERCISES.values() for t in ex["tests"]))
    results, broken, tail = grader.run_tests(root, ids)
    assert not broken, broken
    out = {}
    for n, ex in EXERCISES.items():
        for table_id in ex["tests"]:
            got = [(node, *res) for node, res in results.items() if grader.matches(node, table_id)]
            assert got, f"exercise {n}: {table_id} was not run ({tail})"
            out.setdefault(n, []).extend(got)
    return out


@pytest.mark.slow
def test_reference_passes_every_graded_test_and_grades_all_passed():
    code, lines, out = grade(ROOT)
    assert code == 0, out
    assert sorted(lines) == sorted(EXERCISES), out
    for n, line in lines.items():
        k = sum(1 for _ in EXERCISES[n]["tests"])
        assert "  passed  " in line and re.search(r"\((\d+) of \1 checks pass\)", line), line   # every graded test
        assert int(re.search(r"\((\d+) of", line)[1]) >= k, line


def test_every_graded_test_fails_on_the_blank_copy(student_copy):
    """A test that passes with an exercise still blank checks nothing of the student's code."""
    for n, tests in graded_results(student_copy).items():
        for node, outcome, msg in tests:
            assert outcome == "failed", f"exercise {n}: {node} passes with every exercise blank"


@pytest.mark.slow
def test_student_copy_fails_every_exercise_and_the_rest_still_imports(student_copy):
    ref_files = msc.project_files(ROOT)
    assert msc.project_files(student_copy) == ref_files
    for left_out in ("exercises/answers.md", "methods/fast_cap.py", "tests/test_exercises.py"):
        assert (ROOT / left_out).exists() and not (student_copy / left_out).exists(), left_out
    assert not any((student_copy / d).exists() for d in (".git", ".cache", "results"))
    for rel in ref_files:                                         # verbatim outside the regions
        ref, got = (ROOT / rel).read_bytes(), (student_copy / rel).read_bytes()
        if rel.suffix == ".py" and b"# EXERCISE" in ref:
            assert outside_regions(got.decode()) == outside_regions(ref.decode()), rel
            for n, s, e, indent, words in msc.find_regions(got.decode().split("\n")):
                raise_line = f"{indent}raise NotImplementedError({f'Exercise {n} {words}'!r})"
                assert got.decode().split("\n")[s:e] == [raise_line], rel
        else:
            assert got == ref, rel
    r = subprocess.run([sys.executable, "-c", "import align, data, encoders, evaluate, features, methods, recycling, "
                        "similarity; align.parse_args([])"], cwd=student_copy, capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr
    code, lines, out = grade(student_copy)
    assert code == 1 and sorted(lines) == sorted(EXERCISES), out
    for n, line in lines.items():
        assert "  FAILED  " in line and f"still blank: replace the raise between # EXERCISE {n} and" in line, line
        assert "junit" not in line and "element text" not in line and "AssertionError" not in line, line


def normalised(line):
    """A code line without its comment and whitespace."""
    return re.sub(r"\s+", "", line.split("#")[0])


@pytest.mark.slow
def test_no_answer_stands_anywhere_in_the_student_copy(student_copy):
    """Each region's distinctive lines (>= 30 characters once normalised) appear nowhere in the copy."""
    answers = {}
    for rel in msc.project_files(ROOT):
        if rel.suffix == ".py" and "# EXERCISE" in (text := (ROOT / rel).read_text()):
            lines = text.split("\n")
            for n, s, e, _, _ in msc.find_regions(lines, str(rel)):
                for line in lines[s:e]:
                    if len(normalised(line)) >= 30:
                        answers.setdefault(normalised(line), n)
    assert len(answers) > 40
    for path in sorted(student_copy.rglob("*")):
        if path.is_file() and path.suffix in (".py", ".md", ".txt"):
            for i, line in enumerate(path.read_text().split("\n")):
                assert normalised(line) not in answers, \
                    f"{path.relative_to(student_copy)}:{i + 1} holds exercise {answers[normalised(line)]}'s answer"


@pytest.mark.slow
def test_align_refuses_a_run_that_needs_a_blank_exercise(student_copy):
    """One line before any work; in the reference nothing is blank and the check says nothing."""
    assert table.blank_exercises(ROOT) == set()
    assert table.blank_exercises(student_copy) == set(EXERCISES)
    table.refuse_blank_exercises("pal")                           # the reference: returns silently
    for method in table.NEEDS:
        need = table.run_needs(method)
        with pytest.raises(SystemExit) as e:
            table.refuse_blank_exercises(method, root=student_copy)
        assert str(e.value).startswith(f"error: --method {method} needs exercises {', '.join(map(str, need))}; "
                                       f"still blank: {', '.join(map(str, need))} ("), e.value
    assert set(table.NEEDS) == set(__import__("methods").METHODS)
    assert table.run_needs("pal", analyses=True) == [1, 2, 3, 8, 9, 10, 13]
    r = subprocess.run([sys.executable, "align.py", "--method", "pal", "--cache-dir", str(student_copy / "no-cache")],
                       cwd=student_copy, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and r.stdout == "", (r.stdout, r.stderr)
    assert r.stderr.strip().splitlines() == ["error: --method pal needs exercises 1, 2, 3, 10, 13; still blank: "
                                             "1, 2, 3, 10, 13 (finish them, or run it in a copy that blanks only "
                                             "yours: python exercises/make_student_copy.py DIR --only 2 3, then "
                                             "paste your solutions in)"], r.stderr
    assert not (student_copy / "no-cache").exists()               # nothing was started
    copy3 = student_copy.parent / "only3"
    msc.make_copy(copy3, only={3})
    assert table.blank_exercises(copy3) == {3}
    table.refuse_blank_exercises("csa", root=copy3)               # csa does not need exercise 3
    with pytest.raises(SystemExit, match="still blank: 3 "):
        table.refuse_blank_exercises("pal_rel", root=copy3)


@pytest.mark.slow
def test_classic_mistakes_fail_with_the_hint_that_names_them(tmp_path):
    copy = tmp_path / "mistakes"
    msc.make_copy(copy, only=set())                               # a verbatim copy
    for n, (rel, right, wrong, _) in MISTAKES.items():
        text = (copy / rel).read_text()
        assert text.count(right) == (2 if n == 2 else 1), (n, right)       # exercise 2: both of its regions
        (copy / rel).write_text(text.replace(right, wrong))
    code, lines, out = grade(copy)
    assert code == 1 and sorted(lines) == sorted(EXERCISES), out
    for n, line in lines.items():
        assert "  FAILED  " in line and "NotImplementedError" not in line, line
        assert MISTAKES[n][3] in line.split("hint:")[1], line


def run_align(root, out, cache_dir, *extra):
    """Start a tiny align.py run in root; returns a function that waits for it -> (metrics, stdout)."""
    p = subprocess.Popen([sys.executable, "align.py", *TINY_RUN, "--cache-dir", str(cache_dir), "--out", str(out),
                          *extra], cwd=root, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         env=dict(os.environ, HF_HUB_OFFLINE="1"))

    def finish():
        stdout, stderr = p.communicate(timeout=900)
        assert p.returncode == 0, stderr[-3000:]
        assert "[done]" in stdout
        metrics = json.loads((out / "metrics.json").read_text())
        metrics["train"].pop("seconds")
        return metrics, stdout
    finish.process = p
    return finish


@pytest.mark.slow
def test_pasted_back_copy_passes_and_trains_the_paper_form_to_the_last_digit(student_copy, tmp_path, cache_dir):
    """The copy (no fast_cap.py) trains PAL through relative + cap: the reference's metrics with --hp fast=False;
    a cap that forgets the padding mask fails its grade there and changes the retrieval."""
    copy, no_mask = tmp_path / "solved", tmp_path / "no-mask"
    shutil.copytree(student_copy, copy)
    msc.paste_back(copy, ROOT)
    for rel in msc.project_files(copy):
        assert (copy / rel).read_bytes() == (ROOT / rel).read_bytes(), rel
    shutil.copytree(copy, no_mask)
    rel, right, wrong = NO_MASK
    text = (no_mask / rel).read_text()
    assert text.count(right) == 1
    (no_mask / rel).write_text(text.replace(right, wrong))
    runs = [run_align(copy, tmp_path / "copy-run", cache_dir),        # the three runs side by side
            run_align(ROOT, tmp_path / "ref-run", cache_dir, "--hp", "fast=False"),
            run_align(no_mask, tmp_path / "no-mask-run", cache_dir)]
    try:
        code, lines, out = grade(copy)
        assert code == 0 and len(lines) == len(EXERCISES), out
        code, lines, out = grade(no_mask, 3)
        assert code == 1 and "  FAILED  " in lines[3] and "padded" in lines[3], out
        (got, log), (want, _), (wrong_run, _) = [finish() for finish in runs]
    finally:
        for finish in runs:
            finish.process.kill()
    assert "[pal] CAP trains in the paper form, cap(relative(Z, A), mask, tau_p) (methods/fast_cap.py is not in " \
           "this copy)" in log.splitlines()
    assert got == want
    assert wrong_run["retrieval"]["rsum"] != want["retrieval"]["rsum"], (wrong_run["retrieval"], want["retrieval"])
