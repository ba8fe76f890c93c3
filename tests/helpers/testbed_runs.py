"""Fine-tuning runs on the pretrained testbed LM (benchmarks/testbed.py), for the tests marked ``testbed``."""

from __future__ import annotations

import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def testbed_model_and_corpus():
    """The pretrained causal LM of the testbed and its fine-tuning domain (built on first use, cached; one thread, as
    the xdist worker it runs on)."""
    sys.path.insert(0, str(ROOT))
    from benchmarks import testbed

    return testbed.ensure_causal_lm(threads=1), testbed.milton_corpus()


def run_on_testbed(testbed, tmp_path, *, evaluate_at: tuple[int, ...] = (), **fields) -> tuple[dict, dict[int, float]]:
    """``run_finetuning`` on the testbed at FinetuneArguments' defaults but for ``fields``, evaluated before, after,
    and at the steps in ``evaluate_at`` (each evaluation costs about as much as 3 training steps)."""
    from transformers import TrainerCallback

    from poet_hf.recipes.finetune import parse_finetune_arguments, run_finetuning

    class EvaluateAt(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            control.should_evaluate = control.should_evaluate or state.global_step in evaluate_at

    model, data = testbed
    args, training = parse_finetune_arguments(
        model_name_or_path=str(model),
        dataset=str(data),
        output_dir=str(tmp_path),
        max_eval_samples=64,
        logging_steps=1000,
        disable_tqdm=True,
        **fields,
    )
    results = run_finetuning(args, training, callbacks=[EvaluateAt()])
    history = results["trainer"].state.log_history
    return results, {log["step"]: log["eval_loss"] for log in history if "eval_loss" in log}
