"""FP8 vs BF16 on models jfp8 did not write: published libraries under `jfp8.autocast`, no edits.

    python experiments/autocast_libraries.py --library penzai --steps 300 --out experiments/results/autocast-penzai
    python experiments/autocast_libraries.py --library nano_moe --steps 300 --out experiments/results/autocast-nano-moe

penzai (`penzai==0.2.5`): its Llama-like transformer; `Linear` calls `jnp.einsum` through
named-axis `nmap`. nano-moe-jax (`nano-moe-jax==0.1.0`, linen): a small MoE LM (router + top-k of
dense expert FFNs in every block). Both from the package index (`pip install jfp8[test]`), tiny
config, random init. jfp8 wraps the loss in `jfp8.autocast(loss)` (params at argnum 0): every
weight x activation matmul runs with DeepSeek-V3's recipe except the output head and the MoE
router (`keep=`, as DeepSeek-V3 keeps them in BF16); activation x activation (attention) stays as
the library computes it. The BF16 arm is the same loss without autocast; FP32 master
weights are cast to BF16 inside the loss in both arms (the cast is layout-only, so autocast still
sees weights). Both arms share the seed, init and batches of the Shakespeare corpus (bytes,
vocabulary 256). Writes DIR/summary.json and DIR/summary.md (losses, the gap, which matmuls went
FP8).
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
    library: str = "penzai"  # or "nano_moe"
    experts: int = 4  # nano_moe
    top_k: int = 2  # nano_moe
    embedding_dim: int = 128
    heads: int = 2
    head_dim: int = 64
    mlp_hidden_dim: int = 384  # not the vocabulary size: penzai's `keep` tells the head by its width
    blocks: int = 2
    batch: int = 8
    seq_len: int = 128
    steps: int = 200
    lr: float = 3e-3
    seed: int = 0
    eval_batches: int = 4
    keep_head_and_gate: bool = True  # DeepSeek-V3 keeps the output head and the MoE gate in BF16


def _penzai_head(cfg: Config):
    """penzai's parameters are a flat list (paths are indices): the head is told by its shape."""
    return lambda r: r.rhs_shape[-2:] == (cfg.embedding_dim, BYTE_VOCAB)


# keep= per library: what stays BF16, as DeepSeek-V3 keeps its output head and MoE gate.
HEAD_AND_GATE = {
    "penzai": _penzai_head,
    # linen paths: params/block_<i>/MoELayer_0/Router_0/Dense_0/kernel and the top-level head
    "nano_moe": lambda cfg: (r"/Router_0/", r"^params/Dense_0/kernel$"),
}


def _bf16(params):
    return jax.tree.map(lambda v: v.astype(jnp.bfloat16) if jnp.issubdtype(v.dtype, jnp.floating) else v, params)


def build_model(cfg: Config):
    """(loss(params, tokens), params) of the configured library's LM."""
    return {"penzai": build_penzai, "nano_moe": build_nano_moe}[cfg.library](cfg)


def build_nano_moe(cfg: Config):
    """nano-moe-jax's MoE LM at a tiny size, random init, no dropout; loss = LM loss + the
    library's load-balancing term (its coefficient)."""
    from nano_moe import NanoMoE, NanoMoEConfig

    model_cfg = NanoMoEConfig(
        vocab_size=BYTE_VOCAB, n_layers=cfg.blocks, n_heads=cfg.heads, d_model=cfg.embedding_dim,
        d_ff=cfg.mlp_hidden_dim, n_experts=cfg.experts, top_k=cfg.top_k, block_size=cfg.seq_len,
        dropout_rate=0.0,
    )
    model = NanoMoE(model_cfg)
    params = model.init(jax.random.key(cfg.seed), jnp.zeros((1, cfg.seq_len), jnp.int32))

    def loss(params, tokens):  # tokens [batch, seq + 1] int32
        logits, aux = model.apply(_bf16(params), tokens[:, :-1])
        lm = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), tokens[:, 1:])
        return lm.mean() + model_cfg.aux_loss_coeff * aux

    return loss, params


def build_penzai(cfg: Config):
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
        lm = pz.bind_variables(unbound, _bf16(params))
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
    val = eval_batches(split.val, cfg.batch, cfg.seq_len + 1, cfg.eval_batches) if cfg.eval_batches else []
    opt_state, curve = opt.init(params), []
    t0 = time.perf_counter()
    for i in range(cfg.steps):
        tokens = jnp.asarray(train_batch(split.train, cfg.batch, cfg.seq_len + 1, cfg.seed, i))
        params, opt_state, value = step(params, opt_state, tokens)
        if i % log_every == 0 or i == cfg.steps - 1:
            curve.append((i, float(value)))
    val_loss = float(np.mean([evaluate(params, jnp.asarray(b)) for b in val])) if val else float("nan")
    return {"train": curve, "val_loss": val_loss, "seconds": time.perf_counter() - t0}


def run(cfg: Config, recipe: jfp8.Fp8Recipe = jfp8.Fp8Recipe()) -> dict:
    split = train_val_split(load_bytes())
    loss, params = build_model(cfg)
    fp8_loss = jfp8.autocast(loss, recipe, keep=HEAD_AND_GATE[cfg.library](cfg) if cfg.keep_head_and_gate else None)
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
        f"# {result['config']['library']} under jfp8.autocast: FP8 vs BF16",
        "", f"config: `{json.dumps(result['config'])}`", "",
        "| step | BF16 | FP8 | rel. gap |", "|---|---|---|---|",
        *(f"| {i} | {lb:.4f} | {lf:.4f} | {(lf - lb) / lb:+.2%} |"
          for (i, lb), (_, lf) in zip(b["train"], f["train"])),
        "", f"final train loss: BF16 {final_b:.4f}, FP8 {final_f:.4f} "
        f"({(final_f - final_b) / final_b:+.2%}); validation loss: BF16 {b['val_loss']:.4f}, "
        f"FP8 {f['val_loss']:.4f} ({(f['val_loss'] - b['val_loss']) / b['val_loss']:+.2%})",
        f"wall time (CPU, XLA reference path): BF16 {b['seconds']:.0f} s, FP8 {f['seconds']:.0f} s",
        "", "BF16 arm: FP32 master weights cast to BF16 in the loss, the library's own dtypes otherwise "
        f"(matmul activations: {sorted({r.dtype for r in result['records']})}). FP8 arm: the same loss "
        "under `jfp8.autocast` (DeepSeek-V3 recipe, XLA reference numerics).",
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
    p.add_argument("--library", choices=("penzai", "nano_moe"), default=Config.library)
    p.add_argument("--steps", type=int, default=Config.steps)
    p.add_argument("--out", type=pathlib.Path, required=True)
    args = p.parse_args()
    print(write(run(Config(library=args.library, steps=args.steps)), args.out))


if __name__ == "__main__":
    main()
