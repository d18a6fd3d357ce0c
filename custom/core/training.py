"""The one local training loop every FedUQ 2D method shares (no FLARE here): the device, a site's optimiser
and schedule kept across rounds (:class:`LocalTrainer`), and a received model loaded in place (:func:`load_params`).

A method plugs in only what differs: its loss (``loss_fn``), an optional regulariser on the model (FedProx) and a
hook per step; how its outputs are scored is :mod:`feduq.scores.scoring`.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping

import numpy as np
import torch

#: the ``amp`` values :class:`LocalTrainer` accepts
AMP_MODES = ("auto", True, False, "bf16")
#: the command-line names of the ``amp`` settings (``--amp``) -> the value a site takes
AMP_OPTIONS = {"auto": "auto", "off": False, "bf16": "bf16"}

#: ``/proc/cpuinfo`` flags of a CPU that computes bfloat16 in hardware (AVX-512 BF16, AMX BF16)
BF16_CPU_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})


@functools.lru_cache(maxsize=None)
def cpu_flags(cpuinfo: str | None = None) -> frozenset[str]:
    """The instruction-set flags of every ``flags`` line of ``/proc/cpuinfo`` (empty where it cannot be read, e.g.
    not Linux).

    Args:
        cpuinfo: the text of ``/proc/cpuinfo`` (read when None).
    """
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return frozenset()
    return frozenset(flag for line in cpuinfo.splitlines() if line.startswith("flags") and ":" in line
                     for flag in line.split(":", 1)[1].split())


def cpu_has_bf16(cpuinfo: str | None = None) -> bool:
    """Whether this machine's CPU computes bfloat16 in hardware: :func:`cpu_flags` holds one of
    :data:`BF16_CPU_FLAGS`. False where ``/proc/cpuinfo`` cannot be read (not Linux): bfloat16 is then emulated,
    slower than float32.

    Args:
        cpuinfo: the text of ``/proc/cpuinfo`` (read when None).
    """
    return bool(BF16_CPU_FLAGS & cpu_flags(cpuinfo))


def has_batchnorm(model: torch.nn.Module | None) -> bool:
    """Whether ``model`` holds a BatchNorm layer (any ``torch.nn.modules.batchnorm._BatchNorm``)."""
    return model is not None and any(isinstance(m, torch.nn.modules.batchnorm._BatchNorm) for m in model.modules())


def autocast_dtype(amp: str | bool, device: torch.device, model: torch.nn.Module | None = None) -> torch.dtype | None:
    """The dtype training's forward pass is autocast to for an ``amp`` setting on ``device`` (None: float32).

    ``"auto"``: float16 on CUDA (with a ``GradScaler``); on a CPU that computes bfloat16 in hardware
    (:func:`cpu_has_bf16`) bfloat16 for a ``model`` without BatchNorm layers (1.75x faster, test Dice within float32's
    spread for FedAvg and FedEvi: docs/reference/networks.md) and float32 for one with them (FedBN's network in bfloat16 was not
    shown to stay within it); float32 on any other CPU. True: float16 on CUDA, float32 on a CPU. ``"bf16"``:
    bfloat16 on either. False: float32.

    Raises:
        ValueError: ``amp`` not in ("auto", True, False, "bf16").
    """
    if amp not in AMP_MODES:
        raise ValueError(f"amp must be 'auto', true, false or 'bf16', got {amp!r}")
    if amp == "bf16" or (amp == "auto" and device.type == "cpu" and cpu_has_bf16() and not has_batchnorm(model)):
        return torch.bfloat16
    return torch.float16 if device.type == "cuda" and amp in ("auto", True) else None


def to_device(value, device: torch.device, memory_format: torch.memory_format = torch.preserve_format) -> torch.Tensor:
    """A batch entry on ``device`` as a plain ``torch.Tensor``, copied without blocking the host (from pinned memory
    the copy overlaps the device's work). MONAI's ``MetaTensor`` is dropped to its data first: every operation on a
    ``MetaTensor`` pays Python bookkeeping of its metadata (measured 3-7 ms per training step of the ``light``
    network on a CPU, ops the device would otherwise not wait for); the values are the same.

    Args:
        value: a tensor (``MetaTensor`` or plain) or array-like, any dtype.
        memory_format: e.g. ``torch.channels_last`` for a 4-D image batch.
    """
    tensor = value.as_subclass(torch.Tensor) if isinstance(value, torch.Tensor) else torch.as_tensor(value)
    return tensor.to(device, non_blocking=True, memory_format=memory_format)


LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
ProbFn = Callable[[torch.Tensor], torch.Tensor]


def resolve_device(device: str = "auto") -> torch.device:
    """``"auto"`` -> CUDA when available, else CPU; any other value is passed to ``torch.device``.

    On CUDA, cuDNN's autotuner is switched on (``torch.backends.cudnn.benchmark``): the input size is
    fixed per job, so the fastest convolution algorithms are chosen once.
    """
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    resolved = torch.device(device)
    if resolved.type == "cuda":
        torch.backends.cudnn.benchmark = True
    return resolved


def check_device(device: str) -> torch.device:
    """``device`` (cpu, cuda, cuda:N) as a ``torch.device`` this machine has.

    Raises:
        ValueError: not a torch device, a CUDA device on a machine without one (or an index past the last), or
            another device type; the message names ``--device``.
    """
    try:
        dev = torch.device(device)
    except RuntimeError:
        raise ValueError(f"--device {device!r}: not a torch device (cpu, cuda, cuda:N)") from None
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"--device {device}: this machine has no CUDA device (torch {torch.__version__}); use --device cpu")
    if dev.type == "cuda" and dev.index is not None and dev.index >= torch.cuda.device_count():
        raise ValueError(f"--device {device}: there are {torch.cuda.device_count()} CUDA devices")
    if dev.type not in ("cpu", "cuda"):
        raise ValueError(f"--device {device!r}: FedUQ runs on cpu or cuda")
    return dev


def softmax_probs(logits: torch.Tensor) -> torch.Tensor:
    """Softmax over the class axis: ``[B, C, H, W]`` -> ``[B, C, H, W]``."""
    return torch.softmax(logits, dim=1)


@dataclass
class TrainStats:
    """What one round of local training did."""

    num_steps: int
    num_samples: int
    mean_loss: float
    seconds: float


def load_params(
    model: torch.nn.Module, params: Mapping[str, object], strict: bool = True, skip: frozenset = frozenset()
) -> list[str]:
    """Copy ``params`` into ``model``'s state in place (the optimizer stays bound to the tensors).

    Args:
        params: name -> numpy array or tensor (on any device; a tensor is copied without passing through numpy).
        strict: when True every model entry must be present; when False, absent entries keep
            their local values (FedBN keeps normalisation layers local this way).
        skip: names that are never overwritten even when present (a site's local entries).

    Returns:
        Names of model entries that were not overwritten.

    Raises:
        ValueError: an unknown name, a missing name (strict), or a shape mismatch
            (``expected=... got=...``).
    """
    state = model.state_dict()
    unknown = sorted(set(params) - set(state))
    if unknown:
        raise ValueError(f"received parameters unknown to the local model: {unknown[:5]}")
    kept = sorted((set(state) - set(params)) | (set(skip) & set(state)))
    if strict and set(kept) - set(skip):
        raise ValueError(f"received model lacks parameters: {sorted(set(kept) - set(skip))[:5]}")
    with torch.no_grad():
        for name, value in params.items():
            if name in skip:
                continue
            # a tensor is copied as it is (it may live on a GPU, where numpy cannot read it)
            tensor = value.detach() if isinstance(value, torch.Tensor) else torch.as_tensor(np.asarray(value))
            if tuple(tensor.shape) != tuple(state[name].shape):
                raise ValueError(
                    f"parameter {name!r} shape mismatch: expected={tuple(state[name].shape)}, got={tuple(tensor.shape)}"
                )
            state[name].copy_(tensor.to(state[name].dtype))
    return kept


class LocalTrainer:
    """Local optimisation state of one site, kept across federated rounds.

    Adam (lr 1e-3, betas (0.9, 0.99), weight decay 1e-5) and an ExponentialLR (γ = 0.99) stepped
    once per round are FedEvi's official settings (``main_seg_al.py``); both objects persist across
    rounds, so the Adam moments carry over while the parameters are overwritten in place by each
    received global model.

    Args:
        model: the site's network (moved to ``device``).
        device: torch device for training and evaluation.
        lr, betas, weight_decay: Adam settings.
        lr_gamma: per-round multiplicative learning-rate decay; 1.0 disables it.
        amp: automatic mixed precision of the forward pass; the loss is computed in float32 from float32 logits,
            so evidential ``exp`` evidence cannot overflow. ``"auto"`` (default): float16 autocast with a ``GradScaler``
            on CUDA, bfloat16 autocast on a CPU with bfloat16 hardware (AVX-512 BF16 / AMX) for a network without
            BatchNorm, float32 otherwise (:func:`autocast_dtype`); True: float16 on CUDA, float32 on CPU; ``"bf16"``: bfloat16 autocast on
            either device (no scaler: the exponent range is float32's); False: float32.
        channels_last: store the model and inputs in ``channels_last`` memory format (a CUDA
            switch; off by default until a measurement shows it faster).

    Raises:
        ValueError: ``amp`` not in ("auto", True, False, "bf16").
    """

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.99),
        weight_decay: float = 1e-5,
        lr_gamma: float = 0.99,
        amp: str | bool = "auto",
        channels_last: bool = False,
    ):
        self.device = device
        self.autocast_dtype = autocast_dtype(amp, device, model)
        self.memory_format = torch.channels_last if channels_last else torch.contiguous_format
        self.model = model.to(device, memory_format=self.memory_format)
        # fused Adam on CUDA: one kernel per step, and it takes GradScaler's inf check on the device
        self.optimizer = torch.optim.Adam(
            self.model.parameters(), lr=lr, betas=tuple(betas), weight_decay=weight_decay, fused=device.type == "cuda"
        )
        self.scheduler = torch.optim.lr_scheduler.ExponentialLR(self.optimizer, gamma=lr_gamma)
        self.scaler = torch.amp.GradScaler("cuda", enabled=self.autocast_dtype == torch.float16)
        self.privacy = None  # feduq.privacy.dp_sgd.PrivateTraining once DP-SGD is switched on (enable_privacy)
        self.step_hook: Callable[[], object] | None = None  # called after every step (e.g. feduq.core.threads refresh)
        self.clip_grad_norm: float | None = None  # clip the gradient norm before each step (nnU-Net's recipe: 12)
        self._privacy_state = None  # accountant state restored before DP was switched on

    @property
    def amp(self) -> bool:
        """Whether training's forward pass is autocast (:attr:`autocast_dtype` is float16 or bfloat16)."""
        return self.autocast_dtype is not None

    def enable_privacy(self, privacy) -> None:
        """Train with DP-SGD from now on (``feduq.privacy.dp_sgd.PrivateTraining`` built on ``self.model``).

        AMP is switched off: per-sample gradients are clipped and noised in float32.
        """
        self.privacy = privacy
        self.autocast_dtype = None
        self.scaler = torch.amp.GradScaler("cuda", enabled=False)
        if self._privacy_state:
            privacy.load_state(self._privacy_state)

    def set_optimizer(self, optimizer: torch.optim.Optimizer, scheduler) -> None:
        """Train with ``optimizer`` (over ``self.model``'s parameters) and its per-round LR ``scheduler`` from now on
        (FedUAA's classification site: a new SGD every round)."""
        self.optimizer, self.scheduler = optimizer, scheduler

    def reset_optimizer(self) -> None:
        """A new Adam with the current one's initial lr, betas and weight decay (no moments) and a new ExponentialLR
        with the same γ (FedA3I's official code recreates its optimiser every round)."""
        group = self.optimizer.param_groups[0]
        adam = torch.optim.Adam(self.model.parameters(), lr=group["initial_lr"] if "initial_lr" in group else group["lr"],
                                betas=group["betas"], weight_decay=group["weight_decay"])
        self.set_optimizer(adam, torch.optim.lr_scheduler.ExponentialLR(adam, gamma=self.scheduler.gamma))

    # -- optimiser state across process restarts ----------------------------------------------------
    def state(self) -> dict:
        """Optimizer, scheduler and AMP scaler state (not the model: that comes from the server each round)."""
        state = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                 "scaler": self.scaler.state_dict()}
        privacy = self.privacy.state() if self.privacy is not None else self._privacy_state
        if privacy:  # DP-SGD: the accountant's history, so a restarted site keeps counting epsilon
            state["privacy"] = privacy
        return state

    def load_state(self, state: Mapping) -> None:
        """Restore :meth:`state` (e.g. after the client process was restarted between rounds)."""
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        if state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])
        self._privacy_state = state.get("privacy")
        if self.privacy is not None and self._privacy_state:
            self.privacy.load_state(self._privacy_state)

    # -- parameters in and out -------------------------------------------------------------------
    def get_params(self) -> dict[str, np.ndarray]:
        """The model's state dict as numpy arrays (what a site sends)."""
        return {k: v.detach().cpu().numpy().copy() for k, v in self.model.state_dict().items()}

    def set_params(self, params: Mapping[str, object], strict: bool = True) -> list[str]:
        """Load (part of) a state dict in place, keeping the optimizer bound to the same tensors.

        See :func:`load_params`; returns the names of local entries that were not overwritten.
        """
        return load_params(self.model, params, strict=strict)

    # -- training --------------------------------------------------------------------------------
    def train_epochs(
        self,
        loader,
        epochs: int,
        loss_fn: LossFn,
        regularizer: Callable[[torch.nn.Module], torch.Tensor] | None = None,
    ) -> TrainStats:
        """Run ``epochs`` local epochs, then step the per-round LR scheduler once.

        Args:
            loader: yields dicts with ``image`` ``[B, C_in, H, W]`` (or ``[B, C_in, D, H, W]``) float32 and ``label``
                ``[B, 1, H, W]`` class indices, or a list of them (one per output of a deep-supervised network,
                whose logits are then a list too).
            loss_fn: ``(logits [B, C, H, W], label [B, 1, H, W]) -> scalar`` (lists for a deep-supervised network).
            regularizer: optional ``model -> scalar`` added to the loss (e.g. FedProx).

        Raises:
            FloatingPointError: the loss became NaN/Inf (the site then reports an error instead of
                sending a corrupt update). Checked every step on CPU; on CUDA once per epoch over
                the summed loss (no host sync per step), and then the Adam moments are reset.
        """
        if self.privacy is not None:
            return self._train_private(loader, epochs, loss_fn, regularizer)
        self.model.train()
        # On CUDA the loss is summed on the device and checked once per epoch: a per-step check
        # (``.item()``) would stall the host on every step. On CPU the per-step check is free.
        per_step_check = self.device.type != "cuda"
        start, steps, samples = time.perf_counter(), 0, 0
        total = torch.zeros((), device=self.device)
        for epoch in range(epochs):
            for batch in loader:
                image = to_device(batch["image"], self.device, self.memory_format)
                label = batch["label"]  # a list: one target per deep-supervision output (nnU-Net's network)
                label = ([to_device(t, self.device) for t in label] if isinstance(label, list)
                         else to_device(label, self.device))
                with torch.autocast(device_type=self.device.type, dtype=self.autocast_dtype or torch.bfloat16,
                                    enabled=self.amp):
                    logits = self.model(image)
                loss = loss_fn([lo.float() for lo in logits] if isinstance(logits, (list, tuple)) else logits.float(),
                               label)
                if regularizer is not None:
                    loss = loss + regularizer(self.model)
                if per_step_check and not torch.isfinite(loss):
                    raise FloatingPointError(f"training loss is {loss.item()} at step {steps}")
                self.optimizer.zero_grad(set_to_none=True)
                self.scaler.scale(loss).backward()
                if self.clip_grad_norm is not None:  # on the unscaled gradients, as nnU-Net's trainer clips
                    self.scaler.unscale_(self.optimizer)
                    torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.clip_grad_norm)
                self.scaler.step(self.optimizer)
                self.scaler.update()
                steps += 1
                samples += image.shape[0]
                total += loss.detach()
                if self.step_hook is not None:
                    self.step_hook()
            if not per_step_check and not torch.isfinite(total):
                # the non-finite step may have reached the Adam moments: start them afresh
                self.optimizer.state.clear()
                raise FloatingPointError(
                    f"training loss is {total.item()} in local epoch {epoch} (summed over its steps, up to step {steps})"
                )
        self.scheduler.step()
        total = float(total)
        return TrainStats(steps, samples, total / max(steps, 1), time.perf_counter() - start)


    def _train_private(self, loader, epochs: int, loss_fn: LossFn, regularizer=None) -> TrainStats:
        """:meth:`train_epochs` with DP-SGD (:mod:`feduq.privacy.dp_sgd`): Poisson batches, per-image clipping and
        Gaussian noise on the data term; the regulariser's gradient (data-independent) is added after the
        noise; every step, an empty batch's noise-only step included, goes to the accountant."""
        privacy = self.privacy
        dp_optimizer = privacy.optimizer(self.optimizer)
        params = [p for p in self.model.parameters() if p.requires_grad]
        self.model.train()
        start, steps, samples, total, batches = time.perf_counter(), 0, 0, 0.0, 0
        for _ in range(epochs):
            for batch in privacy.loader(loader):
                dp_optimizer.zero_grad(set_to_none=True)
                if batch is None:
                    privacy.empty_step(dp_optimizer)
                else:
                    image = to_device(batch["image"], self.device, self.memory_format)
                    label = to_device(batch["label"], self.device)
                    loss = loss_fn(privacy.module(image).float(), label)
                    if not torch.isfinite(loss):
                        raise FloatingPointError(f"training loss is {loss.item()} at step {steps}")
                    loss.backward()
                    samples += image.shape[0]
                    total += float(loss.detach())
                    batches += 1
                dp_optimizer.pre_step()  # clip per image, sum, add N(0, sigma^2 C^2), divide by B
                if regularizer is not None:
                    grads = torch.autograd.grad(regularizer(self.model), params, allow_unused=True)
                    for p, g in zip(params, grads):
                        if g is not None:
                            p.grad = g if p.grad is None else p.grad + g
                self.optimizer.step()
                privacy.record_step()
                steps += 1
                if self.step_hook is not None:
                    self.step_hook()
        dp_optimizer.zero_grad(set_to_none=True)  # drop the per-sample gradients
        self.scheduler.step()
        return TrainStats(steps, samples, total / max(batches, 1), time.perf_counter() - start)
