"""Global model selection whose best-so-far survives a resumed job.

FLARE's :class:`IntimeModelSelector` keeps the best validation metric in memory only, so a job
resumed from a checkpoint (``feduq resume``) would start the record again: the first resumed
round would become "best" even when it validates worse than a model of the interrupted run, and the
final test would score that model. :class:`BestModelSelector` writes every new best to a small JSON
record beside the checkpoints and, when resumed, restores the record and the best checkpoint.
"""

from __future__ import annotations

import json
import math
import os
import shutil
from pathlib import Path

from nvflare.apis.event_type import EventType
from nvflare.apis.fl_constant import FLContextKey
from nvflare.apis.fl_context import FLContext
from nvflare.apis.shareable import ReturnCode
from nvflare.app_common.app_constant import AppConstants
from nvflare.app_common.app_event_type import AppEventType
from nvflare.app_common.widgets.intime_model_selector import IntimeModelSelector

SELECTION_RECORD = "best_model_selection.json"


class BestModelSelector(IntimeModelSelector):
    """:class:`IntimeModelSelector` plus a persistent record of the best global model.

    On every new best (FLARE's ``GLOBAL_BEST_MODEL_AVAILABLE``) it writes
    ``<app_server>/best_model_selection.json``: ``{"round": int, "metric": float, "raw_metric": float,
    "key_metric": str}`` (``metric`` is the value compared, negated when ``negate_key_metric``).

    Args:
        resume_from: folder of the interrupted run's checkpoints (its ``app_server``; a path on the
            server, set by ``feduq resume``). When it holds a record and the best checkpoint,
            the record sets the bar for this run and the checkpoint is copied to this run's
            ``best_model_file``, so a resumed round replaces it only if it validates better. Missing
            files are logged as a warning and selection starts afresh.
        best_model_file: the persistor's best-checkpoint file name.
        **kwargs: :class:`IntimeModelSelector` arguments (``key_metric``, ``negate_key_metric``, ...).
    """

    def __init__(self, resume_from: str | None = None, best_model_file: str = "best_FL_global_model.pt", **kwargs):
        super().__init__(**kwargs)
        self.resume_from = resume_from
        self.best_model_file = best_model_file
        self.best_round: int | None = None

    def handle_event(self, event_type: str, fl_ctx: FLContext):
        super().handle_event(event_type, fl_ctx)
        if event_type == EventType.START_RUN and self.resume_from:
            self.restore(Path(fl_ctx.get_prop(FLContextKey.APP_ROOT)), fl_ctx)
        elif event_type == AppEventType.GLOBAL_BEST_MODEL_AVAILABLE:
            self.best_round = fl_ctx.get_prop(AppConstants.CURRENT_ROUND)
            self.write_record(Path(fl_ctx.get_prop(FLContextKey.APP_ROOT)))

    def offer(self, raw_metric: float, fl_ctx: FLContext) -> bool:
        """A global model validated outside FLARE's per-round accumulation (the last model, validated after the final
        round by :class:`feduq.flare.workflows.FinalTestEvaluation`): when ``raw_metric`` (the mean over sites of
        ``key_metric``, negated here when ``negate_key_metric``) beats the best so far it becomes the best, and FLARE's
        ``GLOBAL_BEST_MODEL_AVAILABLE`` is fired with ``fl_ctx`` (which must carry ``CURRENT_ROUND`` and
        ``GLOBAL_MODEL``): the persistor saves the model as the best, this selector writes its record.

        Returns:
            True when the model became the best.
        """
        value = -float(raw_metric) if self.negate_key_metric else float(raw_metric)
        if not value > self.best_val_metric:
            return False
        self.best_val_metric, self.best_raw_val_metric = value, float(raw_metric)
        fl_ctx.set_prop(AppConstants.VALIDATION_RESULT, self.best_val_metric, private=True, sticky=False)
        self.fire_event(AppEventType.GLOBAL_BEST_MODEL_AVAILABLE, fl_ctx)
        return True

    def _before_accept(self, fl_ctx: FLContext):
        """Skip a site's error reply quietly: the workflow already reports the failed site in one line (FLARE's
        selector would log a traceback for every reply that carries no model)."""
        shareable = fl_ctx.get_peer_context().get_prop(FLContextKey.SHAREABLE)
        if shareable is None or shareable.get_return_code(ReturnCode.OK) != ReturnCode.OK:
            return False
        return super()._before_accept(fl_ctx)

    def write_record(self, app_root: Path) -> Path:
        """Write the current best (round and metric) to ``app_root/best_model_selection.json``."""
        record = {
            "round": self.best_round,
            "metric": float(self.best_val_metric),
            "raw_metric": None if self.best_raw_val_metric is None else float(self.best_raw_val_metric),
            "key_metric": self.key_metric,
        }
        path = app_root / SELECTION_RECORD
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(record) + "\n")
        os.replace(tmp, path)
        return path

    def restore(self, app_root: Path, fl_ctx: FLContext | None = None) -> bool:
        """Take over the interrupted run's best record and checkpoint from ``resume_from``.

        Returns:
            True when both were found and restored; False (with a warning) otherwise.

        Raises:
            ValueError: the record is for another key metric, or its metric is not a finite number.
        """
        source = Path(self.resume_from)
        record_path, model_path = source / SELECTION_RECORD, source / self.best_model_file
        if not record_path.is_file() or not model_path.is_file():
            self._warn(fl_ctx, f"resume_from={source}: no {SELECTION_RECORD} and {self.best_model_file} there; "
                               "best-model selection starts afresh")
            return False
        record = json.loads(record_path.read_text())
        if record.get("key_metric") != self.key_metric:
            raise ValueError(f"{record_path}: best model was selected on key_metric={record.get('key_metric')!r}, "
                             f"this job selects on {self.key_metric!r}")
        metric = record.get("metric")
        if not isinstance(metric, (int, float)) or not math.isfinite(metric):
            raise ValueError(f"{record_path}: metric must be a finite number, got {metric!r}")
        app_root.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(model_path, app_root / self.best_model_file)
        self.best_val_metric, self.best_raw_val_metric = float(metric), record.get("raw_metric")
        self.best_round = record.get("round")
        self.write_record(app_root)
        message = (f"restored best global model of round {self.best_round} ({self.key_metric} {metric:.6f}) "
                   f"from {source}")
        if fl_ctx is not None:
            self.log_info(fl_ctx, message)
        return True

    def _warn(self, fl_ctx: FLContext | None, message: str) -> None:
        if fl_ctx is not None:
            self.log_warning(fl_ctx, message)
        else:
            self.logger.warning(message)
