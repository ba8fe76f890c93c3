"""Runs built on the library: pretraining and fine-tuning runs, their presets, the vision training run, the scripts'
options and the memory planner.

The scripts in ``scripts/`` are thin command lines over these; `poet_hf.training` (the Trainer, its callback and
arguments, the optimizers) knows nothing of them.
"""
