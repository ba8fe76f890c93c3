"""Command lines over ``TrainingArguments``: every Trainer flag, with a recipe's values as defaults.

The training scripts parse two dataclasses with ``transformers.HfArgumentParser``: their own options (model, method,
data, …) and a training-arguments class (`poet_hf.training.PoetTrainingArguments` for POET and OFT,
``TrainingArguments`` for the vision models), so every ``TrainingArguments`` flag works (``--bf16``,
``--activation_checkpointing``, ``--torch_compile``, ``--optim``, ``--per_device_train_batch_size``, ``--report_to``,
``--push_to_hub``, …) and ``--help`` lists it. A recipe (a pretraining preset, a fine-tuning method) decides the
defaults of some of those flags; `parse_arguments` reads what the user gave first, asks the script's ``defaults``
function for the rest, and makes them the parser's defaults, so ``--help`` shows the values a run would use and a flag
the user types always wins.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import io
import re
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, TypedDict, TypeVar, cast

from transformers import HfArgumentParser, TrainingArguments

from .argument_errors import OneLineErrorParser

ScriptArgs = TypeVar("ScriptArgs")
TrainingArgs = TypeVar("TrainingArgs", bound=TrainingArguments)
SCRIPT_SEED = 0  # the scripts' default --seed (transformers' is 42): data order, initialisation, permutations


class TrainingFlags(TypedDict, total=False):
    """The training flags a command line (or a caller) set, by ``TrainingArguments`` field name.

    The flags a recipe reads are typed here; any other flag set rides along untyped (``--bf16``, ``--report_to``, …,
    and ``--merge_every``, whose home is `poet_hf.training.PoetTrainingArguments`).
    """

    max_steps: int
    per_device_train_batch_size: int
    gradient_accumulation_steps: int | None
    learning_rate: float
    poet_learning_rate: float | None
    max_grad_norm: float
    weight_decay: float
    warmup_steps: int
    optim: str
    lr_scheduler_type: str
    fused_optimizer_step: bool
    vocab_weights_dtype: str
    seed: int
    save_steps: float
    eval_steps: float | None


class ScriptArgumentParser(OneLineErrorParser, HfArgumentParser):
    """``HfArgumentParser`` whose argument errors are one line naming the flag (`OneLineErrorParser`)."""


# (the script's options, the training flags the user gave) -> the defaults of the other training flags
DefaultsFunction = Callable[[ScriptArgs, TrainingFlags], dict[str, object]]


def parse_arguments(
    script_class: type[ScriptArgs],
    defaults: DefaultsFunction[ScriptArgs],
    argv: Sequence[str] | None = None,
    fields: dict[str, object] | None = None,
    training_class: type[TrainingArgs] = TrainingArguments,  # type: ignore[assignment]
) -> tuple[ScriptArgs, TrainingArgs]:
    """The script's options and its training arguments, from a command line or from keyword fields.

    Args:
        script_class: the dataclass of the script's own options.
        defaults: gives the defaults of the training flags the user did not set (the recipe's).
        argv: the command line (``None``: ``sys.argv[1:]``); ignored when ``fields`` is given.
        fields: instead of a command line, field values of either dataclass (for Python callers).
        training_class: the training-arguments dataclass: ``transformers.TrainingArguments`` (the default), or
            `poet_hf.training.PoetTrainingArguments` for the POET/OFT scripts.

    Returns:
        ``(script options, training arguments)``.

    Raises:
        ValueError: from ``fields``, one that belongs to neither dataclass or is invalid.
        SystemExit: from a command line, an invalid option, after one line naming it (exit status 2, as argparse's own
            errors).
    """
    if fields is not None:
        return _from_fields(script_class, defaults, fields, training_class)
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = training_parser(script_class, training_class)
    try:
        return _from_command_line(parser, script_class, defaults, argv, training_class)
    except ValueError as error:
        parser.exit(2, f"{parser.prog}: error: {flag_message(str(error), parser)}\n")


def flag_message(message: str, parser: argparse.ArgumentParser) -> str:
    """A field's error in the command line's words: each field it names in backticks that is a flag becomes the flag
    ("`block_size` must be …" reads "--block_size must be …")."""
    flags = {action.dest for action in parser._actions}
    return re.sub(r"`(\w+)`", lambda match: f"--{match[1]}" if match[1] in flags else match[0], message)


def _from_command_line(
    parser: HfArgumentParser,
    script_class: type[ScriptArgs],
    defaults: DefaultsFunction[ScriptArgs],
    argv: list[str],
    training_class: type[TrainingArgs],
) -> tuple[ScriptArgs, TrainingArgs]:
    script_args = _script_options(script_class, argv)
    given = given_training_flags(argv, training_class)
    values = {} if script_args is None else defaults(script_args, given)
    # For --help; argparse runs a string default through the flag's type, so one it cannot read (transformers parses
    # include_num_input_tokens_seen as a bool, the recipe says "all") is only applied below.
    parser.set_defaults(**{name: value for name, value in values.items() if _readable(parser, name, value)})
    namespace = parser.parse_args(args=argv)
    for name, value in values.items():
        if name not in given:
            setattr(namespace, name, value)
    parsed = vars(namespace)
    return script_class(**_init_fields(script_class, parsed)), training_class(**_init_fields(training_class, parsed))


def training_parser(script_class: type, training_class: type = TrainingArguments) -> HfArgumentParser:
    """The parser of a training script: its own options, then every flag of ``training_class``.

    The flags come without the recipe's defaults, which `parse_arguments` sets. The usage line is one line: argparse
    would list every flag of both classes in it, well over a hundred lines before the first option's help."""
    usage = f"%(prog)s [options]  (its own options first, then every {training_class.__name__} flag)"
    return ScriptArgumentParser(cast(Any, (script_class, training_class)), usage=usage)


def _init_fields(cls: type, values: dict[str, Any]) -> dict[str, Any]:
    names = {f.name for f in dataclasses.fields(cls) if f.init}
    return {name: value for name, value in values.items() if name in names}


def _readable(parser: argparse.ArgumentParser, name: str, value: object) -> bool:
    """Whether argparse can take ``value`` as the default of flag ``name``."""
    action = next((a for a in parser._actions if a.dest == name), None)
    if action is None or not isinstance(value, str) or action.type is None or not callable(action.type):
        return action is not None
    try:
        action.type(value)
    except (TypeError, ValueError, argparse.ArgumentTypeError):
        return False
    return True


def _script_options(script_class: type[ScriptArgs], argv: list[str]) -> ScriptArgs | None:
    """The script's own options, read first and quietly.

    An error is the full parser's to report, with every option. For ``--help``, required options the line leaves out get
    placeholders, so the help shows the recipe's defaults."""
    if {"-h", "--help"} & set(argv):
        argv = [a for a in argv if a not in ("-h", "--help")]
        for f in dataclasses.fields(script_class):  # type: ignore[arg-type]
            required = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            if required and f"--{f.name}" not in argv:
                argv += [f"--{f.name}", f.name.upper()]
    own = HfArgumentParser(cast(Any, script_class), add_help=False)
    try:
        with contextlib.redirect_stderr(io.StringIO()):
            return own.parse_args_into_dataclasses(args=argv, return_remaining_strings=True)[0]
    except SystemExit:
        return None


def given_training_flags(argv: Sequence[str] | None, training_class: type = TrainingArguments) -> TrainingFlags:
    """The fields of ``training_class`` the command line sets, with their values (the others are absent)."""
    probe = ScriptArgumentParser(cast(Any, training_class), add_help=False)
    for action in probe._actions:
        action.default = argparse.SUPPRESS
    return cast(TrainingFlags, vars(probe.parse_known_args(args=argv)[0]))


def _from_fields(
    script_class: type[ScriptArgs],
    defaults: DefaultsFunction[ScriptArgs],
    fields: dict[str, object],
    training_class: type[TrainingArgs],
) -> tuple[ScriptArgs, TrainingArgs]:
    script_names = {f.name for f in dataclasses.fields(script_class)}  # type: ignore[arg-type]
    training_names = {f.name for f in dataclasses.fields(training_class) if f.init}
    unknown = set(fields) - script_names - training_names
    if unknown:
        raise ValueError(
            f"unknown field(s) {sorted(unknown)}: not options of {script_class.__name__} nor of "
            f"{training_class.__name__}"
        )
    script_args = script_class(**{k: v for k, v in fields.items() if k in script_names})
    given = cast(TrainingFlags, {k: v for k, v in fields.items() if k in training_names and k not in script_names})
    return script_args, training_arguments(training_class, {**defaults(script_args, given), **given})


def training_arguments(training_class: type[TrainingArgs], values: Mapping[str, object]) -> TrainingArgs:
    """``training_class(**values)``: field values of any type, which the dataclass's own checks read.

    Args:
        training_class: a ``TrainingArguments`` class.
        values: its field values.

    Returns:
        The training arguments.
    """
    return training_class(**cast("dict[str, Any]", values))


def check_cpu_mixed_precision(training: TrainingArguments) -> None:
    """Refuse ``--fp16``, and ``--bf16`` where torch's kernels cannot run it, on a CPU, before the run starts.

    On a CPU, ``--bf16`` trains under ``torch.autocast("cpu", torch.bfloat16)``. torch's bfloat16 attention kernels
    for CPUs pack their operands with AVX-512 instructions (for heads of 32 dimensions or fewer they always do), so
    on a CPU without AVX-512 the first forward fails inside torch. ``--fp16`` on a CPU is ignored by Accelerate: the
    run would silently train in float32.

    Args:
        training: the run's training arguments.

    Raises:
        ValueError: the run is on a CPU and ``fp16`` is set, or ``bf16`` is set and torch's CPU capability is not
            AVX-512.
    """
    import torch

    if torch.cuda.is_available() and not training.use_cpu:
        return
    if training.fp16:
        raise ValueError(
            "`fp16` on a CPU: Accelerate does not autocast to float16 on CPUs, so the run would silently train in "
            "float32; use --bf16 on a CPU (or torch.autocast('cpu', torch.float16) in your own loop), --fp16 on a GPU"
        )
    capability = torch.backends.cpu.get_cpu_capability()
    if training.bf16 and not capability.startswith("AVX512"):
        raise ValueError(
            f"`bf16` on this CPU (torch capability {capability}): torch's bfloat16 attention kernels for CPUs need "
            "AVX-512, which it lacks; train in float32 (drop --bf16), or on a GPU or an AVX-512 CPU"
        )


def flag_value(given: TrainingFlags, flag: str, default: str | None = None) -> str:
    """A training flag of ``given`` as the command line spells it (``OptimizerNames.ADAMW_TORCH``: ``"adamw_torch"``);
    absent, ``default``, else ``TrainingArguments``' own default."""
    value = given.get(flag, default if default is not None else TrainingArguments.__dataclass_fields__[flag].default)
    return str(getattr(value, "value", value))


def run_defaults(given: TrainingFlags, **values: object) -> dict[str, object]:
    """The defaults every training script shares, then ``values``.

    No checkpoints unless ``--save_steps`` or ``--save_strategy`` asks for them; seed `SCRIPT_SEED`, and ``data_seed``
    follows ``--seed``; the CPU where no GPU is."""
    import torch

    return {
        "save_strategy": "steps" if "save_steps" in given else "no",
        "seed": SCRIPT_SEED,
        "data_seed": given.get("seed", SCRIPT_SEED),
        "use_cpu": not torch.cuda.is_available(),
        "report_to": "none",
        **values,
    }
