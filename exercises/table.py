"""The one table of the course: exercise -> its regions, the tests that grade it, the hint.

regions: the files holding its `# EXERCISE N` ... `# END EXERCISE N` markers (the
    marker text says what to write; make_student_copy.py blanks what is between).
tests:   pytest node ids of the project's OWN tests covering those regions (values recorded
    on fixed inputs, closed forms, planted structures, invariances, gradients); grade.py runs exactly these.
official: node ids of the checks only the official grade runs (the reference checkout: tests/test_official.py,
    a speed bound against the course's own function), on top of tests.
hint:    the classic mistakes, printed when a graded test fails: the symptom and the equation, never the line.
Grading logic lives only in the tests; nothing here recomputes an answer.

run_needs says which exercises a run of align.py executes (the method's, the evaluation's, the
analyses'); refuse_blank_exercises stops a run that needs a still blank one, before any work (with
align.py --skip-blank, the evaluation's exercises may be blank: their evaluations are left out).
"""
import re
from pathlib import Path

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
        hint="ties ranked in favour of the truth (constant scores must give R@1 = 0: a tie counts against the truth); "
             "an i2t rank that is not the BEST of the image's captions' ranks; a t2i rank that counts the ground "
             "truth itself; AP's precision at a hit taken over the hits so far instead of the position (PAL §5.1)"),
    2: dict(
        title="Symmetric InfoNCE (PAL Eq. 8), the loss of every contrastive method",
        regions=["methods/losses.py"],
        tests=["tests/test_pal.py::test_info_nce_is_the_mean_of_both_directions",
               "tests/test_pal.py::test_gradients_reach_the_anchors_and_only_them"],
        hint="one direction only (Eq. 8 averages the image->text and the text->image cross-entropies); the "
             "temperature tau missing from the logits, or applied twice (info_nce dividing by tau, then "
             "info_nce_of_logits again: Eq. 8 divides the cosines by tau once); targets that are not each row's own "
             "pair"),
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
        hint="softmax over the anchors instead of over the tokens (Eq. 5: alpha sums to 1 over t); padded tokens "
             "that keep some weight (Eq. 5-6 run over the REAL tokens only); dot products where Eq. 3-4 take "
             "cosines; tau_p applied in Eq. 6 as well as in Eq. 5"),
    4: dict(
        title="CoV: bilinear sampling of the patch grid with grid_sample (CVSFE, deformable attention)",
        regions=["methods/cov.py"],
        tests=["tests/test_cov.py::test_deformable_sample_matches_naive_bilinear_loop",
               "tests/test_cov.py::test_deformable_sample_pixel_centre_reads_the_patch",
               "tests/test_cov.py::test_deformable_attention_init_is_deformable_detr",
               "tests/test_cov.py::test_deformable_sample_gradient_matches_finite_differences"],
        hint="align_corners=True or pixel coordinates that put the patch centres elsewhere than (j + .5) / W; "
             "locations left in [0, 1] where grid_sample reads [-1, 1]; x and y swapped (grid_sample's last dim "
             "is (x, y)); reads outside the grid that are not 0 (Deformable DETR pads with zeros); the head and "
             "query axes mixed up when flattening; a gradient that does not reach the values, locations and "
             "weights (CoV learns its offsets through them: no .detach(), no reads by rounded indices alone)"),
    5: dict(
        title="CoV: consistent assign attention, threshold mask, spatial concentration (CVSFE, CDFO)",
        regions=["methods/cov.py"],
        tests=["tests/test_cov.py::test_threshold_mask_matches_loop",
               "tests/test_cov.py::test_regions_match_naive_loop",
               "tests/test_cov.py::test_cov_conc_loss_is_the_attention_weighted_spread",
               "tests/test_cov.py::test_conc_loss_reads_the_full_softmax_attention",
               "tests/test_cov.py::test_threshold_mask_keeps_the_top_patch_of_a_constant_row",
               "tests/test_cov.py::test_threshold_mask_normalises_the_scores_not_the_softmax"],
        hint="softmax over the queries instead of over the patches; the min-max taken of the softmax output instead "
             "of the scores before it (the kept patches then depend on tau); min-max over the wrong axis; two "
             "different W for queries and patches (the consistent assign attention shares ONE W); kept patches "
             "whose weights do not sum to 1; L_conc on the masked attention attn_bar instead of the full softmax "
             "attn; patch centres elsewhere than ((j + .5) / W, (i + .5) / H); a constant row (max = min) "
             "that keeps no patch"),
    6: dict(
        title="FILIP's token-wise max-sum with padding (CoV's score too); TextGuided's mean over real words",
        regions=["methods/filip.py", "methods/text_guided.py"],
        tests=["tests/test_cov.py::test_max_sum_matches_loop_with_padding",
               "tests/test_cov.py::test_padded_words_do_not_change_the_score[CoV]",
               "tests/test_cov.py::test_padded_words_do_not_change_the_score[TextGuided]",
               "tests/test_cov.py::test_cov_dense_image_slice_is_a_one_region_image",
               "tests/test_cov.py::test_permuting_the_batch_permutes_the_scores[CoV]",
               "tests/test_cov.py::test_chunked_score_equals_unchunked[CoV]",
               "tests/test_cov.py::test_token_max_gradient_matches_finite_differences"],
        hint="padded words counted in the mean or allowed to win the max (all-zero rows are padding: they take part "
             "in neither, FILIP Eq. 4-5 average over the REAL tokens); max and mean over the same axis; only one "
             "of the two directions"),
    7: dict(
        title="CSA: CCA by Cholesky whitening and SVD",
        regions=["methods/csa.py"],
        tests=["tests/test_csa.py::test_covariances_in_chunks_match_the_whole_set",     # step (2) first: its dtype
               "tests/test_csa.py::test_planted_correlations_are_recovered",
               "tests/test_csa.py::test_matches_generalised_eigenproblem",
               "tests/test_csa.py::test_one_dimensional_views_give_absolute_pearson",
               "tests/test_csa.py::test_score_is_rho_weighted_dot_and_permutes_with_batch",
               "tests/test_csa.py::test_few_samples_and_dense_image"],
        hint="computing in float32 (the reference works in float64, as the marker says: sums over many rows in "
             "float32 lose digits); centring with the wrong mean (mu is the mean over the samples of the WHOLE set); "
             "covariances divided "
             "by N instead of N - 1 (the tests compare with torch.cov); the way back from the whitened space "
             "not undoing the whitening (check A^T S_xx A = I); one view whitened only; both views' directions "
             "taken from the same side of the SVD"),
    8: dict(
        title="Weight recycling: the cosine-classifier check of neural collapse (Table 1)",
        regions=["recycling.py"],
        tests=["tests/test_recycling.py::test_neural_collapse_exact_collapse_gives_100",
               "tests/test_recycling.py::test_neural_collapse_bias_and_norm_change_the_answer",
               "tests/test_recycling.py::test_neural_collapse_check_matches_naive_loop"],
        hint="head rows not normalised in the cosine classifier (cos(w_i, f) needs BOTH unit length); the norm "
             "taken over the classes instead of over each class's row w_i; the bias added to the cosine or left "
             "in the bias-free head; other keys than linear_top1, cosine_top1, nobias_top1"),
    9: dict(
        title="Mutual kNN between two spaces (Fig. 1)",
        regions=["similarity.py"],
        tests=["tests/test_recycling.py::test_knn_with_duplicate_rows_never_lists_a_row_itself",
               "tests/test_recycling.py::test_mutual_knn_identical_and_independent",
               "tests/test_recycling.py::test_mutual_knn_matches_naive_loop",
               "tests/test_recycling.py::test_prototype_alignment_head_rows_vs_noisy_means",
               "tests/test_pipeline.py::test_mutual_knn_and_cka_tables_equal_the_pairwise_measures"],
        official=["tests/test_official.py::test_mutual_knn_is_vectorised"],
        hint="a row counted as its own neighbour (Fig. 1's kNN is over the OTHER rows, duplicate rows included); "
             "Euclidean instead of cosine neighbours (a row's length must not move them); the overlap divided "
             "by N instead of k; a loop over the rows in Python (the sheet asks for it vectorised: the official "
             "grade allows at most 5x the course's time)"),
    10: dict(
        title="Zero-shot segmentation: upsampled per-patch scores and mIoU over foreground classes",
        regions=["evaluate.py"],
        tests=["tests/test_evaluate.py::test_miou_hand_made_and_ignore_pixels_excluded",
               "tests/test_evaluate.py::test_miou_accumulates_over_the_set_not_per_image",
               "tests/test_evaluate.py::test_segmentation_one_hot_dense_is_perfect_and_matches_known_swap",
               "tests/test_evaluate.py::test_segmentation_with_token_level_method_runs_per_patch",
               "tests/test_evaluate.py::test_segmentation_upsamples_logits_bilinearly",
               "tests/test_evaluate.py::test_segmentation_sums_intersections_and_unions_over_all_batches"],
        hint="H and W swapped when the patch logits (B*H*W, C) become (B, C, H, W) (right for square grids only: "
             "img.grid is (H, W), the patches row after row, and the tests' grids are not square); "
             "nearest instead of bilinear upsampling, or align_corners=True (MaskCLIP upsamples the LOGITS "
             "bilinearly, pixel centres at (j + .5) / W, then takes the argmax); IoU averaged per image instead "
             "of over the set's summed intersections and unions; ignored (background) pixels counted; classes "
             "absent from both prediction and truth counted as IoU 0; no ValueError for a gt label outside 0..C-1"),
    11: dict(
        title="STRUCTURE: the R_S regulariser (neighbourhood distributions, JS divergence)",
        regions=["methods/structure.py"],
        tests=["tests/test_structure.py::test_rs_matches_loops",
               "tests/test_structure.py::test_rs_zero_for_identity_and_rotation_positive_otherwise",
               "tests/test_structure.py::test_identity_head_has_zero_regulariser",
               "tests/test_structure.py::test_rs_gradient_matches_finite_differences"],
        hint="centring before normalising (R_S normalises each row, then centres over the batch), or centring over "
             "the features instead of the batch; KL in the wrong direction (JS = (KL(P || M) + KL(Q || M)) / 2); "
             "softmax over the columns; a sum over the rows where R_S takes their mean; a .detach() (or .item(), "
             "torch.no_grad) that stops R_S's gradient: LinearRS and MLPRS train through it"),
    12: dict(
        title="ASIF: sparse, sharpened relative representations",
        regions=["methods/asif.py"],
        tests=["tests/test_asif.py::test_relative_representation_matches_loop",
               "tests/test_asif.py::test_relative_representation_at_the_default_even_power",
               "tests/test_asif.py::test_k_capped_by_anchor_count_and_n_anchors",
               "tests/test_asif.py::test_retrieval_on_paired_clusters_and_permutation",
               "tests/test_asif.py::test_dense_image_matches_pooled_representation"],
        hint="the power applied before the top-k / clamp (with the default even p = 8 a strongly DISsimilar "
             "anchor then counts as a match); k not capped at the number of anchors; the normalisation taken "
             "before the power"),
    13: dict(
        title="Zero-shot classification: prompt-template averaging and class logits",
        regions=["evaluate.py"],
        tests=["tests/test_evaluate.py::test_template_average_matches_naive",
               "tests/test_evaluate.py::test_token_level_class_logits_average_scores_over_templates",
               "tests/test_evaluate.py::test_classification_with_class_mean_prompts_is_perfect"],
        hint="averaging the templates before normalising each one (each template's embedding is a unit vector "
             "before the mean, the mean is one again); reading the (N, C*n) scores as (N, n, C) although prompts "
             "are class-major (N, C, n)"),
}

# The other exercises whose code an exercise's graded tests also run (grade.py says BLOCKED while one is blank;
# the sheet's "needs" column; tests/test_exercises.py checks both against what grading finds).
DEPENDS = {2: [3], 5: [2, 6], 6: [3, 4, 5], 10: [13], 11: [2]}

# The exercises a run of align.py executes: its method's (method_needs: read off its code), then the evaluation's.
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


def method_needs(method):
    """The exercises a method's training and scoring run: those with a region in its own file or in a file of
    methods/ it imports (the files of its identity's method_code, infra/run.py), so that a new method needs no
    line here."""
    import os

    from infra.run import method_files
    from methods import METHODS
    files = {os.path.relpath(f, ROOT) for f in method_files(METHODS[method])}
    return sorted(n for n, ex in EXERCISES.items() if n not in EVALUATION and files & set(ex["regions"]))


def run_needs(method, analyses=False, select_layers=None):
    """Sorted exercise numbers a run of align.py with these settings executes."""
    need = set(method_needs(method)) | set(EVALUATION)
    need |= set(ANALYSES) if analyses else set()
    need |= set(SELECT_MKNN) if select_layers == "mknn" else set()
    return sorted(need)


def refuse_blank_exercises(method, analyses=False, select_layers=None, root=ROOT, skip_blank=False):
    """Stop with one error line if the run needs an exercise that is still blank here; silent otherwise.
    skip_blank (align.py --skip-blank): the evaluation's exercises may be blank, their evaluations are left out."""
    from infra.errors import RunError  # (align.py's error; the grader imports nothing of infra/)
    blank = blank_exercises(root)
    if not blank:                                  # the reference, or every exercise done
        return
    need = run_needs(method, analyses, select_layers)
    missing = [n for n in need if n in blank and not (skip_blank and n in EVALUATION)]
    if missing:
        fix = (f"finish {'it' if len(missing) == 1 else 'them'}: python exercises/grade.py "
               f"{' '.join(map(str, missing))} says what is left")
        if set(missing) & set(EVALUATION):
            fix += (f"; --skip-blank runs without the evaluations that need "
                    f"{', '.join(str(n) for n in missing if n in EVALUATION)} (retrieval: 1, classification: 13, "
                    f"segmentation: 10 and 13)")
        raise RunError(f"--method {method}{' --analyses' if analyses else ''} needs exercises "
                       f"{', '.join(map(str, need))}; still blank: {', '.join(map(str, missing))} ({fix})")
