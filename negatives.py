"""Composition-aware hard negatives (--hard-negatives): NegCLIP, from "When and why vision-language
models behave like bags-of-words, and what to do about it?" (Yuksekgonul et al., ICLR 2023), Sec. 4.

For each training caption, captions that use the same words but bind them differently. The
Shapes world makes them from the scene (shapes.scene_swaps); any other caption gets a rule over
its noun phrases (word_swaps), with no list of nouns. hard_negative_captions gathers them for a
training set; hard_negative_loss is NegCLIP's image -> text term, which the training loop adds
to the method's own loss through the method's interface only.
"""
import re

import torch

from infra.errors import RunError

# The closed word classes the rule reads (open classes, nouns and adjectives, are whatever they delimit).
DETERMINERS = {"a", "an", "the", "this", "that", "these", "those", "its", "his", "her", "their", "my", "your",
               "our", "some", "one", "two", "three", "four", "five", "several", "many", "another", "each"}


# asymmetric relations only ("next to", "near", "with" read the same both ways); longest first
RELATION_WORDS = ["to the left of", "to the right of", "on top of", "in front of", "left of", "right of", "above",
                  "below", "under", "underneath", "beneath", "behind", "inside", "on", "in"]


BOUNDARY = {"and", "or", "but", "with", "of", "at", "by", "for", "from", "to", "into", "onto", "near", "next",
            "beside", "over", "through", "down", "up", "across", "along", "around", "while", "as", "is", "are",
            "was", "were", "be", "has", "have", "there", "that", "which", "who", "it", "them", "above", "below",
            "under", "underneath", "beneath", "behind", "inside", "on", "in"}  # ends a noun phrase


AUXILIARIES = {"is", "are", "was", "were", "sits", "sit", "stands", "stand", "lies", "lie", "being"}


def _words(text):
    return re.findall(r"[\w']+|[^\w\s]", text)


def _join(words, spaced):
    """The words as one caption: a space before each word, and before punctuation where the caption had one."""
    return "".join((" " if k and (gap or w[:1].isalnum()) else "") + w for k, (w, gap) in enumerate(zip(words, spaced)))


def _verb_form(word):
    return len(word) > 4 and (word.endswith("ing") or word.endswith("ed"))


def noun_phrases(words):
    """Noun phrases as (start, end) spans of a word list, end exclusive: a determiner (or the caption's
    first word), then modifiers and a noun, up to the first closed-class word, punctuation or verb form
    (a word ending in -ing / -ed after the phrase's first word); the noun is the span's last word."""
    low, spans, i = [w.lower() for w in words], [], 0
    while i < len(low):
        if low[i] in DETERMINERS or (i == 0 and low[i].isalpha() and low[i] not in BOUNDARY):
            c = j = i + (low[i] in DETERMINERS)                        # c: the first modifier or noun
            while j < len(low) and low[j].isalpha() and low[j] not in BOUNDARY and low[j] not in DETERMINERS \
                    and not (j > c and _verb_form(low[j])):
                j += 1
            if j > c:
                spans.append((i, j))
                i = j
                continue
        i += 1
    return spans


def _articles(words):
    """a / an agreeing with the next word (a swap can put "old" after "a")."""
    def fix(x, n):
        if x.lower() not in ("a", "an"):
            return x
        a = "an" if n[:1].lower() in "aeiou" else "a"
        return a.capitalize() if x[:1].isupper() else a
    return [fix(x, n) for x, n in zip(words, words[1:] + [""])]


def word_swaps(text):
    """Hard negatives of any caption by a rule over its noun phrases (noun_phrases, no list of nouns):

    1. attribute swap: the first two noun phrases with modifiers (words between the determiner and
       the noun) exchange their modifiers nearest the noun that differ
       ("a red bus next to a white car" -> "a white bus next to a red car");
    2. object swap: at the first relation phrase (RELATION_WORDS, asymmetric, longest first) that has
       a noun phrase right after it and one before it (at most two auxiliaries or verb forms between),
       the two noun phrases exchange places ("a cat sitting on a table" -> "a table sitting on a cat").
    Returns the swaps that apply (0, 1 or 2 captions), each different from the text."""
    w = _words(text)
    low = [x.lower() for x in w]
    spaced = [m.start() > 0 and text[m.start() - 1].isspace() for m in re.finditer(r"[\w']+|[^\w\s]", text)]
    spans, perms = noun_phrases(w), []
    det = lambda s: int(low[s[0]] in DETERMINERS)
    mods = [s for s in spans if s[1] - s[0] - det(s) >= 2]            # determiner, >= 1 modifier, noun
    if len(mods) >= 2:
        (i0, j0), (i1, j1) = mods[:2]
        m0, m1 = range(j0 - 2, i0 + det(mods[0]) - 1, -1), range(j1 - 2, i1 + det(mods[1]) - 1, -1)
        pair = next(((p, q) for p, q in zip(m0, m1) if low[p] != low[q]), None)  # nearest the noun first
        if pair:
            perm = list(range(len(w)))
            perm[pair[0]], perm[pair[1]] = pair[1], pair[0]
            perms.append(perm)
    starts = {s[0]: s for s in spans}
    for at in range(len(low)):
        rel = next((r.split() for r in RELATION_WORDS if low[at:at + len(r.split())] == r.split()), None)
        if rel is None or at + len(rel) not in starts:
            continue
        before = [s for s in spans if s[1] <= at and all(low[k] in AUXILIARIES or _verb_form(low[k])
                                                          for k in range(s[1], at)) and at - s[1] <= 2]
        if before:
            (i0, j0), (i1, j1) = before[-1], starts[at + len(rel)]
            k = list(range(len(w)))
            perms.append(k[:i0] + k[i1:j1] + k[j0:i1] + k[i0:j0] + k[j1:])
        break                                                         # the first relation phrase that starts one
    out = []
    for perm in perms:
        v = [w[k] if k else low[0] if low[0] in DETERMINERS else w[0] for k in perm]  # the capital stays first
        if w[0][:1].isupper():
            v[0] = v[0][:1].upper() + v[0][1:]
        out.append(_join(_articles(v), [spaced[k] for k in perm]))
    return [c for c in dict.fromkeys(out) if c.lower() != text.lower()]  # once each (same-shape objects: one)


def hard_negative_captions(pairs):
    """The swapped captions of every training caption, flat, and index (N, M) long: row i's swaps
    (-1 = none). Shapes: the PairSet's scene swaps (shapes.scene_swaps); real captions: word_swaps."""
    negs = pairs.hard_negatives
    if negs is None:
        negs = [word_swaps(c) for c in pairs.captions]
    M = max(len(n) for n in negs)
    if M == 0:
        raise RunError("--hard-negatives: no training caption has a swap (negatives.word_swaps found no "
                       "two noun phrases with modifiers to exchange and no relation phrase between two noun phrases)")
    flat, index = [], torch.full((len(negs), M), -1, dtype=torch.long)
    for i, n in enumerate(negs):
        for m, c in enumerate(n):
            index[i, m] = len(flat)
            flat.append(c)
    print(f"[hard negatives] {len(flat)} swapped captions for {int((index[:, 0] >= 0).sum())}/"
          f"{len(negs)} training captions (up to {M} each)")
    return flat, index


def contrastive_scale(method):
    """1 / temperature of the method's contrastive logits (its contrastive_scale()), None for a
    method that is not contrastive."""
    return method.contrastive_scale() if method.contrastive_scale is not None else None


def hard_negative_loss(method, img, txt, neg, has_neg, scale):
    """NegCLIP's image -> text term, computed only through the method's interface:

        L_hn = -1/B sum_i log softmax_j(scale * [s(i, t_1..t_B), s(i, n_i1..n_iM)])_i

    s = method.contrastive_score (the score its own loss scales), t_j the batch's captions, n_im
    caption i's swaps. img, txt: B pairs;
    neg: Features (B*M,), row i*M + m = swap m of caption i; has_neg: (B, M) bool (False = no swap).
    The batch is embedded again here (not shared with method.loss): one more forward, one path."""
    B, M = has_neg.shape
    v = method.embed_image(img)                                                     # (B, ...)
    S = method.contrastive_score(v, method.embed_text(txt))                         # (B, B)
    real = has_neg.flatten().nonzero().squeeze(1)                      # (N_real,) only real swaps
    S_neg = method.contrastive_score(v, method.embed_text(neg[real])) if len(real) else S[:, :0]  # (B, N_real)
    own = S.new_zeros(B * M)                                           # (B*M,)
    own[real] = S_neg[real // M, torch.arange(len(real), device=S.device)]  # s(i, n_im), i = row // M
    logits = torch.cat([S, own.view(B, M)], 1) * scale                 # (B, B + M)
    # no swap -> -inf AFTER the scale: a learned scale (SAIL, FA) times -inf gives a NaN gradient
    no_swap = torch.cat([torch.zeros_like(S, dtype=torch.bool), ~has_neg], 1)
    logits = logits.masked_fill(no_swap, float("-inf"))
    return torch.nn.functional.cross_entropy(logits, torch.arange(B, device=logits.device))
