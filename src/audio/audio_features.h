// The Gemma 4 log-mel feature extractor (Gemma4AudioFeatureExtractor, one clip), exactly as
// docs/gemma4-audio.md "Feature extractor" describes it:
//   pad the waveform with zeros to a multiple of 128 samples; prepend 160 zeros (semicausal);
//   frames of 320 samples every 160 (the unfold takes 321, the last one unused); periodic Hann
//   window (float32 product); |rfft| with n = 512 (magnitude, not power); HTK mel bank of 128
//   triangles over 0..8 kHz without normalisation (filter 0 is empty); log(mel + 1e-3), natural,
//   in float64, cast to float32. Frame i is valid iff original sample 160·i + 160 exists; invalid
//   frames are zeroed.
// The FFT is FFTW's double-precision real transform, so the spectrum matches the reference's
// float64 FFT (legacy numpy) to rounding.
#pragma once

#include <cstdint>
#include <span>
#include <vector>

namespace gemstage {

inline constexpr int kMelBins = 128;
inline constexpr int kMelFrameLength = 320;
inline constexpr int kMelHop = 160;
inline constexpr int kMelFftLength = 512;
inline constexpr int kMelPadMultiple = 128;
// processor_config.json audio_seq_length: soft tokens per clip at most.
inline constexpr int64_t kAudioMaxSoftTokens = 750;

struct LogMelFeatures {
  int64_t frames = 0;         // F, every frame of the padded clip
  int64_t valid_frames = 0;   // nv
  std::vector<float> values;  // [F, 128], invalid frames zero
  std::vector<uint8_t> mask;  // [F], 1 = valid
};

// Frames (F) and valid frames (nv) of a clip of n_samples; nv may be <= 0 for a clip too short.
int64_t mel_frame_count(int64_t n_samples);
int64_t mel_valid_frame_count(int64_t n_samples);

// The soft-token count of a clip whose feature mask has nv valid frames:
// ceil(ceil(nv / 2) / 2), capped at 750 (Gemma4Processor). Equals the tower's valid rows.
int64_t audio_soft_tokens_for_frames(int64_t valid_frames);
int64_t audio_soft_tokens_for_samples(int64_t n_samples);

// The HTK mel filter bank [257, 128] (bins × filters), float64, as transformers'
// mel_filter_bank(257, 128, 0, 8000, 16000, norm=None, mel_scale="htk").
std::vector<double> htk_mel_filter_bank();

// Throws (naming `what`) for a clip with no valid frame (shorter than 161 samples) or longer
// than 30 s.
LogMelFeatures log_mel_features(std::span<const float> waveform, const char* what = "audio");

// Direct DFT magnitudes |X_k|, k < n/2 + 1, of a real frame of n samples (test reference for the
// FFT path).
std::vector<double> dft_magnitude_reference(std::span<const double> frame);
// The FFT path's magnitudes of the same frame zero-padded to n.
std::vector<double> fft_magnitude(std::span<const double> frame, int n);

}  // namespace gemstage
