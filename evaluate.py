"""Evaluation protocols: retrieval, zero-shot classification, zero-shot segmentation, binding.

Every function talks to a method ONLY through the interface of methods/__init__.py
(embed_image, embed_text, score, dense_image), so every method gets every task.
Each protocol has two halves: an embedding step that calls the method, and a pure
metric helper on plain tensors (a score matrix, predicted masks) that tests can
feed with known inputs.

Protocols (PAL §5.1; weight recycling App. D):
- retrieval: R@{1,5,10} both ways and RSum (LAPS / CLIP style), plus the
  weight-recycling paper's i2t mAP, i2t P@1, i2t P@5 and t2i P@1 (its appendix).
- classification: zero-shot top-1 with C x n_templates class prompts.
- segmentation: zero-shot mIoU over foreground classes (PAL's mIoU-fg),
  intersections and unions accumulated over the whole set; global methods
  reach it through dense_image (the MaskCLIP trick).
- binding: the Shapes world's test, true caption vs distractor captions.

Choices where the papers are silent:
1. Ties count AGAINST the ground truth: an item scored equal to a ground-truth
   item is ranked before it (rank = number of other items with score >=). A
   method that gives every pair the same score gets R@1 = 0, not 100. NaN
   scores count as -inf. Binding likewise needs a STRICTLY higher true score.
2. Recalls, top-1, mIoU and binding are percent; the weight-recycling metrics
   (i2t_map, i2t_p1, i2t_p5, t2i_p1) are fractions in [0, 1], as that paper
   reports them (e.g. Flickr i2t P@1 0.537).
3. Prompt templates: global text embeddings (C*n, K) are normalised, averaged
   over the n templates and normalised again (CLIP-style multi-template
   averaging); token-level text embeddings (C*n, L, K) cannot be averaged, so
   the SCORES of a class's templates are averaged instead.
4. Evaluation runs with the method in eval mode (dropout off) and no autograd;
   the method's training flag is restored afterwards.
"""
import contextlib

import torch
import torch.nn.functional as F

from features import batch_to, is_stored, read_ahead
from infra.errors import RunError
from infra.folder import Progress

# ----------------------------------------------------------------------------- embedding step

@contextlib.contextmanager
def inference(method):
    """Eval mode and no autograd for the duration; restores the training flag afterwards."""
    was_training = getattr(method, "training", False)
    if hasattr(method, "eval"):
        method.eval()
    try:
        with torch.no_grad():
            yield
    finally:
        if hasattr(method, "train"):
            method.train(was_training)


def pad_cat(parts):
    """Concatenate along dim 0; token-level parts (B, L, K) are zero-padded to the longest L."""
    if parts[0].dim() == 3:
        L = max(p.shape[1] for p in parts)
        parts = [F.pad(p, (0, 0, 0, L - p.shape[1])) for p in parts]
    return torch.cat(parts)


def embed(fn, feats, batch_size=256, device="cpu"):
    """fn (method.embed_image / embed_text / dense_image) over batches of feats, gathered on the CPU.

    Returns (N, K) for global embeddings or (N, L, K) for token-level ones, whose
    padded positions are exactly 0 (the interface's padding convention).
    """
    outs, starts = [], range(0, len(feats), batch_size)
    fetch = lambda i: feats[i:i + batch_size]
    batches = read_ahead(fetch, starts) if is_stored(feats) else map(fetch, starts)   # memory-mapped: one batch ahead
    with torch.no_grad():
        for f in batches:
            outs.append(fn(batch_to(f, device)).float().cpu())                  # CUDA: pinned, non_blocking
    return finite(pad_cat(outs), f"{getattr(fn, '__name__', 'the method')} output")


def finite(x, what):
    """x, refused with one line when it holds NaN or inf: a score of NaN embeddings is no score."""
    if not torch.isfinite(x).all():
        bad = int((~torch.isfinite(x)).sum())
        raise RunError(f"{what} holds {bad} NaN or inf value(s) of {x.numel()}: the trained weights or the "
                       f"features are not finite, so nothing is scored; retrain with a lower --lr or check "
                       f"the encoders' features")
    return x


def real_lengths(emb):
    """(N,) tokens up to each row's last non-zero one (the padding convention: padded positions are 0)."""
    nz = emb.abs().sum(-1) > 0                                                   # (N, L)
    return (nz * torch.arange(1, emb.shape[1] + 1, device=emb.device)).amax(1)


def score_matrix(method, img_emb, txt_emb, chunk=1024, device="cpu", by_length=None, log=print):
    """S[i, j] = method.score(image i, text j), (N_img, N_txt) float32 on the CPU.

    method.score only ever sees chunk x chunk blocks: a token-level score (L x Q
    similarities per pair) would not fit for COCO's 5K x 25K at once; the matrix
    of floats itself (500 MB) does.
    by_length (default: on a GPU): token-level texts are scored in chunks of similar length,
    each cut to its longest text, instead of every chunk padded to the longest text of the set:
    the same scores up to float rounding (~1e-7: the sums over words run over fewer zeros), so
    the CPU keeps the padded form. Progress lines (images, rate, elapsed, ETA) past 10 seconds.
    """
    S = torch.empty(len(img_emb), len(txt_emb), device="cpu")
    by_length = str(device) != "cpu" if by_length is None else by_length
    blocks = [slice(j, j + chunk) for j in range(0, len(txt_emb), chunk)]
    if by_length and txt_emb.dim() == 3:
        n = real_lengths(txt_emb)
        order = n.argsort(descending=True, stable=True)                         # long texts first
        blocks = [order[j:j + chunk] for j in range(0, len(txt_emb), chunk)]
        blocks = [(b, int(n[b].max())) for b in blocks]
    else:
        blocks = [(b, None) for b in blocks]
    progress = Progress("[eval] scores:", len(img_emb), unit="images", log=log)
    with torch.no_grad():
        for i in range(0, len(img_emb), chunk):
            a = img_emb[i:i + chunk].to(device)
            for b, L in blocks:
                t = txt_emb[b] if L is None else txt_emb[b, :max(L, 1)]
                S[i:i + chunk, b] = method.score(a, t.to(device)).float().cpu()
            progress.update(len(a))
    progress.close()
    return finite(S, "the score matrix")


def paired_scores(method, img_emb, txt_emb, chunk=256, device="cpu"):
    """s[i] = method.score(image i, text i), (N,): diagonals of chunk x chunk blocks."""
    return torch.cat([score_matrix(method, img_emb[i:i + chunk], txt_emb[i:i + chunk], chunk, device).diagonal()
                      for i in range(0, len(img_emb), chunk)])


# ----------------------------------------------------------------------------- retrieval

def retrieval_metrics(S, txt_to_img, chunk=512):
    """All retrieval metrics from a score matrix S (N_img, N_txt); txt_to_img (N_txt,) caption -> image.

    Standard protocol: the i2t rank of an image is the rank of its best-scored
    caption; t2i ranks each caption's image; R@K = 100 * #(rank < K) / #queries
    (percent); rsum = the six recalls summed.
    Weight-recycling paper: per image query, AP = 1/R_q sum_k P(k) rel(k) over the
    ranked list of ALL captions, R_q = the image's caption count; i2t_map = mean AP;
    i2t_p1 / t2i_p1 = fraction of queries whose first result is relevant; i2t_p5 =
    #relevant in the top 5 / 5. These four are fractions in [0, 1].
    Ties: non-relevant items scored equal to a relevant one are ranked before it.
    """
    # EXERCISE 1 (retrieval protocol): ranks from S (N_img, N_txt) and txt_to_img (N_txt,), ties count against the
    #   truth -> i2t/t2i R@1/5/10 (%), rsum, i2t_map, i2t_p1, i2t_p5, t2i_p1 (fractions)
    N_img, N_txt = S.shape
    R_q = torch.bincount(txt_to_img, minlength=N_img)               # captions per image, (N_img,)
    if (R_q == 0).any():
        raise ValueError("every image needs at least one caption")
    dev = S.device
    idx = torch.arange(N_txt, device=dev)
    # other images' captions scored >= caption j, by j's image
    n_above = torch.empty(N_txt, dtype=torch.long, device=dev)
    m = torch.empty(N_txt, dtype=torch.long, device=dev)       # 1-based position of j among its image's own captions
    t2i_rank = torch.empty(N_txt, dtype=torch.long, device=dev)  # other images scored >= j's image, for caption j
    for j0 in range(0, N_txt, chunk):
        j = idx[j0:j0 + chunk]
        gt_img = txt_to_img[j]
        rows = S[gt_img].nan_to_num(nan=float("-inf"))              # (c, N_txt) j's image vs all captions
        g = rows.gather(1, j[:, None])                              # (c, 1) ground-truth score of caption j
        same = txt_to_img[None, :] == gt_img[:, None]               # (c, N_txt) captions of j's image
        n_above[j] = ((rows >= g) & ~same).sum(1)
        ahead = (rows > g) | ((rows == g) & (idx[None, :] < j[:, None]))  # own captions ahead of j (ties by index)
        m[j] = 1 + (ahead & same).sum(1)
        cols = S[:, j].nan_to_num(nan=float("-inf"))               # (N_img, c) all images vs caption j
        t2i_rank[j] = (cols >= g.T).sum(0) - 1                      # minus the ground truth itself

    # image -> text: the best caption has the fewest other captions above it
    i2t_rank = torch.full((N_img,), N_txt, device=dev).scatter_reduce(0, txt_to_img, n_above, "amin")
    pos = m + n_above                                  # 1-based position of caption j in its image's ranked list
    ap = torch.zeros(N_img, device=dev).index_add_(0, txt_to_img, m / pos) / R_q        # P(pos_j) = m_j / pos_j
    p5 = torch.zeros(N_img, device=dev).index_add_(0, txt_to_img, (pos <= 5).float()) / 5

    out = {}
    for name, rank in (("i2t", i2t_rank), ("t2i", t2i_rank)):
        for K in (1, 5, 10):
            out[f"{name}_r{K}"] = 100 * (rank < K).float().mean().item()
    out["rsum"] = sum(out.values())
    out["i2t_map"] = ap.mean().item()
    out["i2t_p1"] = (i2t_rank == 0).float().mean().item()
    out["i2t_p5"] = p5.mean().item()
    out["t2i_p1"] = (t2i_rank == 0).float().mean().item()
    return out
    # END EXERCISE 1


def retrieval(method, img, txt, txt_to_img, batch_size=256, device="cpu"):
    """Image-text retrieval (Karpathy-split protocol) on Features of N_img images and N_txt captions.

    txt_to_img: LongTensor (N_txt,), the image index of each caption. Returns the
    dict of retrieval_metrics (recalls in percent, mAP / P@K as fractions).
    """
    with inference(method):
        img_emb = embed(method.embed_image, img, batch_size, device)
        txt_emb = embed(method.embed_text, txt, batch_size, device)
        S = score_matrix(method, img_emb, txt_emb, device=device)   # (N_img, N_txt)
    return retrieval_metrics(S, txt_to_img)


# ----------------------------------------------------------------------------- zero-shot classification

def template_average(txt_emb, n_templates):
    """Class embeddings from C * n_templates prompt embeddings, class-major.

    Global (C*n, K): normalise each template, average over templates, normalise
    again -> (C, K). Token-level (C*n, L, K): returned unchanged, because words of
    different prompts do not line up; class_logits averages their scores instead.
    """
    # EXERCISE 13 (zero-shot prompts): global (C*n, K) -> normalise each template, average over its n templates,
    #   normalise again -> (C, K); token-level (C*n, L, K) unchanged
    if txt_emb.dim() != 2:
        return txt_emb
    C = len(txt_emb) // n_templates
    w = F.normalize(txt_emb, dim=-1).view(C, n_templates, -1).mean(1)    # (C, K)
    return F.normalize(w, dim=-1)
    # END EXERCISE 13


def class_logits(method, img_emb, cls_emb, n_templates, device="cpu"):
    """(N, C) zero-shot logits of images against the output of template_average."""
    # EXERCISE 13 (zero-shot logits): S = score_matrix(...) (N, C) for global class embeddings; token-level: scores
    #   (N, C*n) averaged over each class's n templates -> (N, C)
    S = score_matrix(method, img_emb, cls_emb, device=device)          # (N, C) or (N, C*n)
    if cls_emb.dim() == 2:
        return S
    return S.view(len(img_emb), -1, n_templates).mean(2)               # average over templates, (N, C)
    # END EXERCISE 13


def classification(method, img, labels, class_txt, n_templates, batch_size=256, device="cpu"):
    """Zero-shot classification top-1 (percent) of images img with labels (N,) in 0..C-1.

    class_txt: Features of C * n_templates prompts, class-major (class c's prompts
    are rows c*n ... c*n + n-1). Ties between classes go to the lower class index.
    """
    with inference(method):
        img_emb = embed(method.embed_image, img, batch_size, device)
        cls_emb = template_average(embed(method.embed_text, class_txt, batch_size, device), n_templates)
        pred = class_logits(method, img_emb, cls_emb, n_templates, device).argmax(1)
    return {"top1": 100 * (pred == labels).float().mean().item()}


# ----------------------------------------------------------------------------- zero-shot segmentation

def iou_counts(pred, gt, C, ignore_index=255):
    """Per-class intersection and union (C,), over pixels whose gt is not ignore_index.

    pred, gt: integer tensors of the same shape; pred in 0..C-1 (background is never
    predicted), gt in 0..C-1 or ignore_index (background / unlabelled); any other gt
    value raises ValueError.
    """
    # EXERCISE 10 (segmentation, IoU): over pixels whose gt != ignore_index, per-class intersection and union (C,)
    #   of pred vs gt; raise ValueError if a gt label (other than ignore_index) is outside 0..C-1
    valid = gt != ignore_index
    p, g = pred[valid].long(), gt[valid].long()
    if len(g) and (g.min() < 0 or g.max() >= C):
        raise ValueError(f"mask values must be in 0..{C - 1} or {ignore_index}")
    inter = torch.bincount(g[p == g], minlength=C)
    union = torch.bincount(p, minlength=C) + torch.bincount(g, minlength=C) - inter
    return inter, union
    # END EXERCISE 10


def miou_from_counts(inter, union):
    """Mean IoU in percent over the classes that appear (union > 0)."""
    # EXERCISE 10 (segmentation, mIoU): mean IoU (%) over the classes with union > 0
    present = union > 0
    return 100 * (inter[present] / union[present]).mean().item()
    # END EXERCISE 10


def segmentation(method, img, masks, class_txt, n_templates, ignore_index=255, batch_size=64, device="cpu"):
    """Zero-shot segmentation mIoU-fg (percent), PAL's protocol.

    masks: (N, Hm, Wm) in 0..C-1 for foreground classes, ignore_index for
    background / unlabelled. Every patch embedding from method.dense_image is
    scored against the class embeddings, the (C, H, W) logits are bilinearly
    upsampled to the mask size and argmaxed; intersections and unions are summed
    over the whole set before the per-class IoU (not averaged per image).
    """
    H, W = img.grid
    Hm, Wm = masks.shape[1:]
    C = len(class_txt) // n_templates
    inter, union = torch.zeros(C, dtype=torch.long, device="cpu"), torch.zeros(C, dtype=torch.long, device="cpu")
    with inference(method):
        cls_emb = template_average(embed(method.embed_text, class_txt, batch_size, device), n_templates)
        for i in range(0, len(img), batch_size):
            # (B, H*W, ...) one image emb per patch
            dense = method.dense_image(batch_to(img[i:i + batch_size], device))
            B = len(dense)
            logits = class_logits(method, dense.flatten(0, 1), cls_emb, n_templates, device)   # (B*H*W, C)
            # EXERCISE 10 (segmentation): logits (B*H*W, C) -> (B, C, H, W), bilinear upsampling to (Hm, Wm) with
            #   align_corners=False, argmax -> pred (B, Hm, Wm); add iou_counts to inter, union (summed over
            #   the whole set)
            logits = logits.view(B, H, W, C).permute(0, 3, 1, 2)            # (B, C, H, W)
            # upsample one image at a time: (B, C, Hm, Wm) at once can be GBs for ADE20K's 150 classes
            pred = torch.stack([F.interpolate(l[None], size=(Hm, Wm), mode="bilinear", align_corners=False)[0].argmax(0)
                                for l in logits])                           # (B, Hm, Wm)
            I, U = iou_counts(pred, masks[i:i + B], C, ignore_index)
            inter, union = inter + I, union + U
            # END EXERCISE 10
    return {"miou_fg": miou_from_counts(inter, union)}


# ----------------------------------------------------------------------------- binding

def binding(method, img, txt_true, distractors, batch_size=256, device="cpu"):
    """Binding accuracy: how often an image scores its true caption above a distractor.

    txt_true: Features (N,), image i's true caption. distractors: {kind: Features (N,)},
    row i a corrupted version of caption i (the Shapes world's: "attribute_swap", the two
    objects' colours exchanged; "relation_swap", the relation word reversed; "object_swap",
    the two objects exchanged under the same relation words). binding_<kind> = 100 *
    fraction of images with score(i, true_i) > score(i, distractor_i), strictly (chance 50);
    binding_acc = mean over kinds. align.py runs it once per BindingSet (shapes.binding_sets:
    canonical style, all styles, held-out templates, held-out object pairs), one metrics group each.
    """
    if not distractors:
        raise ValueError("binding needs at least one kind of distractor")
    out = {}
    with inference(method):
        img_emb = embed(method.embed_image, img, batch_size, device)
        s_true = paired_scores(method, img_emb, embed(method.embed_text, txt_true, batch_size, device), device=device)
        for kind, txt in distractors.items():
            s_false = paired_scores(method, img_emb, embed(method.embed_text, txt, batch_size, device), device=device)
            out[f"binding_{kind}"] = 100 * (s_true > s_false).float().mean().item()
    return {"binding_acc": sum(out.values()) / len(out), **out}


# ----------------------------------------------------------------------------- printing

def _fmt(v):
    if isinstance(v, float):
        return f"{v:.2f}" if abs(v) >= 1 or v == 0 else f"{v:.4f}"
    return str(v)


def results_table(metrics):
    """Plain-text table of the nested metrics dict, one line per metric group.

    {"retrieval": {...}, "classification": {set: {"top1": x}}, ...}: a group whose
    values are all dicts gets one line per member ("classification/shapes"); an empty group (a
    task the data has no set for) gets no line, and one closing line names them.
    """
    rows, empty = [], [group for group, vals in metrics.items() if vals == {}]
    for group, vals in metrics.items():
        if vals == {}:
            continue                                  # a task without data: said once, below
        if isinstance(vals, dict) and vals and all(isinstance(v, dict) for v in vals.values()):
            rows += [(f"{group}/{name}", v) for name, v in vals.items()]
        else:
            rows.append((group, vals))
    width = max((len(label) for label, _ in rows), default=0)
    lines = []
    for label, vals in rows:
        cells = [f"{k} {_fmt(v)}" for k, v in vals.items()] if isinstance(vals, dict) else [_fmt(vals)]
        lines.append((label.ljust(width) + "  " + "  ".join(c.ljust(16) for c in cells)).rstrip())
    if empty:
        lines.append(f"(not evaluated: {', '.join(empty)}: the data has no such set; docs/real-data.md)")
    return "\n".join(lines)
