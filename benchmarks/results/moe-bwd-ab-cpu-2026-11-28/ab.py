"""One process: train-step median wall time with donate on or off."""
import json, statistics, sys, time
import jax
from jfp8.train import data
from jfp8.train.config import PRESET_TRAINING, TrainConfig
from jfp8.train.step import build
preset, precision, donate, steps = sys.argv[1], sys.argv[2], sys.argv[3] == "1", int(sys.argv[4])
shape = PRESET_TRAINING[preset]
cfg = TrainConfig(preset=preset, precision=precision, batch_size=shape["batch_size"], seq_len=shape["seq_len"],
                  steps=shape["steps"], progress=False)
s = build(cfg, donate=donate)
split = data.train_val_split(data.load_bytes(cfg.corpus), cfg.val_fraction)
tok = jax.device_put(data.train_batch(split.train, cfg.batch_size, cfg.seq_len, cfg.seed, 0))
state = jax.device_put((s.params, s.rest, s.tx.init(s.params)))
t0 = time.perf_counter(); f = s.train_step.lower(*state, tok).compile(); c = time.perf_counter() - t0
times = []
for i in range(steps + 2):
    t = time.perf_counter()
    *state, m = jax.block_until_ready(f(*state, tok))
    if i >= 2: times.append(time.perf_counter() - t)
print(json.dumps(dict(preset=preset, precision=precision, donate=donate, compile_s=c, step_s=statistics.median(times))))
