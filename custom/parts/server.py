"""The server part of a method: what FedUQ's one round loop asks of it (FLARE-free).

FedUQ's controller (:class:`feduq.flare.controller.FedUQController`) owns the round: start and resume, the
``train`` exchange, accepting updates, the quorum, checkpointing and the logs every method shares. A method
gives it a :class:`ServerPart`, which decides only what differs between methods:

============================  ==============================================================================
:meth:`ServerPart.start`      restore the method's state from the checkpoint; check the job (e.g. K >= 2)
:meth:`ServerPart.payload`    what each site receives for ``train`` (default: the global model)
:meth:`ServerPart.check`      reject an update (ValueError naming the site): names, shapes, NaN, N_k
:meth:`ServerPart.fuse`       the new global model from the accepted updates, with any extra exchange
:meth:`ServerPart.after_round`  an exchange after a round is aggregated (FedA3I's noise estimate)
:meth:`ServerPart.state`      what is checkpointed with the global model (FedEvi's β, GraphFedSeg's W)
:meth:`ServerPart.finish`     after the last round (GraphFedSeg's personalised test, CT's heads and test)
============================  ==============================================================================

Everything a server part needs from the federation comes through a :class:`Federation` (sending a task,
the quorum rule, the log, the run folder), so it runs unchanged under FLARE, in a test's fake federation or
in an in-process simulation. The base class is FedAvg: θ = Σ_k N_k θ_k / Σ_k N_k (McMahan et al. 2017, Eq. 1
of FedAvg's Algorithm 1).
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Mapping, Protocol

import numpy as np

from ..core.aggregation import check_update, normalise_weights, sites_summary, weighted_average
from ..common.wire import FedUQMetaKey, FedUQTask

Params = Mapping[str, np.ndarray]


@dataclass
class Answer:
    """One site's answer to a task.

    Attributes:
        site: the site's name.
        params: parameter name -> numpy array (empty for statistics-only tasks).
        meta: the statistics the site reports (e.g. ``feduq_num_samples`` N_k, FedEvi's A_k).
        metrics: the site's metrics (e.g. validation Dice), as FLARE's ``FLModel.metrics``.
    """

    site: str
    params: dict = field(default_factory=dict)
    meta: dict = field(default_factory=dict)
    metrics: dict = field(default_factory=dict)


class Stop(Exception):
    """The job cannot go on: the controller fails it with ``reason`` (``FEDUQ_JOB_FAILED``, non-zero exit).

    Args:
        reason: one sentence naming the round, task, site or parameter.
        sites: site -> why, for the failure record.
    """

    def __init__(self, reason: str, sites: dict[str, str] | None = None):
        super().__init__(reason)
        self.reason, self.sites = reason, dict(sites or {})


class Federation(Protocol):
    """What a server part may ask of the federation it runs in (FLARE: :class:`feduq.flare.controller.FedUQController`)."""

    round: int | None  #: the current 0-based round (None after the last)
    num_rounds: int
    run_dir: Path  #: where result files go

    def send(self, task: str, payload: Params | Mapping[str, Params], sites: list[str], *, own: bool = False,
             timeout: str = "train_timeout", meta: dict | None = None, quorum: bool = True) -> dict[str, Answer]:
        """Send ``payload`` (one model for all; with ``own``, site -> its own model) to ``sites`` and return the
        answers that came back without error, by site (:attr:`failures` holds the others' errors).
        ``timeout`` names the controller's argument holding the seconds to wait. With ``quorum`` the federation may
        stop the job as soon as too many sites failed for the quorum; ``quorum=False`` leaves the answers to the
        caller (an exchange that tolerates failed sites). When the job is aborted meanwhile, this does not return."""

    @property
    def failures(self) -> dict[str, str]:
        """site -> the error it sent for the last task sent."""

    def require(self, task: str, expected: list[str], valid: list[str], rejected: Mapping[str, str]) -> None:
        """Go on when ``valid`` meets the job's quorum over ``expected`` (``min_clients`` of them, or all; at least
        :attr:`ServerPart.min_sites`); otherwise fail the job naming every other site and why, and do not
        return."""

    def log(self, line: str) -> None: ...

    def warn(self, line: str) -> None: ...


def num_samples(site: str, meta: Mapping) -> float:
    """N_k from an answer's meta.

    Raises:
        ValueError: missing, not a number, not finite or not > 0 (the message names the site).
    """
    value = (meta or {}).get(FedUQMetaKey.NUM_SAMPLES)
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"site {site!r}: n_k = {value!r} (expected a finite number > 0)")
    return float(value)


class ServerPart:
    """A method's server side; this base is FedAvg (weights N_k). Subclasses override what differs.

    Attributes:
        label: the method's name in the server's log lines ("<label> round r started").
        min_sites: fewer sites than this in the job stops it before round 0 (a graph needs K >= 2).
        state_key: the checkpoint meta key :meth:`state` is stored under (None: the method keeps no state).
        timeout_args: the task timeouts (seconds, controller arguments) the method's exchanges use.
    """

    label: str = "FedAvg"
    min_sites: int = 1
    state_key: str | None = None
    timeout_args: tuple[str, ...] = ("train_timeout",)

    @classmethod
    def from_job(cls, **args) -> "ServerPart":
        """The server part from a job's workflow arguments (the ones :func:`server_part_arguments` names); a method
        whose constructor takes something else than flat arguments overrides this (FedEvi: one config)."""
        return cls(**args)

    def training_sites(self, sites: list[str]) -> list[str]:
        """The sites that train (CT: all but the held-out sites)."""
        return list(sites)

    def start(self, fed: Federation, global_params: Params, sites: list[str], state) -> None:
        """Restore from ``state`` (what :meth:`state` returned at the checkpoint; None for a new job).

        Raises:
            Stop: the job cannot run this method (e.g. the network lacks the layers it weights).
        """

    def payload(self, fed: Federation, site: str, global_params: Params) -> Params:
        """What ``site`` receives for ``train`` this round (default: the global model)."""
        return global_params

    def per_site_payloads(self) -> bool:
        """True when :meth:`payload` differs by site this round (the controller then sends each its own)."""
        return False

    def check(self, site: str, answer: Answer, global_params: Params) -> None:
        """Raise ValueError naming ``site`` when its update must not be aggregated: missing, unknown or
        mis-shaped entries, NaN/Inf (:func:`feduq.core.aggregation.check_update`) or a bad N_k."""
        check_update(site, answer.params, global_params)
        num_samples(site, answer.meta)

    def check_round(self, answers: dict[str, Answer]) -> dict[str, str]:
        """Updates to reject because of the round's other updates (each passed :meth:`check`): site -> why."""
        return {}

    def fuse(self, fed: Federation, answers: dict[str, Answer], global_params: Params) -> tuple[dict, dict[str, float]]:
        """The new global model from the accepted answers (every one passed :meth:`check`).

        Returns:
            ``(params, weights)``: the fused state dict (every entry of ``global_params``), and site -> the
            aggregation weight logged in ``FEDUQ_AGGREGATION`` (normalised).

        Raises:
            Stop: the round cannot be fused (e.g. too few sites answered an extra exchange).
            ValueError: the updates cannot be fused (named); the controller fails the job, model unchanged.
        """
        raw = self.weights(fed, answers)
        return weighted_average({s: a.params for s, a in answers.items()}, raw), normalise_weights(raw)

    def weights(self, fed: Federation, answers: dict[str, Answer]) -> dict[str, float]:
        """The sites' raw aggregation weights (FedAvg: N_k); renormalised over the accepted sites."""
        return {s: num_samples(s, a.meta) for s, a in answers.items()}

    def after_round(self, fed: Federation, global_params: Params, sites: list[str]) -> None:
        """Called after round ``fed.round`` was fused, before it is checkpointed."""

    def state(self):
        """JSON-able state checkpointed with the global model under :attr:`state_key` (None: nothing)."""
        return None

    def finish(self, fed: Federation, global_params: Params, sites: list[str]) -> None:
        """Called once after the last round (not after a failure)."""


class LocalEntriesServer(ServerPart):
    """FedAvg when the sites keep some entries of the model local (FedBN's normalisation layers, FedUAA's heads).

    The sites decide what stays local (by module type, on the site), so the server needs no list of names: an update
    is checked against the global model restricted to the entries it carries (an unknown entry, a shape mismatch or
    a NaN/Inf is still rejected), and an update whose entries differ from what most sites sent this round is
    rejected. Only what the sites send is averaged (weights :meth:`ServerPart.weights`); the entries nobody sent
    are carried over unchanged from the global model, so it keeps its full schema.
    """

    def check(self, site, answer, global_params) -> None:
        check_update(site, answer.params, {k: global_params[k] for k in answer.params if k in global_params})
        num_samples(site, answer.meta)

    def check_round(self, answers):
        """The round's schema is the set of entries most sites sent (ties: the first such site's); an update with
        other entries is rejected, so one odd site cannot veto the others."""
        if not answers:
            return {}
        sets = [frozenset(a.params) for a in answers.values()]
        keys = max(sets, key=sets.count)  # max keeps the first of equal counts: deterministic in site order
        return {s: f"site {s!r} sent entries that differ from the other sites' this round: "
                   f"missing={sorted(keys - set(a.params))[:5]} extra={sorted(set(a.params) - keys)[:5]}"
                for s, a in answers.items() if frozenset(a.params) != keys}

    def fuse(self, fed, answers, global_params):
        averaged, weights = super().fuse(fed, answers, global_params)
        kept = [k for k in global_params if k not in averaged]
        if kept:
            fed.log(f"round {fed.round}: {len(kept)} global entries kept unchanged (not sent by the sites)")
        return {**{k: averaged.get(k, global_params[k]) for k in global_params}, **averaged}, weights


class EarlyStopping:
    """Stop training when the global model's validation metric has not improved for ``patience`` rounds.

    Every round's ``train`` answers carry each site's validation of the model it received (the global model of the
    previous round); their mean weighted by the sites' validation images (``feduq_num_val_samples``, as the best-model
    selection weighs them) is observed. The run stops after round r when the best value was observed at a round
    b <= r - patience (``"val_dice"``: higher is better; ``"val_loss"``: lower). Its state is checkpointed with the
    global model (:attr:`STATE_KEY`), so a resumed job stops at the same round.

    Args:
        patience: rounds without improvement before stopping (>= 1).
        key_metric: ``"val_dice"`` or ``"val_loss"``.
        min_delta: an improvement must exceed this (>= 0).

    Raises:
        ValueError: an argument out of range (named).
    """

    STATE_KEY = "feduq_early_stopping"

    def __init__(self, patience: int, key_metric: str = "val_dice", min_delta: float = 0.0):
        if not (isinstance(patience, int) and patience >= 1) or key_metric not in ("val_dice", "val_loss") \
                or not min_delta >= 0:
            raise ValueError(f"early stopping: need patience >= 1, key_metric val_dice or val_loss, min_delta >= 0; "
                             f"got {patience!r}, {key_metric!r}, {min_delta!r}")
        self.patience, self.key_metric, self.min_delta = patience, key_metric, float(min_delta)
        self.best: float | None = None
        self.best_round: int | None = None

    def observe(self, r: int, answers: Mapping[str, Answer]) -> float | None:
        """Record round ``r``'s validation (the mean over ``answers``); None when no answer carries the metric."""
        pairs = [(float(a.metrics[self.key_metric]), float(a.meta.get(FedUQMetaKey.NUM_VAL_SAMPLES, 1) or 1))
                 for a in answers.values() if a.metrics.get(self.key_metric) is not None
                 and math.isfinite(float(a.metrics[self.key_metric]))]
        if not pairs:
            return None
        value = sum(v * w for v, w in pairs) / sum(w for _, w in pairs)
        sign = 1.0 if self.key_metric == "val_dice" else -1.0
        if self.best is None or sign * (value - self.best) > self.min_delta:
            self.best, self.best_round = value, r
        return value

    def should_stop(self, r: int) -> bool:
        return self.best_round is not None and r - self.best_round >= self.patience

    def state(self) -> dict:
        return {"best": self.best, "best_round": self.best_round}

    def restore(self, state: Mapping | None) -> None:
        if state:
            self.best, self.best_round = state.get("best"), state.get("best_round")


def check_sender(site: str, meta) -> None:
    """An update the federation received from ``site`` must have been computed by ``site``: its meta names the site
    that trained it (``feduq_site``, every FedUQ site sends its own name). Under a heavily loaded host FLARE's
    simulator has run one client's task in another client's process, so two answers came from one site's data and
    none from the other's; such an update is rejected (the quorum rule then decides), never averaged.

    Raises:
        ValueError: the meta names another site (both names given).
    """
    sender = (meta or {}).get(FedUQMetaKey.SITE)
    if sender is not None and sender != site:
        raise ValueError(f"site {site!r}: the update was computed by site {sender!r} (FLARE ran that site's task in "
                         f"{site!r}'s place); rejected, so no site's data counts twice")


def run_rounds(server: ServerPart, fed: Federation, params: dict, sites: list[str], first: int, *,
               round_started=None, commit=None, save=None, aggregated=None,
               stopping: EarlyStopping | None = None) -> dict:
    """FedUQ's round loop, the same under FLARE (:class:`feduq.flare.controller.FedUQController`) and in one
    process (``feduq virtual``): rounds ``first .. fed.num_rounds - 1``, then :meth:`ServerPart.finish`.

    Per round r: ``train`` to the training sites (their own payloads when the method sends them); each answer
    through :meth:`ServerPart.check` (a rejection is logged with its reason); the quorum; :meth:`ServerPart.fuse`
    (a ValueError fails the job naming it; the global model stays as it was); the ``FEDUQ_AGGREGATION`` record;
    :meth:`ServerPart.after_round`; ``save(r, params, meta)`` with the method's state under its key.

    Args:
        server: the method's server part, already :meth:`ServerPart.start`-ed.
        fed: the federation; ``fed.round`` must follow the loop (``round_started`` sets it).
        params: the global model, name -> numpy array.
        sites: every site of the job (the training sites are :meth:`ServerPart.training_sites` of them).
        first: the first round to run (after a resume: the round after the checkpointed one).
        round_started: ``f(r)``, called first in each round (sets ``fed.round``, FLARE's round event).
        commit: ``f(r, fused, accepted) -> params``, installs the fused model (FLARE: its aggregation events);
            default: the fused model itself.
        save: ``f(r, params, meta)``, checkpoints round r (meta: the method's state and the round).
        aggregated: ``f(r, weights)`` with site -> normalised aggregation weight, after the ``FEDUQ_AGGREGATION``
            record (FLARE: the weights to the job's experiment tracking).
        stopping: early stopping (:class:`EarlyStopping`, already restored on a resume): after a round whose rule
            says stop, the loop ends there (``FEDUQ_EARLY_STOP``) and :meth:`ServerPart.finish` runs as after the last.

    Returns:
        the final global model.

    Raises:
        Stop: the job must fail (the reason names round, task, sites).
    """
    train_sites = server.training_sites(sites)
    if len(train_sites) < max(server.min_sites, 1):
        raise Stop(f"{server.label} needs at least {max(server.min_sites, 1)} training site(s), the job has {train_sites}")
    for r in range(first, fed.num_rounds):
        if round_started:
            round_started(r)
        own = server.per_site_payloads()
        payload = {s: server.payload(fed, s, params) for s in train_sites} if own else params
        answers = fed.send(FedUQTask.TRAIN, payload, train_sites, own=own)
        accepted, rejected = {}, {}
        for site in train_sites:
            if site not in answers:
                continue
            try:
                check_sender(site, answers[site].meta)
                server.check(site, answers[site], params)
                accepted[site] = answers[site]
            except ValueError as e:
                rejected[site] = str(e) if repr(site) in str(e) else f"site {site!r}: {e}"
                fed.warn(f"round {r}: rejected update: {rejected[site]}")
        for site, why in server.check_round(dict(accepted)).items():
            del accepted[site]
            rejected[site] = why
            fed.warn(f"round {r}: rejected update: {why}")
        fed.require(FedUQTask.TRAIN, train_sites, list(accepted), rejected)
        observed = stopping.observe(r, accepted) if stopping else None
        missing = sorted(set(train_sites) - set(accepted))
        if missing:
            fed.warn(f"round {r} task 'train': no valid answer from {missing}; continuing")
        try:
            fused, weights = server.fuse(fed, accepted, params)
        except ValueError as e:  # e.g. FIVA's variance check: name it and keep the old global model
            raise Stop(f"round {r}: aggregation failed: {e}") from None
        fed.log(f"round {r}: aggregated {len(weights)} site(s) ({sites_summary(train_sites, list(accepted))}, "
                f"rejected={sorted(rejected)}) with weights " + ", ".join(f"{s}={w:.4f}" for s, w in sorted(weights.items())))
        fed.log("FEDUQ_AGGREGATION " + json.dumps({
            "round": r, "weights": {s: round(float(w), 6) for s, w in weights.items()},
            "missing": missing, "rejected": sorted(rejected)}))
        if aggregated:
            aggregated(r, {s: float(w) for s, w in weights.items()})
        params = commit(r, fused, accepted) if commit else fused
        params = {k: np.asarray(v) for k, v in params.items()}
        server.after_round(fed, params, train_sites)
        meta = {FedUQMetaKey.LAST_COMPLETED_ROUND: r, FedUQMetaKey.SERVER_PART: part_name(type(server))}
        if server.state_key and server.state() is not None:
            meta[server.state_key] = server.state()
        if stopping:
            meta[stopping.STATE_KEY] = stopping.state()
        if save:
            save(r, params, meta)
        if stopping and stopping.should_stop(r):
            fed.log("FEDUQ_EARLY_STOP " + json.dumps({
                "round": r, "key_metric": stopping.key_metric, "last": observed, "best": stopping.best,
                "best_round": stopping.best_round, "patience": stopping.patience}))
            break
    fed.log(f"{server.label} finished")
    server.finish(fed, params, sites)
    return params


def server_part_arguments(part_class: type) -> set[str]:
    """The workflow arguments :meth:`ServerPart.from_job` of ``part_class`` names, and its extra task timeouts."""
    from ..common.checks import keyword_names

    own = part_class.from_job.__func__ is not ServerPart.from_job.__func__  # FedEvi's: one config from flat switches
    return keyword_names(part_class.from_job if own else part_class.__init__) | set(part_class.timeout_args)


def part_name(cls: type) -> str:
    """A server part's dotted class path, as checkpoints record it (``feduq.methods.fedevi.FedEviServer``)."""
    return f"{cls.__module__}.{cls.__qualname__}"


def job_server_part(owner: type, server_part: str | None, default: type | None = None) -> type | None:
    """The server part class a job's workflow spec names: its ``server_part`` argument, else the controller class
    ``owner``'s ``SERVER_PART``, else ``default``.

    Raises:
        ValueError: ``server_part`` does not name a server part (:func:`server_part_class`).
    """
    return server_part_class(server_part) if server_part else getattr(owner, "SERVER_PART", None) or default


def server_part_class(path: str) -> type:
    """The :class:`ServerPart` class at dotted ``path`` (a FedUQ method module).

    Raises:
        ValueError: the path is not in ``feduq.methods``, does not import, or is not a server part.
    """
    from ..common.checks import method_part_class

    return method_part_class(path, ServerPart, "workflow argument server_part",
                             "feduq.methods.graphfedseg.GraphFedSegServer")
