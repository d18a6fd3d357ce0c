"""The site part of a method: what differs between methods where the data is (FLARE-free).

FedUQ's 2D site (:class:`feduq.site.site2d.Site2D`; on FLARE run by :class:`feduq.flare.executor.FedUQExecutor`, in one
process by ``feduq virtual``) owns everything every method shares: the site's data and splits, the network, the
optimiser and its schedule across rounds, the training loop with its NaN policy, DP-SGD, resume, validation, the
test and TensorBoard. A method gives it a :class:`SitePart`, which decides only what differs:

=================================  ===========================================================================
:meth:`SitePart.loss`              the local loss ``(logits, label, round) -> loss`` (FedEvi: α/S Dice + KL)
:meth:`SitePart.probabilities`     logits -> class probabilities (softmax; FedEvi α/S)
:meth:`SitePart.uncertainty`       logits -> uncertainty maps (entropy; FedEvi's Dirichlet maps; vacuity)
:meth:`SitePart.local_keys`        state-dict entries that never leave the site (FedBN's normalisation layers)
:meth:`SitePart.receive`           what the site takes from the received parameters (GraphFedSeg's v_i)
:meth:`SitePart.before_round`      before local training (FedA3I: a new optimiser every round)
:meth:`SitePart.regularizer`       a term added to every step's loss (FedProx, GraphFedSeg's alignment)
:meth:`SitePart.statistics`        what is sent beside θ_k (FedEvi's A_k, GraphFedSeg's U_k)
:meth:`SitePart.record`            site-local log entries of the round (never sent)
:meth:`SitePart.tasks`             extra tasks (FedEvi's ``validate_surrogate``, FedA3I's ``estimate_noise``)
=================================  ===========================================================================

A site part reads the site through :class:`Site`, the few things a method needs from it, so it runs the same under
FLARE and without it. The base class is FedAvg's site: MONAI's Dice + cross-entropy, softmax, predictive entropy.
A multi-head CT method runs on the nnU-Net back-end instead and gives a :class:`CTSitePart` (FedAvg's is the base;
FIVA's and FUNAvg's are in :mod:`feduq.methods.fiva.site`).
"""

from __future__ import annotations

from typing import Callable, Iterator, Mapping, Protocol, Sequence

import torch

LOSSES = ("dice_ce", "dice")


class Site(Protocol):
    """What a site part may read from the site that runs it (on FLARE, the executor provides each of these)."""

    site: str  #: the site's name
    device: torch.device
    batch_size: int  #: the training batch size
    dp: object | None  #: the DP-SGD settings when the site trains with DP-SGD, else None
    train_ds: object  #: the training split (a dataset of {"image", "label"} dicts)
    val_ds: object
    val_loader: object  #: the validation split in training-size batches

    @property
    def model(self) -> torch.nn.Module:
        """The site's local model (after training: θ_k)."""

    def load_eval(self, params: Mapping) -> torch.nn.Module:
        """A scratch copy of the local model with ``params`` loaded (local keys kept), in eval mode."""

    def dataset(self, split: str, stage: str = "val"):
        """Another view of one of the site's splits (``stage="val"``: no augmentation)."""

    def reset_optimizer(self) -> None:
        """A new optimiser with the job's settings (its moments forgotten) and a new LR schedule."""

    def log(self, line: str) -> None: ...


class SitePart:
    """A method's site side; this base is FedAvg's site. Subclasses override what differs.

    Args:
        loss: ``"dice_ce"`` (default: MONAI Dice + cross-entropy over all classes) or ``"dice"`` (the official FedEvi
            code's FedAvg: its batch-pooled Dice loss on the softmax, :func:`feduq.scores.scoring.validation_dice_loss`).

    Attributes:
        output: ``"segmentation"`` (a class per pixel) or ``"classification"`` (one class per image).
        primary_uncertainty: the map of :meth:`uncertainty` that is the method's own uncertainty (scored as an error
            detector by :mod:`feduq.site.evaluation`).
        global_model_note: what a user must know when the *global* model is scored off the federation (None: it is
            what the sites test).
        network_defaults: network options the method needs unless the job sets them (FedBN: ``norm: batch``).

    Raises:
        ValueError: ``loss`` not one of :data:`LOSSES`.
    """

    output = "segmentation"
    primary_uncertainty = "total"
    global_model_note: str | None = None
    network_defaults: dict = {}

    def __init__(self, loss: str = "dice_ce"):
        if loss not in LOSSES:
            raise ValueError(f"executor argument loss={loss!r} is out of range: expected \"dice_ce\" or \"dice\"")
        self.loss_name = loss

    def setup(self, site: Site) -> None:
        """Check the site can run the method, once its model and data exist (ValueError naming what is missing)."""

    def loss(self, site: Site) -> Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]:
        """``(logits [B, C, H, W], label [B, 1, H, W], round r 1-based) -> scalar loss``."""
        from ..core.training import softmax_probs
        from ..scores.scoring import validation_dice_loss

        if self.loss_name == "dice":
            dice = validation_dice_loss()
            return lambda logits, label, round_index: dice(softmax_probs(logits), label)
        from monai.losses import DiceCELoss  # here, not at import: a tool that only checks a job loads no MONAI

        loss = DiceCELoss(to_onehot_y=True, softmax=True)
        return lambda logits, label, round_index: loss(logits, label)

    def probabilities(self, logits: torch.Tensor) -> torch.Tensor:
        """Logits ``[B, C, H, W]`` -> class probabilities (softmax)."""
        from ..core.training import softmax_probs

        return softmax_probs(logits)

    def uncertainty(self) -> Callable[[torch.Tensor], dict]:
        """``logits -> {name: [B, *spatial]}`` uncertainty maps (softmax methods: predictive entropy)."""
        from ..scores.maps import softmax_entropy

        return softmax_entropy

    def local_keys(self, model: torch.nn.Module) -> frozenset[str]:
        """State-dict entries that never leave the site and are never overwritten by a received model."""
        return frozenset()

    def receive(self, params: dict) -> dict:
        """The received parameters the model takes; a method takes out what it sends beside them."""
        return params

    def before_round(self, site: Site, round_index: int) -> None:
        """Called first in round ``round_index``'s ``train`` task (0-based), before DP-SGD is set up and the received
        model is loaded."""

    def regularizer(self, site: Site) -> Callable[[torch.nn.Module], torch.Tensor] | None:
        """Optional ``model -> scalar`` added to every step's loss this round; None for FedAvg."""
        return None

    def statistics(self, site: Site, round_index: int) -> dict:
        """What the site sends beside θ_k and N_k after local training (FedUQMetaKey entries)."""
        return {}

    def record(self, round_index: int) -> dict:
        """Site-local entries for this round's ``FEDUQ_TRAIN`` log line; never sent."""
        return {}

    def tasks(self) -> dict[str, Callable]:
        """Extra tasks: name -> ``handler(site, params, round) -> (meta, metrics)``, what the site sends back."""
        return {}


class ClassificationPart(SitePart):
    """FedAvg's site part for image-level classification (:class:`feduq.site.classification.ClassificationSite`):
    cross-entropy of the raw output ``[B, K]`` against the class index ``[B]`` (``torch.nn.functional.cross_entropy``),
    the base's softmax probabilities and predictive entropy (over the class axis: ``[B, K]`` and ``[B]`` here), nothing
    local (the whole network, head included, is averaged)."""

    output = "classification"

    def __init__(self):  # no segmentation loss to choose: a job's ``loss`` argument is not this part's
        super().__init__()

    def loss(self, site: Site) -> Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]:
        """``(logits [B, K], label [B] or [B, 1], round) -> mean cross-entropy``."""
        import torch.nn.functional as F

        return lambda logits, label, round_index: F.cross_entropy(logits.float(), label.reshape(-1).long())


#: job arguments both the site and its site part read (FedUAA's threshold sampling is seeded like the site)
SHARED_SITE_ARGUMENTS = frozenset({"seed"})


def site_part_arguments(part_class: type) -> set[str]:
    """The keyword arguments ``part_class(...)`` names (its constructor's parameters)."""
    from ..common.checks import keyword_names

    return keyword_names(part_class.__init__)


def site_part_class(path: str) -> type:
    """The :class:`SitePart` class at dotted ``path`` (a FedUQ method module).

    Raises:
        ValueError: the path is not in ``feduq.methods``, does not import, or is not a 2D site part.
    """
    from ..common.checks import method_part_class

    return method_part_class(path, SitePart, "executor argument site_part", "feduq.methods.fedprox.FedProxSite")


def job_site_part(owner: type, site_part: str | None, default: type | None = SitePart) -> type | None:
    """The site part class a job's executor spec names: its ``site_part`` argument, else the executor class
    ``owner``'s ``SITE_PART``, else ``default`` (FedAvg's).

    Raises:
        ValueError: ``site_part`` does not name a site part (:func:`site_part_class`).
    """
    return site_part_class(site_part) if site_part else getattr(owner, "SITE_PART", None) or default


def build_site_part(part_class: type, args: Mapping) -> tuple["SitePart", dict]:
    """A method's site part from a job's flat executor arguments, and the arguments left for the site.

    The arguments ``part_class``'s constructor names go to it (``seed`` goes to both); the others (task, image size,
    optimiser, network, ...) are the site's (:class:`feduq.site.site2d.Site2D`). So a job names a method's arguments beside
    the shared ones (``{"mu": 0.01, "lr": 1e-3}`` for FedProx), and a method needs no class of its own on FLARE.

    Raises:
        ValueError: ``part_class`` is not a :class:`SitePart`, or the site part rejects an argument (its message).
    """
    if not (isinstance(part_class, type) and issubclass(part_class, SitePart)):
        raise ValueError(f"site_part: {part_class!r} is not a 2D site part (feduq.parts.site.SitePart subclass)")
    names = site_part_arguments(part_class)
    part = part_class(**{k: v for k, v in args.items() if k in names})
    return part, {k: v for k, v in args.items() if k not in names or k in SHARED_SITE_ARGUMENTS}


class CTSitePart:
    """A multi-head CT method's site side (the nnU-Net back-end, :class:`feduq.flare.ct.CTExecutor`); this base is
    FedAvg's: nothing tracked in training, one deterministic pass at test time.

    The back-end owns nnU-Net's preprocessing, its training iterations (SGD, poly schedule, AMP, NaN-step skipping),
    the site's head, resume and the multi-head test; a site part decides only:

    ================================  ==============================================================================
    :attr:`CTSitePart.sampling`       how the K test-time passes differ: ``"none"`` (one pass), ``"posterior"``
                                      (backbones drawn from :meth:`samples`, FIVA) or ``"mc_dropout"`` (FUNAvg)
    :meth:`CTSitePart.start_round`    ``(on_gradients, on_step)`` callbacks for this round's steps (FIVA: Welford)
    :meth:`CTSitePart.statistics`     extra wire entries after training (FIVA: ``variance::<name>``)
    :meth:`CTSitePart.samples`        the backbones of the posterior passes
    ================================  ==============================================================================
    """

    sampling = "none"

    def check(self, dropout: float) -> None:
        """Check the site's network suits the method (ValueError naming the executor argument)."""

    def start_round(self, backbone: Sequence[str], params: Mapping) -> tuple[Callable | None, Callable | None]:
        """``(on_gradients(net), on_step(net))`` for this round's steps, given the received ``params``; None = none."""
        return None, None

    def statistics(self, steps: int, lr: float) -> dict:
        """Extra wire entries after the round's ``steps`` optimiser steps at learning rate ``lr``: ``{name: array}``."""
        return {}

    def samples(self, backbone: Sequence[str], params: Mapping, generator: torch.Generator,
                count: int) -> Iterator[Mapping]:
        """The backbone parameter dicts of the test-time passes (FedAvg: the received ones, once)."""
        yield params
