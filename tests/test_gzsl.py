"""Generalized zero-shot (aligned.py, choices 6-8): a finished run keeps its training captions' vocabulary;
classify says which class names the captions held and which are novel; calibrated stacking (Chao et al., ECCV
2016, §3.2) and its gamma, chosen on held-out scores, against hand computations on planted score matrices; an
old run folder without the vocabulary still classifies, and refuses --calibrate in one line."""
import json
import shutil
from collections import Counter

import pytest
import torch
from test_aligned import finished_run  # noqa: F401  (a fixture: a finished align.py run, one epoch)
from test_index import photos, tiny_run  # noqa: F401  (fixtures: a hand-written run folder, 9 Shapes PNGs)

import aligned
from infra import folder

CAPTIONS = ["a red circle", "A blue square, and a green square", "a small triangle"]


def test_a_finished_run_keeps_its_training_captions_words_and_adjacent_pairs(finished_run):   # noqa: F811
    """align.py writes vocabulary.json: every word and adjacent word pair of the whole training split's
    captions, lower-cased, with its count (counted here by str.split, not by the code's regex)."""
    import shapes
    vocabulary = json.loads((finished_run / "vocabulary.json").read_text())
    want = Counter()
    for c in shapes.cached_world(json.loads((finished_run / "config.json").read_text())["cache_dir"])["train"].captions:
        w = c.lower().replace(",", " ").split()
        want.update(w + [f"{a} {b}" for a, b in zip(w, w[1:])])
    assert vocabulary == dict(want) and list(vocabulary) == sorted(vocabulary)
    assert vocabulary["red circle"] > 0 and "circle red" not in vocabulary


def test_a_name_is_seen_when_its_words_and_their_adjacent_pairs_occur_in_the_captions(tmp_path):
    folder.write_vocabulary(CAPTIONS, tmp_path / "vocabulary.json")
    vocabulary = aligned.read_vocabulary(tmp_path)
    assert vocabulary["square"] == 2 and vocabulary["a"] == 4 and vocabulary["blue square"] == 1
    names = ["red circle", "Blue  Square", "circle", "green triangle", "green square", "hexagon", "circle red"]
    # "green triangle": both words were captioned, never together: novel; word order counts
    assert aligned.seen_names(names, vocabulary).tolist() == [True, True, True, False, True, False, False]


def test_harmonic_mean_and_the_per_class_seen_and_novel_top1_by_hand():
    """4 classes (0, 1 seen; 2, 3 novel), 6 images. Hand: class 0 1/2 right, class 1 1/1 -> S = 75; class 2
    0/2, class 3 1/1 -> U = 50; H = 2 * 75 * 50 / 125 = 60."""
    seen = torch.tensor([True, True, False, False])
    labels = torch.tensor([0, 0, 1, 2, 2, 3])
    pred = torch.tensor([0, 1, 1, 0, 1, 3])
    scores = torch.nn.functional.one_hot(pred, 4).float()
    s, u, h = aligned.gzsl_top1(scores, labels, seen)
    assert (s, u) == (75.0, 50.0) and h == pytest.approx(60.0)
    assert aligned.harmonic_mean(0.0, 0.0) == 0.0 and aligned.harmonic_mean(100.0, 0.0) == 0.0


def planted(bias=0.3, n=40, seed=0):
    """Scores whose seen bias is a known constant: true scores (right class 1, the others 0, plus noise below
    0.1) with `bias` added to the seen classes' columns (classes 0-2 seen, 3-5 novel)."""
    g = torch.Generator().manual_seed(seed)
    labels = torch.arange(6).repeat(n // 6 + 1)[:n]
    true = torch.nn.functional.one_hot(labels, 6).float() + 0.1 * torch.rand(n, 6, generator=g)
    seen = torch.tensor([True] * 3 + [False] * 3)
    return true + bias * seen.float(), true, labels, seen


def test_calibrated_stacking_removes_a_constant_seen_bias():
    """score'(x, c) = score(x, c) - gamma [c seen]: at gamma = the planted bias, the true scores exactly; the
    biased scores send every novel image to a seen class (U = 0), the calibrated ones classify all (H = 100)."""
    biased, true, labels, seen = planted(bias=1.5)
    torch.testing.assert_close(aligned.calibrated_stacking(biased, seen, 1.5), true, rtol=0, atol=1e-6)
    s, u, h = aligned.gzsl_top1(biased, labels, seen)
    assert (s, u, h) == (100.0, 0.0, 0.0)
    assert aligned.gzsl_top1(aligned.calibrated_stacking(biased, seen, 1.5), labels, seen) == (100.0, 100.0, 100.0)
    assert aligned.gzsl_top1(aligned.calibrated_stacking(biased, seen, 0.0), labels, seen) == (s, u, h)


@pytest.mark.parametrize("bias", [0.3, 1.5, -0.4])
def test_choose_gamma_picks_the_planted_bias(bias):
    """Each seen image's margin (best seen - best novel) is 1 + bias + noise, each novel one's -1 + bias + noise
    (noise in (-0.1, 0.1)), so H is 100 exactly for gamma between the largest novel margin and the smallest seen
    one, an interval around the bias holding no margin; choose_gamma's one candidate there is its middle,
    within the noise of the bias (gamma = 0 is outside the interval at bias 1.5 and -0.4, and off its middle
    at 0.3)."""
    biased, _, labels, seen = planted(bias=bias, n=600)
    gamma, h = aligned.choose_gamma(biased, labels, seen)
    margin = biased[:, seen].max(1).values - biased[:, ~seen].max(1).values
    lo, hi = margin[~seen[labels]].max(), margin[seen[labels]].min()          # the interval of H = 100
    assert h == 100.0 and lo < gamma < hi and abs(gamma - bias) < 0.05
    assert abs(gamma - (lo + hi) / 2) < 0.05                                 # its middle, not an edge
    with pytest.raises(ValueError, match="seen and novel"):
        aligned.choose_gamma(biased, labels, torch.ones(6, dtype=torch.bool))


@pytest.fixture
def run_with_vocabulary(tiny_run, tmp_path):   # noqa: F811
    """The hand-written tiny run, copied, with a vocabulary.json: "green triangle" never captioned."""
    run = tmp_path / "run"
    shutil.copytree(tiny_run, run)
    folder.write_vocabulary(CAPTIONS, run / "vocabulary.json")
    return run


def lines(out):
    return [line.split("  ") for line in out.strip().splitlines()]


def test_classify_says_seen_and_novel_names_and_calibrate_moves_predictions_as_computed(
        run_with_vocabulary, photos, capsys):   # noqa: F811
    """The [classes] line on stderr; --calibrate GAMMA's classes and scores are calibrated_stacking's argmax
    and values; a GAMMA above every margin sends every image to the novel name, the plain run does not."""
    names = ["red circle", "blue square", "green triangle"]
    run, files = str(run_with_vocabulary), aligned.image_files([photos])
    aligned.main(["classify", run, str(photos), "--classes", ",".join(names), "--threads", "1"])
    out = capsys.readouterr()
    assert "[classes] 2 seen in the training captions, 1 novel: green triangle" in out.err
    plain = lines(out.out)
    S = aligned.load(run).zero_shot(files, names)
    seen = torch.tensor([True, True, False])
    margin = S[:, :2].max(1).values - S[:, 2]
    assert [r[1] for r in plain] == [names[i] for i in S.argmax(1)]
    kept = margin[margin > 0].sort().values                 # the images the plain scores give a seen name
    assert len(kept) >= 2
    gamma = float(kept[0] + kept[1]) / 2                    # the first goes to the novel name, the rest stay
    aligned.main(["classify", run, str(photos), "--classes", ",".join(names), "--calibrate", str(gamma),
                  "--threads", "1"])
    calibrated = lines(capsys.readouterr().out)
    C = aligned.calibrated_stacking(S, seen, gamma)
    assert [r[1] for r in calibrated] == [names[i] for i in C.argmax(1)] != [r[1] for r in plain]
    assert [float(r[2]) for r in calibrated] == pytest.approx(C.max(1).values.tolist(), abs=1e-4)
    big = str(float(margin.max()) + 1)
    aligned.main(["classify", run, str(photos), "--classes", ",".join(names), "--calibrate", big, "--top", "2"])
    top = lines(capsys.readouterr().out)
    assert {r[1] for r in top} == {"green triangle"}
    P = aligned.load(run).probabilities(aligned.calibrated_stacking(S, seen, float(big)))
    assert [float(r[4]) for r in top] == pytest.approx(P[:, 2].tolist(), abs=1e-4)   # the calibrated softmax


def test_an_old_run_without_vocabulary_classifies_and_refuses_calibrate_in_one_line(tiny_run, photos, capsys):  # noqa: F811
    assert not (tiny_run / "vocabulary.json").exists()
    aligned.main(["classify", str(tiny_run), str(photos), "--classes", "red circle,blue square", "--threads", "1"])
    out = capsys.readouterr()
    assert len(lines(out.out)) == 9 and "seen and novel class names cannot be told apart" in out.err
    with pytest.raises(SystemExit, match="--calibrate: .* holds no vocabulary.json"):
        aligned.main(["classify", str(tiny_run), str(photos), "--classes", "red circle", "--calibrate", "0.1"])
    with pytest.raises(SystemExit, match="--calibrate inf: give a finite number"):
        aligned.main(["classify", str(tiny_run), str(photos), "--classes", "red circle", "--calibrate", "inf"])


def test_the_benchmarks_gamma_is_chosen_on_training_pairs_of_seen_prime_classes_alone(finished_run, cache_dir):  # noqa: F811
    """benchmarks/gzsl.py's choice of gamma with the test images out of reach (their features taken out: a read
    would be a KeyError): a finite gamma, and each fold fits at most the pairs whose captions name its seen'
    classes only (none novel, none of its pseudo-novel ones), less the held-out single-class images."""
    import math
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import gzsl
    F, train_set, _ = gzsl.features("shapes-cnn", "shapes-text", cache_dir)
    F = {k: v for k, v in F.items() if k != ("cls", "image")}
    labels = [gzsl.classes_of(c) for c in train_set.captions]
    seen_classes = [k for k in range(24) if not gzsl.is_novel(k)]
    fitted, logs = [], []
    real = gzsl.fitted
    def spy(name, img, txt, epochs, seed):
        fitted.append(len(txt))
        return real(name, img, txt, epochs, seed)
    gzsl.fitted = spy
    try:
        gamma = gzsl.choose("linear", F, train_set.txt_to_img, labels, seen_classes, 1, 0, logs.append)
    finally:
        gzsl.fitted = real
    only_seen = sum(bool(c) and all(not gzsl.is_novel(k) for k in c) for c in labels)
    assert math.isfinite(gamma) and len(logs) == len(fitted) == gzsl.FOLDS and only_seen == 1794
    for f, n in enumerate(fitted):      # at most the pairs of the fold's seen' classes, less a few held out
        seen_prime = set(seen_classes) - set(seen_classes[f::gzsl.FOLDS])
        most = sum(bool(c) and c <= seen_prime for c in labels)
        assert 0.8 * most < n < most < only_seen, (f, n, most)
