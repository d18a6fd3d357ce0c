"""FedUQ client executors: one shared executor, one thin subclass per method.

:class:`FedUQExecutor` maps FLARE tasks onto the shared core (:mod:`feduq.engine`): it builds the
site's datasets, network and optimiser once per run (so Adam state and the LR schedule persist
across rounds), validates every received global model on the site's validation split, trains, and
evaluates on the site's test split when the server asks. A method subclass overrides only its
loss, its probability map, and the statistics or extra tasks it needs.

Where a site's data lives is the site's business, never the job's: the data root comes from the
site-local file ``<site workspace>/local/feduq_site.json`` (``{"data_root": ..., "center": ...}``)
or, failing that, the environment variable ``FEDUQ_DATA_ROOT``. A site reads only
``<data_root>/<task>/<center>/``.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from monai.data import DataLoader
from monai.losses import DiceCELoss

from nvflare.apis.event_type import EventType
from nvflare.apis.executor import Executor
from nvflare.apis.fl_constant import FLMetaKey, ReturnCode
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import Shareable, make_reply
from nvflare.apis.signal import Signal
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from nvflare.app_common.utils.fl_model_utils import FLModelUtils

from .. import data as fdata
from ..constants import FedUQMetaKey, FedUQMetric, FedUQTask
from ..engine import (
    LocalTrainer,
    per_image_statistics,
    resolve_device,
    softmax_probs,
    evaluate_test,
    validation_dice,
)
from ..evidential import FedEviLoss, dirichlet_from_logits, image_uncertainty_means
from ..networks import SegUNet

SITE_CONFIG_FILE = "feduq_site.json"
CLIENT_STATE_FILE = "feduq_client_state.pt"  # optimizer + scheduler state, in the site's run folder


def read_site_config(fl_ctx: FLContext) -> dict:
    """The site-local FedUQ settings (``local/feduq_site.json`` in the site workspace), or ``{}``.

    Raises:
        ValueError: the file exists but is not a JSON object (message names the file).
    """
    local_dir = fl_ctx.get_engine().get_workspace().get_site_config_dir()
    path = Path(local_dir) / SITE_CONFIG_FILE
    if not path.is_file():
        return {}
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"site-local FedUQ config {path} is not valid JSON: {e}") from e
    if not isinstance(cfg, dict):
        raise ValueError(f"site-local FedUQ config {path} must be a JSON object")
    return cfg


class FedUQExecutor(Executor):
    """Shared FLARE executor for 2D segmentation clients (FedAvg behaviour by default).

    Tasks handled: ``train`` (validate the received global model, train ``local_epochs``, send
    θ_k with N_k), ``validate`` (validation Dice of the received model), ``test`` (per-site test
    Dice/HD95/ECE of the received model), ``submit_model`` (the local model).

    Args:
        task: FedUQ task name (see :data:`feduq.data.TASKS`), e.g. ``"polyp"``.
        image_size: training/inference side length in pixels (384 as the papers; 128 on CPU).
        batch_size: training batch size (validation and test use 1).
        local_epochs: local epochs E per round.
        lr, betas, weight_decay, lr_gamma: Adam and per-round ExponentialLR settings.
        network: extra keyword arguments for :class:`feduq.networks.SegUNet`.
        keep_largest_component: test-time post-processing (FedEvi evaluation).
        max_items: use only the first N items of each split (smoke tests); None = all.
        seed: torch seed for initialisation-independent randomness (shuffling, flips).
        device: ``"auto"`` (CUDA if available, else CPU), ``"cpu"``, ``"cuda:0"``, ...
        num_threads: torch CPU threads (0 = torch default).
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
        max_items: int | None = None,
        seed: int = 0,
        device: str = "auto",
        num_threads: int = 0,
    ):
        super().__init__()
        self.task_name = task
        self.image_size = int(image_size)
        self.batch_size = int(batch_size)
        self.local_epochs = int(local_epochs)
        self.optim_args = dict(lr=lr, betas=tuple(betas), weight_decay=weight_decay, lr_gamma=lr_gamma)
        self.network_args = dict(network or {})
        self.keep_largest_component = keep_largest_component
        self.max_items = max_items
        self.seed = int(seed)
        self.device_name = device
        self.num_threads = int(num_threads)
        self.site = "?"
        self.trainer: LocalTrainer | None = None
        self._setup_error: str | None = None

    # -- method hooks (override in a method subclass) ------------------------------------------
    def build_loss(self) -> Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]:
        """``(logits, label, round_index) -> loss``. FedAvg: MONAI Dice + CE (both over all classes)."""
        loss = DiceCELoss(to_onehot_y=True, softmax=True)
        return lambda logits, label, round_index: loss(logits, label)

    def prob_fn(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, C, H, W]`` -> class probabilities (softmax; evidential methods use α/S)."""
        return softmax_probs(logits)

    def extra_train_meta(self, round_index: int) -> dict:
        """Method statistics sent with θ_k after local training (none for FedAvg)."""
        return {}

    def extra_tasks(self) -> dict[str, Callable[[FLModel, FLContext], FLModel]]:
        """Additional task handlers ``task_name -> handler(received FLModel, fl_ctx) -> FLModel``."""
        return {}

    # -- setup -----------------------------------------------------------------------------------
    def handle_event(self, event_type: str, fl_ctx: FLContext):
        if event_type == EventType.START_RUN:
            self.site = fl_ctx.get_identity_name()
            try:
                self._setup(fl_ctx)
            except Exception as e:  # a clear, site-named error instead of a crash deep in a worker
                self._setup_error = str(e) if str(e).startswith(f"site {self.site!r}") else f"site {self.site!r}: {e}"
                self.log_error(fl_ctx, f"FedUQ setup failed: {self._setup_error}")
                self.system_panic(f"FedUQ setup failed: {self._setup_error}", fl_ctx)

    def _setup(self, fl_ctx: FLContext) -> None:
        cfg = read_site_config(fl_ctx)
        self.center = cfg.get("center", self.site)
        spec = fdata.get_task(self.task_name)
        if self.center not in spec.centers:
            raise fdata.DataError(
                f"site {self.site!r} is not a center of task {self.task_name!r} (centers: {list(spec.centers)}); "
                f"name the site after its center or set \"center\" in local/{SITE_CONFIG_FILE}"
            )
        data_root = fdata.resolve_data_root(cfg.get("data_root"), site=self.site)
        if self.num_threads > 0:
            torch.set_num_threads(self.num_threads)
        torch.manual_seed(self.seed)
        self.num_classes = len(spec.class_names)
        self.class_names = spec.class_names
        common = dict(data_root=data_root, image_size=self.image_size, max_items=self.max_items)
        self.train_ds = fdata.get_dataset(self.task_name, self.center, "train", **common)
        self.val_ds = fdata.get_dataset(self.task_name, self.center, "val", **common)
        self.test_ds = fdata.get_dataset(self.task_name, self.center, "test", **common)
        if len(self.train_ds) == 0 or len(self.val_ds) == 0:
            raise fdata.DataError(f"site {self.site!r}: the training and validation splits must not be empty")
        self.train_loader = DataLoader(
            self.train_ds,
            batch_size=self.batch_size,
            shuffle=True,
            drop_last=len(self.train_ds) > self.batch_size,
            generator=torch.Generator().manual_seed(self.seed),
        )
        self.val_loader = DataLoader(self.val_ds, batch_size=1)
        self.test_loader = DataLoader(self.test_ds, batch_size=1)
        self.device = resolve_device(self.device_name)
        model = SegUNet(in_channels=spec.in_channels, out_channels=self.num_classes, **self.network_args)
        self.trainer = LocalTrainer(model, self.device, **self.optim_args)
        self.eval_model = copy.deepcopy(self.trainer.model)  # scratch copy for models that are not ours
        self.loss = self.build_loss()
        job_id = fl_ctx.get_job_id()
        self.state_path = Path(fl_ctx.get_engine().get_workspace().get_run_dir(job_id)) / CLIENT_STATE_FILE
        if self.state_path.is_file():  # this site's process was restarted within the job
            state = torch.load(self.state_path, map_location=self.device, weights_only=False)
            self.trainer.load_state(state)
            self.log_info(fl_ctx, f"restored optimizer/scheduler state of round {state.get('round')}")
        self.log_info(
            fl_ctx,
            f"site {self.site!r} center {self.center!r}: train/val/test = "
            f"{len(self.train_ds)}/{len(self.val_ds)}/{len(self.test_ds)} images at {self.image_size}px "
            f"from {data_root / self.task_name / self.center}, device {self.device}",
        )

    # -- task dispatch ---------------------------------------------------------------------------
    def execute(self, task_name: str, shareable: Shareable, fl_ctx: FLContext, abort_signal: Signal) -> Shareable:
        handlers = {
            FedUQTask.TRAIN: self.train,
            FedUQTask.VALIDATE: self.validate,
            FedUQTask.TEST: self.test,
            FedUQTask.SUBMIT_MODEL: self.submit_model,
            **self.extra_tasks(),
        }
        if task_name not in handlers:
            self.log_error(fl_ctx, f"site {self.site!r}: unknown task {task_name!r} (known: {sorted(handlers)})")
            return make_reply(ReturnCode.TASK_UNKNOWN)
        if self.trainer is None:
            self.log_error(fl_ctx, f"cannot run task {task_name!r}: {self._setup_error or 'executor not set up'}")
            return make_reply(ReturnCode.EXECUTION_EXCEPTION)
        try:
            received = FLModelUtils.from_shareable(shareable)
            result = handlers[task_name](received, fl_ctx)
            if abort_signal.triggered:
                return make_reply(ReturnCode.TASK_ABORTED)
            return FLModelUtils.to_shareable(result)
        except Exception as e:
            self.log_exception(fl_ctx, f"site {self.site!r}: task {task_name!r} failed: {e}")
            return make_reply(ReturnCode.EXECUTION_EXCEPTION)

    def _load_eval_model(self, received: FLModel) -> torch.nn.Module:
        """Load received parameters into the scratch model (the local model stays untouched)."""
        self.eval_model.load_state_dict(self.trainer.model.state_dict())
        model = self.eval_model
        state = model.state_dict()
        with torch.no_grad():
            for name, value in received.params.items():
                if name not in state:
                    raise ValueError(f"received parameter {name!r} is unknown to the local model")
                state[name].copy_(torch.as_tensor(np.asarray(value)).to(state[name].dtype))
        return model.eval()

    # -- tasks -----------------------------------------------------------------------------------
    def train(self, received: FLModel, fl_ctx: FLContext) -> FLModel:
        round_index = int(received.current_round or 0)
        self.trainer.set_params(received.params, strict=True)
        val_dice = validation_dice(self.trainer.model, self.val_loader, self.device, self.num_classes)
        stats = self.trainer.train_epochs(
            self.train_loader, self.local_epochs, lambda lo, la: self.loss(lo, la, round_index + 1)
        )
        torch.save({**self.trainer.state(), "round": round_index}, self.state_path)
        meta = {
            FedUQMetaKey.NUM_SAMPLES: len(self.train_ds),
            FedUQMetaKey.NUM_VAL_SAMPLES: len(self.val_ds),
            FLMetaKey.NUM_STEPS_CURRENT_ROUND: len(self.train_ds),
            **self.extra_train_meta(round_index),
        }
        record = {
            "site": self.site,
            "round": round_index,
            "val_dice_global": round(val_dice, 5),
            "train_loss": round(stats.mean_loss, 5),
            "steps": stats.num_steps,
            "train_seconds": round(stats.seconds, 3),
            **{k: (round(v, 6) if isinstance(v, float) else v) for k, v in meta.items()},
        }
        self.log_info(fl_ctx, "FEDUQ_TRAIN " + json.dumps(record))
        return FLModel(
            params=self.trainer.get_params(),
            params_type=ParamsType.FULL,
            metrics={FedUQMetric.VAL_DICE: val_dice, FedUQMetric.TRAIN_LOSS: stats.mean_loss},
            meta=meta,
        )

    def validate(self, received: FLModel, fl_ctx: FLContext) -> FLModel:
        model = self._load_eval_model(received)
        val_dice = validation_dice(model, self.val_loader, self.device, self.num_classes)
        return FLModel(metrics={FedUQMetric.VAL_DICE: val_dice}, meta={FedUQMetaKey.NUM_VAL_SAMPLES: len(self.val_ds)})

    def test(self, received: FLModel, fl_ctx: FLContext) -> FLModel:
        model = self._load_eval_model(received)
        scores = evaluate_test(
            model, self.test_loader, self.device, self.num_classes, self.prob_fn, self.keep_largest_component
        )
        metrics = {
            FedUQMetric.DICE: float(scores["dice"].mean()),
            FedUQMetric.HD95: float(scores["hd95"].mean()),
            "ece": float(scores["ece"].mean()),
            "num_images": int(scores["dice"].shape[0]),
        }
        if self.num_classes > 2:  # per-class columns (e.g. fundus disc and cup)
            for c, name in enumerate(self.class_names[1:]):
                metrics[f"dice_{name}"] = float(scores["dice"][:, c].mean())
                metrics[f"hd95_{name}"] = float(scores["hd95"][:, c].mean())
        self.log_info(fl_ctx, "FEDUQ_TEST " + json.dumps({"site": self.site, **metrics}))
        return FLModel(metrics=metrics, meta={FedUQMetaKey.SITE: self.site})

    def submit_model(self, received: FLModel, fl_ctx: FLContext) -> FLModel:
        return FLModel(params=self.trainer.get_params(), params_type=ParamsType.FULL)


class FedAvgExecutor(FedUQExecutor):
    """FedAvg client (McMahan et al. 2017): Dice + CE loss, sends θ_k and N_k."""


class FedEviExecutor(FedUQExecutor):
    """FedEvi client (Chen et al., MICCAI 2024): evidential training plus the two statistics.

    After local training the site sends A_k = mean over its validation images of U_ale under θ_k
    (and R_k = mean of 1/U_ale, for the paper's form of the reliability term); in the same round it
    answers ``validate_surrogate`` with G_k = mean U_epi of the surrogate model θ̂ on its validation
    images (FedEvi Eq. 5-8, methods.md §1.4-1.5).

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

    def build_loss(self):
        return FedEviLoss(
            kl_weight=self.kl_weight,
            annealing_step=self.annealing_step,
            dice_variant=self.dice_variant,
            clamp_max=self.clamp_max,
        )

    def prob_fn(self, logits: torch.Tensor) -> torch.Tensor:
        return dirichlet_from_logits(logits, clamp_max=self.clamp_max).prob

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
        g = float(self._uncertainty(self._load_eval_model(received))["epistemic"].mean())
        self.log_info(
            fl_ctx,
            "FEDEVI_SURROGATE " + json.dumps({"site": self.site, "round": received.current_round, "u_epi": g}),
        )
        return FLModel(metrics={"u_epi": g}, meta={FedUQMetaKey.MEAN_EPISTEMIC: g})
