"""A sweep of faults an adversarial user meets on the use surfaces (index, classify, search, table,
aligned.load and the writers), none of them a case of tests/test_command_faults.py: each case plants one
fault in a copy of one tiny finished run, its images or a flag, runs the command as a subprocess (as a user
would: python align.py ...), and sorts the outcome:

    OK          a correct result, or ONE `error:` line on stderr (no traceback) holding the expected words,
                exit status non-zero, no file of the run's or the user's changed, nothing left behind
    TRACEBACK   a Python traceback on stderr
    SILENT      exit 0 with a wrong result (or a fault accepted without a word)
    REFUSED     an error for an input that should give a result
    UNCLEAR     an error, but not one line, or without the words that name the file / flag
    LATE        an error after files were written (the work done, then refused)
    DATA LOSS   a file that existed before the command changed or gone (not one the command owns)
    HANG        still running after its timeout

    OMP_NUM_THREADS=1 python benchmarks/fault_sweep.py --cache-dir .cache [--jobs 2] [--only WORD] [--keep] [--long]

It trains one tiny run (PAL, one epoch, 512 pairs: seconds when the Shapes world is cached) into a temp
folder, then copies it per case. Prints a table and the OK share; exit status 0 when every case is OK.
"""
import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PY = sys.executable
ENV = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", HF_HUB_OFFLINE="1", PYTHONPATH=str(ROOT))
CACHE = None          # --cache-dir, set in main
VERBOSE = LONG = False


# --------------------------------------------------------------------------- fixtures
def build_base(base, cache_dir):
    """One tiny finished run and three Shapes PNGs (64 x 64)."""
    run = base / "runs" / "pal-shapes-seed0"
    r = subprocess.run([PY, "align.py", "--epochs", "1", "--num-pairs", "512", "--eval-images", "20",
                        "--no-figures", "--threads", "1", "--quiet", "--cache-dir", str(cache_dir), "--out", str(run)],
                       cwd=ROOT, env=ENV, capture_output=True, text=True)
    if r.returncode:
        sys.exit(f"the base run failed:\n{r.stderr[-3000:]}")
    imgs = base / "imgs"
    imgs.mkdir()
    code = ("import shapes, sys\nfrom PIL import Image\ns = shapes.cached_world(sys.argv[1])['cls']\n"
            "for i in range(3):\n"
            "    Image.fromarray(s.images[i].permute(1, 2, 0).numpy()).save(sys.argv[2] + f'/{i}.png')\n")
    subprocess.run([PY, "-c", code, str(cache_dir), str(imgs)], cwd=ROOT, env=ENV, check=True)
    return run, imgs


class Ctx:
    """One case's world: r a copy of the finished run, i a copy of its images, t a scratch folder."""

    def __init__(self, folder, run, imgs):
        self.r, self.i, self.t = folder / "runs" / run.name, folder / "imgs", folder / "t"
        shutil.copytree(run, self.r)
        shutil.copytree(imgs, self.i)
        self.t.mkdir()

    def cls(self, *more, run=None, imgs=None, classes="red circle,blue square"):
        c = ["--classes", classes] if classes is not None else []
        return ["classify", str(run or self.r), str(imgs or self.i), *c, "--threads", "1", *more]

    def srch(self, *more, query="a red circle", imgs=None):
        return ["search", str(self.r), str(imgs or self.i), query, "--threads", "1", *more]

    def idx(self, *more, imgs=None):
        return ["index", str(self.r), str(imgs or self.i), "--threads", "1", *more]

    def config(self, change):
        c = json.loads((self.r / "config.json").read_text())
        change(c)
        (self.r / "config.json").write_text(json.dumps(c))

    def index_now(self, *more):
        """An index of the images made now (for the cases that plant a fault in it)."""
        subprocess.run([PY, "align.py", *self.idx(*more)], cwd=ROOT, env=ENV, check=True, capture_output=True)

    def png(self, name, size=(64, 64), mode="RGB", **save):
        from PIL import Image
        p = self.i / name
        p.parent.mkdir(parents=True, exist_ok=True)
        Image.new(mode, size).save(p, **save)
        return p

    def write(self, path, data):
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        (path.write_bytes if isinstance(data, bytes) else path.write_text)(data)
        return path


def snapshot(*folders):
    got = {}
    for f in folders:
        for dirpath, dirnames, filenames in os.walk(f):
            for n in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
                p = os.path.join(dirpath, n)
                try:
                    if os.path.islink(p):
                        got[p] = ("link", os.readlink(p))
                    elif os.path.isfile(p):
                        with open(p, "rb") as fh:
                            got[p] = fh.read()
                    else:
                        got[p] = ("special",)
                except OSError as e:
                    got[p] = ("unreadable", e.errno)
    return got


# --------------------------------------------------------------------------- the cases
CASES = []


def case(name, expect="ok", timeout=60, check=None, owned=()):
    """expect: "ok" (exit 0; check(res, ctx) -> None or what is wrong), or words, one of which the error line
    holds (a "|" between alternatives), or "either" (ok, or any clear error line: either is right).
    owned: paths (relative to the case folder's r/i/t via lambda) the command may write."""
    def register(setup):
        CASES.append(dict(name=name, setup=setup, expect=expect, timeout=timeout, check=check, owned=owned))
        return setup
    return register


def lines(n):
    """check: stdout holds n result lines."""
    def check(res, c):
        got = [x for x in res.out.splitlines() if x.strip()]
        return None if len(got) == n else f"{len(got)} output lines, {n} expected"
    return check


def json_out(n, key=None):
    def check(res, c):
        try:
            rec = json.loads(res.out)
        except ValueError:
            return "stdout is not JSON"
        if len(rec) != n:
            return f"{len(rec)} records, {n} expected"
        return None if key is None or all(key in r for r in rec) else f"a record without {key}"
    return check


def file_holds(name, n_lines):
    def check(res, c):
        p = c.t / name
        if not p.is_file():
            return f"{p} not written"
        got = len(p.read_text().splitlines())
        return None if got == n_lines else f"{p}: {got} lines, {n_lines} expected"
    return check


# ---- the run folder
@case("config model is a list", "config.json")
def _(c):
    c.config(lambda k: k.__setitem__("model", [1, 2]))
    return c.cls()


@case("config model without hp", "config.json")
def _(c):
    c.config(lambda k: k["model"].pop("hp"))
    return c.cls()


@case("config model dims a string", "config.json|model.safetensors")
def _(c):
    c.config(lambda k: k["model"].__setitem__("dims", "wide"))
    return c.cls()


@case("config model null, no legacy keys", "config.json")
def _(c):
    c.config(lambda k: (k.__setitem__("model", None), k.pop("image_layer", None)))
    return c.cls()


@case("config identity a list", "config.json")
def _(c):
    c.config(lambda k: k.__setitem__("identity", [1]))
    return c.cls()


@case("config templates malformed {x}", "config.json|template")
def _(c):
    c.config(lambda k: k["model"].__setitem__("templates", ["a photo of a {x}."]))
    return c.cls()


@case("config templates without {}", "config.json|template")
def _(c):
    c.config(lambda k: k["model"].__setitem__("templates", ["a photo"]))
    return c.cls()


@case("config templates a string", "config.json|template")
def _(c):
    c.config(lambda k: k["model"].__setitem__("templates", "a photo of a {}."))
    return c.cls()


@case("config with unknown hp key", "ok", check=lines(3))
def _(c):
    c.config(lambda k: k["model"]["hp"].__setitem__("no_such_hp", 3))
    return c.cls()


@case("config empty templates list (the default)", "ok", check=lines(3))
def _(c):
    c.config(lambda k: k["model"].__setitem__("templates", []))
    return c.cls()


@case("weights of another method (wrong keys)", "model.safetensors")
def _(c):
    import torch
    from safetensors.torch import save_file
    save_file({"W": torch.zeros(4, 4)}, str(c.r / "model.safetensors"))
    return c.cls()


@case("weights with an extra tensor", "model.safetensors")
def _(c):
    import torch
    from safetensors.torch import load_file, save_file
    s = load_file(str(c.r / "model.safetensors"))
    s["extra"] = torch.zeros(3)
    save_file(s, str(c.r / "model.safetensors"))
    return c.cls()


@case("weights with a NaN", "model.safetensors|NaN|nan")
def _(c):
    from safetensors.torch import load_file, save_file
    s = load_file(str(c.r / "model.safetensors"))
    k = next(k for k, v in s.items() if v.is_floating_point() and v.numel())
    s[k].view(-1)[0] = float("nan")
    save_file(s, str(c.r / "model.safetensors"))
    return c.cls()


@case("weights a link to another run's", "ok", check=lines(3))
def _(c):
    shutil.copy(c.r / "model.safetensors", c.t / "w.safetensors")
    (c.r / "model.safetensors").unlink()
    os.symlink(c.t / "w.safetensors", c.r / "model.safetensors")
    return c.cls()


@case("older run: method.pt of pickled code", "method.pt")
def _(c):
    import torch
    (c.r / "model.safetensors").unlink()
    torch.save({"x": Path("evil")}, c.r / "method.pt")
    return c.cls()


@case("older run: both files, method.pt junk", "ok", check=lines(3))
def _(c):
    c.write(c.r / "method.pt", b"junk")
    return c.cls()


@case("metrics.json a folder", "metrics.json|unfinished")
def _(c):
    (c.r / "metrics.json").unlink()
    (c.r / "metrics.json").mkdir()
    return c.cls()


@case("metrics.json not JSON (classify needs none)", "ok", check=lines(3))
def _(c):
    c.write(c.r / "metrics.json", "{oops")
    return c.cls()


@case("run path with a trailing slash", "ok", check=lines(3))
def _(c):
    return c.cls(run=str(c.r) + "/")


@case("run folder named with spaces and unicode", "ok", check=lines(3))
def _(c):
    new = c.r.parent / "my run é ✓"
    c.r.rename(new)
    c.r = new
    return c.cls()


@case("run cache_dir a file", "ok", check=lines(3), timeout=120)
def _(c):
    c.config(lambda k: k["model"].__setitem__("cache_dir", str(c.write(c.t / "cachefile", "x"))))
    return c.cls()


@case("run folder a link loop", "not a folder|config.json")
def _(c):
    os.symlink(c.t / "loop", c.t / "loop")
    return c.cls(run=c.t / "loop")


@case("config.json a fifo", "config.json", timeout=30)
def _(c):
    (c.r / "config.json").unlink()
    os.mkfifo(c.r / "config.json")
    return c.cls()


@case("weights a link to /dev/zero", "model.safetensors|method.pt", timeout=30)
def _(c):
    (c.r / "model.safetensors").unlink()
    os.symlink("/dev/zero", c.r / "model.safetensors")
    return c.cls()


# ---- the images
@case("an image a link to /dev/zero in the folder", "ok", check=lines(3), timeout=30)
def _(c):
    os.symlink("/dev/zero", c.i / "z.png")
    return c.cls()


@case("PNG with a broken chunk CRC", "bad.png|ok")
def _(c):
    p = c.png("bad.png", size=(30, 30))
    data = bytearray(p.read_bytes())
    data[-20] ^= 0xFF                                         # inside IDAT's data or CRC
    p.write_bytes(bytes(data))
    return c.cls()


@case("bilevel (mode 1) image", "ok", check=lines(4))
def _(c):
    c.png("bw.png", mode="1")
    return c.cls()


@case("multi-page TIFF", "ok", check=lines(4))
def _(c):
    from PIL import Image
    frames = [Image.new("RGB", (20, 20), col) for col in ("red", "green")]
    frames[0].save(c.i / "pages.tif", save_all=True, append_images=frames[1:])
    return c.cls()


@case("16-bit grey PNG", "ok", check=lines(4))
def _(c):
    c.png("g16.png", mode="I;16")
    return c.cls()


@case("palette PNG with transparency", "ok", check=lines(4))
def _(c):
    from PIL import Image
    im = Image.new("P", (20, 20))
    im.save(c.i / "p.png", transparency=0)
    return c.cls()


@case("animated GIF", "ok", check=lines(4))
def _(c):
    from PIL import Image
    frames = [Image.new("RGB", (30, 30), col) for col in ("red", "blue")]
    frames[0].save(c.i / "a.gif", save_all=True, append_images=frames[1:])
    return c.cls()


@case("LA image", "ok", check=lines(4))
def _(c):
    c.png("la.png", mode="LA")
    return c.cls()


@case("float TIFF", "ok", check=lines(4))
def _(c):
    c.png("f.tif", mode="F")
    return c.cls()


@case("BMP and WEBP", "ok", check=lines(5))
def _(c):
    c.png("b.bmp")
    c.png("w.webp")
    return c.cls()


@case("PNG named .jpg", "ok", check=lines(4))
def _(c):
    c.png("really-png.jpg")
    return c.cls()


@case("JPEG with EXIF rotation", "ok", check=lines(4))
def _(c):
    from PIL import Image
    im = Image.new("RGB", (40, 20))
    exif = im.getexif()
    exif[0x0112] = 6
    im.save(c.i / "rot.jpg", exif=exif)
    return c.cls()


@case("huge-dimension header (a bomb)", "big.png")
def _(c):
    import struct
    import zlib
    def chunk(kind, data):
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
    ihdr = struct.pack(">IIBBBBB", 60000, 60000, 8, 2, 0, 0, 0)
    c.write(c.i / "big.png", b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) +
            chunk(b"IDAT", zlib.compress(b"\0" * 100)) + chunk(b"IEND", b""))
    return c.cls()


@case("tall thin image 1x4000", "ok", check=lines(4))
def _(c):
    c.png("thin.png", size=(1, 4000))
    return c.cls()


@case("unicode and spaces in image names", "ok", check=lines(4))
def _(c):
    c.png("sub dir/ünï cødé ✓.png")
    return c.cls()


@case("a fifo named x.png in the folder", "ok", check=lines(3), timeout=30)
def _(c):
    os.mkfifo(c.i / "x.png")
    return c.cls()


@case("a fifo named x.png given", "x.png", timeout=30)
def _(c):
    os.mkfifo(c.i / "x.png")
    return c.cls(imgs=c.i / "x.png")


@case("a link loop inside the images", "ok", check=lines(3), timeout=60)
def _(c):
    os.symlink(c.i, c.i / "loop")
    return c.cls()


@case("the same image twice", "ok", check=lines(2))
def _(c):
    return ["classify", str(c.r), str(c.i / "0.png"), str(c.i / "0.png"), "--classes", "a,b", "--threads", "1"]


@case("a .txt given as a file", "notes.txt")
def _(c):
    c.write(c.i / "notes.txt", "hello")
    return c.cls(imgs=c.i / "notes.txt")


@case("an image deleted between scan and decode", "0.png", owned=("imgs/0.png",))
def _(c):
    code = f"""
import os, sys, data, aligned
scan = data.file_scan
def gone(files, **k):
    out = scan(files, **k); os.unlink({str(c.i / '0.png')!r}); return out
data.file_scan = gone
aligned.main({c.cls()!r})
"""
    return ["-c", code]


@case("an image cut short past its header (JPEG)", "cut.jpg")
def _(c):
    import numpy as np
    from PIL import Image
    Image.fromarray((np.random.rand(200, 200, 3) * 255).astype("uint8")).save(c.i / "cut.jpg", quality=95)
    data = (c.i / "cut.jpg").read_bytes()
    (c.i / "cut.jpg").write_bytes(data[:len(data) // 3])
    return c.cls()


# ---- the flags
@case("--top larger than the classes", "ok", check=lines(3))
def _(c):
    return c.cls("--top", "5")


@case("--top 1", "ok", check=lines(3))
def _(c):
    return c.cls("--top", "1")


@case("--top not a number", "--top")
def _(c):
    return c.cls("--top", "many")


@case("--classes a blank among names", "ok", check=lines(3))
def _(c):
    return c.cls(classes="red circle,   ,blue square")


@case("--classes a name with braces", "ok", check=lines(3))
def _(c):
    return c.cls(classes="red {0},blue {},green {x}")     # words the Shapes text encoder tells apart


@case("--classes and --classes-file both", "--classes")
def _(c):
    c.write(c.t / "c.txt", "cat\ndog\n")
    return c.cls("--classes-file", str(c.t / "c.txt"))


@case("--classes-file with a BOM", "ok")
def _(c):
    c.write(c.t / "c.txt", "\ufeffred circle\nblue square\n".encode("utf-8"))
    return ["classify", str(c.r), str(c.i), "--classes-file", str(c.t / "c.txt"), "--json", "-", "--threads", "1"]


def bom_check(res, c):
    try:
        rec = json.loads(res.out)
    except ValueError:
        return "stdout is not JSON"
    names = set(rec[0]["scores"])
    return None if names == {"red circle", "blue square"} else f"class names {sorted(names)!r}"


CASES[-1]["check"] = bom_check


@case("--classes-file CRLF lines", "ok", check=lines(3))
def _(c):
    c.write(c.t / "c.txt", b"red circle\r\nblue square\r\n")
    return ["classify", str(c.r), str(c.i), "--classes-file", str(c.t / "c.txt"), "--threads", "1"]


@case("--classes-file a fifo", "--classes-file", timeout=30)
def _(c):
    os.mkfifo(c.t / "c.txt")
    return ["classify", str(c.r), str(c.i), "--classes-file", str(c.t / "c.txt"), "--threads", "1"]


@case("--classes-file /dev/null", "names no class|--classes-file")
def _(c):
    return ["classify", str(c.r), str(c.i), "--classes-file", "/dev/null", "--threads", "1"]


@case("--classes-file names twice", "twice")
def _(c):
    c.write(c.t / "c.txt", "cat\ndog\ncat\n")
    return ["classify", str(c.r), str(c.i), "--classes-file", str(c.t / "c.txt"), "--threads", "1"]


@case("2,000 classes", "ok", check=lines(3), timeout=120)
def _(c):
    objects = [f"{c} {s}" for c in ("red", "green", "blue", "yellow", "purple", "orange")      # words the Shapes
               for s in ("circle", "square", "triangle", "cross")]                           # text encoder knows
    names = [f"{a} {rel} {b}" for a in objects for rel in ("left of", "right of", "above", "below") for b in objects]
    return c.cls(classes=",".join(names[:2000]))


@case("--csv /dev/stdout", "exists|--csv")
def _(c):
    return c.cls("--csv", "/dev/stdout")


@case("--template empty", "--template")
def _(c):
    return c.cls("--template", "")


@case("--template %s", "--template")
def _(c):
    return c.cls("--template", "a photo of a %s")


@case("--template the same twice", "ok", check=lines(3))
def _(c):
    return c.cls("--template", "a {}", "--template", "a {}")


@case("--batch-size 0", "--batch-size")
def _(c):
    return c.cls("--batch-size", "0")


@case("--batch-size 100000", "ok", check=lines(3))
def _(c):
    return c.cls("--batch-size", "100000")


@case("--workers -1", "--workers")
def _(c):
    return c.cls("--workers", "-1")


@case("--threads -3", "--threads")
def _(c):
    return ["classify", str(c.r), str(c.i), "--classes", "a,b", "--threads", "-3"]


@case("--device nope", "--device")
def _(c):
    return c.cls("--device", "nope")


# ---- the writers: --json / --csv
@case("--json onto an existing file", "exists")
def _(c):
    c.write(c.t / "mine.json", "mine")
    return c.cls("--json", str(c.t / "mine.json"))


@case("--json in a missing folder", "does not exist")
def _(c):
    return c.cls("--json", str(c.t / "no" / "x.json"))


@case("--json a 300-char name", "cannot write|name too long|--json")
def _(c):
    return c.cls("--json", str(c.t / ("j" * 300)))


@case("--csv and --json the same new file", "--csv|--json")
def _(c):
    return c.cls("--csv", str(c.t / "same"), "--json", str(c.t / "same"))


@case("--csv - and --json -", "stdout")
def _(c):
    return c.cls("--csv", "-", "--json", "-")


@case("--json - alone", "ok", check=json_out(3, "class"))
def _(c):
    return c.cls("--json", "-")


@case("--csv and --json both files", "ok", check=lambda res, c: file_holds("o.csv", 4)(res, c) or (
      None if len(json.loads((c.t / "o.json").read_text())) == 3 else "o.json: not 3 records"))
def _(c):
    return c.cls("--csv", str(c.t / "o.csv"), "--json", str(c.t / "o.json"))


@case("--json onto the run's model.safetensors", "exists")
def _(c):
    return c.cls("--json", str(c.r / "model.safetensors"))


@case("--csv a trailing-slash name", "--csv")
def _(c):
    return c.cls("--csv", str(c.t / "out") + "/")


@case("--csv in a read-only file system (EROFS at write)", "cannot write")
def _(c):
    code = f"""
import errno, os, aligned
from infra import storage
real = os.replace
def ro(a, b):
    raise OSError(errno.EROFS, "Read-only file system", str(b))
storage.os.replace = ro
aligned.main({c.cls("--csv", str(c.t / "o.csv"))!r})
"""
    return ["-c", code]


@case("--json on a full disk (ENOSPC at write)", "no space")
def _(c):
    code = f"""
import errno, aligned
from pathlib import Path
def full(self, *a, **k):
    raise OSError(errno.ENOSPC, "No space left on device")
Path.write_text = full
aligned.main({c.cls("--json", str(c.t / "o.json"))!r})
"""
    return ["-c", code]


# ---- search
@case("search a 10,000-character query", "ok", check=lines(3))
def _(c):
    return c.srch(query="red circle " * 910)


@case("search 500 queries", "ok", check=lines(1500), timeout=120)
def _(c):
    return ["search", str(c.r), str(c.i), *[f"query {n}" for n in range(500)], "--threads", "1"]


@case("search an emoji query", "ok", check=lines(3))
def _(c):
    return c.srch(query="🔴 ⭕ circle")


@case("search --json -", "ok", check=json_out(3, "rank"))
def _(c):
    return c.srch("--json", "-")


@case("search --top 1 of two queries", "ok", check=lines(2))
def _(c):
    return ["search", str(c.r), str(c.i), "a red circle", "a blue square", "--top", "1", "--threads", "1"]


@case("search a folder given twice as the folder", "ok", check=lines(3))
def _(c):
    return c.srch(imgs=str(c.i) + "/./")


# ---- the index
IDX = "runs/pal-shapes-seed0/index"


@case("index then classify reads it", "ok", check=lines(3), owned=(IDX,))
def _(c):
    c.index_now()
    return c.cls()


@case("index truncated, classify", "images.safetensors", owned=(IDX,))
def _(c):
    c.index_now()
    p = c.r / "index" / "images.safetensors"
    p.write_bytes(p.read_bytes()[:100])
    return c.cls()


@case("index truncated, index again", "images.safetensors|ok", owned=(IDX,))
def _(c):
    c.index_now()
    p = c.r / "index" / "images.safetensors"
    p.write_bytes(p.read_bytes()[:100])
    return c.idx()


@case("index keys and emb of other lengths", "images.safetensors", owned=(IDX,))
def _(c):
    c.index_now()
    from safetensors import safe_open
    from safetensors.torch import save_file
    p = c.r / "index" / "images.safetensors"
    with safe_open(str(p), "pt") as f:
        meta, emb = f.metadata(), f.get_tensor("emb")
    save_file({"emb": emb[:2]}, str(p), metadata=meta)
    return c.cls()


@case("index emb of other width, same run key", "images.safetensors", owned=(IDX,))
def _(c):
    c.index_now()
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file
    p = c.r / "index" / "images.safetensors"
    with safe_open(str(p), "pt") as f:
        meta, emb = f.metadata(), f.get_tensor("emb")
    save_file({"emb": torch.zeros(len(emb), 7)}, str(p), metadata=meta)
    return c.cls()


@case("index without run_key", "images.safetensors", owned=(IDX,))
def _(c):
    c.index_now()
    from safetensors import safe_open
    from safetensors.torch import save_file
    p = c.r / "index" / "images.safetensors"
    with safe_open(str(p), "pt") as f:
        meta, emb = f.metadata(), f.get_tensor("emb")
    meta.pop("run_key")
    save_file({"emb": emb}, str(p), metadata=meta)
    return c.cls()


@case("index keys not JSON", "images.safetensors", owned=(IDX,))
def _(c):
    c.index_now()
    from safetensors import safe_open
    from safetensors.torch import save_file
    p = c.r / "index" / "images.safetensors"
    with safe_open(str(p), "pt") as f:
        meta, emb = f.metadata(), f.get_tensor("emb")
    meta["keys"] = "[oops"
    save_file({"emb": emb}, str(p), metadata=meta)
    return c.cls()


@case("index an image touched since", "ok", check=lines(3), owned=(IDX,))
def _(c):
    c.index_now()
    os.utime(c.i / "0.png", ns=(time.time_ns(), time.time_ns() + 10**9))
    return c.cls()


@case("index: images.safetensors is a folder", "images.safetensors", owned=(IDX,))
def _(c):
    (c.r / "index" / "images.safetensors").mkdir(parents=True)
    return c.idx()


@case("index: images.safetensors is a link", "images.safetensors", owned=(IDX,))
def _(c):
    c.write(c.t / "victim", "mine")
    (c.r / "index").mkdir()
    os.symlink(c.t / "victim", c.r / "index" / "images.safetensors")
    return c.idx()


@case("index: the run's index is a file", "index")
def _(c):
    c.write(c.r / "index", "mine")
    return c.idx()


@case("index --index is a file", "--index")
def _(c):
    c.write(c.t / "idx", "mine")
    return c.idx("--index", str(c.t / "idx"))


@case("classify --index a missing folder (none yet)", "ok", check=lines(3))
def _(c):
    return c.cls("--index", str(c.t / "none"))


@case("index into a read-only folder (EROFS at write)", "cannot write", owned=(IDX,))
def _(c):
    code = f"""
import errno, aligned
from infra import storage
def ro(*a, **k):
    raise OSError(errno.EROFS, "Read-only file system")
storage.tempfile.mkstemp = ro
aligned.main({c.idx()!r})
"""
    return ["-c", code]


@case("index on a full disk keeps the old index", "no space", owned=(IDX,))
def _(c):
    c.index_now()
    c.png("new.png")
    code = f"""
import errno, aligned
import safetensors.torch as st
def full(*a, **k):
    raise OSError(errno.ENOSPC, "No space left on device")
st.save_file = full
aligned.main({c.idx()!r})
"""
    return ["-c", code]


def old_index_whole(res, c):
    """check: the index still loads, with at least the images indexed before."""
    code = (f"import aligned\ni = aligned.Index.load({str(c.r / 'index')!r})\n"
            f"print(len(i) if i is not None else -1)")
    r = subprocess.run([PY, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True)
    n = int(r.stdout.strip() or -2) if r.returncode == 0 else -3
    return None if n >= 3 else f"the index after: {n} images ({r.stderr.strip()[-200:]})"


@case("two index calls at once, two folders", "ok", owned=(IDX,), timeout=120)
def _(c):
    other = c.t / "more"
    other.mkdir()
    for n in range(3):
        shutil.copy(c.i / f"{n}.png", other / f"m{n}.png")
    return ("parallel", [c.idx(), c.idx(imgs=other)])


def both_folders(res, c):
    code = (f"import aligned\ni = aligned.Index.load({str(c.r / 'index')!r})\nprint(len(i))")
    r = subprocess.run([PY, "-c", code], cwd=ROOT, env=ENV, capture_output=True, text=True)
    got = r.stdout.strip() or r.stderr[-200:]
    return None if got == "6" else f"the index holds {got} images, 6 expected"


CASES[-1]["check"] = both_folders


def slowly(argv):
    """argv run with each batch's forward slowed to 0.3 s (a long encode to interrupt)."""
    return ["-c", "import time, aligned\nforward = aligned.Aligned.forward\n"
            "def slow(self, x):\n    time.sleep(0.3)\n    return forward(self, x)\n"
            f"aligned.Aligned.forward = slow\naligned.main({argv!r})\n"]


def many_images(c, n=100):
    import numpy as np
    from PIL import Image
    d = c.t / "many"
    d.mkdir()
    rng = np.random.default_rng(0)
    for k in range(n):
        Image.fromarray((rng.random((96, 96, 3)) * 255).astype("uint8")).save(d / f"{k}.png")
    return d


@case("Ctrl-C during index keeps the old index", "interrupted", owned=(IDX,), check=old_index_whole, timeout=120)
def _(c):
    c.index_now()
    return ("signal", slowly(c.idx("--batch-size", "4", imgs=many_images(c))), signal.SIGINT)


@case("kill -9 during index keeps the old index", "killed", owned=(IDX,), check=old_index_whole, timeout=120)
def _(c):
    c.index_now()
    return ("signal", slowly(c.idx("--batch-size", "4", imgs=many_images(c))), signal.SIGKILL)


@case("SIGTERM during index keeps the old index", "killed", owned=(IDX,), check=old_index_whole, timeout=120)
def _(c):
    c.index_now()
    return ("signal", slowly(c.idx("--batch-size", "4", imgs=many_images(c))), signal.SIGTERM)


@case("Ctrl-C while the run loads (before any work)", "interrupted", timeout=60)
def _(c):
    return ("signal", ["-c", "import time, aligned\nload = aligned.load\n"
                       "def slow(*a, **k):\n    time.sleep(30)\n    return load(*a, **k)\n"
                       f"aligned.load = slow\naligned.main({c.cls('--json', str(c.t / 'o.json'))!r})\n"],
            signal.SIGINT)


@case("Ctrl-C during classify --json writes nothing", "interrupted", timeout=120)
def _(c):
    return ("signal", slowly(c.cls("--batch-size", "4", "--json", str(c.t / "o.json"), imgs=many_images(c))),
            signal.SIGINT)


@case("kill -9 during classify --csv leaves no file", "killed", timeout=120)
def _(c):
    return ("signal", slowly(c.cls("--batch-size", "4", "--csv", str(c.t / "o.csv"), imgs=many_images(c))),
            signal.SIGKILL)


def train_argv(c, *more):
    return ["--epochs", "60", "--num-pairs", "512", "--eval-images", "20", "--no-figures", "--threads", "1",
            "--cache-dir", str(CACHE), "--out", str(c.t / "train"), *more]


def resumes(res, c):
    """check: the interrupted run's checkpoint is there and --resume finishes it."""
    if not (c.t / "train" / "checkpoint.pt").is_file():
        return "no checkpoint.pt after the interruption"
    r = subprocess.run([PY, "align.py", *train_argv(c, "--resume")], cwd=ROOT, env=ENV, capture_output=True,
                       text=True, timeout=300)
    if r.returncode or not (c.t / "train" / "metrics.json").is_file():
        return f"--resume failed: {r.stderr.strip().splitlines()[-1:]}"
    return None


@case("Ctrl-C during training, then --resume", "interrupted", check=resumes, timeout=300, owned=("t/train",))
def _(c):
    return ("signal", train_argv(c), signal.SIGINT, c.t / "train" / "checkpoint.pt")


@case("kill -9 during training, then --resume", "killed", check=resumes, timeout=300, owned=("t/train",))
def _(c):
    return ("signal", train_argv(c), signal.SIGKILL, c.t / "train" / "checkpoint.pt")


def fresh_cache(c):
    """A cache folder holding the Shapes world alone (no feature extracted yet)."""
    (c.t / "cache" / "world").mkdir(parents=True)
    for f in (CACHE / "world").glob("shapes-world-*.pt"):
        shutil.copy(f, c.t / "cache" / "world" / f.name)
    return c.t / "cache"


def extraction_argv(c):
    return ["--epochs", "1", "--num-pairs", "512", "--eval-images", "20", "--no-figures", "--threads", "1",
            "--cache-dir", str(c.t / "cache"), "--out", str(c.t / "train")]


def extraction_goes_on(res, c):
    """check: what was extracted before the kill is still whole, and the rerun finishes the run."""
    done = {p.name: p.stat().st_mtime_ns for p in (c.t / "cache" / "features").glob("*.pt")}
    r = subprocess.run([PY, "align.py", *extraction_argv(c), "--resume"], cwd=ROOT, env=ENV, capture_output=True,
                       text=True, timeout=600)
    if r.returncode:
        r = subprocess.run([PY, "align.py", *extraction_argv(c)], cwd=ROOT, env=ENV, capture_output=True, text=True,
                           timeout=600)
    if r.returncode or not (c.t / "train" / "metrics.json").is_file():
        return f"the rerun failed: {r.stderr.strip().splitlines()[-1:]}"
    redone = [n for n, t in done.items() if (c.t / "cache" / "features" / n).stat().st_mtime_ns != t]
    return f"extracted again: {redone}" if redone else None


@case("kill -9 during feature extraction, then rerun (--long)", "killed", check=extraction_goes_on, timeout=900,
      owned=("t/train", "t/cache"))
def _(c):
    if not LONG:
        raise RuntimeError("a long case (minutes of extraction): pass --long")
    fresh_cache(c)
    first = c.t / "cache" / "features"
    return ("signal", extraction_argv(c), signal.SIGKILL, first, 12.0)


# ---- table
@case("table nested run folders", "ok")
def _(c):
    group = c.t / "results" / "group"
    group.mkdir(parents=True)
    shutil.copytree(c.r, c.t / "results" / "top-run")
    shutil.copytree(c.r, group / "deep-run")
    return ["table", str(c.t / "results")]


CASES[-1]["check"] = lambda res, c: None if "deep-run" in res.out and "top-run" in res.out else \
    "a nested run is missing from the table"


@case("table a metrics.json that is a fifo beside a good run", "ok", timeout=30,
      check=lambda res, c: None if "pal-shapes-seed0" in res.out else "the good run is missing")
def _(c):
    (c.r.parent / "odd").mkdir()
    os.mkfifo(c.r.parent / "odd" / "metrics.json")
    c.write(c.r.parent / "odd" / "config.json", (c.r / "config.json").read_text())
    return ["table", str(c.r.parent)]


@case("table a results folder and a run in it", "ok",
      check=lambda res, c: None if res.out.count("pal-shapes-seed0") == 1 else "not one row")
def _(c):
    return ["table", str(c.r.parent), str(c.r.parent / "." / c.r.name)]


@case("table metrics.json missing a key", "ok", check=lambda res, c: None if "pal-shapes-seed0" in res.out
      else "the run is missing")
def _(c):
    m = json.loads((c.r / "metrics.json").read_text())
    m.pop(next(iter(m)))
    (c.r / "metrics.json").write_text(json.dumps(m))
    return ["table", str(c.r)]


@case("table metrics.json a list", "no finished run")
def _(c):
    c.write(c.r / "metrics.json", "[1, 2]")
    return ["table", str(c.r)]


@case("table metrics with NaN", "ok", check=lambda res, c: None if "pal-shapes-seed0" in res.out else "missing")
def _(c):
    m = json.loads((c.r / "metrics.json").read_text())
    m["extra_nan"] = float("nan")
    (c.r / "metrics.json").write_text(json.dumps(m))
    return ["table", str(c.r)]


@case("table a results folder with a link loop", "ok", timeout=30,
      check=lambda res, c: None if "pal-shapes-seed0" in res.out else "missing")
def _(c):
    os.symlink(c.r.parent, c.r.parent / "loop")
    return ["table", str(c.r.parent)]


@case("table the same run twice", "ok", check=lambda res, c: None if res.out.count("pal-shapes-seed0") == 1
      else f"{res.out.count('pal-shapes-seed0')} rows")
def _(c):
    return ["table", str(c.r), str(c.r)]


@case("table an older run (no model)", "ok", check=lambda res, c: None if "pal-shapes-seed0" in res.out else "missing")
def _(c):
    c.config(lambda k: k.pop("model"))
    return ["table", str(c.r)]


@case("table config without method/seed", "ok", check=lambda res, c: None if "pal-shapes-seed0" in res.out
      else "missing")
def _(c):
    c.config(lambda k: [k.pop(x, None) for x in ("method", "seed", "epochs", "data")])
    return ["table", str(c.r)]


@case("table a file given", "not a folder|no finished run|metrics")
def _(c):
    return ["table", str(c.r / "config.json")]


@case("table --csv -", "ok", check=lines(2))
def _(c):
    return ["table", str(c.r), "--csv", "-"]


@case("table --csv in a missing folder", "does not exist")
def _(c):
    return ["table", str(c.r), "--csv", str(c.t / "no" / "t.csv")]


@case("table --metrics all", "ok", check=lambda res, c: None if res.out.count("\n") >= 3 else "no rows")
def _(c):
    return ["table", str(c.r), "--metrics", "all"]


@case("table a run whose metrics.json is 0 bytes beside a good one", "ok",
      check=lambda res, c: None if "pal-shapes-seed0" in res.out and "broken" in res.err else "not said")
def _(c):
    shutil.copytree(c.r, c.r.parent / "broken")
    c.write(c.r.parent / "broken" / "metrics.json", "")
    return ["table", str(c.r.parent)]


# ---- aligned.load (the API)
def api(c, body):
    return ["-c", "import aligned\n" + textwrap.dedent(body)]


@case("load device='cuda' without a GPU", "CUDA|cuda")
def _(c):
    return api(c, f"aligned.load({str(c.r)!r}, device='cuda')")


@case("load with cache_dir given, then search one image", "ok")
def _(c):
    return api(c, f"m = aligned.load({str(c.r)!r}, cache_dir={str(CACHE)!r})\n"
                  f"print(m.search([{str(c.i / '0.png')!r}], 'x').shape)")


@case("load a str path with ~ unexpanded", "not a folder")
def _(c):
    return api(c, "aligned.load('~/surely-no-such-run')")


@case("load a run folder that is a file", "not a folder")
def _(c):
    return api(c, f"aligned.load({str(c.r / 'config.json')!r})")


@case("load device='mps'", "device|mps")
def _(c):
    return api(c, f"aligned.load({str(c.r)!r}, device='mps')")


@case("load with cache_dir a missing folder", "cache_dir|no-cache")
def _(c):
    return api(c, f"aligned.load({str(c.r)!r}, cache_dir={str(c.t / 'no-cache')!r})")


@case("load, zero_shot on a missing image", "nope.png")
def _(c):
    return api(c, f"m = aligned.load({str(c.r)!r})\nm.zero_shot([{str(c.i / 'nope.png')!r}], ['a', 'b'])")


@case("load, zero_shot with no class", "class")
def _(c):
    return api(c, f"m = aligned.load({str(c.r)!r})\nm.zero_shot([{str(c.i / '0.png')!r}], [])")


@case("load while another process rewrites config.json", "either", timeout=120)
def _(c):
    code = f"""
import json, os, threading, time, aligned
from pathlib import Path
p = Path({str(c.r / 'config.json')!r}); text = p.read_text(); stop = False
def churn():
    from infra.storage import atomic_write_text
    while not stop:
        atomic_write_text(text, p)
t = threading.Thread(target=churn, daemon=True); t.start()
for _ in range(5):
    aligned.load({str(c.r)!r})
stop = True
print("ok")
"""
    return ["-c", code]


# --------------------------------------------------------------------------- running and sorting
class Res:
    def __init__(self, rc, out, err, seconds, timed_out):
        self.rc, self.out, self.err, self.seconds, self.timed_out = rc, out, err, seconds, timed_out


def launch(argv):
    cmd = [PY, *argv] if argv[0] == "-c" else [PY, "align.py", *argv]
    return subprocess.Popen(cmd, cwd=ROOT, env=ENV, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=default_sigint)


def default_sigint():
    """Ctrl-C as a terminal delivers it: a sweep started in the background (nohup ... &) has SIGINT ignored,
    and a child would inherit that."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


def finish(p, t0, timeout):
    try:
        out, err = p.communicate(timeout=max(1, timeout - (time.time() - t0)))
        return Res(p.returncode, out, err, time.time() - t0, False)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        return Res(p.returncode, out, err, time.time() - t0, True)


def execute(spec, timeout):
    t0 = time.time()
    if isinstance(spec, tuple) and spec[0] == "parallel":
        ps = [launch(a) for a in spec[1]]
        rs = [finish(p, t0, timeout) for p in ps]
        bad = next((r for r in rs if r.rc or r.timed_out), rs[-1])
        return Res(bad.rc, "".join(r.out for r in rs), "".join(r.err for r in rs), time.time() - t0,
                   any(r.timed_out for r in rs))
    if isinstance(spec, tuple) and spec[0] == "signal":
        argv, sig = spec[1], spec[2]
        wait_for = spec[3] if len(spec) > 3 else None
        p = launch(argv)
        deadline = t0 + timeout / 2
        if wait_for is not None:                               # the signal once that file exists (and then some)
            while not Path(wait_for).exists() and p.poll() is None and time.time() < deadline:
                time.sleep(0.05)
            time.sleep(spec[4] if len(spec) > 4 else 0.3)
        else:                                                  # the signal once the work has begun
            time.sleep(6)
        if p.poll() is not None:
            out, err = p.communicate()
            return Res(p.returncode, out, "(finished before the signal) " + err, time.time() - t0, False)
        p.send_signal(sig)
        res = finish(p, t0, timeout)
        if sig != signal.SIGINT and res.rc == -sig:
            res.err += "\nerror: killed (the signal was sent)"
        return res
    return finish(launch(spec), t0, timeout)


def sort_outcome(c, res, expect, check, before, after, owned):
    def is_owned(p):
        return any(p == o or p.startswith(o + os.sep) for o in owned)
    lost = [p for p, b in before.items() if not is_owned(p) and after.get(p) != b]
    if lost:
        return "DATA LOSS", f"changed or gone: {', '.join(lost[:3])}"
    if res.timed_out:
        return "HANG", f"still running after {res.seconds:.0f}s"
    if "Traceback (most recent call last)" in res.err:
        tail = [x for x in res.err.strip().splitlines() if x.strip()][-1:]
        return "TRACEBACK", tail[0][:200] if tail else ""
    new = [p for p in after if p not in before and not is_owned(p) and not os.path.basename(p).startswith(".")]
    errs = [x for x in res.err.splitlines() if "error:" in x or x.startswith("interrupted")]
    if expect == "either":
        expect = "ok" if res.rc == 0 else ""
    if expect.startswith("ok") or (res.rc == 0 and "ok" in expect.split("|")):
        if res.rc != 0:
            return "REFUSED", (errs or res.err.strip().splitlines() or ["?"])[-1][:200]
        why = check(res, c) if check else None
        return ("SILENT", why) if why else ("OK", "")
    if res.rc == 0:
        return "SILENT", "exit 0: " + (res.out.strip().splitlines() or [""])[0][:150]
    if len(errs) != 1 or (expect and not any(w in errs[0] for w in expect.split("|"))):
        return "UNCLEAR", " / ".join(errs)[:200] or (res.err.strip().splitlines() or ["no stderr"])[-1][:200]
    if new:
        return "LATE", f"{errs[0][:120]} after writing {', '.join(map(os.path.basename, new[:2]))}"
    why = check(res, c) if check else None
    return ("SILENT", why) if why else ("OK", errs[0][:160])


def run_case(k, spec, base_run, imgs, work):
    folder = work / f"case{k:03d}"
    folder.mkdir()
    c = Ctx(folder, base_run, imgs)
    try:
        argv = spec["setup"](c)
    except Exception as e:                                  # a fixture this system cannot make (no mkfifo, ...)
        return spec["name"], "SKIPPED", f"setup: {type(e).__name__}: {e}", 0.0
    before = snapshot(c.r.parent, c.i, c.t)
    res = execute(argv, spec["timeout"])
    after = snapshot(c.r.parent, c.i, c.t)
    owned = [str(folder / o) for o in spec["owned"]]
    outcome, why = sort_outcome(c, res, spec["expect"], spec["check"], before, after, owned)
    if VERBOSE:
        print(f"--- {spec['name']}: rc {res.rc}\n{res.out[-1500:]}\n--- stderr\n{res.err[-1500:]}", flush=True)
    for p in c.r.parent, c.i, c.t:                           # undo what setups locked
        for dirpath, dirnames, _ in os.walk(p):
            for d in dirnames:
                try:
                    os.chmod(os.path.join(dirpath, d), 0o755)
                except OSError:
                    pass
    return spec["name"], outcome, why, res.seconds


def main():
    global CACHE, VERBOSE, LONG
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--cache-dir", default=str(ROOT / ".cache"))
    p.add_argument("--jobs", type=int, default=2, help="cases run at once (default: 2)")
    p.add_argument("--only", default=None, help="only the cases whose name holds this")
    p.add_argument("--keep", action="store_true", help="keep the temp folder")
    p.add_argument("--verbose", action="store_true", help="print each case's stdout and stderr")
    p.add_argument("--long", action="store_true", help="also the cases that take minutes (a kill during feature "
                   "extraction into a fresh cache, then the rerun)")
    a = p.parse_args()
    CACHE, VERBOSE, LONG = Path(a.cache_dir).absolute(), a.verbose, a.long
    work = Path(tempfile.mkdtemp(prefix="fault-sweep-"))
    t0 = time.time()
    try:
        base_run, imgs = build_base(work / "base", CACHE)
        todo = [(k, s) for k, s in enumerate(CASES) if not a.only or a.only in s["name"]]
        with ThreadPoolExecutor(a.jobs) as pool:
            results = list(pool.map(lambda ks: run_case(ks[0], ks[1], base_run, imgs, work), todo))
    finally:
        if not a.keep:
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"kept {work}")
    width = max(len(r[0]) for r in results)
    print(f"{'case':<{width}}  {'outcome':<9}  {'s':>5}  detail")
    for name, outcome, why, s in results:
        print(f"{name:<{width}}  {outcome:<9}  {s:5.1f}  {why}")
    ok = sum(r[1] == "OK" for r in results)
    counted = [r for r in results if r[1] != "SKIPPED"]
    print(f"\n{ok}/{len(counted)} OK ({100 * ok / max(len(counted), 1):.0f}%), "
          f"{len(results) - len(counted)} skipped, {time.time() - t0:.0f}s")
    for kind in ("TRACEBACK", "SILENT", "DATA LOSS", "HANG", "LATE", "UNCLEAR", "REFUSED"):
        n = sum(r[1] == kind for r in results)
        if n:
            print(f"  {kind}: {n}")
    sys.exit(0 if ok == len(counted) else 1)


if __name__ == "__main__":
    main()
