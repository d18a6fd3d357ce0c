"""GraphFedSeg's site part and server part, run by FedUQ's executor and round loop (FLARE-free)."""

from __future__ import annotations

import json
import math
import os
import zipfile
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from ...common.wire import FedUQMetaKey, FedUQTask
from ...scores.tables import PERSONALISED, write_results
from ...parts.server import ServerPart, num_samples
from ...parts.site import SitePart
from .equations import (
    aggregate_with_buffers,
    alignment_keys,
    alignment_term,
    effective_weights,
    image_vacuity,
    vacuity,
    neighbour_direction,
)
from .graph import DEFAULT_GAMMA, DEFAULT_LAMBDA, SIMILARITY_MODES, collaboration_graph, similarity_matrix

NEIGHBOUR_KEY = "graphfedseg::neighbour"  # server -> one site: its v_i over the sorted floating keys (alignment_keys)
#: the last rounds' accepted local models, in the server's run folder (v_i of the first round after a resume)
LOCAL_MODELS_FILE = "graphfedseg_local_models_r{round}.npz"


class GraphFedSegServer(ServerPart):
    """GraphFedSeg's server part (Algorithm 1): per-site payloads, the graph W, the dual-layer fusion.

    Per round: each site receives θ_global, plus (from the round after W is known, and with ``send_neighbour``)
    its own v_i = Σ_j W_ij θ_j/‖θ_j‖ over the previous round's accepted local models (:data:`NEIGHBOUR_KEY`);
    every update must carry a finite n_k > 0 and U_k >= 0; W row by row from p, the cosines and U (Eq. 2), then
    θ_global = λ Σ p_j θ_j + (1 − λ) mean_i Σ_j W_ij θ_j (Eq. 6–9; BatchNorm's integer counts averaged and
    rounded). W is logged (``FEDUQ_GRAPHFEDSEG``) and checkpointed (``graphfedseg_w``); the round's accepted local
    models, from which v_i is formed, are written to the server's run folder (:data:`LOCAL_MODELS_FILE`, the last two
    rounds kept) and the checkpoint names the file, so a resumed job sends v_i from its first round. After the last round each
    site scores its own neighbourhood model Σ_j W_ij θ_j on its test split; the table goes to
    ``<run dir>/results/personalised/``.

    Args:
        gamma: γ >= 0, the uncertainty penalty (paper 0.4).
        alpha: α of the similarity reward; None = 0.08·K (paper).
        lam: λ in [0, 1], the fusion coefficient (paper 0.2).
        similarity: ``"model"`` (cosine of the flattened models, paper) or ``"update"`` (of θ_j − θ_global, pFedGraph).
        send_neighbour: send each site its v_i (the sites' λ₁ > 0).

    Raises:
        ValueError: a setting out of range (named).
    """

    label = "GraphFedSeg"
    min_sites = 2  # a collaboration graph needs K >= 2
    state_key = FedUQMetaKey.GRAPH

    def __init__(self, gamma: float = DEFAULT_GAMMA, alpha: float | None = None, lam: float = DEFAULT_LAMBDA,
                 similarity: str = "model", send_neighbour: bool = True):
        if not (gamma >= 0) or not (0 <= lam <= 1) or (alpha is not None and not alpha >= 0):
            raise ValueError(f"GraphFedSeg: need gamma >= 0, 0 <= lam <= 1, alpha >= 0 or None "
                             f"(got gamma={gamma!r}, lam={lam!r}, alpha={alpha!r})")
        if similarity not in SIMILARITY_MODES:
            raise ValueError(f"GraphFedSeg: similarity={similarity!r}: expected one of {SIMILARITY_MODES}")
        self.gamma, self.alpha, self.lam, self.similarity = float(gamma), alpha, float(lam), similarity
        self.send_neighbour = bool(send_neighbour)
        self.graph: dict | None = None  # {"sites": [...], "W": [[...]]} of the last round
        self.local_models: dict[str, dict] = {}  # last round's accepted local models (for v_i)
        self.neighbourhood: dict[str, dict] = {}  # last round's personalised models θ_neigh[i]
        self.local_models_file: dict | None = None  # {"file", "round"} of the file the checkpoint names

    def start(self, fed, global_params, sites, state) -> None:
        state = dict(state) if state else None
        saved = state.pop("local_models", None) if state else None
        self.graph, self.local_models, self.neighbourhood, self.local_models_file = state, {}, {}, None
        if self.send_neighbour and state and saved:
            self.local_models = self._read_local_models(fed, saved, state["sites"])

    def state(self) -> dict | None:
        if self.graph is None:
            return None
        return {**self.graph, **({"local_models": self.local_models_file} if self.local_models_file else {})}

    def after_round(self, fed, global_params, sites) -> None:
        """Write the round's accepted local models (what v_i is formed from) to the run folder; keep two rounds."""
        if not self.send_neighbour or not self.graph:
            return
        r, folder = int(fed.round), Path(fed.run_dir)
        path = folder / LOCAL_MODELS_FILE.format(round=r)
        arrays = {f"site{i}.{k}": np.asarray(v) for i, s in enumerate(self.graph["sites"])
                  for k, v in self.local_models[s].items()}
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, **arrays)
        os.replace(tmp, path)  # a crash mid-write never leaves a half file under the name the checkpoint names
        self.local_models_file = {"file": str(path), "round": r}
        (folder / LOCAL_MODELS_FILE.format(round=r - 2)).unlink(missing_ok=True)

    @staticmethod
    def _read_local_models(fed, saved: dict, order: list[str]) -> dict[str, dict]:
        """The checkpointed round's local models; {} (and a warning: the first resumed round sends no v_i) when the
        file is gone or unreadable. Read with ``allow_pickle=False``: loading it never executes code."""
        path = Path(str(saved.get("file", "")))
        try:
            with np.load(path, allow_pickle=False) as data:
                models: dict[str, dict] = {s: {} for s in order}
                for name in data.files:
                    index, key = name.split(".", 1)
                    models[order[int(index.removeprefix("site"))]][key] = data[name]
            if not all(models.values()):
                raise ValueError(f"no model of {[s for s, m in models.items() if not m]}")
        except (OSError, EOFError, ValueError, IndexError, zipfile.BadZipFile) as e:
            fed.warn(f"GraphFedSeg: cannot read the local models of round {saved.get('round')} ({path}: {e}); "
                     "the first resumed round sends no v_i")
            return {}
        return models

    def per_site_payloads(self) -> bool:
        return True

    def payload(self, fed, site: str, global_params) -> dict:
        """θ_global, plus this site's own v_i when the graph and last round's models are known."""
        params, graph = dict(global_params), self.graph
        if self.send_neighbour and graph and site in graph["sites"] and all(s in self.local_models for s in graph["sites"]):
            row = np.asarray(graph["W"][graph["sites"].index(site)])
            keys = alignment_keys(params)  # floating entries only, as the site's alignment term
            direction = neighbour_direction([self.local_models[s] for s in graph["sites"]], row, keys=keys)
            params[NEIGHBOUR_KEY] = direction.astype(np.float32)
        return params

    def check(self, site, answer, global_params) -> None:
        """The shared checks, then U_k must be a finite number >= 0 (ValueError naming the site)."""
        super().check(site, answer, global_params)
        u = answer.meta.get(FedUQMetaKey.MEAN_VACUITY)
        if isinstance(u, bool) or not isinstance(u, (int, float)) or not math.isfinite(u) or u < 0:
            raise ValueError(f"site {site!r}: U_k = {u!r} (expected a finite number >= 0)")

    def fuse(self, fed, answers, global_params):
        order = list(answers)
        models = [{k: np.asarray(v) for k, v in answers[s].params.items()} for s in order]
        n = np.array([num_samples(s, answers[s].meta) for s in order])
        p = n / n.sum()
        U = np.array([float(answers[s].meta[FedUQMetaKey.MEAN_VACUITY]) for s in order])
        cos = similarity_matrix(models, start=global_params, mode=self.similarity)
        W = collaboration_graph(p, cos, U, alpha=self.alpha, gamma=self.gamma)
        fused = aggregate_with_buffers(models, p, W, lam=self.lam)
        fed.log("FEDUQ_GRAPHFEDSEG " + json.dumps({
            "round": fed.round, "sites": order, "W": np.round(W, 6).tolist(), "p": np.round(p, 6).tolist(),
            "U": np.round(U, 6).tolist(), "cos": np.round(cos, 6).tolist()}))
        self.graph = {"sites": order, "W": W.tolist()}
        self.local_models = dict(zip(order, models))
        self.neighbourhood = dict(zip(order, fused.neighbourhood))
        weights = dict(zip(order, map(float, effective_weights(p, W, lam=self.lam))))
        return {k: np.asarray(v) for k, v in fused.global_model.items()}, weights

    def finish(self, fed, global_params, sites) -> None:
        """Each site scores its last-round neighbourhood model on its test split (``results/personalised/``)."""
        if not self.neighbourhood:
            return
        payloads = {s: {k: np.asarray(v) for k, v in params.items()} for s, params in self.neighbourhood.items()}
        answers = fed.send(FedUQTask.TEST, payloads, list(payloads), own=True,
                           meta={"evaluated_model": "personalised neighbourhood model",
                                 FedUQMetaKey.TEST_RESULTS: PERSONALISED})
        metrics = {s: a.metrics for s, a in answers.items() if a.metrics}
        if not metrics:
            fed.warn(f"no personalised test results ({fed.failures or 'no answers'})")
            return
        paths = write_results(metrics, fed.run_dir / "results" / PERSONALISED, method="graphfedseg (personalised)",
                              note="Each site's last-round neighbourhood model Σ_j W_ij θ_j on its own test split.")
        fed.log(f"GraphFedSeg personalised test results:\n{paths['markdown'].read_text()}")


class GraphFedSegSite(SitePart):
    """GraphFedSeg's site part: FedAvg's training plus U_k and the alignment term.

    After local training the site sends U_k, the mean vacuity u = C/S (exp evidence, Eq. 3-4) over its training
    images (or validation images). When the server sends its neighbour vector v_i (:data:`NEIGHBOUR_KEY`), every
    step's loss gets −λ₁·⟨v_i, θ⟩/‖θ‖ (:func:`alignment_term`, Eq. 5 in pFedGraph's form) over the floating entries.

    Args:
        lam1: weight λ₁ of the alignment term (the paper gives no value; pFedGraph's code uses 0.01); 0 switches it off.
        align_sign: +1 maximises the similarity with the neighbours, as the paper states; −1 is pFedGraph's code.
        uncertainty_split: ``"train"`` (default: the training images after local training) or ``"val"``.
        loss: FedAvg's local loss (:class:`feduq.parts.site.SitePart`).

    Raises:
        ValueError: an argument out of range (named).
    """

    primary_uncertainty = "vacuity"  # GraphFedSeg Eq. 3

    def __init__(self, lam1: float = 0.01, align_sign: int = 1, uncertainty_split: str = "train", loss: str = "dice_ce"):
        super().__init__(loss)
        if not (isinstance(lam1, (int, float)) and math.isfinite(lam1) and lam1 >= 0):
            raise ValueError(f"executor argument lam1={lam1!r}: expected a finite number >= 0")
        if align_sign not in (1, -1) or uncertainty_split not in ("train", "val"):
            raise ValueError(f"executor arguments align_sign={align_sign!r} (1 or -1), "
                             f"uncertainty_split={uncertainty_split!r} ('train' or 'val') out of range")
        self.lam1, self.align_sign, self.uncertainty_split = float(lam1), int(align_sign), uncertainty_split
        self.direction = None  # this round's v_i, when the server sent one

    def receive(self, params: dict) -> dict:
        self.direction = params.pop(NEIGHBOUR_KEY, None)
        return params

    def regularizer(self, site):
        if self.direction is None or self.lam1 == 0:
            return None
        keys = alignment_keys(site.model.state_dict())  # floating entries, sorted: the server's v_i keys
        direction = torch.as_tensor(np.asarray(self.direction))

        def term(model: torch.nn.Module) -> Tensor:
            named = dict(model.named_parameters())
            state = model.state_dict(keep_vars=True)
            return alignment_term({k: named.get(k, state[k]) for k in keys}, direction, self.lam1, self.align_sign, keys)
        return term

    def uncertainty(self):
        """``logits -> {"total": predictive entropy of the softmax (nats), "vacuity": C / S of exp evidence}``: the
        softmax model's logits also read as evidence (GraphFedSeg Eq. 3, :func:`.equations.vacuity`)."""
        from ...scores.maps import softmax_entropy

        def fn(logits: Tensor) -> dict[str, Tensor]:
            return {**softmax_entropy(logits), "vacuity": vacuity(logits.double())}

        return fn

    def statistics(self, site, round_index):
        from monai.data import DataLoader

        from ...scores.scoring import per_image_statistics

        ds = site.train_ds if self.uncertainty_split == "train" else site.val_ds
        stats = per_image_statistics(site.model, DataLoader(ds, batch_size=site.batch_size), site.device,
                                     lambda logits: {"u": image_vacuity(logits.float())})
        return {FedUQMetaKey.MEAN_VACUITY: float(np.mean(stats["u"]))}

    def record(self, round_index):
        return {"lam1": self.lam1, "neighbour_vector": self.direction is not None}
