"""Differentially private local training (DP-SGD) for every FedUQ method, with Opacus.

DP-SGD (Abadi et al., CCS 2016): each step samples a Poisson batch (every training image joins with
probability q = B/N), clips each image's gradient to L2 norm ≤ C (``max_grad_norm``), sums them, adds
Gaussian noise N(0, σ²C²) and divides by the expected batch size B; a Rényi-DP accountant (Mironov 2017)
adds up the privacy loss of the steps. GraphFedSeg's Fig. 7 (δ = 1e-5, ε from 1 to 50) trains this way.

What FedUQ takes from Opacus (none of it is re-implemented here): per-sample gradients
(``GradSampleModule``), clipping and noise (``DPOptimizer``), Poisson sampling
(``UniformWithReplacementSampler``), the noise for a target budget (``get_noise_multiplier``), the RDP
accountant, and the check that a network can be trained privately (``ModuleValidator``).

Where FedUQ departs from ``PrivacyEngine.make_private``:

* the site's model, optimizer and Adam state persist across rounds, so the per-sample machinery is
  attached to the same module (no ``_module.`` prefix reaches the wire) and the optimizer is wrapped
  per round around the persistent Adam;
* a data-independent regulariser (FedProx's proximal term, GraphFedSeg's alignment term) is
  differentiated separately and added *after* clipping and noise: it depends on no training image, so
  this is post-processing and costs no privacy (Opacus would otherwise drop its gradient, which lives
  in ``.grad`` and not in the per-sample gradients);
* an empty Poisson batch still takes a noise-only step (skipping it would make the step depend on
  whether any image was drawn);
* the noise is drawn from a seeded generator (reproducible research runs, not ``secure_mode``).

The budget covers the model updates only. The scalars a method sends beside the model (n_k; FedEvi's
validation statistics, FedUAA's threshold, GraphFedSeg's U_k) are not privatised (docs/reference/privacy.md).
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass
from typing import TYPE_CHECKING, Mapping

import torch
from torch.utils.data import DataLoader

if TYPE_CHECKING:
    from opacus.optimizers import DPOptimizer

# Opacus is imported where it is used: every site process imports this module, and Opacus (with the
# torch.distributed modules it pulls in) adds about a second to the start of a site without DP.

# Opacus' per-sample hooks on the first layer: the input image needs no gradient, torch warns every step
warnings.filterwarnings("ignore", message="Full backward hook is firing when gradients are computed with respect to module outputs")

DEFAULT_DELTA = 1e-5  # GraphFedSeg §3.6
DEFAULT_MAX_GRAD_NORM = 1.0


@dataclass(frozen=True)
class DPConfig:
    """The job's privacy budget for one site's whole training (all rounds × local epochs).

    Attributes:
        epsilon: target ε > 0 spent by the end of the last round.
        delta: δ in (0, 1) (default 1e-5, GraphFedSeg §3.6; should be < 1/N).
        max_grad_norm: per-image gradient clipping norm C > 0.
        rounds: rounds the budget is planned over; None = the job's ``num_rounds``, sent with the model.
    """

    epsilon: float
    delta: float = DEFAULT_DELTA
    max_grad_norm: float = DEFAULT_MAX_GRAD_NORM
    rounds: int | None = None

    @classmethod
    def from_json(cls, value: Mapping | None) -> "DPConfig | None":
        """The executor argument ``dp`` (``null`` = no DP) as a checked :class:`DPConfig`.

        Raises:
            ValueError: not an object, an unknown key, or a value out of range, named as ``dp.<key>``.
        """
        if value is None:
            return None
        if not isinstance(value, Mapping):
            raise ValueError(f"executor argument dp={value!r}: expected null or {{epsilon, delta, max_grad_norm}}")
        unknown = sorted(set(value) - {"epsilon", "delta", "max_grad_norm", "rounds"})
        if unknown:
            raise ValueError(f"executor argument dp has unknown keys {unknown} (known: epsilon, delta, max_grad_norm, rounds)")

        def num(key, default, ok, expected):
            v = value.get(key, default)
            if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or not ok(v):
                raise ValueError(f"executor argument dp.{key}={v!r} is out of range: expected {expected}")
            return v

        if "epsilon" not in value:
            raise ValueError("executor argument dp needs epsilon (the target privacy budget, > 0)")
        rounds = value.get("rounds")
        if rounds is not None and (not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 1):
            raise ValueError(f"executor argument dp.rounds={rounds!r} is out of range: expected null or an integer >= 1")
        return cls(
            epsilon=float(num("epsilon", None, lambda v: v > 0, "a number > 0")),
            delta=float(num("delta", DEFAULT_DELTA, lambda v: 0 < v < 1, "a number in (0, 1)")),
            max_grad_norm=float(num("max_grad_norm", DEFAULT_MAX_GRAD_NORM, lambda v: v > 0, "a number > 0")),
            rounds=rounds,
        )


def check_private_model(model: torch.nn.Module, site: str = "?") -> None:
    """Refuse a network that DP-SGD cannot train (Opacus ``ModuleValidator``).

    BatchNorm mixes the images of a batch, so per-image gradients do not exist: a BatchNorm network
    (FedBN's ``norm="batch"``, FedUAA's ResNet) is refused rather than silently changed.

    Raises:
        ValueError: naming the site and every unsupported layer.
    """
    from opacus.validators import ModuleValidator

    errors = ModuleValidator.validate(model, strict=False)
    if errors:
        listed = "; ".join(sorted({str(e) for e in errors}))[:500]
        raise ValueError(f"site {site!r}: dp is set but this network cannot be trained with DP-SGD: {listed}")


def steps_per_epoch(sample_rate: float) -> int:
    """Poisson batches per local epoch: ⌊1/q⌋, as Opacus' ``DPDataLoader``."""
    return max(int(1 / sample_rate), 1)


def noise_for_budget(config: DPConfig, sample_rate: float, steps: int) -> float:
    """Noise multiplier σ that spends exactly ``config.epsilon`` (RDP, to 0.01) over ``steps`` steps at rate q.

    Raises:
        ValueError: q not in (0, 1] or steps < 1.
    """
    if not 0 < sample_rate <= 1 or steps < 1:
        raise ValueError(f"dp: sample rate {sample_rate} (expected (0, 1]) and steps {steps} (expected >= 1)")
    from opacus.accountants.utils import get_noise_multiplier

    return float(get_noise_multiplier(target_epsilon=config.epsilon, target_delta=config.delta,
                                      sample_rate=sample_rate, steps=steps, accountant="rdp"))


def spent_epsilon(history, delta: float) -> float:
    """ε spent by a list of ``(noise multiplier, sample rate, steps)`` under the RDP accountant (0 with no steps)."""
    if not history:
        return 0.0
    from opacus.accountants import RDPAccountant

    accountant = RDPAccountant()
    accountant.history = [tuple(h) for h in history]
    return float(accountant.get_epsilon(delta))


class _EmptyAware:
    """Collate wrapper: an empty Poisson batch becomes ``None`` (the trainer then takes a noise-only step)."""

    def __init__(self, collate):
        self.collate = collate

    def __call__(self, items):
        return self.collate(items) if items else None


class PrivateTraining:
    """DP-SGD state of one site: per-sample gradients on its model, its Poisson loader, and its accountant.

    Args:
        model: the site's network (per-sample-gradient hooks are attached in place; its state-dict keys
            do not change).
        config: the budget.
        num_samples: N, the site's training images.
        batch_size: expected Poisson batch size B (q = B/N).
        total_steps: DP-SGD steps over the whole job (rounds × local epochs × ⌊1/q⌋); σ is chosen to
            spend ``config.epsilon`` over exactly these.
        seed: seeds the sampler and the noise.

    Raises:
        ValueError: B > N (q > 1) or a budget Opacus cannot reach.
    """

    def __init__(self, model: torch.nn.Module, config: DPConfig, num_samples: int, batch_size: int,
                 total_steps: int, seed: int = 0):
        if batch_size > num_samples:
            raise ValueError(f"dp: batch_size {batch_size} > training images {num_samples} (sample rate > 1)")
        self.config = config
        self.sample_rate = batch_size / num_samples
        self.batch_size = int(batch_size)
        self.num_samples = int(num_samples)
        self.total_steps = int(total_steps)
        self.noise_multiplier = noise_for_budget(config, self.sample_rate, self.total_steps)
        from opacus import GradSampleModule
        from opacus.accountants import RDPAccountant

        self.module = GradSampleModule(model, loss_reduction="mean")
        self.accountant = RDPAccountant()
        self.seed = int(seed)
        self.noise_generator = torch.Generator().manual_seed(self.seed + 1)
        self._loaders: dict[int, DataLoader] = {}

    @classmethod
    def for_rounds(cls, model: torch.nn.Module, config: DPConfig, num_samples: int, batch_size: int,
                   local_epochs: int, rounds: int, seed: int = 0) -> "PrivateTraining":
        """DP-SGD over a job of ``rounds`` rounds of ``local_epochs`` epochs (⌊1/q⌋ steps each, q = B/N)."""
        steps = int(rounds) * int(local_epochs) * steps_per_epoch(min(batch_size / num_samples, 1.0))
        return cls(model, config, num_samples, batch_size, steps, seed=seed)

    def loader(self, loader: DataLoader) -> DataLoader:
        """A Poisson-sampled twin of ``loader`` (same dataset, collate, workers): ⌊1/q⌋ batches per epoch."""
        key = id(loader)
        if key not in self._loaders:
            from opacus.utils.uniform_sampler import UniformWithReplacementSampler

            sampler = UniformWithReplacementSampler(
                num_samples=len(loader.dataset), sample_rate=self.sample_rate,
                generator=torch.Generator().manual_seed(self.seed))
            self._loaders[key] = DataLoader(loader.dataset, batch_sampler=sampler, collate_fn=_EmptyAware(loader.collate_fn),
                                            num_workers=loader.num_workers, pin_memory=loader.pin_memory)
        return self._loaders[key]

    def optimizer(self, optimizer: torch.optim.Optimizer) -> DPOptimizer:
        """``optimizer`` wrapped for clipping and noise (its state, e.g. Adam moments, stays in the original)."""
        from opacus.optimizers import DPOptimizer

        dp = DPOptimizer(optimizer, noise_multiplier=self.noise_multiplier, max_grad_norm=self.config.max_grad_norm,
                         expected_batch_size=self.batch_size, loss_reduction="mean")
        dp.generator = self.noise_generator
        return dp

    def empty_step(self, dp_optimizer: DPOptimizer) -> None:
        """Per-sample gradients of an empty batch (zero rows): the next step adds noise only."""
        for p in dp_optimizer.params:
            p.grad_sample = torch.zeros((0, *p.shape), dtype=p.dtype, device=p.device)

    def record_step(self) -> None:
        """One noisy step taken: add it to the accountant."""
        self.accountant.step(noise_multiplier=self.noise_multiplier, sample_rate=self.sample_rate)

    @property
    def epsilon(self) -> float:
        """ε spent so far (RDP accountant at ``config.delta``)."""
        return spent_epsilon(self.accountant.history, self.config.delta)

    @property
    def steps_taken(self) -> int:
        return int(sum(h[2] for h in self.accountant.history))

    def summary(self) -> dict:
        """What a site logs each round: ε spent, δ, σ, q, C, steps taken and planned."""
        return {"dp_epsilon": round(self.epsilon, 6), "dp_delta": self.config.delta,
                "dp_noise_multiplier": self.noise_multiplier, "dp_sample_rate": self.sample_rate,
                "dp_max_grad_norm": self.config.max_grad_norm, "dp_steps": self.steps_taken,
                "dp_planned_steps": self.total_steps, "dp_target_epsilon": self.config.epsilon}

    def state(self) -> dict:
        return {"history": list(self.accountant.history), "noise_generator": self.noise_generator.get_state()}

    def load_state(self, state: Mapping) -> None:
        self.accountant.history = [tuple(h) for h in state.get("history", [])]
        if state.get("noise_generator") is not None:
            self.noise_generator.set_state(state["noise_generator"])
