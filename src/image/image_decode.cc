#include "image/image_decode.h"

// clang-format off
#include <csetjmp>
#include <cstdio>
#include <jpeglib.h>
#include <jerror.h>
#include <png.h>
// clang-format on

#include <algorithm>
#include <cstring>
#include <memory>

#include "core/error.h"
#include "io/mapped_file.h"

namespace gemstage {

namespace {

// Both libraries report errors by longjmp (we never let libjpeg call exit()). Every function below
// that calls setjmp keeps only trivially destructible locals and touches state through a context
// struct owned by the caller, so a longjmp never skips a destructor. The caller turns a failed
// stage into a gemstage::Error after the C library is out of the picture.

constexpr uint8_t kPngMagic[8] = {0x89, 'P', 'N', 'G', '\r', '\n', 0x1a, '\n'};

void check_dimensions(int64_t w, int64_t h, const ImageLimits& limits, const std::string& what,
                      const char* format) {
  if (w <= 0 || h <= 0)
    fail(what, ": ", format, " header declares a ", w, "x", h,
         " image; an image needs a non-zero width and height (the file is corrupt)");
  if (w * h > limits.max_pixels)
    fail(what, ": ", format, " image is ", w, "x", h, " = ", w * h, " pixels, over the limit of ",
         limits.max_pixels,
         " pixels (decompression-bomb guard); downscale the image first or raise the limit");
}

// PIL's MULDIV255: a*b/255 rounded, in integers (Convert.c).
inline int muldiv255(int a, int b) {
  const int t = a * b + 128;
  return ((t >> 8) + t) >> 8;
}

// ---------------------------------------------------------------------------------------------
// PNG

struct PngContext {
  const uint8_t* data = nullptr;
  size_t size = 0;
  size_t pos = 0;
  png_structp png = nullptr;
  png_infop info = nullptr;
  char message[640] = {};
  char warning[256] = {};  // the last warning: libpng explains "Invalid IHDR data" in one
  // Header.
  png_uint_32 width = 0, height = 0;
  int bit_depth = 0, color_type = 0, interlace = 0;
  // Pixel stage inputs (buffers owned by the caller).
  uint8_t* out = nullptr;             // width*height*3
  uint8_t* raw = nullptr;             // one row, or the whole image when interlaced
  png_bytep* row_pointers = nullptr;  // interlaced only
  size_t rowbytes = 0;
  png_colorp palette = nullptr;
  int num_palette = 0;

  ~PngContext() {
    if (png) png_destroy_read_struct(&png, info ? &info : nullptr, nullptr);
  }
};

void png_read_callback(png_structp png, png_bytep out, size_t n) {
  auto* ctx = static_cast<PngContext*>(png_get_io_ptr(png));
  if (n > ctx->size - ctx->pos) png_error(png, "file is truncated (unexpected end of data)");
  std::memcpy(out, ctx->data + ctx->pos, n);
  ctx->pos += n;
}

void png_error_callback(png_structp png, png_const_charp msg) {
  auto* ctx = static_cast<PngContext*>(png_get_error_ptr(png));
  if (ctx->warning[0])
    std::snprintf(ctx->message, sizeof(ctx->message), "%s (%s)", msg, ctx->warning);
  else
    std::snprintf(ctx->message, sizeof(ctx->message), "%s", msg);
  png_longjmp(png, 1);
}

// libpng warnings (bad ancillary chunk CRCs, unknown chunks) do not stop PIL either; the last one
// is kept because it often names the cause of the error that follows.
void png_warning_callback(png_structp png, png_const_charp msg) {
  auto* ctx = static_cast<PngContext*>(png_get_error_ptr(png));
  std::snprintf(ctx->warning, sizeof(ctx->warning), "%s", msg);
}

bool png_stage_header(PngContext* ctx) {
  if (setjmp(png_jmpbuf(ctx->png))) return false;
  png_set_read_fn(ctx->png, ctx, png_read_callback);
  // Our own pixel-count check gives the clearer message; libpng's default 1e6-per-side limit
  // would otherwise fire first.
  png_set_user_limits(ctx->png, 0x7fffffff, 0x7fffffff);
  png_read_info(ctx->png, ctx->info);
  png_get_IHDR(ctx->png, ctx->info, &ctx->width, &ctx->height, &ctx->bit_depth, &ctx->color_type,
               &ctx->interlace, nullptr, nullptr);
  if (ctx->color_type == PNG_COLOR_TYPE_PALETTE &&
      !png_get_PLTE(ctx->png, ctx->info, &ctx->palette, &ctx->num_palette)) {
    ctx->palette = nullptr;
    ctx->num_palette = 0;
  }
  return true;
}

// One decoded row (after libpng's expand/pack transforms, 16-bit samples still big-endian) to RGB,
// following PIL's raw modes and its convert("RGB").
void png_row_to_rgb(const PngContext& ctx, const uint8_t* row, uint8_t* out) {
  const size_t w = ctx.width;
  const bool b16 = ctx.bit_depth == 16;
  switch (ctx.color_type) {
    case PNG_COLOR_TYPE_GRAY:
      for (size_t x = 0; x < w; ++x) {
        // PIL opens 16-bit gray as mode "I"; "I"->"RGB" clips at 255 rather than scaling.
        const int v = b16 ? std::min(255, (row[2 * x] << 8) | row[2 * x + 1]) : row[x];
        out[3 * x] = out[3 * x + 1] = out[3 * x + 2] = static_cast<uint8_t>(v);
      }
      break;
    case PNG_COLOR_TYPE_GRAY_ALPHA: {
      const size_t step = b16 ? 4 : 2;  // "LA;16B" keeps the high byte; alpha dropped
      for (size_t x = 0; x < w; ++x) out[3 * x] = out[3 * x + 1] = out[3 * x + 2] = row[step * x];
      break;
    }
    case PNG_COLOR_TYPE_RGB:
    case PNG_COLOR_TYPE_RGB_ALPHA: {
      const size_t channels = ctx.color_type == PNG_COLOR_TYPE_RGB ? 3 : 4;
      const size_t bps = b16 ? 2 : 1;
      for (size_t x = 0; x < w; ++x)
        for (size_t c = 0; c < 3; ++c) out[3 * x + c] = row[(x * channels + c) * bps];
      break;
    }
    case PNG_COLOR_TYPE_PALETTE:
      for (size_t x = 0; x < w; ++x) {
        const int i = row[x];
        // An index past the PLTE is invalid PNG; black is as good as anything.
        if (i < ctx.num_palette) {
          out[3 * x] = ctx.palette[i].red;
          out[3 * x + 1] = ctx.palette[i].green;
          out[3 * x + 2] = ctx.palette[i].blue;
        } else {
          out[3 * x] = out[3 * x + 1] = out[3 * x + 2] = 0;
        }
      }
      break;
    default:
      break;
  }
}

size_t png_stage_setup(PngContext* ctx) {
  if (setjmp(png_jmpbuf(ctx->png))) return 0;
  if (ctx->bit_depth < 8) {
    if (ctx->color_type == PNG_COLOR_TYPE_GRAY)
      png_set_expand_gray_1_2_4_to_8(ctx->png);  // 0..3 -> 0,85,170,255 like PIL's "L;2"
    else
      png_set_packing(ctx->png);  // palette indices, one byte each
  }
  png_set_interlace_handling(ctx->png);
  png_read_update_info(ctx->png, ctx->info);
  return png_get_rowbytes(ctx->png, ctx->info);
}

bool png_stage_pixels(PngContext* ctx) {
  if (setjmp(png_jmpbuf(ctx->png))) return false;
  const size_t w3 = size_t{ctx->width} * 3;
  if (ctx->interlace == PNG_INTERLACE_NONE) {
    for (png_uint_32 y = 0; y < ctx->height; ++y) {
      png_read_row(ctx->png, ctx->raw, nullptr);
      png_row_to_rgb(*ctx, ctx->raw, ctx->out + y * w3);
    }
  } else {
    png_read_image(ctx->png, ctx->row_pointers);
    for (png_uint_32 y = 0; y < ctx->height; ++y)
      png_row_to_rgb(*ctx, ctx->row_pointers[y], ctx->out + y * w3);
  }
  return true;
}

// Chunks after the image data (an eXIf may sit there). PIL stops quietly when they are damaged,
// so a failure here keeps the pixels.
bool png_stage_end(PngContext* ctx) {
  if (setjmp(png_jmpbuf(ctx->png))) return false;
  png_read_end(ctx->png, ctx->info);
  return true;
}

RgbImage decode_png(const uint8_t* data, size_t size, const ImageLimits& limits,
                    const std::string& what) {
  PngContext ctx;
  ctx.data = data;
  ctx.size = size;
  ctx.png =
      png_create_read_struct(PNG_LIBPNG_VER_STRING, &ctx, png_error_callback, png_warning_callback);
  if (!ctx.png) fail(what, ": out of memory creating the PNG decoder");
  ctx.info = png_create_info_struct(ctx.png);
  if (!ctx.info) fail(what, ": out of memory creating the PNG decoder");

  if (!png_stage_header(&ctx)) fail(what, ": PNG header is corrupt: ", ctx.message);
  check_dimensions(ctx.width, ctx.height, limits, what, "PNG");
  const size_t rowbytes = png_stage_setup(&ctx);
  if (rowbytes == 0) fail(what, ": PNG decode failed: ", ctx.message);

  RgbImage img;
  img.width = static_cast<int>(ctx.width);
  img.height = static_cast<int>(ctx.height);
  img.rgb.resize(size_t{ctx.width} * ctx.height * 3);
  std::vector<uint8_t> raw;
  std::vector<png_bytep> rows;
  if (ctx.interlace == PNG_INTERLACE_NONE) {
    raw.resize(rowbytes);
  } else {
    raw.resize(rowbytes * ctx.height);
    rows.resize(ctx.height);
    for (size_t y = 0; y < ctx.height; ++y) rows[y] = raw.data() + y * rowbytes;
    ctx.row_pointers = rows.data();
  }
  ctx.out = img.rgb.data();
  ctx.raw = raw.data();
  ctx.rowbytes = rowbytes;
  if (!png_stage_pixels(&ctx))
    fail(what, ": PNG image data is corrupt or truncated: ", ctx.message);
  png_stage_end(&ctx);

  if (limits.apply_exif_orientation) {
    png_uint_32 exif_size = 0;
    png_bytep exif = nullptr;
    if (png_get_eXIf_1(ctx.png, ctx.info, &exif_size, &exif) && exif && exif_size > 0) {
      const int orientation = exif_orientation(exif, exif_size);
      if (orientation != 1) img = apply_exif_orientation(img, orientation);
    }
  }
  return img;
}

// ---------------------------------------------------------------------------------------------
// JPEG

struct JpegError {
  jpeg_error_mgr pub;
  std::jmp_buf jump;
  char message[JMSG_LENGTH_MAX];
};

void jpeg_error_exit_callback(j_common_ptr cinfo) {
  auto* err = reinterpret_cast<JpegError*>(cinfo->err);
  (*cinfo->err->format_message)(cinfo, err->message);
  std::longjmp(err->jump, 1);
}

// libjpeg pads a truncated stream with a fake EOI and only warns; PIL raises "image file is
// truncated" instead, so that one warning is an error here. Other warnings (extraneous bytes and
// the like) are ignored, as PIL does.
void jpeg_emit_message_callback(j_common_ptr cinfo, int msg_level) {
  if (msg_level >= 0) return;  // trace messages
  if (cinfo->err->msg_code == JWRN_JPEG_EOF) jpeg_error_exit_callback(cinfo);
  cinfo->err->num_warnings++;
}

void jpeg_output_message_callback(j_common_ptr) {}  // never print to stderr

struct JpegContext {
  jpeg_decompress_struct cinfo;
  JpegError err;
  bool created = false;
  const uint8_t* data = nullptr;
  size_t size = 0;
  // Pixel stage.
  uint8_t* out = nullptr;  // width*height*3
  uint8_t* row = nullptr;  // width*4
  bool cmyk = false;

  ~JpegContext() {
    if (created) jpeg_destroy_decompress(&cinfo);
  }
};

bool jpeg_stage_header(JpegContext* ctx) {
  ctx->cinfo.err = jpeg_std_error(&ctx->err.pub);
  ctx->err.pub.error_exit = jpeg_error_exit_callback;
  ctx->err.pub.emit_message = jpeg_emit_message_callback;
  ctx->err.pub.output_message = jpeg_output_message_callback;
  ctx->err.message[0] = '\0';
  if (setjmp(ctx->err.jump)) return false;
  jpeg_create_decompress(&ctx->cinfo);
  ctx->created = true;
  jpeg_mem_src(&ctx->cinfo, ctx->data, static_cast<unsigned long>(ctx->size));
  jpeg_save_markers(&ctx->cinfo, JPEG_APP0 + 1, 0xFFFF);
  jpeg_read_header(&ctx->cinfo, TRUE);
  return true;
}

bool jpeg_stage_pixels(JpegContext* ctx) {
  if (setjmp(ctx->err.jump)) return false;
  jpeg_decompress_struct& ci = ctx->cinfo;
  // CMYK and YCCK come out as the stored (Adobe-inverted) CMYK; everything else as RGB, which for
  // grayscale replicates the gray value exactly like PIL's "L"->"RGB". DCT method and fancy
  // upsampling stay at libjpeg's defaults, as PIL leaves them.
  ctx->cmyk = ci.jpeg_color_space == JCS_CMYK || ci.jpeg_color_space == JCS_YCCK;
  ci.out_color_space = ctx->cmyk ? JCS_CMYK : JCS_RGB;
  jpeg_start_decompress(&ci);
  const size_t w = ci.output_width;
  const int comps = ci.output_components;
  if ((ctx->cmyk && comps != 4) || (!ctx->cmyk && comps != 3)) {
    std::snprintf(ctx->err.message, sizeof(ctx->err.message), "unexpected %d output components",
                  comps);
    return false;
  }
  while (ci.output_scanline < ci.output_height) {
    const size_t y = ci.output_scanline;
    JSAMPROW rowp = ctx->row;
    if (jpeg_read_scanlines(&ci, &rowp, 1) != 1) {
      std::snprintf(ctx->err.message, sizeof(ctx->err.message), "no data for scanline %zu", y);
      return false;
    }
    uint8_t* o = ctx->out + y * w * 3;
    if (ctx->cmyk) {
      for (size_t x = 0; x < w; ++x) {
        // PIL reads JPEG CMYK as "CMYK;I" (Adobe-inverted), then cmyk2rgb from Convert.c.
        const uint8_t* p = ctx->row + 4 * x;
        const int k = 255 - p[3];
        const int nk = 255 - k;
        for (int c = 0; c < 3; ++c) {
          const int v = nk - muldiv255(255 - p[c], nk);
          o[3 * x + c] = static_cast<uint8_t>(std::clamp(v, 0, 255));
        }
      }
    } else {
      std::memcpy(o, ctx->row, w * 3);
    }
  }
  // jpeg_finish_decompress is skipped on purpose: every scanline is in, and damage after the last
  // scan (a missing EOI) does not stop PIL either. The destructor releases the decoder.
  return true;
}

int jpeg_exif_orientation(const jpeg_decompress_struct& cinfo) {
  for (jpeg_saved_marker_ptr m = cinfo.marker_list; m; m = m->next) {
    if (m->marker != JPEG_APP0 + 1 || m->data_length < 5) continue;
    // PIL keeps the first APP1 that starts with "Exif\0" and parses a TIFF after "Exif\0\0"; a
    // first Exif segment it cannot read means no orientation, whatever later segments say.
    if (std::memcmp(m->data, "Exif\0", 5) != 0) continue;
    if (m->data_length < 6 || m->data[5] != 0) return 1;
    return exif_orientation(m->data + 6, m->data_length - 6);
  }
  return 1;
}

RgbImage decode_jpeg(const uint8_t* data, size_t size, const ImageLimits& limits,
                     const std::string& what) {
  auto ctx = std::make_unique<JpegContext>();
  ctx->data = data;
  ctx->size = size;
  if (!jpeg_stage_header(ctx.get())) fail(what, ": JPEG header is corrupt: ", ctx->err.message);
  check_dimensions(ctx->cinfo.image_width, ctx->cinfo.image_height, limits, what, "JPEG");

  RgbImage img;
  img.width = static_cast<int>(ctx->cinfo.image_width);
  img.height = static_cast<int>(ctx->cinfo.image_height);
  img.rgb.resize(size_t(img.width) * img.height * 3);
  std::vector<uint8_t> row(size_t(img.width) * 4);
  ctx->out = img.rgb.data();
  ctx->row = row.data();
  if (!jpeg_stage_pixels(ctx.get()))
    fail(what, ": JPEG image data is corrupt or truncated: ", ctx->err.message);
  if (int(ctx->cinfo.output_width) != img.width || int(ctx->cinfo.output_height) != img.height)
    fail(what, ": JPEG decoder produced ", ctx->cinfo.output_width, "x", ctx->cinfo.output_height,
         " instead of the header's ", img.width, "x", img.height);
  if (limits.apply_exif_orientation) {
    const int orientation = jpeg_exif_orientation(ctx->cinfo);
    if (orientation != 1) img = apply_exif_orientation(img, orientation);
  }
  return img;
}

// ---------------------------------------------------------------------------------------------
// EXIF (TIFF) reading: just enough for IFD0's Orientation.

struct TiffReader {
  const uint8_t* p;
  size_t n;
  bool little;
  bool u16(size_t off, uint32_t* v) const {
    if (off > n || n - off < 2) return false;
    *v = little ? uint32_t(p[off]) | uint32_t(p[off + 1]) << 8
                : uint32_t(p[off]) << 8 | uint32_t(p[off + 1]);
    return true;
  }
  bool u32(size_t off, uint32_t* v) const {
    if (off > n || n - off < 4) return false;
    uint32_t a = 0, b = 0;
    u16(off, &a);
    u16(off + 2, &b);
    *v = little ? (a | b << 16) : (a << 16 | b);
    return true;
  }
};

}  // namespace

int exif_orientation(const uint8_t* tiff, size_t size) {
  if (!tiff || size < 8) return 1;
  TiffReader r{tiff, size, false};
  if (tiff[0] == 'I' && tiff[1] == 'I')
    r.little = true;
  else if (!(tiff[0] == 'M' && tiff[1] == 'M'))
    return 1;
  uint32_t magic = 0, ifd = 0, count = 0;
  if (!r.u16(2, &magic) || magic != 42 || !r.u32(4, &ifd) || !r.u16(ifd, &count)) return 1;
  for (uint32_t i = 0; i < count; ++i) {
    const size_t e = size_t{ifd} + 2 + size_t{i} * 12;
    uint32_t tag = 0, type = 0, n = 0, value = 0;
    if (!r.u16(e, &tag) || !r.u16(e + 2, &type) || !r.u32(e + 4, &n)) return 1;
    if (tag != 0x0112) continue;
    if (n != 1) return 1;  // PIL would read a tuple, which is no orientation
    if (type == 3) {       // SHORT, left-justified in the value field
      if (!r.u16(e + 8, &value)) return 1;
    } else if (type == 4) {  // LONG
      if (!r.u32(e + 8, &value)) return 1;
    } else {
      return 1;
    }
    return (value >= 1 && value <= 8) ? static_cast<int>(value) : 1;
  }
  return 1;
}

RgbImage apply_exif_orientation(const RgbImage& img, int orientation) {
  if (orientation < 2 || orientation > 8) return img;
  const int w = img.width, h = img.height;
  const bool swap = orientation >= 5;
  RgbImage out;
  out.width = swap ? h : w;
  out.height = swap ? w : h;
  out.rgb.resize(img.rgb.size());
  for (int y = 0; y < out.height; ++y) {
    for (int x = 0; x < out.width; ++x) {
      // Source pixel for output (x, y); the names are PIL's Image.Transpose members.
      int sx = x, sy = y;
      switch (orientation) {
        case 2:  // FLIP_LEFT_RIGHT
          sx = w - 1 - x;
          break;
        case 3:  // ROTATE_180
          sx = w - 1 - x;
          sy = h - 1 - y;
          break;
        case 4:  // FLIP_TOP_BOTTOM
          sy = h - 1 - y;
          break;
        case 5:  // TRANSPOSE
          sx = y;
          sy = x;
          break;
        case 6:  // ROTATE_270: a clockwise quarter turn
          sx = y;
          sy = h - 1 - x;
          break;
        case 7:  // TRANSVERSE
          sx = w - 1 - y;
          sy = h - 1 - x;
          break;
        case 8:  // ROTATE_90: a counter-clockwise quarter turn
          sx = w - 1 - y;
          sy = x;
          break;
        default:
          break;
      }
      const uint8_t* s = &img.rgb[(size_t(sy) * w + sx) * 3];
      uint8_t* d = &out.rgb[(size_t(y) * out.width + x) * 3];
      d[0] = s[0];
      d[1] = s[1];
      d[2] = s[2];
    }
  }
  return out;
}

ImageFormat detect_image_format(const uint8_t* data, size_t size) {
  if (data && size >= 8 && std::memcmp(data, kPngMagic, 8) == 0) return ImageFormat::kPng;
  if (data && size >= 3 && data[0] == 0xFF && data[1] == 0xD8 && data[2] == 0xFF)
    return ImageFormat::kJpeg;
  return ImageFormat::kUnknown;
}

RgbImage decode_image(const uint8_t* data, size_t size, const ImageLimits& limits,
                      const std::string& what) {
  if (!data || size == 0) fail(what, ": image data is empty (0 bytes)");
  switch (detect_image_format(data, size)) {
    case ImageFormat::kPng:
      return decode_png(data, size, limits, what);
    case ImageFormat::kJpeg:
      return decode_jpeg(data, size, limits, what);
    case ImageFormat::kUnknown:
      break;
  }
  fail(what,
       ": unrecognised image format (first bytes do not match PNG or JPEG); supported "
       "formats are PNG and JPEG, convert the image to one of them");
}

RgbImage decode_image_file(const std::string& path, const ImageLimits& limits) {
  MappedFile file(path);
  return decode_image(file.data(), file.size(), limits, path);
}

}  // namespace gemstage
