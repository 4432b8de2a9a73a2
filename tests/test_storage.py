"""Files the run writes (infra/storage.py): a full disk, a folder where a file goes: one `error:`
line and no half file."""
from argparse import Namespace

import pytest
import torch
from faults_common import extract, full_disk, models, one_line  # noqa: F401  (fixtures)

import encoders
from infra import folder, storage


def test_a_folder_where_a_cache_file_or_a_result_goes_is_one_line_before_the_work(tmp_path, models, monkeypatch):
    """A folder under a cache file's name was "rebuilding it", then a traceback from the rename once the
    features were computed (lost); one under --out's metrics.json ended the run after training. Both are
    one line before any encoder runs; the folder is left as it was (a user's folder is never deleted)."""
    txt_enc = encoders.load_hf_text(str(models / "bert"))
    texts = ["a dog sits on the cat.", "the man rides a red dog."]
    extract(txt_enc, texts, tmp_path)
    (path,) = (tmp_path / "features").glob("*.pt")
    path.unlink()
    (path / "notes.txt").parent.mkdir()
    (path / "notes.txt").write_text("mine")
    monkeypatch.setattr(txt_enc, "encode", lambda *a: pytest.fail("encoded before the fault was said"))
    with pytest.raises(SystemExit) as e:
        extract(txt_enc, texts, tmp_path)
    assert f"{path} is a folder where the cache keeps a file; move it away" in one_line(e)
    assert (path / "notes.txt").read_text() == "mine"
    out = tmp_path / "out"
    (out / "metrics.json").mkdir(parents=True)
    with pytest.raises(SystemExit) as e:
        folder.check_out(out, Namespace(resume=False))
    assert f"--out {out} holds files this program did not write (metrics.json, ...: " in one_line(e)


def test_a_full_disk_during_torch_save_is_one_line_and_leaves_no_file(full_disk):
    with pytest.raises(RuntimeError, match="inline_container|PytorchStreamWriter"):     # torch's own exception
        with open(full_disk / "raw.pt", "wb") as f:
            torch.save({"x": torch.zeros(2**17)}, f)
    (full_disk / "raw.pt").unlink()
    with pytest.raises(SystemExit) as e:
        storage.atomic_save({"key": "k", "x": torch.zeros(2**17)}, full_disk / "features" / "x.pt")
    assert "(no space left on its disk)" in one_line(e) and str(full_disk / "features" / "x.pt") in str(e.value)
    assert list((full_disk / "features").iterdir()) == []                         # no half file
