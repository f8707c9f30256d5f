// Vision tower, embedder and image splice: unit tests of the pieces against hand-computed
// references, and every vision tap plus the full multimodal prefill/decode against the golden
// fixtures (f32 and bf16 weights).
#include <gtest/gtest.h>
#include <unistd.h>

#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <memory>
#include <string>

#include "core/error.h"
#include "gemma4/multimodal.h"
#include "gemma4/registry.h"
#include "gemma4/vision_model.h"
#include "io/npy.h"
#include "kernels/weight_rows.h"
#include "stage/sequence.h"
#include "test_util.h"

using namespace gemstage;
using gemstage::testing::max_abs_diff;
using gemstage::testing::max_abs_diff_rows;

namespace {

std::string fx(const std::string& rel) {
  return std::string(GEMSTAGE_FIXTURES) + "/gemma4-tiny/" + rel;
}

FloatTensor load_f32(const std::string& path) {
  const NpyArray a = load_npy(path);
  FloatTensor t;
  t.shape = a.shape;
  t.data = a.to_f32();
  return t;
}

std::vector<int32_t> load_ids32(const std::string& path) {
  std::vector<int32_t> out;
  for (int64_t v : load_npy(path).to_i64()) out.push_back(static_cast<int32_t>(v));
  return out;
}

const std::shared_ptr<const Model>& shared_model(bool bf16) {
  static const std::shared_ptr<const Model> f32 = Model::open(fx("model"));
  static const std::shared_ptr<const Model> b16 = Model::open(fx("model_bf16"));
  return bf16 ? b16 : f32;
}
const Model& model(bool bf16) {
  return *shared_model(bf16);
}

const TensorStore& fixture_store() {
  static const TensorStore store = TensorStore::open_dir(fx("model"));
  return store;
}

std::string mm_dir(bool bf16) {
  return fx(bf16 ? "multimodal_bf16/" : "multimodal/");
}

std::vector<VisionInput> fixture_images(const Model& m) {
  return vision_inputs_from_arrays(load_npy(fx("multimodal/pixel_values.npy")),
                                   load_npy(fx("multimodal/image_position_ids.npy")),
                                   m.vision()->patch_dim(), "pixel_values.npy",
                                   "image_position_ids.npy");
}

struct MmRun {
  std::unique_ptr<TapRecorder> taps;
  std::vector<int64_t> decode_ids;
  FloatTensor decode_logits;  // [steps, V]
};

// The dump pipeline in-process: vision -> chunked prefill -> greedy decode.
MmRun run_multimodal(bool bf16, PleIdentity mode, int64_t chunk, int steps) {
  const Model& m = model(bf16);
  MmRun r;
  r.taps = std::make_unique<TapRecorder>(std::vector<std::string>{"all"});
  ThreadPool pool(2);
  const std::vector<int32_t> ids = load_ids32(fx("multimodal/input_ids.npy"));
  const FloatTensor soft = m.vision()->encode_all(pool, fixture_images(m), r.taps.get());
  TextRunOptions opt;
  opt.ple_identity = mode;
  const TextConfig& tc = m.config().text;
  Sequence seq(shared_model(bf16), static_cast<int64_t>(ids.size()) + steps + 1);
  FloatTensor last = seq.prefill(pool, ids, &soft, chunk, true, r.taps.get(), opt);
  const int64_t V = tc.vocab_size;
  std::vector<float> row(last.row(last.dim(0) - 1), last.row(last.dim(0) - 1) + V);
  r.decode_logits = FloatTensor({steps, V});
  for (int s = 0; s < steps; ++s) {
    int64_t best = 0;
    for (int64_t i = 1; i < V; ++i)
      if (row[static_cast<size_t>(i)] > row[static_cast<size_t>(best)]) best = i;
    r.decode_ids.push_back(best);
    std::copy(row.begin(), row.end(), r.decode_logits.row(s));
    if (s + 1 == steps) break;
    const int32_t next = static_cast<int32_t>(best);
    FloatTensor l =
        seq.forward(pool, std::span<const int32_t>(&next, 1), nullptr, false, nullptr, opt);
    row.assign(l.row(0), l.row(0) + V);
  }
  return r;
}

std::vector<int64_t> image_rows() {
  std::vector<int64_t> rows;
  const std::vector<int32_t> ids = load_ids32(fx("multimodal/input_ids.npy"));
  for (size_t i = 0; i < ids.size(); ++i)
    if (ids[i] == 2040) rows.push_back(static_cast<int64_t>(i));
  return rows;
}

template <typename F>
std::string error_of(F&& f) {
  try {
    f();
  } catch (const Error& e) {
    return e.what();
  }
  return "";
}

}  // namespace

// ---------------------------------------------------------------------------------------------
// pieces against hand-computed references

TEST(VisionRope, MatchesHandComputedRotation) {
  // head_dim 8: x part = channels 0..3 (pairs (0,2), (1,3)), y part = 4..7 (pairs (4,6), (5,7));
  // inv_freq = [100^0, 100^(-2/4)] = [1, 0.1].
  const VisionRope rope = VisionRope::make(8, 100.0);
  ASSERT_EQ(rope.inv_freq.size(), 2u);
  EXPECT_FLOAT_EQ(rope.inv_freq[0], 1.0f);
  EXPECT_FLOAT_EQ(rope.inv_freq[1], 0.1f);
  float v[8] = {1, 2, 3, 4, 5, 6, 7, 8};
  apply_vision_rope(rope, /*x=*/2, /*y=*/3, v, 1);
  auto rot = [](double a, double b, double ang, double* oa, double* ob) {
    *oa = a * std::cos(ang) - b * std::sin(ang);
    *ob = b * std::cos(ang) + a * std::sin(ang);
  };
  double e[8];
  rot(1, 3, 2 * 1.0, &e[0], &e[2]);
  rot(2, 4, 2 * 0.1, &e[1], &e[3]);
  rot(5, 7, 3 * 1.0, &e[4], &e[6]);
  rot(6, 8, 3 * 0.1, &e[5], &e[7]);
  for (int i = 0; i < 8; ++i) EXPECT_NEAR(v[i], e[i], 2e-6) << "channel " << i;
}

TEST(VisionRope, OriginIsIdentityAndHeadsIndependent) {
  const VisionRope rope = VisionRope::make(32, 100.0);
  std::vector<float> v(64);
  for (size_t i = 0; i < v.size(); ++i) v[i] = 0.1f * static_cast<float>(i) - 2.0f;
  std::vector<float> w = v;
  apply_vision_rope(rope, 0, 0, w.data(), 2);
  EXPECT_EQ(v, w);
  // Two heads get the same rotation: rotating head 1 alone equals head 1 of the pair.
  std::vector<float> both = v, one(v.begin() + 32, v.end());
  apply_vision_rope(rope, 5, 7, both.data(), 2);
  apply_vision_rope(rope, 5, 7, one.data(), 1);
  for (int i = 0; i < 32; ++i)
    EXPECT_EQ(both[static_cast<size_t>(32 + i)], one[static_cast<size_t>(i)]);
}

TEST(VisionRope, DotProductDependsOnlyOnOffsets) {
  const VisionRope rope = VisionRope::make(32, 100.0);
  std::vector<float> q(32), k(32);
  for (int i = 0; i < 32; ++i) {
    q[static_cast<size_t>(i)] = std::sin(0.7f * static_cast<float>(i));
    k[static_cast<size_t>(i)] = std::cos(0.3f * static_cast<float>(i));
  }
  auto dot_at = [&](int64_t qx, int64_t qy, int64_t kx, int64_t ky) {
    std::vector<float> a = q, b = k;
    apply_vision_rope(rope, qx, qy, a.data(), 1);
    apply_vision_rope(rope, kx, ky, b.data(), 1);
    double d = 0;
    for (int i = 0; i < 32; ++i)
      d += static_cast<double>(a[static_cast<size_t>(i)]) * b[static_cast<size_t>(i)];
    return d;
  };
  EXPECT_NEAR(dot_at(3, 4, 1, 1), dot_at(12, 9, 10, 6), 1e-4);
  // x and y act on different channels: swapping the offsets changes the result.
  EXPECT_GT(std::abs(dot_at(3, 0, 0, 0) - dot_at(0, 3, 0, 0)), 1e-3);
}

TEST(VisionRope, RejectsHeadDimNotMultipleOf4) {
  EXPECT_NE(error_of([] { VisionRope::make(30, 100.0); }).find("multiple of 4"), std::string::npos);
}

TEST(VisionPooler, AveragesKxKBlocksByPositionInAnyInputOrder) {
  // 6 wide x 3 high grid, k = 3 -> 2 slots; hidden = (x + 10y, -x).
  std::vector<int64_t> xy;
  std::vector<float> h;
  for (int64_t y = 2; y >= 0; --y)  // scrambled order: rows bottom-up, columns right-to-left
    for (int64_t x = 5; x >= 0; --x) {
      xy.push_back(x);
      xy.push_back(y);
      h.push_back(static_cast<float>(x + 10 * y));
      h.push_back(static_cast<float>(-x));
    }
  const FloatTensor p = pool_by_position(h.data(), xy.data(), 18, 2, 3, 6, 3);
  ASSERT_EQ(p.shape, (Shape{2, 2}));
  // slot 0: x in 0..2, y in 0..2 -> mean x = 1, mean y = 1.
  EXPECT_NEAR(p.row(0)[0], 11.0f, 1e-5);
  EXPECT_NEAR(p.row(0)[1], -1.0f, 1e-6);
  // slot 1: x in 3..5 -> mean x = 4.
  EXPECT_NEAR(p.row(1)[0], 14.0f, 1e-5);
  EXPECT_NEAR(p.row(1)[1], -4.0f, 1e-6);
}

TEST(VisionPooler, SlotOrderIsRowMajorOverThePooledGrid) {
  // 6x6 grid, k = 3 -> 2x2 slots: j = floor(x/3) + 2 floor(y/3). hidden = x + 10y.
  std::vector<int64_t> xy;
  std::vector<float> h;
  for (int64_t y = 0; y < 6; ++y)
    for (int64_t x = 0; x < 6; ++x) {
      xy.push_back(x);
      xy.push_back(y);
      h.push_back(static_cast<float>(x + 10 * y));
    }
  const FloatTensor p = pool_by_position(h.data(), xy.data(), 36, 1, 3, 6, 6);
  ASSERT_EQ(p.shape, (Shape{4, 1}));
  EXPECT_NEAR(p.data[0], 11.0f, 1e-5);
  EXPECT_NEAR(p.data[1], 14.0f, 1e-5);
  EXPECT_NEAR(p.data[2], 41.0f, 1e-5);
  EXPECT_NEAR(p.data[3], 44.0f, 1e-5);
}

TEST(ClippableLinear, ClampsInputThenOutput) {
  // W = [[1, 2, 3], [-1, 0.5, 1]], x = [2, -3, 0.25] -> clamp to [-1, 1]: [1, -1, 0.25]
  // y = [1 - 2 + 0.75, -1 - 0.5 + 0.25] = [-0.25, -1.25] -> clamp to [-1, 2]: [-0.25, -1].
  const std::vector<float> w = {1, 2, 3, -1, 0.5f, 1};
  ClippableLinear l;
  l.weight = {"w", DType::F32, {2, 3}, w.data(), w.size() * sizeof(float)};
  l.input_min = -1;
  l.input_max = 1;
  l.output_min = -1;
  l.output_max = 2;
  ThreadPool pool(1);
  const std::vector<float> x = {2, -3, 0.25f};
  float y[2];
  clippable_linear(pool, l, x.data(), 1, y);
  EXPECT_FLOAT_EQ(y[0], -0.25f);
  EXPECT_FLOAT_EQ(y[1], -1.0f);
  EXPECT_EQ(x[0], 2.0f);  // the input is not modified
  // Infinite bounds (no clipped linears): the plain product [2 - 6 + 0.75, -2 - 1.5 + 0.25].
  ClippableLinear plain;
  plain.weight = l.weight;
  clippable_linear(pool, plain, x.data(), 1, y);
  EXPECT_FLOAT_EQ(y[0], -3.25f);
  EXPECT_FLOAT_EQ(y[1], -3.25f);
}

TEST(VisionWeights, ClipScalarsAreBoundFromTheCheckpoint) {
  const Model& m = model(false);
  ASSERT_NE(m.vision(), nullptr);
  const VisionLayerWeights& l0 = m.vision()->weights().layers.at(0);
  const float expect = weight_at(
      fixture_store().view("model.vision_tower.encoder.layers.0.self_attn.q_proj.input_max"), 0);
  EXPECT_EQ(l0.q_proj.input_max, expect);
  EXPECT_TRUE(std::isfinite(l0.q_proj.input_min));
  EXPECT_LT(l0.q_proj.input_min, l0.q_proj.input_max);
  EXPECT_TRUE(std::isfinite(l0.down_proj.output_max));
  EXPECT_LT(l0.down_proj.output_min, l0.down_proj.output_max);
}

TEST(VisionWeights, WithoutClippedLinearsTheBoundsAreInfinite) {
  const Model& m = model(false);
  ModelConfig c = m.config();
  c.vision->use_clipped_linears = false;
  for (const TensorSpec& sp : vision_tensor_specs(c))
    EXPECT_EQ(sp.key.find("input_min"), std::string::npos) << sp.key;
  const VisionWeights w = bind_vision_weights(c, fixture_store());
  for (const VisionLayerWeights& l : w.layers)
    for (const ClippableLinear* cl :
         {&l.q_proj, &l.k_proj, &l.v_proj, &l.o_proj, &l.gate_proj, &l.up_proj, &l.down_proj}) {
      EXPECT_TRUE(std::isinf(cl->input_min) && cl->input_min < 0);
      EXPECT_TRUE(std::isinf(cl->input_max) && cl->input_max > 0);
      EXPECT_TRUE(std::isinf(cl->output_min) && cl->output_min < 0);
      EXPECT_TRUE(std::isinf(cl->output_max) && cl->output_max > 0);
    }
  // The clamps matter on this checkpoint: switching them off changes the soft tokens.
  ThreadPool pool(2);
  const VisionTower unclipped(c, w);
  const std::vector<VisionInput> imgs = fixture_images(m);
  const double d = max_abs_diff_rows(unclipped.encode_all(pool, imgs, nullptr),
                                     m.vision()->encode_all(pool, imgs, nullptr));
  EXPECT_GT(d, 1e-3);
}

TEST(VisionWeights, TextOnlyCheckpointHasNoTower) {
  const std::filesystem::path dir = gemstage::testing::temp_dir("vision_textonly");
  std::string cfg;
  {
    std::FILE* f = std::fopen(fx("model/config.json").c_str(), "rb");
    ASSERT_NE(f, nullptr);
    char buf[4096];
    size_t n;
    while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) cfg.append(buf, n);
    std::fclose(f);
  }
  const size_t at = cfg.find("\"vision_config\"");
  ASSERT_NE(at, std::string::npos);
  const size_t end = cfg.find("\"audio_config\"", at);
  ASSERT_NE(end, std::string::npos);
  cfg = cfg.substr(0, at) + "\"vision_config\": null,\n  " + cfg.substr(end);
  {
    std::FILE* f = std::fopen((dir / "config.json").string().c_str(), "wb");
    ASSERT_NE(f, nullptr);
    std::fwrite(cfg.data(), 1, cfg.size(), f);
    std::fclose(f);
  }
  std::filesystem::create_symlink(fx("model/model.safetensors"), dir / "model.safetensors");
  const auto m = Model::open(dir.string());
  EXPECT_EQ(m->vision(), nullptr);
  std::filesystem::remove_all(dir);
}

// ---------------------------------------------------------------------------------------------
// input validation

TEST(VisionInputs, FixtureGridIs21x24WithPadding) {
  const Model& m = model(false);
  const std::vector<VisionInput> imgs = fixture_images(m);
  ASSERT_EQ(imgs.size(), 1u);
  EXPECT_EQ(imgs[0].max_patches, 630);
  const PatchGrid g = check_patch_positions(imgs[0].position_ids.data(), 630, m.vision()->config());
  EXPECT_EQ(g.width, 24);
  EXPECT_EQ(g.height, 21);
  EXPECT_EQ(g.rows.size(), 504u);
  EXPECT_EQ(g.num_soft_tokens(), 56);
}

TEST(VisionInputs, RejectsBadPositionIds) {
  const VisionConfig& v = model(false).vision()->config();  // pos size 32, k = 3
  auto grid = [](int64_t w, int64_t h, int64_t pad) {
    std::vector<int64_t> p;
    for (int64_t y = 0; y < h; ++y)
      for (int64_t x = 0; x < w; ++x) p.insert(p.end(), {x, y});
    for (int64_t i = 0; i < pad; ++i) p.insert(p.end(), {-1, -1});
    return p;
  };
  auto err = [&](std::vector<int64_t> p) {
    return error_of(
        [&] { check_patch_positions(p.data(), static_cast<int64_t>(p.size() / 2), v); });
  };
  EXPECT_EQ(err(grid(6, 3, 9)), "");
  std::vector<int64_t> p = grid(6, 3, 9);
  p[2 * 4] = 32;  // x beyond position_embedding_size
  EXPECT_NE(err(p).find("outside [0, position_embedding_size = 32)"), std::string::npos) << err(p);
  p = grid(6, 3, 9);
  p[2 * 18] = 0;  // (0, -1): half padding
  EXPECT_NE(err(p).find("row 18"), std::string::npos) << err(p);
  p = grid(6, 3, 9);
  p[2 * 5] = 4;  // duplicate (4, 0), and (5, 0) missing
  EXPECT_NE(err(p).find("appears twice"), std::string::npos) << err(p);
  p = grid(6, 3, 9);
  p[2 * 17] = -1;  // drop (5, 2)
  p[2 * 17 + 1] = -1;
  EXPECT_NE(err(p).find("do not form a grid"), std::string::npos) << err(p);
  EXPECT_NE(err(grid(4, 3, 15)).find("multiples of pooling_kernel_size 3"), std::string::npos);
  EXPECT_NE(err(grid(6, 3, 10)).find("not a multiple of 9"), std::string::npos);
  EXPECT_NE(err(std::vector<int64_t>(18, -1)).find("every row is padding"), std::string::npos);
}

TEST(VisionInputs, RejectsWrongPixelWidthAndMismatchedArrays) {
  const Model& m = model(false);
  NpyArray pix = load_npy(fx("multimodal/pixel_values.npy"));
  const NpyArray pos = load_npy(fx("multimodal/image_position_ids.npy"));
  NpyArray narrow = pix;
  narrow.shape = {1, 1260, 384};
  std::string e = error_of([&] {
    vision_inputs_from_arrays(narrow, pos, m.vision()->patch_dim(), "pv.npy", "pos.npy");
  });
  EXPECT_NE(e.find("pv.npy: expected pixel_values of shape [max_patches, 768]"), std::string::npos)
      << e;
  NpyArray fewer = pix;
  fewer.shape = {1, 315, 1536};
  e = error_of([&] { vision_inputs_from_arrays(fewer, pos, 768, "pv.npy", "pos.npy"); });
  EXPECT_NE(e.find("pv.npy"), std::string::npos) << e;
  NpyArray flat = pix;
  flat.shape = {630, 768};  // [Np, 3pp] is accepted too
  EXPECT_EQ(vision_inputs_from_arrays(flat, pos, 768, "pv", "pos").size(), 1u);
  NpyArray short_pos = pos;
  short_pos.shape = {1, 315, 4};
  e = error_of([&] { vision_inputs_from_arrays(pix, short_pos, 768, "pv.npy", "pos.npy"); });
  EXPECT_NE(e.find("pos.npy"), std::string::npos) << e;
}

TEST(VisionTower, EncodeRejectsBadPositionIds) {
  const Model& m = model(false);
  std::vector<VisionInput> imgs = fixture_images(m);
  imgs[0].position_ids[2 * 10] = 40;
  ThreadPool pool(2);
  const std::string e = error_of([&] { m.vision()->encode_all(pool, imgs, nullptr); });
  EXPECT_NE(e.find("image 1: image_position_ids row 10"), std::string::npos) << e;
}

// ---------------------------------------------------------------------------------------------
// vision taps vs the fixture

class VisionFixture : public ::testing::TestWithParam<bool> {};

TEST_P(VisionFixture, EveryVisionTapMatches) {
  const bool bf16 = GetParam();
  const Model& m = model(bf16);
  const std::string dir = mm_dir(bf16);
  TapRecorder taps({"all"});
  ThreadPool pool(2);
  const std::vector<VisionInput> imgs = fixture_images(m);
  const FloatTensor soft = m.vision()->encode(pool, imgs[0].pixel_values.data(),
                                              imgs[0].position_ids.data(), 630, &taps);
  ASSERT_EQ(soft.shape, (Shape{56, 128}));
  const FloatTensor pe = taps.get("vision_patch_embeds"), eo = taps.get("vision_encoder_out"),
                    po = taps.get("vision_pooled"), eb = taps.get("vision_embedder_out");
  EXPECT_EQ(pe.shape, (Shape{630, 64}));
  EXPECT_EQ(eo.shape, (Shape{630, 64}));
  EXPECT_EQ(po.shape, (Shape{56, 64}));
  EXPECT_EQ(eb.shape, (Shape{56, 128}));
  EXPECT_EQ(eb.data, soft.data);
  const double e_pe = max_abs_diff_rows(pe, load_f32(dir + "vision_patch_embeds.npy"), 504);
  const double e_pe_all = max_abs_diff_rows(pe, load_f32(dir + "vision_patch_embeds.npy"));
  const double e_eo = max_abs_diff_rows(eo, load_f32(dir + "vision_encoder_out.npy"), 504);
  const double e_po = max_abs_diff_rows(po, load_f32(dir + "vision_pooled.npy"));
  const double e_eb = max_abs_diff_rows(eb, load_f32(dir + "vision_embedder_out.npy"));
  std::cout << (bf16 ? "[bf16]" : "[f32]") << " max_abs vision_patch_embeds " << e_pe
            << " (all 630 rows " << e_pe_all << "), vision_encoder_out " << e_eo
            << ", vision_pooled " << e_po << ", vision_embedder_out " << e_eb << "\n";
  EXPECT_LE(e_pe, 5e-5);
  EXPECT_LE(e_pe_all, 5e-5);  // padded rows are filled the way HF fills them
  EXPECT_LE(e_eo, 2e-4);
  EXPECT_LE(e_po, 5e-4);
  EXPECT_LE(e_eb, 5e-5);
  for (int64_t r = 504; r < 630; ++r)  // documented: padded encoder rows are zero
    for (int64_t d = 0; d < 64; ++d) ASSERT_EQ(eo.row(r)[d], 0.0f);
  // The input taps round-trip.
  EXPECT_EQ(taps.get("pixel_values").data, imgs[0].pixel_values);
  EXPECT_EQ(taps.get_ids("image_position_ids"), imgs[0].position_ids);
}

INSTANTIATE_TEST_SUITE_P(F32AndBf16, VisionFixture, ::testing::Values(false, true),
                         [](const auto& p) { return p.param ? "bf16" : "f32"; });

TEST(VisionTower, SeveralImagesConcatenateInOrder) {
  const Model& m = model(false);
  ThreadPool pool(2);
  const VisionInput a = fixture_images(m)[0];
  // Image b: the top-left 9x12 patches of a, padded to 117 rows (13 * 9), order shuffled.
  VisionInput b;
  b.max_patches = 117;
  const int64_t pd = m.vision()->patch_dim();
  for (int64_t y = 8; y >= 0; --y)
    for (int64_t x = 0; x < 12; ++x) {
      const int64_t src = y * 24 + x;  // a is row-major over its 24-wide grid
      ASSERT_EQ(a.position_ids[static_cast<size_t>(2 * src)], x);
      b.pixel_values.insert(b.pixel_values.end(), a.pixel_values.begin() + src * pd,
                            a.pixel_values.begin() + (src + 1) * pd);
      b.position_ids.insert(b.position_ids.end(), {x, y});
    }
  for (int i = 0; i < 9; ++i) {
    b.pixel_values.insert(b.pixel_values.end(), static_cast<size_t>(pd), 0.0f);
    b.position_ids.insert(b.position_ids.end(), {-1, -1});
  }
  EXPECT_EQ(m.vision()->num_soft_tokens(b.position_ids.data(), 117), 12);
  TapRecorder taps({"vision_pooled", "vision_patch_embeds"});
  const FloatTensor both = m.vision()->encode_all(pool, {a, b}, &taps);
  const FloatTensor sa = m.vision()->encode_all(pool, {a}, nullptr);
  const FloatTensor sb = m.vision()->encode_all(pool, {b}, nullptr);
  ASSERT_EQ(both.shape, (Shape{68, 128}));
  EXPECT_EQ(max_abs_diff_rows(slice_rows(both, 0, 56), sa), 0.0);
  EXPECT_EQ(max_abs_diff_rows(slice_rows(both, 56, 12), sb), 0.0);
  EXPECT_EQ(taps.get("vision_pooled").shape, (Shape{68, 64}));
  EXPECT_EQ(taps.get("vision_patch_embeds").shape, (Shape{630 + 117, 64}));
}

// ---------------------------------------------------------------------------------------------
// the full multimodal forward vs the fixture

class MultimodalFixture : public ::testing::TestWithParam<bool> {};

TEST_P(MultimodalFixture, PrefillAndDecodeMatch) {
  const bool bf16 = GetParam();
  const std::string dir = mm_dir(bf16);
  const MmRun r = run_multimodal(bf16, PleIdentity::Pad, 0, 8);
  const TapRecorder& t = *r.taps;
  const double e_ie =
      max_abs_diff_rows(t.get("inputs_embeds"), load_f32(dir + "inputs_embeds.npy"));
  const double e_pli =
      max_abs_diff_rows(t.get("per_layer_inputs"), load_f32(dir + "per_layer_inputs.npy"));
  const double e_hs =
      max_abs_diff_rows(t.get("hidden_states"), load_f32(dir + "hidden_states.npy"));
  const double e_lg = max_abs_diff_rows(t.get("logits"), load_f32(dir + "logits.npy"));
  const double e_dl = max_abs_diff_rows(r.decode_logits, load_f32(dir + "decode_logits.npy"));
  std::cout << (bf16 ? "[bf16]" : "[f32]") << " max_abs inputs_embeds " << e_ie
            << ", per_layer_inputs " << e_pli << ", hidden_states " << e_hs << ", logits " << e_lg
            << ", decode_logits " << e_dl << "\n";
  EXPECT_LE(e_ie, 5e-5);
  EXPECT_LE(e_pli, 2e-4);
  EXPECT_LE(e_hs, 1e-2);
  EXPECT_LE(e_lg, 5e-4);
  EXPECT_LE(e_dl, 5e-4);
  EXPECT_EQ(r.decode_ids, load_npy(dir + "decode_ids.npy").to_i64());
  EXPECT_EQ(t.get_ids("llm_input_ids"), load_npy(dir + "llm_input_ids.npy").to_i64());
  EXPECT_EQ(t.get_ids("ple_ids"), load_npy(dir + "ple_ids.npy").to_i64());
}

TEST_P(MultimodalFixture, ChunkedPrefillGivesTheSameLogits) {
  const bool bf16 = GetParam();
  const FloatTensor want = load_f32(mm_dir(bf16) + "logits.npy");
  const std::vector<int64_t> want_ids = load_npy(mm_dir(bf16) + "decode_ids.npy").to_i64();
  const MmRun whole = run_multimodal(bf16, PleIdentity::Pad, 0, 8);
  const FloatTensor lw = whole.taps->get("logits");
  for (int64_t chunk : {1, 7}) {
    const MmRun r = run_multimodal(bf16, PleIdentity::Pad, chunk, 8);
    const FloatTensor l = r.taps->get("logits");
    const double e = max_abs_diff_rows(l, want), d = max_abs_diff_rows(l, lw);
    std::cout << (bf16 ? "[bf16]" : "[f32]") << " chunk " << chunk << ": max_abs logits vs fixture "
              << e << ", vs whole-prompt run " << d << "\n";
    EXPECT_LE(e, 5e-4) << "chunk " << chunk;
    EXPECT_LE(d, 5e-5) << "chunk " << chunk;
    EXPECT_EQ(r.decode_ids, want_ids) << "chunk " << chunk;
    // Every chunk spliced exactly its own soft tokens.
    EXPECT_LE(max_abs_diff_rows(r.taps->get("inputs_embeds"), whole.taps->get("inputs_embeds")),
              0.0);
  }
}

TEST_P(MultimodalFixture, PlaceholderRowsGetThePadPleIdentity) {
  const bool bf16 = GetParam();
  const Model& m = model(bf16);
  const MmRun r = run_multimodal(bf16, PleIdentity::Pad, 0, 1);
  const FloatTensor ple = r.taps->get("ple_token_embeds");  // [70, L, P]
  EXPECT_LE(max_abs_diff_rows(ple, load_f32(mm_dir(bf16) + "ple_token_embeds.npy")), 1e-6);
  const TextConfig& tc = m.config().text;
  const int64_t LP = int64_t{tc.num_hidden_layers} * tc.ple_dim();
  std::vector<float> pad_row(static_cast<size_t>(LP));
  weight_row_to_f32(m.embeddings_model().weights().embed_tokens_per_layer, tc.pad_token_id,
                    pad_row.data());
  const float scale = std::sqrt(static_cast<float>(tc.ple_dim()));
  const std::vector<int64_t> rows = image_rows();
  ASSERT_EQ(rows.size(), 56u);
  for (int64_t row : rows)
    for (int64_t i = 0; i < LP; ++i)
      ASSERT_EQ(ple.data[static_cast<size_t>(row * LP + i)],
                pad_row[static_cast<size_t>(i)] * scale)
          << "row " << row << " element " << i;
}

TEST_P(MultimodalFixture, RawIdDiagnosticReproducesTheKnownWrongOutputs) {
  const bool bf16 = GetParam();
  const std::string dir = mm_dir(bf16);
  const MmRun pad = run_multimodal(bf16, PleIdentity::Pad, 0, 8);
  const MmRun raw = run_multimodal(bf16, PleIdentity::Raw, 0, 8);
  EXPECT_EQ(raw.decode_ids, load_npy(dir + "decode_ids_rawid.npy").to_i64());
  EXPECT_NE(raw.decode_ids, pad.decode_ids);
  if (!bf16) {  // the bf16 fixture carries only decode_ids_rawid
    EXPECT_LE(max_abs_diff_rows(raw.taps->get("per_layer_inputs"),
                                load_f32(dir + "per_layer_inputs_rawid.npy")),
              2e-4);
    EXPECT_LE(max_abs_diff_rows(raw.taps->get("ple_token_embeds"),
                                load_f32(dir + "ple_token_embeds_rawid.npy")),
              1e-6);
    const double e = max_abs_diff_rows(raw.taps->get("logits"), load_f32(dir + "logits_rawid.npy"));
    std::cout << "[f32] raw-id diagnostic: max_abs logits vs logits_rawid " << e << "\n";
    EXPECT_LE(e, 5e-4);
  }
  // Only the image rows differ: text rows of per_layer_inputs are bit-identical.
  const FloatTensor a = pad.taps->get("per_layer_inputs"), b = raw.taps->get("per_layer_inputs");
  const int64_t row = a.numel() / a.dim(0);
  const std::vector<int64_t> img = image_rows();
  ASSERT_EQ(a.shape, b.shape);
  for (int64_t r = 0; r < a.dim(0); ++r) {
    const auto at = static_cast<size_t>(r * row), n = static_cast<size_t>(row);
    const double d = max_abs_diff(std::span<const float>(a.data).subspan(at, n),
                                  std::span<const float>(b.data).subspan(at, n));
    const bool is_img = std::find(img.begin(), img.end(), r) != img.end();
    if (is_img)
      EXPECT_GT(d, 1e-3) << "image row " << r;
    else
      EXPECT_EQ(d, 0.0) << "text row " << r;
  }
  // Logits before the first image row are identical.
  const FloatTensor la = pad.taps->get("logits"), lb = raw.taps->get("logits");
  EXPECT_EQ(max_abs_diff_rows(la, lb, img.front()), 0.0);
}

INSTANTIATE_TEST_SUITE_P(F32AndBf16, MultimodalFixture, ::testing::Values(false, true),
                         [](const auto& p) { return p.param ? "bf16" : "f32"; });

// ---------------------------------------------------------------------------------------------
// splice errors

TEST(Multimodal, PlaceholderCountMustEqualSoftTokens) {
  const Model& m = model(false);
  ThreadPool pool(2);
  const FloatTensor soft = m.vision()->encode_all(pool, fixture_images(m), nullptr);
  std::vector<int32_t> ids = load_ids32(fx("multimodal/input_ids.npy"));
  ids.erase(ids.begin() + 10);  // 55 placeholders for 56 soft tokens
  Sequence seq(shared_model(false), 128);
  TextRunOptions opt;
  std::string e = error_of([&] { seq.prefill(pool, ids, &soft, 7, false, nullptr, opt); });
  EXPECT_NE(e.find("55 image/audio/video placeholder tokens but the images yield 56"),
            std::string::npos)
      << e;
  e = error_of([&] { m.embeddings_model().embed(pool, ids, &soft, opt, nullptr); });
  EXPECT_NE(e.find("55"), std::string::npos) << e;
  ids = load_ids32(fx("multimodal/input_ids.npy"));
  e = error_of([&] { seq.prefill(pool, ids, nullptr, 0, false, nullptr, opt); });
  EXPECT_NE(e.find("56 image/audio/video placeholder tokens but the images yield 0"),
            std::string::npos)
      << e;
}

// ---------------------------------------------------------------------------------------------
// the CLI end to end

namespace {
int run_cli(const std::string& args, const std::string& log) {
  const std::string cmd = std::string(GEMSTAGE_CLI) + " " + args + " > " + log + " 2>&1";
  return std::system(cmd.c_str());
}
std::string read_file(const std::string& p) {
  std::FILE* f = std::fopen(p.c_str(), "rb");
  if (!f) return "";
  std::string s;
  char buf[4096];
  size_t n;
  while ((n = std::fread(buf, 1, sizeof buf, f)) > 0) s.append(buf, n);
  std::fclose(f);
  return s;
}
}  // namespace

TEST(DumpCli, MultimodalDumpWithChunksMatchesTheFixture) {
  const std::filesystem::path tmp = gemstage::testing::temp_dir("vision_cli");
  const std::string d = fx("multimodal/"), out = (tmp / "out").string(),
                    log = (tmp / "log.txt").string();
  const std::string args = "dump -m " + fx("model") + " --ids " + d + "input_ids.npy" +
                           " --pixel-values " + d + "pixel_values.npy" + " --image-position-ids " +
                           d + "image_position_ids.npy" + " --out " + out +
                           " --chunk 7 --decode 8 --taps logits,decode_ids,vision_embedder_out,"
                           "pixel_values,image_position_ids -t 2";
  ASSERT_EQ(run_cli(args, log), 0) << read_file(log);
  EXPECT_LE(max_abs_diff_rows(load_f32(out + "/logits.npy"), load_f32(d + "logits.npy")), 5e-4);
  EXPECT_EQ(load_npy(out + "/decode_ids.npy").to_i64(), load_npy(d + "decode_ids.npy").to_i64());
  EXPECT_LE(max_abs_diff_rows(load_f32(out + "/vision_embedder_out.npy"),
                              load_f32(d + "vision_embedder_out.npy")),
            5e-5);
  // Same names, shapes ([N_img, max_patches, ...]) and values as the fixture's processor outputs.
  const NpyArray pos = load_npy(out + "/image_position_ids.npy");
  EXPECT_EQ(pos.shape, load_npy(d + "image_position_ids.npy").shape);
  EXPECT_EQ(pos.to_i64(), load_npy(d + "image_position_ids.npy").to_i64());
  EXPECT_EQ(load_npy(out + "/pixel_values.npy").shape, load_npy(d + "pixel_values.npy").shape);

  // Errors: a missing positions file, a wrong pixel width, too few placeholders.
  EXPECT_NE(run_cli("dump -m " + fx("model") + " --ids " + d + "input_ids.npy --pixel-values " + d +
                        "pixel_values.npy --out " + out,
                    log),
            0);
  EXPECT_NE(read_file(log).find("--image-position-ids"), std::string::npos) << read_file(log);
  const std::string bad = (tmp / "bad_pixels.npy").string();
  save_npy_f32(bad, {630, 384}, std::vector<float>(630 * 384, 0.5f));
  EXPECT_NE(run_cli("dump -m " + fx("model") + " --ids " + d + "input_ids.npy --pixel-values " +
                        bad + " --image-position-ids " + d + "image_position_ids.npy --out " + out,
                    log),
            0);
  EXPECT_NE(read_file(log).find("bad_pixels.npy: expected pixel_values of shape"),
            std::string::npos)
      << read_file(log);
  EXPECT_NE(run_cli("dump -m " + fx("model") + " --ids " + fx("text/input_ids.npy") +
                        " --pixel-values " + d + "pixel_values.npy --image-position-ids " + d +
                        "image_position_ids.npy --out " + out,
                    log),
            0);
  EXPECT_NE(
      read_file(log).find(
          "0 image/audio/video placeholder tokens but the 1 image(s), 0 video frame(s) yield 56"),
      std::string::npos)
      << read_file(log);
  // --pixel-values / --image-position-ids repeat, one pair per image.
  const std::string two = " --pixel-values " + d + "pixel_values.npy --image-position-ids " + d +
                          "image_position_ids.npy";
  EXPECT_NE(run_cli("dump -m " + fx("model") + " --ids " + d + "input_ids.npy" + two + two +
                        " --out " + out,
                    log),
            0);
  EXPECT_NE(read_file(log).find("56 image/audio/video placeholder tokens but the 2 image(s), 0 "
                                "video frame(s) yield 112"),
            std::string::npos)
      << read_file(log);
  std::filesystem::remove_all(tmp);
}

// The full image path: image.png decoded and preprocessed here gives the fixture's exact pixel
// values, and the multimodal logits and greedy ids of the HF reference, for f32 and bf16 weights.
TEST(DumpCli, ImageFileThroughPreprocessingMatchesTheFixture) {
  const std::filesystem::path tmp = gemstage::testing::temp_dir("vision_png");
  for (const auto& [model, ref] :
       {std::pair{"model", "multimodal/"}, std::pair{"model_bf16", "multimodal_bf16/"}}) {
    const std::string out = (tmp / model).string(), log = (tmp / "log.txt").string();
    const std::string d = fx(ref);
    ASSERT_EQ(run_cli("dump -m " + fx(model) + " --ids " + d + "input_ids.npy --image " +
                          fx("multimodal/image.png") + " --out " + out +
                          " --chunk 9 --decode 8 --taps logits,decode_ids,pixel_values,"
                          "per_layer_inputs,vision_pooled -t 2",
                      log),
              0)
        << read_file(log);
    EXPECT_EQ(load_f32(out + "/pixel_values.npy").data,
              load_f32(fx("multimodal/pixel_values.npy")).data)
        << model;
    EXPECT_LE(
        max_abs_diff_rows(load_f32(out + "/vision_pooled.npy"), load_f32(d + "vision_pooled.npy")),
        5e-4)
        << model;
    EXPECT_LE(max_abs_diff_rows(load_f32(out + "/per_layer_inputs.npy"),
                                load_f32(d + "per_layer_inputs.npy")),
              2e-4)
        << model;
    EXPECT_LE(max_abs_diff_rows(load_f32(out + "/logits.npy"), load_f32(d + "logits.npy")), 5e-4)
        << model;
    EXPECT_EQ(load_npy(out + "/decode_ids.npy").to_i64(), load_npy(d + "decode_ids.npy").to_i64())
        << model;
  }
  // A corrupt image is refused with a message naming the file.
  const std::string bad = (tmp / "broken.png").string();
  {
    std::FILE* f = std::fopen(bad.c_str(), "wb");
    const unsigned char png_magic[8] = {0x89, 'P', 'N', 'G', 0x0d, 0x0a, 0x1a, 0x0a};
    std::fwrite(png_magic, 1, 8, f);
    std::fclose(f);
  }
  const std::string log = (tmp / "bad.txt").string();
  EXPECT_NE(run_cli("dump -m " + fx("model") + " --ids " + fx("multimodal/input_ids.npy") +
                        " --image " + bad + " --out " + (tmp / "x").string(),
                    log),
            0);
  EXPECT_NE(read_file(log).find("broken.png"), std::string::npos) << read_file(log);
}
