"""Making draft models from a target: pruning + distillation (``tandem draft distill``),
and the drafts that ship with Tandem."""
