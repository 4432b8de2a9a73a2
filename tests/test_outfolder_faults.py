"""The results folder (--out) and its lock on a researcher's own folders: files this program did not
write, links where a file goes, a killed run's temporary files, --out inside the feature cache, and
the settings a rerun is compared on. Runs go through align.main in this process and stop at the
folder checks, before any data loads."""
import json
import os
from pathlib import Path

import pytest

import align
from infra import outfolder, storage

QUICK = ("--eval-images", "20", "--no-figures", "--threads", "1")


def refused(tmp_path, out, *extra):
    """The one error line of a run that stops at the folder checks."""
    with pytest.raises(SystemExit) as e:
        align.main(["--cache-dir", str(tmp_path / "cache"), "--out", str(out), *QUICK, *extra])
    text = str(e.value)
    assert text.startswith("error: ") and "\n" not in text, text
    return text


def files_of(folder):
    return {p.name: p.read_bytes() for p in Path(folder).iterdir()}


# ----------------------------------------------------------------------------- case 1: files it did not write
@pytest.mark.parametrize("name, text", [("config.json", '{"my": 1}'), ("metrics.json", '{"acc": 0.93}'),
                                        ("config.json", '{"model_type": "bert", "hidden_size": 8}'),
                                        ("method.pt", "weights"), ("checkpoint.pt", "weights")])
def test_an_out_holding_files_this_program_did_not_write_is_refused_before_any_work(tmp_path, name, text):
    """A user's config.json / metrics.json (or a Hugging Face model folder's config.json, a method.pt of
    their own) in --out: refused before any work, the files byte for byte as they were."""
    out = tmp_path / "u"
    out.mkdir()
    (out / name).write_text(text)
    (out / "notes.txt").write_text("mine")
    before = files_of(out)
    msg = refused(tmp_path, out)
    assert f"--out {out} holds a {name} that this program did not write" in msg, msg
    assert files_of(out) == before


def test_files_of_a_finished_run_are_ours_and_a_foreign_one_beside_them_is_not(tmp_path):
    out = tmp_path / "r"
    config = {"data": "shapes", "method": "pal", "seed": 0}
    work = outfolder.begin(out, config, resume=False)
    (work / "config.json").write_text(json.dumps(config))
    (work / "metrics.json").write_text("{}")
    outfolder.finish(out)
    assert outfolder.foreign_files(out) == []
    (out / "method.pt").write_text("theirs")                # not in the finished run's list of files
    assert outfolder.foreign_files(out) == ["method.pt"]


# ----------------------------------------------------------------------------- case 2: a lock that is a link
def test_a_link_where_the_lock_goes_is_refused_and_its_target_is_never_written(tmp_path):
    """`ln -s ~/victim.txt shared/.run1.lock` (or a results folder copied with tar / rsync -a): the run
    is refused naming the link, the target keeps its bytes; the cache's per-key locks and the temporary
    file of every atomic write never write through a link either."""
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    shared = tmp_path / "shared"
    shared.mkdir()
    os.symlink(victim, shared / ".run1.lock")
    msg = refused(tmp_path, shared / "run1")
    assert f"{shared / '.run1.lock'} is a link" in msg, msg
    assert victim.read_text() == "precious" and not (shared / "run1").exists()
    dangling = tmp_path / "locks" / "key.lock"
    dangling.parent.mkdir()
    os.symlink(tmp_path / "created-through-the-link", dangling)
    with pytest.raises(SystemExit, match="is a link"):
        with storage.file_lock(dangling):
            pass
    assert not (tmp_path / "created-through-the-link").exists()
    target = tmp_path / "metrics.json"
    os.symlink(victim, target.with_name(f"metrics.json.tmp{os.getpid()}"))   # a copied leftover of this pid
    storage.atomic_write_text("{}", target)
    assert victim.read_text() == "precious" and target.read_text() == "{}" and not target.is_symlink()


# ----------------------------------------------------------------------------- case 3: a killed write's temporary file
def test_a_killed_checkpoint_writes_temporary_file_never_reaches_out(tmp_path):
    """kill -9 between a checkpoint's temporary write and its rename leaves checkpoint.pt.tmp<pid> in the
    partial folder: --resume removes it, and finish never moves one into --out nor lists it."""
    out = tmp_path / "r"
    config = {"data": "shapes", "method": "pal", "seed": 0}
    work = outfolder.begin(out, config, resume=False)
    (work / "config.json").write_text(json.dumps(config))
    (work / "checkpoint.pt.tmp4242").write_bytes(b"half")          # the killed run's
    work = outfolder.begin(out, config, resume=True)
    assert not (work / "checkpoint.pt.tmp4242").exists()
    (work / "method.pt.tmp4343").write_bytes(b"half")             # and one left later all the same
    (work / "metrics.json").write_text("{}")
    outfolder.finish(out)
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "metrics.json"]
    assert json.loads((out / "config.json").read_text())["files"] == ["config.json", "metrics.json"]


# ----------------------------------------------------------------------------- case 12: --out and --cache-dir apart
@pytest.mark.parametrize("out, cache", [("c", "c"), ("p", "p/cache"), ("c/results", "c")])
def test_an_out_equal_to_above_or_below_the_cache_is_refused(tmp_path, out, cache):
    """--out equal to --cache-dir (or a folder above it, or inside it): a later refusal's "delete <out>"
    would delete the feature cache. Refused before any work, naming both."""
    with pytest.raises(SystemExit) as e:
        align.main(["--cache-dir", str(tmp_path / cache), "--out", str(tmp_path / out), *QUICK])
    msg = str(e.value)
    assert msg.startswith("error: --out ") and "--cache-dir" in msg and "\n" not in msg, msg
    assert "pass an --out apart from --cache-dir" in msg, msg


# ----------------------------------------------------------------------------- case 14: the resolved hp
def test_the_same_hp_given_twice_or_at_its_default_is_the_same_run(tmp_path):
    """--hp K=128 into the --out of --hp K=64 --hp K=128 computes the same run (the last wins), as does
    --hp K=512 (PAL's default) into a run without --hp: compared on the resolved hyperparameters, not
    the flags as typed, also for a config.json written without "given"; K=64 is another run."""
    from infra import checks

    def finished(*flags, given=True):
        out = tmp_path / f"r{len(list(tmp_path.iterdir()))}"
        args = align.parse_args(["--out", str(out), *flags])
        config = dict(vars(args), files=["config.json"], **({"given": checks.given_settings(args)} if given else {}))
        out.mkdir()
        (out / "config.json").write_text(json.dumps(config))
        return out

    for given in (True, False):
        for first, rerun in ((["--hp", "K=64", "--hp", "K=128"], ["--hp", "K=128"]), ([], ["--hp", "K=512"])):
            out = finished(*first, given=given)
            checks.check_out_data(align.parse_args(["--out", str(out), *rerun]), out)
            with pytest.raises(SystemExit, match="holds the results of a run with other settings"):
                checks.check_out_data(align.parse_args(["--out", str(out), "--hp", "K=64"]), out)
