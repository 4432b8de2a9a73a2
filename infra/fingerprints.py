"""Fingerprints: what the feature cache is keyed by besides an encoder's name (its weights, its code).

The same name can hold other weights (a re-pretrained tiny encoder, another revision downloaded into
the same folder), so features are keyed by the weights:
- the tiny encoders: a hash of their state_dict (and vocabulary), exact;
- a Hugging Face snapshot folder (hub cache) or a model loaded by hub name: its commit hash, as the
  Hugging Face cache itself keys files by revision;
- any other model folder: every file's name and size, plus its content hash (files up to 16 MB:
  config, tokenizer, small weights) or, for larger weight files, its modification time and a hash of
  its first and last MB: reading a 1.2 GB checkpoint in full on every run would cost seconds, while
  another revision written into the folder changes the mtime (and nearly always the size or the
  first tensors);
- torchvision: the weights enum and its URL (whose name carries the file's hash).
"""
import hashlib
import os
import re
from pathlib import Path

import torch

FULL_HASH_BYTES = 16 * 2**20


def state_fingerprint(state, *extra):
    """sha1 of a state_dict's names, dtypes, shapes and values (plus extra plain values), exact."""
    h = hashlib.sha1()
    for name, t in sorted(state.items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name} {t.dtype} {tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())       # the raw bytes, any dtype
    for e in extra:
        h.update(repr(e).encode())
    return h.hexdigest()[:16]


def code_hash(*files):
    """sha256 (16 hex digits) of source files, by name and bytes: the code a result was computed with."""
    h = hashlib.sha256()
    for f in sorted(map(str, files)):
        h.update(Path(f).name.encode() + b"\0" + Path(f).read_bytes())
    return h.hexdigest()[:16]


def folder_fingerprint(folder):
    """The weights fingerprint of a model folder (the module docstring)."""
    folder = Path(folder).absolute()
    if folder.parent.name == "snapshots" and re.fullmatch(r"[0-9a-f]{40}", folder.name):
        return f"commit {folder.name}"                                    # a Hugging Face cache snapshot
    h = hashlib.sha1()
    for f in sorted(p for p in folder.iterdir() if p.is_file()):
        st = f.stat()
        h.update(f"{f.name} {st.st_size}".encode())
        with open(f, "rb") as fh:
            if st.st_size <= FULL_HASH_BYTES:
                h.update(fh.read())
            else:
                h.update(f" {st.st_mtime_ns}".encode() + fh.read(2**20))
                fh.seek(-2**20, os.SEEK_END)
                h.update(fh.read())
    return "files " + h.hexdigest()[:16]
