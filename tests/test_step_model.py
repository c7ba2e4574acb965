"""The step-time model (benchmarks/step_model.py): its HLO reader and classifier on hand-written
HLO with hand-counted FLOPs and bytes, on the committed tiny FP8 train step (optimized HLO of a
deviceless H100 compile, kernel payloads stripped), the wave model against a measured GEMM row it
was not calibrated on, and the committed predictions' shape."""

import gzip
import json
import math
import pathlib
import sys

import jax.numpy as jnp
import pytest

REPO = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "benchmarks"))
import step_model as sm  # noqa: E402

FIXTURE = REPO / "tests" / "fixtures" / "step_model" / "tiny-fp8-train.hlo.gz"

# A hand-written module: a dense FP8 GEMM, a grouped one, a grouped Wgrad, a quantizer, a retile,
# a Triton GEMM fusion (batched dot), a dynamic-update-slice fusion, and a while loop of 3 trips.
HAND = """\
HloModule hand

%gemm_comp (p0: bf16[8,128,64], p1: bf16[8,64,256]) -> f32[8,128,256] {
  %p0 = bf16[8,128,64]{2,1,0} parameter(0)
  %p1 = bf16[8,64,256]{2,1,0} parameter(1)
  ROOT %d = f32[8,128,256]{2,1,0} dot(%p0, %p1), lhs_batch_dims={0}, lhs_contracting_dims={2}, rhs_batch_dims={0}, rhs_contracting_dims={1}
}

%dus_comp (q0: f32[64,1024], q1: f32[1,1024], q2: s32[]) -> f32[64,1024] {
  %q0 = f32[64,1024]{1,0} parameter(0)
  %q1 = f32[1,1024]{1,0} parameter(1)
  %q2 = s32[] parameter(2)
  %z = s32[] constant(0)
  ROOT %u = f32[64,1024]{1,0} dynamic-update-slice(%q0, %q1, %q2, %z)
}

%add_comp (r0: f32[1024]) -> f32[1024] {
  %r0 = f32[1024]{0} parameter(0)
  ROOT %n = f32[1024]{0} negate(%r0)
}

%body (t: (s32[], f32[1024])) -> (s32[], f32[1024]) {
  %t = (s32[], f32[1024]{0}) parameter(0)
  %i = s32[] get-tuple-element(%t), index=0
  %v = f32[1024]{0} get-tuple-element(%t), index=1
  %f = f32[1024]{0} fusion(%v), kind=kLoop, calls=%add_comp
  ROOT %o = (s32[], f32[1024]{0}) tuple(%i, %f)
}

%cond (c: (s32[], f32[1024])) -> pred[] {
  %c = (s32[], f32[1024]{0}) parameter(0)
  ROOT %k = pred[] constant(true)
}

ENTRY %main (a: f8e4m3fn[512,1024], x: bf16[512,1024]) -> bf16[512,768] {
  %a = f8e4m3fn[512,1024]{1,0} parameter(0)
  %x = bf16[512,1024]{1,0} parameter(1)
  %dense = bf16[512,768]{1,0} custom-call(%a, %b, %sa, %sb), custom_call_target="mosaic_gpu_v2", operand_layout_constraints={f8e4m3fn[512,1024]{1,0}, f8e4m3fn[768,1024]{1,0}, f32[8,512]{1,0}, f32[8,6]{1,0}}, api_version=API_VERSION_TYPED_FFI, backend_config={}
  %grouped = bf16[4096,256]{1,0} custom-call(%g0, %g1, %g2, %g3, %xa, %xs, %w, %ws), custom_call_target="mosaic_gpu_v2", operand_layout_constraints={s32[36]{0}, s32[36]{0}, s32[36]{0}, s32[36]{0}, f8e4m3fn[4096,512]{1,0}, f32[4,4096]{1,0}, f8e4m3fn[8,256,512]{2,1,0}, f32[8,4,2]{2,1,0}}, api_version=API_VERSION_TYPED_FFI, backend_config={}
  %gwgrad = f32[8,256,512]{2,1,0} custom-call(%h0, %h1, %h2, %h3, %ya, %ys, %za, %zs), custom_call_target="mosaic_gpu_v2", operand_layout_constraints={s32[8]{0}, s32[8]{0}, s32[8]{0}, s32[8]{0}, f8e4m3fn[256,4096]{1,0}, f32[32,256]{1,0}, f8e4m3fn[512,4096]{1,0}, f32[32,512]{1,0}}, api_version=API_VERSION_TYPED_FFI, backend_config={}
  %quant = (f8e4m3fn[512,1024]{1,0}, f32[512,8]{1,0}) custom-call(%x), custom_call_target="mosaic_gpu_v2", operand_layout_constraints={bf16[512,1024]{1,0}}, api_version=API_VERSION_TYPED_FFI, backend_config={}
  %retile = (f8e4m3fn[1024,512]{1,0}, f32[1024,4]{1,0}) custom-call(%a, %s), custom_call_target="mosaic_gpu_v2", operand_layout_constraints={f8e4m3fn[512,1024]{1,0}, f32[512,8]{1,0}}, api_version=API_VERSION_TYPED_FFI, backend_config={}
  %lhs = bf16[8,128,64]{2,1,0} parameter(2)
  %rhs = bf16[8,64,256]{2,1,0} parameter(3)
  %attn = f32[8,128,256]{2,1,0} fusion(%lhs, %rhs), kind=kCustom, calls=%gemm_comp, backend_config={"fusion_backend_config":{"kind":"__triton_nested_gemm_fusion"}}
  %buf = f32[64,1024]{1,0} parameter(4)
  %row = f32[1,1024]{1,0} parameter(5)
  %idx = s32[] parameter(6)
  %upd = f32[64,1024]{1,0} fusion(%buf, %row, %idx), kind=kLoop, calls=%dus_comp
  %init = (s32[], f32[1024]{0}) parameter(7)
  %loop = (s32[], f32[1024]{0}) while(%init), condition=%cond, body=%body, backend_config={"known_trip_count":{"n":"3"}}
  %bc = bf16[512,768]{1,0} bitcast(%dense)
  ROOT %out = bf16[512,768]{1,0} copy(%bc)
}
"""


def _by_name(ops):
    return {op.name: op for op in ops}


def test_hand_module_classified_and_counted_by_hand():
    ops = _by_name(sm.step_ops(sm.parse_module(HAND)))
    assert "bc" not in ops  # bitcasts are free
    dense = ops["dense"]
    assert (dense.category, dense.gemm) == ("fp8 gemm: dense", (512, 768, 1024))
    assert dense.flops == 2 * 512 * 768 * 1024
    assert dense.bytes == 512 * 1024 + 768 * 1024 + 4 * (8 * 512 + 8 * 6) + 2 * 512 * 768
    g = ops["grouped"]
    assert (g.category, g.gemm, g.flops) == ("fp8 gemm: grouped", (8, 4096, 256, 512), 2 * 4096 * 256 * 512)
    w = ops["gwgrad"]  # 8 experts' [256, 512] weight gradients over 4096 routed rows in all
    assert (w.category, w.gemm, w.flops) == ("fp8 gemm: grouped wgrad", (8, 256, 512, 4096), 2 * 256 * 512 * 4096)
    q = ops["quant"]
    assert (q.category, q.elements) == ("quantize: 1x128", 512 * 1024)
    assert q.bytes == 2 * 512 * 1024 + 512 * 1024 + 4 * 512 * 8  # bf16 in, E4M3 + scales out
    assert ops["retile"].category == "quantize: retile"
    attn = ops["attn"]  # batched dot: 8 x [128, 64] @ [64, 256]
    assert (attn.category, attn.flops, attn.gemm) == ("xla gemm (bf16)", 2 * 8 * 128 * 256 * 64, (8, 128, 256, 64))
    # a dynamic-update-slice fusion writes its row, not the buffer: row read + row written + index
    assert ops["upd"].bytes == 4 * 1024 + 4 + 4 * 1024
    assert ops["f"].count == 3 and ops["f"].bytes == 2 * 4 * 1024  # the while body, 3 trips
    assert ops["out"].category == "xla transpose/copy"


def test_parse_tuple_shapes_and_comments():
    a = sm.arrays("(f32[2,3]{1,0}, /*index=5*/bf16[4]{0}, s32[], f8e4m3fn[128,256]{1,0})")
    assert [(x.dtype, x.dims, x.bytes) for x in a] == [
        ("f32", (2, 3), 24), ("bf16", (4,), 8), ("s32", (), 4), ("f8e4m3fn", (128, 256), 128 * 256)]


def test_wave_model_calibrated_at_its_shape_and_near_a_measured_row_it_was_not_fitted_to():
    r = sm.H100_RATES
    m, n, k = r.fp8_dense.shape
    assert sm.gemm_seconds((m, n, k), r.fp8_dense, r) == pytest.approx(2 * m * n * k / (r.fp8_dense.tflops * 1e12))
    # docs/gpu.md: jfp8 dense at 4096x2112x7168 measured 769 TFLOP/s, at 4096x7168x16384 1063
    for shape, measured in (((4096, 2112, 7168), 769.0), ((4096, 7168, 16384), 1063.0)):
        predicted = 2 * math.prod(shape) / sm.gemm_seconds(shape, r.fp8_dense, r) / 1e12
        assert abs(predicted / measured - 1) < 0.15, (shape, predicted)


@pytest.fixture(scope="module")
def tiny_fp8_ops():
    return sm.step_ops(sm.parse_module(gzip.decompress(FIXTURE.read_bytes()).decode()))


def test_tiny_fp8_step_every_mosaic_kernel_recognised(tiny_fp8_ops):
    """The tiny FP8 train step's 172 Mosaic custom calls, each classified (none 'other'): per
    projection an Fprop, a Dgrad and a Wgrad GEMM with their quantizers."""
    counts = {}
    for op in tiny_fp8_ops:
        counts[op.category] = counts.get(op.category, 0) + op.count
    mosaic = {c: n for c, n in counts.items() if c.startswith(("fp8", "quantize", "mosaic"))}
    assert "mosaic: other" not in mosaic
    assert sum(mosaic.values()) == 172
    assert mosaic == {"fp8 gemm: dense": 44, "fp8 gemm: dense wgrad": 22, "fp8 gemm: grouped": 8,
                      "fp8 gemm: grouped wgrad": 4, "quantize: 1x128": 23, "quantize: both orientations": 26,
                      "quantize: weight 128x128": 22, "quantize: retile": 23}
    # 22 dense weights (3 blocks x 5 MLA projections, the dense FFN's 2, 2 x the shared expert's 2,
    # the MTP projection): one weight quantization and one Wgrad GEMM each
    assert mosaic["quantize: weight 128x128"] == mosaic["fp8 gemm: dense wgrad"]
    # the attention products, router and head stay in XLA (BF16)
    assert counts["xla gemm (bf16)"] == 28


def test_tiny_fp8_gemm_flops_match_the_shapes(tiny_fp8_ops):
    """Wgrad of the tiny dense FFN's w13: [64 -> 256] over 2048 tokens, counted 2*64*256*2048."""
    w13 = [op for op in tiny_fp8_ops if op.category == "fp8 gemm: dense wgrad" and op.gemm == (64, 256, 2048)]
    assert len(w13) == 1 and w13[0].flops == 2 * 64 * 256 * 2048
    model = sm.summarize(tiny_fp8_ops)
    assert model["total"]["seconds"] > 0
    assert set(model["categories"]) <= set(sm.CATEGORY_NAMES)
    cuts = sm.quantization_cuts(tiny_fp8_ops)
    assert sum(c["launches"] for c in cuts) == 23 + 26 + 22 + 23
    assert sum(c["bytes"] for c in cuts) == pytest.approx(
        sum(op.bytes * op.count for op in tiny_fp8_ops if op.category.startswith("quantize")))


def test_committed_predictions_are_labelled_and_unmeasured():
    for path in sorted(sm.OUT.glob("*-h100_sxm.json")) + sorted(sm.OUT.glob("*-h200.json")):
        doc = json.loads(path.read_text())
        assert doc["what"].startswith("predicted (model)"), path
        for precision in sm.PRECISIONS:
            s = doc["precisions"][precision]
            assert s["measured"] == sm.MEASURED_NOT or s["measured_step_s"] is not None, path
            assert s["total"]["seconds"] == pytest.approx(sum(r["seconds"] for r in s["categories"].values()))
        assert "| category |" in sm.markdown_table(doc)


def test_gemm_tile_loop_what_if_prices_one_grouped_gemm():
    """A while loop of per-tile dots (BF16's `_ragged`) becomes one launch with its FLOPs at the
    measured BF16 grouped rate; ops outside loops stay."""
    tile = sm.Op("xla gemm (bf16)", "dot", 2 * 256 * 512 * 2048, 10, (1, 256, 512, 2048), count=100, loop="w")
    copy = sm.Op("xla transpose/copy", "copy", 0, 1 << 20, count=100, loop="w")
    out = sm.Op("xla elementwise", "add", 0, 1 << 20)
    assert sm.gemm_loops([tile, copy, out])["w"]["flops"] == 100 * tile.flops
    what_if = sm.as_grouped_gemm([tile, copy, out])
    assert [o.name for o in what_if] == ["add", "w as one grouped GEMM"]
    r = sm.H100_RATES
    assert sm.op_seconds(what_if[1]) == pytest.approx(100 * tile.flops / (r.bf16_grouped.tflops * 1e12) + r.launch.value)


RAGGED = """\
HloModule ragged

ENTRY %main (gs: s32[8], x: bf16[4096,512], w: bf16[8,512,256], dy: bf16[4096,256]) -> bf16[4096,256] {
  %gs = s32[8]{0} parameter(0)
  %x = bf16[4096,512]{1,0} parameter(1)
  %w = bf16[8,512,256]{2,1,0} parameter(2)
  %dy = bf16[4096,256]{1,0} parameter(3)
  %trd = bf16[8,512,256]{2,1,0} custom-call(%gs, %gs, %gs, %gs, %gs, %x, %dy), custom_call_target="mosaic_gpu_v2", operand_layout_constraints={s32[8]{0}, s32[8]{0}, s32[8]{0}, s32[8]{0}, s32[8]{0}, bf16[4096,512]{1,0}, bf16[4096,256]{1,0}}, api_version=API_VERSION_TYPED_FFI, backend_config={}
  ROOT %rd = bf16[4096,256]{1,0} custom-call(%gs, %x, %w), custom_call_target="mosaic_gpu_v2", operand_layout_constraints={s32[8]{0}, bf16[4096,512]{1,0}, bf16[8,512,256]{2,1,0}}, api_version=API_VERSION_TYPED_FFI, backend_config={}
}
"""


def test_bf16_ragged_kernels_are_grouped_gemms_at_the_bf16_grouped_rate():
    """jax's ragged dots (the BF16 experts on Hopper): 2·M·N·K FLOPs, priced as grouped GEMMs at
    the BF16 grouped rate (the forward one with half a tile per group, the transposed one per
    group over its share of the tokens)."""
    ops = _by_name(sm.step_ops(sm.parse_module(RAGGED)))
    fwd, wgrad = ops["rd"], ops["trd"]
    assert (fwd.category, fwd.flops, fwd.gemm) == ("bf16 gemm: grouped", 2.0 * 4096 * 256 * 512, (8, 4096, 256, 512))
    assert (wgrad.category, wgrad.flops, wgrad.gemm) == (
        "bf16 gemm: grouped wgrad", 2.0 * 512 * 256 * 4096, (8, 512, 256, 4096))
    r = sm.H100_RATES
    # Compute only (no bytes): the same wave model as the FP8 grouped GEMM, at the BF16 rate.
    bf16, fp8 = (sm.Op(c, "rd", fwd.flops, 0, fwd.gemm) for c in ("bf16 gemm: grouped", "fp8 gemm: grouped"))
    ratio = (sm.op_seconds(bf16) - r.launch.value) / (sm.op_seconds(fp8) - r.launch.value)
    assert ratio == pytest.approx(r.fp8_grouped.tflops / r.bf16_grouped.tflops)


def test_quantizers_at_the_goal_is_a_what_if_on_the_quantizers_only():
    r = sm.H100_RATES
    fast = sm.quantizers_at(r, 0.7)
    assert {gbs for _, points in fast.quantizers for _, gbs in points} == {0.7 * r.copy.value}
    quant = sm.Op("quantize: 1x128", "q", 0.0, 1 << 30, elements=1 << 29)
    gemm = sm.Op("fp8 gemm: dense", "g", 2.0 * 4096**3, 1 << 20, (4096, 4096, 4096))
    assert sm.op_seconds(quant, fast) == pytest.approx((1 << 30) / (0.7 * r.copy.value * 1e9) + r.launch.value)
    assert sm.op_seconds(gemm, fast) == sm.op_seconds(gemm, r)
    doc = json.loads((sm.OUT / "wide-h100_sxm.json").read_text())["precisions"]["fp8"]
    assert doc["with_quantizers_at_goal"]["seconds"] < doc["total"]["seconds"]  # every quantizer is slower today


def test_weights_from_the_update_prices_only_the_weights_writes():
    """The what-if drops a weight quantizer's f32 read and launch (its E4M3 writes stay, at copy
    bandwidth), a cast's read and launch (its bf16 write stays), and leaves every other op alone."""
    r = sm.H100_RATES
    copy = r.copy.value * 1e9
    n = 4096 * 7168
    weight = sm.Op("quantize: weight 128x128", "w", 0.0, 4 * n + 2 * n + 2 * 4 * (n // 128 // 128), elements=n,
                   count=2.0)
    cast = sm.Op("xla cast", "c", 0.0, 6 * n)
    act = sm.Op("quantize: both orientations", "a", 0.0, 4 * n, elements=n)
    gemm = sm.Op("fp8 gemm: dense", "g", 2.0 * 4096**3, 1 << 20, (4096, 4096, 4096))
    got = sm.weights_from_the_update([weight, cast, act, gemm], r)
    want = (2 * (2 * n + 8 * (n // 128 // 128)) / copy + 2 * n / copy
            + sm.op_seconds(act, r) + sm.op_seconds(gemm, r))
    assert got == pytest.approx(want, rel=1e-12)
    assert got < sum(sm.op_seconds(o, r) * o.count for o in (weight, cast, act, gemm))
    doc = json.loads((sm.OUT / "wide4k-h100_sxm.json").read_text())["precisions"]
    for precision in ("fp8", "bf16"):  # a saving in both, FP8's larger (it reads the masters at quantizer speed)
        assert doc[precision]["with_weights_from_the_update"]["seconds"] < doc[precision]["total"]["seconds"]
    saved = {p: doc[p]["total"]["seconds"] - doc[p]["with_weights_from_the_update"]["seconds"] for p in doc}
    assert saved["fp8"] > saved["bf16"]


def test_rule_picks_scale_only_the_dense_fp8_gemms_by_the_cost_model():
    """The what-if divides a dense FP8 GEMM's compute by `rule_factor` (the cost model's 128×128
    cycles over its pick's), Wgrads with their own pick (f32 out, tile-scaled b), and leaves every
    other op alone; `few_tiles_only` touches only GEMMs whose 128×128 tiles leave SMs idle."""
    from pallas_kernels import tuning

    r = sm.H100_RATES
    wgrad = sm.Op("fp8 gemm: dense wgrad", "w", 2.0 * 768 * 384 * 32768, 1 << 20, (768, 384, 32768))
    fprop = sm.Op("fp8 gemm: dense", "f", 2.0 * 8192**3, 1 << 20, (8192, 8192, 8192), count=2.0)
    quant = sm.Op("quantize: 1x128", "q", 0.0, 1 << 30, elements=1 << 29)
    pick = tuning.rule_config(768, 384, 32768, jnp.float32, r.sms, scalar_b=False)
    assert (pick.tile_m, pick.tile_n, pick.warp_specialized) == (64, 64, False)

    def cycles(c, shape, **kw):
        return tuning.modelled(c, *shape, r.sms, **kw).cycles

    wf = cycles(tuning.Layout(128, 128), wgrad.gemm, out_dtype=jnp.float32, scalar_b=False) / cycles(
        pick, wgrad.gemm, out_dtype=jnp.float32, scalar_b=False)
    assert sm.rule_factor(wgrad, r) == pytest.approx(wf) and wf > 1.5  # 18 tiles of 128 x 128 -> 72
    ff = sm.rule_factor(fprop, r)
    assert ff == pytest.approx(cycles(tuning.Layout(128, 128), fprop.gemm) / cycles(
        tuning.rule_config(8192, 8192, 8192, jnp.bfloat16, r.sms), fprop.gemm))

    def priced(op, factor):  # the GEMM's compute alone scaled; its bytes still bound it
        compute = sm.gemm_seconds(op.gemm, r.fp8_dense, r) / factor
        return max(compute, op.bytes / (r.copy.value * 1e9)) + r.launch.value

    # a GEMM whose bytes bound it today: the what-if may not scale its memory time
    bound = sm.Op("fp8 gemm: dense wgrad", "b", 2.0 * 768 * 384 * 128, 1 << 33, (768, 384, 128))
    assert sm.with_rule_picks([bound], r) == pytest.approx(sm.op_seconds(bound, r), rel=1e-12)

    ops = [wgrad, fprop, quant]
    assert sm.with_rule_picks(ops, r) == pytest.approx(
        priced(wgrad, wf) + 2 * priced(fprop, ff) + sm.op_seconds(quant, r), rel=1e-12)
    assert sm.with_rule_picks(ops, r, few_tiles_only=True) == pytest.approx(
        priced(wgrad, wf) + 2 * sm.op_seconds(fprop, r) + sm.op_seconds(quant, r), rel=1e-12)

    # grouped Fprop/Dgrad: the grouped rule's pick, with a row tile more per group boundary; the
    # grouped Wgrad (its own default config) is left alone
    gemm = (8, 8 * 4096, 4096, 7168)
    grouped = sm.Op("fp8 gemm: grouped", "gg", 2.0 * 8 * 4096 * 4096 * 7168, 1 << 20, gemm)
    gwgrad = sm.Op("fp8 gemm: grouped wgrad", "gw", 2.0 * 4096 * 7168 * 8 * 4096, 1 << 20, (8, 4096, 7168, 8 * 4096))
    gpick = tuning.grouped_rule_config(*gemm[1:], jnp.bfloat16, r.sms, groups=8)
    gf = cycles(tuning.Layout(128, 128), gemm[1:], groups=8) / cycles(gpick, gemm[1:], groups=8)
    assert sm.rule_factor(grouped, r) == pytest.approx(gf) and gf > 1.2
    want = max(sm._gemm_compute(grouped, r) / gf, grouped.bytes / (r.copy.value * 1e9)) + r.launch.value
    assert sm.with_rule_picks([grouped, gwgrad], r) == pytest.approx(want + sm.op_seconds(gwgrad, r), rel=1e-12)


def test_levers_start_from_the_step_as_compiled_and_each_one_helps_fp8():
    r = sm.H100_RATES
    fp8 = sm.step_ops(sm.parse_module(HAND)) + [
        sm.Op("quantize: weight 128x128", "w", 0.0, 6 * (1 << 20), elements=1 << 20)]
    bf16 = [sm.Op("xla gemm (bf16)", "g", 2.0 * 4096**3, 1 << 20, (4096, 4096, 4096)), sm.Op("xla cast", "c", 0.0, 6 << 20)]
    rows = sm.levers(fp8, bf16, r)
    assert len(rows) == len(sm.LEVER_GEMMS) * 2 * 2
    plain = next(x for x in rows if (x["fp8_gemms_faster"], x["quantizers_fraction_of_copy"],
                                      x["weights_from_the_update"]) == (1.0, None, False))
    assert plain["fp8_s"] == pytest.approx(sum(sm.op_seconds(o, r) * o.count for o in fp8))
    assert plain["bf16_s"] == pytest.approx(sum(sm.op_seconds(o, r) for o in bf16))
    by = {(x["fp8_gemms_faster"], x["quantizers_fraction_of_copy"], x["weights_from_the_update"]): x for x in rows}
    factors = [g for g in sm.LEVER_GEMMS if g != "rule"]
    for (g, q, u), x in by.items():  # every lever added takes FP8's time down, and BF16 gets the update too
        if g == "rule":  # the rule's picks, by its cost model: faster than the measured 128 x 128
            assert x["fp8_s"] < by[(1.0, q, u)]["fp8_s"] and x["bf16_s"] == by[(1.0, q, u)]["bf16_s"]
            assert x["fp8_s"] == pytest.approx(sm.priced(fp8, sm.quantizers_at(r, q) if q else r, update=u,
                                                         rule="all"))
        elif g > 1.0:
            assert x["fp8_s"] < by[(factors[factors.index(g) - 1], q, u)]["fp8_s"]
        if q is not None:
            assert x["fp8_s"] < by[(g, None, u)]["fp8_s"]
        if u:
            assert x["fp8_s"] < by[(g, q, False)]["fp8_s"] and x["bf16_s"] < by[(g, q, False)]["bf16_s"]
        assert x["speedup"] == pytest.approx(x["bf16_s"] / x["fp8_s"])


def test_priced_names_its_what_ifs():
    with pytest.raises(ValueError, match="rule must be"):
        sm.priced([], rule="some")


def test_levers_without_kept_hlo_say_how_to_make_it(tmp_path):
    with pytest.raises(SystemExit, match="--keep-hlo"):
        sm.levers_table(tmp_path, ["wide4k"], "h100_sxm")


CUDNN = """\
HloModule attn

ENTRY %main (q: bf16[2,256,4,192], k: bf16[2,256,4,192], v: bf16[2,256,4,128]) -> bf16[2,4,256,128] {
  %q = bf16[2,256,4,192]{3,2,1,0} parameter(0)
  %k = bf16[2,256,4,192]{3,2,1,0} parameter(1)
  %v = bf16[2,256,4,128]{3,2,1,0} parameter(2)
  %fwd = (bf16[2,4,256,128]{3,1,2,0}, f32[2,4,256]{2,1,0}, u8[0]{0}) custom-call(%q, %k, %v), custom_call_target="__cudnn$fmhaSoftmax", operand_layout_constraints={bf16[2,256,4,192]{3,2,1,0}, bf16[2,256,4,192]{3,2,1,0}, bf16[2,256,4,128]{3,2,1,0}}, api_version=API_VERSION_STATUS_RETURNING, backend_config={"cudnn_fmha_backend_config": {"mask_type": "CAUSAL"}}
  %lse = f32[2,4,256]{2,1,0} get-tuple-element(%fwd), index=1
  %out = bf16[2,4,256,128]{3,1,2,0} get-tuple-element(%fwd), index=0
  %bwd = (bf16[2,4,256,192]{3,1,2,0}, bf16[2,4,256,192]{3,1,2,0}, bf16[2,4,256,128]{3,1,2,0}, u8[0]{0}) custom-call(%q, %k, %v, %lse, %out, %out), custom_call_target="__cudnn$fmhaSoftmaxBackward", operand_layout_constraints={bf16[2,256,4,192]{3,2,1,0}, bf16[2,256,4,192]{3,2,1,0}, bf16[2,256,4,128]{3,2,1,0}, f32[2,4,256]{2,1,0}, bf16[2,256,4,128]{3,2,1,0}, bf16[2,256,4,128]{3,2,1,0}}, api_version=API_VERSION_STATUS_RETURNING, backend_config={"cudnn_fmha_backend_config": {"mask_type": "NO_MASK"}}
  ROOT %r = bf16[2,4,256,128]{3,1,2,0} copy(%out)
}
"""


def test_cudnn_attention_counted_by_hand_and_priced_at_its_rate():
    """cuDNN's fused attention: the forward's QKᵀ and PV, the backward's five T×T products, the
    causal mask halving them; priced at the attention rate (compute-bound here)."""
    ops = _by_name(sm.step_ops(sm.parse_module(CUDNN)))
    pairs = 2 * 4 * 256 * 256
    fwd, bwd = ops["fwd"], ops["bwd"]
    assert (fwd.category, bwd.category) == ("attention: cudnn forward", "attention: cudnn backward")
    assert fwd.flops == 2 * pairs / 2 * (192 + 128)  # causal: half the pairs
    assert bwd.flops == 2 * pairs * (3 * 192 + 2 * 128)  # no mask: all of them
    r = sm.H100_RATES
    for op, rate in ((fwd, r.attention), (bwd, r.attention_backward)):
        assert sm.op_seconds(op, r) == pytest.approx(
            max(op.flops / (rate.value * 1e12), op.bytes / (r.copy.value * 1e9)) + r.launch.value)
        assert "assumed" in rate.source
    assert r.attention_backward.value < r.attention.value


def test_h200_rates_are_the_h100s_with_bandwidth_scaled_and_say_they_are_assumed():
    """No H200 has run jfp8: compute-bound rates are the H100's, copies and quantizers scaled by
    the HBM ratio, and every rate says it is assumed; the record bounds the quantizers with the
    H100's own GB/s."""
    h100, h200 = sm.H100_RATES, sm.TARGET_RATES["h200"]
    for name in ("fp8_dense", "fp8_grouped", "bf16_gemm", "bf16_grouped"):
        a, b = getattr(h100, name), getattr(h200, name)
        assert (a.tflops, a.shape) == (b.tflops, b.shape) and b.source.startswith("assumed")
    assert h200.copy.value == pytest.approx(h100.copy.value * 4.8 / 3.35) and "assumed" in h200.copy.source
    for (kind, ours), (kind2, theirs) in zip(h200.quantizers, h100.quantizers, strict=True):
        assert kind == kind2 and [g for _, g in ours] == pytest.approx([g * 4.8 / 3.35 for _, g in theirs])
    assert (h200.attention.value, h200.launch.value) == (h100.attention.value, h100.launch.value)
    assert all("assumed" in r.source for r in (h200.attention, h200.attention_backward, h200.launch))
    assert "assumed" in h200.quantizer_source
    quant = sm.Op("quantize: 1x128", "q", 0.0, 1 << 30, elements=1 << 29)
    gemm = sm.Op("fp8 gemm: dense", "g", 2.0 * 4096**3, 1 << 20, (4096, 4096, 4096))
    assert sm.op_seconds(gemm, h200) == sm.op_seconds(gemm, h100)
    assert sm.op_seconds(quant, h200) < sm.op_seconds(quant, h100)
    text = gzip.decompress(FIXTURE.read_bytes()).decode()
    on_h100, on_h200 = sm.model_hlo(text, h100), sm.model_hlo(text, h200)
    assert "with_h100_quantizers" not in on_h100
    assert on_h200["total"]["seconds"] < on_h200["with_h100_quantizers"]["seconds"] < on_h100["total"]["seconds"]


def test_measured_rows_match_the_gpu_model_not_its_exact_name():
    assert sm.same_gpu("NVIDIA H200", "NVIDIA H200 141GB HBM3e")
    assert sm.same_gpu("NVIDIA H100 80GB HBM3", "NVIDIA H100 80GB HBM3")
    assert not sm.same_gpu("NVIDIA H100 PCIe", "NVIDIA H100 80GB HBM3")
    assert not sm.same_gpu("NVIDIA H200", "NVIDIA H100 80GB HBM3")
    assert not sm.same_gpu(None, "NVIDIA H200")


def test_recipe_overrides_are_checked_and_name_their_own_files():
    """`--recipe quantize_impl=xla` (a what-if of the FP8 recipe): parsed against Fp8Recipe's fields,
    refused at once when the recipe refuses them, and named in the record's and the kept FP8 HLO's file names."""
    recipe = sm._recipe_overrides_arg("quantize_impl=xla")
    assert recipe == {"quantize_impl": "xla"}
    assert sm.variant(0, {}, recipe) == "-recipe-quantize_implxla"
    assert sm.variant(16, {"d_model": 4096}, recipe) == "-b16-d_model4096-recipe-quantize_implxla"
    assert sm.variant(16, {}) == "-b16"
    with pytest.raises(Exception, match="no field 'quantise_impl'"):
        sm._recipe_overrides_arg("quantise_impl=xla")
    with pytest.raises(Exception, match="quantize_impl must be one of"):  # refused before anything compiles
        sm._recipe_overrides_arg("quantize_impl=cuda")
