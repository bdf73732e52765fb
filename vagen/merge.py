"""Merge a LoRA adapter that training saved into a whole Hugging Face checkpoint.

    python -m vagen.merge runs/<run>/checkpoints/step_N/actor OUT_DIR [--base PATH] [--dtype float32]

The adapter (peft format, as `checkpoints/step_N/actor/` holds it with `model.lora_rank > 0`; a
`step_N` directory or a run directory, meaning its latest checkpoint, are accepted too) is loaded onto its
base checkpoint, the one its adapter_config.json records unless `--base` names another, and each adapted
weight becomes W + (lora_alpha / lora_rank) B A (peft's merge and unload). OUT_DIR receives the merged
model and the adapter's processor (the base's, when none was saved with it): a checkpoint that `vagen.eval --checkpoint OUT_DIR`, `model.path=OUT_DIR`
and `from_pretrained` load like any other.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def adapter_dir(path: str | Path) -> Path:
    """The adapter directory `path` names: itself, a checkpoint's `actor/`, or a run's latest checkpoint's."""
    p = Path(path).expanduser()
    if (p / "checkpoints" / "latest").exists():
        p = p / "checkpoints" / (p / "checkpoints" / "latest").read_text().strip()
    for candidate in (p, p / "actor"):
        if (candidate / "adapter_config.json").exists():
            return candidate
    whole = " (it holds a whole model, which needs no merging)" if (p / "config.json").exists() else ""
    raise FileNotFoundError(f"{path}: no LoRA adapter there (expected adapter_config.json){whole}; pass "
                            f"runs/<run>/checkpoints/step_N/actor of a run trained with model.lora_rank > 0, its "
                            f"step_N directory, or the run directory")


def merge(adapter: str | Path, out_dir: str | Path, base: str | Path | None = None, dtype: str = "float32") -> Path:
    """Write the merged checkpoint of `adapter` (see the module docstring) into `out_dir`; returns it."""
    import torch
    from peft import PeftModel
    from peft.tuners.lora import LoraLayer

    from vagen.models import is_vision_checkpoint, load_policy

    adapter = adapter_dir(adapter)
    recorded = json.loads((adapter / "adapter_config.json").read_text()).get("base_model_name_or_path")
    base_path = Path(base or recorded or "").expanduser()
    if not (base_path / "config.json").exists():
        raise FileNotFoundError(f"the base checkpoint of {adapter} is {str(base_path)!r} (from "
                                f"{'--base' if base else 'its adapter_config.json'}), which holds no config.json; "
                                f"pass the checkpoint training started from with --base PATH")
    model, _ = load_policy(base_path, dtype)
    adapted = PeftModel.from_pretrained(model, str(adapter))
    for layer in adapted.modules():
        if isinstance(layer, LoraLayer):
            # W + scale B A in float64, one layer at a time, rounded once to the checkpoint's dtype: merged in
            # float32 the log-probabilities moved by up to 1.2e-5 from the adapted model's, in float64 by
            # 6.7e-6, the gap float32 itself leaves between a batch and its rows run alone
            kept = layer.base_layer.weight.dtype
            layer.to(torch.float64)
            layer.merge()
            layer.to(kept)
    merged = adapted.unload()  # the layers hold their merged weights: unwrapping them ends peft's merge_and_unload
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(out)
    # the processor training used, saved beside the adapter; an adapter saved without one takes the base's
    source = adapter if (adapter / "tokenizer_config.json").exists() else base_path
    if is_vision_checkpoint(base_path):
        from transformers import AutoProcessor

        AutoProcessor.from_pretrained(source).save_pretrained(out)
    else:
        from transformers import AutoTokenizer

        AutoTokenizer.from_pretrained(source).save_pretrained(out)
    return out


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("adapter", help="runs/<run>/checkpoints/step_N/actor (or step_N, or the run directory)")
    parser.add_argument("out", help="directory of the merged checkpoint")
    parser.add_argument("--base", default=None, help="base checkpoint (default: the one adapter_config.json records)")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"), help="dtype of the merged weights")
    args = parser.parse_args(argv)
    try:
        out = merge(args.adapter, args.out, args.base, args.dtype)
    except FileNotFoundError as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"merged checkpoint: {out}", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
