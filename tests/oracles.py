"""The references of the graded tests, as naive loops: the reference checkout only, never in a student copy.

exercises/make_goldens.py runs the graded tests with RECORD_GOLDENS set: each `expected(name, *inputs)` of
tests/recorded.py then calls the function `name` here and records its value on those inputs in
tests/goldens.pt, the file a student copy grades against. Each is an exercise's answer in loop form (that is
why it stays out of the copy: exercises/make_student_copy.py's SKIP_FILES).
"""
import math

import torch
import torch.nn.functional as F


def cosines(X, A):
    """(N, D), (K, D) -> (N, K) cosines by loops (PAL Eq. 3-4 of single vectors)."""
    return torch.tensor([[naive_cos(x, a) for a in A.tolist()] for x in X.tolist()])



def naive_relative(x, anchors, k, p):
    """One sample at a time: cosines, keep the k largest, clamp, power p, L2-normalise."""
    sims = [float(x @ a) / (x.norm().item() * a.norm().item()) for a in anchors]
    keep = sorted(range(len(sims)), key=lambda j: -sims[j])[:k]
    r = [max(sims[j], 0.0) ** p if j in keep else 0.0 for j in range(len(sims))]
    norm = math.sqrt(sum(v * v for v in r))
    return torch.tensor([v / norm for v in r])



def naive_mutual_knn(X, Y, k):
    def neighbours(Z, i):
        cos = [(F.cosine_similarity(Z[i], Z[j], dim=0).item(), j) for j in range(len(Z)) if j != i]
        return {j for _, j in sorted(cos, reverse=True)[:k]}
    return sum(len(neighbours(X, i) & neighbours(Y, i)) / k for i in range(len(X))) / len(X)



def naive_rs(X, Z, tau):
    """R_S with Python loops: normalise, centre, row softmaxes, KL to the midpoint."""
    def distribution(H):
        H = [h / h.norm() for h in H]
        mean = sum(H) / len(H)
        H = [h - mean for h in H]
        rows = []
        for i in range(len(H)):
            e = [math.exp(float(H[i] @ H[j]) / tau) for j in range(len(H))]
            rows.append([v / sum(e) for v in e])
        return rows

    P, Q = distribution(X), distribution(Z)
    js = 0.0
    for p, q in zip(P, Q):
        m = [(a + b) / 2 for a, b in zip(p, q)]
        js += 0.5 * sum(a * math.log(a / c) for a, c in zip(p, m))
        js += 0.5 * sum(b * math.log(b / c) for b, c in zip(q, m))
    return js / len(P)



def naive_retrieval(S, txt_to_img):
    """Per-query loops over a full argsort (valid without ties)."""
    N_img, N_txt = S.shape
    i2t_rank, ap, p1, p5 = [], [], [], []
    for i in range(N_img):
        order = torch.argsort(S[i], descending=True).tolist()
        rel = [int(txt_to_img[j]) == i for j in order]
        i2t_rank.append(rel.index(True))
        hits, total = 0, 0.0
        for k, r in enumerate(rel, start=1):
            if r:
                hits += 1
                total += hits / k                       # P(k) at each relevant rank
        ap.append(total / sum(rel))
        p1.append(float(rel[0]))
        p5.append(sum(rel[:5]) / 5)
    t2i_rank = []
    for j in range(N_txt):
        order = torch.argsort(S[:, j], descending=True).tolist()
        t2i_rank.append(order.index(int(txt_to_img[j])))
    out = {}
    for name, rank in [("i2t", i2t_rank), ("t2i", t2i_rank)]:
        for K in (1, 5, 10):
            out[f"{name}_r{K}"] = 100 * sum(r < K for r in rank) / len(rank)
    out["rsum"] = sum(out.values())
    out.update(i2t_map=sum(ap) / N_img, i2t_p1=sum(p1) / N_img, i2t_p5=sum(p5) / N_img,
               t2i_p1=sum(r == 0 for r in t2i_rank) / N_txt)
    return out



def naive_cos(u, v):
    dot = sum(a * b for a, b in zip(u, v))
    return dot / (math.sqrt(sum(a * a for a in u)) * math.sqrt(sum(b * b for b in v)))



def naive_p(tokens, mask, A, tau_p, pooling):
    """p (K,) of one sample by explicit loops over anchors k and real tokens t."""
    Z = [tokens[t].tolist() for t in range(len(mask)) if mask[t]]
    p = []
    for a in A.tolist():
        r = [naive_cos(z, a) for z in Z]                              # Eq. (3)-(4)
        if pooling == "cap":
            e = [math.exp(x / tau_p) for x in r]
            p.append(sum(ei / sum(e) * x for ei, x in zip(e, r)))      # Eq. (5)-(6)
        else:
            p.append(sum(r) / len(r))                                  # mean
    return torch.tensor(p)



def bilinear_naive(v, x, y):
    """v (D, H, W); (x, y) in [0,1] image coords; pixel centres at (j+.5)/W; zeros outside."""
    D, H, W = v.shape
    px, py = x * W - 0.5, y * H - 0.5          # align_corners=False: continuous pixel index
    x0, y0 = math.floor(px), math.floor(py)
    out = torch.zeros(D, dtype=torch.float64)
    for yi in (y0, y0 + 1):
        for xi in (x0, x0 + 1):
            w = (1 - abs(px - xi)) * (1 - abs(py - yi))
            if 0 <= xi < W and 0 <= yi < H:
                out += w * v[:, yi, xi].double()
    return out



def deformable_naive(value, loc, A):
    B, M, Dh, H, W = value.shape
    Q, P = loc.shape[1], loc.shape[3]
    out = torch.zeros(B, Q, M, Dh, dtype=torch.float64)
    for b in range(B):
        for m in range(M):
            for q in range(Q):
                for p in range(P):
                    x, y = loc[b, q, m, p].tolist()
                    out[b, q, m] += A[b, q, m, p].item() * bilinear_naive(value[b, m], x, y)
    return out



def max_sum_naive(r, w):
    I, T = len(r), len(w)
    S = torch.zeros(I, T, dtype=torch.float64)
    for i in range(I):
        regions = [q for q in r[i] if q.abs().sum() > 0]
        for t in range(T):
            words = [x for x in w[t] if x.abs().sum() > 0]
            s = [[float(q.detach() @ x.detach()) for x in words] for q in regions]
            S[i, t] = (sum(max(row) for row in s) / len(regions)
                       + sum(max(s[a][b] for a in range(len(regions))) for b in range(len(words))) / len(words))
    return S



def naive_mask(scores, eps):
    """The threshold mask of one row of assign scores (before the softmax), by a loop: hatAttn = the scores
    min-max normalised to [0, 1]; keep hatAttn >= eps; softmax over the kept patches, 0 elsewhere."""
    lo, hi = min(scores), max(scores)
    hat = [(s - lo) / (hi - lo) for s in scores]
    e = [math.exp(s) if h >= eps else 0.0 for s, h in zip(scores, hat)]
    return [x / sum(e) for x in e]



def naive_assign(m, img):
    """CVSFE's consistent assign attention and threshold mask, one image and one query at a time
    (deformable=False, so z' = z): attention over the patches = softmax of cos(W z_q, W F_p) / tau with the ONE
    shared W; threshold mask at eps on the min-max normalised scores, softmax renormalised over the kept patches;
    r_q = sum_p barAttn_p V F_p. Lists of float64 tensors per image."""
    F_img = m.P_v(img.patches()).double()                              # (B, N, K)
    W, V, z = m.W_assign.weight.double(), m.V.weight.double(), m.z.double()
    attn, attn_bar, r = [], [], []
    for b in range(len(F_img)):
        A, A_bar, R = [], [], []
        for q in range(len(z)):
            wz = W @ z[q]
            cos = [float(wz @ (W @ f)) / float(wz.norm() * (W @ f).norm()) for f in F_img[b]]
            e = [math.exp(c / m.tau) for c in cos]
            a = [x / sum(e) for x in e]
            bar = naive_mask([c / m.tau for c in cos], m.eps)
            A.append(torch.tensor(a, dtype=torch.float64))
            A_bar.append(torch.tensor(bar, dtype=torch.float64))
            R.append(sum(bar[p] * (V @ F_img[b, p]) for p in range(len(bar))))
        attn.append(torch.stack(A)), attn_bar.append(torch.stack(A_bar)), r.append(torch.stack(R))
    return torch.stack(attn), torch.stack(attn_bar), torch.stack(r)



def naive_spread(a, H, W):
    """L_conc (CDFO spatial concentration) by loops: a (Q, H*W) -> (Q,) sum_p a_p ||p - c||, patch centres
    ((j+.5)/W, (i+.5)/H)."""
    centres = [((j + 0.5) / W, (i + 0.5) / H) for i in range(H) for j in range(W)]
    out = []
    for row in a.tolist():
        cx = sum(w * x for w, (x, _) in zip(row, centres))
        cy = sum(w * y for w, (_, y) in zip(row, centres))
        out.append(sum(w * math.hypot(x - cx, y - cy) for w, (x, y) in zip(row, centres)))
    return out


def naive_bilinear(logits, Hm, Wm):
    """(C, H, W) -> (C, Hm, Wm) per output pixel, align_corners=False: source coordinate
    (y + .5) H / Hm - .5, clamped at 0 (PyTorch's rule), blend of the 4 neighbours."""
    C, H, W = logits.shape
    out = torch.zeros(C, Hm, Wm, dtype=torch.float64)
    for y in range(Hm):
        sy = max((y + 0.5) * H / Hm - 0.5, 0.0)
        y0, wy = int(sy), sy - int(sy)
        y1 = min(y0 + 1, H - 1)
        for x in range(Wm):
            sx = max((x + 0.5) * W / Wm - 0.5, 0.0)
            x0, wx = int(sx), sx - int(sx)
            x1 = min(x0 + 1, W - 1)
            out[:, y, x] = ((1 - wy) * (1 - wx) * logits[:, y0, x0] + (1 - wy) * wx * logits[:, y0, x1]
                            + wy * (1 - wx) * logits[:, y1, x0] + wy * wx * logits[:, y1, x1]).double()
    return out


def naive_token_score(a, b):
    """One (image, text) pair at a time: sum over words of max over regions."""
    return sum(max(float(q @ w) for q in a) for w in b if w.abs().sum() > 0)


def info_nce_directions(s):
    """(image->text, text->image) cross-entropies of a logit matrix s (B, B) by loops: rows, then columns."""
    s = s.tolist()

    def cross_entropy(rows):                       # mean over i of -log softmax(rows[i])_i
        return sum(math.log(sum(math.exp(x) for x in row)) - row[i] for i, row in enumerate(rows)) / len(rows)
    return cross_entropy(s), cross_entropy([list(col) for col in zip(*s)])


def naive_template_average(t, n):
    """(C*n, K) -> (C, K): each template normalised, averaged over its class's n, normalised again."""
    C, K = len(t) // n, t.shape[1]
    out = []
    for c in range(C):
        acc = torch.zeros(K)
        for r in range(n):
            v = t[c * n + r]
            acc += v / math.sqrt(float(v @ v))
        acc /= n
        out.append(acc / math.sqrt(float(acc @ acc)))
    return torch.stack(out)


def naive_token_class_logits(img, txt, n):
    """(N, C) class logits of a token-level method: the mean over a class's n templates of the pair's score."""
    C = len(txt) // n
    return torch.tensor([[sum(naive_token_score(img[i], txt[c * n + r]) for r in range(n)) / n for c in range(C)]
                         for i in range(len(img))])


def naive_neural_collapse(W, b, feats):
    """Labels that the cosine classifier gets right but for the first 8 images, and Table 1's three top-1s on them
    by loops: argmax_i of w_i . f + b_i, of cos(w_i, f), of w_i . f."""
    C = len(W)
    cos = lambda u, v: float(u @ v) / (float(u.norm()) * float(v.norm()))
    labels = torch.tensor([max(range(C), key=lambda i: cos(W[i], f)) for f in feats])
    labels[:8] = (labels[:8] + 1) % C
    top1 = lambda score: 100 * sum(max(range(C), key=lambda i: score(i, f)) == int(y)
                                   for f, y in zip(feats, labels)) / len(labels)
    return labels, {"linear_top1": top1(lambda i, f: float(W[i] @ f) + float(b[i])),
                    "cosine_top1": top1(lambda i, f: cos(W[i], f)), "nobias_top1": top1(lambda i, f: float(W[i] @ f))}

