"""The rotation family: what POET and OFT share, the two thin siblings `poet_hf.tuners.poet` and
`poet_hf.tuners.oft` beside it.

- `model`: the tuner base (`RotationModel`: merges, `merge_and_reinit`, saved base weights);
- `layer`: the layer base (`RotationLayer`: adapter state, merge / unmerge), with `block_sizes` resolving each
  side's block size;
- `base_weight`: the frozen weight ``W0`` a layer reads and folds into; `quantization`, `quantized_rows` and
  `low_precision` for bitsandbytes 4/8-bit and 16-bit bases, `residual_store` and `residual_folder` for their
  rounding residuals, `row_fold` and `dense_reload` for folding and reloading them;
- `forward`: the forward (weight or activation strategy), with `caches` holding the per-step rotation caches and
  accumulation windows;
- `state_checks`: the checks of a saved adapter against the model it is loaded into.
"""
