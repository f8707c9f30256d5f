// Image file decoding (PNG, JPEG) to 8-bit interleaved RGB, the way Hugging Face loads an image
// before its processor sees it.
//
// What "the way HF loads it" means, from the transformers source:
//  - `image_utils.load_image` (used for paths, URLs and base64 strings, including the images in a
//    chat template) opens the file with PIL, applies `PIL.ImageOps.exif_transpose`, then calls
//    `image.convert("RGB")`. So EXIF orientation IS applied by default here.
//  - The Gemma 4 processors (both backends, `image_processing_backends.py`) call
//    `image_transforms.convert_to_rgb`, which is a plain `image.convert("RGB")` for non-RGB modes.
//    That is NOT the white-background compositing of the idefics2/mllama helper of the same name:
//    PIL's RGBA/LA/P→RGB conversion drops the alpha channel and keeps the colour values as stored.
//    So alpha is dropped, never composited, here too.
//  - PIL's own decoders decide the 8-bit values: 16-bit RGB(A)/LA PNG samples keep their high
//    byte; 16-bit grayscale PNG opens as mode "I" and "I"→"RGB" CLIPS to 255 (so 0x0100 is white,
//    not 1); 1/2/4-bit gray scales to 0..255; palette entries are looked up and tRNS is ignored;
//    CMYK/YCCK JPEG is read as Adobe-inverted CMYK and converted with PIL's cmyk2rgb formula.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace gemstage {

// 8-bit RGB, interleaved, row-major: rgb[(y * width + x) * 3 + c].
struct RgbImage {
  int width = 0;
  int height = 0;
  std::vector<uint8_t> rgb;
};

struct ImageLimits {
  // Decompression-bomb guard: checked against the header's width*height before any pixel buffer
  // is allocated. 64 megapixels is ~2.7x a 24 MP camera photo and 192 MiB of RGB.
  int64_t max_pixels = int64_t{64} * 1000 * 1000;
  // HF's load_image applies the EXIF Orientation tag (PIL.ImageOps.exif_transpose).
  bool apply_exif_orientation = true;
};

enum class ImageFormat { kUnknown, kPng, kJpeg };

// By magic bytes only; never by file name.
ImageFormat detect_image_format(const uint8_t* data, size_t size);

// Decode a PNG or JPEG held in memory. `what` names the source in error messages (a path, or
// "request image 2"). Throws gemstage::Error for unknown formats, corrupt or truncated data, zero
// sizes and images over `limits.max_pixels`.
RgbImage decode_image(const uint8_t* data, size_t size, const ImageLimits& limits,
                      const std::string& what);
RgbImage decode_image_file(const std::string& path, const ImageLimits& limits = {});

// EXIF support, exposed for tests. `tiff` is the EXIF payload after the "Exif\0\0" header (a TIFF
// structure). Returns the Orientation tag (1..8) of IFD0, or 1 when absent or unreadable: PIL's
// exif_transpose also leaves an image alone when it cannot read a valid orientation.
int exif_orientation(const uint8_t* tiff, size_t size);
// Applies an EXIF orientation (1..8) like PIL.ImageOps.exif_transpose; 1 returns a copy.
RgbImage apply_exif_orientation(const RgbImage& img, int orientation);

}  // namespace gemstage
