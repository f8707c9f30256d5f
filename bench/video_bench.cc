// Times the video path on one file (not a test): open + packet scan, seek-and-decode of the
// sampled frames, and their preprocessing, as `gemstage generate --video` runs them.
//   build/gemstage_video_bench FILE [NUM_FRAMES] [BUDGET] [REPEATS]
#include <chrono>
#include <cstdlib>
#include <iostream>
#include <string>

#include "core/error.h"
#include "video/video_decode.h"
#include "video/video_processor.h"

using namespace gemstage;

namespace {

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2 || argc > 5) {
    std::cerr << "usage: " << argv[0] << " FILE [NUM_FRAMES=32] [BUDGET=70] [REPEATS=3]\n";
    return 2;
  }
  try {
    VideoProcessorConfig cfg;
    if (argc > 2) cfg.num_frames = std::atoi(argv[2]);
    if (argc > 3) cfg.frame.max_soft_tokens = std::atoi(argv[3]);
    const int repeats = argc > 4 ? std::atoi(argv[4]) : 3;
    cfg.validate("arguments");
    for (int r = 0; r < repeats; ++r) {
      const auto t0 = std::chrono::steady_clock::now();
      auto decoder = VideoDecoder::open_file(argv[1]);
      const double t_open = seconds_since(t0);
      const VideoInfo& info = decoder->info();
      const auto t1 = std::chrono::steady_clock::now();
      VideoDecodeStats stats;
      const ProcessedVideo v = process_video(*decoder, cfg, &stats);
      const double t_frames = seconds_since(t1);
      if (r == 0)
        std::cout << argv[1] << ": " << info.container << " " << info.codec << " " << info.width
                  << "x" << info.height << ", " << info.total_frames << " frames, " << info.fps
                  << " fps, " << info.duration_seconds << " s; " << v.num_frames
                  << " frames sampled -> " << v.resized_w << "x" << v.resized_h << ", "
                  << v.num_soft_tokens_per_frame << " soft tokens each\n";
      std::cout << "run " << r + 1 << ": open+scan " << t_open << " s, seek+decode+convert+"
                << "preprocess " << t_frames << " s, total " << t_open + t_frames << " s ("
                << stats.seeks << " seeks, " << stats.packets_decoded << " packets decoded, "
                << stats.frames_decoded << " frames decoded, " << stats.frames_converted
                << " converted)\n";
    }
  } catch (const Error& e) {
    std::cerr << "error: " << e.what() << "\n";
    return 1;
  }
  return 0;
}
