"""Settings chosen per run on held-out alignment pairs (CSA's ridge, SAIL's epochs), never on a test pair; and
the loop settings refused in one line before any work."""
import csv
import dataclasses
import json

import pytest
import torch
from conftest import random_features

import align
import data
import shapes
import train
from features import Features
from methods.csa import held_out_split
from methods.sail import SAIL

QUICK = ("--eval-images", "20", "--no-figures", "--threads", "1")


def poisoned_world(cache_dir):
    """The Shapes world with every set but the alignment pairs poisoned, so that whatever a run reads from one
    of them moves:
    - test (pairs): images noise, txt_to_img shuffled with the captions left in place, so every caption now names
      another image and an image's 5 paraphrases are scattered over 5 images (a leak that reads the captions
      alone, with their grouping, moves too);
    - cls: images reversed, labels rolled; seg: images reversed against their masks;
    - every binding set: images reversed, each true caption swapped with its first distractor."""
    world = dict(shapes.cached_world(cache_dir))
    g = torch.Generator().manual_seed(0)
    for split, s in world.items():
        if split == "train":
            continue
        if isinstance(s, data.PairSet):
            world[split] = dataclasses.replace(
                s, images=torch.randint(0, 256, s.images.shape, dtype=torch.uint8, generator=g),
                txt_to_img=s.txt_to_img[torch.randperm(len(s.txt_to_img), generator=g)])
        elif isinstance(s, data.LabelSet):
            world[split] = dataclasses.replace(s, images=s.images.flip(0), labels=s.labels.roll(1),
                                               masks=None if s.masks is None else s.masks.roll(1, 0))
        elif isinstance(s, data.MaskSet):
            world[split] = dataclasses.replace(s, images=s.images.flip(0))
        elif isinstance(s, data.BindingSet):
            first = next(iter(s.distractors))
            world[split] = dataclasses.replace(s, images=s.images.flip(0), captions=list(s.distractors[first]),
                                               distractors={**s.distractors, first: list(s.captions)})
        else:
            raise AssertionError(f"poisoned_world cannot poison {split} ({type(s).__name__}): add it here")
    return world


def pairs_kept_poison(cache_dir):
    """A weaker poison: test images noise, captions reversed TOGETHER with their image links (so every
    (caption, image) pair and every group of paraphrases is unchanged), cls reordered, seg and binding untouched.
    Kept to show what it misses (test_the_poison_catches_a_captions_only_leak)."""
    world = dict(shapes.cached_world(cache_dir))
    g = torch.Generator().manual_seed(0)
    test = world["test"]
    world["test"] = dataclasses.replace(test, images=torch.randint(0, 256, test.images.shape, dtype=torch.uint8,
                                                                   generator=g),
                                        captions=list(reversed(test.captions)), txt_to_img=test.txt_to_img.flip(0))
    world["cls"] = dataclasses.replace(world["cls"], images=world["cls"].images.flip(0),
                                       labels=world["cls"].labels.roll(1))
    return world


def test_every_test_set_is_poisoned(cache_dir):
    """poisoned_world changes every set but the alignment pairs: for each, a field the evaluation reads differs
    in its first 20 items (what --eval-images 20 scores), and the pairs' captions stay while their links move."""
    clean, poisoned = shapes.cached_world(cache_dir), poisoned_world(cache_dir)
    assert set(poisoned) == set(clean)
    def differs(a, b):
        if isinstance(a, dict):
            return any(differs(a[k], b[k]) for k in a)
        return (not torch.equal(a[:20], b[:20])) if torch.is_tensor(a) else a[:20] != b[:20]
    for split, s in clean.items():
        p = poisoned[split]
        fields = [f.name for f in dataclasses.fields(s) if f.name not in ("class_names", "templates")]
        moved = [f for f in fields if getattr(s, f) is not None and differs(getattr(s, f), getattr(p, f))]
        if split == "train":
            assert not moved, f"the alignment pairs were poisoned too ({moved})"
        else:
            assert "images" in moved and len(moved) >= (1 if isinstance(s, data.MaskSet) else 2), \
                f"{split}: only {moved} poisoned"
    assert poisoned["test"].captions == clean["test"].captions, "the test captions moved with their links"
    assert (poisoned["test"].txt_to_img != clean["test"].txt_to_img).float().mean() > 0.9


def test_held_out_pairs_keep_each_image_on_one_side():
    """Pairs that share an image (COCO's 5 captions) are held out together: no image on both sides."""
    pooled = torch.randn(40, 8).repeat_interleave(3, 0)                       # 40 images x 3 captions
    for split in (train.held_out_pairs(pooled, 0.2), held_out_split(pooled, 0.2)):
        val, fit = split
        assert len(val) == 24 and len(fit) == 96, (len(val), len(fit))       # 8 of 40 images, 3 pairs each
        key = lambda idx: {tuple(r) for r in pooled[idx].tolist()}
        assert not key(val) & key(fit), "an image is on both sides of the held-out split"


def test_the_stop_on_validation_keeps_the_best_epoch(tmp_path):
    """train() with held-out pairs: one validation row per epoch, and the weights it returns are the best
    epoch's (validating them again gives that epoch's figures exactly)."""
    img = random_features(120, 1 + 4, 16, grid=(2, 2), seed=1)
    txt = Features.from_vectors(img.pooled @ torch.randn(16, 12, generator=torch.Generator().manual_seed(3))
                                + 0.3 * torch.randn(120, 12, generator=torch.Generator().manual_seed(4)))
    val_idx, fit_idx = train.held_out_pairs(img.pooled, 0.25)
    val = train.validation_set(img, txt, val_idx)
    torch.manual_seed(0)
    m = SAIL(16, 12, K=16, width=2)
    loop = dict(epochs=6, batch_size=30, lr=3e-3, weight_decay=1e-4, seed=0)
    result = train.train(m, img[fit_idx], txt[fit_idx], loop, tmp_path / "run", "cpu", val=val)
    rows = result["history"]
    assert [r["epoch"] for r in rows] == list(range(1, 7)) and all("val_rsum" in r for r in rows)
    best = max(rows, key=lambda r: r["val_score"])
    assert result["chosen"] == {"epochs": best["epoch"]}
    again = train.validate(m, val, "cpu")
    assert again == {k: best[k] for k in again}, f"the returned weights validate at {again}, the best epoch at {best}"


def choice_of(method, out):
    """What a run's choice read off its held-out pairs: CSA's whole ridge table (validation.json), SAIL's
    per-epoch validation figures (history.csv's val_ columns)."""
    if method == "csa":
        return json.loads((out / "validation.json").read_text())
    return [{k: v for k, v in r.items() if k.startswith("val_")} for r in csv.DictReader(open(out / "history.csv"))]


def clean_and_poisoned(method, extra, cache_dir, tmp_path, monkeypatch, poison=poisoned_world):
    """(metrics, choice) of one run on the world as it is, then of one with its test sets poisoned."""
    runs = []
    for name in ("clean", "poisoned"):
        if name == "poisoned":
            world = poison(cache_dir)
            monkeypatch.setattr(shapes, "cached_world", lambda *a, _world=world, **k: _world)
        out = tmp_path / f"{method}-{name}-{poison.__name__}"
        metrics = align.main(["--method", method, "--cache-dir", str(cache_dir), "--out", str(out), *QUICK, *extra])
        runs.append((metrics, choice_of(method, out)))
    monkeypatch.undo()
    return runs


def assert_the_choice_did_not_move(method, clean, poisoned):
    """The poisoning check: the choice's whole table is the same to the last digit with every test set poisoned
    (not only the chosen value, which a leak into one score can leave in place)."""
    (clean_metrics, clean_choice), (poisoned_metrics, poisoned_choice) = clean, poisoned
    assert poisoned_choice == clean_choice, f"{method}'s choice moved when the test sets were poisoned: the " \
        f"selection reads a test set (clean {clean_choice}, poisoned {poisoned_choice})"
    assert poisoned_metrics["train"]["chosen"] == clean_metrics["train"]["chosen"]


@pytest.mark.slow
@pytest.mark.parametrize("method, extra", [("csa", ()), ("sail", ("--epochs", "2"))])
def test_the_per_run_choice_reads_no_test_pair(cache_dir, tmp_path, monkeypatch, capsys, method, extra):
    """The run's choice (CSA's ridge table, SAIL's per-epoch validation figures) is the same to the last digit
    with every test set poisoned (poisoned_world), while the test metrics move (the poison reached them)."""
    clean, poisoned = clean_and_poisoned(method, extra, cache_dir, tmp_path, monkeypatch)
    assert "[choice]" in capsys.readouterr().out, "the run does not print the setting it chose"
    assert_the_choice_did_not_move(method, clean, poisoned)
    (c, _), (p, _) = clean, poisoned
    assert p["retrieval"]["rsum"] != c["retrieval"]["rsum"], "(the test's own check) the poison missed retrieval"
    assert p["classification"]["cls"] != c["classification"]["cls"], "(the test's own check) the poison missed cls"
    assert p["segmentation"]["seg"] != c["segmentation"]["seg"], "(the test's own check) the poison missed seg"
    binding = [k for k in c if k.startswith("binding")]
    assert binding and [p[k] for k in binding] != [c[k] for k in binding], "(the test's own check) binding"


def plant_captions_only_leak(monkeypatch, cache_dir):
    """A captions-only leak, planted: during CSA's ridge selection every ridge is also scored on the test
    captions alone, their features extracted under the label split="train" (so a spy on the extracted splits sees
    nothing): the share of test captions whose nearest caption under the ridge's text map is a paraphrase of the
    same image (txt_to_img's grouping). No test image is read."""
    import torch.nn.functional as F  # noqa: PLC0415

    import methods.csa as csa  # noqa: PLC0415
    from infra import cache  # noqa: PLC0415
    seen, real_load, real_select = {}, align.load_inputs, csa.select_ridge

    def load_inputs(args, device):               # the run's test set kept aside at load: align.main hands the fit
        seen["run"] = real_load(args, device)    # none (test_the_test_sets_are_read_only_after_the_method_is_frozen)
        seen["test"] = seen["run"].sets["test"]
        return seen["run"]

    def leaky_select(X, Y, d, **kw):
        ridge, table = real_select(X, Y, d, **kw)
        run, test = seen["run"], seen["test"]
        T = cache.extract(run.text_encoder, test.captions, cache_dir, dataset="shapes", split="train",
                          modality="text")                               # the test captions, labelled "train"
        T = F.normalize(T.pooled.double(), dim=-1)
        mu_x, mu_y, *S = csa.covariances(X, Y)
        same = test.txt_to_img[:, None] == test.txt_to_img[None]          # paraphrases of one image
        for r, row in table.items():
            _, B, _ = csa.cca(*S, min(d, len(X) - 1), r)
            e = F.normalize((T - mu_y) @ B, dim=-1)
            sim = (e @ e.T).fill_diagonal_(-2)
            row["test_captions"] = same.gather(1, sim.argmax(1, keepdim=True)).double().mean().item()
            row["score"] = (row["score"] + row["test_captions"]) / 2
        return max(table, key=lambda r: table[r]["score"]), table

    monkeypatch.setattr(align, "load_inputs", load_inputs)
    monkeypatch.setattr(csa, "select_ridge", leaky_select)


@pytest.mark.slow
def test_the_poison_catches_a_captions_only_leak(cache_dir, tmp_path, monkeypatch):
    """The poisoning check is honest: with the captions-only leak planted, it fails (the ridge table moves under
    poisoned_world, whose shuffled links scatter the paraphrases), where a poison that keeps every (caption,
    image) pair (pairs_kept_poison) lets the same leak through."""
    plant = lambda: plant_captions_only_leak(monkeypatch, cache_dir)
    plant()
    clean, poisoned = clean_and_poisoned("csa", (), cache_dir, tmp_path, monkeypatch)
    with pytest.raises(AssertionError, match="choice moved when the test sets were poisoned"):
        assert_the_choice_did_not_move("csa", clean, poisoned)
    assert "test_captions" in clean[1]["table"][0], "(the test's own check) the leak was not planted"
    plant()
    clean, weak = clean_and_poisoned("csa", (), cache_dir, tmp_path, monkeypatch, poison=pairs_kept_poison)
    assert_the_choice_did_not_move("csa", clean, weak)      # the pair-keeping poison: the leak passes unseen


def inputs_of_the_test_sets(world):
    """Every input of the world's test sets, as cache.extract would be handed it: {captions and prompts}, {image
    bytes}."""
    texts, images = set(), set()
    for split, s in world.items():
        if split == "train":
            continue
        texts |= set(getattr(s, "captions", [])) | {c for caps in getattr(s, "distractors", {}).values() for c in caps}
        images |= {bytes(x.numpy().tobytes()) for x in s.images}
    return texts, images


def watch_the_choice(monkeypatch, cache_dir):
    """While train.fit_or_train runs (the method's fit and every choice made on held-out pairs), record each
    cache.extract call whose inputs hold a test set's caption or image, whatever split it is labelled."""
    from infra import cache  # noqa: PLC0415
    texts, images = inputs_of_the_test_sets(shapes.cached_world(cache_dir))
    state, reads = {"in_fit": False}, []
    real_fit, real_extract = train.fit_or_train, cache.extract

    def fit_or_train(*a, **k):
        state["in_fit"] = True
        try:
            return real_fit(*a, **k)
        finally:
            state["in_fit"] = False

    def extract(enc, inputs, cache_dir, **key):
        if state["in_fit"]:
            hit = (set(inputs) & texts) if isinstance(inputs, list) else \
                {i for i, x in enumerate(inputs) if bytes(x.numpy().tobytes()) in images}
            if hit:
                reads.append(f"{key.get('split')}/{key.get('modality')}: {len(hit)} test inputs")
        return real_extract(enc, inputs, cache_dir, **key)

    monkeypatch.setattr(train, "fit_or_train", fit_or_train)
    monkeypatch.setattr(cache, "extract", extract)
    return reads


@pytest.mark.slow
def test_no_choice_extracts_a_test_input_whatever_its_label(cache_dir, tmp_path, monkeypatch):
    """During the fit and its choice on held-out pairs no extraction is handed a test caption or image, checked by
    content, not by the split label; with the captions-only leak planted (labelled split="train") it is caught."""
    run = lambda out: align.main(["--method", "csa", "--cache-dir", str(cache_dir), "--out", str(tmp_path / out),
                                  *QUICK])
    reads = watch_the_choice(monkeypatch, cache_dir)
    run("clean")
    assert not reads, f"the choice extracted test inputs: {reads}"
    plant_captions_only_leak(monkeypatch, cache_dir)
    run("leak")
    assert len(reads) == 1 and reads[0].startswith("train/text: "), f"(the test's own check) the planted leak " \
        f"(the test captions, labelled train) was not seen: {reads}"


@pytest.mark.parametrize("flags, says", [(("--lr", "5e37"), "lr in (0, 3.40"),
                                         (("--weight-decay", "1e300"), "--weight-decay 1e+300: with lr 0.001")])
def test_loop_settings_that_overflow_are_refused_in_one_line(tmp_path, capsys, flags, says):
    """--lr 5e37 (Adam's lr / (1 - beta1) overflows float32) and --weight-decay 1e300 (1 - lr x wd < 0) stop
    before any work, each naming its own flag."""
    with pytest.raises(SystemExit) as e:
        align.main(["--method", "linear", "--epochs", "1", "--cache-dir", str(tmp_path / "c"),
                    "--out", str(tmp_path / "o"), *QUICK, *flags])
    text = str(e.value)
    assert text.startswith(f"error: {flags[0]}") and says in text and "\n" not in text, text
    assert "[features]" not in capsys.readouterr().out
    assert not (tmp_path / "c").exists(), "the refused run read or wrote the cache"


def test_a_word_default_takes_a_number_or_its_word():
    """CSA's ridge defaults to the word "auto": --hp ridge=0.1 is a number, ridge=auto the word, anything else
    one line naming both."""
    from infra.errors import RunError
    from infra.run import parse_hp
    from methods.csa import CSA
    assert parse_hp(CSA, ["ridge=0.1"]) == {"ridge": 0.1} and parse_hp(CSA, ["ridge=1"]) == {"ridge": 1.0}
    assert parse_hp(CSA, ["ridge=auto"]) == {"ridge": "auto"}
    with pytest.raises(RunError, match="takes a number or auto"):
        parse_hp(CSA, ["ridge=abc"])


@pytest.mark.slow
def test_the_test_sets_are_read_only_after_the_method_is_frozen(cache_dir, tmp_path, monkeypatch):
    """Structurally, not by a poison: while the method is chosen and trained (train.fit_or_train, CSA's held-out
    ridge included) the run holds the training split alone, and no test set's features are extracted; they are
    extracted after the fit returns, with every parameter of the method frozen."""
    import train  # noqa: PLC0415
    from infra import cache  # noqa: PLC0415
    events, seen = [], {}
    real_fit, real_split, real_extract = train.fit_or_train, align.test_sets, cache.extract

    def test_sets(run):
        seen["run"] = run
        return real_split(run)

    def fit_or_train(method, *a, **kw):
        seen["method"] = method
        run = seen["run"]
        events.append(("fit", set(run.sets), {split for split, _ in run.features}))
        try:
            return real_fit(method, *a, **kw)
        finally:
            events.append(("fitted", None, None))

    def extract(enc, inputs, *a, split=None, **kw):
        frozen = "method" in seen and not any(p.requires_grad for p in seen["method"].parameters())
        events.append(("extract", split, frozen))
        return real_extract(enc, inputs, *a, split=split, **kw)
    monkeypatch.setattr(align, "test_sets", test_sets)
    monkeypatch.setattr(train, "fit_or_train", fit_or_train)
    monkeypatch.setattr(cache, "extract", extract)
    align.main(["--method", "csa", "--cache-dir", str(cache_dir), "--out", str(tmp_path / "o"), "--threads", "1",
                "--no-figures", "--eval-images", "20", "--quiet"])
    fit = next(i for i, e in enumerate(events) if e[0] == "fit")
    fitted = events.index(("fitted", None, None))
    assert events[fit][1] == {"train"} and events[fit][2] == {"train"}, events[fit]      # the run during the fit
    before = [e for e in events[:fitted] if e[0] == "extract"]
    after = [e for e in events[fitted:] if e[0] == "extract"]
    assert before and all(split == "train" for _, split, _ in before), before
    assert {split for _, split, _ in after} >= {"test", "cls", "seg", "binding"}, after
    assert all(frozen for _, split, frozen in after if split != "train"), after
