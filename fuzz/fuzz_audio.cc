// Audio decoding (libsndfile through audio/audio_decode.h: WAV, FLAC, OGG, MP3 ...), mix-down,
// resampling, and the log-mel features of whatever decodes.
#include "audio/audio_decode.h"
#include "audio/audio_features.h"
#include "fuzz_util.h"

using namespace gemstage;

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  AudioLimits limits;
  // 2 s keeps each run fast under ASan; a header claiming more is refused before its samples are
  // read, which is the limit worth fuzzing.
  limits.max_seconds = 2.0;
  fuzz::expect_error_or_success([&] {
    const AudioClip clip = decode_audio(data, size, "input audio", limits);
    (void)log_mel_features(clip.samples, "input audio");
  });
  return 0;
}
