"""Uncertainty-quality metrics, computed the same way for every method (no FLARE here).

Every method gives, per pixel, class probabilities (softmax, the Dirichlet mean α/S, or FIVA's sample mean) and an
uncertainty map (:mod:`feduq.scores.maps`: softmax entropy, evidential total/aleatoric/epistemic, ...). This module scores
how good those are, from arrays only:

* **Calibration**: reliability bins and the expected calibration error (ECE, Guo et al., ICML 2017) with **15
  equal-width bins** on [0, 1] as FIVA reports it. Bin b holds confidences in [b/15, (b+1)/15); the top edge 1.0 is in
  the last bin (bin = min(floor(conf·n), n−1)). ``ECE = Σ_b n_b/N · |acc_b − conf_b|``.
  :func:`feduq.scores.metrics.calibration_error` (MONAI) is a different reading of the same formula: per image, one-vs-rest
  per foreground class (confidence p_c, "correct" y_c), 20 bins by default, averaged over classes. On the same inputs
  (confidence = p_c, correct = [label == c], same bin count) the two agree; the tests check it. This module's
  :class:`PixelAccumulator` uses the top-label reading instead (confidence = max_c p_c, correct = argmax == label),
  pooled over every pixel of a site's test set, background included.
* **Proper scores**: multi-class Brier score (Brier 1950; sum over classes, range [0, 2]; twice scikit-learn's binary
  ``brier_score_loss``, equal to its ``scale_by_half=False``) and the negative log-likelihood in nats.
* **Error detection**: the uncertainty map as a score for mis-segmented pixels (argmax ≠ label): AUROC and AUPRC
  (scikit-learn ``roc_auc_score`` / ``average_precision_score``); the AUPRC of a random score is the error rate.
* **Image level**: Spearman correlation between an image's mean uncertainty and its Dice (scipy ``spearmanr``;
  a good uncertainty gives ρ < 0), and the risk–coverage curve with its area (AURC; Geifman et al., ICLR 2019), risk =
  1 − Dice.
"""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

import numpy as np
from scipy.stats import spearmanr
from sklearn.metrics import average_precision_score, roc_auc_score

FIVA_BINS = 15


def _np(x, dtype=np.float64) -> np.ndarray:
    if hasattr(x, "detach"):  # torch tensor
        x = x.detach().cpu().numpy()
    return np.asarray(x, dtype=dtype)


def reliability_bins(confidence, correct, n_bins: int = FIVA_BINS) -> dict[str, np.ndarray]:
    """Per-bin statistics of a reliability diagram (equal-width bins on [0, 1], see module doc).

    Args:
        confidence: ``[N]`` (any shape, flattened) float confidences in [0, 1]; values outside are clipped.
        correct: same size, bool or {0, 1}: whether each prediction is right.
        n_bins: number of bins (15 as in FIVA).

    Returns:
        ``{"edges": [n_bins+1], "count": [n_bins] int64, "confidence": [n_bins], "accuracy": [n_bins]}``, the means
        float64 and NaN in empty bins. Same binning as scikit-learn ``calibration_curve(strategy="uniform")`` except
        for a confidence exactly on an interior edge, which goes to the upper bin here.

    Raises:
        ValueError: sizes differ or ``n_bins < 1``.
    """
    return _bins_from_sums(*_bin_sums(confidence, correct, n_bins))


def _bin_sums(confidence, correct, n_bins: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per-bin count, sum of confidences and number correct (the exact streaming state)."""
    conf, corr = _np(confidence).ravel(), _np(correct).ravel()
    if conf.size != corr.size or n_bins < 1:
        raise ValueError(f"reliability_bins: {conf.size} confidences vs {corr.size} labels, n_bins={n_bins}")
    conf = np.clip(conf, 0.0, 1.0)
    idx = np.minimum(np.floor(conf * n_bins), n_bins - 1).astype(np.int64)
    return np.bincount(idx, minlength=n_bins), np.bincount(idx, conf, n_bins), np.bincount(idx, corr, n_bins)


def _bins_from_sums(count: np.ndarray, conf_sum: np.ndarray, correct_sum: np.ndarray) -> dict[str, np.ndarray]:
    n_bins = len(count)
    with np.errstate(invalid="ignore", divide="ignore"):
        mean_conf, acc = conf_sum / count, correct_sum / count
    return {"edges": np.linspace(0.0, 1.0, n_bins + 1), "count": count.astype(np.int64), "confidence": mean_conf,
            "accuracy": acc}


def ece_from_bins(bins: Mapping[str, np.ndarray]) -> float:
    """``Σ_b n_b/N · |acc_b − conf_b|`` of :func:`reliability_bins` output, in [0, 1]; NaN when N = 0."""
    count = np.asarray(bins["count"], dtype=np.float64)
    if count.sum() == 0:
        return float("nan")
    gap = np.abs(bins["accuracy"] - bins["confidence"])
    return float(np.sum(np.where(count > 0, count * np.nan_to_num(gap), 0.0)) / count.sum())


def pool_bins(bins_list) -> dict[str, np.ndarray]:
    """Reliability bins of several sets pooled (each a :func:`reliability_bins` output with the same edges): the bins
    the union of their pixels would give. Raises ValueError on different bin counts or an empty list."""
    bins_list = list(bins_list)
    if not bins_list or len({len(b["count"]) for b in bins_list}) != 1:
        raise ValueError("pool_bins: need at least one bins dict, all with the same number of bins")
    count = sum(np.asarray(b["count"], np.int64) for b in bins_list)
    conf = sum(np.nan_to_num(np.asarray(b["confidence"]) * b["count"]) for b in bins_list)
    acc = sum(np.nan_to_num(np.asarray(b["accuracy"]) * b["count"]) for b in bins_list)
    return _bins_from_sums(count, conf, acc)


def expected_calibration_error(confidence, correct, n_bins: int = FIVA_BINS) -> float:
    """ECE of ``[N]`` confidences and correctness (Guo et al. 2017; 15 bins as FIVA), in [0, 1].

    Raises:
        ValueError: as :func:`reliability_bins`.
    """
    return ece_from_bins(reliability_bins(confidence, correct, n_bins))


def _flatten(probs, labels) -> tuple[np.ndarray, np.ndarray]:
    """``[N, C]`` or ``[B, C, *spatial]`` probs and ``[N]`` / ``[B, 1, *spatial]`` / ``[B, *spatial]`` labels ->
    ``[M, C]`` float64, ``[M]`` int64."""
    p, y = _np(probs), _np(labels, np.int64)
    if p.ndim > 2:
        p = np.moveaxis(p, 1, -1).reshape(-1, p.shape[1])
    y = y.ravel()
    if p.ndim != 2 or p.shape[0] != y.size:
        raise ValueError(f"probs {p.shape} (as [N, C]) and {y.size} labels do not match")
    if y.size and (y.min() < 0 or y.max() >= p.shape[1]):
        raise ValueError(f"labels must be in [0, {p.shape[1]}), got [{y.min()}, {y.max()}]")
    return p, y


def brier_score(probs, labels) -> float:
    """Multi-class Brier score: mean over pixels of ``Σ_c (p_c − y_c)²`` with y one-hot, in [0, 2] (Brier 1950).

    Args:
        probs: ``[N, C]`` or ``[B, C, H, W]`` float probabilities (rows sum to 1).
        labels: ``[N]``, ``[B, 1, H, W]`` or ``[B, H, W]`` int class indices.

    Raises:
        ValueError: shapes do not match or a label is outside [0, C).
    """
    p, y = _flatten(probs, labels)
    return float(np.mean((p**2).sum(1) - 2.0 * p[np.arange(y.size), y] + 1.0))


def nll(probs, labels, eps: float = 1e-12) -> float:
    """Mean negative log-likelihood ``−ln max(p_y, eps)`` in nats (scikit-learn ``log_loss`` formula).

    Shapes and errors as :func:`brier_score`; ``eps`` keeps a zero probability finite (−ln 1e-12 ≈ 27.6).
    """
    p, y = _flatten(probs, labels)
    return float(np.mean(-np.log(np.maximum(p[np.arange(y.size), y], eps))))


def error_detection(uncertainty, wrong) -> dict:
    """How well an uncertainty map finds mis-segmented pixels: ``{"auroc", "auprc", "error_rate"}``.

    Higher uncertainty should mean "wrong" (scikit-learn ``roc_auc_score`` and ``average_precision_score`` with
    ``wrong`` as the positive class). AUROC 0.5 = no better than chance; AUPRC of a random score = error rate.

    Args:
        uncertainty: ``[N]`` float scores (any unit: nats, variance, ...).
        wrong: ``[N]`` bool, True where the prediction is wrong.

    Returns:
        floats; when every pixel is right or every pixel is wrong the two areas are undefined: NaN, with a
        ``"reason"`` string added.

    Raises:
        ValueError: sizes differ.
    """
    u, w = _np(uncertainty).ravel(), _np(wrong, bool).ravel()
    if u.size != w.size:
        raise ValueError(f"error_detection: {u.size} uncertainties vs {w.size} labels")
    rate = float(w.mean()) if w.size else float("nan")
    if w.all() or not w.any():
        reason = "no pixels" if not w.size else ("every pixel is wrong" if w.all() else "no wrong pixel")
        return {"auroc": float("nan"), "auprc": float("nan"), "error_rate": rate, "reason": reason}
    return {"auroc": float(roc_auc_score(w, u)), "auprc": float(average_precision_score(w, u)), "error_rate": rate}


def uncertainty_dice_spearman(image_uncertainty, image_dice) -> tuple[float, float]:
    """Spearman ``(rho, p)`` between per-image mean uncertainty ``[I]`` and Dice ``[I]`` (scipy ``spearmanr``).

    NaN when either is constant. Raises ValueError when sizes differ or I < 2.
    """
    u, d = _np(image_uncertainty).ravel(), _np(image_dice).ravel()
    if u.size != d.size or u.size < 2:
        raise ValueError(f"uncertainty_dice_spearman: need two equal sizes >= 2, got {u.size} and {d.size}")
    if np.ptp(u) == 0 or np.ptp(d) == 0:
        return float("nan"), float("nan")
    res = spearmanr(u, d)
    return float(res.statistic), float(res.pvalue)


def risk_coverage(image_uncertainty, image_risk) -> tuple[np.ndarray, np.ndarray, float]:
    """Risk–coverage curve of images ranked by uncertainty, and its area (AURC, Geifman et al. 2019).

    Images are sorted by increasing uncertainty (stable sort: ties keep input order). At coverage k/I the k most
    certain images are kept; risk_k = mean of their risks (risk = 1 − Dice). AURC = (1/I) Σ_k risk_k, the mean over
    the I coverage points (no point at coverage 0). Lower is better. For a perfect ranking (risks sorted increasingly,
    r_(1) <= ... <= r_(I)) it is its minimum :func:`optimal_aurc`; risks [0, .1, .2, .5] -> curve [0, .05, .1, .2],
    AURC 0.0875.

    Args:
        image_uncertainty: ``[I]`` per-image uncertainty (e.g. mean of the map).
        image_risk: ``[I]`` per-image risk, 1 − Dice in [0, 1].

    Returns:
        ``(coverage [I], risk [I], aurc)``, float64.

    Raises:
        ValueError: sizes differ or I = 0.
    """
    u, r = _np(image_uncertainty).ravel(), _np(image_risk).ravel()
    if u.size != r.size or u.size == 0:
        raise ValueError(f"risk_coverage: need equal non-empty sizes, got {u.size} and {r.size}")
    k = np.arange(1, u.size + 1)
    risk = np.cumsum(r[np.argsort(u, kind="stable")]) / k
    return k / u.size, risk, float(risk.mean())


def optimal_aurc(image_risk) -> float:
    """AURC of a perfect ranking in closed form: ``(1/I) Σ_j r_(j) (H_I − H_{j−1})``, r sorted increasingly and
    H_n = Σ_{m<=n} 1/m the harmonic numbers (each r_(j) enters the means at coverage j..I with weight 1/k)."""
    r = np.sort(_np(image_risk).ravel())
    harmonic = np.concatenate([[0.0], np.cumsum(1.0 / np.arange(1, r.size + 1))])
    return float(np.sum(r * (harmonic[-1] - harmonic[:-1])) / r.size)


class PixelAccumulator:
    """Streams a site's test batches and keeps what the figures above need, not every pixel.

    Per batch ``update(probs [B, C, H, W] float, label [B, 1, H, W] int, uncertainty [B, H, W] float)`` (numpy or
    torch): the prediction is argmax_c, its confidence max_c p_c (top-label reading, module doc).

    * Exact over all pixels: reliability bins (per-bin counts and sums), Brier and NLL sums.
    * Error detection: a uniform random subsample of at most ``max_pixels`` pixels without replacement (bottom-k
      sampling: each pixel draws a key from ``numpy.random.default_rng(seed)``; the ``max_pixels`` smallest keys are
      kept). With fewer pixels than ``max_pixels`` every pixel is kept and AUROC/AUPRC are exact.
    * Per image: the mean of the uncertainty map, in update order (match ``image_dice`` to it).
    """

    def __init__(self, n_bins: int = FIVA_BINS, max_pixels: int = 200_000, seed: int = 0, eps: float = 1e-12):
        self.n_bins, self.max_pixels, self.eps = n_bins, int(max_pixels), eps
        self._rng = np.random.default_rng(seed)
        self._count = np.zeros(n_bins, np.int64)
        self._conf_sum, self._correct_sum = np.zeros(n_bins), np.zeros(n_bins)
        self._brier = self._nll = 0.0
        self._n = 0
        self._keys, self._unc, self._wrong = np.empty(0), np.empty(0), np.empty(0, bool)
        self.image_uncertainty: list[float] = []

    def update(self, probs, label, uncertainty) -> None:
        """Add a batch. Raises ValueError when shapes disagree (see class doc)."""
        p, y, u = _np(probs), _np(label, np.int64), _np(uncertainty)
        if y.ndim == p.ndim:
            y = y[:, 0]
        if p.ndim < 3 or y.shape != p.shape[:1] + p.shape[2:] or u.shape != y.shape:
            raise ValueError(f"PixelAccumulator: probs {p.shape}, label {y.shape}, uncertainty {u.shape} differ")
        flat_p, flat_y = _flatten(p, y)
        conf, pred = flat_p.max(1), flat_p.argmax(1)
        correct = pred == flat_y
        count, conf_sum, correct_sum = _bin_sums(conf, correct, self.n_bins)
        self._count += count
        self._conf_sum += conf_sum
        self._correct_sum += correct_sum
        p_y = flat_p[np.arange(flat_y.size), flat_y]
        self._brier += float(np.sum((flat_p**2).sum(1) - 2.0 * p_y + 1.0))
        self._nll += float(np.sum(-np.log(np.maximum(p_y, self.eps))))
        self._n += flat_y.size
        keys = self._rng.random(flat_y.size)
        self._keys = np.concatenate([self._keys, keys])
        self._unc = np.concatenate([self._unc, u.ravel()])
        self._wrong = np.concatenate([self._wrong, ~correct])
        if self._keys.size > self.max_pixels:
            keep = np.argpartition(self._keys, self.max_pixels - 1)[: self.max_pixels]
            self._keys, self._unc, self._wrong = self._keys[keep], self._unc[keep], self._wrong[keep]
        self.image_uncertainty.extend(u.reshape(u.shape[0], -1).mean(1).tolist())

    def bins(self) -> dict[str, np.ndarray]:
        """Reliability bins over every pixel so far (as :func:`reliability_bins`)."""
        return _bins_from_sums(self._count.copy(), self._conf_sum.copy(), self._correct_sum.copy())

    def result(self, image_dice=None) -> dict:
        """Every figure: ``ece``, ``bins``, ``brier``, ``nll``, ``n_pixels``, :func:`error_detection` keys plus
        ``n_sampled``, ``image_uncertainty`` [I]; with ``image_dice`` (``[I]``, or ``[I, K]`` averaged over the K
        classes/regions, in update order) also ``spearman_rho``, ``spearman_p``, ``coverage``, ``risk``, ``aurc``,
        ``optimal_aurc`` (risk = 1 − Dice). Raises ValueError when no pixel was added or I does not match."""
        if self._n == 0:
            raise ValueError("PixelAccumulator.result: no batch was added")
        bins = self.bins()
        out = {"ece": ece_from_bins(bins), "bins": bins, "brier": self._brier / self._n, "nll": self._nll / self._n,
               "n_pixels": self._n, "n_sampled": int(self._unc.size), **error_detection(self._unc, self._wrong),
               "image_uncertainty": np.asarray(self.image_uncertainty)}
        if image_dice is not None:
            dice = _np(image_dice)
            dice = dice.mean(1) if dice.ndim == 2 else dice.ravel()
            if dice.size != len(self.image_uncertainty):
                raise ValueError(f"result: {dice.size} Dice values for {len(self.image_uncertainty)} images")
            if dice.size >= 2:
                out["spearman_rho"], out["spearman_p"] = uncertainty_dice_spearman(out["image_uncertainty"], dice)
            out["coverage"], out["risk"], out["aurc"] = risk_coverage(out["image_uncertainty"], 1.0 - dice)
            out["optimal_aurc"] = optimal_aurc(1.0 - dice)
        return out


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def plot_reliability(bins: Mapping[str, np.ndarray], path: str | Path, title: str = "") -> Path:
    """Reliability diagram (accuracy per bin against the diagonal, ECE in the title) over the share of pixels per
    bin (log scale), written to ``path`` (PNG; parent created). Returns ``Path(path)``."""
    plt, path = _pyplot(), Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    edges, count = np.asarray(bins["edges"]), np.asarray(bins["count"])
    width, ok = np.diff(edges), count > 0
    fig, (ax, ax_n) = plt.subplots(2, 1, figsize=(4.2, 5.0), sharex=True, gridspec_kw={"height_ratios": [3, 1]})
    ax.bar(edges[:-1][ok], np.asarray(bins["accuracy"])[ok], width[ok], align="edge", edgecolor="k", label="accuracy")
    ax.bar(edges[:-1][ok], (bins["confidence"] - bins["accuracy"])[ok], width[ok], bottom=bins["accuracy"][ok],
           align="edge", color="tab:red", alpha=0.35, label="gap to confidence")
    ax.plot([0, 1], [0, 1], "k--", lw=1)
    ax.set(ylim=(0, 1), ylabel="accuracy", title=f"{title} ECE={ece_from_bins(bins):.4f}".strip())
    ax.legend(loc="upper left", fontsize=8)
    ax_n.bar(edges[:-1][ok], count[ok] / count.sum(), width[ok], align="edge", color="gray")
    ax_n.set(xlim=(0, 1), yscale="log", xlabel="confidence", ylabel="share")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def plot_risk_coverage(curves: Mapping[str, tuple], path: str | Path, title: str = "") -> Path:
    """Risk–coverage curves, one line per method (``method -> (coverage [I], risk [I])``), AURC (mean of the risk
    curve, :func:`risk_coverage`) in the legend, written to ``path`` (PNG). Returns ``Path(path)``."""
    plt, path = _pyplot(), Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig, ax = plt.subplots(figsize=(4.8, 3.6))
    for method, (coverage, risk) in curves.items():
        risk = np.asarray(risk, dtype=np.float64)
        ax.plot(coverage, risk, marker="." if risk.size <= 50 else None, label=f"{method} (AURC {risk.mean():.4f})")
    ax.set(xlim=(0, 1), xlabel="coverage (most certain images kept)", ylabel="risk (mean 1 − Dice)", title=title)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
