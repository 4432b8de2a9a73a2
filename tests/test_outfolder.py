"""The results folder (infra/outfolder.py): a finished --out is replaced only by a rerun of the same
settings."""
import json

import pytest
from faults_common import models, one_line  # noqa: F401  (fixtures)
from test_real import write_karpathy

import align
from infra import checks


@pytest.mark.slow
def test_a_run_on_other_data_never_overwrites_the_results_in_its_out(tmp_path, models, capsys):
    """Two runs with one --out (the default names the method, the set and the seed, not the folder):
    the second, on another --data-root, stops before any work and the first one's results stay."""
    for name in ("a", "b"):
        write_karpathy(tmp_path / name / "coco")
    out = tmp_path / "out"
    run = lambda root, *extra: align.main([
        "--data", "coco", "--data-root", str(root), "--cache-dir", str(tmp_path / "cache"), "--out", str(out),
        "--threads", "1", "--epochs", "1", "--method", "linear", "--no-figures", "--image-encoder",
        str(models / "dinov2"), "--text-encoder", str(models / "bert"), *extra])
    run(tmp_path / "a")
    first = (out / "metrics.json").read_bytes()
    capsys.readouterr()
    with pytest.raises(SystemExit) as e:
        run(tmp_path / "b")
    assert f"--out {out} holds the results of a run on other data (coco in {tmp_path / 'a'}; this run: coco in " \
           f"{tmp_path / 'b'})" in one_line(e)
    assert (out / "metrics.json").read_bytes() == first and "[data]" not in capsys.readouterr().out
    same = ["--data", "coco", "--data-root", str(tmp_path / "a"), "--threads", "1", "--epochs", "1", "--method",
            "linear", "--image-encoder", str(models / "dinov2"), "--text-encoder", str(models / "bert")]
    checks.check_out_data(align.parse_args(same + ["--no-figures"]), out)   # the same settings: a rerun replaces them
    checks.check_out_data(align.parse_args([*same[:3], str(tmp_path / "a" / "coco"), *same[4:]]), out)  # <root>/coco
    with pytest.raises(SystemExit, match="holds the results of a run on other data"):   # --resume: the same rule
        checks.check_out_data(align.parse_args([*same[:3], str(tmp_path / "b"), *same[4:], "--resume"]), out)


def test_a_run_of_another_method_never_overwrites_the_results_in_its_out(tmp_path):
    """--out of a PAL run given to a linear run: it replaced PAL's config, metrics and method.pt and
    left PAL's figures and checkpoint beside them. Refused, with --resume too; a rerun of PAL with
    other hyperparameters is refused the same way (other settings); the same settings replace them."""
    out = tmp_path / "out"
    out.mkdir()
    (out / "config.json").write_text(json.dumps(dict(vars(align.parse_args([])), out=str(out))))   # a PAL run's
    for extra in ([], ["--resume"]):
        with pytest.raises(SystemExit) as e:
            checks.check_out_data(align.parse_args(["--method", "linear", *extra]), out)
        assert f"--out {out} holds the results of a pal run (this run: linear); pass another --out" in one_line(e)
    with pytest.raises(SystemExit) as e:
        checks.check_out_data(align.parse_args(["--hp", "K=64"]), out)
    assert "holds the results of a run with other settings (hp.K 512 there, 64 now); pass another --out " \
           f"(e.g. --out {out}-2)" in one_line(e)
    checks.check_out_data(align.parse_args(["--threads", "1", "--no-figures", "--out", "x"]), out)   # a rerun
