"""GraphFedSeg's FLARE glue (Acta Electronica Sinica 2026): the uncertainty collaboration graph on the server.

* :class:`GraphFedSegExecutor` -- FedAvg's site with two additions: after local training it sends U_k,
  the mean vacuity u = C/S (exp evidence) over its training images (or validation images, a switch);
  and, when the server sends its neighbour vector v_i, it adds the alignment term
  −λ₁·⟨v_i, θ⟩/‖θ‖ (Eq. 5 in pFedGraph's form) to every step's loss.
* :class:`GraphFedSegController` -- per round: every site trains from θ_global (each receives **its own**
  payload: the global model plus, from round 1 on and when λ₁ > 0, its v_i = Σ_j W_ij θ_j/‖θ_j‖ over
  the previous round's local models); the server validates θ_k, n_k and U_k, solves each row of W as a
  projection onto the simplex (Eq. 2, :mod:`feduq.methods.graphfedseg`), and fuses
  θ_global = λ Σ p_j θ_j + (1 − λ) mean_i Σ_j W_ij θ_j (Eq. 6–9). W and the effective weights are
  logged every round (``FEDUQ_GRAPHFEDSEG``) and checkpointed with the model.
"""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import numpy as np
import torch

from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from nvflare.app_common.app_constant import AppConstants
from nvflare.app_common.app_event_type import AppEventType
from nvflare.app_common.workflows.base_fedavg import BaseFedAvg

from ..aggregation import check_update
from ..constants import FedUQMetaKey, FedUQTask
from ..engine import per_image_statistics
from ..maps import softmax_entropy_and_vacuity
from ..reporting import write_results
from ..methods.graphfedseg import (
    DEFAULT_GAMMA,
    DEFAULT_LAMBDA,
    SIMILARITY_MODES,
    aggregate_with_buffers,
    alignment_keys,
    alignment_term,
    collaboration_graph,
    effective_weights,
    image_vacuity,
    neighbour_direction,
    similarity_matrix,
)
from .executor import FedAvgExecutor
from .quorum import required_answers
from .workflows import LAST_ROUND, QuorumExchange, fail_job

NEIGHBOUR_KEY = "graphfedseg::neighbour"  # server -> one site: its v_i over the sorted floating keys (alignment_keys)


class GraphFedSegExecutor(FedAvgExecutor):
    """GraphFedSeg site: FedAvg's training plus U_k and the alignment term.

    Args:
        lam1: weight λ₁ of the alignment term (the paper gives no value; pFedGraph's code uses 0.01);
            0 switches it off (the server then sends no v_i).
        align_sign: +1 maximises the similarity with the neighbours, as the paper states; −1 is
            pFedGraph's code (its sign is reversed).
        uncertainty_split: ``"train"`` (default: the training images after local training) or ``"val"``.
        **kwargs: :class:`feduq.flare.executor.FedUQExecutor`.
    """

    def __init__(self, lam1: float = 0.01, align_sign: int = 1, uncertainty_split: str = "train", **kwargs):
        super().__init__(**kwargs)
        if not (isinstance(lam1, (int, float)) and math.isfinite(lam1) and lam1 >= 0):
            raise ValueError(f"executor argument lam1={lam1!r}: expected a finite number >= 0")
        if align_sign not in (1, -1) or uncertainty_split not in ("train", "val"):
            raise ValueError(f"executor arguments align_sign={align_sign!r} (1 or -1), "
                             f"uncertainty_split={uncertainty_split!r} ('train' or 'val') out of range")
        self.lam1, self.align_sign, self.uncertainty_split = float(lam1), int(align_sign), uncertainty_split
        self._direction = None

    def train(self, received: FLModel, fl_ctx):
        params = dict(received.params)
        self._direction = params.pop(NEIGHBOUR_KEY, None)
        received.params = params
        return super().train(received, fl_ctx)

    def regularizer(self, received: FLModel):
        if self._direction is None or self.lam1 == 0:
            return None
        keys = alignment_keys(self._shared_params())  # floating entries, sorted: the server's v_i keys
        direction = torch.as_tensor(np.asarray(self._direction))

        def term(model: torch.nn.Module) -> torch.Tensor:
            named = dict(model.named_parameters())
            state = model.state_dict(keep_vars=True)
            return alignment_term({k: named.get(k, state[k]) for k in keys}, direction, self.lam1, self.align_sign, keys)
        return term

    def uncertainty_fn(self):
        return softmax_entropy_and_vacuity()

    primary_uncertainty = "vacuity"  # GraphFedSeg Eq. 3

    def extra_train_record(self, round_index: int) -> dict:
        return {"lam1": self.lam1, "neighbour_vector": self._direction is not None}

    def extra_train_meta(self, round_index: int) -> dict:
        from monai.data import DataLoader

        ds = self.train_ds if self.uncertainty_split == "train" else self.val_ds
        stats = per_image_statistics(self.trainer.model, DataLoader(ds, batch_size=self.batch_size), self.device,
                                     lambda logits: {"u": image_vacuity(logits.float())})
        return {FedUQMetaKey.MEAN_VACUITY: float(np.mean(stats["u"]))}


class GraphFedSegController(QuorumExchange, BaseFedAvg):
    """GraphFedSeg's round with per-site payloads (FLARE ModelController API).

    Args:
        num_rounds, persistor_id: as FLARE's BaseFedAvg.
        gamma: γ >= 0, the uncertainty penalty (paper 0.4).
        alpha: α of the similarity reward; None = 0.08·K (paper).
        lam: λ in [0, 1], the fusion coefficient (paper 0.2).
        similarity: ``"model"`` (cosine of the flattened models, paper) or ``"update"`` (of θ_j − θ_global, pFedGraph).
        send_neighbour: send each site its v_i (the sites' λ₁ > 0).
        min_clients, train_timeout: quorum and timeout as the other FedUQ workflows.
    """

    def __init__(self, *, num_rounds: int = 250, persistor_id: str = "persistor", gamma: float = DEFAULT_GAMMA,
                 alpha: float | None = None, lam: float = DEFAULT_LAMBDA, similarity: str = "model",
                 send_neighbour: bool = True, min_clients: int | None = None, train_timeout: int = 0, **kwargs):
        kwargs.setdefault("ignore_result_error", True)
        kwargs.setdefault("memory_gc_rounds", 1)  # gc + malloc_trim after every round (FLARE's cleanup_memory)
        super().__init__(num_rounds=num_rounds, persistor_id=persistor_id, **kwargs)
        if not (gamma >= 0) or not (0 <= lam <= 1) or (alpha is not None and not alpha >= 0):
            raise ValueError(f"GraphFedSegController: need gamma >= 0, 0 <= lam <= 1, alpha >= 0 or None "
                             f"(got gamma={gamma!r}, lam={lam!r}, alpha={alpha!r})")
        if similarity not in SIMILARITY_MODES:
            raise ValueError(f"GraphFedSegController: similarity={similarity!r}: expected one of {SIMILARITY_MODES}")
        if min_clients is not None and int(min_clients) < 2:
            raise ValueError("GraphFedSegController: a collaboration graph needs min_clients >= 2 (K = 1 has no graph)")
        self.gamma, self.alpha, self.lam, self.similarity = float(gamma), alpha, float(lam), similarity
        self.send_neighbour, self.min_clients, self.train_timeout = bool(send_neighbour), min_clients, train_timeout
        self._failures: dict[str, str] = {}

    def check_update(self, site: str, res: FLModel, global_params: dict) -> None:
        """Raise ValueError naming the site: missing/mis-shaped/non-finite tensors, or a bad n_k or U_k."""
        check_update(site, res.params or {}, global_params)
        for key, name in ((FedUQMetaKey.NUM_SAMPLES, "n_k"), (FedUQMetaKey.MEAN_VACUITY, "U_k")):
            value = (res.meta or {}).get(key)
            if not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0 or (name == "n_k" and value == 0):
                raise ValueError(f"site {site!r}: {name} = {value!r} (expected a finite number {'> 0' if name == 'n_k' else '>= 0'})")

    def run(self) -> None:
        start = self._start_run()
        if start is None:
            return
        model, first = start
        sites = [c.name for c in self.engine.get_clients()]
        if len(sites) < 2:
            fail_job(self, self.fl_ctx, f"GraphFedSeg needs at least 2 sites, the job has {sites}")
            return
        required = max(required_answers(self.min_clients, len(sites)), 1)
        graph = model.meta.get(FedUQMetaKey.GRAPH)  # {"sites": [...], "W": [[...]]} of the last round
        local_models: dict[str, dict] = {}  # previous round's accepted local models (for v_i)
        neighbourhood: dict[str, dict] = {}  # last round's personalised models theta_neigh[i]
        for self.current_round in range(first, self.num_rounds):
            r = self.current_round
            self.info(f"GraphFedSeg round {r} started")
            model.current_round = r
            self.fl_ctx.set_prop(AppConstants.CURRENT_ROUND, r, private=True, sticky=False)
            self.event(AppEventType.ROUND_STARTED)
            results = self._send_own(FedUQTask.TRAIN, {s: self._payload(model, s, graph, local_models) for s in sites})
            if self._aborted():
                return
            accepted, rejected = self._accept(results, model.params)
            if not self._quorum_met("train", max(required, 2), sites, list(accepted), rejected):
                return
            order = [s for s in sites if s in accepted]
            models = [{k: np.asarray(v) for k, v in accepted[s].params.items()} for s in order]
            n = np.array([float(accepted[s].meta[FedUQMetaKey.NUM_SAMPLES]) for s in order])
            p = n / n.sum()
            U = np.array([float(accepted[s].meta[FedUQMetaKey.MEAN_VACUITY]) for s in order])
            cos = similarity_matrix(models, start={k: np.asarray(v) for k, v in model.params.items()}, mode=self.similarity)
            W = collaboration_graph(p, cos, U, alpha=self.alpha, gamma=self.gamma)
            fused = aggregate_with_buffers(models, p, W, lam=self.lam)  # BatchNorm's integer counts averaged, rounded
            w = effective_weights(p, W, lam=self.lam)
            self.info("FEDUQ_GRAPHFEDSEG " + json.dumps({
                "round": r, "sites": order, "W": np.round(W, 6).tolist(), "p": np.round(p, 6).tolist(),
                "U": np.round(U, 6).tolist(), "cos": np.round(cos, 6).tolist()}))
            self.info("FEDUQ_AGGREGATION " + json.dumps({"round": r, "weights": {s: round(float(x), 6) for s, x in zip(order, w)}}))
            global_params = {k: np.asarray(v) for k, v in fused.global_model.items()}
            aggr = self.aggregate(list(accepted.values()), aggregate_fn=lambda _res: FLModel(params=global_params))
            model = self.update_model(model, aggr)
            graph = {"sites": order, "W": W.tolist()}
            local_models = dict(zip(order, models))
            neighbourhood = dict(zip(order, fused.neighbourhood))
            model.meta = dict(model.meta or {})
            model.meta[FedUQMetaKey.GRAPH] = graph
            model.meta[LAST_ROUND] = r
            self.save_model(model)
            self._maybe_cleanup_memory()
        self.info("GraphFedSeg finished")
        if neighbourhood and not self._aborted():
            self._test_personalised(neighbourhood)

    def _test_personalised(self, neighbourhood: dict[str, dict]) -> None:
        """Each site scores its own last-round neighbourhood model θ_neigh[i] = Σ_j W_ij θ_j on its test split;
        the table lands in ``<run dir>/results/personalised/`` (the global model's table is written by the
        ``FinalTestEvaluation`` workflow that follows)."""
        results = self._send_own(FedUQTask.TEST, {
            site: FLModel(params={k: np.asarray(v) for k, v in params.items()}, params_type=ParamsType.FULL,
                          meta={"evaluated_model": "personalised neighbourhood model"})
            for site, params in neighbourhood.items()})
        metrics = {res.meta["client_name"]: res.metrics for res in results if res.metrics}
        if not metrics:
            self.warning(f"no personalised test results ({self._failures or 'no answers'})")
            return
        paths = write_results(metrics, Path(self.get_run_dir()) / "results" / "personalised",
                              method="graphfedseg (personalised)",
                              note="Each site's last-round neighbourhood model Σ_j W_ij θ_j on its own test split.")
        self.info(f"GraphFedSeg personalised test results:\n{paths['markdown'].read_text()}")

    def _payload(self, model: FLModel, site: str, graph: dict | None, local_models: dict) -> FLModel:
        """The global model, plus this site's own v_i when the graph and last round's models are known."""
        params = dict(model.params)
        if self.send_neighbour and graph and site in graph["sites"] and all(s in local_models for s in graph["sites"]):
            row = np.asarray(graph["W"][graph["sites"].index(site)])
            keys = alignment_keys(params)  # floating entries only, as the site's alignment term
            params[NEIGHBOUR_KEY] = neighbour_direction([local_models[s] for s in graph["sites"]], row, keys=keys).astype(np.float32)
        return FLModel(params=params, params_type=ParamsType.FULL, current_round=model.current_round,
                       total_rounds=self.num_rounds, meta={})

    def _send_own(self, task_name: str, payloads: dict[str, FLModel]) -> list[FLModel]:
        """Send every site its own payload (non-blocking) and wait for all answers (or the timeout)."""
        self._failures = {}
        results: list[FLModel] = []
        for site, data in payloads.items():
            self.send_model(task_name=task_name, data=data, targets=[site], timeout=self.train_timeout,
                            callback=results.append)
        while self.get_num_standing_tasks() and not self._aborted():
            time.sleep(0.2)
        return results
