"""The course (exercises/): the markers agree with the table, and the grader has teeth.

The reference grades all passed; in a fresh student copy EVERY graded test of every exercise
fails, while the rest of the project still imports, no exercise's answer stands anywhere in
it, and align.py refuses a run that needs a blank exercise in one line; one classic mistake
per exercise, patched into a copy, fails with the hint naming it; a cap that forgets the
padding mask fails its grade and changes PAL's retrieval; the reference regions pasted back
grade as passed and align.py gives the reference's metrics there (its paper form: a copy's
methods/fast_cap.py is exercises/paper_cap.py). This file plants the answers, so it is not in a student copy."""
import builtins
import io
import json
import keyword
import os
import re
import shutil
import subprocess
import sys
import tokenize
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "exercises"))
import grade as grader  # noqa: E402
import make_student_copy as msc  # noqa: E402
import official  # noqa: E402
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
    6: ("methods/filip.py", "t2i = (best_region * w_ok[None]).sum(-1) / w_ok.sum(-1)[None].clamp_min(1)",
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
NO_MASK = ("methods/pal.py",
           """    R = R.masked_fill(~mask[..., None], 0.0)                                   # padding -> 0
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
            for n, start, end, _indent, words in msc.find_regions(text.split("\n"), str(rel)):
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
    ok = ("def f(x):\n    # EXERCISE 2 (Eq. 1): y = 2 x\n    #   shapes (B,)\n    y = 2 * x\n    return y\n"
          "    # END EXERCISE 2\n")
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
    results, broken, tail, _ = grader.run_tests(root, ids)
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


@pytest.mark.slow
def test_every_graded_test_fails_on_the_blank_copy(student_copy):
    """A test that passes with an exercise still blank checks nothing of the student's code."""
    for n, tests in graded_results(student_copy).items():
        for node, outcome, _msg in tests:
            assert outcome == "failed", f"exercise {n}: {node} passes with every exercise blank"


@pytest.mark.slow
def test_student_copy_fails_every_exercise_and_the_rest_still_imports(student_copy):
    ref_files = msc.project_files(ROOT)
    assert msc.project_files(student_copy) == ref_files
    for left_out in ("exercises/answers.md", "exercises/answers_template.md", "exercises/answers_figures.json",
                     "exercises/make_answers.py", "tests/test_answers.py", "tests/test_exercises.py"):
        assert (ROOT / left_out).exists() and not (student_copy / left_out).exists(), left_out
    assert (student_copy / "methods" / "fast_cap.py").read_bytes() == (ROOT / msc.PAPER_CAP).read_bytes()
    assert not any((student_copy / d).exists() for d in (".git", ".cache", "results"))
    for rel in ref_files:                                         # verbatim outside the regions
        ref, got = (ROOT / rel).read_bytes(), (student_copy / rel).read_bytes()
        if rel.suffix == ".py" and b"# EXERCISE" in ref:
            assert outside_regions(got.decode()) == outside_regions(ref.decode()), rel
            for n, s, e, indent, words in msc.find_regions(got.decode().split("\n")):
                raise_line = f"{indent}raise NotImplementedError({f'Exercise {n} {words}'!r})"
                assert got.decode().split("\n")[s:e] == [raise_line], rel
        elif rel.suffix == ".md" and msc.ANSWERS.search(ref.decode()):
            assert got.decode() == msc.without_answers(ref.decode()), rel
        elif rel == Path("tests/README.md"):                      # without the test files a copy does not hold
            assert got.decode() == msc.without_left_out(ref.decode()), rel
        else:
            assert got == ref, rel
    r = subprocess.run([sys.executable, "-c", "import align, data, encoders, evaluate, features, methods, recycling, "
                        "similarity; align.parse_args([])"], cwd=student_copy, capture_output=True, text=True,
                       timeout=300)
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
    from methods import METHODS
    for method in METHODS:
        need = table.run_needs(method)
        with pytest.raises(SystemExit) as e:
            table.refuse_blank_exercises(method, root=student_copy)
        assert str(e.value).startswith(f"error: --method {method} needs exercises {', '.join(map(str, need))}; "
                                       f"still blank: {', '.join(map(str, need))} ("), e.value
    assert {m: table.method_needs(m) for m in ("pal", "cov", "text_guided", "csa", "asif", "sail")} == {
        "pal": [2, 3], "cov": [2, 4, 5, 6], "text_guided": [2, 3, 6], "csa": [7], "asif": [12], "sail": []}
    assert table.run_needs("pal", analyses=True) == [1, 2, 3, 8, 9, 10, 13]
    r = subprocess.run([sys.executable, "align.py", "--method", "pal", "--cache-dir", str(student_copy / "no-cache")],
                       cwd=student_copy, capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and r.stdout == "", (r.stdout, r.stderr)
    assert r.stderr.strip().splitlines() == ["error: --method pal needs exercises 1, 2, 3, 10, 13; still blank: "
                                             "1, 2, 3, 10, 13 (finish them: python exercises/grade.py 1 2 3 10 13 "
                                             "says what is left; --skip-blank runs without the evaluations that "
                                             "need 1, 10, 13 (retrieval: 1, classification: 13, segmentation: 10 "
                                             "and 13))"], r.stderr
    assert "make_student_copy" not in r.stderr
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
        assert text.count(right) == 1, (n, right)
        (copy / rel).write_text(text.replace(right, wrong))
    code, lines, out = grade(copy)
    assert code == 1 and sorted(lines) == sorted(EXERCISES), out
    for n, line in lines.items():
        assert "  FAILED  " in line and "NotImplementedError" not in line, line
        assert MISTAKES[n][3] in line.split("hint:")[1], line
    # seeded tests: exercise 3 graded alone, at the grade's seed, reports each failing check with the same numbers
    seed = re.search(r"\(seed (\d+)\)", out)[1]
    alone = grade(copy, 3, "--seed", seed)[2].splitlines()
    checks = lambda lines: [l for l in lines if l.startswith("    ")]
    block = out.splitlines()[out.splitlines().index(lines[3]):]
    assert checks(alone) and checks(alone) == checks(block)[:len(checks(alone))], (alone, block)


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
    """The copy (its fast_cap.py the paper form) trains PAL through relative + cap: the reference's metrics with
    --hp fast=False; a cap that forgets the padding mask fails its grade there and changes the retrieval."""
    copy, no_mask = tmp_path / "solved", tmp_path / "no-mask"
    shutil.copytree(student_copy, copy)
    msc.paste_back(copy, ROOT)
    for rel in msc.project_files(copy):                       # the reference, less the docs' answers
        ref = (ROOT / rel).read_bytes()
        if rel.suffix == ".md" and msc.ANSWERS.search(ref.decode()):
            ref = msc.without_answers(ref.decode()).encode()
        if rel == Path("tests/README.md"):
            ref = msc.without_left_out(ref.decode()).encode()
        assert (copy / rel).read_bytes() == ref, rel
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
        # one line per failing check: the padding test's own message is not hidden behind the first failure
        assert re.search(r"^    test_pooling_matches_naive_loop\[cap\]: image p ", out, re.M), out
        assert re.search(r"^    test_padding_does_not_change_h\[cap\]: .*padded tokens must get weight 0$", out,
                         re.M), out
        (got, log), (want, _), (wrong_run, _) = [finish() for finish in runs]
    finally:
        for finish in runs:
            finish.process.kill()
    assert "[fast_cap] CAP trains in the paper form, cap(relative(Z, A), mask, tau_p) (methods/fast_cap.py is not " \
           "in this copy)" in log.splitlines()
    assert got == want
    assert wrong_run["retrieval"]["rsum"] != want["retrieval"]["rsum"], (wrong_run["retrieval"], want["retrieval"])


# ----------------------------------------------------------------------------- the course as a class runs it

KEEP_NAMES = set(keyword.kwlist) | set(dir(builtins)) | {"torch", "F", "nn", "math", "self"}
# idioms that give nothing away (the marker text names them): zeroing padding, the diagonal targets
IDIOMS = {"_.masked_fill(~_[...,None],0.0)", "torch.arange(len(_),_=_.device)"}


def code_shape(line):
    """A code line as its computation: the names a writer chooses (variables, arguments) become `_`, an
    assignment's target and a `return` are dropped; attributes, torch calls, keywords and literals stay. Two
    lines that differ only in naming have the same shape."""
    try:
        toks = list(tokenize.generate_tokens(io.StringIO(line.strip()).readline))
    except (tokenize.TokenError, IndentationError, SyntaxError):
        return ""
    out, prev = [], None
    for t in toks:
        if t.type in (tokenize.COMMENT, tokenize.NEWLINE, tokenize.NL, tokenize.ENDMARKER, tokenize.INDENT,
                      tokenize.DEDENT):
            continue
        out.append("_" if t.type == tokenize.NAME and t.string not in KEEP_NAMES and prev != "." else t.string)
        prev = t.string
    text = "".join(out)
    text = re.sub(r"^return", "", text)
    return re.sub(r"^[_,()]+=(?!=)", "", text)                # `a, b = ...` -> `...`


def test_code_shape_sees_through_renaming():
    assert code_shape("t2i = (best_region * w_ok[None]).sum(-1) / w_ok.sum(-1)[None].clamp_min(1)") == \
        code_shape("    return (cos * real[None]).sum(-1) / real.sum(-1)[None].clamp_min(1)  # Eq. (3)")
    assert code_shape("a = x.softmax(dim=1)") != code_shape("a = x.softmax(dim=2)")
    assert code_shape("y = F.normalize(x, dim=-1)") != code_shape("y = F.normalize(x, dim=0)")


def test_no_answer_stands_renamed_outside_its_region():
    """Every region line of 30+ characters, as its computation (code_shape), appears in no line outside the
    regions of a file a student copy holds: a copy keeps every such line verbatim."""
    answers, outside = {}, []
    for rel in msc.project_files(ROOT):
        if rel.suffix != ".py" or str(rel) in ("methods/fast_cap.py", "tests/test_exercises.py"):
            continue                                          # (neither is in a copy)
        lines = (ROOT / rel).read_text().split("\n")
        inside = set()
        for n, start, end, _, _ in (msc.find_regions(lines, str(rel)) if "# EXERCISE" in "\n".join(lines) else []):
            for i in range(start, end):
                inside.add(i)
                if len(code_shape(lines[i])) >= 30:
                    answers.setdefault(code_shape(lines[i]), (n, f"{rel}:{i + 1}"))
        if not str(rel).startswith("tests/"):               # the tests hold naive loops, not the answers' lines
            outside += [(f"{rel}:{i + 1}", code_shape(l)) for i, l in enumerate(lines) if i not in inside]
    assert len(answers) > 40
    leaks = [f"{where} computes exercise {answers[k][0]}'s {answers[k][1]}" for where, k in outside
             if k in answers and k not in IDIOMS]
    assert not leaks, leaks


CALLABLE_PROBE = """
import torch, similarity
from features import Features
from methods.filip import FILIP
from methods.text_guided import text_guided_score
g = torch.Generator().manual_seed(0)
X, Y = torch.randn(20, 6, generator=g), torch.randn(20, 5, generator=g)
def knn(X, k):  # exercise 9's first half, as a student who has written it
    Xn = torch.nn.functional.normalize(X, dim=-1)
    return (Xn @ Xn.T).fill_diagonal_(float("-inf")).topk(k, dim=1).indices
similarity.knn_indices = knn
def probe(name, f):
    try:
        f()
        print(name, "ANSWERS")
    except NotImplementedError as e:
        print(name, str(e).split()[1])
probe("mutual_knn_table", lambda: similarity.mutual_knn_table({0: X}, {0: Y}, 3))
def feats(B, T, D, grid=None):
    tokens = torch.randn(B, T, D, generator=g)
    return Features(tokens=tokens, mask=torch.ones(B, T, dtype=torch.bool), pooled=tokens.mean(1), grid=grid)
img, txt = feats(4, 5, 8, grid=(2, 2)), feats(4, 3, 6)
m = FILIP(8, 6, K=4)
import methods.filip as mf
mf.token_max = lambda r, w: (r.mean(1) @ w.mean(1).T,) * 2    # exercise 6 done (any form)
probe("FILIP.loss", lambda: m.loss(img, txt))
v, w = torch.randn(3, 4, 5, generator=g), torch.randn(2, 3, 5, generator=g)
import methods.text_guided as mt
def cap(R, mask, tau):  # exercise 3 done (TextGuided pools with it)
    a = (R / tau).masked_fill(~mask[..., None], float("-inf")).softmax(1)
    return (a * R).sum(1), a
mt.cap = cap
probe("text_guided_score", lambda: text_guided_score(v, w, 0.1))
"""


@pytest.mark.slow
def test_no_function_outside_a_region_answers_an_exercise(student_copy):
    """In a blank copy, with the other exercises done, the functions that compute an answer's math reach the
    blank region instead of computing it themselves."""
    r = subprocess.run([sys.executable, "-c", CALLABLE_PROBE], cwd=student_copy, capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr
    assert r.stdout.split("\n")[:3] == ["mutual_knn_table 9", "FILIP.loss 2", "text_guided_score 6"], r.stdout


def planted_commented_raise(copy):
    """exercise 3's cap in a verbatim copy with a commented-out raise above its finished body."""
    pal = copy / "methods" / "pal.py"
    text = pal.read_text()
    anchor = "    R = R.masked_fill(~mask[..., None], 0.0)"
    assert text.count(anchor) == 1
    pal.write_text(text.replace(anchor, "    # raise NotImplementedError('Exercise 3 (PAL Eq. 5-6): ...')\n" + anchor))


def test_a_commented_out_raise_above_a_finished_body_is_not_blank(tmp_path):
    copy = tmp_path / "done"
    msc.make_copy(copy, only=set())
    planted_commented_raise(copy)
    assert table.blank_exercises(copy) == set()
    table.refuse_blank_exercises("pal", root=copy)          # nothing blank: silent
    msc.make_copy(tmp_path / "blank3", only={3})
    assert table.blank_exercises(tmp_path / "blank3") == {3}


def test_the_refusal_says_finish_it_and_skip_blank_leaves_out_only_the_evaluation(tmp_path):
    msc.make_copy(tmp_path / "only3", only={3})
    assert json.loads((tmp_path / "only3" / "exercises" / "this_copy.json").read_text()) == {
        "blanked": [3], "course": official.course_version()}
    with pytest.raises(SystemExit) as e:
        table.refuse_blank_exercises("pal", root=tmp_path / "only3")
    assert str(e.value) == ("error: --method pal needs exercises 1, 2, 3, 10, 13; still blank: 3 (finish it: "
                            "python exercises/grade.py 3 says what is left)")
    with pytest.raises(SystemExit, match="still blank: 3 "):          # the method's own: --skip-blank is no way out
        table.refuse_blank_exercises("pal", root=tmp_path / "only3", skip_blank=True)
    msc.make_copy(tmp_path / "eval", only={1, 10, 13})              # PAL's own done, the metrics not
    with pytest.raises(SystemExit, match=r"still blank: 1, 10, 13 .*--skip-blank runs without"):
        table.refuse_blank_exercises("pal", root=tmp_path / "eval")
    table.refuse_blank_exercises("pal", root=tmp_path / "eval", skip_blank=True)   # runs
    msc.make_copy(tmp_path / "only8", only={8})                     # --analyses' exercise: never skipped
    with pytest.raises(SystemExit, match=r"still blank: 8 "):
        table.refuse_blank_exercises("pal", analyses=True, root=tmp_path / "only8", skip_blank=True)


def test_make_student_copy_refuses_inside_a_copy(tmp_path):
    copy = tmp_path / "copy"
    msc.make_copy(copy)
    r = subprocess.run([sys.executable, "exercises/make_student_copy.py", str(tmp_path / "again"), "--only", "2"],
                       cwd=copy, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and r.stdout == "", r
    assert r.stderr.strip().splitlines() == ["error: this is a student copy, not the reference checkout: a copy is "
                                             "made from the reference only"], r.stderr
    assert not (tmp_path / "again").exists()
    said = [str(rel) for rel in msc.project_files(copy) if rel.suffix in (".py", ".md") and str(rel) !=
            "exercises/make_student_copy.py" and re.search(r"python exercises/make_student_copy\.py|make_student_copy"
                                                           r"\.py (DIR|~|\S+ --only)", (copy / rel).read_text())]
    assert not said, f"files of a copy that suggest make_student_copy.py: {said}"
    for word in ("instructor, in", "--only", "tests/test_exercises.py", "course_references", "shared cache"):
        assert word not in (copy / "exercises" / "README.md").read_text(), word


def test_every_test_starts_from_the_same_random_state():
    """tests/conftest.py seeds torch's generator before each test: a test alone and under the grader draw the same."""
    assert torch.equal(torch.rand(4), torch.rand(4, generator=torch.Generator().manual_seed(0)))


def sheet_rows():
    """{exercise: {column: cell}} of the sheet's table of coding exercises."""
    sheet = (ROOT / "exercises" / "README.md").read_text()
    rows = [l for l in sheet.split("## The coding exercises")[1].split("###")[0].splitlines() if l.startswith("|")]
    head = [c.strip() for c in rows[0].strip("|").split("|")]
    return {int(cells[0]): dict(zip(head, cells)) for r in rows[2:]
            if (cells := [c.strip() for c in r.strip("|").split("|")])}


def test_the_sheet_gives_each_exercise_its_needs_and_time_and_an_order_that_keeps_them():
    rows = sheet_rows()
    assert sorted(rows) == sorted(EXERCISES)
    for n, row in rows.items():
        needs = sorted(int(x) for x in re.findall(r"\d+", row["needs"]))
        assert needs == sorted(table.DEPENDS.get(n, [])), (n, row["needs"])
        assert re.fullmatch(r"[\d.]+(-[\d.]+)? (h|min)", row["time"]), (n, row["time"])
    sheet = (ROOT / "exercises" / "README.md").read_text()
    days = [l for l in sheet.split("## A two-week module")[1].splitlines() if re.match(r"\| \d+ \|", l)]
    day_of = {}
    for d, line in enumerate(days):
        if m := re.search(r"\bexercises? (\d+(?:(?:, then |, | and )\d+)*)", line.split("|")[2]):
            for n in map(int, re.findall(r"\d+", m[1])):
                day_of.setdefault(n, d)
    assert sorted(day_of) == sorted(EXERCISES)
    for n, deps in table.DEPENDS.items():
        assert all(day_of[m] <= day_of[n] for m in deps), (n, deps, day_of)
    assert "In a student copy" in sheet or "**Tests in a student copy.**" in sheet
    assert "python exercises/grade.py" in sheet.split("**Tests in a student copy.**")[1].split("\n\n")[0]


def experiment_sections():
    """{"E1": its text, ...} of the sheet's experiments."""
    sheet = (ROOT / "exercises" / "README.md").read_text().split("## Experiments")[1].split("## A two-week")[0]
    return {m[1]: m[2] for m in re.finditer(r"\*\*(E\d)\.(.*?)(?=\*\*E\d\.|\Z)", sheet, re.S)}


def test_each_experiment_says_every_exercise_its_runs_need_and_e1_one_schedule():
    """"(after exercises ...)" lists what its align.py runs execute (table.run_needs: the method's and the
    evaluation's); E1's three runs train the same --epochs."""
    sections = experiment_sections()
    assert sorted(sections) == [f"E{i}" for i in range(1, 7)]
    for e, text in sections.items():
        runs = re.findall(r"python align\.py ([^`\n]*)", text)
        if not runs:
            continue
        methods = {m for r in runs for m in re.findall(r"--method (\w+)", r)} or {"pal"}
        need = sorted(set().union(*(table.run_needs(m, "--analyses" in text) for m in methods)))
        label = re.search(r"\(after exercises? ([\d, ]+)[;)]", text)
        assert label and sorted(map(int, re.findall(r"\d+", label[1]))) == need, (e, label and label[0], need)
    e1 = re.findall(r"^python align\.py .*$", sections["E1"], re.M)
    assert len(e1) == 3 and len({re.search(r"--epochs (\d+)", r)[1] for r in e1}) == 1, e1


def test_the_experiments_give_each_run_its_own_out_folder():
    sheet = (ROOT / "exercises" / "README.md").read_text()
    for e in ("E1", "E2", "E3"):
        part = sheet.split(f"**{e}.")[1].split("**E")[0]
        runs = re.findall(r"^python align\.py .*$", part, re.M)
        assert len(runs) == 3, (e, runs)
        outs = [re.search(r"--out (\S+)", r) for r in runs]
        assert all(outs) and len({o[1] for o in outs}) == 3, (e, runs)


@pytest.mark.slow
def test_a_correct_exercise_is_blocked_not_failed_by_a_blank_one_it_needs(tmp_path):
    """Exercise 2 is the reference in a copy blanking only 3, but its gradient check trains PAL through cap."""
    msc.make_copy(tmp_path / "only3", only={3})
    code, lines, out = grade(tmp_path / "only3", 2, 3, 11)
    assert code == 1, out
    assert "  BLOCKED  " in lines[2] and "blocked by exercise 3: " in lines[2] and "NotImplementedError" not in out
    assert "  FAILED  " in lines[3] and "still blank" in lines[3]
    assert "  passed  " in lines[11]


@pytest.mark.slow
def test_the_needs_column_is_what_grading_finds(tmp_path):
    """For each exercise m: in a copy blanking only m, exactly the exercises that need m are not passed."""
    found = {}
    for m in sorted(EXERCISES):
        msc.make_copy(tmp_path / f"only{m}", only={m})
        report, _, _ = grader.grade(tmp_path / f"only{m}", [n for n in EXERCISES if n != m])
        for n, ok, lines in report:
            if not ok:
                assert f"blocked by exercise {m}" in lines[0] or f"blocked by exercise {m}" in "\n".join(lines), lines
                found.setdefault(n, []).append(m)
    assert found == {n: sorted(d) for n, d in table.DEPENDS.items()}


# ----------------------------------------------------------------------------- grading against the references

def reference_cases():
    """(exercise, name, the project's function, its reference, inputs as a function) for every reference."""
    import course_references as cr
    from conftest import random_features

    from methods.cov import CoV
    g = torch.Generator().manual_seed(1)
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64, requires_grad=True)
    mask = torch.tensor([[True] * 5, [True, True, True, False, False], [True] * 4 + [False]])
    w = torch.randn(3, 4, 6, generator=g, dtype=torch.float64)
    w[1, 2:] = 0                                                              # padded words
    r = torch.randn(2, 5, 6, generator=g, dtype=torch.float64)
    r[0, 4] = 0                                                               # a padded region
    cov = CoV(8, 6, dim=16, n_regions=4, eps=0.5, mask="scores_renorm", n_heads=2, n_points=2).double()  # exercise 5's
    img = random_features(3, 9 + 1, 8, grid=(3, 3)).to("cpu", torch.float64)
    import evaluate
    import methods.cov as mc
    import methods.filip as mf
    import methods.losses as ml
    import methods.pal as mp
    import methods.text_guided as mt

    class Global:  # the smallest method a class_logits call needs
        def score(self, a, b):
            return a @ b.T
    cases = [(2, "info_nce", ml.info_nce, cr.info_nce, lambda: (rnd(4, 6), rnd(4, 6), 0.1)),
             (2, "info_nce_of_logits", ml.info_nce_of_logits, cr.info_nce_of_logits, lambda: (rnd(4, 4),)),
             (2, "info_nce_of_logits (two)", ml.info_nce_of_logits, cr.info_nce_of_logits,
              lambda: (rnd(4, 4), rnd(4, 4))),
             (3, "relative", mp.relative, cr.relative, lambda: (rnd(3, 5, 6), rnd(4, 6))),
             (3, "cap", mp.cap, cr.cap, lambda: (rnd(3, 5, 4), mask, 0.1)),
             (4, "deformable_sample", mc.deformable_sample, cr.deformable_sample,
              lambda: (rnd(2, 2, 3, 4, 5), (torch.rand(2, 3, 2, 4, 2, generator=g, dtype=torch.float64) * 1.4 - 0.2)
                       .requires_grad_(), rnd(2, 3, 2, 4))),
             (5, "threshold_mask", mc.threshold_mask, cr.threshold_mask,
              lambda: (rnd(2, 3, 7) * 10, 0.5)),
             (5, "CoV.regions", lambda i: CoV.regions(cov, i), lambda i: cr.regions(cov, i), lambda: (img,)),
             (5, "CoV.spread", CoV.spread, cr.spread, lambda: (rnd(2, 3, 12).softmax(-1), (3, 4))),
             (6, "token_max", mf.token_max, cr.max_mean,
              lambda: (r.clone().requires_grad_(), w.clone().requires_grad_())),
             (6, "real_word_mean", mt.real_word_mean, cr.real_word_mean, lambda: (rnd(2, 3, 4), w)),
             (13, "template_average", evaluate.template_average, cr.template_average, lambda: (rnd(6, 5), 3)),
             (13, "class_logits", evaluate.class_logits, cr.class_logits,
              lambda: (Global(), torch.randn(4, 5, generator=g), torch.randn(2, 5, generator=g), 3))]
    assert {n for n, *_ in cases} == set(cr.REFERENCES)
    return cases


def test_each_reference_is_the_reference_code_in_values_and_gradients():
    """tests/course_references.py, what grade.py puts in place of a student's dependency, computes what the
    project's own regions compute, forward and backward."""
    for n, name, ours, ref, inputs in reference_cases():
        torch.manual_seed(0)
        args = inputs()
        got, want = ref(*args), ours(*args)
        got, want = (got if isinstance(got, tuple) else (got,)), (want if isinstance(want, tuple) else (want,))
        for a, b in zip(got, want):
            torch.testing.assert_close(a, b, msg=lambda m, n=n, name=name: f"exercise {n}'s {name}: {m}")
        leaves = [a for a in args if isinstance(a, torch.Tensor) and a.requires_grad]
        if leaves and got[0].requires_grad:
            for a, b in zip(torch.autograd.grad(got[0].sum(), leaves), torch.autograd.grad(want[0].sum(), leaves)):
                torch.testing.assert_close(a, b, msg=lambda m, n=n, name=name: f"exercise {n}'s {name}, gradient: {m}")


WRONG_CAP = ("methods/pal.py", "alpha = logits.softmax(dim=1)", "alpha = logits.softmax(dim=2)")


@pytest.mark.slow
def test_a_wrong_dependency_is_graded_as_its_own_exercise(tmp_path):
    """A cap with the softmax over the anchors fails exercise 3; exercise 2, whose tests run cap too, is graded
    with the reference cap: passed, saying the student's own cap also breaks it; exercise 6 (FILIP's max-sum,
    TextGuided's own softmax) never runs cap and passes as it is. A blank cap blocks exercise 2."""
    copy = tmp_path / "wrong-cap"
    msc.make_copy(copy, only=set())
    rel, right, wrong = WRONG_CAP
    text = (copy / rel).read_text()
    assert text.count(right) == 1
    (copy / rel).write_text(text.replace(right, wrong))
    code, lines, out = grade(copy, 2, 3, 6)
    assert code == 1, out
    assert "  FAILED  " in lines[3] and "softmax over the anchors" in lines[3], out
    assert "  passed  " in lines[2] and "also fails with your exercise 3: " in lines[2], out
    assert "  passed  " in lines[6], out                    # (TextGuided pools with cap: graded with the reference)
    # the copy's own grader has no references: exercise 2 fails, and says its checks run a failing exercise 3
    r = subprocess.run([sys.executable, "exercises/grade.py", "2"], cwd=copy, capture_output=True, text=True,
                       timeout=600)
    shutil.rmtree(copy / "tests" / "__pycache__", ignore_errors=True)
    msg = "    these checks also run your exercise 3, which fails its own checks: the fault may be there " \
          "(python exercises/grade.py 3)"
    assert r.returncode == 1 and msg in r.stdout.splitlines(), r.stdout
    msc.make_copy(tmp_path / "only3", only={3})
    code, lines, out = grade(tmp_path / "only3", 2)
    assert "  BLOCKED  " in lines[2] and "blocked by exercise 3: " in lines[2], out


# ----------------------------------------------------------------------------- a run of other code keeps its own folder

def test_the_identity_holds_the_method_code_and_only_its_own(tmp_path, monkeypatch):
    """config.json's identity holds method_code: a hash of the method's own file and the shared files of methods/
    it imports. A byte changed in csa.py changes CSA's, and not PAL's: another method's file is not CSA's code."""
    from infra.run import method_code
    from methods import csa, pal
    csa_before, pal_before = method_code(csa.CSA), method_code(pal.PAL)
    copy = tmp_path / "csa.py"
    copy.write_text(Path(csa.__file__).read_text() + "\n")
    monkeypatch.setattr(csa, "__file__", str(copy))
    assert method_code(csa.CSA) != csa_before and method_code(pal.PAL) == pal_before


# ----------------------------------------------------------------------------- what a failing check says

def graded_assertions():
    """(exercise, "file:line", the assertion's message source or the call) of every check in the graded tests."""
    import ast
    seen, out = set(), []
    for n, ex in EXERCISES.items():
        for node_id in ex["tests"]:
            path, name = node_id.split("::")
            if (path, name.split("[")[0]) in seen:
                continue
            seen.add((path, name.split("[")[0]))
            tree = ast.parse((ROOT / path).read_text())
            fn = next(f for f in ast.walk(tree) if isinstance(f, ast.FunctionDef) and f.name == name.split("[")[0])
            for node in ast.walk(fn):
                if isinstance(node, ast.Assert):
                    out.append((n, f"{path}:{node.lineno}", ast.unparse(node.msg) if node.msg else ""))
                elif isinstance(node, ast.Call) and ast.unparse(node.func) in ("pytest.raises", "assert_same", "want",
                                                                                "torch.testing.assert_close"):
                    out.append((n, f"{path}:{node.lineno}", ast.unparse(node.func)))
    return out


def test_every_graded_check_names_the_expected_value():
    """Each assertion of a graded test carries a message saying what was expected (exercises/grade.py prints its
    first line); assert_same and want say "expected" themselves; pytest.raises ("DID NOT RAISE") and a bare
    assert_close are not used there."""
    checks = graded_assertions()
    assert len(checks) > 100
    bad = [(n, where, msg) for n, where, msg in checks
           if msg in ("pytest.raises", "torch.testing.assert_close") or
           (msg not in ("assert_same", "want") and not re.search(r"\bexpected\b", msg))]
    assert not bad, bad
    from conftest import assert_same
    with pytest.raises(AssertionError, match=r"x: 1 of 2 entries differ, by up to 1 \(at \[1\]: 3, expected 2\)"):
        assert_same(torch.tensor([1.0, 3.0]), torch.tensor([1.0, 2.0]), "x")


def marker_text(n):
    """The words of exercise n's markers, all its regions together."""
    words = []
    for rel in EXERCISES[n]["regions"]:
        words += [t for m, *_, t in msc.find_regions((ROOT / rel).read_text().split("\n")) if m == n]
    return " ".join(words)


def test_what_the_tests_require_is_in_the_markers():
    """The requirements a graded test checks beyond the equation are in the marker a student reads."""
    assert "raise ValueError" in marker_text(10) and "outside 0..C-1" in marker_text(10)
    assert all(k in marker_text(8) for k in ("linear_top1", "cosine_top1", "nobias_top1"))
    assert "N - 1" in marker_text(7) and "torch.cov" in marker_text(7) and "same CCA" not in marker_text(7)
    assert "each class's row w_i" in EXERCISES[8]["hint"] and "dim -1" not in EXERCISES[8]["hint"]


def test_hints_name_the_symptom_not_the_line():
    """No hint writes the fix as code: no -inf to set, no formula to type, no keyword argument to pass."""
    lines = ("fill_diagonal", "-inf", "A = L_x^-T U", "align_corners=False", "normalise, average, normalise again",
             "dim=", "masked_fill")
    found = [(n, w) for n, ex in EXERCISES.items() for w in lines if w in ex["hint"]]
    assert not found, found


# ----------------------------------------------------------------------------- the copy an instructor hands out

def test_the_copy_to_hand_out_is_an_archive_without_the_answers(tmp_path):
    import tarfile
    archive = tmp_path / "course.tar.gz"
    blanked = msc.make_archive(archive, only={3})
    assert blanked == {3: 2}
    with tarfile.open(archive) as tar:
        names = tar.getnames()
        assert names and all(n == "course" or n.startswith("course/") for n in names), names[:5]
        files = {n[len("course/"):] for n in names if tar.getmember(n).isfile()}
        results = tar.extractfile("course/docs/results.md").read().decode()
        pal = tar.extractfile("course/methods/pal.py").read().decode()
    assert files == {str(rel) for rel in msc.project_files(ROOT)} | {"exercises/this_copy.json", "methods/fast_cap.py"}
    for left_out in ("exercises/answers.md", "exercises/answers_template.md", "exercises/make_answers.py",
                     "tests/test_answers.py", "tests/test_exercises.py", "tests/course_references.py",
                     "tests/oracles.py", "exercises/make_goldens.py", "exercises/INSTRUCTOR.md"):
        assert left_out not in files, left_out
    assert "raise NotImplementedError('Exercise 3" in pal
    # the docs' part that answers E3 (and links to answers.md) is one line saying it is left out
    ref = (ROOT / "docs" / "results.md").read_text()
    assert "## Defaults chosen on held-out pairs" in ref
    assert "## Defaults chosen on held-out pairs" not in results and "answers.md" not in results
    assert "Left out of the student copy: this part answers experiment E3" in results
    assert results.replace(msc.without_answers(ref), "") == ""
    with pytest.raises(SystemExit, match="exists"):
        msc.make_archive(archive)                                  # a copy handed out is never overwritten
    shipped = [p for p in msc.project_files(ROOT) if p.suffix == ".md"]
    answers_in = [str(p) for p in shipped if "answers.md" in msc.without_answers((ROOT / p).read_text())
                  and str(p) != "exercises/README.md"]
    assert not answers_in, f"docs in a copy that point to exercises/answers.md: {answers_in}"


@pytest.mark.slow
def test_a_rerun_after_changing_the_method_code_never_replaces_the_old_results(tmp_path, cache_dir):
    """The sheet's rule, end to end: CSA's run in a copy, a method file changed, the same command again: refused
    before it writes, the first results as they were; into a new --out it runs, and config.json's identity
    tells the two runs' code apart."""
    copy = tmp_path / "copy"
    msc.make_copy(copy, only=set())
    cmd = lambda out: [sys.executable, "align.py", "--method", "csa", *TINY_RUN, "--cache-dir", str(cache_dir),
                       "--out", str(out)]
    run = lambda out: subprocess.run(cmd(out), cwd=copy, capture_output=True, text=True, timeout=900)
    r = run(tmp_path / "first")
    assert r.returncode == 0, r.stderr[-2000:]
    first = json.loads((tmp_path / "first" / "config.json").read_text())["identity"]["method_code"]
    metrics = (tmp_path / "first" / "metrics.json").read_bytes()
    csa = copy / "methods" / "csa.py"
    csa.write_text(csa.read_text().replace("x = X[i:i + chunk].double() - mu_x", "x = X[i:i + chunk].double() - mu_x "))
    r = run(tmp_path / "first")
    assert r.returncode == 1 and "holds a finished run; results are never replaced" in r.stderr, r.stderr[-2000:]
    assert (tmp_path / "first" / "metrics.json").read_bytes() == metrics
    r = run(tmp_path / "second")
    assert r.returncode == 0, r.stderr[-2000:]
    assert json.loads((tmp_path / "second" / "config.json").read_text())["identity"]["method_code"] != first


# ----------------------------------------------------------------------------- the archive computes no answer

ARCHIVE_PROBE = r'''
"""In an unpacked archive: import every module, call every function on each exercise's planted inputs, print one
line per call whose value is that exercise's answer: `ANSWER <exercise> <module>.<function>`."""
import copy, importlib, inspect, signal, sys, time, warnings
from pathlib import Path
import torch
root = Path.cwd()
sys.path[:0] = [str(root), str(root / "tests"), str(root / "exercises")]
warnings.simplefilter("ignore")
cases = torch.load(sys.argv[1], weights_only=False)         # [(exercise, args, expected)]

def alarm(*_):
    raise TimeoutError
signal.signal(signal.SIGALRM, alarm)


class NoSubprocess:                                  # a helper that starts a run is no answer: refuse it quickly
    def __init__(self, *a, **kw):
        raise OSError("no subprocess in the probe")


import os, subprocess                                # noqa: E401
subprocess.Popen = NoSubprocess
os.system = os.execv = os.execve = os.fork = NoSubprocess

def as_tensor(x):
    if isinstance(x, torch.Tensor):
        return x.detach().double()
    if isinstance(x, (int, float)) and not isinstance(x, bool):
        return torch.tensor(float(x), dtype=torch.float64)
    if isinstance(x, (list, tuple)) and x and all(isinstance(v, (int, float)) for v in x):
        return torch.tensor(x, dtype=torch.float64)
    return None

def same(got, want):
    if isinstance(want, dict):
        return isinstance(got, dict) and got.keys() >= want.keys() and all(same(got[k], v) for k, v in want.items())
    g, w = as_tensor(got), as_tensor(want)
    if w is None or g is None or g.shape != w.shape:
        return False
    if w.dtype == torch.float64 and w.numel() and not torch.isfinite(w).all():
        return False
    return bool(torch.allclose(g, w, rtol=1e-4, atol=1e-5))

def answers(out, want):
    outs = [out] + (list(out) if isinstance(out, (tuple, list)) and len(out) <= 5 else [])
    return any(same(o, want) for o in outs)

modules = []
for path in sorted(root.rglob("*.py")):
    rel = path.relative_to(root)
    if any(p.startswith(".") or p in ("results", "__pycache__") for p in rel.parts):
        continue
    package = (root / rel.parts[0] / "__init__.py").is_file() and len(rel.parts) > 1
    if package:                                                   # methods/asif.py -> methods.asif
        name = ".".join(rel.with_suffix("").parts).removesuffix(".__init__")
    else:                                                         # align.py, tests/test_x.py, exercises/grade.py
        sys.path.insert(1, str(path.parent))
        name = path.stem
    t0 = time.time()
    try:
        signal.alarm(20)
        mod = importlib.import_module(name)
        signal.alarm(0)
        modules.append((str(rel), mod))
    except BaseException as e:
        signal.alarm(0)
        print("NOIMPORT", rel, type(e).__name__, str(e)[:200])
    if time.time() - t0 > 2:
        print("SLOWIMPORT", rel, f"{time.time() - t0:.1f}s")


def functions(mod):
    for key, obj in vars(mod).items():
        if inspect.isfunction(obj) and obj.__module__ == mod.__name__ and not key.startswith("test_"):
            yield key, obj
        elif inspect.isclass(obj) and obj.__module__ == mod.__name__:
            for attr, f in vars(obj).items():
                if isinstance(f, staticmethod):
                    yield f"{key}.{attr}", f.__func__

n_calls = 0
for rel, mod in modules:
    for key, f in list(functions(mod)):
        if key in ("main", "cli") or key.startswith("_"):
            continue
        try:
            sig = inspect.signature(f)
        except (TypeError, ValueError):
            continue
        for n, args, want in cases:
            try:
                sig.bind(*args)
            except TypeError:
                continue
            t0 = time.time()
            try:
                signal.alarm(3)
                out = f(*copy.deepcopy(args))
                signal.alarm(0)
                n_calls += 1
            except BaseException:
                signal.alarm(0)
                continue
            finally:
                if time.time() - t0 > 1:
                    print("SLOWCALL", rel, key, n, f"{time.time() - t0:.1f}s")
            if answers(out, want):
                print("ANSWER", n, f"{rel}:{key}", flush=True)
print("CALLS", n_calls)
'''


def planted_cases():
    """[(exercise, planted inputs, the reference's answer)], in the signatures of the exercises' functions and of
    the loop forms a test could hold (one sample, lists of floats, (C, H, W) logits)."""
    import torch.nn.functional as F

    import evaluate
    import recycling
    import similarity
    from methods import cov, filip, losses, pal, structure, text_guided
    from methods.asif import ASIF
    from methods.csa import cca, covariances
    g = torch.Generator().manual_seed(0)
    r = lambda *s: torch.randn(*s, generator=g)
    cases = []
    S, t2i = r(6, 12), torch.arange(6).repeat_interleave(2)[torch.randperm(12, generator=g)]
    cases.append((1, (S, t2i), evaluate.retrieval_metrics(S, t2i)))
    hv, hl, logits = F.normalize(r(5, 4), dim=-1), F.normalize(r(5, 4), dim=-1), r(5, 5)
    cases += [(2, (hv, hl, 0.1), losses.info_nce(hv, hl, 0.1)), (2, (logits,), losses.info_nce_of_logits(logits))]
    Z, A, mask = r(3, 5, 4), r(6, 4), torch.tensor([[1, 1, 1, 1, 1], [1, 1, 0, 0, 0], [1, 0, 0, 0, 0]]).bool()
    R = pal.relative(Z, A)
    cases += [(3, (Z, A), R), (3, (R, mask, 0.3), pal.cap(R, mask, 0.3)[0]),
              (3, (Z[0], A), pal.relative(Z[:1], A)[0]),
              (3, (Z[1], mask[1], A, 0.3, "cap"), pal.cap(R, mask, 0.3)[0][1])]
    value, loc, Aw = r(2, 2, 3, 4, 5), torch.rand(2, 3, 2, 4, 2, generator=g), torch.rand(2, 3, 2, 4, generator=g)
    cases.append((4, (value, loc, Aw), cov.deformable_sample(value, loc, Aw)))
    lg, att = r(2, 3, 7) * 3, r(2, 3, 16).softmax(-1)
    cases += [(5, (lg, 0.6), cov.threshold_mask(lg, 0.6)),
              (5, (lg[0, 0].tolist(), 0.6), cov.threshold_mask(lg, 0.6)[0, 0]),
              (5, (att, (4, 4)), cov.CoV.spread(att, (4, 4))), (5, (att[0], 4, 4), cov.CoV.spread(att, (4, 4))[0])]
    rr, ww = r(3, 4, 5), r(2, 3, 5)
    rr[0, 3], ww[1, 2] = 0, 0
    x = r(3, 2, 3)
    cases += [(6, (rr, ww), filip.token_max(rr, ww)[0]), (6, (rr, ww), cov.max_sum(rr, ww)),
              (6, (x, ww), text_guided.real_word_mean(x, ww))]
    X, Y = r(30, 4), r(30, 3)
    cov_ref = covariances(X, Y)
    cases += [(7, (X, Y), cov_ref[2]), (7, tuple(cov_ref[2:]) + (2, 0.1), cca(*cov_ref[2:], 2, 0.1)[2])]
    W, b, f, lab = r(4, 5), r(4), r(20, 5), torch.randint(0, 4, (20,), generator=g)
    cases.append((8, (W, b, f, lab), recycling.neural_collapse_check(W, b, f, lab)))
    Xk, Yk = r(15, 4), r(15, 6)
    cases += [(9, (Xk, 3), similarity.knn_indices(Xk, 3)), (9, (Xk, Yk, 3), similarity.mutual_knn(Xk, Yk, 3))]
    pred, gt = torch.randint(0, 3, (2, 5, 6), generator=g), torch.randint(0, 3, (2, 5, 6), generator=g)
    inter, union = evaluate.iou_counts(pred, gt, 3)
    lo = r(3, 2, 3)
    cases += [(10, (pred, gt, 3), inter),
              (10, (inter.double(), union.double()), evaluate.miou_from_counts(inter, union)),
              (10, (lo, 5, 7), F.interpolate(lo[None], size=(5, 7), mode="bilinear", align_corners=False)[0])]
    H1, H2 = r(8, 5), r(8, 6)
    P, Q = structure.neighbour_distribution(H1, 0.3), structure.neighbour_distribution(H2, 0.3)
    cases += [(11, (H1, 0.3), P), (11, (P, Q), structure.js_divergence(P, Q)),
              (11, (H1, H2, 0.3), structure.structure_reg(H1, H2, 0.3))]
    asif = ASIF(4, 4, k=5, p=3)
    q, anchors = r(3, 4), r(12, 4)
    rel = asif.relative(q, F.normalize(anchors, dim=-1))
    cases += [(12, (q, F.normalize(anchors, dim=-1), 5, 3), rel), (12, (q[0], anchors, 5, 3), rel[0])]
    emb = r(12, 5)
    cases.append((13, (emb, 4), evaluate.template_average(emb, 4)))
    return cases


def probe_archive(tmp_path, cases, only=None, plant=None):
    """Build the archive (blanking only these exercises, if given), unpack it, optionally plant (file, text) in
    it, run ARCHIVE_PROBE there -> ({exercise: [where it is computed]}, the probe's output)."""
    import tarfile
    tmp_path.mkdir(parents=True)
    archive = tmp_path / "course.tar.gz"
    msc.make_archive(archive, only=only)
    with tarfile.open(archive) as tar:
        tar.extractall(tmp_path, filter="data")
    copy = tmp_path / "course"
    if plant:
        (copy / plant[0]).write_text(plant[1])
    torch.save(cases, tmp_path / "cases.pt")
    (tmp_path / "probe.py").write_text(ARCHIVE_PROBE)
    r = subprocess.run([sys.executable, str(tmp_path / "probe.py"), str(tmp_path / "cases.pt")], cwd=copy,
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    found = {}
    for line in r.stdout.splitlines():
        if line.startswith("ANSWER "):
            _, n, where = line.split(" ", 2)
            found.setdefault(int(n), []).append(where)
    return found, r.stdout


@pytest.mark.slow
def test_no_module_of_the_archive_computes_an_exercise_answer(tmp_path):
    """Import every module of the unpacked archive (tests, scripts, benchmarks included) and call every function
    on each exercise's planted inputs: none returns the answer. The same probe, in an archive whose regions are
    the reference's, finds every exercise's own functions, and finds the loop references if they shipped."""
    cases = planted_cases()
    assert {n for n, _, _ in cases} == set(EXERCISES)
    found, out = probe_archive(tmp_path / "clean", cases)
    assert int(out.split("CALLS ")[-1]) > 200, out[-2000:]
    broken = [l for l in out.splitlines() if l.startswith("NOIMPORT") and "NotImplementedError Exercise" not in l]
    assert not broken, broken                      # (a script that runs a blank exercise on import is fine)
    assert not found, f"modules of the archive that compute an exercise's answer: {found}"
    found, _ = probe_archive(tmp_path / "reference", cases, only=set())
    methods_only = {12}                              # ASIF.relative: a method, no free function holds it
    assert set(found) == set(EXERCISES) - methods_only, f"the planted inputs find no answer for " \
        f"{set(EXERCISES) - methods_only - set(found)}"
    loops = (ROOT / "tests" / "oracles.py").read_text()
    found, _ = probe_archive(tmp_path / "planted", cases, plant=("tests/helpers_planted.py", loops))
    assert {1, 3, 5, 9, 10, 11, 12}.issubset(found), found


def test_every_recorded_value_has_its_reference_in_the_reference_checkout():
    """tests/goldens.pt holds values of the references in tests/oracles.py only, for tests that still call them;
    the oracles are not in a copy, the recorded values are (exercises/make_goldens.py records them)."""
    import oracles
    called = {m for p in (ROOT / "tests").glob("test_*.py") for m in re.findall(r'expected\("(\w+)"', p.read_text())}
    assert called and all(callable(getattr(oracles, name, None)) for name in called), called
    table_ = torch.load(ROOT / "tests" / "goldens.pt", weights_only=False)
    recorded_names = {key.rsplit("::", 1)[1].split("#")[0] for key in table_}
    assert recorded_names == called, (recorded_names ^ called)
    files = {key.split("::")[0] for key in table_}
    assert all((ROOT / f).is_file() for f in files), files
    shipped = {str(p) for p in msc.project_files(ROOT)}
    assert "tests/goldens.pt" in shipped and "tests/recorded.py" in shipped and "tests/oracles.py" not in shipped
