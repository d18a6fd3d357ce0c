"""FedA3I's FLARE glue (Wu et al., AAAI 2024): annotation-quality-aware, layer-wise aggregation.

* :class:`FedA3IExecutor` -- FedAvg's site with the paper's training (BCE, "CE", or 0.5·BCE + 0.5·Dice, "DC";
  Adam recreated every round) and one extra task, ``estimate_noise``: the received global model is scored on
  the site's own (noisy) training images without augmentation, and the site returns q_k = (mean BCE inside the
  inner boundary band, mean BCE in the outer band) (paper Eq. 3, :func:`feduq.methods.feda3i.band_losses`).
* :class:`FedA3IController` -- FedAvg (n-weighted) for the ``warmup_rounds`` T1; right after round T1 − 1 is
  aggregated, a **noise-estimation exchange** sends that global model to every site; the server groups the sites
  with a 2-component GMM on q, computes each site's strength, the Intra/InterGW quality weights w̄ (r) and the
  quantity weights w̃ = n/Σn, and from then on aggregates every state-dict entry of layer j with
  w_ij = L(j)·w̄_i + (1 − L(j))·w̃_i (Eq. 6–7), the weights **frozen** (official code). A site whose q is NaN, or
  that did not answer, is left out of the grouping (w̄ = 0, named in the log); the weights and the estimate are
  logged (``FEDUQ_FEDA3I``) and checkpointed with the model, so a resumed job keeps them.
"""

from __future__ import annotations

import json
import math

import numpy as np
import torch
import torch.nn.functional as F
from monai.data import DataLoader
from monai.losses import DiceLoss

from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from nvflare.app_common.app_constant import AppConstants
from nvflare.app_common.app_event_type import AppEventType
from nvflare.app_common.workflows.base_fedavg import BaseFedAvg

from .. import data as fdata
from ..aggregation import check_update, weighted_average
from ..constants import FedUQMetaKey, FedUQTask
from ..methods import feda3i as fm
from .executor import FedAvgExecutor
from .quorum import required_answers
from .workflows import LAST_ROUND, QuorumExchange, fail_job

ESTIMATE_NOISE = "estimate_noise"
NOISE_Q = "feda3i_q"  # site -> server: [q_in, q_out], mean BCE in the inner / outer boundary band
FEDA3I_WEIGHTS = "feda3i_weights"  # in checkpoint meta: the frozen estimate (sites, q, groups, w_bar, w_tilde)
LOSSES = ("ce", "dc")


class FedA3IExecutor(FedAvgExecutor):
    """FedA3I site.

    Args:
        loss: ``"ce"`` (BCE; the paper's main rows) or ``"dc"`` (0.5·BCE + 0.5·soft Dice, smooth 1, per image).
        reset_optimizer: recreate Adam every round (official code; no moments across rounds).
        **kwargs: :class:`feduq.flare.executor.FedUQExecutor` (the job: lr 5e-3, lr_gamma 1, batch 8, 5 local epochs,
            256 px, ``intensity: raw``, network ``feda3i_unet``).

    The binary networks' two logits are ``[0, z]`` (``feda3i_unet``), so cross entropy is BCE-with-logits on z
    and softmax is σ(z); other networks give the two-class softmax form of the same loss.
    """

    def __init__(self, loss: str = "ce", reset_optimizer: bool = True, **kwargs):
        super().__init__(**kwargs)
        if loss not in LOSSES or not isinstance(reset_optimizer, bool):
            raise ValueError(f"executor arguments loss={loss!r} (one of {LOSSES}), reset_optimizer={reset_optimizer!r} "
                             "(true or false) out of range")
        self.loss_name, self.reset_optimizer = loss, reset_optimizer
        self._noise_loader = None

    def build_loss(self):
        dice = DiceLoss(include_background=False, to_onehot_y=True, softmax=True, smooth_nr=1.0, smooth_dr=1.0)

        def loss(logits: torch.Tensor, label: torch.Tensor, round_index: int) -> torch.Tensor:
            ce = F.cross_entropy(logits, label[:, 0].long())
            return ce if self.loss_name == "ce" else 0.5 * ce + 0.5 * dice(logits, label)

        return loss

    def train(self, received: FLModel, fl_ctx) -> FLModel:
        if self.reset_optimizer:  # official code: a new Adam every round (constant lr)
            t = self.trainer
            group = t.optimizer.param_groups[0]
            t.optimizer = torch.optim.Adam(t.model.parameters(), lr=group["initial_lr"] if "initial_lr" in group else group["lr"],
                                           betas=group["betas"], weight_decay=group["weight_decay"])
            t.scheduler = torch.optim.lr_scheduler.ExponentialLR(t.optimizer, gamma=t.scheduler.gamma)
        return super().train(received, fl_ctx)

    def extra_tasks(self) -> dict:
        return {ESTIMATE_NOISE: self.estimate_noise}

    def estimate_noise(self, received: FLModel, fl_ctx) -> FLModel:
        """q_k of the received global model on this site's training images (its own labels, no augmentation).

        Returns:
            ``FLModel(meta={feda3i_q: [q_in, q_out], feduq_num_samples: N_k, ...})``; q is NaN when every
            training mask is empty (the server then leaves the site out of the grouping).
        """
        if self._noise_loader is None:
            ds = fdata.get_dataset(self.task_name, self.center, "train", stage="val", site=self.site, **self._common)
            self._noise_loader = DataLoader(ds, batch_size=self.batch_size)
        model = self._load_eval_model(received)
        rows = []
        with torch.no_grad():
            for batch in self._noise_loader:
                logits = model(batch["image"].to(self.device)).float()
                z = logits[:, 1] - logits[:, 0]  # the foreground logit: softmax([0, z]) = sigmoid(z)
                rows.append(fm.band_losses(z.cpu(), (batch["label"][:, 0] > 0).cpu().numpy()))
        per_image = np.concatenate(rows)
        q = fm.site_noise_statistic(per_image)
        skipped = int(np.isnan(per_image).any(axis=1).sum())
        self.log_info(fl_ctx, "FEDUQ_FEDA3I_Q " + json.dumps({"site": self.site, "q": [float(v) for v in q],
                                                               "images": len(per_image), "skipped_empty": skipped}))
        return FLModel(metrics={"feda3i_q_in": float(q[0]), "feda3i_q_out": float(q[1])},
                       meta={NOISE_Q: [float(v) for v in q], FedUQMetaKey.NUM_SAMPLES: len(self.train_ds),
                             FedUQMetaKey.SITE: self.site})


class FedA3IController(QuorumExchange, BaseFedAvg):
    """FedA3I's rounds: FedAvg warm-up, one noise-estimation exchange, then frozen layer-wise weights.

    Args:
        num_rounds, persistor_id: as FLARE's BaseFedAvg (paper: 100 rounds).
        warmup_rounds: T1 ≥ 1, FedAvg rounds before the estimate (paper: SKIN 10, BREAST 30); T1 ≥ num_rounds
            never estimates: FedAvg with FedA3I's training throughout, the paper's FedAvg-CE row (``jobs/fedavg_ce``).
        r: share of the enlarging group G_l in the quality weights (Eq. 6; paper 0.5).
        layer_weight, layer_power, layer_bias: the code's schedule L(j) = weight·((j − 1)/(L − 1))^power + bias.
        gmm_seed: ``random_state`` of the GMM.
        min_clients, train_timeout: quorum and timeout as the other FedUQ workflows.

    Raises:
        ValueError: a setting out of range (named).
    """

    def __init__(self, *, num_rounds: int = 100, persistor_id: str = "persistor", warmup_rounds: int = 10,
                 r: float = 0.5, layer_weight: float = 1.0, layer_power: float = 1.0, layer_bias: float = 0.0,
                 gmm_seed: int = 0, min_clients: int | None = None, train_timeout: int = 0, **kwargs):
        kwargs.setdefault("ignore_result_error", True)
        kwargs.setdefault("memory_gc_rounds", 1)  # gc + malloc_trim after every round (FLARE's cleanup_memory)
        super().__init__(num_rounds=num_rounds, persistor_id=persistor_id, **kwargs)
        if not (isinstance(warmup_rounds, int) and warmup_rounds >= 1) or not (0 <= r <= 1):
            raise ValueError(f"FedA3IController: need warmup_rounds >= 1 and 0 <= r <= 1 "
                             f"(got warmup_rounds={warmup_rounds!r}, num_rounds={num_rounds!r}, r={r!r})")
        self.warmup_rounds, self.r, self.gmm_seed = warmup_rounds, float(r), int(gmm_seed)
        self.schedule = dict(weight=float(layer_weight), power=float(layer_power), bias=float(layer_bias))
        self.min_clients, self.train_timeout = min_clients, train_timeout
        self._failures: dict[str, str] = {}
        self._layer_names = fm.LAYER_NAMES

    # -- the estimate ------------------------------------------------------------------------------
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
        w_tilde = fm.quantity_weights(n)
        w_bar = np.zeros(len(sites))
        groups, strength = {}, {}
        if valid:
            q = np.array([answers[s][0] for s in valid], dtype=float)
            g = fm.group_sites(q, seed=self.gmm_seed)
            st = fm.strengths(q, g)
            wq = fm.quality_weights(st, g, r=self.r)
            for i, s in enumerate(valid):
                w_bar[sites.index(s)] = wq[i]
                groups[s], strength[s] = ("G_l" if g[i] == 1 else "G_s"), float(st[i])
        return {"sites": sites, "q": {s: answers[s][0] for s in sites if s in answers}, "excluded": excluded,
                "groups": groups, "strength": strength, "w_bar": w_bar.tolist(), "w_tilde": w_tilde.tolist()}

    def layer_weights(self, estimate: dict, keys: list[str], order: list[str]) -> dict[str, np.ndarray]:
        """Per state-dict key, the weights of the sites in ``order`` (renormalised over them; a layer whose
        weights are all 0 among them falls back to their quantity weights)."""
        idx = [estimate["sites"].index(s) for s in order]
        w_bar = np.asarray(estimate["w_bar"])[idx]
        w_tilde = np.asarray(estimate["w_tilde"])[idx]
        out = {}
        for key in keys:
            mix = fm.layer_schedule(fm.layer_index(key, self._layer_names), **self.schedule)
            w = mix * w_bar + (1.0 - mix) * w_tilde
            if not w.sum() > 0:
                w = w_tilde
            out[key] = w / w.sum()
        return out

    def fuse(self, results: dict[str, FLModel], order: list[str], estimate: dict | None) -> tuple[dict, dict]:
        """One round's aggregate of the sites' models ``results[s].params`` (sites in ``order``).

        Before the estimate: FedAvg, n_k-weighted (``feduq_num_samples``). After it: the frozen layer-wise mix
        w_ij = L(j)·w̄_i + (1 − L(j))·w̃_i (paper Eq. 7), renormalised over ``order``.

        Returns:
            ``(params, weights)``: the fused state dict, and per site the weight of its last layer (``outc``,
            pure quality after the estimate) as logged in ``FEDUQ_AGGREGATION``.
        """
        models = [{k: np.asarray(v) for k, v in results[s].params.items()} for s in order]
        if estimate is None:
            n = {s: float(results[s].meta[FedUQMetaKey.NUM_SAMPLES]) for s in order}
            return weighted_average(dict(zip(order, models)), n), {s: round(n[s] / sum(n.values()), 6) for s in order}
        per_key = self.layer_weights(estimate, sorted(models[0]), order)
        outc = max(per_key, key=lambda k: fm.layer_index(k, self._layer_names))
        return fm.layerwise_average(models, per_key), {s: round(float(w), 6) for s, w in zip(order, per_key[outc])}

    # -- the rounds --------------------------------------------------------------------------------
    def check_update(self, site: str, res: FLModel, global_params: dict) -> None:
        check_update(site, res.params or {}, global_params)
        n = (res.meta or {}).get(FedUQMetaKey.NUM_SAMPLES)
        if not isinstance(n, (int, float)) or not math.isfinite(n) or n <= 0:
            raise ValueError(f"site {site!r}: n_k = {n!r} (expected a finite number > 0)")

    def run(self) -> None:
        start = self._start_run()
        if start is None:
            return
        model, first = start
        sites = [c.name for c in self.engine.get_clients()]
        required = max(required_answers(self.min_clients, len(sites)), 1)
        self._layer_names = self._layer_map(list(model.params))
        if self._layer_names is None:
            return
        estimate = model.meta.get(FEDA3I_WEIGHTS)
        for self.current_round in range(first, self.num_rounds):
            r = self.current_round
            self.info(f"FedA3I round {r} started ({'FedAvg warm-up' if estimate is None else 'frozen layer-wise weights'})")
            model.current_round = r
            self.fl_ctx.set_prop(AppConstants.CURRENT_ROUND, r, private=True, sticky=False)
            self.event(AppEventType.ROUND_STARTED)
            sent = FLModel(params=model.params, params_type=ParamsType.FULL, current_round=r, total_rounds=self.num_rounds)
            results = self._exchange(FedUQTask.TRAIN, sent, sites, self.train_timeout)
            if self._aborted():
                return
            accepted, rejected = self._accept(results, model.params)
            if not self._quorum_met("train", required, sites, list(accepted), rejected):
                return
            fused, logged = self.fuse(accepted, [s for s in sites if s in accepted], estimate)
            self.info("FEDUQ_AGGREGATION " + json.dumps({"round": r, "weights": logged, "rejected": sorted(rejected)}))
            aggr = self.aggregate(list(accepted.values()), aggregate_fn=lambda _res: FLModel(params=fused))
            model = self.update_model(model, aggr)
            model.meta = dict(model.meta or {})
            if estimate is None and r == self.warmup_rounds - 1:
                estimate = self._estimate_noise(model, sites, r)
                if estimate is None:
                    return
                model.meta[FEDA3I_WEIGHTS] = estimate
            model.meta[LAST_ROUND] = r
            self.save_model(model)
            self._maybe_cleanup_memory()
        self.info("FedA3I finished")

    def _layer_map(self, keys: list[str]) -> tuple[str, ...] | None:
        """The ten FedA3I layers of the global model (``feda3i_unet`` or ``fedevi_unet`` names); else stop the job."""
        try:
            return fm.layer_names_of(keys)
        except ValueError as e:
            fail_job(self, self.fl_ctx, f"FedA3I: {e}")
            return None

    def _estimate_noise(self, model: FLModel, sites: list[str], r: int) -> dict | None:
        """The noise-estimation exchange after round ``r``; None when the job was stopped."""
        self.info(f"FedA3I noise estimation after round {r}: the global model goes to every site's training set")
        results = self._exchange(ESTIMATE_NOISE, FLModel(params=model.params, params_type=ParamsType.FULL,
                                                         current_round=r), sites, self.train_timeout)
        if self._aborted():
            return None
        answers = {}
        for res in results:
            meta = res.meta or {}
            answers[meta.get("client_name")] = (meta.get(NOISE_Q), meta.get(FedUQMetaKey.NUM_SAMPLES, 0))
        for site in self._failures:  # an error reply carries no q
            answers.pop(site, None)
        if not answers:
            fail_job(self, self.fl_ctx, f"FedA3I noise estimation after round {r}: no site answered", self._failures)
            return None
        estimate = self.estimate(answers, sites)
        self.info("FEDUQ_FEDA3I " + json.dumps({"round": r, **estimate}))
        for site, why in estimate["excluded"].items():
            self.warning(f"FedA3I: site {site!r} is left out of the grouping (w_bar = 0): {why}")
        return estimate
