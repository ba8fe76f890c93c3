"""What each fused strategy of `rotated_linear` costs: multiply-adds and kept bytes, from the shapes alone.

`strategy_costs` counts them and `auto_strategy` is how ``forward="auto"`` chooses a strategy per call;
`polynomial_products` counts the orthogonal map's evaluation (the Cayley–Neumann polynomial) by the call's place in
an optimizer step;
`rotation_cache_choice` is how ``cache_rotations="auto"`` decides whether a layer keeps its rotations across the
micro-batches of a step.
"""

from __future__ import annotations

from dataclasses import dataclass

from .map_protocol import OrthogonalMap
from .rotated_linear import ACTIVATION, ACTIVATION_RECOMPUTE, WEIGHT
from .spo import SideSpec

__all__ = [
    "CacheChoice",
    "admissible_strategies",
    "auto_strategy",
    "polynomial_products",
    "rotation_cache_choice",
    "strategy_costs",
]

CACHE_MIN_SAVING = 0.10  # a deferred micro-batch must skip at least this share of the layer's multiply-adds
CACHE_MAX_HOLD = 2.0  # and the cache may hold at most this multiple of the rotations' state on the process
KEEP_MIN_SAVING = 0.10  # forward="auto" keeps h only where that skips at least this share of the layer's work
KEEP_MIN_WIDTH = 2048  # and both of the layer's widths are at least this (docs/benchmarks.md, POET layer)
ROTATION_STATE_BYTES = 16  # per rotation parameter: float32 parameter, gradient and Adam's two moments


def polynomial_products(orthogonal_map: OrthogonalMap, block_size: int, phase: str) -> int:
    """Batched ``b × b`` products of the orthogonal map (the Cayley–Neumann polynomial) that one training call pays.

    They depend on the call's place in the optimizer step (`RotationCache`):

    - ``"uncached"``: built in the forward, rebuilt in the backward, and its VJP (no accumulation window);
    - ``"building"``: the window's first micro-batch builds the blocks, its VJP is deferred;
    - ``"deferred"``: the blocks come from the cache, the VJP is deferred: nothing;
    - ``"closing"``: the window's last micro-batch rebuilds once for the VJP of the accumulated sum.

    Over a window of ``k`` micro-batches that is ``2·forward + VJP`` per optimizer step, as for one uncached call.

    Args:
        orthogonal_map: the map (`OrthogonalMap.product_count`).
        block_size: the blocks' side ``b``.
        phase: the call's place in the step, one of the four above.

    Returns:
        The number of products.
    """
    forward, vjp = orthogonal_map.product_count(block_size)
    return {"uncached": 2 * forward + vjp, "building": forward, "deferred": 0, "closing": forward + vjp}[phase]


def strategy_costs(
    tokens: int,
    d_in: int,
    d_out: int,
    input_side: SideSpec | None,
    output_side: SideSpec | None,
    training: bool,
    dequantize_cost: float = 0.0,
    polynomial: int = 0,
) -> dict[str, dict[str, float]]:
    """Multiply-adds (``"macs"``) and floats kept beyond the layer input (``"kept"``) of each strategy.

    For one call with ``tokens`` rows. ``polynomial`` is the number of batched ``b × b`` products the call pays for
    the Cayley–Neumann polynomial (`polynomial_products`; 0 leaves it out), ``b³`` multiply-adds per block and side.

    With ``N = d_in·d_out``, ``ρ_W`` one side's rotation of the weight (``b·N`` for a block side, ``b²·d_other`` for
    a fully stochastic one) and ``ρ_T`` its rotation of ``T`` rows (``b·T·d`` or ``b²·T``), in training:

    - ``weight``: ``3·T·N`` (``y``, ``∂L/∂x``, ``∂L/∂W_eff = gᵀx``) + ``3·ρ_W(R) + (3 or 4)·ρ_W(P)`` (forward, rebuild,
      block gradient; P's side also carries the gradient through to R's). Keeps nothing.
    - ``activation``: ``2·T·N`` + ``3·ρ_T`` per side. Keeps ``h`` (``T × d_out``) when there is an output side.
    - ``activation-recompute``: as ``activation`` plus ``T·N + ρ_T(R)`` to recompute ``h``. Keeps nothing.

    Inference is ``T·N`` plus one rotation per side (of the weight, or of the rows).

    A quantised ``W0`` (`DenseWeight`) adds ``dequantize_cost·N`` per pass that needs it dense: the forward
    and the backward in training (every strategy), the forward in inference. It is the same for every strategy, so
    it moves the totals, never the choice. So does the polynomial: amortizing it over an accumulation window (a
    deferred micro-batch pays none of it) makes every strategy cheaper by the same amount.
    """
    passes = 2 if training else 1
    fixed = passes * dequantize_cost * d_in * d_out + polynomial * sum(
        spec.num_blocks * spec.block**3 for spec in (input_side, output_side) if spec is not None
    )
    return {
        name: {"macs": cost["macs"] + fixed, "kept": cost["kept"]}
        for name, cost in _rotation_costs(tokens, d_in, d_out, input_side, output_side, training).items()
    }


def admissible_strategies(costs: dict[str, dict[str, float]], d_in: int, d_out: int) -> list[str]:
    """The strategies ``forward="auto"`` may take by what they keep: `auto_strategy`'s memory bound.

    Those that keep nothing but the layer input, and, where both widths are at least `KEEP_MIN_WIDTH`, those that
    keep at most half as many floats as ``W0`` has entries (``T ≤ d_in / 2`` for ``activation``, which keeps ``h``,
    ``T × d_out``: the layer then holds at most 1.5 ``W0``'s worth, against the four of an AdamW-trained layer's
    weight, gradient and two moments).

    Args:
        costs: `strategy_costs` of the call.
        d_in: the layer's input width.
        d_out: the layer's output width.

    Returns:
        Their names, in the order of ``costs``.
    """
    limit = d_in * d_out / 2 if min(d_in, d_out) >= KEEP_MIN_WIDTH else 0.0
    return [name for name, cost in costs.items() if cost["kept"] <= limit]


def auto_strategy(costs: dict[str, dict[str, float]], d_in: int, d_out: int) -> str:
    """``forward="auto"``'s strategy from `strategy_costs`: the fewest multiply-adds, memory kept bounded.

    The cheapest strategy that keeps only the layer input, unless one that keeps more (`admissible_strategies`)
    needs at least `KEEP_MIN_SAVING` fewer multiply-adds. Narrower than `KEEP_MIN_WIDTH`, the activation strategy's
    gathers and small block products eat its counted saving, so there it keeps nothing. On a tie the strategy
    listed first wins.

    Args:
        costs: `strategy_costs` of the call.
        d_in: the layer's input width.
        d_out: the layer's output width.
    """
    # (macs, order, name) lists and plain mins, which Dynamo traces
    allowed = admissible_strategies(costs, d_in, d_out)
    ranked = [(cost["macs"], i, name) for i, (name, cost) in enumerate(costs.items()) if name in allowed]
    frugal = min([entry for entry in ranked if costs[entry[2]]["kept"] == 0])
    bounded = min(ranked)
    return bounded[2] if bounded[0] <= (1 - KEEP_MIN_SAVING) * frugal[0] else frugal[2]


def _rotation_costs(
    tokens: int, d_in: int, d_out: int, input_side: SideSpec | None, output_side: SideSpec | None, training: bool
) -> dict[str, dict[str, float]]:
    """`strategy_costs` for a dense ``W0``."""
    n = d_in * d_out
    rotate_weight = {
        side: spec.apply_cost(other)
        for side, spec, other in (("R", input_side, d_out), ("P", output_side, d_in))
        if spec is not None
    }
    rotate_rows = {
        side: spec.apply_cost(tokens) for side, spec in (("R", input_side), ("P", output_side)) if spec is not None
    }
    if not training:
        row_cost = tokens * n + sum(rotate_rows.values())
        return {
            WEIGHT: {"macs": tokens * n + sum(rotate_weight.values()), "kept": 0.0},
            ACTIVATION: {"macs": row_cost, "kept": 0.0},
            ACTIVATION_RECOMPUTE: {"macs": row_cost, "kept": 0.0},
        }
    weight = (
        3 * tokens * n + 3 * rotate_weight.get("R", 0) + (4 if "R" in rotate_weight else 3) * rotate_weight.get("P", 0)
    )
    activation = 2 * tokens * n + 3 * sum(rotate_rows.values())
    if "P" not in rotate_rows:  # nothing to keep: the two activation strategies are the same
        return {
            WEIGHT: {"macs": weight, "kept": 0.0},
            ACTIVATION: {"macs": activation, "kept": 0.0},
            ACTIVATION_RECOMPUTE: {"macs": activation, "kept": 0.0},
        }
    return {
        WEIGHT: {"macs": weight, "kept": 0.0},
        ACTIVATION: {"macs": activation, "kept": float(tokens * d_out)},
        ACTIVATION_RECOMPUTE: {"macs": activation + tokens * n + rotate_rows.get("R", 0), "kept": 0.0},
    }


@dataclass(frozen=True)
class CacheChoice:
    """Whether one layer caches its rotations across an accumulation window, and why (`rotation_cache_choice`).

    ``saving`` is the share of the layer's multiply-adds per micro-batch that a deferred micro-batch skips (the
    Cayley–Neumann polynomial: its build, rebuild and VJP); ``hold`` the cache's bytes over what the layer's
    rotations hold on this process (skew parameters, their gradients and Adam's two moments); ``cache_bytes`` the
    cache's bytes (blocks and pending gradient)."""

    cache: bool
    saving: float
    hold: float
    cache_bytes: int

    @property
    def reason(self) -> str:
        """One line: the choice and the two figures it rests on."""
        facts = f"a deferred micro-batch skips {self.saving:.1%} of the layer's multiply-adds; the cache would hold "
        facts += f"{self.hold:.1f}x the rotations' state on this process"
        if self.cache:
            return f"on: {facts}"
        limit = (
            f"below {CACHE_MIN_SAVING:.0%}"
            if self.saving < CACHE_MIN_SAVING
            else f"above the {CACHE_MAX_HOLD:.0f}x allowed"
        )
        return f"off: {facts} ({limit})"


def rotation_cache_choice(
    tokens: int,
    d_in: int,
    d_out: int,
    input_side: SideSpec | None,
    output_side: SideSpec | None,
    orthogonal_map: OrthogonalMap,
    shards: int = 1,
    block_bytes: int = 4,
    dequantize_cost: float = 0.0,
) -> CacheChoice:
    """Whether a layer's rotation cache pays for itself under gradient accumulation (``cache_rotations="auto"``).

    The cache spares every deferred micro-batch the polynomial (`polynomial_products` ``"uncached"``) and holds
    ``rows·b²`` blocks (``block_bytes`` each, the run's compute dtype) and their float32 pending gradient per side,
    unsharded. It is on when both hold:

    - it saves: the polynomial is at least `CACHE_MIN_SAVING` of the layer's multiply-adds per micro-batch (the
      cheapest strategy that keeps only the input, `strategy_costs`, plus the polynomial);
    - it is small: its bytes are at most `CACHE_MAX_HOLD` times the rotations' state on this process,
      `ROTATION_STATE_BYTES` per parameter divided by ``shards`` (FSDP2 and ZeRO-3 shard the state, not the cache).

    At the paper's 1 × 4096-token micro-batch and a 2048-wide layer the polynomial is about 2 % of a POET-BS layer's
    work, so the cache is off; at a few hundred tokens and a 512-wide layer it is about half, and the cache is on
    unless the state is sharded.

    Args:
        tokens: tokens per micro-batch through the layer.
        d_in: the layer's input width.
        d_out: the layer's output width.
        input_side: R's primitive, or ``None``.
        output_side: P's primitive, or ``None``.
        orthogonal_map: the sides' map (its products and its parameters per block).
        shards: processes the skew parameters are sharded over (1: replicated).
        block_bytes: bytes per entry of a cached block (the compute dtype's).
        dequantize_cost: a quantised ``W0``'s dequantisation cost per entry (`strategy_costs`).

    Returns:
        The [`CacheChoice`][poet_hf.orthogonal.strategy_costs.CacheChoice].
    """
    sides = [spec for spec in (input_side, output_side) if spec is not None]
    block = max(spec.block for spec in sides)
    polynomial = polynomial_products(orthogonal_map, block, "uncached")
    costs = strategy_costs(
        tokens, d_in, d_out, input_side, output_side, True, dequantize_cost=dequantize_cost, polynomial=polynomial
    )
    layer = min(cost["macs"] for cost in costs.values() if cost["kept"] == 0)
    saved = polynomial * sum(spec.num_blocks * spec.block**3 for spec in sides)
    cache_bytes = sum(spec.num_blocks * spec.block**2 for spec in sides) * (block_bytes + 4)
    state = (
        ROTATION_STATE_BYTES * sum(spec.num_blocks * orthogonal_map.num_params(spec.block) for spec in sides) / shards
    )
    saving, hold = saved / layer if layer else 0.0, cache_bytes / state if state else float("inf")
    return CacheChoice(saving >= CACHE_MIN_SAVING and hold <= CACHE_MAX_HOLD, saving, hold, cache_bytes)
