// Video demuxing and decoding (FFmpeg's libavformat/libavcodec/libswscale through
// video/video_decode.h), frame sampling and the per-frame preprocessing of whatever decodes.
// FFmpeg itself is Debian's uninstrumented build: ASan and UBSan watch our code and the buffers
// we hand FFmpeg, and a crash inside FFmpeg still ends the run as a finding.
extern "C" {
#include <libavutil/log.h>
}

#include "fuzz_util.h"
#include "video/video_decode.h"
#include "video/video_processor.h"

using namespace gemstage;

extern "C" int LLVMFuzzerInitialize(int*, char***) {
  // FFmpeg logs every damaged packet to stderr; libFuzzer's output is what matters here.
  av_log_set_level(AV_LOG_QUIET);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  // 2-pixel patches and no pooling (as fuzz_image.cc): the same resize and patch arithmetic at a
  // fraction of the cost, so a run spends its time in the demuxer and decoder.
  static const VideoProcessorConfig cfg = [] {
    VideoProcessorConfig c;
    c.frame.patch_size = 2;
    c.frame.pooling_kernel_size = 1;
    c.frame.max_soft_tokens = 70;
    c.num_frames = 4;
    return c;
  }();
  VideoLimits limits;
  // Headers claiming more are refused before a frame is allocated, the limits worth fuzzing.
  limits.max_frame_pixels = 1 << 16;
  limits.max_stream_frames = 4096;
  limits.decoder_threads = 1;
  fuzz::expect_error_or_success([&] {
    auto decoder = VideoDecoder::open_memory({data, size}, "input video", limits);
    (void)process_video(*decoder, cfg);
  });
  return 0;
}
