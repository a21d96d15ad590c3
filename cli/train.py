"""`metrale train-mtp`: give a model an MTP drafter by self-distillation.

Contract: the command loads the frozen model (never its existing MTP layers),
reads ``--data`` (text files, JSONL prompts the model answers itself, JSONL
prompt + completion pairs; see ``metrale.engine.train.data``), trains one head
with ``metrale.engine.train.trainer`` on ``--device`` (the model's: CUDA when
available, as everywhere) and writes ``OUT.safetensors`` (bfloat16) +
``OUT.json`` (the card: data, tokens, steps, time, held-out acceptance).
Generations, cached hidden states and checkpoints live in ``--work-dir``
(default ``OUT.work``): running the same command again after an interrupt
resumes. Progress bars show the stage, loss and trained tokens/s; held-out
acceptance is printed as training goes. Usage errors exit with 2.
"""

from __future__ import annotations

import datetime
import shlex
import time
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from metrale.cli.options import (
    DeviceOpt,
    DtypeOpt,
    ModelOpt,
    RevisionOpt,
    ThreadsOpt,
    config_error,
    load_error,
    option,
)
from metrale.engine.config import RuntimeConfig

if TYPE_CHECKING:  # torch loads only when a command runs, not for --help
    from metrale.engine.train.trainer import EvalReport, TrainConfig, TrainProgress

STDERR = Console(stderr=True)

# TrainConfig's fields are set by the flags of the same names; the generation
# batch is `--gen-batch` here.
TRAIN_FLAGS = {
    "num_slots": "--gen-batch",
    **{
        field: "--" + field.replace("_", "-")
        for field in (
            "epochs",
            "batch_tokens",
            "lr",
            "heldout",
            "prompt_weight",
            "feature_weight",
            "vocab",
            "draft_vocab",
        )
    },
}


def _progress(console: Console) -> Progress:
    return Progress(
        TextColumn("{task.description:<9}"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("loss {task.fields[loss]}"),
        TextColumn("{task.fields[rate]} tok/s"),
        TimeElapsedColumn(),
        TimeRemainingColumn(),
        console=console,
    )


def describe(report: EvalReport) -> str:
    by_depth = " ".join(f"d{i + 1} {a:.1%}" for i, a in enumerate(report.accepted))
    return (
        f"held-out acceptance {by_depth} ({report.positions} positions; "
        f"~{report.tokens_per_verify:.2f} tokens/verify at chain {len(report.accepted)})"
    )


def train_mtp_command(
    data: Annotated[
        list[Path], option("--data", "Training data: text files or JSONL (repeat the flag).")
    ],
    out: Annotated[Path, option("--out", "Head to write: OUT.safetensors + OUT.json.")],
    model: ModelOpt = None,
    revision: RevisionOpt = None,
    work_dir: Annotated[
        Path | None,
        option("--work-dir", "Generations, cached hidden states, checkpoints (default OUT.work)."),
    ] = None,
    epochs: Annotated[int, option("--epochs", "Passes over the training data.")] = 3,
    batch_tokens: Annotated[
        int, option("--batch-tokens", "Trained positions per optimizer step.")
    ] = 4096,
    lr: Annotated[float, option("--lr", "Peak AdamW learning rate.")] = 1e-3,
    seed: Annotated[int, option("--seed", "Seed: the same seed and data give the same head.")] = 0,
    heldout: Annotated[float, option("--heldout", "Fraction of sequences held out.")] = 0.05,
    eval_every: Annotated[int, option("--eval-every", "Steps between evaluations.")] = 100,
    checkpoint_every: Annotated[
        int, option("--checkpoint-every", "Steps between checkpoints.")
    ] = 20,
    vocab: Annotated[
        str,
        option("--vocab", "Softmax over 'seen' target tokens (fast) or the 'full' vocabulary."),
    ] = "seen",
    prompt_weight: Annotated[
        float,
        option("--prompt-weight", "Loss weight of prompt positions (0: train on answers only)."),
    ] = 0.5,
    feature_weight: Annotated[
        float,
        option(
            "--feature-weight",
            "Weight of the feature loss (head output vs the model's next hidden state).",
        ),
    ] = 1.0,
    max_steps: Annotated[
        int | None, option("--max-steps", "Stop after this many steps (resumable).")
    ] = None,
    draft_vocab: Annotated[
        int,
        option(
            "--draft-vocab",
            "Tokens the head drafts from, the most frequent in the data (0: the whole vocabulary).",
        ),
    ] = 8192,
    max_len: Annotated[int, option("--max-len", "Longest sequence, in tokens.")] = 1280,
    gen_batch: Annotated[
        int, option("--gen-batch", "Prompts answered at once when generating.")
    ] = 16,
    device: DeviceOpt = None,
    dtype: DtypeOpt = None,
    threads: ThreadsOpt = None,
) -> None:
    """Train an MTP head for a model on its own predictions (self-distillation)."""
    try:
        from metrale.engine.train.trainer import TrainConfig

        config = TrainConfig(
            epochs=epochs,
            batch_tokens=batch_tokens,
            lr=lr,
            seed=seed,
            heldout=heldout,
            eval_every=eval_every,
            checkpoint_every=checkpoint_every,
            vocab=vocab,  # type: ignore[arg-type]
            prompt_weight=prompt_weight,
            feature_weight=feature_weight,
            max_steps=max_steps,
            draft_vocab=draft_vocab,
        )
        runtime = RuntimeConfig(
            num_slots=gen_batch,
            max_len=max_len,
            device=device,
            dtype=dtype,
            mtp=False,
            revision=revision,
        )
    except ValueError as exc:
        raise config_error(exc, TRAIN_FLAGS) from exc
    missing = [str(p) for p in data if not p.exists()]
    if missing:
        raise typer.BadParameter(f"not found: {', '.join(missing)}", param_hint="--data")
    work = work_dir or out.with_name(out.name + ".work")
    if threads is not None:
        import torch

        torch.set_num_threads(threads)
    run_training(model, data, out, work, config, runtime)


def run_training(
    model: str | None,
    data: list[Path],
    out: Path,
    work: Path,
    config: TrainConfig,
    runtime: RuntimeConfig,
) -> None:
    from metrale.engine.load.loader import load_model
    from metrale.engine.runtime.llama import LlamaModel
    from metrale.engine.runtime.mtp_head import DRAFT_VOCAB, save_mtp_head
    from metrale.engine.train.data import load_sources
    from metrale.engine.train.trainer import draft_vocabulary, train_mtp

    started = time.perf_counter()
    try:
        loaded = load_model(model, runtime)
    except (ValueError, RuntimeError, OSError) as exc:
        raise load_error(exc, None) from exc
    if not isinstance(loaded.model, LlamaModel):
        raise typer.BadParameter(
            "train-mtp needs a model of metrale's own Llama-family runtime", param_hint="--model"
        )
    with _progress(STDERR) as bars:
        tasks: dict[str, Any] = {}

        def show(stage: str, done: int, total: int, loss: str = "-", rate: str = "-") -> None:
            if stage not in tasks:
                tasks[stage] = bars.add_task(stage, total=total, loss="-", rate="-")
            bars.update(tasks[stage], completed=done, total=total, loss=loss, rate=rate)

        sequences = load_sources(
            loaded,
            data,
            work,
            window=runtime.max_len or 512,
            max_batch=runtime.num_slots,
            on_generated=lambda done, total: show("generate", done, total),
        )

        def on_progress(p: TrainProgress) -> None:
            if p.stage == "cache":
                show("hidden", p.done, p.total)
            else:
                show("train", p.done, p.total, f"{p.loss:.3f}", f"{p.tokens_per_s:,.0f}")

        def on_eval(step: int, report: EvalReport) -> None:
            bars.console.print(f"step {step}: {describe(report)}")

        result = train_mtp(
            loaded.model, sequences, config, work, on_progress=on_progress, on_eval=on_eval
        )
    import torch

    fields: dict[str, Any] = {
        "trained_by": "metrale train-mtp",
        "date": datetime.date.today().isoformat(),
        "data": [p.name for p in data],
        "sequences": len(sequences),
        "answer_tokens": sum(len(s.token_ids) - s.loss_start for s in sequences),
        "prompt_tokens": sum(s.loss_start for s in sequences),
        "generated_by_the_model": sum(1 for s in sequences if s.hidden is not None),
        "trained_positions_per_epoch": result.train_tokens,
        "heldout_answer_positions": result.heldout_tokens,
        "epochs": config.epochs,
        "steps": result.steps,
        "seconds": round(time.perf_counter() - started, 1),
        "final_loss": round(result.final_loss, 4),
        "settings": {k: v for k, v in vars(config).items() if k != "max_steps"},
    }
    if result.heldout_eval is not None:
        fields["heldout_acceptance_by_depth"] = [round(a, 4) for a in result.heldout_eval.accepted]
        fields["heldout_positions"] = result.heldout_eval.positions
    tensors = {k: v.to(torch.bfloat16) for k, v in result.tensors.items()}
    vocab_size = loaded.model.spec.vocab_size
    if 0 < config.draft_vocab < vocab_size:  # else the head drafts from every token
        tensors[DRAFT_VOCAB] = draft_vocabulary(sequences, config.draft_vocab, vocab_size)
        fields["draft_vocab"] = config.draft_vocab
    weights, card = save_mtp_head(
        out, tensors, loaded.model.spec, base_model=loaded.name, fields=fields
    )
    if result.heldout_eval is not None:
        STDERR.print(f"final {describe(result.heldout_eval)}")
    STDERR.print(f"wrote {weights} and {card} ({result.steps} steps, {fields['seconds']} s)")
    model_flag = f" --model {shlex.quote(model)}" if model is not None else ""
    STDERR.print(
        f"draft with it: metrale generate PROMPTS{model_flag} --mtp-head {shlex.quote(str(out))}",
        highlight=False,
        markup=False,
    )
