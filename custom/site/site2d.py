"""FedUQ's 2D site, without FLARE's engine: the training, validation and test a site runs for every 2D method.

:class:`Site2D` builds the site's datasets, network and optimiser once per run (so Adam state and the LR schedule
persist across rounds), validates every received global model, trains, and tests when the server asks. What
differs per method is its site part (:class:`feduq.parts.site.SitePart`), asked through
:class:`feduq.site.hooks.SitePartHooks`. On FLARE, :class:`feduq.flare.executor.FedUQExecutor` adds only the FLARE
side (workspace, log, TensorBoard writer, core share, task dispatch); ``feduq virtual`` and
:mod:`feduq.site.evaluation` call :meth:`Site2D.start` and the tasks directly. Models travel as FLARE's
:class:`~nvflare.app_common.abstract.fl_model.FLModel` (the type of FLARE's Client API).

The data root is the site's business, never the job's: its config's ``data_root`` (on FLARE
``<site workspace>/local/feduq_site.json``) or else ``FEDUQ_DATA_ROOT``; a site reads only
``<data_root>/<task>/<center>/``.
"""

from __future__ import annotations

import json
import logging
import time
import warnings

import torch

from nvflare.apis.fl_constant import FLMetaKey
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType

from .. import data as fdata
from ..common.saving import save_torch
from ..common.wire import FedUQMetaKey, FedUQMetric, FedUQTask
from ..scores.maps import image_stem, save_uncertainty_maps
from ..scores.scoring import evaluate_test, summarize_test_scores, validation_scores
from ..scores.tables import PER_CASE_TEST_FILE, per_image_test_path, per_image_test_rows, write_rows
from ..core.partial_labels import scored_columns
from ..scores.volume_scores import CaseCollector, volume_site_results
from ..core.training import LocalTrainer
from ..parts.site import LOSSES, SitePart
from ..privacy.dp_sgd import DPConfig, PrivateTraining
from .hooks import SitePartHooks
from .local_entries import LocalEntries
from .protocol import TestProtocol
from .settings import check_common_args, track_scalars
from .setup import CLIENT_STATE_FILE, SiteSetup  # noqa: F401  (CLIENT_STATE_FILE: the site's restart state)

_LOG = logging.getLogger("feduq.site")

class Site2D(SiteSetup, SitePartHooks):
    """A 2D segmentation site (FedAvg behaviour by default; a method changes it through ``method``).

    Set it up with :meth:`start`, then run the tasks of :meth:`tasks`: ``train`` (validate the received global model, train ``local_epochs``, send
    θ_k with N_k), ``validate`` (validation Dice of the received model), ``test`` (per-site test
    Dice/HD95/ECE of the received model), ``submit_model`` (the local model).

    Args:
        task: FedUQ task name (see :data:`feduq.data.TASKS`), e.g. ``"polyp"``.
        image_size: training/inference side length in pixels (384 as the papers; 128 on CPU).
        batch_size: training batch size (validation and test use 1).
        local_epochs: local epochs E per round.
        lr, betas, weight_decay, lr_gamma: Adam and per-round ExponentialLR settings.
        network: ``{"name": ..., **options}`` of :func:`feduq.core.networks.build_network` (default
            ``{"name": "fedevi_unet"}``, FedEvi's U-Net; ``"light"`` is the CPU smoke-test network).
        keep_largest_component: test-time post-processing (FedEvi evaluation).
        test_protocol: how the site tests (:class:`feduq.site.protocol.TestProtocol`): ``{"resolution": "stored" |
            "training", "connectivity": 8 | 4, "empty_prediction": "empty" | "whole_image", "every_round": bool}``;
            null = FedUQ's defaults (stored resolution, 8-connected, empty as empty, final test only).
        loss: the local loss of executors that keep FedAvg's (FedAvg, FedProx, FedBN, GraphFedSeg): ``"dice_ce"``
            (default: MONAI Dice + cross-entropy over all classes) or ``"dice"`` (the official FedEvi code's FedAvg:
            its ``Dice_Loss_val`` on the softmax, :func:`feduq.scores.scoring.validation_dice_loss`, batch-pooled).
        max_items: use only the first N items of each split (smoke tests); None = all.
        seed: torch seed for initialisation-independent randomness (shuffling, flips).
        device: ``"auto"`` (CUDA if available, else CPU), ``"cpu"``, ``"cuda:0"``, ...
        resize: ``"stretch"`` (constructor default) or ``"letterbox"`` (the official FedEvi polyp pipeline and the
            committed jobs' setting: long side to ``image_size`` at the original aspect ratio, zero padding; test
            predictions are cropped back before upsampling).
        intensity: ``"minmax"`` (constructor default: (x - min) / (max - min)) or ``"max"`` (the official FedEvi
            code and the committed jobs' setting: x / max per image).
        amp: mixed precision of training's forward pass (``"auto"``: float16 on CUDA, bfloat16 on a CPU with bfloat16
            hardware for a network without BatchNorm, else float32; ``"bf16"``: bfloat16 on either; false: float32; see
            :func:`feduq.core.training.autocast_dtype`).
        channels_last: ``channels_last`` memory format for the model and inputs (off: not measured faster yet).
        save_maps: at the final ``test`` task, write uncertainty maps of the first N test images
            (:func:`feduq.scores.maps.save_uncertainty_maps`) to ``<site run dir>/uncertainty_maps/``; they stay on
            the site. 0 (default) writes none.
        num_threads: torch CPU threads. 0 (default): this site's share of the host's cores among the job's sites
            that compute at the moment, re-read every training step (:class:`feduq.core.threads.HostCoreShare`): the
            simulator's site processes together use every core and no more, and the site still training when the
            others are done takes the cores they freed; a site alone on its host uses every core. A number, or per
            site ``{"Kvasir-SEG": 2, "default": 1}``, fixes it.
        num_workers: training-loader worker processes. ``"auto"`` (default): 0 on CPU (the cores
            train), on CUDA ``min(4, CPU count // 2)`` workers with pinned memory (measured
            on an H100 at 384 px, fedevi_unet: 0 workers reach 0.36 of the plain-loop limit, 4 workers
            0.55-0.61; ``tools/benchmark_throughput.py``).
        dp: differentially private local training (:mod:`feduq.privacy.dp_sgd`), ``null`` (default) or
            ``{"epsilon": ε, "delta": 1e-5, "max_grad_norm": 1.0}``: DP-SGD with Opacus, σ chosen so the site
            spends ε by the end of the job's last round (``"rounds"`` overrides the job's ``num_rounds``);
            the ε spent is logged every round (``dp_epsilon``) and reported with the test scores.
            Networks with BatchNorm are refused at start-up. AMP is off under DP.
        method: the method's site part (:class:`feduq.parts.site.SitePart`; a method's executor class passes its
            own); None: FedAvg's, with ``loss``.

    Attributes:
        site: the site's name (set by :meth:`start`).
        writer: where each round's numbers go (an object with ``add_scalar(key, value, global_step)``; on FLARE
            the job's TBWriter), or None.
        cores: this site's share of the host's cores (:class:`feduq.core.threads.HostCoreShare`) when one is held.
    """

    def __init__(
        self,
        task: str = "polyp",
        image_size: int = 384,
        batch_size: int = 8,
        local_epochs: int = 2,
        lr: float = 1e-3,
        betas: tuple = (0.9, 0.99),
        weight_decay: float = 1e-5,
        lr_gamma: float = 0.99,
        network: dict | None = None,
        keep_largest_component: bool = True,
        test_protocol: dict | None = None,
        loss: str = "dice_ce",
        max_items: int | None = None,
        seed: int = 0,
        device: str = "auto",
        resize: str = "stretch",
        intensity: str = "minmax",
        amp: str | bool = "auto",
        channels_last: bool = False,
        save_maps: int = 0,
        num_threads: int = 0,
        num_workers: int | str = "auto",
        dp: dict | None = None,
        method: SitePart | None = None,
    ):
        self.site = "?"
        self.cores = None
        check_common_args(task=task, image_size=image_size, batch_size=batch_size, local_epochs=local_epochs, lr=lr,
                          betas=betas, weight_decay=weight_decay, lr_gamma=lr_gamma, network=network, resize=resize,
                          intensity=intensity, amp=amp, channels_last=channels_last, max_items=max_items,
                          save_maps=save_maps, num_threads=num_threads, device=device, num_workers=num_workers, dp=dp,
                          seed=seed)
        self.dp = DPConfig.from_json(dp)
        self.test_protocol = TestProtocol.from_json(test_protocol)  # ValueError naming test_protocol.<key>
        self.method = method if method is not None else SitePart(loss)  # the method's site part
        if loss not in LOSSES:
            raise ValueError(f"executor argument loss={loss!r} is out of range: expected \"dice_ce\" or \"dice\"")
        self._local_keys: frozenset[str] | None = None
        self.local_entries = LocalEntries(frozenset())  # the local entries per validated global model (set at start-up)
        self.eval_local = "current"  # the local entries the last scratch model was loaded with: matched or current
        self.regions = None  # nested evaluation regions of the task (set at start-up)
        self.writer = None  # where each round's numbers go (FLARE: the TBWriter component, found at start-up)
        self.task_name = fdata.task_name(task)  # a declared task (its JSON object in the job) is registered here
        self.image_size = int(image_size)
        self.batch_size = int(batch_size)
        self.local_epochs = int(local_epochs)
        self.optim_args = dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay, lr_gamma=lr_gamma)
        self.speed_args = dict(amp=amp, channels_last=bool(channels_last))
        self.network_args = {**self.method.network_defaults, **(network or {})}
        self.keep_largest_component, self.resize, self.intensity = keep_largest_component, resize, intensity
        self.save_maps, self.max_items, self.seed = int(save_maps), max_items, int(seed)
        self.device_name, self.num_threads, self.num_workers = device, num_threads, num_workers
        self.trainer: LocalTrainer | None = None

    # -- logging and the host's cores (FLARE's executor writes to FLARE's log and holds a share) ------------------
    def log(self, line: str) -> None:
        """One line in the site's log."""
        _LOG.info(line)

    def warn(self, line: str) -> None:
        """One warning in the site's log."""
        _LOG.warning(line)

    def take_core_share(self) -> None:
        """``num_threads`` 0: take this site's share of the host's cores (FLARE: among the job's sites computing now,
        :meth:`feduq.flare.site_executor.SiteExecutor.share_cores`); off FLARE torch's own threads are kept."""

    def _track(self, record: dict, round_index: int) -> None:
        """Stream this round's numbers to :attr:`writer` (on FLARE: the server's TensorBoard, when the job has a TBWriter)."""
        track_scalars(self.writer, record, round_index)

    # -- tasks -------------------------------------------------------------------------------------------------
    def ready(self) -> bool:
        """Whether :meth:`start` succeeded, so tasks can run."""
        return self.trainer is not None

    def _setup_failed(self) -> None:
        self.trainer = None

    def tasks(self) -> dict:
        """Task name -> handler ``(received FLModel) -> FLModel``: the four shared tasks and the method's extra ones."""
        return {
            FedUQTask.TRAIN: self.train,
            FedUQTask.VALIDATE: self.validate,
            FedUQTask.TEST: self.test,
            FedUQTask.SUBMIT_MODEL: self.submit_model,
            **self.extra_tasks(),
        }

    def _ensure_privacy(self, received: FLModel) -> None:
        """Switch DP-SGD on at the first training task (σ needs the job's rounds, sent with the model).

        Raises:
            ValueError: ``dp`` is set but neither ``dp.rounds`` nor the received model gives the rounds.
        """
        if self.dp is None or self.trainer.privacy is not None:
            return
        rounds = self.dp.rounds or received.total_rounds
        if not rounds:
            raise ValueError(f"site {self.site!r}: dp needs the job's number of rounds: set dp.rounds "
                             "(the workflow sent none with the model)")
        privacy = PrivateTraining.for_rounds(self.trainer.model, self.dp, len(self.train_ds), self.batch_size,
                                             self.local_epochs, int(rounds), seed=self.seed)
        self.trainer.enable_privacy(privacy)
        self.log("FEDUQ_DP " + json.dumps({"site": self.site, **privacy.summary(), "rounds": int(rounds)}))

    def train(self, received: FLModel) -> FLModel:
        """Validate the received global model, train ``local_epochs`` and return θ_k (all but the local entries) with
        N_k, N_k^val and the method's statistics in ``meta``; the ``FEDUQ_TRAIN`` record is logged.

        Raises:
            ValueError: the received model does not fit the site's network (unknown or missing entry, shape).
        """
        round_index = int(received.current_round or 0)
        self.method.before_round(self, round_index)  # e.g. FedA3I: a new optimiser every round
        self._ensure_privacy(received)
        received.params = self.method.receive(dict(received.params))  # e.g. GraphFedSeg takes out its v_i
        self._remember_local(received)  # the local entries this round validates the received model with
        self._load_received(received.params)
        if self.trainer.scheduler.last_epoch < round_index:  # resumed job or lost state: one LR step per round
            with warnings.catch_warnings():  # catching up the schedule before this round's first step is the intent
                warnings.filterwarnings("ignore", message="Detected call of `lr_scheduler.step\\(\\)` before")
                for _ in range(round_index - self.trainer.scheduler.last_epoch):
                    self.trainer.scheduler.step()
        start = time.perf_counter()
        val = validation_scores(self.trainer.model, self.val_loader, self.device, self.num_classes, self.regions,
                                self.prob_fn)
        tested = self._test_scores(self.trainer.model) if self.test_protocol.every_round else {}
        validate_seconds = time.perf_counter() - start
        stats = self.trainer.train_epochs(
            self.train_loader,
            self.local_epochs,
            lambda lo, la: self.loss(lo, la, round_index + 1),
            regularizer=self.regularizer(received),
        )
        save_torch({**self.trainer.state(), "round": round_index}, self.state_path)
        self.local_entries.save(self.trainer.model)  # the trained local entries, for a restarted process
        return self._round_result(round_index, stats, val, validate_seconds=round(validate_seconds, 3),
                                  **{f"test_{k}_global": round(v, 5) for k, v in tested.items() if k in ("dice", "hd95")})

    def _round_result(self, round_index: int, stats, val_metrics: dict, **record_extra) -> FLModel:
        """What a site sends after local training, and its ``FEDUQ_TRAIN`` log line / TensorBoard scalars.

        Args:
            val_metrics: metric name -> value of the *received* global model on the validation split
                (``val_dice``; ``val_auc``/``val_accuracy`` for classification); logged as ``<name>_global``.
            record_extra: site-local log fields (never sent).
        """
        start = time.perf_counter()
        meta = {
            FedUQMetaKey.NUM_SAMPLES: len(self.train_ds),
            FedUQMetaKey.NUM_VAL_SAMPLES: len(self.val_ds),
            FLMetaKey.NUM_STEPS_CURRENT_ROUND: len(self.train_ds),
            **self.extra_train_meta(round_index),
        }
        record_extra["statistics_seconds"] = round(time.perf_counter() - start, 3)  # e.g. FedEvi's A_k pass
        record = {
            "site": self.site,
            "round": round_index,
            **{f"{name}_global": round(float(v), 5) for name, v in val_metrics.items()},
            **record_extra,
            "train_loss": round(stats.mean_loss, 5),
            "steps": stats.num_steps,
            "train_seconds": round(stats.seconds, 3),
            "torch_threads": torch.get_num_threads(),  # at the end of training (num_threads 0: this site's share)
            **{k: (round(v, 6) if isinstance(v, float) else v) for k, v in meta.items()},
            **self.extra_train_record(round_index),
            **(self.trainer.privacy.summary() if self.trainer.privacy is not None else {}),
        }
        self.log("FEDUQ_TRAIN " + json.dumps(record))
        self._track(record, round_index)
        return FLModel(
            params=self._shared_params(),
            params_type=ParamsType.FULL,
            metrics={**val_metrics, FedUQMetric.TRAIN_LOSS: stats.mean_loss},
            meta={**meta, FedUQMetaKey.SITE: self.site},  # which site computed it (feduq.parts.server.check_sender)
        )

    def validate(self, received: FLModel) -> FLModel:
        """Validation scores of the received model (``val_dice``, ``val_loss``), as ``train`` computes them for the
        model it receives; logged as ``FEDUQ_VALIDATE {json}`` with ``<name>_global`` keys and, when
        ``test_protocol.every_round``, the model's test Dice and HD95 (``test_dice_global``, ``test_hd95_global``),
        so the last round's model has a point on the learning curves too. Test scores are never sent."""
        self._remember_local(received)  # the last global model, validated after the final round, is tested so too
        model = self._load_eval_model(received)
        val = validation_scores(model, self.val_loader, self.device, self.num_classes, self.regions, self.prob_fn)
        tested = self._test_scores(model) if self.test_protocol.every_round else {}
        record = {"site": self.site, "round": int(received.current_round or 0),
                  **{f"{name}_global": round(float(v), 5) for name, v in val.items()},
                  **{f"test_{k}_global": round(v, 5) for k, v in tested.items() if k in ("dice", "hd95")}}
        self.log("FEDUQ_VALIDATE " + json.dumps(record))
        return FLModel(metrics=val, meta={FedUQMetaKey.NUM_VAL_SAMPLES: len(self.val_ds)})

    def _test_scores(self, model: torch.nn.Module, per_image: bool = False, stems: list | None = None,
                     observe=None) -> dict:
        """Test scores of ``model`` on this site's test split under :attr:`test_protocol`: the per-image arrays of
        :func:`feduq.scores.scoring.evaluate_test` (``per_image``), else the means ``{"dice", "hd95", "ece"}`` (empty for
        an empty split). ``stems``, when given, receives each test image's file stem in the arrays' order."""
        if len(self.test_ds) == 0:
            return {}
        proto = self.test_protocol
        scores = evaluate_test(
            model,
            self.test_loader,
            self.device,
            self.num_classes,
            self.prob_fn,
            self.keep_largest_component,
            regions=fdata.get_task(self.task_name).eval_regions or None,
            letterbox=self.resize == "letterbox" and proto.resolution == "stored",
            connectivity=proto.connectivity,
            empty_prediction=proto.empty_prediction,
            observe=_observers((lambda batch, *_: stems.append(image_stem(batch) or "?")) if stems is not None
                               else None, observe),
        )
        return scores if per_image else {k: float(v.mean()) for k, v in scores.items()}

    def test(self, received: FLModel) -> FLModel:
        """Test scores of the received model: mean Dice/HD95/ECE over the site's test images.

        Tasks with ``eval_regions`` (fundus) report ``dice_<region>``/``hd95_<region>`` per region
        and ``dice``/``hd95`` as the mean over regions; other multi-class tasks report per-class
        columns. A site with an empty test split returns no metrics (left out of the table).
        """
        if len(self.test_ds) == 0:
            self.warn(f"site {self.site!r}: the test split is empty; no test scores to report")
            return FLModel(metrics={}, meta={FedUQMetaKey.SITE: self.site})
        # the global model's scores, or under the name the server gave another tested model (a personalised one)
        per_image_file = per_image_test_path(self.state_path.parent, (received.meta or {}).get(FedUQMetaKey.TEST_RESULTS))
        model = self._load_eval_model(received)
        regions = fdata.get_task(self.task_name).eval_regions
        stems: list[str] = []
        cases = (CaseCollector(regions, self.keep_largest_component, self.test_protocol.connectivity,
                               self.resize == "letterbox") if fdata.get_task(self.task_name).kind == "3d" else None)
        scores = self._test_scores(model, per_image=True, stems=stems, observe=cases)
        shown = regions
        if self.annotated is not None and cases is None:  # partial labels: scored on what this site annotates
            columns, keep = scored_columns(self.class_names, regions, self.annotated)
            scores = {**scores, "dice": scores["dice"][:, keep], "hd95": scores["hd95"][:, keep]}
            shown = {name: columns[name] for i, name in enumerate(columns) if i in keep}
        metrics = summarize_test_scores(scores, self.class_names, shown)  # dice, hd95, ece, num_images, per column
        # per image, in the split's order: Dice (mean over foreground classes or regions) and HD95 in stored pixels;
        # it stays on the site (feduq compare pairs these, the model as this site tested it)
        columns = list(shown) if shown else list(self.class_names[1:])  # per structure where there are several
        write_rows(per_image_file, per_image_test_rows(self.site, stems, scores, columns))
        if cases is not None:  # a volume site's table row is per case: Dice per case, HD95 in mm (volumes stay here)
            metrics, rows, units = volume_site_results(cases, scores["ece"], self.class_names, regions, self.site,
                                                       self.annotated)
            write_rows(per_image_file.with_name(PER_CASE_TEST_FILE), rows)
            write_rows(per_image_file, units)  # the paired tests' unit is the case (feduq compare reads this)
        if self.trainer.privacy is not None:  # the budget this site's training spent
            metrics["dp_epsilon"] = self.trainer.privacy.epsilon
        self.log("FEDUQ_TEST " + json.dumps({"site": self.site, **metrics}))
        self._log_test_local()
        if self.save_maps > 0:  # site-local output: maps show the site's images and never leave it
            summary = save_uncertainty_maps(
                model,
                self.test_loader,
                self.device,
                self.prob_fn,
                self.uncertainty_fn(),
                self.state_path.parent / "uncertainty_maps",
                self.save_maps,
                letterbox=self.resize == "letterbox",
                title=f"{self.site} {type(self).__name__}",
            )
            self.log(f"uncertainty maps of up to {self.save_maps} test images written to {summary.parent}")
        return FLModel(metrics=metrics, meta={FedUQMetaKey.SITE: self.site})

    def submit_model(self, received: FLModel) -> FLModel:
        """This site's local model (all but the local entries)."""
        return FLModel(params=self._shared_params(), params_type=ParamsType.FULL)


def _observers(*hooks):
    """One ``observe`` hook of :func:`feduq.scores.scoring.evaluate_test` calling each given hook (None: none)."""
    hooks = [h for h in hooks if h is not None]
    if not hooks:
        return None
    return lambda *args: [h(*args) for h in hooks] and None
