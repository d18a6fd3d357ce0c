"""FedEvi's FLARE glue (Chen et al., MICCAI 2024): the client executor and the server workflow.

* :class:`FedEviExecutor` -- the site side: evidential training, and the statistics A_k (after
  training) and G_k (the ``validate_surrogate`` task).
* :class:`FedEviController` -- FedEvi's round (§2.3, Eq. 6-8) as it must run in a real federation:
  clients train and return θ_k, N_k and A_k; the server sends the surrogate
  θ̂ = Σ_k β_k^{r-1} θ_k out as a second task; clients return G_k; the server updates β and
  aggregates θ^r = Σ_k β_k^r θ_k.

The weight math is in :mod:`feduq.methods.fedevi`; the evidential loss and uncertainties in
:mod:`feduq.evidential`.
"""

from __future__ import annotations

import json
import math
import time

import numpy as np
import torch

from nvflare.apis.fl_context import FLContext
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from nvflare.app_common.app_constant import AppConstants
from nvflare.app_common.app_event_type import AppEventType
from nvflare.app_common.workflows.base_fedavg import BaseFedAvg

from ..constants import FedUQMetaKey, FedUQTask
from ..engine import per_image_statistics
from ..evidential import FedEviLoss, dirichlet_from_logits, image_uncertainty_means
from ..maps import dirichlet_uncertainty
from ..methods.fedevi import FedEviConfig, initial_weights, round_weights
from .aggregators import WeightedAggregator
from .executor import FedUQExecutor
from .quorum import required_answers
from .workflows import LAST_ROUND, QuorumExchange


class FedEviExecutor(FedUQExecutor):
    """FedEvi client (Chen et al., MICCAI 2024): evidential training plus the two statistics.

    After local training the site sends A_k = mean over its validation images of U_ale under θ_k
    (and R_k = mean of 1/U_ale, for the paper's form of the reliability term); in the same round it
    answers ``validate_surrogate`` with G_k = mean U_epi of the surrogate model θ̂ on its validation
    images (FedEvi Eq. 5-8, official code).

    Args:
        kl_weight: λ of the KL regulariser (0.01 for polyp and prostate; 1e-5 for fundus).
        annealing_step: a(r) = min(1, r / annealing_step) with 1-based round r (official code).
        dice_variant: ``"mean"`` (official code) or ``"second_moment"`` (Dirichlet E[ρ²]).
        clamp_max: upper clamp of the logits before exp (official code: 80).
        **kwargs: see :class:`FedUQExecutor`.
    """

    def __init__(
        self,
        kl_weight: float = 0.01,
        annealing_step: int = 10,
        dice_variant: str = "mean",
        clamp_max: float = 80.0,
        **kwargs,
    ):
        super().__init__(**kwargs)
        self.kl_weight = kl_weight
        self.annealing_step = annealing_step
        self.dice_variant = dice_variant
        self.clamp_max = clamp_max
        try:
            self.build_loss()  # validates kl_weight, annealing_step, dice_variant, clamp_max now, not at round 0
        except (TypeError, ValueError) as e:
            raise ValueError(f"FedEvi: {e}") from None

    def build_loss(self):
        return FedEviLoss(
            kl_weight=self.kl_weight,
            annealing_step=self.annealing_step,
            dice_variant=self.dice_variant,
            clamp_max=self.clamp_max,
            batch_dice=self.dp is None,  # DP-SGD: per-image Dice, so the loss is a mean of per-image losses
        )

    def prob_fn(self, logits: torch.Tensor) -> torch.Tensor:
        return dirichlet_from_logits(logits, clamp_max=self.clamp_max).prob

    def uncertainty_fn(self):
        return dirichlet_uncertainty("exp", self.clamp_max)

    def _uncertainty(self, model: torch.nn.Module) -> dict[str, np.ndarray]:
        return per_image_statistics(
            model, self.val_loader, self.device, lambda lo: image_uncertainty_means(lo, clamp_max=self.clamp_max)
        )

    def extra_train_meta(self, round_index: int) -> dict:
        u_ale = self._uncertainty(self.trainer.model)["aleatoric"]
        return {
            FedUQMetaKey.MEAN_ALEATORIC: float(u_ale.mean()),
            FedUQMetaKey.MEAN_INV_ALEATORIC: float((1.0 / u_ale).mean()),
        }

    def extra_tasks(self):
        return {FedUQTask.VALIDATE_SURROGATE: self.validate_surrogate}

    def validate_surrogate(self, received: FLModel, fl_ctx: FLContext) -> FLModel:
        start = time.perf_counter()
        g = float(self._uncertainty(self._load_eval_model(received))["epistemic"].mean())
        record = {"site": self.site, "round": received.current_round, "u_epi": g,
                  "seconds": round(time.perf_counter() - start, 3)}
        self.log_info(fl_ctx, "FEDEVI_SURROGATE " + json.dumps(record))
        return FLModel(metrics={"u_epi": g}, meta={FedUQMetaKey.MEAN_EPISTEMIC: g})


class FedEviController(QuorumExchange, BaseFedAvg):
    """FedEvi's two-exchange round on FLARE's ModelController API.

    Per round r (0-based here; FedEvi's 1-based r is r + 1):

    1. ``train`` -> each site returns θ_k, N_k, A_k (mean U_ale on its validation split) and R_k.
    2. The aggregator validates every update (finite, matching names and shapes).
    3. ``validate_surrogate`` with θ̂ = Σ β_k^{r-1} θ_k (β renormalised over the accepted sites)
       -> each site returns G_k (mean U_epi of θ̂ on its validation split).
    4. β^r = update(β^{r-1}, δ·G/A) (Eq. 8; switches in :class:`feduq.methods.fedevi.FedEviConfig`).
    5. θ^r = Σ β_k^r θ_k; β is logged (``FEDEVI_BETA {json}``) and stored in the model's meta, so
       it is checkpointed with the global model and restored on resume.

    A site that fails or times out in step 1 or 3 is left out of that round; its β is carried
    forward unchanged and the others are renormalised. When fewer than the quorum can answer
    validly (:mod:`feduq.flare.quorum`), the job stops with ``FEDUQ_JOB_FAILED`` naming every failed
    site and its reason; a round is never aggregated with fewer. The job configuration is validated
    at start-up (:func:`feduq.flare.jobcheck.validate_running_app`).

    Args:
        num_rounds: federated rounds R.
        aggregator_id: id of a :class:`feduq.flare.aggregators.WeightedAggregator` component.
        persistor_id: id of the model persistor.
        min_clients: valid answers each task needs; None requires every site (a failing site then
            stops the job). With a value, the workflow waits for every live site until the
            task's timeout and continues with whoever answered, as long as at least
            ``min_clients`` did.
        train_timeout, surrogate_timeout: seconds to wait for each task (0 = no limit).
        delta, reliability, clip_min, renormalize_after_clip, initial_weights: FedEvi switches,
            see :class:`feduq.methods.fedevi.FedEviConfig` for meanings and defaults.
    """

    timeout_args = ("train_timeout", "surrogate_timeout")

    def __init__(
        self,
        *,
        num_rounds: int = 200,
        aggregator_id: str = "aggregator",
        persistor_id: str = "persistor",
        min_clients: int | None = None,
        train_timeout: int = 0,
        surrogate_timeout: int = 0,
        delta: float = 1.0,
        reliability: str = "code",
        clip_min: float = 1e-3,
        renormalize_after_clip: bool = False,
        initial_weights: str = "samples",
        **kwargs,
    ):
        # FLARE never panics on a site's error by itself: this workflow applies the quorum, with reasons
        kwargs.setdefault("ignore_result_error", True)
        kwargs.setdefault("memory_gc_rounds", 1)  # gc + malloc_trim after every round (FLARE's cleanup_memory)
        super().__init__(num_rounds=num_rounds, persistor_id=persistor_id, **kwargs)
        if min_clients is not None and int(min_clients) < 1:
            raise ValueError(f"FedEviController: min_clients must be >= 1 or None, got {min_clients!r}")
        self._failures: dict[str, str] = {}
        self.aggregator_id = aggregator_id
        self.min_clients = min_clients
        self.train_timeout = train_timeout
        self.surrogate_timeout = surrogate_timeout
        self.config = FedEviConfig(
            delta=delta,
            reliability=reliability,
            clip_min=clip_min,
            renormalize_after_clip=renormalize_after_clip,
            initial=initial_weights,
        )
        self.config.validate()

    def run(self) -> None:
        start = self._start_run()
        if start is None:
            return
        model, first_round = start
        aggregator = self.get_component(self.aggregator_id)
        if not isinstance(aggregator, WeightedAggregator):
            self.panic(f"component {self.aggregator_id!r} must be a WeightedAggregator, got {type(aggregator)}")
            return
        aggregator.fl_ctx = self.fl_ctx
        aggregator.set_quorum(self.min_clients)
        required = required_answers(self.min_clients, self._num_sites())
        beta: dict[str, float] = {k: float(v) for k, v in (model.meta.get(FedUQMetaKey.FEDEVI_BETA) or {}).items()}
        if first_round > self.start_round:
            self.info(f"resuming FedEvi at round {first_round} with beta {beta}")
        model.start_round, model.total_rounds = self.start_round, self.num_rounds

        for self.current_round in range(first_round, self.num_rounds):
            r = self.current_round
            self.info(f"FedEvi round {r} started")
            model.current_round = r
            self.fl_ctx.set_prop(AppConstants.CURRENT_ROUND, r, private=True, sticky=False)
            self.event(AppEventType.ROUND_STARTED)
            clients = self.sample_clients()

            results = self._exchange(FedUQTask.TRAIN, model, clients, self.train_timeout)
            if self._aborted():
                return
            aggregator.reset_stats()
            for res in results:
                res.current_round = r
            accepted_results = [res for res in results if aggregator.accept_model(res)]
            sites = aggregator.accepted_sites()
            if not self._quorum_met("train", required, clients, sites, rejected=aggregator.rejected_sites()):
                return
            self._log_missing("train", clients, sites)
            meta = {res.meta["client_name"]: res.meta for res in accepted_results}
            if not beta:
                beta0 = initial_weights([meta[s][FedUQMetaKey.NUM_SAMPLES] for s in sites], mode=self.config.initial)
                beta = dict(zip(sites, map(float, beta0)))
                self.info("FEDEVI_BETA " + json.dumps({"round": "initial", "beta": beta}))
            for s in sites:  # a site joining late starts from the mean weight
                beta.setdefault(s, float(np.mean(list(beta.values()))))
            beta_prev = {s: beta[s] for s in sites}  # renormalised over `sites` by the averaging

            surrogate = FLModel(
                params=aggregator.average(beta_prev), params_type=ParamsType.FULL, current_round=r, meta={}
            )
            sur_results = self._exchange(FedUQTask.VALIDATE_SURROGATE, surrogate, sites, self.surrogate_timeout)
            if self._aborted():
                return
            epistemic, invalid = {}, {}
            for res in sur_results:
                g = (res.meta or {}).get(FedUQMetaKey.MEAN_EPISTEMIC)
                if isinstance(g, (int, float)) and math.isfinite(g) and g >= 0:
                    epistemic[res.meta["client_name"]] = float(g)
                else:
                    invalid[res.meta.get("client_name")] = f"sent an invalid G_k {g!r}"
                    self.warning(f"round {r}: site {res.meta.get('client_name')!r} sent an invalid G_k {g!r}")
            scored = [s for s in sites if s in epistemic]
            if not self._quorum_met("validate_surrogate", required, clients, scored, rejected=invalid):
                return
            self._log_missing("validate_surrogate", sites, scored)
            if scored:  # Eq. 8 over the scored sites; a site not scored this round keeps its beta
                beta = round_weights(
                    beta, {s: epistemic[s] for s in scored},
                    mean_aleatoric={s: meta[s][FedUQMetaKey.MEAN_ALEATORIC] for s in scored},
                    mean_inv_aleatoric={s: meta[s].get(FedUQMetaKey.MEAN_INV_ALEATORIC, np.nan) for s in scored},
                    config=self.config,
                )
            beta_round = {s: beta[s] for s in sites}
            self.info(
                "FEDEVI_BETA "
                + json.dumps(
                    {
                        "round": r,
                        "beta": {s: round(w, 6) for s, w in beta.items()},
                        "G": {s: round(v, 6) for s, v in epistemic.items()},
                        "A": {s: round(meta[s][FedUQMetaKey.MEAN_ALEATORIC], 6) for s in sites},
                    }
                )
            )

            aggr = self.aggregate(accepted_results, aggregate_fn=lambda _res: aggregator.aggregate_model(beta_round))
            if aggr.params:
                model = self.update_model(model, aggr)
            model.meta = dict(model.meta or {})
            model.meta[FedUQMetaKey.FEDEVI_BETA] = dict(beta)
            model.meta[LAST_ROUND] = r
            self.save_model(model)
            self._maybe_cleanup_memory()
        self.info("FedEvi finished")

    def _num_sites(self) -> int:
        """K, the number of sites in the job."""
        return len(self.engine.get_clients())

    def _log_missing(self, task: str, expected: list[str], answered: list[str]) -> None:
        missing = sorted(set(expected) - set(answered))
        if missing:
            self.warning(f"round {self.current_round} task {task!r}: no valid answer from {missing}; continuing")
