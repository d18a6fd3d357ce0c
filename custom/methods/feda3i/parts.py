"""FedA3I's site part and server part, run by FedUQ's executor and round loop (FLARE-free)."""

from __future__ import annotations

import json

import numpy as np
import torch
from torch import Tensor

from ...common.wire import FedUQMetaKey
from ...parts.server import ServerPart, Stop
from ...parts.site import SitePart
from .equations import DEFAULT_R, band_losses, compute_weights, quantity_weights, site_noise_statistic
from .layerwise import LAYER_NAMES, layer_index, layer_names_of, layerwise_average, layerwise_weights

FEDA3I_LOSSES = ("ce", "dc")  # the site's local loss: BCE, or 0.5 BCE + 0.5 soft Dice
ESTIMATE_NOISE = "estimate_noise"  # the site task: q_k of the received global model on its training images
NOISE_Q = "feda3i_q"  # site -> server: [q_in, q_out], mean BCE in the inner / outer boundary band
FEDA3I_WEIGHTS = "feda3i_weights"  # in checkpoint meta: the frozen estimate (sites, q, groups, w_bar, w_tilde)


class FedA3IServer(ServerPart):
    """FedA3I's server part: FedAvg warm-up, one noise-estimation exchange, then frozen layer-wise weights.

    Rounds 0 .. T1 − 1 are FedAvg (n_k-weighted). Right after round T1 − 1 is fused, the global model goes to
    every site's ``estimate_noise`` task; the sites' q = (q_in, q_out) are grouped by a 2-component GMM, and the
    strengths, quality weights w̄ (Eq. 5–6) and quantity weights w̃ = n/Σn are frozen (official code). From then
    on every state-dict entry of layer j is fused with w_ij = L(j)·w̄_i + (1 − L(j))·w̃_i (Eq. 7), renormalised
    over the sites that answered the round. A site with a NaN q, or no answer, is left out of the grouping
    (w̄ = 0, named in the log). The estimate is logged (``FEDUQ_FEDA3I``) and checkpointed (``feda3i_weights``).

    Args:
        warmup_rounds: T1 >= 1 (paper: SKIN 10, BREAST 30); T1 >= the job's rounds never estimates (the paper's
            FedAvg-CE row).
        r: share of the enlarging group G_l in the quality weights (Eq. 6; paper 0.5).
        layer_weight, layer_power, layer_bias: the code's schedule L(j) = weight·((j − 1)/(L − 1))^power + bias.
        gmm_seed: ``random_state`` of the GMM.

    Raises:
        ValueError: a setting out of range (named).
    """

    label = "FedA3I"
    state_key = FEDA3I_WEIGHTS

    def __init__(self, warmup_rounds: int = 10, r: float = DEFAULT_R, layer_weight: float = 1.0,
                 layer_power: float = 1.0, layer_bias: float = 0.0, gmm_seed: int = 0):
        if not (isinstance(warmup_rounds, int) and warmup_rounds >= 1) or not (0 <= r <= 1):
            raise ValueError(f"FedA3I: need warmup_rounds >= 1 and 0 <= r <= 1 (got warmup_rounds={warmup_rounds!r}, "
                             f"r={r!r})")
        self.warmup_rounds, self.r, self.gmm_seed = warmup_rounds, float(r), int(gmm_seed)
        self.schedule = dict(weight=float(layer_weight), power=float(layer_power), bias=float(layer_bias))
        self.layer_names = LAYER_NAMES
        self.frozen: dict | None = None

    def start(self, fed, global_params, sites, state) -> None:
        """Restore the frozen estimate; find the ten layers in the global model (``feda3i_unet`` or ``fedevi_unet``)."""
        try:
            self.layer_names = layer_names_of(list(global_params))
        except ValueError as e:
            raise Stop(f"FedA3I: {e}") from None
        self.frozen = state

    def state(self) -> dict | None:
        return self.frozen

    def estimate(self, answers: dict[str, tuple[list, float]], sites: list[str]) -> dict:
        """Weights from each site's ``(q, n)``; sites with no answer or a non-finite q get w̄ = 0.

        Returns:
            ``{"sites", "q", "excluded", "groups", "strength", "w_bar", "w_tilde"}`` (lists in ``sites`` order).
        """
        excluded = {s: "no answer" for s in sites if s not in answers}
        valid = []
        for s in sites:
            if s in answers:
                q = np.asarray(answers[s][0], dtype=float)
                if q.shape != (2,) or not np.isfinite(q).all():
                    excluded[s] = f"q = {answers[s][0]!r} (not two finite numbers)"
                else:
                    valid.append(s)
        n = np.array([float(answers[s][1]) if s in answers else 0.0 for s in sites])
        if not (n > 0).any():
            n = np.ones(len(sites))
        w_tilde = quantity_weights(n)
        w_bar = np.zeros(len(sites))
        groups, strength = {}, {}
        if valid:  # the grouping, strengths and quality weights of the sites with a finite q (Eq. 5-6)
            frozen = compute_weights([answers[s][0] for s in valid], [n[sites.index(s)] for s in valid], r=self.r,
                                     seed=self.gmm_seed, sites=valid)
            for i, s in enumerate(valid):
                w_bar[sites.index(s)] = frozen.w_quality[i]
                groups[s], strength[s] = ("G_l" if frozen.groups[i] == 1 else "G_s"), float(frozen.s[i])
        return {"sites": sites, "q": {s: answers[s][0] for s in sites if s in answers}, "excluded": excluded,
                "groups": groups, "strength": strength, "w_bar": w_bar.tolist(), "w_tilde": w_tilde.tolist()}

    def layer_weights(self, estimate: dict, keys: list[str], order: list[str]) -> dict[str, np.ndarray]:
        """Per state-dict key, the weights of the sites in ``order``: :func:`layerwise_weights` (Eq. 7) of w̄ and w̃,
        each renormalised over ``order`` (the sites that answered the round; all of them in the paper). When no site
        of ``order`` has quality weight (all left out of the grouping), w̄ falls back to their quantity weights."""
        idx = [estimate["sites"].index(s) for s in order]
        w_tilde = np.asarray(estimate["w_tilde"], dtype=np.float64)[idx]
        w_tilde = w_tilde / w_tilde.sum() if w_tilde.sum() > 0 else np.full(len(order), 1.0 / len(order))
        w_bar = np.asarray(estimate["w_bar"], dtype=np.float64)[idx]
        w_bar = w_bar / w_bar.sum() if w_bar.sum() > 0 else w_tilde
        return layerwise_weights(keys, w_bar, w_tilde, layer_names=self.layer_names, **self.schedule)

    def fuse(self, fed, answers, global_params):
        """Before the estimate: FedAvg (n_k). After it: the frozen layer-wise mix (Eq. 7). The weights returned
        are those of the last layer (``outc``: pure quality after the estimate)."""
        order = list(answers)
        models = [{k: np.asarray(v) for k, v in answers[s].params.items()} for s in order]
        if self.frozen is None:
            return super().fuse(fed, answers, global_params)
        per_key = self.layer_weights(self.frozen, sorted(models[0]), order)
        outc = max(per_key, key=lambda k: layer_index(k, self.layer_names))
        return layerwise_average(models, per_key), dict(zip(order, map(float, per_key[outc])))

    def after_round(self, fed, global_params, sites) -> None:
        """After round T1 − 1: the noise-estimation exchange and the frozen estimate."""
        if self.frozen is not None or fed.round < self.warmup_rounds - 1:
            return  # (a job resumed after T1 from a checkpoint without the estimate estimates now, once)
        r = fed.round
        fed.log(f"FedA3I noise estimation after round {r}: the global model goes to every site's training set")
        replies = fed.send(ESTIMATE_NOISE, global_params, sites, quorum=False)  # a failed site is left out, named
        answers = {s: (a.meta.get(NOISE_Q), a.meta.get(FedUQMetaKey.NUM_SAMPLES, 0)) for s, a in replies.items()}
        if not answers:
            raise Stop(f"FedA3I noise estimation after round {r}: no site answered", fed.failures)
        self.frozen = self.estimate(answers, sites)
        fed.log("FEDUQ_FEDA3I " + json.dumps({"round": r, **self.frozen}))
        for site, why in self.frozen["excluded"].items():
            fed.warn(f"FedA3I: site {site!r} is left out of the grouping (w_bar = 0): {why}")


class FedA3ISite(SitePart):
    """FedA3I's site part: the paper's training, and the ``estimate_noise`` task (q_k, Eq. 3-4).

    Local loss: BCE (``"ce"``, the paper's main rows) or 0.5·BCE + 0.5·soft Dice (``"dc"``, smooth 1, per image); Adam
    recreated every round (official code: no moments across rounds). ``estimate_noise``: the received global model
    is scored on the site's own (noisy) training images without augmentation, and the site returns
    q_k = (mean BCE inside the inner boundary band, mean BCE in the outer band) (:func:`band_losses`,
    :func:`site_noise_statistic`) with N_k; q is NaN when every training mask is empty (the server then leaves the
    site out of the grouping).

    The binary networks' two logits are ``[0, z]`` (``feda3i_unet``), so cross entropy is BCE-with-logits on z and
    softmax is σ(z); other networks give the two-class softmax form of the same loss.

    Args:
        loss: ``"ce"`` or ``"dc"``.
        reset_optimizer: recreate Adam every round (official code).

    Raises:
        ValueError: an argument out of range (named).
    """

    def __init__(self, loss: str = "ce", reset_optimizer: bool = True):
        super().__init__()
        if loss not in FEDA3I_LOSSES or not isinstance(reset_optimizer, bool):
            raise ValueError(f"executor arguments loss={loss!r} (one of {FEDA3I_LOSSES}), "
                             f"reset_optimizer={reset_optimizer!r} (true or false) out of range")
        self.loss_name, self.reset_optimizer = loss, reset_optimizer
        self._noise_loader = None

    def loss(self, site):
        import torch.nn.functional as F
        from monai.losses import DiceLoss

        dice = DiceLoss(include_background=False, to_onehot_y=True, softmax=True, smooth_nr=1.0, smooth_dr=1.0)

        def loss(logits: Tensor, label: Tensor, round_index: int) -> Tensor:
            ce = F.cross_entropy(logits, label[:, 0].long())
            return ce if self.loss_name == "ce" else 0.5 * ce + 0.5 * dice(logits, label)
        return loss

    def before_round(self, site, round_index: int) -> None:
        if self.reset_optimizer:  # official code: a new Adam every round (constant lr)
            site.reset_optimizer()

    def tasks(self):
        return {ESTIMATE_NOISE: self.estimate_noise}

    def estimate_noise(self, site, params, round_index):
        """q_k of the received global model on this site's training images (its own labels, no augmentation);
        logged ``FEDUQ_FEDA3I_Q {json}``."""
        from monai.data import DataLoader

        if self._noise_loader is None:
            self._noise_loader = DataLoader(site.dataset("train", stage="val"), batch_size=site.batch_size)
        model = site.load_eval(params)
        rows = []
        with torch.no_grad():
            for batch in self._noise_loader:
                logits = model(batch["image"].to(site.device)).float()
                z = logits[:, 1] - logits[:, 0]  # the foreground logit: softmax([0, z]) = sigmoid(z)
                rows.append(band_losses(z.cpu(), (batch["label"][:, 0] > 0).cpu().numpy()))
        per_image = np.concatenate(rows)
        q = site_noise_statistic(per_image)
        skipped = int(np.isnan(per_image).any(axis=1).sum())
        site.log("FEDUQ_FEDA3I_Q " + json.dumps({"site": site.site, "q": [float(v) for v in q],
                                                 "images": len(per_image), "skipped_empty": skipped}))
        meta = {NOISE_Q: [float(v) for v in q], FedUQMetaKey.NUM_SAMPLES: len(site.train_ds), FedUQMetaKey.SITE: site.site}
        return meta, {"feda3i_q_in": float(q[0]), "feda3i_q_out": float(q[1])}
