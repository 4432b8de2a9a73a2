"""CSA's ridge against what each ridge segments: why the held-out choice cannot see segmentation.

    python benchmarks/csa_ridges.py                                                      # the tiny encoders
    python benchmarks/csa_ridges.py --image-encoder efficientnet-lite2 --text-encoder minilm --cache-dir .cache

For each ridge of methods/csa.py's grid (choice 3): the held-out scores the run's own choice reads (mean
reciprocal rank of the true partners on 20% of the training images held out: of the pooled vectors,
"mrr", and of each held-out image's mean patch embedding, "dense_mrr"; their mean, "score", is what
ridge="auto" maximises), then, as a report only, CSA refitted on every training pair at that ridge and scored
on the TEST sets: retrieval RSum and segmentation mIoU-fg. The choice never reads a test set (align.py
freezes the method before the test sets are loaded); this script reads them to show what the choice
cannot see: a run's pairs carry captions, not masks, so every held-out score is a retrieval score.
"""
import argparse
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import align  # noqa: E402
import evaluate  # noqa: E402
from methods import METHODS  # noqa: E402
from methods.csa import RIDGES, select_ridge  # noqa: E402

HEADER = f"{'ridge':>7} {'mrr':>7} {'dense_mrr':>9} {'score':>7} | {'test RSum':>9} {'test seg mIoU-fg':>16}"


def lines(table):
    """The printed table of {"rows": [[ridge, mrr, dense_mrr, score, rsum, miou], ...], "chosen"}, one row a line."""
    return [HEADER] + [f"{r:7g} {mrr:7.4f} {dense:9.4f} {score:7.4f} | {rsum:9.1f} {miou:16.1f}"
                       + ("   <- chosen (ridge=auto)" if r == table["chosen"] else "")
                       for r, mrr, dense, score, rsum, miou in table["rows"]]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--image-encoder", default="shapes-cnn", help="as align.py's")
    p.add_argument("--text-encoder", default="shapes-text", help="as align.py's")
    p.add_argument("--cache-dir", default=".cache", help="align.py's encoder and feature cache")
    p.add_argument("--ridges", nargs="*", type=float, default=[0.02, 0.05, 0.1, 0.2, 0.5, 1.0, 2.0, 5.0, 10.0],
                   help="ridges to refit and score on the test sets (of the grid's)")
    p.add_argument("--out", default=None, help="also write the table as JSON (docs/tables/ holds it)")
    args = p.parse_args(argv)
    torch.set_num_threads(1)
    run_args = align.parse_args(["--method", "csa", "--image-encoder", args.image_encoder, "--text-encoder",
                                 args.text_encoder, "--cache-dir", args.cache_dir, "--threads", "1"])
    run = align.load_inputs(run_args, "cpu")
    align.extract_features(run_args, run, "cpu", run.sets)
    img, txt, _ = align.alignment_data(run_args, run)
    D_v, D_l = img.pooled.shape[-1], txt.pooled.shape[-1]
    csa = METHODS["csa"](D_v, D_l)
    chosen, scores = select_ridge(csa.unit(img.pooled), csa.unit(txt.pooled), csa.d, patches=img, unit=csa.unit)
    feats, test, seg = run.features, run.sets["test"], run.sets["seg"]
    given = sys.argv[1:] if argv is None else list(argv)
    kept = [a for i, a in enumerate(given) if a not in ("--out", "--cache-dir") and
            (i == 0 or given[i - 1] not in ("--out", "--cache-dir"))]     # where it ran is no part of the table
    table = {"command": " ".join(["python benchmarks/csa_ridges.py", *kept]), "chosen": chosen, "rows": []}
    print(HEADER)
    for r in [r for r in RIDGES if any(abs(r - x) < 1e-9 for x in args.ridges)]:
        m = METHODS["csa"](D_v, D_l, ridge=r).fit(img, txt)
        rsum = evaluate.retrieval(m, feats["test", "image"], feats["test", "text"], test.txt_to_img)["rsum"]
        miou = evaluate.segmentation(m, feats["seg", "image"], seg.masks, feats["seg", "text"],
                                     len(seg.templates))["miou_fg"]
        v = scores[r]
        table["rows"].append([r, v["mrr"], v["dense_mrr"], v["score"], rsum, miou])
        print(lines(table)[-1], flush=True)
    print(f"{args.image_encoder} + {args.text_encoder}: ridge=auto chose {chosen:g} on the held-out pairs")
    if args.out:
        Path(args.out).write_text(json.dumps(table, indent=1))
    return table


if __name__ == "__main__":
    main()
