"""The course (exercises/): the markers agree with the table, and the grader has teeth.

The reference grades all passed; a fresh student copy grades all failed, naming each
exercise, while the rest of the project still imports; one classic mistake per
exercise, patched into a copy, fails with the hint naming it; the reference regions
pasted back grade as passed and align.py runs in that copy. Four grader calls in all
(each one pytest run of the table's node ids)."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "exercises"))
import make_student_copy as msc  # noqa: E402
from table import EXERCISES  # noqa: E402

# One classic mistake per exercise: (file, reference text, mistaken text, words of the hint that name it).
MISTAKES = {
    1: ("evaluate.py", "n_above[j] = ((rows >= g) & ~same).sum(1)", "n_above[j] = ((rows > g) & ~same).sum(1)",
        "ties ranked in favour of the truth"),
    2: ("methods/pal.py", "return (F.cross_entropy(logits, target) + F.cross_entropy(logits.T, target)) / 2",
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

def test_reference_grades_all_passed():
    code, lines, out = grade(ROOT)
    assert code == 0, out
    assert sorted(lines) == sorted(EXERCISES) and all("  passed  " in l for l in lines.values()), out


def test_student_copy_fails_every_exercise_and_the_rest_still_imports(student_copy):
    ref_files = msc.project_files(ROOT)
    assert msc.project_files(student_copy) == ref_files
    assert not (student_copy / "exercises" / "answers.md").exists()
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
        assert "  FAILED  " in line and f"NotImplementedError: Exercise {n} " in line, line


def test_classic_mistakes_fail_with_the_hint_that_names_them(tmp_path):
    copy = tmp_path / "mistakes"
    msc.make_copy(copy, only=set())                               # a verbatim copy
    for n, (rel, right, wrong, _) in MISTAKES.items():
        text = (copy / rel).read_text()
        assert text.count(right) == 1, (n, right)
        (copy / rel).write_text(text.replace(right, wrong))
    code, lines, out = grade(copy)
    assert code == 1 and sorted(lines) == sorted(EXERCISES), out
    for n, line in lines.items():
        assert "  FAILED  " in line and "NotImplementedError" not in line, line
        assert MISTAKES[n][3] in line.split("hint:")[1], line


def test_pasted_back_copy_passes_and_align_runs_in_it(student_copy, tmp_path, cache_dir):
    copy = tmp_path / "solved"
    shutil.copytree(student_copy, copy)
    msc.paste_back(copy, ROOT)
    for rel in msc.project_files(copy):
        assert (copy / rel).read_bytes() == (ROOT / rel).read_bytes(), rel
    code, lines, out = grade(copy)
    assert code == 0 and len(lines) == len(EXERCISES), out
    env = dict(os.environ, HF_HUB_OFFLINE="1")
    r = subprocess.run([sys.executable, "align.py", "--epochs", "1", "--eval-images", "50", "--threads", "1",
                        "--cache-dir", str(cache_dir), "--out", str(tmp_path / "run")],
                       cwd=copy, capture_output=True, text=True, timeout=900, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "run" / "metrics.json").exists() and "[done]" in r.stdout
