"""The official grade's own checks (exercises/official.py): what a copy's tests cannot check without the course's
answers, here against tests/course_references.py. This file is the reference checkout's only, never a copy's.

Speed, where the sheet says vectorised: the student's function on the same inputs, on the same machine, timed
interleaved with the course's own, at most SLOWER times its time (a loop over the rows in Python is many times
slower; a vectorised form within a small factor)."""
import time

import course_references as ref
import torch

import similarity

SLOWER = 5


def timed(f, *args):
    t0 = time.perf_counter()
    f(*args)
    return time.perf_counter() - t0


def assert_about_as_fast(mine, theirs, args, what, rounds=3, slack=0.02):
    """mine(*args) takes at most SLOWER times theirs(*args) (the best of a few interleaved rounds, plus slack
    seconds for the clock); a first call far over the bound is not repeated."""
    theirs(*args)                                                 # warm-up: first-call costs out of the timing
    t_mine, t_theirs = [timed(mine, *args)], [timed(theirs, *args)]
    for _ in range(rounds if t_mine[0] <= 4 * SLOWER * t_theirs[0] + 1 else 0):
        t_theirs.append(timed(theirs, *args))
        t_mine.append(timed(mine, *args))
    best_mine, best_theirs = min(t_mine), min(t_theirs)
    assert best_mine <= SLOWER * best_theirs + slack, \
        f"{what} took {best_mine:.3g} s, {best_mine / best_theirs:.0f}x the course's vectorised form " \
        f"({best_theirs:.3g} s, same inputs, same machine); at most {SLOWER}x: the sheet asks for it vectorised " \
        f"(no Python loop over the rows)"


def test_mutual_knn_is_vectorised():
    g = torch.Generator().manual_seed(0)
    X, Y = torch.randn(800, 32, generator=g), torch.randn(800, 48, generator=g)
    assert_about_as_fast(similarity.mutual_knn, ref.mutual_knn, (X, Y, 10), "mutual_knn(X, Y, k) on 800 rows")
