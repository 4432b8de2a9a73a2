"""The method interface is declared once (methods/__init__.py: Method) and align.py reads it, never
probes it: every method inherits the declared defaults, and align.py holds no hasattr / getattr on
a method or its class."""
import re
from pathlib import Path

import pytest
import torch

import align
from infra import run as settings
from methods import METHODS, Method
from methods.pal import PAL

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("name", sorted(METHODS))
def test_every_method_inherits_the_interface(name):
    cls = METHODS[name]
    assert issubclass(cls, Method) and issubclass(cls, torch.nn.Module)
    for attr in ("ranges", "refuses_align_data", "split_loss", "reads_head_rows"):
        assert isinstance(getattr(cls, attr), type(getattr(Method, attr))), attr
    assert (cls.fit is not None) or (cls.loss is not None)          # a closed form, or trained
    assert callable(cls.contrastive_score)


def test_the_base_class_holds_only_defaults():
    assert Method.fit is None and Method.loss is None and Method.analyse is None
    assert Method.contrastive_scale is None and Method.split_loss is False
    assert Method.ranges == {} and Method.refuses_align_data == {} and Method.reads_head_rows is False
    assert PAL.reads_head_rows and not any(c.reads_head_rows for n, c in METHODS.items() if n != "pal")


def test_align_does_not_probe_a_method():
    source = (ROOT / "align.py").read_text() + (ROOT / "infra" / "run.py").read_text()
    probes = re.findall(r"(?:hasattr|getattr)\(\s*(?:method|method_cls|probe|m|cls)\b", source)
    assert probes == []

def test_head_rows_reach_the_method_that_reads_them():
    args = align.parse_args(["--method", "pal", "--align-data", "weights"])

    class Head:
        head_reads = "patches"

    assert settings.head_row_hp(args, PAL, {"K": 8}, Head()) == {"head_rows": "patches", "K": 8}
    assert settings.head_row_hp(args, METHODS["mlp"], {}, Head()) == {}    # mlp takes no head_rows
    pairs = align.parse_args(["--method", "pal"])
    assert settings.head_row_hp(pairs, PAL, {}, Head()) == {}               # pairs: the method's default
