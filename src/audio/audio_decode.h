// Audio file decoding to the mono float32 16 kHz waveform the Gemma 4 feature extractor takes,
// the way Hugging Face loads a clip (docs/gemma4-audio.md, "Loading"):
//  - samples become float32 in [-1, 1) by libsndfile's normalisation, which is the scale
//    soundfile/librosa and FFmpeg use (PCM16 × 1/32768, PCM24 × 1/2^23, PCM32 × 1/2^31; float
//    files as stored);
//  - several channels become mono through the float32 mean over channels (librosa.to_mono);
//  - a clip at another rate is resampled to 16 kHz (libsamplerate, best sinc quality). HF uses
//    soxr 'HQ' or FFmpeg there, so resampled clips are close to, not bit-equal with, HF's;
//  - clips longer than the processor's 30 s window are refused (HF would truncate silently and
//    lose the rest; the caller should split the recording).
// Formats: whatever libsndfile reads (WAV PCM 8/16/24/32 and float, FLAC, OGG/Vorbis, Opus, MP3
// on Debian's build). Every error names the file or request part.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>
#include <vector>

namespace gemstage {

inline constexpr int kAudioSampleRate = 16000;
// Gemma4AudioFeatureExtractor max_length: 30 s at 16 kHz.
inline constexpr int64_t kAudioMaxSamples = 480000;

struct AudioClip {
  std::vector<float> samples;  // mono, kAudioSampleRate
  int source_rate = 0;         // the file's sample rate
  int source_channels = 0;     // the file's channel count
  std::string format;          // libsndfile's name of the container/encoding, for messages
  double seconds() const { return static_cast<double>(samples.size()) / kAudioSampleRate; }
};

struct AudioLimits {
  double max_seconds = 30.0;  // longer clips are refused before any sample is read
  int max_channels = 64;
  int max_rate = 768000;
};

// Decode an audio file held in memory. `what` names it in errors ("request audio 1").
AudioClip decode_audio(const uint8_t* data, size_t size, const std::string& what,
                       const AudioLimits& limits = {});
AudioClip decode_audio_file(const std::string& path, const AudioLimits& limits = {});

// Mono float32 mean over channels of interleaved frames, summed in channel order then divided
// (numpy's float32 mean over axis 0 of [C, L]).
std::vector<float> mix_to_mono(const float* interleaved, int64_t frames, int channels);

// Resamples mono audio from `rate` to kAudioSampleRate (a copy when already there).
std::vector<float> resample_to_16k(const std::vector<float>& mono, int rate,
                                   const std::string& what);

}  // namespace gemstage
