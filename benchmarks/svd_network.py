"""The auxiliary-reflection paper's SVD network (its §5.1 / Figure 3) on the bundled digits: each orthogonal map's
final validation error and time per epoch, against the auxiliary reflection in the same run.

``poet_hf.vision.svd_network.run_svd_experiment`` at ``scripts/svd_network.py``'s defaults (64-wide, 3 SVD layers,
20 epochs, Adam 1e-3, batch 64, seed 0) on one thread, as docs/vision.md quotes it. The paper's 784-wide MNIST-5k
run fetches its data and takes tens of minutes; it is not part of the suite.
"""

from __future__ import annotations

import tempfile

SETTINGS = {"dataset": "digits", "epochs": 20, "threads": 1, "seed": 0}


def run(quick: bool = False) -> list[dict]:
    """One row per orthogonal map: final validation error, seconds per epoch, time against the auxiliary reflection."""
    from poet_hf.vision.svd_network import SvdExperimentArgs, run_svd_experiment

    with tempfile.TemporaryDirectory() as out:
        args = SvdExperimentArgs(epochs=2 if quick else SETTINGS["epochs"], threads=SETTINGS["threads"], output_dir=out)
        results = run_svd_experiment(args)
    return [
        {
            "method": method,
            "features": results["features"],
            "epochs": args.epochs,
            "final_val_error": result["final_val_error"],
            "seconds_per_epoch": result["seconds_per_epoch"],
            "time_vs_auxiliary": result["time_vs_auxiliary"],
        }
        for method, result in results["runs"].items()
    ]
