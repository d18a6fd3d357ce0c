"""FedA3I's Contour Evolution Model (CEM): synthetic, annotator-specific noise for binary masks. Pure NumPy/SciPy.

Source: FedA3I, Wu et al., "FedA3I: Annotation Quality-Aware Aggregation for Federated Medical Image Segmentation
against Heterogeneous Annotation Noise" (AAAI 2024; §3.2, Eq. 1;
official code ``data/ISIC2017/noise_generate.py``). Step-by-step notes and the paper-vs-code differences are in
the FedA3I paper §3.2 and its official code.

A site (annotator) i gets a CEM C(mu_i, sigma_i) drawn from a multi-source model M(mu_max, mu_min, sigma_max, p_d)
(:func:`draw_site_noise`, Eq. 1). Per object (8-connected component of the clean mask, largest first) the CEM

1. traces the external contour as an ordered list of l boundary pixels (:func:`trace_contour`), rolled to a
   random start;
2. draws a smooth bias sequence b_1..b_l in pixels (:func:`bias_sequence`): 30 equally spaced samples of
   N(mu, sigma^2), a weighted degree-10 polynomial fit, clipped to +-30 px, redrawn until it closes;
3. moves every contour pixel |b_k| px along its outward (b_k > 0) or inward (b_k < 0) normal
   (:func:`contour_normals`, :func:`outward_normals`, :func:`move_contour`);
4. fills the polygon through the moved pixels (:func:`fill_contour`).

Components under 15 px are dropped; the results are OR-ed (:func:`noisy_label`, :func:`evolve_mask`).
Coordinates are (row, col) pixel indices; biases and distances are in pixels.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple

import numpy as np

from numpy.polynomial import polynomial as P
from scipy import ndimage
from skimage.draw import polygon, polygon_perimeter
from ...common.checks import scalar as _scalar

__all__ = [
    "NUM_SAMPLES", "POLY_DEGREE", "CLOSURE_WEIGHT", "MAX_BIAS", "MAX_CLOSURE_GAP", "MAX_DRAWS", "NORMAL_HALF_WINDOW",
    "VERTICAL_SLOPE", "PROBE_STEPS", "MIN_AREA", "DRAW_MODES",
    "NoiseModel", "PRESETS", "SiteNoise", "draw_site_noise",  # per-site parameters
    "trace_contour", "bias_sequence", "contour_normals", "outward_normals", "move_contour", "fill_contour",  # CEM
    "ObjectResult", "evolve_object", "NoisyLabel", "noisy_label", "evolve_mask", "dice",  # whole masks
]

NUM_SAMPLES = 30  # l_sub: sampled contour pixels (code)
POLY_DEGREE = 10  # p (code)
CLOSURE_WEIGHT = 10.0  # weight of the first sample and of the appended closure point (code)
MAX_BIAS = 30.0  # |b_k| clip, px (code)
MAX_CLOSURE_GAP = 3.0  # redraw until |b_1 - b_l| < 3 px (code)
# FedUQ's cap on those redraws (the code loops without a cap). Some contour lengths close only about 1 draw in 300
# (40-59 and ~80 px), so the cap is high enough that a capped object is rare (~0.1 %) and the noise stays the code's.
MAX_DRAWS = 2000
NORMAL_HALF_WINDOW = 20  # +-20 contour neighbours in the tangent line fit (code)
VERTICAL_SLOPE = 20.0  # |normal slope| >= 20 -> vertical normal (code)
PROBE_STEPS = 5  # probe 1..5 px along +-normal for the inside/outside side (code)
MIN_AREA = 15  # components with fewer pixels are dropped (code)
DRAW_MODES = ("paper", "code")


# --------------------------------------------------------------------------------------------------
# Per-site parameters (paper Eq. 1)
# --------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class NoiseModel:
    """Multi-source noise model M(mu_max, mu_min, sigma_max, p_d) (paper §3.2, Eq. 1); biases in pixels.

    ``p_d`` is the probability that a site's mean bias is positive (it enlarges), so p_d = 0.2 is shrink-dominant
    (N_S) and p_d = 0.8 enlarge-dominant (N_E).

    Raises:
        ValueError: naming the parameter: mu_max < 0, mu_min > 0, sigma_max <= 0, p_d outside [0, 1], non-finite.
    """

    mu_max: float
    mu_min: float
    sigma_max: float
    p_d: float

    def __post_init__(self):
        for name in ("mu_max", "mu_min", "sigma_max", "p_d"):
            object.__setattr__(self, name, _scalar(getattr(self, name), name))
        for name, ok, rule in (("mu_max", self.mu_max >= 0, ">= 0"), ("mu_min", self.mu_min <= 0, "<= 0"),
                               ("sigma_max", self.sigma_max > 0, "> 0"), ("p_d", 0 <= self.p_d <= 1, "in [0, 1]")):
            if not ok:
                raise ValueError(f"{name} must be {rule}, got {getattr(self, name)}")


#: The paper's settings (§4.1): SKIN and BREAST, shrink-dominant N_S and enlarge-dominant N_E.
PRESETS = {
    "skin_ns": NoiseModel(20, -20, 10, 0.2),
    "skin_ne": NoiseModel(25, -25, 10, 0.8),
    "breast_ns": NoiseModel(25, -15, 5, 0.2),
    "breast_ne": NoiseModel(25, -15, 5, 0.8),
}


@dataclass(frozen=True)
class SiteNoise:
    """One site's CEM C(mu, sigma): mean and standard deviation of the sampled biases, in pixels.

    Raises:
        ValueError: mu not finite, sigma negative or not finite (names the parameter).
    """

    mu: float
    sigma: float

    def __post_init__(self):
        object.__setattr__(self, "mu", _scalar(self.mu, "mu"))
        object.__setattr__(self, "sigma", _scalar(self.sigma, "sigma"))
        if self.sigma < 0:
            raise ValueError(f"sigma must be >= 0, got {self.sigma}")


def draw_site_noise(num_sites: int, model: NoiseModel, rng: np.random.Generator, mode: str = "paper") -> list[SiteNoise]:
    """Draw C(mu_i, sigma_i) for sites 0..K-1 from ``model``; sigma_i ~ U(sigma_max/2, sigma_max) in both modes.

    * ``"paper"`` (Eq. 1): each site independently has mu_i ~ U(0, mu_max) with probability p_d, else
      U(mu_min, 0) (a Bernoulli count of enlarging sites).
    * ``"code"`` (official code variant): exactly
      ``n_neg = floor((1 - p_d) * K)`` sites (the code's ``int(0.2*K)`` / ``int(0.8*K)``; a 1e-9 tolerance keeps
      (1 - 0.8) * 10 at 2, not 1.99.. -> 1) are negative, chosen uniformly without replacement by ``rng``; |mu_i| ~
      U(0, mu_max) for the positive sites and U(0, |mu_min|) for the negative ones. The code draws |mu| ~ U(0, mu_max)
      for all and only has symmetric models (mu_min = -mu_max), where both are the same; for an asymmetric M
      (BREAST) this keeps every mu_i inside [mu_min, mu_max].

    Returns:
        ``num_sites`` :class:`SiteNoise`, in site order.

    Raises:
        ValueError: num_sites < 1, unknown mode (names the parameter); ``model`` not a :class:`NoiseModel`.
    """
    if not isinstance(model, NoiseModel):
        raise ValueError(f"model must be a NoiseModel, got {type(model).__name__}")
    if isinstance(num_sites, bool) or not isinstance(num_sites, (int, np.integer)) or num_sites < 1:
        raise ValueError(f"num_sites must be an integer >= 1, got {num_sites!r}")
    if mode not in DRAW_MODES:
        raise ValueError(f"mode must be one of {DRAW_MODES}, got {mode!r}")
    k = int(num_sites)
    if mode == "paper":
        positive = rng.random(k) < model.p_d
    else:
        positive = np.ones(k, dtype=bool)
        positive[rng.choice(k, size=int(math.floor((1 - model.p_d) * k + 1e-9)), replace=False)] = False
    u = rng.random(k)
    mu = np.where(positive, u * model.mu_max, u * model.mu_min)  # U(0, mu_max) or U(mu_min, 0)
    sigma = rng.uniform(model.sigma_max / 2, model.sigma_max, size=k)
    return [SiteNoise(float(m), float(s)) for m, s in zip(mu, sigma)]


# --------------------------------------------------------------------------------------------------
# CEM steps for one object
# --------------------------------------------------------------------------------------------------
_RING = np.array([(0, 1), (1, 1), (1, 0), (1, -1), (0, -1), (-1, -1), (-1, 0), (-1, 1)])  # clockwise from east
_RING_INDEX = {tuple(d): i for i, d in enumerate(_RING)}


def trace_contour(obj: np.ndarray) -> np.ndarray:
    """Ordered external contour of one 8-connected object: Moore-neighbour boundary tracing.

    Stands in for the code's OpenCV ``findContours(RETR_EXTERNAL, CHAIN_APPROX_NONE)``: every foreground pixel of
    the outer border, in 8-connected order (clockwise on screen), from the top-most, left-most pixel, without
    simplification. A pixel on a 1-px-wide part is listed once per pass, as OpenCV does; holes are ignored.
    Stops when the tracer leaves the start pixel towards the second pixel again (Jacob's criterion).

    Args:
        obj: [H, W] bool, one 8-connected component (more components: only the first in raster order is traced).

    Returns:
        [l, 2] int64 (row, col); l = 1 for a single pixel, 0 rows for an empty mask.
    """
    obj = np.pad(np.asarray(obj, dtype=bool), 1)
    fg = np.argwhere(obj)
    if len(fg) == 0:
        return np.zeros((0, 2), dtype=np.int64)
    start = fg[0]  # raster order: its west and north neighbours are background
    contour, p, back = [start], start, 4  # back: direction from p to the last background pixel examined
    for _ in range(4 * obj.size):
        for k in range(1, 9):
            q = p + _RING[(back + k) % 8]
            if obj[q[0], q[1]]:
                break
        else:
            break  # a single pixel
        background = p + _RING[(back + k - 1) % 8]
        if len(contour) > 1 and (p == start).all() and (q == contour[1]).all():
            contour.pop()  # the start pixel appended on the way back
            break
        contour.append(q)
        p, back = q, _RING_INDEX[tuple(background - q)]
    return np.asarray(contour, dtype=np.int64) - 1


def bias_sequence(length: int, noise: SiteNoise, rng: np.random.Generator, max_draws: int = MAX_DRAWS
                  ) -> tuple[np.ndarray, int]:
    """Smooth bias b_0..b_{l-1} along a contour of ``length`` pixels (paper §3.2; steps 2-4 of the CEM).

    Draws N(mu, sigma^2) at the 30 indices ``k * floor(l/30)``, appends the closure point (index l, value of
    index 0), fits a degree-10 polynomial by weighted least squares (weights 10 on the first and the closure
    point, 1 otherwise), evaluates it at 0..l-1 and clips to +-30 px; redrawn until |b_0 - b_{l-1}| < 3 px.
    The fit runs on the rescaled index t = 2k/l - 1 (the same polynomial space, hence the same fit, without
    the ill-conditioned powers k^10). After ``max_draws`` draws the last one is kept: the code loops without a
    cap, which never ends on short contours, where the last sample (index 29 * floor(l/30)) lies far from l and
    the degree-10 fit swings between them (l = 40..59: under 1 draw in 300 closes; l = 80: 1 in 300).

    Returns:
        ([length] float64 biases in px, number of draws used).

    Raises:
        ValueError: length < 30 (the code returns a malformed value there; :func:`evolve_object` keeps such
            objects unchanged), max_draws < 1.
    """
    if length < NUM_SAMPLES:
        raise ValueError(f"length must be >= {NUM_SAMPLES} contour pixels, got {length}")
    if max_draws < 1:
        raise ValueError(f"max_draws must be >= 1, got {max_draws}")
    index = np.append(np.arange(NUM_SAMPLES) * (length // NUM_SAMPLES), length).astype(np.float64)
    weights = np.ones(NUM_SAMPLES + 1)
    weights[[0, -1]] = CLOSURE_WEIGHT
    t_all = 2.0 * np.arange(length) / length - 1.0
    for draw in range(1, max_draws + 1):
        samples = rng.normal(noise.mu, noise.sigma, size=NUM_SAMPLES)
        coef = P.polyfit(2.0 * index / length - 1.0, np.append(samples, samples[0]), POLY_DEGREE, w=weights)
        bias = np.clip(P.polyval(t_all, coef), -MAX_BIAS, MAX_BIAS)
        if abs(bias[0] - bias[-1]) < MAX_CLOSURE_GAP:
            break
    return bias, draw


def contour_normals(contour: np.ndarray, half_window: int = NORMAL_HALF_WINDOW) -> np.ndarray:
    """Unit normal at each contour pixel from a least-squares line through its +-``half_window`` neighbours (code).

    The neighbours wrap around the closed contour. The line regresses row on col when the cols vary more
    (variance), else col on row; the normal is perpendicular to it. A normal with |d_row / d_col| >= 20 (a tangent
    slope |k| <= 0.05) is snapped to vertical, as the code does; its sign is arbitrary (see :func:`outward_normals`).

    Args:
        contour: [l, 2] (row, col).

    Returns:
        [l, 2] float64 unit vectors (d_row, d_col).
    """
    pts = np.asarray(contour, dtype=np.float64)
    idx = (np.arange(len(pts))[:, None] + np.arange(-half_window, half_window + 1)[None, :]) % len(pts)
    y, x = pts[idx, 0], pts[idx, 1]
    y, x = y - y.mean(1, keepdims=True), x - x.mean(1, keepdims=True)
    vx, vy, cov = (x * x).mean(1), (y * y).mean(1), (x * y).mean(1)
    along_x = vx >= vy
    with np.errstate(divide="ignore", invalid="ignore"):
        k = np.where(along_x, cov / vx, 0.0)  # row = k col + c: tangent (dr, dc) = (k, 1), normal (1, -k)
        m = np.where(along_x, 0.0, cov / vy)  # col = m row + c: tangent (1, m), normal (-m, 1)
    normal = np.where(along_x[:, None], np.stack([np.ones_like(k), -k], 1), np.stack([-m, np.ones_like(m)], 1))
    normal = np.nan_to_num(normal)  # a degenerate window (all neighbours on one pixel)
    vertical = np.abs(normal[:, 1]) * VERTICAL_SLOPE <= np.abs(normal[:, 0])
    normal[vertical] = (1.0, 0.0)
    return normal / np.linalg.norm(normal, axis=1, keepdims=True)


def _lookup(mask: np.ndarray, pts: np.ndarray) -> np.ndarray:
    """mask at integer (row, col) points; outside the image counts as background."""
    r, c = pts[..., 0], pts[..., 1]
    inside = (r >= 0) & (r < mask.shape[0]) & (c >= 0) & (c < mask.shape[1])
    out = np.zeros(r.shape, dtype=bool)
    out[inside] = mask[r[inside], c[inside]]
    return out


def outward_normals(obj: np.ndarray, contour: np.ndarray, normals: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Orient the normals outward by probing 1..5 px along +-normal for a label flip (code).

    At the first step s where ``obj`` differs at round(p + s n) and round(p - s n), the side on the background is
    outside. Pixels without a flip within 5 px get no direction (the code skips them).

    Returns:
        ([l, 2] float64 outward unit normals, [l] bool: a side was found).
    """
    steps = np.arange(1, PROBE_STEPS + 1, dtype=np.float64)[None, :, None]
    p, n = contour[:, None, :].astype(np.float64), normals[:, None, :]
    plus = _lookup(obj, np.rint(p + steps * n).astype(np.int64))
    minus = _lookup(obj, np.rint(p - steps * n).astype(np.int64))
    flip = plus != minus
    found = flip.any(1)
    first = flip.argmax(1)
    plus_is_inside = plus[np.arange(len(contour)), first]
    return np.where(plus_is_inside[:, None], -normals, normals), found


def move_contour(obj: np.ndarray, contour: np.ndarray, bias: np.ndarray, outward: np.ndarray, found: np.ndarray
                 ) -> np.ndarray:
    """Move each contour pixel by b_k px along its outward normal (b_k < 0: inward), rounded, clipped (code).

    Skipped (as the code): pixels without a side (``found`` False), moves with b > 1 that land on the object
    (an outward move into a concavity) and moves with b <= -1 that land on background.

    Returns:
        [m, 2] int64 moved (row, col), in contour order, m <= l.
    """
    moved = np.rint(contour + bias[:, None] * outward).astype(np.int64)
    moved[:, 0] = np.clip(moved[:, 0], 0, obj.shape[0] - 1)
    moved[:, 1] = np.clip(moved[:, 1], 0, obj.shape[1] - 1)
    on_object = obj[moved[:, 0], moved[:, 1]]
    keep = found & ~((bias > 1) & on_object) & ~((bias <= -1) & ~on_object)
    return moved[keep]


def fill_contour(points: np.ndarray, shape: tuple[int, int]) -> np.ndarray:
    """[H, W] bool: the polygon through ``points`` filled, outline included (like OpenCV drawContours FILLED)."""
    out = np.zeros(shape, dtype=bool)
    rr, cc = polygon(points[:, 0], points[:, 1], shape)
    out[rr, cc] = True
    rr, cc = polygon_perimeter(points[:, 0], points[:, 1], shape)
    out[rr, cc] = True
    return out


class ObjectResult(NamedTuple):
    mask: np.ndarray  # [H, W] bool, the noisy object
    evolved: bool  # False: kept unchanged (contour < 30 px or < 3 moved points)
    draws: int  # bias draws used (0 when the contour is too short)
    closed: bool  # the bias sequence met |b_0 - b_{l-1}| < 3 px (False: MAX_DRAWS reached, last draw kept)


def evolve_object(obj: np.ndarray, noise: SiteNoise, rng: np.random.Generator) -> ObjectResult:
    """The CEM on one 8-connected object (FedA3I's CEM, steps 1-7).

    Contours shorter than 30 px (where the code returns a malformed tuple) and objects left with fewer than 3
    moved points are returned unchanged (``evolved`` False) and consume no further random numbers.

    Args:
        obj: [H, W] bool, a single 8-connected component.
    """
    obj = np.asarray(obj, dtype=bool)
    contour = trace_contour(obj)
    if len(contour) < NUM_SAMPLES:
        return ObjectResult(obj.copy(), False, 0, True)
    contour = np.roll(contour, -int(rng.integers(len(contour))), axis=0)
    bias, draws = bias_sequence(len(contour), noise, rng)
    outward, found = outward_normals(obj, contour, contour_normals(contour))
    moved = move_contour(obj, contour, bias, outward, found)
    closed = bool(abs(bias[0] - bias[-1]) < MAX_CLOSURE_GAP)
    if len(moved) < 3:
        return ObjectResult(obj.copy(), False, draws, closed)
    return ObjectResult(fill_contour(moved, obj.shape), True, draws, closed)


# --------------------------------------------------------------------------------------------------
# Whole masks
# --------------------------------------------------------------------------------------------------
def _binary(mask) -> tuple[np.ndarray, np.ndarray]:
    """(bool foreground, sorted distinct values); ValueError for a non-2-D or non-binary mask."""
    mask = np.asarray(mask)
    if mask.ndim != 2:
        raise ValueError(f"mask must be 2-D [H, W], got shape {mask.shape}")
    values = np.unique(mask)
    if len(values) > 2:
        shown = ", ".join(str(v) for v in values[:6]) + (", ..." if len(values) > 6 else "")
        raise ValueError(f"mask must be binary (two values, e.g. {{0, 255}}), got {len(values)} values: {shown}")
    # two values: the larger is foreground; one value: all foreground unless it is 0 / False
    return (mask == values[-1]) if len(values) == 2 else (mask != 0), values


class NoisyLabel(NamedTuple):
    mask: np.ndarray  # [H, W], the input's dtype and values (background = smaller value, foreground = larger)
    objects: int  # 8-connected components of the clean mask
    evolved: int  # components moved by the CEM
    dropped: int  # components under MIN_AREA px, removed
    unchanged: int  # components kept as they are (contour < 30 px, or < 3 points left after the moves)
    capped_draws: int  # components whose bias sequence hit MAX_DRAWS without closing (last draw kept)


def _evolve_foreground(fg: np.ndarray, noise: SiteNoise, rng: np.random.Generator) -> tuple[np.ndarray, tuple]:
    """(noisy [H, W] bool, (objects, evolved, dropped, unchanged, capped_draws)) for a bool foreground."""
    labels, n = ndimage.label(fg, structure=np.ones((3, 3), dtype=int))
    out = np.zeros_like(fg)
    if n == 0:
        return out, (0, 0, 0, 0, 0)
    areas = np.bincount(labels.ravel())[1:]
    slices = ndimage.find_objects(labels)
    evolved = dropped = capped = 0
    for i in np.argsort(-areas, kind="stable"):
        if areas[i] < MIN_AREA:
            dropped += 1
            continue
        # crop to the object plus the largest move (30 px) and a margin: the same result, less work
        sl = tuple(slice(max(s.start - int(MAX_BIAS) - 2, 0), s.stop + int(MAX_BIAS) + 2) for s in slices[i])
        res = evolve_object(labels[sl] == i + 1, noise, rng)
        out[sl] |= res.mask
        evolved += res.evolved
        capped += not res.closed
    return out, (n, evolved, dropped, n - dropped - evolved, capped)


def noisy_label(mask: np.ndarray, noise: SiteNoise, rng: np.random.Generator) -> NoisyLabel:
    """A noisy version of a binary ``mask`` under C(mu, sigma), with per-object counts (FedA3I's CEM, step 8).

    Components are 8-connected (OpenCV's default), processed largest first (ties: raster order); those under
    15 px are dropped, the others evolved by :func:`evolve_object` and OR-ed. A mask without foreground comes back
    unchanged (``objects`` 0; the caller may warn). Foreground is the larger of two values ({0, 1}, {0, 255},
    bool); a one-valued mask is all background if that value is 0, else all foreground.

    Args:
        mask: [H, W] bool or integer, at most two distinct values.

    Raises:
        ValueError: a mask that is not 2-D or has more than two values (names them).
    """
    fg, values = _binary(mask)
    mask = np.asarray(mask)
    out, counts = _evolve_foreground(fg, noise, rng)
    if counts[0] == 0:
        return NoisyLabel(mask.copy(), *counts)
    if mask.dtype != bool:
        bg, fg_value = (values[0], values[-1]) if len(values) == 2 else (0, values[0])
        out = np.where(out, fg_value, bg).astype(mask.dtype)
    return NoisyLabel(out, *counts)


def evolve_mask(mask: np.ndarray, noise: SiteNoise, rng: np.random.Generator) -> np.ndarray:
    """[H, W] bool: the noisy foreground of a binary ``mask`` under C(mu, sigma) (as :func:`noisy_label`).

    Raises:
        ValueError: as :func:`noisy_label`.
    """
    return _evolve_foreground(_binary(mask)[0], noise, rng)[0]


def dice(a: np.ndarray, b: np.ndarray) -> float:
    """Dice of two [H, W] foregrounds (nonzero = foreground); 1.0 when both are empty.

    Raises:
        ValueError: the shapes differ.
    """
    a, b = np.asarray(a) != 0, np.asarray(b) != 0
    if a.shape != b.shape:
        raise ValueError(f"dice: shapes differ, {a.shape} vs {b.shape}")
    total = int(a.sum()) + int(b.sum())
    return 1.0 if total == 0 else 2.0 * int((a & b).sum()) / total
