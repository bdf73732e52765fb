"""The critic: the policy's architecture with a scalar value head, saved and loaded beside the actor."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from torch import nn

from vagen.models.adapters import has_adapters
from vagen.models.forward import forward_packed, forward_shared_prefix
from vagen.models.loading import backbone_of


class ValueModel(nn.Module):
    """Critic: the policy's architecture and weights with a scalar head on the last hidden state.

    `forward` takes the same inputs as the policy and returns values [B, L] where
    `values[:, t]` estimates the return from the state in which token t is chosen (the hidden state
    at position t - 1); `values[:, 0]` is 0.
    """

    def __init__(self, policy: nn.Module):
        super().__init__()
        self.backbone = backbone_of(policy)
        hidden = policy.config.get_text_config().hidden_size
        # in the backbone's dtype: ZeRO-3 flattens a module's parameters into one buffer of one dtype
        self.value_head = nn.Linear(hidden, 1, dtype=policy.dtype)
        nn.init.zeros_(self.value_head.weight)
        nn.init.zeros_(self.value_head.bias)

    def forward(self, packed: bool = False, **inputs) -> torch.Tensor:
        """`packed`: the rows run back to back in one (`forward_packed`), with the same values."""
        hidden = (forward_packed if packed else forward_shared_prefix)(self.backbone, inputs)
        values = self.value_head(hidden[:, :-1].to(self.value_head.weight.dtype)).squeeze(-1)
        return torch.nn.functional.pad(values, (1, 0))

    def save(self, out_dir: Path, state_dict: dict | None = None) -> None:
        """Backbone in HF format and the head's weights; `state_dict` is the full critic state when
        the live parameters are partitioned (ZeRO-3)."""
        out_dir = Path(out_dir)
        out_dir.mkdir(parents=True, exist_ok=True)
        backbone_state = head_state = None
        if state_dict is not None:
            backbone_state = {k[len("backbone."):]: v for k, v in state_dict.items() if k.startswith("backbone.")}
            head_state = {k[len("value_head."):]: v for k, v in state_dict.items() if k.startswith("value_head.")}
        self.backbone.save_pretrained(out_dir / "backbone", state_dict=backbone_state)
        torch.save(head_state or self.value_head.state_dict(), out_dir / "value_head.pt")

    def load(self, out_dir: Path) -> None:
        """The backbone and value head `save` wrote into `out_dir`."""
        from safetensors.torch import load_file

        out_dir = Path(out_dir)
        state = {}
        for shard in sorted((out_dir / "backbone").glob("*.safetensors")):
            state.update(load_file(shard))
        saved_adapters = (out_dir / "backbone" / "adapter_config.json").exists()
        if saved_adapters != has_adapters(self.backbone):
            raise RuntimeError(f"critic checkpoint {out_dir} was saved {'with' if saved_adapters else 'without'} LoRA "
                               f"adapters, but this critic is built {'with' if has_adapters(self.backbone) else 'without'} "
                               f"them; set model.lora_rank as the run that saved it did, or leave model.critic_path unset")
        if saved_adapters:  # the adapters (peft format); the frozen base is model.path's
            from peft import set_peft_model_state_dict

            result = set_peft_model_state_dict(self.backbone, state)
            missing = [k for k in result.missing_keys if "lora_" in k or "modules_to_save" in k]
            unexpected = list(result.unexpected_keys)
        else:
            missing, unexpected = self.backbone.load_state_dict(state, strict=False)
        if unexpected or missing:
            raise RuntimeError(f"critic checkpoint {out_dir} does not match the model: unexpected {unexpected[:5]}, "
                               f"missing {missing[:5]}; pass a critic saved from the same architecture")
        self.value_head.load_state_dict(torch.load(out_dir / "value_head.pt", weights_only=True))


def saved_critic(path: str | Path) -> Path | None:
    """The critic directory (backbone/ and value_head.pt, as `ValueModel.save` writes it) that `path`
    names: itself, a checkpoint's `critic/`, or the latest checkpoint's of a run directory; None when
    `path` holds no saved critic."""
    p = Path(os.path.expanduser(str(path)))
    if (p / "checkpoints" / "latest").exists():
        p = p / "checkpoints" / (p / "checkpoints" / "latest").read_text().strip()
    for candidate in (p, p / "critic"):
        if (candidate / "value_head.pt").exists() and (candidate / "backbone").is_dir():
            return candidate
    return None
