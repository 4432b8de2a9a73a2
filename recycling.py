"""Supervised classification heads as semantic prototypes: data + analyses.

Read next to "Supervised Classification Heads as Semantic Prototypes: Unlocking
Vision-Language Alignment via Weight Recycling" (§3-§4, Appendices H and I).
A supervised image encoder f_I is trained with a linear head W f_I(x) + b
(Eq. 1); this module recycles the head rows w_i as alignment data and
reproduces the paper's analyses of them:

    weight_pairs / augment     §4.1 D_weights, Eq. (3) D_aug = D_imgtxt ∪ D_weights
    neural_collapse_check      Table 1 (linear vs cosine classifier on w_i)
    (mutual_knn, in similarity.py, is the Fig. 1 metric (Huh et al. 2024))
    prototype_alignment        Fig. 1 (head rows vs class means of n images, to text)
    modality_gap               Appendix I (centroid distance + permutation null, separability)
    few_shot                   Table 2 / Table 11 (NCC, KNN, weight-aligned MLP)
    head_class_index           which classes of a labelled set are head classes (by name)
    head_analyses / run_analyses   Table 1, Fig. 1, App. I (+ Table 2) on one head and its features

Symbols -> variables: W (C, D) -> W, b (C,) -> b, w_i -> W[i], f_I(x) (N, D) ->
feats, f_T(t_i) (class-name text embedding) -> class_text / class_text_vecs,
C classes, N images, n images per class -> n, k neighbours -> k.

Deviations / choices (where the paper is silent):
1. Fig. 1 class means average the RAW features of n random images of a class
   (as the reference code does), then compare by cosine; several random draws
   (`repeats`) are averaged, and only classes that have images take part.
2. Appendix I: the image side is one class-mean feature per class (as in the
   paper, "averaged image representations"); p-value = (1 + #null >= gap) /
   (1 + n_perm). "cohens_d" = (gap - null_mean) / null_std, the paper's number.
   Separability: a logistic regression (the paper's "single-layer MLP") on a
   stratified 80/20 split, balanced accuracy in percent.
3. few_shot: per run and per class, a random order; the first max(shots) images
   are the support pool (the n-shot support is its first n, so supports are
   nested), the remaining images are the test set, the same for every method
   and shot count of a run (the paper's controlled comparison). KNN uses
   k = shots (so 1-shot KNN = NCC, as in Table 2), cosine, majority vote, ties
   broken by the nearest neighbour. Features are L2-normalised first.
4. finetune_mlp_classifier: Adam, cosine annealing to 0 (the reference code's
   optimiser), full-batch steps: with <= 512 support pairs one step is one of
   the paper's 200 fine-tuning epochs at batch 512. As App. H and its code, it
   fine-tunes on one pair per class (the normalised mean of the class's shots)
   against the class text "A photo of a {class}" (FEW_SHOT_TEMPLATE); the head
   rows themselves are aligned to the bare class names (§4.1). On the Shapes world
   every shot as a pair, or the bare class name, moves 1/2/4-shot top-1 by at most
   0.3 points (near the ceiling), so the paper's setting is kept. lr 5e-3, App. H's
   "identical optimizer" (the reference code's two-stage function defaults to 5e-4).
   The shots are L2-normalised before their mean (few_shot's features are); the
   reference code averages the raw shots, then normalises. Stage 1 (weight_aligned_mlp)
   runs MLP.defaults' 400 full-batch steps, not App. H's 500 epochs: Shapes 1-shot 94.4
   against 94.3 at 500.
5. D_weights holds the head rows L2-normalised (weight_pairs), as the reference code and
   App. B's cosine classifier; §4.1 writes w_i.
6. Fig. 1's n defaults to (1, 2, 5, 10, 20), counts above the smallest class size skipped;
   the paper's n is {1, 5, 10, 20, 30, 40, 50} (50: all IN-1K validation images of a class).
7. cannot_analyse says why the analyses cannot run (no usable head, no classification set), so
   align.py refuses --analyses before any features are extracted (docs/faults.md).
8. A classification set none of whose classes is a head class (Shapes under an ImageNet head)
   labels each image by the head's own top-1 for Table 1, Fig. 1 and App. I: Table 1's cosine
   top-1 is then how often cos(w_i, f) picks the linear head's class (the Neural Collapse limit
   argmax w_i f + b_i = argmax cos(w_i, f), App. B), linear top-1 is 100 by construction.

The analyses on the Shapes world, next to the paper's numbers: docs/results.md
("Weight recycling"), from `python align.py --analyses`; on EfficientNet-Lite2's ImageNet head:
"Weight recycling on a real head".
"""
import copy

import torch
import torch.nn.functional as F

import data
import eval_sets
from features import Features
from infra import cache
from infra.errors import RunError
from infra.shards import ConcatFeatures
from similarity import mutual_knn

# ---------------------------------------------------------------- alignment data (§4)

def weight_pairs(W, class_text):
    """§4.1: D_weights = {(w_i, f_T(class name i))}, w_i L2-normalised (choice 5), bias dropped.

    W: (C, D) head rows; class_text: Features of the C raw class names (full
    token rows kept, so token-level methods can use them). Returns (img, txt)
    Features; the image side is a one-token sequence per class."""
    assert len(W) == len(class_text), "one class name per head row"
    w_hat = F.normalize(W.float(), dim=-1)                   # (C, D) unit rows
    return Features.from_vectors(w_hat), class_text


def augment(pairs_img, pairs_txt, w_img, w_txt):
    """Eq. (3): D_aug = D_imgtxt ∪ D_weights, as one (img, txt) Features pair; a memory-mapped
    pair set (StoredFeatures) stays on disk: ConcatFeatures reads a batch's rows only."""
    if isinstance(pairs_img, Features) and isinstance(pairs_txt, Features):
        return Features.cat([pairs_img, w_img]), Features.cat([pairs_txt, w_txt])
    return ConcatFeatures([pairs_img, w_img]), ConcatFeatures([pairs_txt, w_txt])


# ---------------------------------------------------------------- Table 1

def neural_collapse_check(W, b, feats, labels):
    """Table 1: top-1 (%) on held-out images of the linear head W f + b, the cosine classifier cos(w_i, f)
    (Eq. 4) and the bias-free head W f -> {"linear_top1", "cosine_top1", "nobias_top1"}."""
    # EXERCISE 8 (weight recycling Table 1, Eq. 1 and 4): top-1 (%) of the linear head W f + b, the cosine
    #   classifier cos(w_i, f) and the bias-free head W f; W (C, D), b (C,), feats (N, D), labels (N,)
    #   -> a dict with exactly the keys linear_top1, cosine_top1, nobias_top1 (floats in percent)
    W, b, feats = W.float(), b.float(), feats.float()
    acc = lambda logits: 100.0 * (logits.argmax(1) == labels).float().mean().item()
    cos = F.normalize(feats, dim=-1) @ F.normalize(W, dim=-1).T   # (N, C)
    return {"linear_top1": acc(feats @ W.T + b),                  # Eq. (1)
            "cosine_top1": acc(cos),                              # Eq. (4)
            "nobias_top1": acc(feats @ W.T)}
    # END EXERCISE 8


# ---------------------------------------------------------------- Fig. 1

def class_means(feats, labels, classes, n=None, generator=None):
    """(len(classes), D) mean of n random images per class (all images if n is None)."""
    rows = []
    for c in classes:
        idx = (labels == c).nonzero().squeeze(1)
        if n is not None:
            idx = idx[torch.randperm(len(idx), generator=generator)[:n]]
        rows.append(feats[idx].float().mean(0))
    return torch.stack(rows)


def prototype_alignment(W, feats, labels, class_text_vecs, counts=(1, 2, 5, 10, 20),
                        k=(3, 5, 10),  # Fig. 1 tests k in {3, 5, 10}
                        repeats=5, seed=0):
    """Fig. 1: m_NN of the class-name text embeddings with (a) the head rows w_i
    ("head_k{k}") and (b) class means of n random images per class
    ("mean{n}_k{k}", averaged over `repeats` draws; "meanall_k{k}" uses every
    image). Counts above the smallest class size and k >= #classes are skipped."""
    classes = labels.unique()                                # classes that have images
    sizes = torch.stack([(labels == c).sum() for c in classes])
    T = class_text_vecs[classes].float()                     # (C', D_t)
    ks = [k] if isinstance(k, int) else list(k)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for kk in [kk for kk in ks if kk < len(classes)]:
        out[f"head_k{kk}"] = mutual_knn(W[classes], T, kk)   # (a) head rows
        for n in [n for n in counts if n <= sizes.min()]:    # (b) n-image class means
            draws = [mutual_knn(class_means(feats, labels, classes, n, g), T, kk) for _ in range(repeats)]
            out[f"mean{n}_k{kk}"] = sum(draws) / repeats
        out[f"meanall_k{kk}"] = mutual_knn(class_means(feats, labels, classes), T, kk)
    return out


# ---------------------------------------------------------------- Appendix I

def logistic_separability(A, B, steps=300, lr=0.05, seed=0):
    """Held-out balanced accuracy (%) of a logistic regression telling rows of A
    from rows of B, trained on a stratified random 80/20 split (Appendix I)."""
    g = torch.Generator().manual_seed(seed)
    split = lambda n: torch.randperm(n, generator=g).split([n - max(1, n // 5), max(1, n // 5)])
    (trA, teA), (trB, teB) = split(len(A)), split(len(B))
    X_tr = torch.cat([A[trA], B[trB]])
    y_tr = torch.cat([torch.ones(len(trA)), torch.zeros(len(trB))])
    mu, sd = X_tr.mean(0), X_tr.std(0) + 1e-6                # standardise with train statistics
    w = torch.zeros(A.shape[1], requires_grad=True)
    c = torch.zeros(1, requires_grad=True)
    pos_weight = torch.tensor(len(trB) / len(trA))           # balance the two groups
    opt = torch.optim.Adam([w, c], lr=lr)
    for _ in range(steps):
        logit = (X_tr - mu) / sd @ w + c
        loss = F.binary_cross_entropy_with_logits(logit, y_tr, pos_weight=pos_weight)
        opt.zero_grad()
        loss.backward()
        opt.step()
    with torch.no_grad():
        hit_A = (((A[teA] - mu) / sd @ w + c) > 0).float().mean()
        hit_B = (((B[teB] - mu) / sd @ w + c) <= 0).float().mean()
    return 50.0 * (hit_A + hit_B).item()


def modality_gap(W, feats, n_perm=1000, seed=0):
    """Appendix I: gap = ||mean_i w_i/||w_i|| - mean_j f_j/||f_j|| ||, against a
    permutation null (shuffle the head/image labels of the pooled rows and
    recompute); "separability" = held-out accuracy (%) of a linear head-vs-image
    classifier. Paper (BEiT, IN-1K): gap 0.1723, null 0.0446 +- 0.0014, p < 0.001."""
    A = F.normalize(W.float(), dim=-1)                       # (C, D) head rows
    B = F.normalize(feats.float(), dim=-1)                   # (N, D) image features
    gap = (A.mean(0) - B.mean(0)).norm().item()
    Z = torch.cat([A, B])                                    # (C + N, D) pooled set
    M, nA = len(Z), len(A)
    g = torch.Generator().manual_seed(seed)
    null = []
    for chunk in torch.arange(n_perm).split(256):
        order = torch.rand(len(chunk), M, generator=g).argsort(1)          # one permutation per row
        in_A = torch.zeros(len(chunk), M).scatter_(1, order[:, :nA], 1.0)  # (P, M) relabelled "head"
        sum_A = in_A @ Z                                                     # (P, D)
        mean_A, mean_B = sum_A / nA, (Z.sum(0) - sum_A) / (M - nA)
        null.append((mean_A - mean_B).norm(dim=1))
    null = torch.cat(null)                                   # (n_perm,)
    return {"gap": gap, "null_mean": null.mean().item(), "null_std": null.std().item(),
            "p_value": (1 + (null >= gap).sum().item()) / (1 + n_perm),
            "cohens_d": (gap - null.mean().item()) / (null.std().item() + 1e-12),
            "separability": logistic_separability(A, B, seed=seed)}


# ---------------------------------------------------------------- Table 2

FEW_SHOT_TEMPLATE = "A photo of a {}"   # §4.2 and its code: the class text of Table 2


def fit_full_batch(mlp, img, txt, steps, lr):
    """Train mlp (methods/mlp.py) on all its pairs at once: Adam, one step per epoch, the lr annealed on
    a cosine to 0 over the steps (App. E, no restarts). Returns mlp in eval mode."""
    opt = torch.optim.Adam(mlp.parameters(), lr=lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=steps)
    mlp.train()
    for _ in range(steps):
        loss, _ = mlp.loss(img, txt)
        opt.zero_grad()
        loss.backward()
        opt.step()
        sched.step()
    return mlp.eval()


def class_mean_pairs(support_feats, support_labels):
    """App. H, stage 2 (and its code): one pair per class, the normalised mean of that class's
    L2-normalised shots (its code: of the raw shots, choice 4). Returns (C_s, D) image side and (C_s,)
    the classes that have shots."""
    x = F.normalize(support_feats.float(), dim=-1)                                   # (n*C, D) unit shots
    classes = support_labels.unique()                                                # (C_s,) sorted
    means = torch.zeros(len(classes), x.shape[1], device=x.device).index_add_(
        0, torch.searchsorted(classes, support_labels), x)                           # (C_s, D) sums
    return F.normalize(means, dim=-1), classes


def finetune_mlp_classifier(mlp_method, class_text, support_feats, support_labels,
                            steps=200,  # App. H: 200 fine-tuning epochs
                            lr=5e-3,    # App. E: MLP-alignment learning rate
                            class_mean=True):  # App. H stage 2: one pair per class (choice 4)
    """Table 2 "Ours": copy an already weight-aligned MLP (methods/mlp.py, trained on
    D_weights), fine-tune the copy with the method's own loss on (image, class text) pairs
    - class_mean=True: one pair per class, the normalised mean of its shots (App. H and its
    code); False: every shot as its own pair - and classify by cosine between the aligned
    image and the class text embeddings (class_text: Features (C, ...), e.g. of
    FEW_SHOT_TEMPLATE). Returns logits_fn(feats (N, D)) -> (N, C)."""
    mlp = copy.deepcopy(mlp_method)                          # the caller's aligner stays as it was
    if class_mean:
        x, y = class_mean_pairs(support_feats, support_labels)                     # (C_s, D), (C_s,)
    else:
        x, y = support_feats.float(), support_labels                               # (n*C, D), (n*C,)
    img = Features.from_vectors(x)
    txt = class_text[y]                                      # the class text of each pair
    fit_full_batch(mlp, img, txt, steps, lr)
    with torch.no_grad():
        t = F.normalize(mlp.embed_text(class_text), dim=-1)  # (C, K) class prototypes

    def logits_fn(feats):
        with torch.no_grad():
            v = F.normalize(mlp.embed_image(Features.from_vectors(feats.float())), dim=-1)
            return v @ t.T                                   # (N, C) cosine
    return logits_fn


def head_class_index(class_names, head_names):
    """(C_set,) index of each class of a labelled set among the head's classes, -1 where none;
    matched by name, case-insensitive, a head name may list synonyms ("tabby, tabby cat")."""
    lookup = {}
    for j, name in enumerate(head_names):
        for syn in name.split(","):
            lookup.setdefault(syn.strip().lower(), j)
    return torch.tensor([lookup.get(c.strip().lower(), -1) for c in class_names])


def ncc_predict(support, support_labels, query, C):
    """Nearest class centroid by cosine (inputs L2-normalised)."""
    centroids = torch.zeros(C, support.shape[1]).index_add_(0, support_labels, support)  # (C, D)
    sim = query @ F.normalize(centroids, dim=-1).T           # (N, C) cosine to each centroid
    sim[:, torch.bincount(support_labels, minlength=C) == 0] = float("-inf")  # classes without shots
    return sim.argmax(1)


def knn_predict(support, support_labels, query, C, k):
    """k-NN by cosine, majority vote; ties go to the class with the nearest neighbour."""
    sim, idx = (query @ support.T).topk(k, dim=1)            # (N, k)
    votes = F.one_hot(support_labels[idx], C).sum(1).float() # (N, C)
    nearest = torch.zeros_like(votes).scatter_reduce(1, support_labels[idx], sim, "amax", include_self=False)
    return (votes + nearest / 4).argmax(1)                   # |sim|/4 < 1/2 only breaks ties


def few_shot(feats, labels, support_shots=(1, 2, 4), runs=5, seed=0, aligned_classifier=None):
    """Table 2 / Table 11: few-shot top-1 (%) of NCC and KNN on frozen features and,
    if `aligned_classifier(support_feats, support_labels) -> logits_fn` is given,
    of the weight-aligned MLP fine-tuned on the shots ("mlp_<n>shot"). Mean and
    std over `runs` random draws, evaluated on the images outside the support pool."""
    feats = F.normalize(feats.float(), dim=-1)
    C, S = int(labels.max()) + 1, max(support_shots)
    classes = labels.unique()
    g = torch.Generator().manual_seed(seed)
    scores = {}
    for _ in range(runs):
        orders = []                                          # per class, its images in random order
        for c in classes:
            idx = (labels == c).nonzero().squeeze(1)
            assert len(idx) > S, f"class {int(c)} has {len(idx)} images, needs > {S}"
            orders.append(idx[torch.randperm(len(idx), generator=g)])
        test = torch.cat([o[S:] for o in orders])           # same test set for every n and method
        for n in support_shots:
            sup = torch.cat([o[:n] for o in orders])
            preds = {"ncc": ncc_predict(feats[sup], labels[sup], feats[test], C),
                     "knn": knn_predict(feats[sup], labels[sup], feats[test], C, k=n)}
            if aligned_classifier is not None:
                preds["mlp"] = aligned_classifier(feats[sup], labels[sup])(feats[test]).argmax(1)
            for name, p in preds.items():
                scores.setdefault(f"{name}_{n}shot", []).append(100.0 * (p == labels[test]).float().mean().item())
    out = {}
    for key, v in scores.items():
        v = torch.tensor(v)
        out[key], out[key + "_std"] = v.mean().item(), (v.std().item() if len(v) > 1 else 0.0)
    return out


# ---------------------------------------------------------------- all together

def head_analyses(W, b, feats_train, labels_train, feats_test, labels_test, class_text_vecs, n_perm=1000, seed=0):
    """The analyses that need images of the head's own classes (labels = head row indices):
    Table 1 and Fig. 1 on the held-out images (the paper uses the IN-1K validation set),
    Appendix I with one train-set class mean per class."""
    classes = labels_train.unique()
    return {
        "neural_collapse": neural_collapse_check(W, b, feats_test, labels_test),
        "prototype_alignment": prototype_alignment(W, feats_test, labels_test, class_text_vecs, seed=seed),
        "modality_gap": modality_gap(W[classes], class_means(feats_train, labels_train, classes),
                                     n_perm=n_perm, seed=seed),
    }


def run_analyses(W, b, class_names, feats_train, labels_train, feats_test, labels_test,
                 class_text_vecs, aligned_classifier=None, n_perm=1000, seed=0):
    """Every analysis of the paper on one head: head_analyses, then Table 2 on the held-out pool."""
    assert len(class_names) == len(W), "one class name per head row (drop e.g. a background row)"
    return {**head_analyses(W, b, feats_train, labels_train, feats_test, labels_test, class_text_vecs, n_perm, seed),
            "few_shot": few_shot(feats_test, labels_test, seed=seed, aligned_classifier=aligned_classifier)}


def analyses_table(d):
    """The nested dict of run_analyses as aligned text, one section per paper table/figure."""
    titles = {"neural_collapse": "Table 1: head as classifier (top-1 %)",
              "prototype_alignment": "Fig. 1: mutual kNN to class-name text",
              "modality_gap": "Appendix I: head rows vs image class means",
              "few_shot": "Table 2: few-shot top-1 % (mean +- std over runs)"}
    lines = []
    for section, title in titles.items():
        if section not in d:
            continue
        lines.append(title)
        for key, v in d[section].items():
            if key.endswith("_std") and key[:-4] in d[section]:   # printed next to its mean
                continue
            std = d[section].get(key + "_std")
            lines.append(f"  {key:<16}{v:10.4f}" + (f" +- {std:.4f}" if std is not None else ""))
    return "\n".join(lines)


# ---------------------------------------------------------------- the analyses of a run (align.py --analyses)

def class_name_features(run, names, args, device="cpu"):
    """Text features of the raw class names of the image encoder's head (weight recycling §4), fp32 on
    the host; the text encoder runs on device, where the run's other features were extracted."""
    return cache.extract(run.text_encoder, names, args.cache_dir, device=device, dataset=args.data,
                         split="head", modality="classnames").to("cpu")


def analysis_features(s, img, reads="pooled"):
    """(feats (M, D), labels (M,), even (M,) bool) of a labelled set for the analyses: what the
    head reads of each image (reads: the encoder's head_reads), even images the train half, odd
    images the held-out half. "pooled": one vector an image (real heads). "patches": the Shapes
    head classifies PATCHES, so a set with object masks gives its object patches (more than half
    covered by the object) instead."""
    if s.masks is None or reads != "patches":
        return img.pooled.float(), s.labels, torch.arange(len(s.labels)) % 2 == 0
    H, Wg = img.grid
    cover = torch.nn.functional.adaptive_avg_pool2d((s.masks != data.IGNORE).float()[:, None], (H, Wg))
    is_obj = cover.flatten(1) > 0.5                                       # (N, H*W)
    even = (torch.arange(len(s.labels)) % 2 == 0)[:, None].expand_as(is_obj)
    labels = s.labels[:, None].expand_as(is_obj)
    return img.patches().float()[is_obj], labels[is_obj], even[is_obj]


def head_labels(W, b, feats, class_names, head_names):
    """(M,) head row of each feature for Table 1, Fig. 1 and App. I, and where it comes from: the
    set's own label when its class is a head class (by name), else -1 ("names"); when no class
    of the set is a head class, the linear head's own top-1, argmax W f + b ("top-1", choice 8)."""
    y = head_class_index(class_names, head_names)                         # (C_set,) head row or -1
    if (y >= 0).any():
        return y, "names"
    return (feats.float() @ W.float().T + b.float()).argmax(1), "top-1"  # (M,) Eq. (1)


def weight_aligned_mlp(W, names_txt, steps=None, lr=None):
    """§4.1: methods/mlp.py aligned on D_weights alone (head rows W (C, D), names_txt: Features of the C class
    names), full batch (one step is one epoch of the C rows), with MLP.defaults' optimiser and App. E's cosine
    annealing of the lr to 0 over the steps (steps, lr: MLP.defaults). Returns the MLP in eval mode."""
    from methods.mlp import MLP
    steps, lr = steps or MLP.defaults["steps"], lr or MLP.defaults["lr"]
    mlp = MLP(W.shape[1], names_txt.tokens.shape[-1])
    return fit_full_batch(mlp, *weight_pairs(W, names_txt), steps, lr)


def cannot_analyse(run, args):
    """Why the analyses cannot run on run (align.Run: no usable head, no classification set), or None;
    align.py asks before any features are extracted."""
    try:
        run.image_encoder.head()
    except RunError as e:
        return str(e).removeprefix("error: ")
    if not any(isinstance(s, data.LabelSet) for s in run.sets.values()):
        return (f"--data {args.data} has no classification set (put one of {', '.join(eval_sets.TORCHVISION_SETS)} in "
                f"torchvision's layout under {args.data_root}/<name>)")
    return None


def recycling_analyses(run, args, device):
    """The weight-recycling paper's analyses of the image encoder's head (Table 1, Fig. 1, App. I,
    Table 2) on every classification set of --data (Shapes: "cls"; real data: the torchvision
    sets found under --data-root), keyed by set name.

    Table 1, Fig. 1 and App. I need images of the head's classes: they run on the set's
    classes that are head classes (matched by name). Table 2 runs on every set: NCC / KNN
    on frozen features vs methods/mlp.py aligned on the head rows alone, then fine-tuned
    on one pair per class (App. H) against "A photo of a {class}".
    """
    why = cannot_analyse(run, args)
    if why:
        print(f"[analyses] skipped: {why}")
        return {}
    W, b, names = run.image_encoder.head()
    label_sets = [k for k, s in run.sets.items() if isinstance(s, data.LabelSet)]
    names_txt = class_name_features(run, names, args, device)
    mlp = None                                     # fitted on the first set that runs Table 2
    results = {}
    reads = getattr(run.image_encoder, "head_reads", "pooled")
    for name in label_sets:
        s, out = run.sets[name], {}
        feats, labels, even = analysis_features(s, run.features[name, "image"], reads)
        y_head, source = head_labels(W, b, feats, s.class_names, names)
        y_head = y_head[labels] if source == "names" else y_head   # (M,) head row, -1: not a head class
        tr, te = even & (y_head >= 0), ~even & (y_head >= 0)
        if source == "top-1":
            print(f"[analyses] {name}: none of its classes is a head class (matched by name): Table 1, Fig. 1 "
                  f"and App. I take the head's own top-1 as each image's class ({y_head.unique().numel()} classes)")
        if y_head[tr].unique().numel() >= 2 and y_head[te].unique().numel() >= 2:
            out.update(head_analyses(W, b, feats[tr], y_head[tr], feats[te], y_head[te],
                                               names_txt.pooled.float()))
        else:
            print(f"[analyses] {name}: Table 1, Fig. 1, App. I skipped: fewer than 2 head classes among "
                  f"its images on either half")
        per_class = torch.bincount(labels[~even])
        fewest = int(per_class[per_class > 0].min()) if len(per_class) else 0     # held-out images of the rarest class
        shots = tuple(n for n in (1, 2, 4) if n < fewest)
        if shots:
            prompts = cache.extract(run.text_encoder, [FEW_SHOT_TEMPLATE.format(c) for c in s.class_names],
                                    args.cache_dir, dataset=args.data, split=name, modality="fewshot",
                                    template=FEW_SHOT_TEMPLATE).to("cpu")  # the key holds the text
            if mlp is None:
                mlp = weight_aligned_mlp(W, names_txt)                     # 400 full-batch steps
            aligned = lambda sf, sl: finetune_mlp_classifier(mlp, prompts, sf, sl)  # noqa: B023 (called in this iteration)
            out["few_shot"] = few_shot(feats[~even], labels[~even], support_shots=shots, aligned_classifier=aligned)
        else:
            print(f"[analyses] {name}: Table 2 skipped: a class has {fewest} held-out images (needs 2+)")
        print(f"[analyses] {name}\n" + analyses_table(out))
        results[name] = out
    return results
