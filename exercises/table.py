"""The one table of the course: exercise -> its regions, the tests that grade it, the hint.

regions: the files holding its `# EXERCISE N` ... `# END EXERCISE N` markers (the
    marker text says what to write; make_student_copy.py blanks what is between).
tests:   pytest node ids of the project's OWN tests covering those regions (naive
    loops, closed forms, planted structures); grade.py runs exactly these.
hint:    the classic mistakes, printed when a graded test fails.
Grading logic lives only in the tests; nothing here recomputes an answer.

NEEDS says which exercises a run of align.py executes (the method's, the evaluation's, the
analyses'); refuse_blank_exercises stops a run that needs a still blank one, before any work.
"""
import json
import re
from pathlib import Path

from infra.errors import RunError

ROOT = Path(__file__).resolve().parents[1]
COPY_RECORD = Path("exercises/this_copy.json")    # written into a student copy: the exercises it blanked
BLANK_LINE = re.compile(r"^[ \t]*raise NotImplementedError\(['\"]Exercise (\d+) ", re.M)

EXERCISES = {
    1: dict(
        title="Retrieval: R@K, RSum, mAP from a score matrix",
        regions=["evaluate.py"],
        tests=["tests/test_evaluate.py::test_recalls_on_hand_made_matrix_with_known_ranks",
               "tests/test_evaluate.py::test_constant_scores_count_ties_against_the_ground_truth",
               "tests/test_evaluate.py::test_retrieval_metrics_match_naive_loops",
               "tests/test_evaluate.py::test_retrieval_metrics_invariant_to_consistent_permutation",
               "tests/test_evaluate.py::test_retrieval_end_to_end_is_perfect_for_near_copies_and_uses_eval_mode"],
        hint="ties ranked in favour of the truth (> where >= belongs: constant scores must give R@1 = 0); "
             "i2t rank = the BEST of the image's captions, not the first; t2i rank counting the ground truth "
             "itself; AP dividing by the hits so far instead of the position"),
    2: dict(
        title="Symmetric InfoNCE (PAL Eq. 8), the loss of every contrastive method",
        regions=["methods/losses.py"],
        tests=["tests/test_pal.py::test_info_nce_is_the_mean_of_both_directions",
               "tests/test_pal.py::test_gradients_reach_the_anchors_and_only_them"],
        hint="one direction only (image -> text): average the cross-entropies of logits AND logits.T; "
             "forgetting the temperature tau; targets off the diagonal"),
    3: dict(
        title="PAL: token-to-anchor cosines and cross-attention pooling (Eq. 3-6)",
        regions=["methods/pal.py"],
        tests=["tests/test_pal.py::test_pooling_matches_naive_loop",
               "tests/test_pal.py::test_cap_at_default_tau_p_matches_naive_loop",
               "tests/test_pal.py::test_global_pooling_is_relative_representation_of_one_vector",
               "tests/test_pal.py::test_padding_does_not_change_h",
               "tests/test_pal.py::test_anchor_gradient_matches_finite_differences_with_padding",
               "tests/test_pal.py::test_dense_image_is_normalised_per_patch_relative_representation",
               "tests/test_pal.py::test_permuting_the_batch_permutes_the_scores"],
        hint="softmax over the anchors (dim 2) instead of over the tokens (dim 1); forgetting the padding mask "
             "(padded tokens must get weight 0: -inf before the softmax); dot products instead of cosines "
             "(normalise both Z and A); dividing by tau_p in Eq. 6 as well as in Eq. 5"),
    4: dict(
        title="CoV: bilinear sampling of the patch grid with grid_sample (CVSFE, deformable attention)",
        regions=["methods/cov.py"],
        tests=["tests/test_cov.py::test_deformable_sample_matches_naive_bilinear_loop",
               "tests/test_cov.py::test_deformable_sample_pixel_centre_reads_the_patch",
               "tests/test_cov.py::test_deformable_attention_init_is_deformable_detr"],
        hint="align_corners=True (pixel centres sit at (j+.5)/W: align_corners=False); forgetting 2 * loc - 1 "
             "(grid_sample wants [-1, 1]); swapping x and y (grid_sample's last dim is (x, y)); padding_mode "
             "'border' instead of zeros; mixing up the head and query axes when flattening"),
    5: dict(
        title="CoV: consistent assign attention, threshold mask, spatial concentration (CVSFE, CDFO)",
        regions=["methods/cov.py"],
        tests=["tests/test_cov.py::test_threshold_mask_matches_loop",
               "tests/test_cov.py::test_regions_match_naive_loop",
               "tests/test_cov.py::test_cov_conc_loss_is_the_attention_weighted_spread",
               "tests/test_cov.py::test_conc_loss_reads_the_full_softmax_attention",
               "tests/test_cov.py::test_threshold_mask_keeps_the_top_patch_of_a_constant_row",
               "tests/test_cov.py::test_threshold_mask_normalises_the_scores_not_the_softmax"],
        hint="softmax over the queries instead of over the patches; min-max of the softmax output instead of the "
             "scores before it (eps then depends on tau); min-max over the wrong axis; two different "
             "W for queries and patches (the consistent assign attention shares ONE W); forgetting to "
             "renormalise the softmax over the kept patches; L_conc on the masked attention attn_bar instead of the "
             "full softmax "
             "attn; patch centres at j/W instead of (j+.5)/W; a constant row (max = min) masking every patch"),
    6: dict(
        title="FILIP's token-wise max-sum with padding (CoV's score too); TextGuided's mean over real words",
        regions=["methods/filip.py", "methods/text_guided.py"],
        tests=["tests/test_cov.py::test_max_sum_matches_loop_with_padding",
               "tests/test_cov.py::test_padded_words_do_not_change_the_score[CoV]",
               "tests/test_cov.py::test_padded_words_do_not_change_the_score[TextGuided]",
               "tests/test_cov.py::test_cov_dense_image_slice_is_a_one_region_image",
               "tests/test_cov.py::test_permuting_the_batch_permutes_the_scores[CoV]",
               "tests/test_cov.py::test_chunked_score_equals_unchunked[CoV]"],
        hint="padded words counted in the mean or allowed to win the max (all-zero rows are padding: mask them "
             "with -inf / a very negative number before the max, divide by the REAL count); max and mean over "
             "the same axis; only one of the two directions"),
    7: dict(
        title="CSA: CCA by Cholesky whitening and SVD",
        regions=["methods/csa.py"],
        tests=["tests/test_csa.py::test_planted_correlations_are_recovered",
               "tests/test_csa.py::test_matches_generalised_eigenproblem",
               "tests/test_csa.py::test_one_dimensional_views_give_absolute_pearson",
               "tests/test_csa.py::test_score_is_rho_weighted_dot_and_permutes_with_batch",
               "tests/test_csa.py::test_few_samples_and_dense_image",
               "tests/test_csa.py::test_covariances_in_chunks_match_the_whole_set"],
        hint="centring with the wrong mean (the mean over samples, dim 0, of the WHOLE set, not per row or per "
             "chunk); dividing the covariances by N instead of N - 1; whitening with L instead of L^T on the way "
             "back (A = L_x^-T U); whitening one view only; using U for both views (B comes from V = Vh.T)"),
    8: dict(
        title="Weight recycling: the cosine-classifier check of neural collapse (Table 1)",
        regions=["recycling.py"],
        tests=["tests/test_recycling.py::test_neural_collapse_exact_collapse_gives_100",
               "tests/test_recycling.py::test_neural_collapse_bias_and_norm_change_the_answer",
               "tests/test_recycling.py::test_neural_collapse_check_matches_naive_loop"],
        hint="head rows not normalised in the cosine classifier (cos needs BOTH w_i and f unit length); "
             "normalising W along dim 0 (each class's ROW w_i is what gets unit length: dim -1); the bias added to "
             "the cosine or left in the bias-free head; other keys than linear_top1, cosine_top1, nobias_top1"),
    9: dict(
        title="Mutual kNN between two spaces (Fig. 1)",
        regions=["similarity.py"],
        tests=["tests/test_recycling.py::test_mutual_knn_matches_naive_loop",
               "tests/test_recycling.py::test_mutual_knn_identical_and_independent",
               "tests/test_recycling.py::test_prototype_alignment_head_rows_vs_noisy_means",
               "tests/test_pipeline.py::test_mutual_knn_and_cka_tables_equal_the_pairwise_measures"],
        hint="a row counted as its own neighbour (set the diagonal to -inf before top-k); Euclidean instead "
             "of cosine neighbours (normalise the rows); dividing the overlap by N instead of k"),
    10: dict(
        title="Zero-shot segmentation: upsampled per-patch scores and mIoU over foreground classes",
        regions=["evaluate.py"],
        tests=["tests/test_evaluate.py::test_miou_hand_made_and_ignore_pixels_excluded",
               "tests/test_evaluate.py::test_miou_accumulates_over_the_set_not_per_image",
               "tests/test_evaluate.py::test_segmentation_one_hot_dense_is_perfect_and_matches_known_swap",
               "tests/test_evaluate.py::test_segmentation_with_token_level_method_runs_per_patch",
               "tests/test_evaluate.py::test_segmentation_upsamples_logits_bilinearly",
               "tests/test_evaluate.py::test_segmentation_sums_intersections_and_unions_over_all_batches"],
        hint="nearest instead of bilinear upsampling, or align_corners=True (upsample the LOGITS bilinearly "
             "with align_corners=False, then argmax); averaging IoU per image instead of summing intersections "
             "and unions over the set; counting ignored (background) pixels; classes absent from both "
             "prediction and truth counted as IoU 0; no ValueError for a gt label outside 0..C-1"),
    11: dict(
        title="STRUCTURE: the R_S regulariser (neighbourhood distributions, JS divergence)",
        regions=["methods/structure.py"],
        tests=["tests/test_structure.py::test_rs_matches_loops",
               "tests/test_structure.py::test_rs_zero_for_identity_and_rotation_positive_otherwise",
               "tests/test_structure.py::test_identity_head_has_zero_regulariser"],
        hint="centring before normalising (normalise the rows first, then subtract the batch mean), or centring "
             "over the features instead of the batch; KL in the wrong direction (KL(P || M), not KL(M || P)); "
             "softmax over the columns; summing instead of averaging over rows"),
    12: dict(
        title="ASIF: sparse, sharpened relative representations",
        regions=["methods/asif.py"],
        tests=["tests/test_asif.py::test_relative_representation_matches_loop",
               "tests/test_asif.py::test_relative_representation_at_the_default_even_power",
               "tests/test_asif.py::test_k_capped_by_anchor_count_and_n_anchors",
               "tests/test_asif.py::test_retrieval_on_paired_clusters_and_permutation",
               "tests/test_asif.py::test_dense_image_matches_pooled_representation"],
        hint="the power applied before the top-k / clamp (with the default even p = 8 a strongly DISsimilar "
             "anchor then counts as a match); forgetting to cap k at the number of anchors; normalising before "
             "the power"),
    13: dict(
        title="Zero-shot classification: prompt-template averaging and class logits",
        regions=["evaluate.py"],
        tests=["tests/test_evaluate.py::test_template_average_matches_naive",
               "tests/test_evaluate.py::test_token_level_class_logits_average_scores_over_templates",
               "tests/test_evaluate.py::test_classification_with_class_mean_prompts_is_perfect"],
        hint="averaging the templates before normalising each one (normalise, average, normalise again); "
             "reshaping the (N, C*n) scores as (N, n, C) although prompts are class-major (N, C, n)"),
}

# The other exercises whose code an exercise's graded tests also run (grade.py says BLOCKED while one is blank;
# the sheet's "needs" column; tests/test_exercises.py checks both against what grading finds).
DEPENDS = {2: [3], 5: [2, 6], 6: [4, 5], 10: [13], 11: [2]}

# The exercises a run of align.py executes: its method's (training and scoring), then the evaluation's.
NEEDS = {
    "pal": [2, 3], "pal_rel": [2, 3], "cov": [2, 4, 5, 6], "text_guided": [2, 6], "filip": [2, 6], "fa": [2],
    "linear": [2], "linear_rs": [2, 11], "mlp_rs": [2, 11], "csa": [7], "asif": [12], "mlp": [], "t2c": [],
    "sail": [],
}
EVALUATION = [1, 10, 13]       # retrieval, segmentation, zero-shot classification (every run evaluates them)
ANALYSES = [8, 9]              # --analyses: the neural-collapse check and mutual kNN (weight recycling)
SELECT_MKNN = [9]              # --select-layers mknn


def blank_exercises(root=ROOT):
    """The exercises with a region still blank in the checkout at root: a student copy's raise line, as code (a
    commented-out raise above a finished body is not blank)."""
    blank = set()
    for rel in sorted({r for ex in EXERCISES.values() for r in ex["regions"]}):
        path = Path(root) / rel
        if path.is_file():
            blank |= {int(n) for n in BLANK_LINE.findall(path.read_text())}
    return blank


def copy_blanked(root=ROOT):
    """The exercises make_student_copy.py blanked in the copy at root (its exercises/this_copy.json); every
    exercise where there is no such file."""
    record = Path(root) / COPY_RECORD
    return set(json.loads(record.read_text())["blanked"]) if record.is_file() else set(EXERCISES)


def run_needs(method, analyses=False, select_layers=None):
    """Sorted exercise numbers a run of align.py with these settings executes."""
    need = set(NEEDS.get(method, [])) | set(EVALUATION)
    need |= set(ANALYSES) if analyses else set()
    need |= set(SELECT_MKNN) if select_layers == "mknn" else set()
    return sorted(need)


def refuse_blank_exercises(method, analyses=False, select_layers=None, root=ROOT):
    """Stop with one error line if the run needs an exercise that is still blank here; silent otherwise."""
    blank = blank_exercises(root)
    if not blank:                                  # the reference, or every exercise done
        return
    need = run_needs(method, analyses, select_layers)
    missing = [n for n in need if n in blank]
    if missing:
        # the method's exercises and the finished ones, among those this copy blanked: a copy that blanks only
        # them has the reference code for the rest (worth making only if it leaves out a blank one)
        mine = sorted((set(NEEDS.get(method, [])) | (set(need) - blank)) & copy_blanked(root))
        if set(missing) - set(mine):
            fix = (f"finish them, or run it in a copy that blanks only yours: python exercises/make_student_copy.py "
                   f"DIR --only {' '.join(map(str, mine)) or 'N ...'}, then paste your solutions in")
        else:
            fix = (f"finish {'it' if len(missing) == 1 else 'them'}: python exercises/grade.py "
                   f"{' '.join(map(str, missing))} says what is left")
        raise RunError(f"--method {method}{' --analyses' if analyses else ''} needs exercises "
                 f"{', '.join(map(str, need))}; still blank: {', '.join(map(str, missing))} ({fix})")
