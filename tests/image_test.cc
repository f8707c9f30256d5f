// Image decoding, resizing and Gemma 4 preprocessing.
//
// Sources of truth: the HF fixture (tests/fixtures/gemma4-tiny/multimodal), PIL-made goldens
// (tests/fixtures/image, written once by scripts/make_image_goldens.py with Pillow 9.4), the
// resize-target table of gemma4-spec.md section 4.6, and images written here with libpng/libjpeg.

// clang-format off
#include <csetjmp>
#include <cstdio>
#include <jpeglib.h>
#include <png.h>
#include <zlib.h>
// clang-format on

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <iostream>
#include <nlohmann/json.hpp>
#include <string>
#include <vector>

#include "core/error.h"
#include "image/image_decode.h"
#include "image/image_processor.h"
#include "image/image_resize.h"
#include "io/npy.h"

namespace gemstage {
namespace {

const std::string kFixtures = GEMSTAGE_FIXTURES;
const std::string kImageFixtures = kFixtures + "/image";

// ---------------------------------------------------------------------------------------------
// Helpers: encoders for test inputs, and error-message matching.

struct PngWriteBuffer {
  std::vector<uint8_t> bytes;
};

void png_write_to_vector(png_structp png, png_bytep data, size_t n) {
  auto* b = static_cast<PngWriteBuffer*>(png_get_io_ptr(png));
  b->bytes.insert(b->bytes.end(), data, data + n);
}
void png_flush_noop(png_structp) {}

struct PngSpec {
  int width = 0, height = 0, color_type = PNG_COLOR_TYPE_RGB, bit_depth = 8;
  std::vector<uint8_t> rows;        // height rows of PNG row bytes (big-endian 16-bit, packed <8)
  std::vector<png_color> palette;   // PLTE
  std::vector<uint8_t> trns_alpha;  // tRNS for palette images
  bool gray_trns = false;           // tRNS for gray images (value 0)
  std::vector<uint8_t> exif;        // eXIf payload (TIFF)
};

bool png_encode_impl(const PngSpec* spec, PngWriteBuffer* out, png_structp png, png_infop info,
                     png_bytep* row_ptrs) {
  if (setjmp(png_jmpbuf(png))) return false;
  png_set_write_fn(png, out, png_write_to_vector, png_flush_noop);
  png_set_IHDR(png, info, spec->width, spec->height, spec->bit_depth, spec->color_type,
               PNG_INTERLACE_NONE, PNG_COMPRESSION_TYPE_DEFAULT, PNG_FILTER_TYPE_DEFAULT);
  if (!spec->palette.empty())
    png_set_PLTE(png, info, const_cast<png_colorp>(spec->palette.data()),
                 static_cast<int>(spec->palette.size()));
  if (!spec->trns_alpha.empty())
    png_set_tRNS(png, info, const_cast<png_bytep>(spec->trns_alpha.data()),
                 static_cast<int>(spec->trns_alpha.size()), nullptr);
  png_color_16 gray_trns{};
  if (spec->gray_trns) png_set_tRNS(png, info, nullptr, 0, &gray_trns);
  if (!spec->exif.empty())
    png_set_eXIf_1(png, info, static_cast<png_uint_32>(spec->exif.size()),
                   const_cast<png_bytep>(spec->exif.data()));
  png_write_info(png, info);
  png_write_image(png, row_ptrs);
  png_write_end(png, info);
  return true;
}

std::vector<uint8_t> encode_png(const PngSpec& spec) {
  PngWriteBuffer out;
  png_structp png = png_create_write_struct(PNG_LIBPNG_VER_STRING, nullptr, nullptr, nullptr);
  png_infop info = png_create_info_struct(png);
  const size_t rowbytes = spec.rows.size() / spec.height;
  std::vector<png_bytep> rows(spec.height);
  for (int y = 0; y < spec.height; ++y)
    rows[y] = const_cast<png_bytep>(spec.rows.data() + y * rowbytes);
  const bool ok = png_encode_impl(&spec, &out, png, info, rows.data());
  png_destroy_write_struct(&png, &info);
  EXPECT_TRUE(ok) << "test PNG encoder failed";
  return out.bytes;
}

struct JpegWriteError {
  jpeg_error_mgr pub;
  std::jmp_buf jump;
};
void jpeg_write_error_exit(j_common_ptr cinfo) {
  std::longjmp(reinterpret_cast<JpegWriteError*>(cinfo->err)->jump, 1);
}

struct JpegSpec {
  int width = 0, height = 0, components = 3;
  J_COLOR_SPACE in_color_space = JCS_RGB;
  int quality = 95;
  std::vector<uint8_t> pixels;  // interleaved
  std::vector<uint8_t> app1;    // written as an APP1 marker when non-empty
};

bool jpeg_encode_impl(const JpegSpec* spec, jpeg_compress_struct* c, unsigned char** buf,
                      unsigned long* size) {
  if (setjmp(reinterpret_cast<JpegWriteError*>(c->err)->jump)) return false;
  jpeg_create_compress(c);
  jpeg_mem_dest(c, buf, size);
  c->image_width = spec->width;
  c->image_height = spec->height;
  c->input_components = spec->components;
  c->in_color_space = spec->in_color_space;
  jpeg_set_defaults(c);
  jpeg_set_quality(c, spec->quality, TRUE);
  jpeg_start_compress(c, TRUE);
  if (!spec->app1.empty())
    jpeg_write_marker(c, JPEG_APP0 + 1, spec->app1.data(),
                      static_cast<unsigned int>(spec->app1.size()));
  const size_t stride = size_t(spec->width) * spec->components;
  while (c->next_scanline < c->image_height) {
    JSAMPROW row = const_cast<JSAMPROW>(spec->pixels.data() + c->next_scanline * stride);
    jpeg_write_scanlines(c, &row, 1);
  }
  jpeg_finish_compress(c);
  return true;
}

std::vector<uint8_t> encode_jpeg(const JpegSpec& spec) {
  jpeg_compress_struct c{};
  JpegWriteError err{};
  c.err = jpeg_std_error(&err.pub);
  err.pub.error_exit = jpeg_write_error_exit;
  unsigned char* buf = nullptr;
  unsigned long size = 0;
  const bool ok = jpeg_encode_impl(&spec, &c, &buf, &size);
  jpeg_destroy_compress(&c);
  std::vector<uint8_t> out;
  if (ok && buf) out.assign(buf, buf + size);
  std::free(buf);
  EXPECT_TRUE(ok) << "test JPEG encoder failed";
  return out;
}

std::vector<uint8_t> read_file(const std::string& path) {
  std::ifstream in(path, std::ios::binary);
  EXPECT_TRUE(in.good()) << path;
  return std::vector<uint8_t>((std::istreambuf_iterator<char>(in)),
                              std::istreambuf_iterator<char>());
}

// A PNG chunk with a correct CRC, for hand-made headers.
void append_chunk(std::vector<uint8_t>* out, const char* tag, const std::vector<uint8_t>& data) {
  const uint32_t n = static_cast<uint32_t>(data.size());
  const uint8_t len[4] = {uint8_t(n >> 24), uint8_t(n >> 16), uint8_t(n >> 8), uint8_t(n)};
  out->insert(out->end(), len, len + 4);
  std::vector<uint8_t> body(tag, tag + 4);
  body.insert(body.end(), data.begin(), data.end());
  const uint32_t crc = static_cast<uint32_t>(crc32(0, body.data(), static_cast<uInt>(body.size())));
  out->insert(out->end(), body.begin(), body.end());
  const uint8_t c[4] = {uint8_t(crc >> 24), uint8_t(crc >> 16), uint8_t(crc >> 8), uint8_t(crc)};
  out->insert(out->end(), c, c + 4);
}

std::vector<uint8_t> png_header_only(uint32_t w, uint32_t h) {
  std::vector<uint8_t> out = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};
  std::vector<uint8_t> ihdr = {uint8_t(w >> 24),
                               uint8_t(w >> 16),
                               uint8_t(w >> 8),
                               uint8_t(w),
                               uint8_t(h >> 24),
                               uint8_t(h >> 16),
                               uint8_t(h >> 8),
                               uint8_t(h),
                               8,
                               2,
                               0,
                               0,
                               0};
  append_chunk(&out, "IHDR", ihdr);
  // libpng reads the header up to the first IDAT, so one must follow (its data is never reached).
  append_chunk(&out, "IDAT", {0x78, 0x9c});
  append_chunk(&out, "IEND", {});
  return out;
}

// Runs fn, expecting a gemstage::Error whose message contains every needle.
template <typename Fn>
void expect_error(Fn fn, std::initializer_list<const char*> needles) {
  try {
    fn();
    ADD_FAILURE() << "expected an error containing " << *needles.begin();
  } catch (const Error& e) {
    const std::string msg = e.what();
    for (const char* n : needles) EXPECT_NE(msg.find(n), std::string::npos) << msg;
  }
}

std::vector<uint8_t> npy_u8(const std::string& path, int* h, int* w) {
  const NpyArray a = load_npy(path);
  EXPECT_EQ(a.dtype, DType::U8) << path;
  EXPECT_EQ(a.shape.size(), 3u) << path;
  *h = static_cast<int>(a.shape[0]);
  *w = static_cast<int>(a.shape[1]);
  return a.bytes;
}

RgbImage decode(const std::vector<uint8_t>& bytes, const ImageLimits& limits = {}) {
  return decode_image(bytes.data(), bytes.size(), limits, "test image");
}

// ---------------------------------------------------------------------------------------------
// The HF fixture: exact pixel_values and position ids.

TEST(ImageProcessor, FixtureImageMatchesHfExactly) {
  const std::string dir = kFixtures + "/gemma4-tiny/multimodal/";
  const ImageProcessorConfig cfg = ImageProcessorConfig::from_json_file(
      kFixtures + "/gemma4-tiny/model/preprocessor_config.json");
  EXPECT_EQ(cfg.max_soft_tokens, 70);
  EXPECT_EQ(cfg.patch_size, 16);
  EXPECT_EQ(cfg.pooling_kernel_size, 3);

  const RgbImage img = decode_image_file(dir + "image.png");
  ASSERT_EQ(img.width, 384);
  ASSERT_EQ(img.height, 336);
  const ProcessedImage out = preprocess_image(img, cfg);
  EXPECT_EQ(out.num_patches, 504);
  EXPECT_EQ(out.max_patches, 630);
  EXPECT_EQ(out.num_soft_tokens, 56);
  EXPECT_EQ(out.patches_h, 21);
  EXPECT_EQ(out.patches_w, 24);
  EXPECT_EQ(out.resized_h, 336);
  EXPECT_EQ(out.resized_w, 384);

  const NpyArray pv = load_npy(dir + "pixel_values.npy");
  ASSERT_EQ(pv.numel(), int64_t{630} * 768);
  const std::vector<float> expect_pv = pv.to_f32();
  ASSERT_EQ(out.pixel_values.size(), expect_pv.size());
  size_t mismatches = 0;
  for (size_t i = 0; i < expect_pv.size(); ++i)
    mismatches += std::memcmp(&expect_pv[i], &out.pixel_values[i], sizeof(float)) != 0;
  EXPECT_EQ(mismatches, 0u) << "pixel_values must match bit for bit";

  const NpyArray pos = load_npy(dir + "image_position_ids.npy");
  EXPECT_EQ(pos.to_i64(), out.position_ids);
}

// ---------------------------------------------------------------------------------------------
// Resize targets (gemma4-spec.md 4.6 and transformers' get_aspect_ratio_preserving_size).

TEST(ImageProcessor, ResizeTargetTable) {
  struct Case {
    int budget;
    int64_t h, w;
    int th, tw, tokens;
  };
  const Case cases[] = {
      // The spec's table at the default budget of 280.
      {280, 224, 224, 768, 768, 256},
      {280, 512, 512, 768, 768, 256},
      {280, 1024, 1024, 768, 768, 256},
      {280, 480, 640, 672, 912, 266},
      {280, 600, 800, 672, 912, 266},
      {280, 768, 1024, 672, 912, 266},
      {280, 3000, 4000, 672, 912, 266},
      {280, 640, 480, 912, 672, 266},
      {280, 720, 1280, 576, 1056, 264},
      {280, 1080, 1920, 576, 1056, 264},
      {280, 1, 1, 768, 768, 256},
      // One side rounds to zero: 48 on that side, the other capped by the budget.
      {280, 5, 3000, 48, 13440, 280},
      {280, 3000, 5, 13440, 48, 280},
      {280, 20, 100000, 48, 13440, 280},
      {70, 1, 1000, 48, 3360, 70},
      {70, 1000, 1, 3360, 48, 70},
      {1120, 5, 3000, 48, 39312, 819},
      // Other budgets.
      {70, 224, 224, 384, 384, 64},
      {70, 480, 640, 336, 432, 63},
      {70, 336, 384, 336, 384, 56},
      {140, 224, 224, 528, 528, 121},
      {140, 480, 640, 480, 624, 130},
      {140, 720, 1280, 384, 720, 120},
      {560, 224, 224, 1104, 1104, 529},
      {560, 480, 640, 960, 1296, 540},
      {560, 720, 1280, 816, 1488, 527},
      {1120, 224, 224, 1584, 1584, 1089},
      {1120, 480, 640, 1344, 1824, 1064},
      {1120, 720, 1280, 1200, 2112, 1100},
      {1120, 1, 1000, 48, 50784, 1058},
  };
  for (const Case& c : cases) {
    const ResizeTarget t = aspect_ratio_preserving_size(c.h, c.w, 16, c.budget * 9, 3);
    EXPECT_EQ(t.height, c.th) << c.budget << " " << c.h << "x" << c.w;
    EXPECT_EQ(t.width, c.tw) << c.budget << " " << c.h << "x" << c.w;
    EXPECT_EQ((t.height / 48) * (t.width / 48), c.tokens) << c.budget << " " << c.h << "x" << c.w;
  }
  // Both sides zero can only happen with a tiny custom budget.
  expect_error([] { aspect_ratio_preserving_size(100, 100, 16, 4, 3); }, {"0x0", "48"});
  expect_error([] { aspect_ratio_preserving_size(0, 100, 16, 2520, 3); }, {"0x100"});
}

TEST(ImageProcessor, PreprocessResizesAndPads) {
  RgbImage img;
  img.width = 224;
  img.height = 224;
  img.rgb.assign(size_t(224) * 224 * 3, 0);
  for (size_t i = 0; i < img.rgb.size(); ++i) img.rgb[i] = static_cast<uint8_t>(i * 7 % 251);
  ImageProcessorConfig cfg;  // HF defaults: 280 soft tokens
  const ProcessedImage out = preprocess_image(img, cfg);
  EXPECT_EQ(out.resized_h, 768);
  EXPECT_EQ(out.resized_w, 768);
  EXPECT_EQ(out.patches_h, 48);
  EXPECT_EQ(out.patches_w, 48);
  EXPECT_EQ(out.num_patches, 2304);
  EXPECT_EQ(out.num_soft_tokens, 256);
  EXPECT_EQ(out.max_patches, 2520);
  ASSERT_EQ(out.pixel_values.size(), size_t(2520) * 768);
  ASSERT_EQ(out.position_ids.size(), size_t(2520) * 2);
  // Row-major patches, (x, y) positions; padding is (-1, -1) with zero pixels.
  EXPECT_EQ(out.position_ids[2 * 0], 0);
  EXPECT_EQ(out.position_ids[2 * 1], 1);
  EXPECT_EQ(out.position_ids[2 * 49], 1);
  EXPECT_EQ(out.position_ids[2 * 49 + 1], 1);
  EXPECT_EQ(out.position_ids[2 * 2303], 47);
  EXPECT_EQ(out.position_ids[2 * 2303 + 1], 47);
  for (size_t n = 2304; n < 2520; ++n) {
    EXPECT_EQ(out.position_ids[2 * n], -1);
    EXPECT_EQ(out.position_ids[2 * n + 1], -1);
  }
  EXPECT_TRUE(std::all_of(out.pixel_values.begin() + 2304 * 768, out.pixel_values.end(),
                          [](float v) { return v == 0.0f; }));
  // Patch layout against the resized image: patch (x=2, y=1), pixel (dy=3, dx=5), channel 2.
  const RgbImage resized = resize_bicubic_aa(img, 768, 768, ResizeBackend::kTorchvision);
  const size_t n = 1 * 48 + 2;
  const uint8_t v = resized.rgb[(size_t(1 * 16 + 3) * 768 + (2 * 16 + 5)) * 3 + 2];
  EXPECT_EQ(out.pixel_values[n * 768 + (3 * 16 + 5) * 3 + 2],
            static_cast<float>(v) * static_cast<float>(1.0 / 255.0));
}

TEST(ImageProcessor, RescaleAndNormalizeArithmetic) {
  RgbImage img;
  img.width = 48;
  img.height = 48;
  img.rgb.resize(48 * 48 * 3);
  for (size_t i = 0; i < img.rgb.size(); ++i) img.rgb[i] = static_cast<uint8_t>(i % 256);
  ImageProcessorConfig cfg;
  cfg.max_soft_tokens = 70;
  cfg.do_resize = false;
  cfg.do_normalize = true;
  cfg.image_mean = {0.5, 0.25, 0.125};
  cfg.image_std = {0.5, 0.75, 2.0};
  const ProcessedImage tv = preprocess_image(img, cfg);
  cfg.backend = ResizeBackend::kPil;
  const ProcessedImage pil = preprocess_image(img, cfg);
  const float inv = static_cast<float>(1.0 / cfg.rescale_factor);
  for (size_t i = 0; i < 16 * 16 * 3; ++i) {
    const int c = static_cast<int>(i % 3);
    const uint8_t u = img.rgb[((i / 48) * 48 + (i % 48) / 3) * 3 + c];
    // torchvision fuses: (x - mean/r) / (std/r) in float32.
    const float m = static_cast<float>(cfg.image_mean[c]) * inv;
    const float s = static_cast<float>(cfg.image_std[c]) * inv;
    EXPECT_EQ(tv.pixel_values[i], (static_cast<float>(u) - m) / s) << i;
    // PIL backend: float32(double(x) * r), then (x - mean) / std in float32.
    const float r = static_cast<float>(double(u) * cfg.rescale_factor);
    EXPECT_EQ(pil.pixel_values[i],
              (r - static_cast<float>(cfg.image_mean[c])) / static_cast<float>(cfg.image_std[c]))
        << i;
  }
}

TEST(ImageProcessor, ConfigFromJson) {
  const ImageProcessorConfig def = ImageProcessorConfig::from_json(nlohmann::json::object(), "x");
  EXPECT_EQ(def.max_soft_tokens, 280);
  EXPECT_EQ(def.max_patches(), 2520);
  EXPECT_TRUE(def.do_rescale);
  EXPECT_FALSE(def.do_normalize);

  const auto nested = nlohmann::json::parse(
      R"({"image_processor": {"max_soft_tokens": 1120, "image_mean": 0.5, "do_normalize": true}})");
  const ImageProcessorConfig n = ImageProcessorConfig::from_json(nested, "processor_config.json");
  EXPECT_EQ(n.max_soft_tokens, 1120);
  EXPECT_EQ(n.image_mean[2], 0.5);

  auto bad = [](const char* text, std::initializer_list<const char*> needles) {
    expect_error([&] { ImageProcessorConfig::from_json(nlohmann::json::parse(text), "cfg.json"); },
                 needles);
  };
  bad(R"({"patch_size": "16"})", {"cfg.json", "patch_size", "integer", "string"});
  bad(R"({"patch_size": 16.5})", {"patch_size", "integer"});
  bad(R"({"do_rescale": 1})", {"do_rescale", "true or false"});
  bad(R"({"rescale_factor": "1/255"})", {"rescale_factor", "number"});
  bad(R"({"image_std": [1, 1]})", {"image_std", "3 numbers"});
  bad(R"({"image_mean": [0, "a", 0]})", {"image_mean", "[1]"});
  bad(R"({"max_soft_tokens": 100})", {"max_soft_tokens", "100", "70, 140, 280, 560 or 1120"});
  bad(R"({"resample": 2})", {"resample", "BICUBIC"});
  bad(R"({"max_soft_tokens": null})", {"max_soft_tokens", "null"});
  bad(R"([1, 2])", {"JSON object"});
}

// ---------------------------------------------------------------------------------------------
// Decoding: PIL goldens (what HF's load_image returns for each file).

TEST(ImageDecode, MatchesPilGoldens) {
  const char* cases[] = {
      "gray8.png",
      "gray16.png",
      "bilevel.png",
      "gray_alpha.png",
      "rgba.png",
      "palette.png",
      "palette_trns.png",
      "rgb_interlaced.png",
      "rgb_exif6.png",
      "rgb420.jpg",
      "rgb444_progressive.jpg",
      "gray.jpg",
      "cmyk.jpg",
      "rgb_exif2.jpg",
      "rgb_exif3.jpg",
      "rgb_exif4.jpg",
      "rgb_exif5.jpg",
      "rgb_exif6.jpg",
      "rgb_exif7.jpg",
      "rgb_exif8.jpg",
  };
  for (const char* name : cases) {
    const std::string path = kImageFixtures + "/decode/" + name;
    int h = 0, w = 0;
    const std::vector<uint8_t> expect = npy_u8(path + ".rgb.npy", &h, &w);
    const RgbImage img = decode_image_file(path);
    ASSERT_EQ(img.width, w) << name;
    ASSERT_EQ(img.height, h) << name;
    size_t diff = 0;
    for (size_t i = 0; i < expect.size(); ++i) diff += expect[i] != img.rgb[i];
    EXPECT_EQ(diff, 0u) << name << ": bytes differing from PIL";
  }
}

TEST(ImageDecode, ExifOrientationCanBeDisabled) {
  ImageLimits limits;
  limits.apply_exif_orientation = false;
  const RgbImage raw = decode_image_file(kImageFixtures + "/decode/rgb_exif6.jpg", limits);
  EXPECT_EQ(raw.width, 23);
  EXPECT_EQ(raw.height, 17);
  const RgbImage plain = decode_image_file(kImageFixtures + "/decode/rgb420.jpg");
  EXPECT_EQ(raw.rgb, plain.rgb);  // same pixels, only the EXIF differs
  const RgbImage turned = decode_image_file(kImageFixtures + "/decode/rgb_exif6.jpg");
  EXPECT_EQ(turned.rgb, apply_exif_orientation(plain, 6).rgb);
}

TEST(ImageDecode, ExifParser) {
  // Big-endian TIFF, IFD0 with one SHORT Orientation = 6.
  const std::vector<uint8_t> mm = {'M', 'M', 0, 42, 0, 0, 0, 8, 0, 1, 0x01, 0x12, 0,
                                   3,   0,   0, 0,  1, 0, 6, 0, 0, 0, 0,    0,    0};
  EXPECT_EQ(exif_orientation(mm.data(), mm.size()), 6);
  // Little-endian, another tag first, then Orientation = 8.
  const std::vector<uint8_t> ii = {'I', 'I', 42, 0, 8, 0,   0,   0,   2, 0,    0x0f, 0x01, 2,
                                   0,   4,   0,  0, 0, 'a', 'b', 'c', 0, 0x12, 0x01, 3,    0,
                                   1,   0,   0,  0, 8, 0,   0,   0,   0, 0,    0,    0};
  EXPECT_EQ(exif_orientation(ii.data(), ii.size()), 8);
  // Truncated, wrong magic, out-of-range value: orientation 1 (leave the image alone).
  EXPECT_EQ(exif_orientation(mm.data(), 12), 1);
  std::vector<uint8_t> bad = mm;
  bad[3] = 43;
  EXPECT_EQ(exif_orientation(bad.data(), bad.size()), 1);
  bad = mm;
  bad[19] = 9;
  EXPECT_EQ(exif_orientation(bad.data(), bad.size()), 1);
  EXPECT_EQ(exif_orientation(nullptr, 0), 1);
}

// ---------------------------------------------------------------------------------------------
// Decoding: files written here with libpng / libjpeg.

std::vector<uint8_t> pattern_bytes(size_t n, uint32_t seed) {
  std::vector<uint8_t> v(n);
  uint32_t s = seed;
  for (auto& b : v) {
    s = s * 1664525u + 1013904223u;
    b = static_cast<uint8_t>(s >> 24);
  }
  return v;
}

TEST(ImageDecode, GeneratedPngModes) {
  const int w = 7, h = 5;
  {  // 8-bit gray with tRNS: replicated, transparency ignored.
    PngSpec s{w, h, PNG_COLOR_TYPE_GRAY, 8, pattern_bytes(w * h, 1)};
    s.gray_trns = true;
    const RgbImage img = decode(encode_png(s));
    for (int i = 0; i < w * h; ++i)
      for (int c = 0; c < 3; ++c) EXPECT_EQ(img.rgb[i * 3 + c], s.rows[i]);
  }
  {  // 2-bit and 4-bit gray scale to 0..255 by bit replication.
    for (int depth : {2, 4}) {
      const int per_byte = 8 / depth;
      const int rowbytes = (w + per_byte - 1) / per_byte;
      PngSpec s{w, h, PNG_COLOR_TYPE_GRAY, depth, pattern_bytes(size_t(rowbytes) * h, depth)};
      const RgbImage img = decode(encode_png(s));
      const int maxv = (1 << depth) - 1;
      for (int y = 0; y < h; ++y)
        for (int x = 0; x < w; ++x) {
          const uint8_t byte = s.rows[y * rowbytes + x / per_byte];
          const int shift = 8 - depth * (x % per_byte + 1);
          const int v = (byte >> shift) & maxv;
          EXPECT_EQ(img.rgb[(y * w + x) * 3], v * 255 / maxv) << depth;
        }
    }
  }
  {  // 16-bit gray clips at 255 (PIL mode "I" -> "RGB").
    std::vector<uint8_t> rows(size_t(w) * h * 2);
    const uint16_t vals[] = {0, 1, 200, 255, 256, 1000, 65535};
    for (int i = 0; i < w * h; ++i) {
      const uint16_t v = vals[i % 7];
      rows[2 * i] = uint8_t(v >> 8);
      rows[2 * i + 1] = uint8_t(v & 0xff);
    }
    const RgbImage img = decode(encode_png({w, h, PNG_COLOR_TYPE_GRAY, 16, rows}));
    for (int i = 0; i < w * h; ++i) EXPECT_EQ(img.rgb[i * 3 + 1], std::min<int>(vals[i % 7], 255));
  }
  {  // 16-bit RGB and RGBA keep the high byte; alpha is dropped, never composited.
    for (int ct : {PNG_COLOR_TYPE_RGB, PNG_COLOR_TYPE_RGB_ALPHA, PNG_COLOR_TYPE_GRAY_ALPHA}) {
      const int ch = ct == PNG_COLOR_TYPE_RGB ? 3 : ct == PNG_COLOR_TYPE_RGB_ALPHA ? 4 : 2;
      PngSpec s{w, h, ct, 16, pattern_bytes(size_t(w) * h * ch * 2, 10 + ct)};
      const RgbImage img = decode(encode_png(s));
      for (int i = 0; i < w * h; ++i)
        for (int c = 0; c < 3; ++c) {
          const int sc = ch >= 3 ? c : 0;
          EXPECT_EQ(img.rgb[i * 3 + c], s.rows[(i * ch + sc) * 2]) << ct;
        }
    }
  }
  {  // 8-bit RGBA with fully transparent pixels: colour kept as stored (no white background).
    PngSpec s{w, h, PNG_COLOR_TYPE_RGB_ALPHA, 8, pattern_bytes(size_t(w) * h * 4, 3)};
    for (int i = 0; i < w * h; ++i) s.rows[i * 4 + 3] = 0;
    const RgbImage img = decode(encode_png(s));
    for (int i = 0; i < w * h; ++i)
      for (int c = 0; c < 3; ++c) EXPECT_EQ(img.rgb[i * 3 + c], s.rows[i * 4 + c]);
  }
  {  // 4-bit palette with tRNS: looked up, transparency ignored.
    PngSpec s{w, h, PNG_COLOR_TYPE_PALETTE, 4, {}};
    for (int i = 0; i < 16; ++i)
      s.palette.push_back({uint8_t(i * 16), uint8_t(255 - i * 9), uint8_t(i * i)});
    s.trns_alpha = {0, 10, 200};
    const int rowbytes = (w + 1) / 2;
    s.rows = pattern_bytes(size_t(rowbytes) * h, 4);
    const RgbImage img = decode(encode_png(s));
    for (int y = 0; y < h; ++y)
      for (int x = 0; x < w; ++x) {
        const int idx = (s.rows[y * rowbytes + x / 2] >> (x % 2 ? 0 : 4)) & 15;
        EXPECT_EQ(img.rgb[(y * w + x) * 3], s.palette[idx].red);
        EXPECT_EQ(img.rgb[(y * w + x) * 3 + 1], s.palette[idx].green);
        EXPECT_EQ(img.rgb[(y * w + x) * 3 + 2], s.palette[idx].blue);
      }
  }
  {  // eXIf orientation 3 (rotate 180) in a PNG.
    PngSpec s{w, h, PNG_COLOR_TYPE_RGB, 8, pattern_bytes(size_t(w) * h * 3, 5)};
    s.exif = {'M', 'M', 0, 42, 0, 0, 0, 8, 0, 1, 0x01, 0x12, 0,
              3,   0,   0, 0,  1, 0, 3, 0, 0, 0, 0,    0,    0};
    const RgbImage img = decode(encode_png(s));
    for (int i = 0; i < w * h; ++i)
      for (int c = 0; c < 3; ++c) EXPECT_EQ(img.rgb[i * 3 + c], s.rows[(w * h - 1 - i) * 3 + c]);
  }
}

TEST(ImageDecode, GeneratedJpegModes) {
  const int w = 16, h = 16;
  {  // CMYK (libjpeg writes an Adobe marker): PIL's inverted-CMYK reading and cmyk2rgb.
    JpegSpec s{w, h, 4, JCS_CMYK, 100, {}};
    const uint8_t cmyk[4] = {30, 120, 200, 60};  // flat colour survives the DCT almost exactly
    for (int i = 0; i < w * h; ++i) s.pixels.insert(s.pixels.end(), cmyk, cmyk + 4);
    const RgbImage img = decode(encode_jpeg(s));
    // Stored values are taken as Adobe-inverted: C = 255 - stored, so nk = stored K.
    const int nk = cmyk[3];
    for (int c = 0; c < 3; ++c) {
      const int cc = 255 - cmyk[c];
      const int t = cc * nk + 128;
      const int expect = nk - (((t >> 8) + t) >> 8);
      EXPECT_NEAR(img.rgb[(5 * w + 5) * 3 + c], expect, 2) << c;
    }
  }
  {  // Grayscale: replicated into three equal channels.
    JpegSpec s{w, h, 1, JCS_GRAYSCALE, 95, pattern_bytes(size_t(w) * h, 8)};
    const RgbImage img = decode(encode_jpeg(s));
    for (int i = 0; i < w * h; ++i) {
      EXPECT_EQ(img.rgb[i * 3], img.rgb[i * 3 + 1]);
      EXPECT_EQ(img.rgb[i * 3], img.rgb[i * 3 + 2]);
    }
  }
  {  // APP1 Exif orientation 8 turns a 16x16... use a non-square image to see the swap.
    JpegSpec s{24, 8, 3, JCS_RGB, 90, pattern_bytes(size_t(24) * 8 * 3, 9)};
    const std::vector<uint8_t> plain_bytes = encode_jpeg(s);
    s.app1 = {'E',  'x',  'i', 'f', 0, 0, 'I', 'I', 42, 0, 8, 0, 0, 0, 1, 0,
              0x12, 0x01, 3,   0,   1, 0, 0,   0,   8,  0, 0, 0, 0, 0, 0, 0};
    const RgbImage turned = decode(encode_jpeg(s));
    const RgbImage plain = decode(plain_bytes);
    EXPECT_EQ(turned.width, 8);
    EXPECT_EQ(turned.height, 24);
    EXPECT_EQ(turned.rgb, apply_exif_orientation(plain, 8).rgb);
  }
}

TEST(ImageDecode, OrientationTransforms) {
  // 3x2 image with distinct pixels; check the PIL transpose for each orientation on corners.
  RgbImage img;
  img.width = 3;
  img.height = 2;
  for (int i = 0; i < 6; ++i) img.rgb.insert(img.rgb.end(), {uint8_t(i), 0, 0});
  auto at = [](const RgbImage& m, int x, int y) { return m.rgb[(y * m.width + x) * 3]; };
  // Input layout: row0 = 0 1 2, row1 = 3 4 5.
  const RgbImage o2 = apply_exif_orientation(img, 2);  // mirror: 2 1 0 / 5 4 3
  EXPECT_EQ(at(o2, 0, 0), 2);
  const RgbImage o3 = apply_exif_orientation(img, 3);  // 5 4 3 / 2 1 0
  EXPECT_EQ(at(o3, 0, 0), 5);
  const RgbImage o4 = apply_exif_orientation(img, 4);  // 3 4 5 / 0 1 2
  EXPECT_EQ(at(o4, 0, 0), 3);
  const RgbImage o5 = apply_exif_orientation(img, 5);  // transpose: 0 3 / 1 4 / 2 5
  EXPECT_EQ(o5.width, 2);
  EXPECT_EQ(at(o5, 1, 0), 3);
  EXPECT_EQ(at(o5, 0, 2), 2);
  const RgbImage o6 = apply_exif_orientation(img, 6);  // clockwise: 3 0 / 4 1 / 5 2
  EXPECT_EQ(at(o6, 0, 0), 3);
  EXPECT_EQ(at(o6, 1, 2), 2);
  const RgbImage o7 = apply_exif_orientation(img, 7);  // transverse: 5 2 / 4 1 / 3 0
  EXPECT_EQ(at(o7, 0, 0), 5);
  const RgbImage o8 = apply_exif_orientation(img, 8);  // counter-clockwise: 2 5 / 1 4 / 0 3
  EXPECT_EQ(at(o8, 0, 0), 2);
  EXPECT_EQ(at(o8, 1, 2), 3);
}

// ---------------------------------------------------------------------------------------------
// Decoding errors: each names the problem, none crashes (this suite also runs under ASan).

TEST(ImageDecode, Errors) {
  const std::vector<uint8_t> png = read_file(kImageFixtures + "/decode/rgb_interlaced.png");
  const std::vector<uint8_t> jpg = read_file(kImageFixtures + "/decode/rgb420.jpg");
  const std::vector<uint8_t> prog = read_file(kImageFixtures + "/decode/rgb444_progressive.jpg");

  expect_error([] { decode_image(nullptr, 0, {}, "empty.png"); }, {"empty.png", "empty"});
  const std::vector<uint8_t> gif = {'G', 'I', 'F', '8', '9', 'a', 1, 0, 1, 0, 0, 0, 0};
  expect_error([&] { decode(gif); }, {"unrecognised image format", "PNG and JPEG"});

  // Truncations at several points, and corrupted image data.
  for (size_t keep : {size_t{8}, size_t{20}, size_t{40}, png.size() / 2, png.size() - 20}) {
    const std::vector<uint8_t> cut(png.begin(), png.begin() + keep);
    expect_error([&] { decode(cut); }, {"test image", "PNG"});
  }
  {
    std::vector<uint8_t> bad = png;
    for (size_t i = 60; i < 90 && i < bad.size(); ++i) bad[i] ^= 0x5a;  // inside IDAT
    expect_error([&] { decode(bad); }, {"PNG"});
  }
  for (const auto* src : {&jpg, &prog}) {
    for (size_t keep : {size_t{3}, size_t{50}, src->size() / 2, src->size() - 10}) {
      const std::vector<uint8_t> cut(src->begin(), src->begin() + keep);
      expect_error([&] { decode(cut); }, {"JPEG"});
    }
  }
  {
    std::vector<uint8_t> bad = jpg;
    for (size_t i = 4; i < 40; ++i) bad[i] = 0x00;  // wreck the marker segments
    expect_error([&] { decode(bad); }, {"JPEG", "corrupt"});
  }

  // Header-declared sizes: zero, and a decompression bomb, both refused before allocating.
  expect_error([] { decode(png_header_only(0, 10)); }, {"PNG", "zero"});
  expect_error([] { decode(png_header_only(100000, 100000)); },
               {"100000x100000", "limit", "decompression-bomb"});
  ImageLimits small;
  small.max_pixels = 100;
  expect_error([&] { decode(jpg, small); }, {"23x17", "limit of 100"});
  expect_error([&] { decode(png, small); }, {"23x17", "limit of 100"});
  expect_error([] { decode_image_file("/nonexistent/x.png"); }, {"/nonexistent/x.png"});
}

// Every prefix of a file, and seeded random byte damage: each decode either succeeds or throws
// gemstage::Error; never a crash, a libjpeg exit() or (under ASan) a bad memory access.
TEST(ImageDecode, SurvivesTruncationAndRandomDamage) {
  ImageLimits limits;
  limits.max_pixels = int64_t{1} << 20;  // damaged headers may claim large sizes
  const char* files[] = {"rgb_interlaced.png",     "palette_trns.png", "gray16.png",   "rgb420.jpg",
                         "rgb444_progressive.jpg", "cmyk.jpg",         "rgb_exif6.jpg"};
  size_t decoded = 0, rejected = 0;
  uint32_t seed = 12345;
  auto next = [&seed] {
    seed = seed * 1664525u + 1013904223u;
    return seed >> 8;
  };
  for (const char* name : files) {
    const std::vector<uint8_t> bytes = read_file(kImageFixtures + "/decode/" + name);
    auto attempt = [&](const std::vector<uint8_t>& b) {
      try {
        const RgbImage img = decode_image(b.data(), b.size(), limits, name);
        EXPECT_EQ(img.rgb.size(), size_t(img.width) * img.height * 3);
        ++decoded;
      } catch (const Error&) {
        ++rejected;
      }
    };
    for (size_t n = 0; n < bytes.size(); n += 7)
      attempt(std::vector<uint8_t>(bytes.begin(), bytes.begin() + n));
    for (int trial = 0; trial < 150; ++trial) {
      std::vector<uint8_t> b = bytes;
      const int flips = 1 + int(next() % 8);
      for (int f = 0; f < flips; ++f) b[next() % b.size()] ^= uint8_t(1 + next() % 255);
      attempt(b);
    }
  }
  EXPECT_GT(rejected, 0u);
  EXPECT_GT(decoded, 0u);
}

// ---------------------------------------------------------------------------------------------
// Resampler: a from-the-formula scalar reference, and PIL's output.

// Straight from the formulas in image_resize.h, one output pixel at a time, with the cubic in
// torch's form ((A*x - 5A)*x + 8A)*x - 4A rather than Pillow's, so the test also pins the claim
// that the two forms give the same double.
double torch_form_cubic(double x) {
  const double A = -0.5;
  x = std::fabs(x);
  if (x < 1.0) return ((A + 2) * x - (A + 3)) * x * x + 1;
  if (x < 2.0) return ((A * x - 5 * A) * x + 8 * A) * x - 4 * A;
  return 0.0;
}

struct RefAxis {
  std::vector<int> first, taps;
  std::vector<std::vector<int>> w;
  int precision = 0;
};

RefAxis ref_axis(int in, int out, ResizeBackend backend) {
  RefAxis r;
  const double scale = double(in) / out;
  const double support = scale >= 1.0 ? 2.0 * scale : 2.0;
  const int kmax = int(std::ceil(support)) * 2 + 1;
  std::vector<std::vector<double>> wd(out);
  double wmax = 0;
  for (int i = 0; i < out; ++i) {
    const double center = scale * (i + 0.5);
    const int lo = std::max(int(center - support + 0.5), 0);
    const int hi = std::min(int(center + support + 0.5), in);
    const int n = std::min(hi - lo, kmax);
    double total = 0;
    for (int j = 0; j < n; ++j) {
      wd[i].push_back(torch_form_cubic((j + lo - center + 0.5) * (1.0 / std::max(scale, 1.0))));
      total += wd[i].back();
    }
    for (double& v : wd[i]) {
      v /= total;
      wmax = std::max(wmax, v);
    }
    r.first.push_back(lo);
    r.taps.push_back(n);
  }
  if (backend == ResizeBackend::kPil) {
    r.precision = 22;
  } else {
    r.precision = 22;
    for (int p = 0; p < 22; ++p)
      if (int(0.5 + wmax * (1 << (p + 1))) >= 32768) {
        r.precision = p;
        break;
      }
  }
  for (auto& row : wd) {
    std::vector<int> q;
    for (double v : row) {
      const double s = v * (1 << r.precision);
      q.push_back(s < 0 ? int(-0.5 + s) : int(0.5 + s));
    }
    r.w.push_back(q);
  }
  return r;
}

RgbImage ref_resize(const RgbImage& src, int ow, int oh, ResizeBackend backend) {
  auto clamp8 = [](long long acc, int p) {
    return uint8_t(std::clamp<long long>(acc >> p, 0, 255));
  };
  RgbImage mid = src;
  if (ow != src.width) {
    const RefAxis ax = ref_axis(src.width, ow, backend);
    mid.width = ow;
    mid.rgb.assign(size_t(ow) * src.height * 3, 0);
    for (int y = 0; y < src.height; ++y)
      for (int x = 0; x < ow; ++x)
        for (int c = 0; c < 3; ++c) {
          long long acc = 1LL << (ax.precision - 1);
          for (int j = 0; j < ax.taps[x]; ++j)
            acc +=
                (long long)src.rgb[(size_t(y) * src.width + ax.first[x] + j) * 3 + c] * ax.w[x][j];
          mid.rgb[(size_t(y) * ow + x) * 3 + c] = clamp8(acc, ax.precision);
        }
  }
  RgbImage out = mid;
  if (oh != src.height) {
    const RefAxis ax = ref_axis(src.height, oh, backend);
    out.height = oh;
    out.rgb.assign(size_t(mid.width) * oh * 3, 0);
    for (int y = 0; y < oh; ++y)
      for (int x = 0; x < mid.width; ++x)
        for (int c = 0; c < 3; ++c) {
          long long acc = 1LL << (ax.precision - 1);
          for (int j = 0; j < ax.taps[y]; ++j)
            acc +=
                (long long)mid.rgb[(size_t(ax.first[y] + j) * mid.width + x) * 3 + c] * ax.w[y][j];
          out.rgb[(size_t(y) * mid.width + x) * 3 + c] = clamp8(acc, ax.precision);
        }
  }
  return out;
}

TEST(ImageResize, MatchesScalarReferenceOnOddSizes) {
  RgbImage src;
  src.width = 37;
  src.height = 29;
  src.rgb = pattern_bytes(size_t(37) * 29 * 3, 77);
  const int sizes[][2] = {{53, 41}, {11, 7}, {37, 9}, {5, 29}, {101, 3}, {1, 1}, {19, 61}};
  for (ResizeBackend b : {ResizeBackend::kTorchvision, ResizeBackend::kPil}) {
    for (const auto& s : sizes) {
      const RgbImage got = resize_bicubic_aa(src, s[0], s[1], b);
      const RgbImage want = ref_resize(src, s[0], s[1], b);
      ASSERT_EQ(got.width, s[0]);
      ASSERT_EQ(got.height, s[1]);
      EXPECT_EQ(got.rgb, want.rgb) << s[0] << "x" << s[1] << " backend " << int(b);
    }
  }
}

TEST(ImageResize, AxisWeightsAndPrecision) {
  // Upscale 2x: support 2, five taps max, torch precision from the largest weight.
  const ResampleAxis up = bicubic_aa_axis(10, 20, ResizeBackend::kTorchvision);
  EXPECT_EQ(up.max_taps, 5);
  for (int i = 0; i < 20; ++i) {
    long sum = 0;
    for (int j = 0; j < up.taps[i]; ++j) sum += up.weights[size_t(i) * up.max_taps + j];
    EXPECT_NEAR(double(sum), double(1 << up.precision), 3.0) << i;
  }
  EXPECT_GE(up.precision, 14);
  EXPECT_LE(up.precision, 15);
  const ResampleAxis pil = bicubic_aa_axis(10, 20, ResizeBackend::kPil);
  EXPECT_EQ(pil.precision, 22);
  // Downscale 4x: support grows with the factor.
  const ResampleAxis down = bicubic_aa_axis(40, 10, ResizeBackend::kTorchvision);
  EXPECT_EQ(down.max_taps, 8 * 2 + 1);
  EXPECT_EQ(resize_bicubic_aa({2, 1, {1, 2, 3, 4, 5, 6}}, 2, 1, ResizeBackend::kPil).rgb,
            (std::vector<uint8_t>{1, 2, 3, 4, 5, 6}));
}

TEST(ImageResize, MatchesPilGolden) {
  const RgbImage src = decode_image_file(kImageFixtures + "/resize/src.png");
  ASSERT_EQ(src.width, 45);
  ASSERT_EQ(src.height, 31);
  const int targets[][2] = {{101, 67}, {17, 11}, {45, 13}, {77, 31}, {29, 50}, {7, 5}, {130, 3}};
  size_t total = 0, tv_vs_pil_diff = 0, tv_vs_float_diff = 0, pil_vs_float_diff = 0;
  int tv_vs_pil_max = 0, tv_vs_float_max = 0, pil_vs_float_max = 0;
  for (const auto& t : targets) {
    const std::string tag = std::to_string(t[0]) + "x" + std::to_string(t[1]);
    int h = 0, w = 0;
    const std::vector<uint8_t> pil = npy_u8(kImageFixtures + "/resize/pil_" + tag + ".npy", &h, &w);
    const std::vector<uint8_t> tvf =
        npy_u8(kImageFixtures + "/resize/tv_float_" + tag + ".npy", &h, &w);
    ASSERT_EQ(w, t[0]);
    ASSERT_EQ(h, t[1]);
    // The PIL backend is bit-exact with Pillow.
    const RgbImage ours_pil = resize_bicubic_aa(src, t[0], t[1], ResizeBackend::kPil);
    EXPECT_EQ(ours_pil.rgb, pil) << tag;
    // The torch uint8 arithmetic differs from Pillow's only by weight quantisation: a 1 in the
    // 8-bit intermediate can grow to 2 through the second pass.
    const RgbImage ours_tv = resize_bicubic_aa(src, t[0], t[1], ResizeBackend::kTorchvision);
    for (size_t i = 0; i < pil.size(); ++i) {
      const int d = std::abs(int(ours_tv.rgb[i]) - int(pil[i]));
      EXPECT_LE(d, 2) << tag << " byte " << i;
      tv_vs_pil_max = std::max(tv_vs_pil_max, d);
      tv_vs_pil_diff += d != 0;
      const int f = std::abs(int(ours_tv.rgb[i]) - int(tvf[i]));
      tv_vs_float_max = std::max(tv_vs_float_max, f);
      tv_vs_float_diff += f != 0;
      const int g = std::abs(int(pil[i]) - int(tvf[i]));
      pil_vs_float_max = std::max(pil_vs_float_max, g);
      pil_vs_float_diff += g != 0;
    }
    total += pil.size();
  }
  // The residuals quoted in image_resize.h.
  std::cout << "[resize residual] torch-uint8 vs PIL: max " << tv_vs_pil_max << ", "
            << 100.0 * tv_vs_pil_diff / total << "% of bytes differ; torch-uint8 vs "
            << "torchvision float32 path: max " << tv_vs_float_max << ", "
            << 100.0 * tv_vs_float_diff / total << "%; PIL vs float32 path: max "
            << pil_vs_float_max << ", " << 100.0 * pil_vs_float_diff / total << "% (" << total
            << " bytes)\n";
}

}  // namespace
}  // namespace gemstage
