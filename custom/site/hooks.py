"""What FedUQ's 2D site asks of a method's site part, and what it shows a site part of the site.

:class:`SitePartHooks` is the half of :class:`feduq.site.site2d.Site2D` that faces the method: each hook the shared
training, validation and test code calls asks the site's site part (``self.method``, a
:class:`feduq.parts.site.SitePart`), and each attribute a site part may read (:class:`feduq.parts.site.Site`:
the model, a scratch evaluation model, another view of a split, a new optimiser, the log) is provided here. A
method's executor class only builds its site part from the job's arguments (FedEvi:
:class:`feduq.flare.executor.FedUQExecutor` with FedEvi's site part). Nothing here needs FLARE's engine; models travel as FLARE's
:class:`~nvflare.app_common.abstract.fl_model.FLModel`, the type of FLARE's Client API.
"""

from __future__ import annotations

import json
from typing import Callable

import numpy as np
import torch

from nvflare.app_common.abstract.fl_model import FLModel

from .. import data as fdata
from ..core.training import load_params
from .local_entries import LOCAL_ENTRIES_FILE, LocalEntries


class SitePartHooks:
    """The site-part side of FedUQ's 2D site (mixed into :class:`feduq.site.site2d.Site2D`, which sets ``method``,
    ``trainer``, ``eval_model``, ``local_entries``, ``task_name``, ``center``, ``site`` and ``_common``, and gives
    ``log``/``warn``)."""

    def build_loss(self) -> Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]:
        """``(logits, label, round_index) -> loss`` (:meth:`feduq.parts.site.SitePart.loss`); on a site with partial
        labels (:attr:`annotated`), the same loss marginalised over the classes it does not annotate
        (:func:`feduq.core.partial_labels.partial_label_loss`)."""
        from ..core.partial_labels import partial_label_loss

        annotated = getattr(self, "annotated", None)
        loss = self.method.loss(self)
        return loss if annotated is None else partial_label_loss(loss, annotated, self.num_classes)

    def prob_fn(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, C, H, W]`` -> class probabilities (:meth:`feduq.parts.site.SitePart.probabilities`)."""
        return self.method.probabilities(logits)

    def uncertainty_fn(self) -> Callable[[torch.Tensor], dict]:
        """``logits -> {name: [B, *spatial]}`` uncertainty maps (:meth:`feduq.parts.site.SitePart.uncertainty`)."""
        return self.method.uncertainty()

    @property
    def global_model_note(self) -> str | None:
        """What a user must know when the *global* model is scored off the federation (``feduq evaluate``)."""
        return self.method.global_model_note

    @property
    def output(self) -> str:
        """``"segmentation"`` or ``"classification"`` (:attr:`feduq.parts.site.SitePart.output`)."""
        return self.method.output

    @property
    def primary_uncertainty(self) -> str:
        """The method's own map of :meth:`uncertainty_fn` (scored as an error detector by :mod:`feduq.site.evaluation`)."""
        return self.method.primary_uncertainty

    def extra_train_meta(self, round_index: int) -> dict:
        """Method statistics sent with θ_k after local training (:meth:`feduq.parts.site.SitePart.statistics`)."""
        return self.method.statistics(self, round_index)

    def extra_tasks(self) -> dict[str, Callable[[FLModel], FLModel]]:
        """The method's extra task handlers ``task_name -> handler(received FLModel) -> FLModel``."""
        def handler(run):
            def task(received: FLModel) -> FLModel:
                meta, metrics = run(self, dict(received.params or {}), received.current_round)
                return FLModel(metrics=dict(metrics), meta=dict(meta))
            return task
        return {name: handler(run) for name, run in self.method.tasks().items()}

    def local_keys(self) -> frozenset[str]:
        """State-dict entries that never leave the site (:meth:`feduq.parts.site.SitePart.local_keys`)."""
        if self._local_keys is None:  # computed once from the local model
            self._local_keys = frozenset(self.method.local_keys(self.trainer.model))
        return self._local_keys

    def regularizer(self, received: FLModel) -> Callable[[torch.nn.Module], torch.Tensor] | None:
        """Optional ``model -> scalar`` added to the loss this round (:meth:`feduq.parts.site.SitePart.regularizer`);
        called after the received global model has been loaded into the local model."""
        return self.method.regularizer(self)

    def extra_train_record(self, round_index: int) -> dict:
        """Site-local entries for this round's ``FEDUQ_TRAIN`` log line; never sent to the server."""
        return self.method.record(round_index)

    @property
    def model(self) -> torch.nn.Module:
        """The site's local model (:class:`feduq.parts.site.Site`)."""
        return self.trainer.model

    def load_eval(self, params) -> torch.nn.Module:
        """A scratch copy of the local model with ``params`` loaded, local keys kept, in eval mode."""
        return self._load_eval_model(FLModel(params=params))

    def dataset(self, split: str, stage: str = "val"):
        """Another view of one of this site's splits (``stage="val"``: no augmentation)."""
        return fdata.get_dataset(self.task_name, self.center, split, stage=stage, site=self.site, **self._common)

    def reset_optimizer(self) -> None:
        """A new Adam (the job's lr, betas, weight decay; no moments) and a new ExponentialLR with the job's γ."""
        self.trainer.reset_optimizer()

    # -- the entries the method keeps on the site (FedBN's normalisation layers, FedUAA's head) ---------------
    def _load_eval_model(self, received: FLModel) -> torch.nn.Module:
        """Load received parameters into the scratch model (the local model stays untouched).

        Entries in :meth:`local_keys` keep the site's own values (FedBN evaluates with its own
        normalisation statistics even when the received model carries some): the values this site validated the
        received global model with, when it did (so the best global model, chosen by that validation, is tested as
        it was validated, not with a later round's local entries), else its current ones.
        """
        self.eval_model.load_state_dict(self.trainer.model.state_dict())
        local = self.local_keys()
        load_params(self.eval_model, received.params, strict=False, skip=local)
        matched = self.local_entries.matched(received.params)
        if matched is not None:
            load_params(self.eval_model, matched, strict=False)
        self.eval_local = "matched" if matched is not None else "current"
        return self.eval_model.eval()

    def _start_local_entries(self) -> None:
        """At start-up (``state_path`` set): keep this site's local entries in its run folder, and read them back when
        the site's process was restarted within the job (they are not on the server)."""
        self._local_keys = None
        self.local_entries = LocalEntries(self.local_keys(), self.state_path.with_name(LOCAL_ENTRIES_FILE))
        restored = self.local_entries.restore(self.trainer.model)
        if restored is not None:
            self.log(f"restored the site's {len(self.local_keys())} local entries ({restored} validated-model copies)")

    def _remember_local(self, received: FLModel) -> None:
        """Keep the local entries the received global model is validated with now (see :meth:`_load_eval_model`)."""
        self.local_entries.remember(received.params, self.trainer.model)

    def _load_received(self, params: dict) -> None:
        """Load a received global model into the local model, except :meth:`local_keys`.

        Raises:
            ValueError: an unknown entry, a shape mismatch, or a shared entry that is missing.
        """
        local = self.local_keys()
        if not local:
            self.trainer.set_params(params, strict=True)
            return
        kept = self.trainer.set_params({k: v for k, v in params.items() if k not in local}, strict=False)
        missing = sorted(set(kept) - local)
        if missing:
            raise ValueError(f"received model lacks parameters: {missing[:5]}")

    def _shared_params(self) -> dict[str, np.ndarray]:
        """The local model's entries that may leave the site (all but :meth:`local_keys`)."""
        local = self.local_keys()
        return {k: v for k, v in self.trainer.get_params().items() if k not in local}

    # -- tasks -----------------------------------------------------------------------------------
    def _log_test_local(self) -> None:
        """For a method with local entries: ``FEDUQ_TEST_LOCAL {"site", "local": "matched"|"current"}``, and a warning
        when the tested global model was never validated here (scored with the current local entries)."""
        if not self.local_keys():
            return
        self.log("FEDUQ_TEST_LOCAL " + json.dumps({"site": self.site, "local": self.eval_local}))
        if self.eval_local != "matched":
            self.warn("the tested global model was never validated here; it was scored with the site's current local "
                      "entries")
