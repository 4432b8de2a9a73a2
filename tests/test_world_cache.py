"""The Shapes world cached like the features: built once, read back equal, keyed by what builds it."""
import shutil
from pathlib import Path

import pytest
import torch

import data
import shapes

SMALL = dict(n_train=12, n_test=4, n_cls=4, n_seg=4, n_bind=4)


def same_sets(a, b):
    assert a.keys() == b.keys()
    for name in a:
        assert type(a[name]) is type(b[name]), name
        for field, v in vars(a[name]).items():
            w = getattr(b[name], field)
            assert torch.equal(v, w) if isinstance(v, torch.Tensor) else v == w, (name, field)


def test_the_world_is_written_once_and_read_back_without_rendering(tmp_path, monkeypatch):
    built = shapes.cached_world(tmp_path, 0, **SMALL)
    files = list((tmp_path / "world").glob("*.pt"))
    assert len(files) == 1
    shapes._WORLDS.clear()                                           # as a new process would start
    monkeypatch.setattr(shapes, "shapes_world", lambda *a, **k: (_ for _ in ()).throw(AssertionError("rendered")))
    read = shapes.cached_world(tmp_path, 0, **SMALL)
    same_sets(read, built)


def test_the_world_matches_a_fresh_build_and_other_settings_get_other_files(tmp_path):
    read = shapes.cached_world(tmp_path, 1, **SMALL)
    shapes._WORLDS.clear()
    same_sets(shapes.cached_world(tmp_path, 1, **SMALL), shapes.shapes_world(1, **SMALL))
    shapes.cached_world(tmp_path, 2, **SMALL)
    shapes.cached_world(tmp_path, 1, **dict(SMALL, n_test=5))
    assert len(list((tmp_path / "world").glob("*.pt"))) == 3
    assert read["test"].captions == shapes.shapes_world(1, **SMALL)["test"].captions


@pytest.mark.parametrize("module", [shapes, data])
def test_an_edit_to_the_code_that_builds_the_world_changes_the_key(tmp_path, monkeypatch, module):
    before = shapes.world_key(0, SMALL)
    edited = tmp_path / Path(module.__file__).name
    shutil.copy(module.__file__, edited)
    edited.write_text(edited.read_text() + "\n# an edit\n")
    monkeypatch.setattr(module, "__file__", str(edited))
    assert shapes.world_key(0, SMALL) != before


def test_a_corrupt_world_file_is_rebuilt(tmp_path):
    shapes.cached_world(tmp_path, 0, **SMALL)
    f, = (tmp_path / "world").glob("*.pt")
    raw = bytearray(f.read_bytes())
    raw[len(raw) // 2] ^= 0xFF
    f.write_bytes(bytes(raw))
    shapes._WORLDS.clear()
    same_sets(shapes.cached_world(tmp_path, 0, **SMALL), shapes.shapes_world(0, **SMALL))
