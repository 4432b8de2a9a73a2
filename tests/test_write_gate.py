"""The one write gate (infra/storage.py, atomic_target): every file the project's modules create goes through it.

A scan of the code that a run or a command imports (the top-level modules, infra/, methods/; not tests/,
benchmarks/ or the course's tools) finds every call that can create or write a file and fails when one
stands outside the gate's own functions. Then the gate's promises, each on a planted fault."""
import ast
import errno
import os
from pathlib import Path

import pytest
import torch

from infra import storage

ROOT = Path(__file__).resolve().parents[1]
GATE = {"atomic_target", "atomic_save", "atomic_write_text", "save_tensors", "save_npy", "save_image"}
WRITERS = {"save_file", "save", "to_csv", "write_text", "write_bytes", "NamedTemporaryFile", "mkstemp", "savefig",
           "tofile", "copyfile", "copy2", "copy", "copytree", "open_memmap", "symlink_to", "hardlink_to"}


def writes(tree):
    """[(line, what)] of every call in tree that can create or write a file."""
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Call):
            continue
        f = node.func
        name = f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None
        owner = f.value.id if isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) else None
        if name == "open" and owner in (None, "io", "builtins", "codecs"):
            mode = node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords if k.arg == "mode"),
                                                                 None)
            text = "r" if mode is None else mode.value if isinstance(mode, ast.Constant) else "?"  # computed: writes
            if text == "?" or set(str(text)) & set("wax+"):
                found.append((node.lineno, f"open(..., {text!r})"))
        elif name == "open" and owner == "os":
            flags = ast.unparse(node.args[1]) if len(node.args) > 1 else ""
            if any(w in flags for w in ("O_CREAT", "O_WRONLY", "O_RDWR", "O_APPEND", "O_TRUNC")):
                found.append((node.lineno, f"os.open(..., {flags})"))
        elif name in WRITERS and not (name == "copy" and owner not in ("shutil",)):
            found.append((node.lineno, f"{ast.unparse(f)}(...)"))
    return found


def outside_gate(path):
    """The writes of one file that are not inside the gate's own functions (infra/storage.py)."""
    tree = ast.parse(Path(path).read_text())
    allowed = set()
    if Path(path).resolve() == (ROOT / "infra" / "storage.py").resolve():
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef) and node.name in GATE:
                allowed |= {n.lineno for n in ast.walk(node) if hasattr(n, "lineno")}
    return [(line, what) for line, what in writes(tree) if line not in allowed]


def product_files():
    return sorted([*ROOT.glob("*.py"), *(ROOT / "infra").glob("*.py"), *(ROOT / "methods").glob("*.py")])


def test_no_code_but_the_gate_writes_a_file():
    bad = {str(p.relative_to(ROOT)): w for p in product_files() if (w := outside_gate(p))}
    assert not bad, f"files written outside infra/storage.py's gate (use atomic_target / its forms): {bad}"


def test_the_scan_finds_each_kind_of_write(tmp_path):
    """The scan is not blind: each kind of write, planted in a file, is found."""
    planted = ["open(p, 'w')", "open(p, mode='ab')", "open(p, m)", "os.open(p, os.O_RDWR | os.O_CREAT)",
               "save_file(s, p)", "torch.save(x, p)", "np.save(p, a)", "df.to_csv(p)", "p.write_text('x')",
               "image.save(p)", "tempfile.NamedTemporaryFile()", "shutil.copy(a, b)"]
    for line in planted:
        (tmp_path / "m.py").write_text(f"def f(p, s, x, a, b, m, df, image):\n    {line}\n")
        assert outside_gate(tmp_path / "m.py"), line
    (tmp_path / "m.py").write_text("def f(p):\n    open(p)\n    open(p, 'rb')\n    os.open(p, os.O_RDONLY)\n")
    assert outside_gate(tmp_path / "m.py") == []


def test_a_link_or_a_foreign_file_is_never_written(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    link = tmp_path / "log.txt"
    os.symlink(victim, link)
    with pytest.raises(SystemExit, match="is a link where this program writes a file"):
        storage.atomic_write_text("x", link)
    with pytest.raises(SystemExit, match="exists; pass a new file name"):
        storage.atomic_write_text("x", victim, new=True)
    assert victim.read_text() == "precious" and link.is_symlink()
    assert [p.name for p in tmp_path.iterdir() if p.name.endswith(".tmp")] == []


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS, errno.ENAMETOOLONG, errno.EACCES])
def test_any_failed_write_is_one_line_and_keeps_the_old_file(tmp_path, code):
    target = tmp_path / "metrics.json"
    target.write_text("finished")

    def failing(*a, **k):
        raise OSError(code, os.strerror(code))
    with pytest.raises(SystemExit) as stop:
        with storage.atomic_target(target) as tmp:
            tmp.write_text("half")
            failing()
    line = str(stop.value)
    assert line.startswith(f"error: cannot write {target} (") and "\n" not in line, line
    assert ("no space left" if code == errno.ENOSPC else os.strerror(code)) in line, line
    assert target.read_text() == "finished" and sorted(p.name for p in tmp_path.iterdir()) == ["metrics.json"]


def test_a_librarys_own_error_is_one_line(tmp_path, monkeypatch):
    """safetensors' SafetensorError (a full disk mid-file) is a line naming the file, not a traceback."""
    import safetensors.torch

    def full(*a, **k):
        raise safetensors.SafetensorError("Error while serializing: IoError(No space left on device)")
    monkeypatch.setattr(safetensors.torch, "save_file", full)
    with pytest.raises(SystemExit, match=r"cannot write .*model.safetensors \(SafetensorError"):
        storage.save_tensors({"w": torch.zeros(2)}, tmp_path / "model.safetensors")
    assert list(tmp_path.iterdir()) == []


def test_every_file_gets_the_same_permissions(tmp_path):
    """mkstemp makes 0600; the gate gives every file 0666 less the umask, as open() would."""
    storage.save_tensors({"w": torch.zeros(2)}, tmp_path / "model.safetensors")
    storage.atomic_write_text("{}", tmp_path / "config.json")
    modes = {p.name: p.stat().st_mode & 0o777 for p in tmp_path.iterdir()}
    assert set(modes.values()) == {0o666 & ~storage.UMASK}, modes
