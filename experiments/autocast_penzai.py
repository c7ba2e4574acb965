"""FP8 vs BF16: penzai's Llama-like transformer under `jfp8.autocast`, no edits.

    python experiments/autocast_penzai.py --steps 200 --out experiments/results/autocast-penzai

penzai (installed from the package index, `pip install jfp8[test]`) builds the model; its
`Linear` layers call `jnp.einsum` through named-axis `nmap`. jfp8 wraps the loss in
`jfp8.autocast(loss, weight_argnums=(0,))`: every weight x activation einsum runs with DeepSeek-V3's
recipe, attention (activation x activation) stays as penzai computes it. The BF16 arm is the same
loss without autocast: FP32 master weights cast to BF16 in the loss (both arms). penzai keeps its
activations in FP32 at this config (its norms compute in FP32), so the BF16 arm's projections are
BF16 weight x FP32 activation GEMMs with FP32 accumulation; the FP8 arm's are E4M3 x E4M3. Both arms share the seed,
the initialisation and the batches of the Shakespeare corpus (bytes, vocabulary 256). Writes
DIR/summary.json, DIR/summary.md (losses, the gap, and which matmuls went FP8).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import optax

import jfp8
from jfp8.train.data import BYTE_VOCAB, eval_batches, load_bytes, train_batch, train_val_split


@dataclasses.dataclass(frozen=True)
class Config:
    embedding_dim: int = 128
    heads: int = 2
    head_dim: int = 64
    mlp_hidden_dim: int = 256
    blocks: int = 2
    batch: int = 8
    seq_len: int = 128
    steps: int = 200
    lr: float = 3e-3
    seed: int = 0
    eval_batches: int = 4


def build_model(cfg: Config):
    """penzai's Llama-like LM at a tiny size, random init; returns (loss(params, tokens), params)."""
    from penzai import pz
    from penzai.models.transformer.variants import llamalike_common as ll

    model_cfg = ll.LlamalikeTransformerConfig(
        num_kv_heads=cfg.heads, query_head_multiplier=1, embedding_dim=cfg.embedding_dim,
        projection_dim=cfg.head_dim, mlp_hidden_dim=cfg.mlp_hidden_dim,
        num_decoder_blocks=cfg.blocks, vocab_size=BYTE_VOCAB, mlp_variant="swiglu",
        tie_embedder_and_logits=False, parameter_dtype=jnp.float32,
        activation_dtype=jnp.bfloat16,
    )
    model = ll.build_llamalike_transformer(model_cfg, init_base_rng=jax.random.key(cfg.seed))
    unbound, params = pz.unbind_params(model, freeze=True)

    def loss(params, tokens):  # tokens [batch, seq + 1] int32
        # FP32 master weights, BF16 compute: the cast is layout-only, so autocast still sees weights.
        params = jax.tree.map(lambda v: v.astype(jnp.bfloat16) if jnp.issubdtype(v.dtype, jnp.floating) else v, params)
        lm = pz.bind_variables(unbound, params)
        logits = lm(pz.nx.wrap(tokens[:, :-1]).tag("batch", "seq"))
        logits = logits.untag("batch", "seq", "vocabulary").unwrap().astype(jnp.float32)
        return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    return loss, params


def train(loss, params, cfg: Config, split, log_every: int = 10):
    opt = optax.adamw(cfg.lr)

    @jax.jit
    def step(params, opt_state, tokens):
        value, grads = jax.value_and_grad(loss)(params, tokens)
        updates, opt_state = opt.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, value

    evaluate = jax.jit(loss)
    val = eval_batches(split.val, cfg.batch, cfg.seq_len + 1, cfg.eval_batches)
    opt_state, curve = opt.init(params), []
    t0 = time.perf_counter()
    for i in range(cfg.steps):
        tokens = jnp.asarray(train_batch(split.train, cfg.batch, cfg.seq_len + 1, cfg.seed, i))
        params, opt_state, value = step(params, opt_state, tokens)
        if i % log_every == 0 or i == cfg.steps - 1:
            curve.append((i, float(value)))
    val_loss = float(np.mean([evaluate(params, jnp.asarray(b)) for b in val]))
    return {"train": curve, "val_loss": val_loss, "seconds": time.perf_counter() - t0}


def run(cfg: Config, recipe: jfp8.Fp8Recipe = jfp8.Fp8Recipe()) -> dict:
    split = train_val_split(load_bytes())
    loss, params = build_model(cfg)
    fp8_loss = jfp8.autocast(loss, recipe)
    tokens = jnp.zeros((cfg.batch, cfg.seq_len + 1), jnp.int32)
    records = fp8_loss.report(params, tokens)
    arms = {"bf16": train(loss, params, cfg, split), "fp8": train(fp8_loss, params, cfg, split)}
    return {"config": dataclasses.asdict(cfg), "arms": arms, "records": records}


def _matmul_table(records) -> list[str]:
    rows = {}
    for r in records:
        key = (r.fp8, r.kind, r.lhs_shape, r.rhs_shape, r.note)  # lhs dtype is the same for all
        rows[key] = rows.get(key, 0) + 1
    out = ["| FP8 | kind | lhs | rhs | count | note |", "|---|---|---|---|---|---|"]
    for (fp8, kind, lhs, rhs, note), n in rows.items():
        out.append(f"| {'yes' if fp8 else 'no'} | {kind} | {lhs} | {rhs} | {n} | {note} |")
    return out


def write(result: dict, out: pathlib.Path) -> str:
    out.mkdir(parents=True, exist_ok=True)
    arms = result["arms"]
    b, f = arms["bf16"], arms["fp8"]
    final_b, final_f = b["train"][-1][1], f["train"][-1][1]
    lines = [
        "# penzai Llama-like LM under jfp8.autocast: FP8 vs BF16",
        "", f"config: `{json.dumps(result['config'])}`", "",
        "| step | BF16 | FP8 | rel. gap |", "|---|---|---|---|",
        *(f"| {i} | {lb:.4f} | {lf:.4f} | {(lf - lb) / lb:+.2%} |"
          for (i, lb), (_, lf) in zip(b["train"], f["train"])),
        "", f"final train loss: BF16 {final_b:.4f}, FP8 {final_f:.4f} "
        f"({(final_f - final_b) / final_b:+.2%}); validation loss: BF16 {b['val_loss']:.4f}, "
        f"FP8 {f['val_loss']:.4f} ({(f['val_loss'] - b['val_loss']) / b['val_loss']:+.2%})",
        f"wall time (CPU, XLA reference path): BF16 {b['seconds']:.0f} s, FP8 {f['seconds']:.0f} s",
        "", "BF16 arm: FP32 master weights cast to BF16 in the loss; penzai keeps activations in FP32 "
        "here, so its projections are BF16-weight x FP32-activation GEMMs (FP32 accumulation). FP8 "
        "arm: the same loss under `jfp8.autocast` (DeepSeek-V3 recipe, XLA reference numerics).",
        "", f"## Matmuls ({sum(r.fp8 for r in result['records'])} of {len(result['records'])} in FP8)",
        "", *_matmul_table(result["records"]),
    ]
    text = "\n".join(lines) + "\n"
    (out / "summary.md").write_text(text)
    records = [dataclasses.asdict(r) for r in result["records"]]
    (out / "summary.json").write_text(json.dumps({**result, "records": records}, indent=1, default=str))
    return text


def main():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=Config.steps)
    p.add_argument("--out", type=pathlib.Path, default=pathlib.Path("experiments/results/autocast-penzai"))
    args = p.parse_args()
    print(write(run(Config(steps=args.steps)), args.out))


if __name__ == "__main__":
    main()
