"""The README's main job with every memory saving on, against the plain job, on four seeds: what the savings cost in
validation perplexity.

The main job (`scripts/pretrain.py` at its defaults: POET-BS on the tiny preset, 200 steps, a merge every 50, the
recipe's clip at 1.0), then the same command with ``--base_quantization nf4 --optim adamw_bnb_8bit
--fused_optimizer_step --activation_checkpointing``: the clip left at the recipe's default, which the fused steps apply
against their running global-norm estimate (`poet_hf.training.FusedStepOptimizer`). Each run in its own process, as a
user types it.

The same again with the head and the input embeddings stored in bfloat16 (``--vocab_weights_dtype bfloat16``,
stochastic rounding: `poet_hf.training.bf16_storage`), the saving that changes the arithmetic at large vocabularies.

Beside them, the plain job again with ``--optim adamw_torch``, torch's for-each AdamW in place of its fused one
(transformers' default): the same update rounded differently in the last bits, which shows how far 200 steps with
four merges carry such differences.
"""

from __future__ import annotations

from benchmarks.common import readme_job_results

EVERYTHING_ON = ["--base_quantization", "nf4", "--optim", "adamw_bnb_8bit", "--fused_optimizer_step"]
EVERYTHING_ON += ["--activation_checkpointing"]
VARIANTS = {
    "plain": [],
    "plain, other rounding": ["--optim", "adamw_torch"],
    "everything on": EVERYTHING_ON,
    "everything on, bfloat16 head and embeddings": [*EVERYTHING_ON, "--vocab_weights_dtype", "bfloat16"],
}
SEEDS = (0, 1, 2, 3)


def run(quick: bool = False) -> list[dict]:
    """One row per seed and variant: validation perplexity, its gap to the plain run of the same seed, the clip."""
    rows = []
    for seed in SEEDS:
        reference = None
        for name, flags in VARIANTS.items():
            results = readme_job_results([*flags, "--seed", str(seed)], quick)
            perplexity = results["val_perplexity"]
            reference = reference or perplexity
            rows.append(
                {
                    "run": name,
                    "seed": seed,
                    "steps": results["steps"],
                    "merges": results["merges"],
                    "max_grad_norm": results["recipe"]["max_grad_norm"],
                    "optimizer": results["recipe"]["optimizer"],
                    "fused steps": results["recipe"]["fused_optimizer_step"],
                    "val perplexity": perplexity,
                    "vs plain": perplexity / reference - 1,
                }
            )
    return rows
