"""`tandem draft quantize|distill|train`: make a draft model from a target (the parser and its commands)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from cluster.drafts.distill import DistillSettings, distill
from cluster.drafts.head_train import HeadSettings, train_head
from cluster.drafts.quantize import quantize_draft


def cmd_draft_distill(args: argparse.Namespace) -> int:
    settings = DistillSettings(
        layers=args.layers, steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr,
        seed=args.seed, num_samples=args.num_samples, max_new_tokens=args.max_new_tokens,
        layer_choice=args.layer_choice, checkpoint_every=args.checkpoint_every,
    )
    result = distill(args.target, Path(args.out), settings)
    report = json.loads((result.out / "distill_report.json").read_text())
    print(f"layers {result.layers} (choice {report['layer_choice']}); held-out KL "
          f"{report['heldout_kl_start']:.3f} -> {report['heldout_kl_end']:.3f}; wrote {result.out}")
    return 0


def cmd_draft_train(args: argparse.Namespace) -> int:
    settings = HeadSettings(
        steps=args.steps, batch_size=args.batch_size, seq_len=args.seq_len, lr=args.lr, ttt_steps=args.ttt_steps,
        draft_vocab=args.draft_vocab, seed=args.seed, num_open=args.num_open, max_new_tokens=args.max_new_tokens,
        checkpoint_every=args.checkpoint_every, max_texts=args.max_texts,
    )
    result = train_head(args.target, Path(args.out), settings, stop_after=args.stop_after)
    if not result.finished:
        print(f"stopped at step {result.step} of {settings.steps}; run the same command again to resume")
        return 0
    report = json.loads((result.out / "head_report.json").read_text())
    accepted = ", ".join(f"{rate:.2f}" for rate in report["acceptance_per_position"])
    print(f"held-out acceptance per draft position {accepted}; mean acceptance length "
          f"{report['mean_acceptance_length']:.2f}; wrote {result.out}")
    return 0


def cmd_draft_quantize(args: argparse.Namespace) -> int:
    summary = quantize_draft(args.target, Path(args.out), args.scheme)
    print(f"wrote {summary['out']}: {summary['num_quantized']} matrices in {summary['scheme']}, weights "
          f"{summary['bytes_before'] / 1e6:.1f} MB -> {summary['bytes_after'] / 1e6:.1f} MB")
    return 0


def add_draft_parser(sub) -> None:
    """``tandem draft <command>``: each command is one ``add_parser`` + ``set_defaults``."""
    draft = sub.add_parser("draft", help="make a draft model from a target").add_subparsers(dest="draft",
                                                                                            required=True)
    dist = draft.add_parser("distill", help="prune the target to N layers and distill it on its own text "
                            "(resumable: run the same command again)")
    dist.add_argument("target", help="short name, Hugging Face folder or .gguf file (a Llama-family model)")
    dist.add_argument("out", help="output folder: a Hugging Face model folder; OUT/checkpoint holds the run")
    dist.add_argument("--layers", type=int, required=True, help="decoder layers the draft keeps")
    dist.add_argument("--layer-choice", default="auto", choices=["auto", "first", "even", "first-last"],
                      help="which layers: auto measures each choice's KL to the target before training")
    dist.add_argument("--steps", type=int, default=120, help="optimizer steps")
    dist.add_argument("--batch-size", type=int, default=8, help="rows (samples) per step")
    dist.add_argument("--seq-len", type=int, default=192, help="tokens per row (prompt + answer)")
    dist.add_argument("--lr", type=float, default=3e-4, help="peak learning rate (AdamW, cosine decay)")
    dist.add_argument("--seed", type=int, default=0, help="seeds the samples and the row order")
    dist.add_argument("--num-samples", type=int, default=192, help="answers the target writes to train on")
    dist.add_argument("--max-new-tokens", type=int, default=128, help="longest answer sampled")
    dist.add_argument("--checkpoint-every", type=int, default=25, help="steps between checkpoints")
    dist.set_defaults(func=cmd_draft_distill)
    train = draft.add_parser("train", help="train an EAGLE-3 head on the target's own answers "
                             "(resumable: run the same command again)")
    train.add_argument("target", help="short name, Hugging Face folder or .gguf file (a Llama-family model)")
    train.add_argument("out", help="output folder: an EAGLE-3 head; OUT/checkpoint holds the run")
    defaults = HeadSettings()
    train.add_argument("--steps", type=int, default=defaults.steps, help="optimizer steps")
    train.add_argument("--batch-size", type=int, default=defaults.batch_size, help="texts per step")
    train.add_argument("--seq-len", type=int, default=defaults.seq_len, help="tokens per text (prompt + answer)")
    train.add_argument("--lr", type=float, default=defaults.lr, help="peak learning rate (AdamW, cosine decay)")
    train.add_argument("--ttt-steps", type=int, default=defaults.ttt_steps,
                       help="draft steps unrolled in training (training-time test)")
    train.add_argument("--draft-vocab", type=int, default=defaults.draft_vocab,
                       help="tokens the head can draft: those the target chooses most often")
    train.add_argument("--seed", type=int, default=defaults.seed, help="seeds the texts, the init and the row order")
    train.add_argument("--num-open", type=int, default=defaults.num_open,
                       help="made prompts the target answers (plus edit tasks over half of the answers)")
    train.add_argument("--max-new-tokens", type=int, default=defaults.max_new_tokens, help="longest answer")
    train.add_argument("--max-texts", type=int, default=defaults.max_texts,
                       help="train on this many of the texts made (a seeded choice; 0: all)")
    train.add_argument("--checkpoint-every", type=int, default=defaults.checkpoint_every,
                       help="steps between checkpoints")
    train.add_argument("--stop-after", type=int, help="stop after this many steps (resume later)")
    train.set_defaults(func=cmd_draft_train)
    quant = draft.add_parser("quantize", help="write an int8 copy of the target to use as its own draft")
    quant.add_argument("target", help="short name, Hugging Face folder or .gguf file")
    quant.add_argument("out", help="output folder (new or empty): a Hugging Face folder with int8 weights")
    quant.add_argument("--scheme", default="int8", choices=["int8", "int8-dynamic"],
                       help="int8: weight-only; int8-dynamic: int8 activations too (fbgemm, CPU)")
    quant.set_defaults(func=cmd_draft_quantize)
