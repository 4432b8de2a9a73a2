"""Record the graded tests' expected values (tests/goldens.pt): the instructor, in the reference checkout.

    python exercises/make_goldens.py

Runs the quick tests of the files that call tests/recorded.py's `expected` with RECORD_GOLDENS set, so each
call computes its reference (tests/oracles.py, naive loops) and records the value with a fingerprint of its
inputs; then writes tests/goldens.pt, the file a student copy grades against (it holds values, no code). Rerun it
after changing a graded test, its fixtures or an oracle (exercises/INSTRUCTOR.md).
"""
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from infra.errors import RunError  # noqa: E402

GOLDENS = ROOT / "tests" / "goldens.pt"


def recording_files(root=ROOT):
    """The test files that grade against recorded values."""
    return sorted(str(p.relative_to(root)) for p in (root / "tests").glob("test_*.py")
                  if 'expected("' in p.read_text())


def main():
    if (ROOT / "exercises" / "this_copy.json").is_file() or not (ROOT / "tests" / "oracles.py").is_file():
        raise RunError("this is a student copy: the expected values are recorded in the reference checkout only")
    t0 = time.time()
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "goldens.pt"
        r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-x",
                            *recording_files()], cwd=ROOT, env=dict(os.environ, RECORD_GOLDENS=str(out)),
                           capture_output=True, text=True)
        if r.returncode != 0 or not out.exists():
            raise RunError(f"the tests failed while recording (nothing written): {r.stdout.strip()[-300:]}")
        GOLDENS.write_bytes(out.read_bytes())
    import torch
    n = len(torch.load(GOLDENS, weights_only=False))
    print(f"{GOLDENS.relative_to(ROOT)}: {n} expected values recorded ({time.time() - t0:.0f}s)")


if __name__ == "__main__":
    main()
