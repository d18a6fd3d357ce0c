"""Names that cross the wire between FedUQ sites and the server.

Everything a site sends beyond the model parameters is listed here: this module is the privacy
ledger of FedUQ (see docs/reference/privacy.md, "What leaves a site").
"""


# The server log line of a job that stopped: ``FEDUQ_JOB_FAILED {"reason": ..., "sites": {site: why}}``
# (written by feduq.flare.quorum, read by feduq.recipes.outcome).
JOB_FAILED_MARKER = "FEDUQ_JOB_FAILED"


#: A site's own FedUQ settings, ``<site workspace>/local/feduq_site.json`` (``{"data_root", "center", "on_bad_file"}``):
#: written by ``feduq prepare-site``, read by the executors; a job never carries a data path.
SITE_CONFIG_FILE = "feduq_site.json"


class FedUQTask:
    """FLARE task names used by FedUQ workflows and executors."""

    TRAIN = "train"
    VALIDATE_SURROGATE = "validate_surrogate"  # FedEvi: epistemic statistic of the surrogate model
    VALIDATE = "validate"  # validation Dice of a model on the site's validation split
    TEST = "test"  # final per-site test evaluation of the best global model
    SUBMIT_MODEL = "submit_model"


class FedUQMetaKey:
    """Keys of ``FLModel.meta`` (client -> server and server -> client)."""

    NUM_SAMPLES = "feduq_num_samples"  # N_k, number of training images of the site (int)
    NUM_VAL_SAMPLES = "feduq_num_val_samples"
    SITE = "feduq_site"
    ROUND = "feduq_round"
    LAST_COMPLETED_ROUND = "feduq_last_completed_round"  # in checkpoint meta: resume continues after it
    SERVER_PART = "feduq_server_part"  # in checkpoint meta: the method's server part class (resume checks it)
    SITE_ERROR = "feduq_site_error"  # header of a site's error reply: its own error message (str, <= 1000 chars)
    # server -> site with a test task of a model other than the global one: the results' name (GraphFedSeg's
    # "personalised"); the site keeps its per-image scores under that name, beside the global model's (str)
    TEST_RESULTS = "feduq_test_results"
    # FedEvi
    MEAN_ALEATORIC = "fedevi_mean_u_ale"  # A_k: mean over val images of U_ale under the local model
    MEAN_INV_ALEATORIC = "fedevi_mean_inv_u_ale"  # R_k: mean over val images of 1/U_ale (paper form)
    MEAN_EPISTEMIC = "fedevi_mean_u_epi"  # G_k: mean over val images of U_epi under the surrogate model
    FEDEVI_BETA = "fedevi_beta"  # server -> client: dict site -> beta_k (logged, informational)
    # FedUAA
    FEDUAA_THRESHOLD = "feduaa_youden_threshold"  # theta_k: the site's Youden uncertainty threshold (float or None)
    FEDUAA_THRESHOLDS = "feduaa_thresholds"  # server -> client: dict site -> theta used (logged, informational)
    # GraphFedSeg
    MEAN_VACUITY = "graphfedseg_mean_vacuity"  # U_k: mean vacuity u = C/S over the site's images (float >= 0)
    GRAPH = "graphfedseg_w"  # in checkpoint meta: the K x K collaboration graph W and its site order


class FedUQMetric:
    """Metric names reported in ``FLModel.metrics``."""

    VAL_DICE = "val_dice"  # mean foreground Dice of the received global model on the validation split
    VAL_LOSS = "val_loss"  # its mean validation Dice loss on the probabilities (official FedEvi model selection)
    TRAIN_LOSS = "train_loss"
    DICE = "dice"
    HD95 = "hd95"
    # image-level classification (FedUAA's original form)
    VAL_AUC = "val_auc"  # AUC (softmax of the raw output) of the received global model on the validation split
    VAL_ACCURACY = "val_accuracy"
    AUC = "auc"
    ACCURACY = "accuracy"
