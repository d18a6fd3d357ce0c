"""FedUQ's one round loop on FLARE's ModelController API; the method is a FLARE-free server part.

:class:`FedUQController` owns everything every method shares: the start-up job check, loading the global
model and resuming after the checkpointed round, the round events, the ``train`` exchange under the quorum
rule (:mod:`feduq.flare.quorum`), accepting and rejecting updates, FLARE's aggregation events, the
``FEDUQ_AGGREGATION`` record, checkpointing the model with the method's state, and memory clean-up. What
differs between methods is a :class:`feduq.parts.server.ServerPart` (its payloads, checks, fusion, extra
exchanges and state), so a new method's server side is that class and nothing here: its job names this
controller and its ``server_part``, as FLARE's own FedCE controller plugs one piece into the stock workflow
(FedEvi: ``{"server_part": "feduq.methods.fedevi.FedEviServer", "delta": 1.0, ...}``; FedAvg: none).
"""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np

from nvflare.apis.analytix import ANALYTIC_EVENT_TYPE, AnalyticsDataType
from nvflare.apis.fl_constant import EventScope, FedEventHeader, FLContextKey, ReservedKey
from nvflare.apis.fl_context import FLContext
from nvflare.apis.utils.analytix_utils import create_analytic_dxo
from nvflare.app_common.abstract.fl_model import FLModel, ParamsType
from nvflare.app_common.app_constant import AppConstants
from nvflare.app_common.app_event_type import AppEventType
from nvflare.app_common.workflows.base_fedavg import BaseFedAvg
from nvflare.widgets.info_collector import GroupInfoCollector, InfoCollector

from ..parts.server import Answer, EarlyStopping, ServerPart, Stop, job_server_part, run_rounds, server_part_arguments
from .workflows import QuorumExchange, fail_job


class _Aborted(Exception):
    """FLARE aborted the job (the abort signal): stop quietly, FLARE reports it."""


def _answer(res: FLModel) -> Answer:
    meta = dict(res.meta or {})
    params = {k: np.asarray(v) for k, v in (res.params or {}).items()}
    return Answer(site=meta.get("client_name"), params=params, meta=meta, metrics=dict(res.metrics or {}))


class _FlareFederation:
    """:class:`feduq.parts.server.Federation` over a running :class:`FedUQController`."""

    def __init__(self, ctl: FedUQController):
        self._ctl = ctl

    @property
    def round(self):
        return self._ctl.current_round

    @property
    def num_rounds(self):
        return self._ctl.num_rounds

    @property
    def run_dir(self) -> Path:
        return Path(self._ctl.get_run_dir())

    def send(self, task, payload, sites, *, own=False, timeout="train_timeout", meta=None, quorum=True):
        ctl = self._ctl
        seconds = int(getattr(ctl, timeout))
        r = ctl.current_round
        if own:
            results = ctl._send_own(task, {s: FLModel(params=dict(payload[s]), params_type=ParamsType.FULL,
                                                      current_round=r, total_rounds=ctl.num_rounds, meta=dict(meta or {}))
                                           for s in sites}, seconds, quorum=quorum)
        else:
            data = FLModel(params=dict(payload), params_type=ParamsType.FULL, current_round=r,
                           total_rounds=ctl.num_rounds, meta=dict(meta or {}))
            results = ctl._exchange(task, data, list(sites), seconds, quorum=quorum)
        if ctl._aborted():
            raise _Aborted()
        answers = {}
        for res in results:
            a = _answer(res)
            if a.site not in ctl._failures:
                answers[a.site] = a
        return answers

    def require(self, task, expected, valid, rejected):
        ctl = self._ctl
        if not ctl._quorum_met(task, ctl._required(len(expected)), list(expected), list(valid), dict(rejected)):
            raise _Aborted()  # the job was failed with the reasons; nothing more to do

    @property
    def failures(self) -> dict[str, str]:
        """site -> the error it sent for the last task."""
        return dict(self._ctl._failures)

    def log(self, line: str) -> None:
        self._ctl.info(line)

    def warn(self, line: str) -> None:
        self._ctl.warning(line)


class FedUQController(QuorumExchange, BaseFedAvg):
    """The round every FedUQ method runs (FLARE ModelController API), with the method's server part.

    Per round r (0-based): each training site gets ``train`` with the global model (or its own payload); every
    answer is checked by the server part (names, shapes, NaN/Inf, N_k; a rejection is logged with its reason);
    fewer valid updates than the quorum stops the job with ``FEDUQ_JOB_FAILED`` naming every failed site and why;
    the server part fuses the accepted updates (with any extra exchange it needs) into the new global model,
    which is checkpointed with the round and the method's state, so a resumed job continues after it. A
    round is never aggregated with fewer updates than the quorum, and a failure inside the method's fusion
    leaves the global model as it was.

    The method's server part is ``server`` (code), else built from the job's workflow arguments: the class named by
    ``server_part`` or the controller class's :attr:`SERVER_PART` (FedAvg's when neither), from the arguments its
    :meth:`~feduq.parts.server.ServerPart.from_job` names; the task timeouts it declares (``timeout_args``, e.g.
    FedEvi's ``surrogate_timeout``) are this controller's. So a method's job names this class and its server part,
    and no method has a controller class of its own.

    Args:
        server: the method's server part, made by code (CT's controllers); None: built as above.
        server_part: dotted path of the method's :class:`feduq.parts.server.ServerPart` class (e.g.
            ``"feduq.methods.graphfedseg.GraphFedSegServer"``); None: :attr:`SERVER_PART`.
        num_rounds, persistor_id: as FLARE's BaseFedAvg (``num_rounds`` None: :attr:`DEFAULT_ROUNDS`).
        min_clients: valid answers each task needs; None requires every (training) site. With a value, the
            workflow waits for every live site until the task's timeout and goes on with whoever answered.
        train_timeout: seconds to wait for ``train`` (0 = no limit); a method's extra exchanges name their own
            timeout argument (:attr:`timeout_args`).
        aggregator_id: accepted for jobs written before FedUQ's one controller; unused.
        patience, key_metric, min_delta: early stopping (:class:`feduq.parts.server.EarlyStopping`): stop when the
            global model's ``key_metric`` (``val_dice`` or ``val_loss``) has not improved by more than ``min_delta``
            for ``patience`` rounds; ``patience`` None: never.
        **kwargs: the server part's arguments and timeouts, then FLARE's BaseFedAvg's.

    Raises:
        ValueError: ``server_part`` does not name a server part, a server argument out of range, or ``min_clients``
            below what the method needs.
    """

    #: the method's server part class (None: FedAvg's, :class:`feduq.parts.server.ServerPart`)
    SERVER_PART: type | None = None
    #: ``num_rounds`` when the job gives none (the method's paper)
    DEFAULT_ROUNDS = 200
    timeout_args = ("train_timeout",)

    def __init__(self, *, server: ServerPart | None = None, server_part: str | None = None, num_rounds: int | None = None,
                 persistor_id: str = "persistor", min_clients: int | None = None, train_timeout: int = 0,
                 aggregator_id: str = "aggregator", patience: int | None = None, key_metric: str = "val_dice",
                 min_delta: float = 0.0, **kwargs):
        timeouts = {}
        if server is None:  # the job's server part, from the workflow arguments it names
            part_class = job_server_part(type(self), server_part, default=ServerPart)
            names = server_part_arguments(part_class)
            timeouts = {k: kwargs.pop(k, 0) for k in part_class.timeout_args if k != "train_timeout"}
            server = part_class.from_job(**{k: kwargs.pop(k) for k in list(kwargs) if k in names})
        num_rounds = self.DEFAULT_ROUNDS if num_rounds is None else num_rounds
        # FLARE never panics on a site's error by itself: this workflow applies the quorum, with reasons
        kwargs.setdefault("ignore_result_error", True)
        kwargs.setdefault("memory_gc_rounds", 1)  # gc + malloc_trim after every round (FLARE's cleanup_memory)
        super().__init__(num_rounds=num_rounds, persistor_id=persistor_id, **kwargs)
        if min_clients is not None and int(min_clients) < max(server.min_sites, 1):
            raise ValueError(f"{type(self).__name__}: min_clients must be >= {max(server.min_sites, 1)} or None, "
                             f"got {min_clients!r}" + (" (K = 1 has no graph)" if server.min_sites > 1 else ""))
        self.server, self.min_clients, self.train_timeout = server, min_clients, train_timeout
        self.aggregator_id = aggregator_id
        # ValueError when out of range
        self.stopping = None if patience is None else EarlyStopping(patience, key_metric, min_delta)
        for name, seconds in timeouts.items():  # the method's extra task timeouts (FedEvi's surrogate_timeout)
            setattr(self, name, seconds)
        self._failures: dict[str, str] = {}
        self._aggregations: list[dict] = []  # the FEDUQ_AGGREGATION records so far, for FLARE's show_stats

    def handle_event(self, event_type: str, fl_ctx: FLContext) -> None:
        """FLARE's ``show_stats`` (admin console, ``Session.show_stats``): group ``feduq`` with ``num_rounds``, the
        current ``round`` and ``aggregation``, every round's ``{"round", "weights"}`` so far (how ``feduq.run --env
        prod`` prints its round lines without the server's log)."""
        super().handle_event(event_type, fl_ctx)
        if event_type == InfoCollector.EVENT_TYPE_GET_STATS:
            collector = fl_ctx.get_prop(InfoCollector.CTX_KEY_STATS_COLLECTOR, None)
            if isinstance(collector, GroupInfoCollector):
                collector.add_info("feduq", {"num_rounds": self.num_rounds, "round": self.current_round,
                                             "aggregation": list(self._aggregations)})

    def _sites(self) -> list[str]:
        return [c.name for c in self.engine.get_clients()]

    def run(self) -> None:
        start = self._start_run()
        if start is None:
            return
        model, first = start
        try:
            self._rounds(model, first)
        except Stop as e:
            fail_job(self, self.fl_ctx, e.reason, e.sites)
        except _Aborted:
            return
        except Exception as e:  # a fault in the method's server part: a named failure, never a silent one
            self.exception(f"{self.server.label}: round {self.current_round}: {type(e).__name__}: {e}")
            fail_job(self, self.fl_ctx, f"{self.server.label}: round {self.current_round}: {type(e).__name__}: {e}")

    def _rounds(self, model: FLModel, first: int) -> None:
        server, name = self.server, self.server.label
        sites = self._sites()
        train_sites = server.training_sites(sites)
        fed = _FlareFederation(self)
        model.params = {k: np.asarray(v) for k, v in model.params.items()}
        state = model.meta.get(server.state_key) if server.state_key else None
        server.start(fed, model.params, train_sites, state)
        if self.stopping is not None:
            self.stopping.restore(model.meta.get(EarlyStopping.STATE_KEY))
        if first > self.start_round:
            self.info(f"resuming {name} at round {first}" + (f" with {server.state_key} {state}" if state else ""))

        def round_started(r: int) -> None:
            self.current_round = r
            self.info(f"{name} round {r} started")
            model.current_round = r
            self.fl_ctx.set_prop(AppConstants.CURRENT_ROUND, r, private=True, sticky=False)
            self.event(AppEventType.ROUND_STARTED)

        def commit(r: int, fused: dict, accepted: dict) -> dict:
            nonlocal model
            results = [FLModel(params=a.params, params_type=ParamsType.FULL, current_round=r, meta=a.meta)
                       for a in accepted.values()]
            aggr = self.aggregate(results, aggregate_fn=lambda _res: FLModel(
                params=fused, params_type=ParamsType.FULL, meta={"nr_aggregated": len(accepted)}))
            model = self.update_model(model, aggr)
            return model.params

        def save(r: int, params: dict, meta: dict) -> None:
            model.params, model.meta = params, {**(model.meta or {}), **meta}
            self.save_model(model)
            self._maybe_cleanup_memory()

        run_rounds(server, fed, model.params, sites, first, round_started=round_started, commit=commit, save=save,
                   aggregated=self._aggregated, stopping=self.stopping)
        self.current_round = None

    def _aggregated(self, r: int, weights: dict[str, float]) -> None:
        """Round r's aggregation weights to ``show_stats`` (:meth:`handle_event`) and the job's experiment tracking (FLARE's TensorBoard, MLflow or W&B
        receivers on the server): each site's weight as its own record ``aggregation_weight`` at step r, delivered as
        the site's records are (a federation-scoped ``fed.analytix_log_stats`` event whose origin is the site), so it
        lands in the site's run beside the numbers the site streams itself. Without a receiver nothing listens."""
        self._aggregations.append({"round": int(r), "weights": {s: round(float(w), 6) for s, w in weights.items()}})
        for site, weight in sorted(weights.items()):
            shareable = create_analytic_dxo("aggregation_weight", float(weight), AnalyticsDataType.SCALAR,
                                            global_step=int(r)).to_shareable()
            shareable.set_peer_props({ReservedKey.IDENTITY_NAME: site})
            # an incoming event, as FLARE's FedEventRunner marks what it received: its server runner does not send it
            # on to every site (an "out" event went to each site every round, and a site whose task process had ended
            # logged "No callback is registered for aux_communication/fed.event" for each)
            shareable.set_header(FedEventHeader.DIRECTION, "in")
            with self.engine.new_context() as ctx:
                ctx.set_prop(FLContextKey.EVENT_DATA, shareable, private=True, sticky=False)
                ctx.set_prop(FLContextKey.EVENT_SCOPE, EventScope.FEDERATION, private=True, sticky=False)
                self.engine.fire_event(f"fed.{ANALYTIC_EVENT_TYPE}", ctx)  # as FLARE delivers a site's event

    def _send_own(self, task_name: str, payloads: dict[str, FLModel], timeout: int, quorum: bool = True) -> list[FLModel]:
        """Send every site its own payload (non-blocking) and wait for all answers (or the timeout). With ``quorum``,
        the job stops as soon as too many sites failed for the quorum (as :meth:`_exchange`); the answers are checked
        against it afterwards too (:meth:`_FlareFederation.require`)."""
        self._failures, self._quorum_lost = {}, False
        self._task_quorum = (task_name, len(payloads), self._required(len(payloads))) if quorum else (None, 0, 0)
        results: list[FLModel] = []

        def send_all() -> list[FLModel]:
            for site, data in payloads.items():
                self.send_model(task_name=task_name, data=data, targets=[site], timeout=timeout,
                                callback=results.append)
            while self.get_num_standing_tasks() and not self._aborted():
                time.sleep(0.2)
            return results

        return self._watched(send_all, list(payloads))  # a site whose process is gone is named (feduq.flare.liveness)
